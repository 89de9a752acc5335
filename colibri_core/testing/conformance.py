"""The conformance battery (see the package docstring). Needs the test extra: torch, transformers."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from .. import plugins, quant
from ..container import Container, dequantize
from ..convert import convert_checkpoint, read_config
from ..engine import load
from ..errors import ColibriError
from .sessions import check_failed_forward, check_kill_during_save, check_torn_saves

QUANTS = ("f32", "int8", "int4")


class Oracle:
    """A tiny random `transformers` model, its checkpoint on disk, and its containers."""

    def __init__(self, suite: type[ConformanceSuite], root: Path):
        import torch
        from transformers import AutoModelForCausalLM

        self.suite, self.root = suite, root
        torch.manual_seed(suite.seed)
        model = AutoModelForCausalLM.from_config(suite.hf_config, attn_implementation="eager", dtype=torch.float32)
        gen = torch.Generator().manual_seed(suite.seed + 1)
        with torch.no_grad():
            for _, p in model.named_parameters():
                flat = p.reshape(-1)
                if bool((flat == flat[0]).all()):  # a constant initialisation hides code paths: perturb it
                    p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * suite.perturb_std)
        self.model = model.eval()
        self.checkpoint = root / "hf"
        model.save_pretrained(self.checkpoint)
        self.fused_checkpoint = root / "hf-fused"
        model.save_pretrained(self.fused_checkpoint, save_original_format=False)
        registry = plugins.registry()
        config = read_config(self.checkpoint)
        model_cls = registry.model_class(registry.resolve(config))
        self.layout = model_cls.layout(model_cls.parse_config(config))
        rng = np.random.default_rng(suite.seed)
        self.prompt = [int(i) for i in rng.integers(0, suite.hf_config.vocab_size, suite.prompt_tokens)]
        self._containers: dict[str, Path] = {}
        self._oracles = {"f32": self.model}

    def convert(self, src: Path, dst: Path, q: str) -> None:
        convert_checkpoint(src, dst, q, progress=False)

    def container(self, q: str) -> Path:
        if q not in self._containers:
            self.convert(self.checkpoint, self.root / f"colibri-{q}", q)
            self._containers[q] = self.root / f"colibri-{q}"
        return self._containers[q]

    def oracle(self, q: str):
        """The `transformers` model the engine must match at quantisation q."""
        if q not in self._oracles:
            import torch
            from safetensors.numpy import save_file
            from transformers import AutoModelForCausalLM

            d = self.root / f"oracle-{q}"
            d.mkdir()
            shutil.copy(self.checkpoint / "config.json", d)
            save_file(dequantize(self.container(q)), str(d / "model.safetensors"))
            self._oracles[q] = AutoModelForCausalLM.from_pretrained(
                d, attn_implementation="eager", dtype=torch.float32).eval()
        return self._oracles[q]

    def hf_greedy(self, q: str, n: int) -> list[int]:
        import torch

        with torch.no_grad():
            out = self.oracle(q).generate(torch.tensor([self.prompt]), max_new_tokens=n, min_new_tokens=n,
                                          do_sample=False, pad_token_id=0)
        return out[0, len(self.prompt):].tolist()

    def hf_logits(self, q: str, ids: list[int]) -> np.ndarray:
        import torch

        with torch.no_grad():
            return self.oracle(q)(torch.tensor([ids])).logits[0].float().numpy()


class ConformanceSuite:
    """Subclass and set `hf_config` (a tiny `transformers` config of your architecture)."""

    hf_config = None  # transformers.PretrainedConfig: tiny (hidden ~64, a few layers, 4-16 experts)
    seed = 0
    perturb_std = 0.1  # noise added to parameters that initialise to a constant
    prompt_tokens = 12
    new_tokens = 32
    rel_tol = 1e-4  # logits within rel_tol * max|logit|
    unsupported: dict[str, str] = {}  # check name -> why this plugin cannot support it

    @pytest.fixture(scope="class")
    @classmethod
    def oracle(cls, tmp_path_factory) -> Oracle:
        if cls.hf_config is None:
            pytest.fail(f"{cls.__name__} must set hf_config")
        return Oracle(cls, tmp_path_factory.mktemp(cls.__name__))

    def _check(self, name: str) -> None:
        if name in self.unsupported:
            pytest.skip(reason=f"{type(self).__name__} declares {name} unsupported: {self.unsupported[name]}")

    # ---- agreement with the oracle ----------------------------------------------------------
    @pytest.mark.parametrize("q", QUANTS)
    def test_greedy_tokens(self, oracle: Oracle, q: str):
        """32 greedy tokens identical to transformers (ties in the oracle itself are reported)."""
        self._check(f"greedy_{q}")
        expected = oracle.hf_greedy(q, self.new_tokens)
        with load(oracle.container(q), activations="f32") as engine:
            got = engine.generate(oracle.prompt, self.new_tokens, stop_ids=())
        if got != expected:
            i = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
            ref = oracle.hf_logits(q, oracle.prompt + expected[:i])[-1]
            top2 = np.sort(ref)[-2:]
            gap, tol = top2[1] - top2[0], self.rel_tol * np.abs(ref).max()
            assert gap < tol, (f"greedy token {i} differs: colibri {got[i]}, transformers {expected[i]} "
                               f"(oracle top-1/top-2 gap {gap:.3g} > tolerance {tol:.3g}, not a tie)")
            print(f"TIE: token {i} differs where the oracle's own top-1/top-2 gap {gap:.3g} < {tol:.3g}")

    @pytest.mark.parametrize("q", QUANTS)
    def test_logits(self, oracle: Oracle, q: str):
        """Teacher-forced logits within rel_tol * max|logit| of transformers."""
        self._check(f"logits_{q}")
        rng = np.random.default_rng(self.seed + 2)
        ids = oracle.prompt + [int(i) for i in rng.integers(0, self.hf_config.vocab_size, self.new_tokens)]
        ref = oracle.hf_logits(q, ids)
        with load(oracle.container(q), activations="f32") as engine:
            got = engine.logits(ids)
        assert got.shape == ref.shape and got.dtype == np.float32
        err, tol = np.abs(got - ref).max(), self.rel_tol * np.abs(ref).max()
        assert err <= tol, f"max |logit difference| {err:.3g} > {tol:.3g} at {q}"

    # ---- placement ---------------------------------------------------------------------------
    @pytest.mark.parametrize("q", ("f32", "int4"))
    def test_placement_invariance(self, oracle: Oracle, q: str):
        """1 slot per layer, a few, all resident: bit-identical logits, identical tokens."""
        self._check("placement_invariance")
        n_experts = oracle.layout.n_experts
        ids = oracle.prompt * 2
        results = []
        for slots in sorted({1, max(1, n_experts // 3), n_experts}):
            with load(oracle.container(q), cache_slots=slots, activations="f32") as engine:
                results.append((slots, engine.logits(ids), engine.generate(oracle.prompt, 16, stop_ids=()),
                                engine.stats()))
        _, base_logits, base_tokens, base_stats = results[-1]
        for slots, logits, tokens, stats in results[:-1]:
            assert np.array_equal(logits, base_logits), f"logits with {slots} slot(s) differ from all-resident"
            assert tokens == base_tokens, f"tokens with {slots} slot(s) differ from all-resident"
        assert results[0][3]["expert_misses"] > base_stats["expert_misses"], "1 slot per layer should miss more"

    # ---- persistent sessions -----------------------------------------------------------------
    def test_session_torn_saves(self, oracle: Oracle, tmp_path):
        """A save cut at any byte loads as the turn before; resuming continues token-identically,
        prefilling only the new tokens; another model's or a damaged file is refused, never half-used."""
        self._check("session")
        check_torn_saves(oracle.container("int4"), tmp_path, oracle.prompt, self.hf_config.vocab_size)

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
        assert {k: p[k] for k in got} == got

    # ---- the container -----------------------------------------------------------------------
    @pytest.mark.parametrize("q", QUANTS)
    def test_container_round_trip(self, oracle: Oracle, q: str, tmp_path):
        """dequantize(container) == quantise-dequantise of every source tensor; fused == per-expert."""
        self._check("container_round_trip")
        from safetensors import safe_open

        got = dequantize(oracle.container(q))
        source = {}
        for f in sorted(oracle.checkpoint.glob("*.safetensors")):
            with safe_open(f, "np") as st:
                source.update({k: st.get_tensor(k) for k in st.keys()})
        assert set(got) == {k for k in source if not oracle.layout.ignored(k)}
        for name, w in got.items():
            resident_f32 = name in oracle.layout.resident and oracle.layout.stays_f32(name, source[name].ndim)
            want = source[name] if q == "f32" or resident_f32 else quant.dequantize(quant.quantize(source[name], q))
            assert np.array_equal(w, want.astype(np.float32)), f"{name} differs after the round trip at {q}"
        oracle.convert(oracle.fused_checkpoint, tmp_path / "fused", q)
        fused = dequantize(tmp_path / "fused")
        assert Container(tmp_path / "fused").resident().keys() == Container(oracle.container(q)).resident().keys()
        with load(tmp_path / "fused", activations="f32") as a, load(oracle.container(q), activations="f32") as b:
            assert np.array_equal(a.logits(oracle.prompt), b.logits(oracle.prompt)), "fused and per-expert containers differ"
        assert sum(v.size for v in fused.values()) == sum(v.size for v in got.values())

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
