"""kernels.AttnBlock / layers.attention.gqa_block: the fused attention sub-block gives the same bits
as its steps one by one (the path every plugin took before it), for each q/k norm, clip, GQA,
a prompt and decode steps over a filled cache, in both activation modes."""
from dataclasses import replace

import numpy as np
import pytest

from colibri_core.kv.cache import KVCache
from colibri_core.layers.attention import AttnBlock, gqa_attention, gqa_block
from colibri_core.layers.gated_attention import GatedAttention
from colibri_core.layers.norm import rms_norm, rms_norm_zero_centred
from colibri_core.layers.rope import Rope, apply_rotate_half
from colibri_core.model import linear, linears
from colibri_core.quant import quantize

H, HEADS, KV_HEADS, D, EPS = 64, 4, 2, 16, 1e-5


def weights(kind, qk_norm, seed=0, act="f32"):
    """A layer's attention weights of `kind`, their products in arithmetic `act` (QTensor.act)."""
    rng = np.random.default_rng(seed)
    w = lambda r, c: replace(quantize(rng.standard_normal((r, c)).astype(np.float32) * 0.2, kind), act=act)  # noqa: E731
    width = {"whole": (HEADS * D, KV_HEADS * D), "head": (D, D), None: (0, 0)}[qk_norm]
    return dict(norm=1 + 0.1 * rng.standard_normal(H).astype(np.float32),
                wq=w(HEADS * D, H), wk=w(KV_HEADS * D, H), wv=w(KV_HEADS * D, H), wo=w(H, HEADS * D),
                q_norm=1 + 0.1 * rng.standard_normal(width[0]).astype(np.float32),
                k_norm=1 + 0.1 * rng.standard_normal(width[1]).astype(np.float32))


def step_by_step(W, qk_norm, clip, h, cache, cos, sin):
    T = len(h)
    x = rms_norm(h, W["norm"], EPS)
    q, k, v = linears(x, (W["wq"], W["wk"], W["wv"]))
    if qk_norm == "whole":
        q, k = rms_norm(q, W["q_norm"], EPS), rms_norm(k, W["k_norm"], EPS)
    elif qk_norm == "head":
        q = rms_norm(q.reshape(T, HEADS, D), W["q_norm"], EPS).reshape(T, -1)
        k = rms_norm(k.reshape(T, KV_HEADS, D), W["k_norm"], EPS).reshape(T, -1)
    if clip is not None:
        q, k, v = (np.clip(t, -clip, clip) for t in (q, k, v))
    q = apply_rotate_half(q.reshape(T, HEADS, D), cos, sin)
    k = apply_rotate_half(k.reshape(T, KV_HEADS, D), cos, sin)
    return h + linear(gqa_attention(q, k, v.reshape(T, KV_HEADS, D), cache, D ** -0.5), W["wo"])


@pytest.mark.parametrize("cache", ["f32", "f16"])
@pytest.mark.parametrize("act", ["f32", "int8"])
@pytest.mark.parametrize("kind", ["int4", "f32"])
@pytest.mark.parametrize("qk_norm,clip", [("whole", None), ("head", None), (None, None), ("whole", 0.5)])
def test_fused_block_is_bit_identical_to_its_steps(kind, qk_norm, clip, act, cache):
    W = weights(kind, qk_norm, act=act)
    block = AttnBlock(W["norm"], W["wq"], W["wk"], W["wv"], W["wo"], heads=HEADS, kv_heads=KV_HEADS, head_dim=D,
                      eps=EPS, scale=D ** -0.5, qk_norm=qk_norm, q_norm=W["q_norm"] if qk_norm else None,
                      k_norm=W["k_norm"] if qk_norm else None, clip=clip)
    rope = Rope(D, 10000.0)
    rng = np.random.default_rng(1)
    dtype = {"f32": np.float32, "f16": np.float16}[cache]  # float16: the block rounds its rows as NumPy does
    fused, steps = (KVCache(KV_HEADS, D, cache, capacity=4) for _ in range(2))  # grows on the way
    for T in (7, 1, 1, 3, 1):  # a prompt, then decode steps and a short chunk over the filled cache
        h = rng.standard_normal((T, H)).astype(np.float32)
        cos, sin = rope.cos_sin(np.arange(fused.length, fused.length + T))
        a = gqa_block(block, h, fused, cos, sin)
        b = step_by_step(W, qk_norm, clip, h, steps, cos, sin)
        assert a.tobytes() == b.tobytes()
        assert fused.length == steps.length
        assert all(x.dtype == dtype and x.tobytes() == y.tobytes() for x, y in zip(fused.view(), steps.view()))


@pytest.mark.parametrize("cache", ["f32", "f16"])
@pytest.mark.parametrize("act", ["f32", "int8"])
@pytest.mark.parametrize("rotary_dim", [D // 2, D])
def test_gated_block_is_bit_identical_to_gated_attention(rotary_dim, act, cache):
    """Qwen3.5/3.6's gated attention (q projection per head [q | gate], per-head zero-centred q/k
    norms, partial RoPE, the output times sigmoid(gate), projection biases) as a gated `AttnBlock`
    gives the bits of `GatedAttention`'s steps after the input norm, plus the residual."""
    rng = np.random.default_rng(2)
    w = lambda r, c: replace(quantize(rng.standard_normal((r, c)).astype(np.float32) * 0.2, "int4"), act=act)  # noqa: E731
    small = lambda n: 0.1 * rng.standard_normal(n).astype(np.float32)  # noqa: E731
    norm, q_norm, k_norm = small(H), small(D), small(D)  # zero-centred: offsets from 1
    biases = {"q": small(2 * HEADS * D), "k": small(KV_HEADS * D), "v": small(KV_HEADS * D), "o": small(H)}
    steps = GatedAttention(w(2 * HEADS * D, H), w(KV_HEADS * D, H), w(KV_HEADS * D, H), w(H, HEADS * D), q_norm, k_norm,
                           heads=HEADS, kv_heads=KV_HEADS, head_dim=D, eps=EPS, biases=biases)
    one = np.float32(1)
    block = AttnBlock(one + norm, steps.q_proj, steps.k_proj, steps.v_proj, steps.o_proj, heads=HEADS,
                      kv_heads=KV_HEADS, head_dim=D, eps=EPS, scale=D ** -0.5, qk_norm="head", q_norm=one + q_norm,
                      k_norm=one + k_norm, **{f"{n}_bias": b for n, b in biases.items()}, gated=True,
                      rotary_dim=rotary_dim)
    rope = Rope(rotary_dim, 10000.0)
    fused, stepped = (KVCache(KV_HEADS, D, cache, capacity=4) for _ in range(2))
    for T in (7, 1, 1, 3, 1):
        h = rng.standard_normal((T, H)).astype(np.float32)
        cos, sin = rope.cos_sin(np.arange(fused.length, fused.length + T))  # (T, rotary_dim)
        a = gqa_block(block, h, fused, cos, sin)
        b = h + steps(rms_norm_zero_centred(h, norm, EPS), stepped, cos, sin)
        assert a.tobytes() == b.tobytes()
        assert all(x.tobytes() == y.tobytes() for x, y in zip(fused.view(), stepped.view()))


@pytest.mark.parametrize("cache", ["f32", "f16"])
def test_several_sequences_in_one_call_get_their_own_bits(cache):
    """`AttnBlock.seqs`, a batch's sequences in one call (the projections on all rows, attention per
    cache), gives each sequence the bits of its own call, a sliding window and sinks included."""
    W = weights("int4", "head", act="int8")
    rng = np.random.default_rng(3)
    block = AttnBlock(W["norm"], W["wq"], W["wk"], W["wv"], W["wo"], heads=HEADS, kv_heads=KV_HEADS, head_dim=D,
                      eps=EPS, scale=D ** -0.5, qk_norm="head", q_norm=W["q_norm"], k_norm=W["k_norm"],
                      sinks=rng.standard_normal(HEADS).astype(np.float32), window=5)
    rope = Rope(D, 10000.0)
    dtype = {"f32": np.float32, "f16": np.float16}[cache]
    filled, lengths = [0, 9, 3], [1, 4, 7]  # rows each cache holds already, new rows each
    alone = [(rng.standard_normal((16, KV_HEADS, D)) * 0.1).astype(dtype) for _ in range(6)]  # k, v of each
    together = [a.copy() for a in alone]
    h = rng.standard_normal((sum(lengths), H)).astype(np.float32)
    cos, sin = (np.concatenate(t) for t in zip(*(rope.cos_sin(np.arange(f, f + n)) for f, n in zip(filled, lengths))))
    out = block.seqs(h, lengths, cos, sin, [(together[2 * i], together[2 * i + 1], f) for i, f in enumerate(filled)])
    at = np.cumsum([0] + lengths)
    for i, (f, n) in enumerate(zip(filled, lengths)):
        rows = slice(at[i], at[i + 1])
        want = block(h[rows], cos[rows], sin[rows], alone[2 * i], alone[2 * i + 1], f)
        assert want.tobytes() == out[rows].tobytes()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(alone, together))


def test_bad_shapes_are_one_clear_error():
    W = weights("int4", "whole")
    with pytest.raises(ValueError, match="projections must be"):
        AttnBlock(W["norm"], W["wk"], W["wq"], W["wv"], W["wo"], heads=HEADS, kv_heads=KV_HEADS, head_dim=D,
                  eps=EPS, scale=1.0)
    with pytest.raises(ValueError, match="q_norm must be"):
        AttnBlock(W["norm"], W["wq"], W["wk"], W["wv"], W["wo"], heads=HEADS, kv_heads=KV_HEADS, head_dim=D,
                  eps=EPS, scale=1.0, qk_norm="head", q_norm=W["q_norm"], k_norm=W["k_norm"])
    block = AttnBlock(W["norm"], W["wq"], W["wk"], W["wv"], W["wo"], heads=HEADS, kv_heads=KV_HEADS, head_dim=D,
                      eps=EPS, scale=1.0)
    small = np.zeros((2, KV_HEADS, D), np.float32)
    with pytest.raises(ValueError, match="caches must be"):
        block(np.zeros((3, H), np.float32), np.zeros((3, D), np.float32), np.zeros((3, D), np.float32), small, small, 0)
