"""The shared expert in the core's MoE block (colibri_core/layers/shared_expert.py, MoE(shared=)):
run in the routed experts' C call when the layer holds them all, on its own otherwise (streamed
experts, or a probe listening for the routed sum alone) — the same bits every way. Tiny random
models of the four architectures that have one (tools/tiny_model.py)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from colibri_core import kernels, probe
from colibri_core.engine import load
from colibri_core.kernels.decoder import MoELayer

pytest.importorskip("transformers", reason="the tiny models are built with transformers (the test extra)")

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("tiny_model", ROOT / "tools" / "tiny_model.py")
tiny_model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tiny_model)

PROMPT = [5, 17, 300, 42, 9, 77, 1000, 3, 64, 128, 256, 12, 700]


@pytest.mark.parametrize("activations", ["f32", "int8"])
@pytest.mark.parametrize("arch", ["glm52", "qwen36", "deepseek_v4", "kimi_linear"])
def test_shared_expert_fused_or_not_gives_the_same_bits(arch, activations, tmp_path, monkeypatch):
    model = tiny_model.build(arch, tmp_path / arch)
    fused = []
    for name in ("moe_block", "moe_block_softmax"):  # the latter with the softmax router in the call (Qwen3.6)
        def counting(*args, real=getattr(kernels, name), shared=None, **kw):
            fused.append(shared is not None)
            return real(*args, shared=shared, **kw)

        monkeypatch.setattr(kernels, name, counting)
    real_layer = MoELayer.__call__  # a whole decoder layer in one call (Qwen3.6's): the shared expert inside it
    monkeypatch.setattr(MoELayer, "__call__", lambda self, *a, **kw: fused.append(self.shared is not None)
                        or real_layer(self, *a, **kw))
    with load(model, activations=activations, cache_slots=10**6) as engine:
        for layer in engine.container.moe_layers:  # every expert resident: one C call per layer
            for e in range(engine.container.n_experts):
                engine.store.get(layer, e)
        together = engine.logits(PROMPT)
        assert fused and all(fused), "the shared expert did not run in the experts' call"
        fused.clear()
        with probe.recording(["ffn_moe_out", "ffn_shexp"]) as rec:  # a listener: the two sums apart
            apart = engine.logits(PROMPT)
        assert fused and not any(fused)
        assert rec.layers("ffn_shexp") and rec.layers("ffn_shexp") == rec.layers("ffn_moe_out")
    with load(model, activations=activations, cache_slots=1) as engine:  # streamed: never the one call
        streamed = engine.logits(PROMPT)
    for got in (apart, streamed):
        assert np.array_equal(got.view(np.uint32), together.view(np.uint32))
