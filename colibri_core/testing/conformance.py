"""The conformance battery (see the package docstring). Needs the test extra: torch, transformers."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from ..convert import read_config
from ..errors import ColibriError
from . import checks
from .oracle import DROP, Oracle
from .sessions import check_failed_forward, check_kill_during_save, check_torn_saves

__all__ = ["ConformanceSuite", "DROP", "Oracle"]

QUANTS = ("f32", "int8", "int4")
# int8's checks are in the system tier (`-m "not system"` leaves them out): f32 (exact) and int4 (the
# container the placement and session checks use too) are what a quick run checks
QUANT_PARAMS = [pytest.param(q, marks=pytest.mark.system) if q == "int8" else q for q in QUANTS]

# the names `unsupported` may give: every check a test of the suite runs through `_check`
CHECKS = frozenset({*(f"{kind}_{q}" for kind in ("greedy", "logits") for q in QUANTS), "config_variants",
                    "container_round_trip", "kv_cache_floats", "leftover_tensor", "lookahead_active",
                    "lookahead_predicts_routing", "missing_tensor", "moe_layers", "one_forward_is_pieces", "batch_equals_solo",
                    "placement_invariance", "plan", "prefetch_invisible", "prefix_cache", "session",
                    "short_forward_is_decode_exact", "state_round_trip"})


class ConformanceSuite:
    """Subclass and set `hf_config` (a tiny `transformers` config of your architecture)."""

    hf_config = None  # transformers.PretrainedConfig: tiny (hidden ~64, a few layers, 4-16 experts)
    seed = 0
    perturb_std = 0.1  # noise added to parameters that initialise to a constant
    prompt_tokens = 12
    new_tokens = 32
    rel_tol = 1e-4  # logits within rel_tol * max|logit|
    unsupported: dict[str, str] = {}  # check name -> why this plugin cannot support it
    # released-style config.json variants the plugin must read as the same model: name -> edits to
    # the oracle's config.json (a dict of top-level keys, DROP to remove one; or a callable
    # config -> config). See test_config_variant.
    config_variants: dict = {}
    config_edits: dict = {}  # edits to the saved checkpoint's config.json itself (rarely needed)

    @classmethod
    def prepare_model(cls, model) -> None:
        """Edit the tiny `transformers` model (under no_grad, after the constant-initialised parameters
        are perturbed, before it is saved): e.g. fill a buffer HF initialises to a constant, such as
        DeepSeek V4's hash table `tid2eid` (zeros: every token would pick expert 0). Default: nothing."""

    @pytest.fixture(scope="class")
    @classmethod
    def oracle(cls, tmp_path_factory) -> Oracle:
        if cls.hf_config is None:
            pytest.fail(f"{cls.__name__} must set hf_config")
        return Oracle(cls, tmp_path_factory.mktemp(cls.__name__))

    def pytest_generate_tests(self, metafunc):
        """One test_config_variant per declared variant (a skip when there is none)."""
        if "config_variant" in metafunc.fixturenames:
            none = pytest.mark.skip(reason=f"{type(self).__name__} declares no config_variants")
            metafunc.parametrize("config_variant", list(self.config_variants) or [pytest.param(None, marks=none)])

    def _check(self, name: str) -> None:
        assert name in CHECKS, f"the kit's own check {name!r} is missing from CHECKS"
        unknown = sorted(set(self.unsupported) - CHECKS)
        if unknown:  # a misspelt name would leave the check it meant running, unnoticed
            pytest.fail(f"{type(self).__name__}.unsupported names {unknown[0]!r}, which is no check (the checks: "
                        f"{', '.join(sorted(CHECKS))})", pytrace=False)
        if name in self.unsupported:
            pytest.skip(reason=f"{type(self).__name__} declares {name} unsupported: {self.unsupported[name]}")

    # ---- agreement with the oracle ----------------------------------------------------------
    @pytest.mark.parametrize("q", QUANT_PARAMS)
    def test_greedy_tokens(self, oracle: Oracle, q: str):
        """The whole greedy continuation (new_tokens) equals transformers'. A differing token is a tie
        only where the oracle's own top-1/top-2 gap is below rel_tol * max|logit|; the comparison then
        continues teacher-forced from the oracle's token, and every tie is reported (TieWarning)."""
        self._check(f"greedy_{q}")
        checks.check_greedy(oracle, q, self.new_tokens, self.rel_tol)

    @pytest.mark.parametrize("q", QUANT_PARAMS)
    def test_logits(self, oracle: Oracle, q: str):
        """Teacher-forced logits within rel_tol * max|logit| of transformers; a failure names the first
        layer and sub-block (attention, router input, router, experts) where colibri diverges."""
        self._check(f"logits_{q}")
        checks.check_logits(oracle, q, oracle.logits_ids, self.rel_tol)

    # ---- placement and the router lookahead --------------------------------------------------
    @pytest.mark.parametrize("q", ("f32", "int4"))
    def test_placement_invariance(self, oracle: Oracle, q: str):
        """1 slot per layer, a few, all resident: bit-identical logits, identical tokens."""
        self._check("placement_invariance")
        n_experts = oracle.layout.n_experts
        runs = {slots: oracle.engine_run(q, slots) for slots in sorted({1, max(1, n_experts // 3), n_experts})}
        base = runs[n_experts]
        for slots, run in runs.items():
            what = f"placement_invariance_{q}: with {slots} slot(s) per layer"
            assert np.array_equal(run["logits"], base["logits"]), f"{what}, logits differ from all-resident"
            assert run["tokens"] == base["tokens"], f"{what}, tokens differ from all-resident"
        assert runs[1]["stats"]["expert_misses"] > base["stats"]["expert_misses"], "1 slot per layer should miss more"

    @pytest.mark.parametrize("q", ("f32", "int4"))
    def test_prefetch_invisible(self, oracle: Oracle, q: str):
        """Router lookahead on or off, at 1 and 2 slots per layer: bit-identical logits, identical tokens."""
        self._check("prefetch_invisible")
        checks.check_prefetch_invisible(oracle, q)

    def test_lookahead_active(self, oracle: Oracle):
        """At 1 slot per layer a generation issues prefetches; their recall is printed."""
        self._check("lookahead_active")
        checks.check_lookahead_active(oracle, "int4")
        if not oracle.engine_run("int4", 1)["lookahead"]:
            pytest.skip(reason="no MoE layer has a lookahead target (a single MoE layer?)")

    def test_lookahead_predicts_routing(self, oracle: Oracle):
        """Each MoE layer's declared predictor, applied to its own residual stream, gives the ids it routed."""
        self._check("lookahead_predicts_routing")
        checks.check_lookahead_predicts_routing(oracle, oracle.logits_ids)

    # ---- the plugin contract -----------------------------------------------------------------
    def test_moe_layers(self, oracle: Oracle):
        """routers() == layout.moe_layers; the forward pass runs exactly transformers' MoE layers (a layer
        only a draft head runs lies beyond the decoder stack); the lookahead targets layers run later."""
        self._check("moe_layers")
        checks.check_moe_layers(oracle, oracle.logits_ids)

    def test_state_round_trip(self, oracle: Oracle):
        """new_state() is a kv.State; arrays()/load_arrays() after a prefill continue token-identically."""
        self._check("state_round_trip")
        checks.check_state_round_trip(oracle)

    def test_short_forward_is_decode_exact(self, oracle: Oracle):
        """A forward of a few tokens (a verified draft) = those tokens fed one by one, bit for bit."""
        self._check("short_forward_is_decode_exact")
        checks.check_short_forward_is_decode_exact(oracle)

    def test_one_forward_is_pieces(self, oracle: Oracle):
        """One forward over a long prompt = forwards cut at the multiples of the prefill chunk, bit for
        bit: logits and state (the prefill runs in one forward, the prefix cache restores at a cut)."""
        self._check("one_forward_is_pieces")
        checks.check_one_forward_is_pieces(oracle)

    def test_prefix_cache_is_invisible(self, oracle: Oracle):
        """A prompt served from the prefix cache (rows cut, fixed-size states restored at a boundary,
        shorter, longer and diverging prompts) = a cold prefill: tokens and logits, bit for bit."""
        self._check("prefix_cache")
        checks.check_prefix_cache_is_invisible(oracle.container("int4"), self.hf_config.vocab_size)

    def test_batch_equals_solo(self, oracle: Oracle):
        """Three generations decoded together (different prompt lengths, samplers, one joining later,
        a long prompt prefilled in chunks between the others' steps) = each alone: tokens and final
        states, bit for bit."""
        self._check("batch_equals_solo")
        checks.check_batch_equals_solo(oracle.container("int4"), self.hf_config.vocab_size)

    def test_config_variant(self, oracle: Oracle, config_variant: str, tmp_path):
        """A released-style config.json (`config_variants`) is read as the same model: same parsed config
        and layout, same transformers logits, and it converts and loads to bit-identical logits."""
        self._check("config_variants")
        edits = self.config_variants[config_variant]
        checks.check_config_variant(oracle, config_variant, edits, tmp_path, self.rel_tol)

    # ---- persistent sessions -----------------------------------------------------------------
    def test_session_torn_saves(self, oracle: Oracle, tmp_path):
        """A save cut at any byte loads as the turn before; resuming continues token-identically,
        prefilling only the new tokens; another model's or a damaged file is refused, never half-used."""
        self._check("session")
        check_torn_saves(oracle.container("int4"), tmp_path, oracle.prompt, self.hf_config.vocab_size)

    @pytest.mark.system
    def test_session_kill_during_save(self, oracle: Oracle, tmp_path):
        """kill -9 in the middle of a save: the restart resumes from the last whole turn, token-identical."""
        self._check("session")
        check_kill_during_save(oracle.container("int4"), tmp_path, oracle.prompt, self.hf_config.vocab_size)

    def test_failed_forward_leaves_session_intact(self, oracle: Oracle, tmp_path):
        """A read error or Ctrl-C in the middle of a forward leaves the session as it was: continuing
        gives the uninterrupted run's tokens; a persistent session never saves the failed turn."""
        self._check("session")
        check_failed_forward(oracle.container("int4"), tmp_path, oracle.prompt, self.hf_config.vocab_size)

    # ---- planning ------------------------------------------------------------------------------
    @pytest.mark.parametrize("q", ("f32", "int4"))
    def test_plan_matches_container(self, oracle: Oracle, q: str):
        """`planning.plan` from config.json alone (the model class's resident_shapes and the layout)
        predicts exactly the bytes the converter wrote."""
        self._check("plan")
        from ..planning import measured, plan_config

        try:
            p = plan_config(read_config(oracle.checkpoint), q)
        except NotImplementedError:
            pytest.fail(f"{type(self).__name__}: the model class must implement resident_shapes and "
                        "state_floats_per_token (see colibri_core.model.MoEModel)")
        got = measured(oracle.container(q))
        differ = {k: (p[k], v) for k, v in got.items() if p[k] != v}
        assert not differ, (f"plan_matches_container at {q}: `colibri plan` (resident_shapes, state_floats_per_token) "
                            f"and the converted container differ, (planned, measured): {differ}")

    def test_kv_cache_floats(self, oracle: Oracle):
        """`kv_cache_floats_per_token` is the part of the state a float16 KV cache halves: measured on
        a session's state after the prompt, under both cache types."""
        self._check("kv_cache_floats")
        checks.check_kv_cache_floats(oracle)

    # ---- the container -----------------------------------------------------------------------
    @pytest.mark.parametrize("q", QUANT_PARAMS)
    def test_container_round_trip(self, oracle: Oracle, q: str, tmp_path):
        """dequantize(container) == quantise-dequantise of every source tensor, for each checkpoint form
        the layout reads (per-expert, fused, or fused only); the forms' containers compute the same."""
        self._check("container_round_trip")
        checks.check_container_round_trip(oracle, q, tmp_path)

    def test_missing_tensor_is_an_error(self, oracle: Oracle, tmp_path):
        self._check("missing_tensor")
        self._edit_checkpoint_and_expect(oracle, tmp_path, drop=oracle.layout.resident[-1], add=None)

    def test_leftover_tensor_is_an_error(self, oracle: Oracle, tmp_path):
        self._check("leftover_tensor")
        self._edit_checkpoint_and_expect(oracle, tmp_path, drop=None, add="model.layers.0.mlp.unexpected.weight")

    @staticmethod
    def _edit_checkpoint_and_expect(oracle: Oracle, tmp_path: Path, drop: str | None, add: str | None):
        from safetensors.numpy import load_file, save_file

        src = tmp_path / "edited"
        shutil.copytree(oracle.checkpoint, src)
        (f,) = src.glob("*.safetensors")
        tensors = load_file(str(f))
        if drop:
            del tensors[drop]
        if add:
            tensors[add] = np.zeros((2, 2), np.float32)
        save_file(tensors, str(f), metadata={"format": "pt"})
        with pytest.raises(ColibriError, match=drop or add):
            oracle.convert(src, tmp_path / "out", "int8")
        assert not (tmp_path / "out").exists(), "a failed conversion left a container behind"
