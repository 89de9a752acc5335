"""The conformance kit: the battery every architecture plugin must pass against `transformers`.

A plugin's whole suite is one subclass (fsspec / transformers ModelTesterMixin style)::

    from transformers import OlmoeConfig
    from colibri_core.testing import ConformanceSuite

    class TestTinyOlmoe(ConformanceSuite):
        hf_config = OlmoeConfig(vocab_size=256, hidden_size=64, ...)

It builds the tiny random model (seeded; every parameter initialised to a constant is perturbed, or
the test would prove nothing about it), saves it, converts it at f32, int8 and int4 and checks:

- greedy tokens identical to `transformers` and teacher-forced logits within
  ``1e-4 * max|logit|`` — at f32 against the model itself, at int8/int4 against the oracle loaded
  with `colibri_core.dequantize(container)`;
- placement invariance: 1 expert slot per layer, a few, everything resident give bit-identical
  logits and identical tokens;
- the container round trip (per-expert and fused checkpoints), and that a tensor missing from or
  left over in the checkpoint is a conversion error;
- persistent sessions (`colibri_core.testing.sessions`): a save torn at any point or killed with
  ``kill -9`` resumes from the last whole turn with the uninterrupted run's tokens, prefilling
  only the new tokens; another model's or a damaged file is refused;
- planning: `colibri_core.planning` from config.json alone predicts the container's bytes exactly
  (the model class implements ``resident_shapes`` and ``state_floats_per_token``).

A plugin that cannot support a check says so in ``unsupported = {"check_name": "why"}``: the check
is then reported as skipped with that reason, never silently dropped. Greedy mismatches where the
oracle's own top-1/top-2 gap is below the tolerance are reported as ties, not hidden.
"""
from .conformance import ConformanceSuite

__all__ = ["ConformanceSuite"]
