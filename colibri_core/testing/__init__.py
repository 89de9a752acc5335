"""The conformance kit: the battery every architecture plugin must pass against `transformers`.

A plugin's whole suite is one subclass (fsspec / transformers ModelTesterMixin style)::

    from transformers import OlmoeConfig
    from colibri_core.testing import ConformanceSuite

    class TestTinyOlmoe(ConformanceSuite):
        hf_config = OlmoeConfig(vocab_size=256, hidden_size=64, ...)

It builds the tiny random model (seeded; every parameter initialised to a constant is perturbed, or
the test would prove nothing about it), saves it, converts it at f32, int8 and int4 and checks:

- greedy: the whole continuation (``new_tokens``) identical to `transformers`' — at f32 against the
  model itself, at int8/int4 against the oracle loaded with `colibri_core.dequantize(container)`.
  A differing token is accepted as a tie only where the oracle's own top-1/top-2 gap is below
  ``rel_tol * max|logit|``; the comparison then continues teacher-forced from the oracle's token,
  and every tie is reported (printed, and a `checks.TieWarning`);
- teacher-forced logits within ``rel_tol * max|logit|``; a failure names the first layer and
  sub-block (attention, router input, router ids or weights, experts) where colibri's
  intermediates leave the oracle's (`colibri_core.testing.trace`, fed by the core's named-
  intermediates hook `colibri_core.probe.record`: the MoE block records its input, routing and
  output, and each plugin's forward records ``record(i, l_out=h)`` after each layer);
- placement invariance: 1 expert slot per layer, a few, everything resident give bit-identical
  logits and identical tokens; so do the router lookahead on and off (1 and 2 slots);
- the lookahead: it is active (at 1 slot a generation issues prefetches; the recall is printed),
  and each layer's declared predictor applied to its own residual stream reproduces its routing;
- the plugin contract: `routers()` == `layout.moe_layers`, the forward pass runs exactly the MoE
  layers transformers routes in (a draft-only layer such as GLM-5.2's MTP lies beyond the
  decoder stack, and no lookahead points at it); `new_state()` is a `kv.State` whose
  ``arrays()`` / ``load_arrays()`` round trip after a prefill continues token-identically;
- released-style config.json variants (``config_variants = {name: edits}``, e.g. a top-level
  ``rope_theta`` with ``"rope_scaling": null``) parse to the same config and layout, are the same
  model to `transformers`, and convert and load to bit-identical logits;
- the container round trip (per-expert and fused checkpoints), and that a tensor missing from or
  left over in the checkpoint is a conversion error;
- persistent sessions (`colibri_core.testing.sessions`): a save torn at any point or killed with
  ``kill -9`` resumes from the last whole turn with the uninterrupted run's tokens, prefilling
  only the new tokens; another model's or a damaged file is refused; a failed forward leaves the
  session intact;
- planning: `colibri_core.planning` from config.json alone predicts the container's bytes exactly
  (the model class implements ``resident_shapes`` and ``state_floats_per_token``), and
  ``kv_cache_floats_per_token`` is exactly what a float16 KV cache halves, measured on a session.

Every failure message starts with the check's name and says the quantisation, the layer and the
position where they apply. The checks are plain functions in `colibri_core.testing.checks` (a test
can run them on a plugin of its own: tests/test_conformance_kit.py breaks OLMoE on purpose); the
oracle's work is shared by every check of a suite class (`colibri_core.testing.oracle.Oracle`),
and a conversion that fails is reported as its own error by every check that needs it.

A plugin that cannot support a check says so in ``unsupported = {"check_name": "why"}``: the check
is then reported as skipped with that reason, never silently dropped.
"""
from .conformance import DROP, ConformanceSuite

__all__ = ["DROP", "ConformanceSuite"]
