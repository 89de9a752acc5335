"""A whole decoder layer in one C call (kernels.decoder.MoELayer, MoEModel.decoder_layer): the same
bits as its blocks one by one — the kernel against its steps for both mixers, with and without a
gated shared expert, in both arithmetics; and OLMoE and Qwen3.6 (tiny random models), which are
written with `MoEDecoderLayer`, decoding with the fused call and without it."""
from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from colibri_core import kernels
from colibri_core.engine import load
from colibri_core.kernels.decoder import MoELayer
from colibri_core.kernels.deltanet import DeltaNetBlock
from colibri_core.layers.moe import MoE
from colibri_core.layers.rope import Rope
from colibri_core.quant import quantize

H, HEADS, KV_HEADS, D, E, K, I, EPS = 64, 4, 2, 16, 8, 2, 32, 1e-5


def _weights(rng, kind, act):
    w = lambda r, c, k=kind: replace(quantize(rng.standard_normal((r, c)).astype(np.float32) * 0.2, k), act=act)  # noqa: E731
    vec = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    return w, vec


def _attn_block(w, vec):
    """Qwen3.6's gated attention with partial RoPE: every option the fused call passes through."""
    return kernels.AttnBlock(vec(H), w(2 * HEADS * D, H), w(KV_HEADS * D, H), w(KV_HEADS * D, H), w(H, HEADS * D),
                             heads=HEADS, kv_heads=KV_HEADS, head_dim=D, eps=EPS, scale=D ** -0.5, qk_norm="head",
                             q_norm=vec(D), k_norm=vec(D), gated=True, rotary_dim=D // 2)


def _deltanet_block(w, vec, rng):
    hk, hv, dk, dv, conv = 2, 4, 8, 8, 4
    channels = 2 * hk * dk + hv * dv
    return DeltaNetBlock(w(channels, H), w(hv * dv, H), w(hv, H, "f32"), w(hv, H, "f32"),
                         0.3 * rng.standard_normal((channels, conv)).astype(np.float32),
                         -np.exp(0.1 * rng.standard_normal(hv).astype(np.float32)), vec(hv), vec(dv), w(H, hv * dv),
                         key_heads=hk, value_heads=hv, key_dim=dk, value_dim=dv, eps=EPS)


@pytest.mark.parametrize("act", ["f32", "int8"])
@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("mixer_kind", ["attention", "deltanet"])
def test_the_layer_call_is_its_steps(mixer_kind, shared, kind, act):
    rng = np.random.default_rng(0)
    w, vec = _weights(rng, kind, act)
    mixer = _attn_block(w, vec) if mixer_kind == "attention" else _deltanet_block(w, vec, rng)
    table = kernels.ExpertTable([(w(I, H), w(I, H), w(H, I)) for _ in range(E)])
    router, gate = w(E, H, "f32"), w(1, H, "f32")
    shared_table = kernels.ExpertTable([(w(2 * I, H), w(2 * I, H), w(H, 2 * I))]) if shared else None
    input_norm, post_norm = (vec(H) if mixer_kind == "deltanet" else None), vec(H)
    layer = MoELayer(mixer, post_norm, EPS, router, K, True, input_norm=input_norm, shared=shared_table,
                     shared_gate=gate if shared else None)
    rope = Rope(D // 2, 10000.0)
    caches = [np.zeros((32, KV_HEADS, D), np.float32) for _ in range(4)]  # fused k, v; steps k, v
    states = [[np.zeros(s, np.float32) for s in mixer.state_shapes] for _ in range(2)] if mixer_kind == "deltanet" else None
    start = 0
    for T in (7, 1, 1, 3, 1):  # a prompt, then decode steps and a short chunk
        h = rng.standard_normal((T, H)).astype(np.float32)
        if mixer_kind == "attention":
            cos, sin = rope.cos_sin(np.arange(start, start + T))
            out, weights, ids = layer(h, table, [T], cos=cos, sin=sin, caches=[(caches[0], caches[1], start)])
            h1 = mixer(h, cos, sin, caches[2], caches[3], start)
        else:
            out, weights, ids = layer(h, table, [T], states=[tuple(states[0])])
            h1 = h + mixer(kernels.rms_norm(h, input_norm, EPS), *states[1])
        x = kernels.rms_norm(h1, post_norm, EPS)
        scale = kernels.sigmoid(kernels.matmul(gate, x))[:, 0] if shared else None
        o, w_ref, ids_ref = kernels.moe_block_softmax(x, router, K, True, table, shared=shared_table, shared_scale=scale)
        assert (h1 + o).tobytes() == out.tobytes()
        assert ids.tobytes() == ids_ref.tobytes() and weights.tobytes() == w_ref.tobytes()
        start += T
    pairs = zip(caches[:2], caches[2:]) if mixer_kind == "attention" else zip(*states)
    assert all(a.tobytes() == b.tobytes() for a, b in pairs)
    mixer_seconds, moe_seconds = layer.seconds()
    assert mixer_seconds > 0 and moe_seconds > 0 and layer.seconds() == (0.0, 0.0)


def test_a_layer_call_that_does_not_fit_is_one_clear_error():
    rng = np.random.default_rng(0)
    w, vec = _weights(rng, "int4", "f32")
    mixer = _attn_block(w, vec)
    with pytest.raises(ValueError, match="input_norm"):
        MoELayer(mixer, vec(H), EPS, w(E, H, "f32"), K, True, input_norm=vec(H))
    with pytest.raises(ValueError, match="do not fit"):
        MoELayer(mixer, vec(H), EPS, w(E, H, "f32"), E + 1, True)
    layer = MoELayer(mixer, vec(H), EPS, w(E, H, "f32"), K, True)
    other = kernels.ExpertTable([(w(I, H), w(I, H), w(H, I)) for _ in range(E - 1)])
    with pytest.raises(ValueError, match="must hold 8 experts"):
        layer(np.zeros((1, H), np.float32), other, [1], cos=np.zeros((1, D // 2), np.float32),
              sin=np.zeros((1, D // 2), np.float32),
              caches=[(np.zeros((4, KV_HEADS, D), np.float32), np.zeros((4, KV_HEADS, D), np.float32), 0)])


ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("tiny_model", ROOT / "tools" / "tiny_model.py")
tiny_model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tiny_model)

PROMPT = [5, 17, 300, 42, 9, 77, 1000, 3, 64, 128, 256, 12, 700]


@pytest.mark.parametrize("activations,kv_cache", [("f32", "f32"), ("int8", "f16")])
@pytest.mark.parametrize("arch", ["olmoe", "qwen36"])
def test_a_resident_model_decodes_a_layer_a_call_with_the_bits_of_its_blocks(arch, activations, kv_cache, tmp_path,
                                                                             monkeypatch):
    """A short prompt, a long one (past the DeltaNet's exact batch: its chunked rule), then decoding."""
    pytest.importorskip("transformers", reason="the tiny models are built with transformers (the test extra)")
    model = tiny_model.build(arch, tmp_path / arch)
    taken = []  # whether each layer run took the one call
    real = MoE.layer_table

    def layer_table(self, *a):
        table = real(self, *a)
        taken.append(table is not None)
        return table

    monkeypatch.setattr(MoE, "layer_table", layer_table)
    runs = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(MoE, "layer_table", lambda *a: None)  # every layer block by block
        with load(model, activations=activations, kv_cache=kv_cache, cache_slots=10**6, prefetch=False,
                  usage=False) as engine:
            c = engine.container
            for layer in c.moe_layers:  # every expert resident
                for e in range(c.n_experts):
                    engine.store.get(layer, e)
            runs[fused] = engine.logits(PROMPT), engine.logits(PROMPT * 4), engine.generate(PROMPT, 6, stop_ids=())
            if fused:
                assert taken and all(taken)
                assert engine.stats()["attention_seconds"] > 0 and engine.stats()["moe_seconds"] > 0
    for got, want in zip(runs[True][:2], runs[False][:2]):
        assert got.tobytes() == want.tobytes()
    assert runs[True][2] == runs[False][2]


def test_a_layer_whose_lookahead_is_due_runs_its_blocks(tmp_path, monkeypatch):
    """A resident layer before layers that are not: its lookahead guesses from the residual stream
    midway, so it keeps its blocks; a resident layer with no guess to make takes the one call."""
    pytest.importorskip("transformers", reason="the tiny models are built with transformers (the test extra)")
    model = tiny_model.build("olmoe", tmp_path / "olmoe")
    taken = {}
    real = MoE.layer_table

    def layer_table(self, layer, *a):
        table = real(self, layer, *a)
        taken.setdefault(layer, []).append(table is not None)
        return table

    monkeypatch.setattr(MoE, "layer_table", layer_table)
    with load(model, cache_slots=10**6, prefetch=False, usage=False) as engine:
        first, *_, last = engine.container.moe_layers
        for layer in (first, last):  # these two hold all their experts, the ones between do not
            for e in range(engine.container.n_experts):
                engine.store.get(layer, e)
        engine.logits(PROMPT[:3])
    assert taken[first] == [False] and taken[last] == [True]


@pytest.mark.parametrize("arch", ["olmoe", "qwen36"])
def test_a_batch_runs_a_layer_a_call_for_all_its_generations(arch, tmp_path, monkeypatch):
    """Three generations decoded together, every expert resident: each layer is one C call over
    all three's rows (a prompt beside the others' decode steps too), and each generation's tokens
    are those it gets alone."""
    pytest.importorskip("transformers", reason="the tiny models are built with transformers (the test extra)")
    model = tiny_model.build(arch, tmp_path / arch)
    prompts = [PROMPT, PROMPT[:4], PROMPT * 3]  # the long one is prefilled in chunks beside the others
    seqs = []
    real = MoELayer.__call__
    monkeypatch.setattr(MoELayer, "__call__", lambda self, h, table, lengths, **kw: seqs.append(len(lengths))
                        or real(self, h, table, lengths, **kw))
    with load(model, activations="int8", cache_slots=10**6, prefetch=False, usage=False, prefix_cache=0) as engine:
        c = engine.container
        for layer in c.moe_layers:
            for e in range(c.n_experts):
                engine.store.get(layer, e)
        together = engine.generate_batch(prompts, 5, stop_ids=(), draft="off")
        assert max(seqs) == 3
        alone = [engine.generate(p, 5, stop_ids=(), draft="off") for p in prompts]
    assert together == alone
