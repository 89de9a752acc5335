"""The oracle behind the conformance kit: a tiny random `transformers` model, its checkpoint on disk,
colibri's containers of it, and every pass over it the checks share (memoised per suite class, so
the oracle never runs the same thing twice).

- `container(q)`: the checkpoint converted at q; `oracle(q)`: the `transformers` model the engine
  must match at q (at f32 the model itself, at int8/int4 the model loaded with
  `colibri_core.dequantize(container)`). A conversion that fails is remembered: every later call
  for that quantisation raises the same error (the real one), and nothing is left on disk that a
  later call could trip over (``oracle-int4`` is created only once its weights exist).
- `routers()`: transformers' router modules, found through the routers the plugin declares (never
  by a module name: `colibri_core.testing.trace.find_routers`).
- `trace(q, ids)`: the oracle's teacher-forced logits and its per-layer intermediates, hooked at
  those routers (see `colibri_core.testing.trace`); `engine_trace(q, ids)`: the same from colibri.
- `hf_greedy(q, n)`: the oracle's greedy continuation of the prompt.
- `engine_run(q, slots, prefetch)`: logits, 16 greedy tokens and the stats of colibri at a cache size.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from .. import plugins
from ..container import dequantize
from ..convert import convert_checkpoint, read_config
from .trace import OracleRouters, Trace, engine_trace, find_routers, oracle_trace

RUN_TOKENS = 16  # greedy tokens of each `engine_run`


@contextmanager
def one_torch_thread():
    """torch on one thread while the oracle runs: its matrices are tiny, and on a shared CPU torch's
    thread pool costs far more than it saves (GLM's greedy oracle: 14 s → 0.8 s). Same results."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _Drop:
    def __repr__(self) -> str:
        return "DROP"


DROP = _Drop()  # as a value in config edits: remove the key


def edit_config(config: dict, edits) -> dict:
    """`edits` applied to a config.json dict: a dict of top-level keys to set (`DROP` as a value
    removes the key), or a callable config → new config (given a copy)."""
    if callable(edits):
        return edits(json.loads(json.dumps(config)))
    out = dict(config)
    for key, value in edits.items():
        if value is DROP:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def effective_lookahead(model) -> dict[int, int]:
    """{MoE layer: the layer its lookahead predicts}: `lookahead()`, or each router's successor."""
    declared = model.lookahead()
    if declared is not None:
        return dict(declared)
    layers = list(model.routers())
    return dict(zip(layers, layers[1:]))


class Oracle:
    """A tiny random `transformers` model, its checkpoint on disk, and its containers, built from a
    `ConformanceSuite` subclass `suite` (its hf_config, seed, perturb_std, config_edits, …). The
    kit's modules import in one direction: conformance → checks → oracle → trace."""

    def __init__(self, suite: type, root: Path):
        import torch
        from transformers import AutoModelForCausalLM

        self.suite, self.root = suite, root
        with one_torch_thread():
            torch.manual_seed(suite.seed)
            model = AutoModelForCausalLM.from_config(suite.hf_config, attn_implementation="eager", dtype=torch.float32)
            gen = torch.Generator().manual_seed(suite.seed + 1)
            with torch.no_grad():
                for _, p in model.named_parameters():
                    flat = p.reshape(-1)
                    if bool((flat == flat[0]).all()):  # a constant initialisation hides code paths: perturb it
                        p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * suite.perturb_std)
                suite.prepare_model(model)  # e.g. a hash table of distinct experts (a buffer, not perturbed)
        self.model = model.eval()
        saved, fused = root / "hf", root / "hf-fused"  # transformers' save, and its fused-experts save
        model.save_pretrained(saved)
        model.save_pretrained(fused, save_original_format=False)
        if suite.config_edits:  # e.g. another `architectures` name (a test serving a variant plugin)
            for d in (saved, fused):
                config = json.loads((d / "config.json").read_text())
                (d / "config.json").write_text(json.dumps(edit_config(config, suite.config_edits), indent=2))
        registry = plugins.registry()
        config = read_config(saved)
        self.model_class = registry.model_class(registry.resolve(config))
        self.layout = self.model_class.layout(self.model_class.parse_config(config))
        # the checkpoint every check converts: transformers' own save, or the fused save where the
        # layout names the experts only fused ((E, 2I, H) gate_up, (E, H, I) down)
        self.checkpoint = saved if self.layout.experts.per_expert else fused
        self.fused_checkpoint = fused
        rng = np.random.default_rng(suite.seed)
        self.prompt = [int(i) for i in rng.integers(0, suite.hf_config.vocab_size, suite.prompt_tokens)]
        self._containers: dict[str, Path] = {}
        self._oracles: dict[str, Any] = {"f32": self.model}
        self._failed: dict[str, BaseException] = {}  # quantisation → the error its conversion raised
        self._memo: dict[tuple, Any] = {}
        rng = np.random.default_rng(suite.seed + 2)  # the logits check's sequence: prompt + random tokens
        self.logits_ids = self.prompt + [int(i) for i in rng.integers(0, suite.hf_config.vocab_size, suite.new_tokens)]

    def memo(self, key: tuple, compute):
        """compute() once per key for this suite class (the checks share the oracle's work)."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    # ---- containers and oracles at each quantisation -------------------------------------------
    def convert(self, src: Path, dst: Path, q: str) -> None:
        convert_checkpoint(src, dst, q, progress=False)

    def container(self, q: str) -> Path:
        """The checkpoint converted at q (converted once; a failure is re-raised for every later call)."""
        if q in self._failed:
            raise self._failed[q]
        if q not in self._containers:
            dst = self.root / f"colibri-{q}"
            try:
                self.convert(self.checkpoint, dst, q)
            except BaseException as e:
                self._failed[q] = e
                raise
            self._containers[q] = dst
        return self._containers[q]

    def oracle(self, q: str):
        """The `transformers` model the engine must match at quantisation q."""
        if q in self._failed:
            raise self._failed[q]
        if q not in self._oracles:
            import torch
            from safetensors.numpy import save_file
            from transformers import AutoModelForCausalLM

            tensors = dequantize(self.container(q))  # the conversion first: its own error, if any
            d = self.root / f"oracle-{q}"
            tmp = Path(tempfile.mkdtemp(prefix=f"oracle-{q}.", dir=self.root))
            try:
                shutil.copy(self.checkpoint / "config.json", tmp)
                save_file(tensors, str(tmp / "model.safetensors"))
                tmp.rename(d)  # whole or absent
            except BaseException as e:
                shutil.rmtree(tmp, ignore_errors=True)
                self._failed[q] = e
                raise
            with one_torch_thread():
                self._oracles[q] = AutoModelForCausalLM.from_pretrained(
                    d, attn_implementation="eager", dtype=torch.float32).eval()
        return self._oracles[q]

    def forget_engine(self) -> None:
        """Drop colibri's memoised passes, keep the oracle's (a test that changes the plugin in between)."""
        self._memo = {k: v for k, v in self._memo.items() if not k[0].startswith("engine")}

    # ---- the oracle's passes ---------------------------------------------------------------------
    def hf_greedy(self, q: str, n: int) -> list[int]:
        """The oracle's n greedy tokens after the prompt."""
        def run():
            import torch

            model = self.oracle(q)
            with torch.no_grad(), one_torch_thread():
                # eos_token_id=[]: plain argmax for n tokens (min_new_tokens would suppress the EOS
                # token's logit where the model's own argmax is EOS; colibri's greedy does not)
                out = model.generate(torch.tensor([self.prompt]), max_new_tokens=n, eos_token_id=[],
                                     do_sample=False, pad_token_id=0)
            return out[0, len(self.prompt):].tolist()

        return self.memo(("hf_greedy", q, n), run)

    def routers(self) -> OracleRouters:
        """transformers' router modules, found from the routers the plugin declares on the f32
        container (memoised with colibri's passes: a test that changes the plugin looks again)."""
        from ..engine import load

        def find():
            with load(self.container("f32"), activations="f32") as engine:
                return find_routers(self.model, engine.model.routers())

        return self.memo(("engine_routers",), find)

    def trace(self, q: str, ids: list[int]) -> Trace:
        """The oracle's teacher-forced logits (len(ids), V) and per-layer intermediates on ids,
        hooked at `routers()` (found on the f32 model; the oracle at q is the same class)."""
        routers = self.routers()

        def run():
            model = self.oracle(q)
            with one_torch_thread():
                return oracle_trace(model, ids, routers)

        return self.memo(("trace", q, tuple(ids), routers.key()), run)

    def hf_logits(self, q: str, ids: list[int]) -> np.ndarray:
        return self.trace(q, ids).logits

    # ---- colibri's passes ------------------------------------------------------------------------
    def engine_trace(self, q: str, ids: list[int]):
        """colibri's teacher-forced logits and its recorded intermediates (`probe.Recorder`) on ids."""
        return self.memo(("engine_trace", q, tuple(ids)), lambda: engine_trace(self.container(q), ids))

    def engine_run(self, q: str, slots: int, prefetch: bool = True) -> dict:
        """colibri with `slots` experts cached per layer and the router lookahead on or off:
        {"logits": of the prompt twice, "tokens": RUN_TOKENS greedy tokens, "stats": engine.stats()
        after both, "lookahead": {MoE layer: the layer it predicts}}."""
        from ..engine import load

        def run():
            with load(self.container(q), cache_slots=slots, prefetch=prefetch, activations="f32") as engine:
                logits = engine.logits(self.prompt * 2)
                tokens = engine.generate(self.prompt, RUN_TOKENS, stop_ids=())
                return {"logits": logits, "tokens": tokens, "stats": engine.stats(),
                        "lookahead": effective_lookahead(engine.model)}

        return self.memo(("engine_run", q, slots, prefetch), run)
