"""Attention's options (GPT-OSS's): per-head sinks, a sliding window whose cache holds only the
window (`kv.cache.WindowKV`), q/k/v/o biases. The C kernels against their NumPy reference, every
token the bits it gets alone and over only its window's rows, and the fused block the bits of its
steps over either cache."""
import numpy as np
import pytest

from colibri_core import kernels
from colibri_core.kernels import reference
from colibri_core.kv import SequenceState
from colibri_core.kv.cache import KVCache, WindowKV
from colibri_core.layers.attention import AttnBlock, gqa_attention, gqa_block
from colibri_core.layers.norm import rms_norm
from colibri_core.layers.rope import Rope, apply_rotate_half
from colibri_core.model import linear, linears
from colibri_core.quant import quantize

from test_kernels import assert_close, assert_same_bits, supported_paths, thread_counts  # noqa: F401 (a fixture)


@pytest.mark.parametrize("T,H,Hkv,D,start,window", [(1, 4, 2, 64, 40, 8), (5, 8, 2, 64, 0, 3), (37, 4, 4, 128, 45, 20),
                                                    (22, 6, 3, 20, 70, 5), (40, 8, 2, 64, 10, 1), (3, 2, 1, 16, 2, 100)])
@pytest.mark.parametrize("sinks", [False, True])
def test_window_and_sinks_match_reference_and_each_token_alone(thread_counts, T, H, Hkv, D, start, window, sinks):
    """Several new tokens (blocks of 16, tiles, 4 tokens at a time: tokens of one block see different
    first rows) give every token the bits it gets fed alone over only the rows its window holds, on
    every path and thread count, float16 caches as their float32 widening."""
    rng = np.random.default_rng([T, H, D, start, window])
    S = start + T
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    k, v = (rng.standard_normal((S, Hkv, D)).astype(np.float32) for _ in range(2))
    s = rng.standard_normal(H).astype(np.float32) * 2 if sinks else None
    want = reference.attention(q, k, v, start, D ** -0.5, window, s)
    got = kernels.attention(q, k, v, start, D ** -0.5, window, s)
    assert_close(got, want, 1e-5 * (np.abs(v).max() + np.abs(want)))
    for t in range(T):
        lo = max(start + t - window + 1, 0)
        alone = kernels.attention(q[t:t + 1], k[lo:start + t + 1], v[lo:start + t + 1], start + t - lo, D ** -0.5, window, s)
        assert_same_bits(alone, got[t:t + 1], f"token {t} alone over its window")
    for path in supported_paths():
        kernels.set_simd(path)
        for n in thread_counts:
            kernels.set_threads(n)
            assert_same_bits(kernels.attention(q, k, v, start, D ** -0.5, window, s), got, f"path {path}, {n} threads")
    kernels.set_simd("auto")
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    assert_same_bits(kernels.attention(q, k16, v16, start, D ** -0.5, window, s),
                     kernels.attention(q, k16.astype(np.float32), v16.astype(np.float32), start, D ** -0.5, window, s))


def test_no_window_no_sinks_is_the_plain_kernel():
    """The options off are exactly the kernel every other plugin runs (None and a window past the
    context alike)."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((9, 4, 32), (30, 2, 32), (30, 2, 32)))
    plain = kernels.attention(q, k, v, 21, 0.2)
    assert_same_bits(kernels.attention(q, k, v, 21, 0.2, window=30), plain)
    assert_same_bits(kernels.attention(q, k, v, 21, 0.2, sinks=np.full(4, -np.inf, np.float32)), plain)
    with pytest.raises(ValueError, match="window must be a positive int"):
        kernels.attention(q, k, v, 21, 0.2, window=0)
    with pytest.raises(ValueError, match=r"sinks must be \(4,\)"):
        kernels.attention(q, k, v, 21, 0.2, sinks=np.zeros(3, np.float32))


HID, HEADS, KV_HEADS, D, EPS, WINDOW = 48, 4, 2, 16, 1e-5, 6


def block_and_weights(kind, rng):
    w = lambda r, c: quantize(rng.standard_normal((r, c)).astype(np.float32) * 0.2, kind)  # noqa: E731
    vec = lambda n: rng.standard_normal(n).astype(np.float32) * 0.3  # noqa: E731
    W = dict(norm=1 + vec(HID), wq=w(HEADS * D, HID), wk=w(KV_HEADS * D, HID), wv=w(KV_HEADS * D, HID),
             wo=w(HID, HEADS * D), q_bias=vec(HEADS * D), k_bias=vec(KV_HEADS * D), v_bias=vec(KV_HEADS * D),
             o_bias=vec(HID), sinks=vec(HEADS) * 3)
    block = AttnBlock(W["norm"], W["wq"], W["wk"], W["wv"], W["wo"], heads=HEADS, kv_heads=KV_HEADS, head_dim=D,
                      eps=EPS, scale=D ** -0.5, q_bias=W["q_bias"], k_bias=W["k_bias"], v_bias=W["v_bias"],
                      o_bias=W["o_bias"], sinks=W["sinks"], window=WINDOW)
    return block, W


def steps(W, h, cache, cos, sin):
    """The sub-block step by step with GPT-OSS's options, over a full KVCache."""
    T = len(h)
    q, k, v = linears(rms_norm(h, W["norm"], EPS), (W["wq"], W["wk"], W["wv"]))
    q, k, v = q + W["q_bias"], k + W["k_bias"], v + W["v_bias"]
    q = apply_rotate_half(q.reshape(T, HEADS, D), cos, sin)
    k = apply_rotate_half(k.reshape(T, KV_HEADS, D), cos, sin)
    a = gqa_attention(q, k, v.reshape(T, KV_HEADS, D), cache, D ** -0.5, WINDOW, W["sinks"])
    return h + (linear(a, W["wo"]) + W["o_bias"])


@pytest.mark.parametrize("kind", ["f32", "int4"])
def test_block_with_biases_sinks_and_window_is_its_steps_and_holds_only_the_window(kind):
    """The fused block over a WindowKV gives the bits of its steps over a full cache, call after
    call (a prompt longer than the arrays, decode steps past several moves of the rows, chunks),
    and the window's arrays stay a few windows long whatever the context."""
    rng = np.random.default_rng(5)
    block, W = block_and_weights(kind, rng)
    rope = Rope(D, 10000.0)
    window, full = WindowKV(KV_HEADS, D, WINDOW), KVCache(KV_HEADS, D)
    pos = 0
    for T in (30, 1, 1, 3, *[1] * 40, 9, 1):
        h = rng.standard_normal((T, HID)).astype(np.float32)
        cos, sin = rope.cos_sin(np.arange(pos, pos + T))
        a, b = gqa_block(block, h, window, cos, sin), steps(W, h, full, cos, sin)
        assert a.tobytes() == b.tobytes(), f"{T} tokens at {pos}"
        pos += T
        assert window.k.shape[0] <= max(WindowKV.SPARE * WINDOW, WINDOW - 1 + T)
    assert window.k.shape[0] == WindowKV.SPARE * WINDOW  # the long prompt's rows went at the next call
    keep = window.arrays()
    fk, fv = full.view()
    assert keep["k"].tobytes() == fk[-(WINDOW - 1):].tobytes() and keep["v"].tobytes() == fv[-(WINDOW - 1):].tobytes()


def test_window_state_saves_and_resumes_with_the_same_bits():
    """A state holding a WindowKV (a fixed-size part) saves the last window − 1 rows and a resumed
    copy continues with the bits of the original."""
    rng = np.random.default_rng(8)
    block, _ = block_and_weights("f32", rng)
    rope = Rope(D, 10000.0)
    state = SequenceState({"layer.0": WindowKV(KV_HEADS, D, WINDOW)})
    h = rng.standard_normal((20, HID)).astype(np.float32)
    gqa_block(block, h, state["layer.0"], *rope.cos_sin(np.arange(20)))
    state.advance(20)
    arrays = state.arrays()
    assert arrays["layer.0.k"].shape == (WINDOW - 1, KV_HEADS, D) and arrays["length"][0] == 20
    twin = SequenceState({"layer.0": WindowKV(KV_HEADS, D, WINDOW)})
    twin.load_arrays(arrays)
    x = rng.standard_normal((2, HID)).astype(np.float32)
    cos, sin = rope.cos_sin(np.arange(20, 22))
    assert gqa_block(block, x, state["layer.0"], cos, sin).tobytes() == gqa_block(block, x, twin["layer.0"], cos, sin).tobytes()
    with pytest.raises(ValueError, match="layer.0.k has shape"):
        twin.load_arrays({**arrays, "layer.0.k": np.zeros((WINDOW, KV_HEADS, D), np.float32)})
