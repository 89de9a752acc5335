"""The core's MLA (compressed cache, absorbed kv_b_proj) against the expanded form written out in
NumPy float64, interleaved RoPE against complex rotation, and DSA's top-k selection."""
import numpy as np
import pytest

from colibri_core import quant
from colibri_core.layers.dsa import select_topk
from colibri_core.layers.mla import MLA, QUERY_BLOCK, MLACache, MLADims
from colibri_core.layers.rope import Rope, apply_interleaved

DIMS = MLADims(heads=3, q_lora_rank=20, kv_lora_rank=24, qk_nope_head_dim=10, qk_rope_head_dim=8, v_head_dim=12,
               scale=18 ** -0.5)
H = 40


def make_mla(rng, kind):
    d = DIMS

    def mat(rows, cols):
        return quant.quantize((rng.standard_normal((rows, cols)) * 0.3).astype(np.float32), kind)

    return MLA(d, mat(d.q_lora_rank, H), (1 + 0.1 * rng.standard_normal(d.q_lora_rank)).astype(np.float32),
               mat(d.heads * (d.qk_nope_head_dim + d.qk_rope_head_dim), d.q_lora_rank),
               mat(d.kv_lora_rank + d.qk_rope_head_dim, H),
               (1 + 0.1 * rng.standard_normal(d.kv_lora_rank)).astype(np.float32),
               mat(d.heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank), mat(H, d.heads * d.v_head_dim))


def expanded(mla, x, cos, sin, keep):
    """The textbook form in float64: expand every cached latent to per-head k_nope and v with kv_b."""
    d = mla.d
    f = {k: quant.dequantize(getattr(mla, k)).astype(np.float64) for k in ("q_a", "q_b", "kv_a", "kv_b", "o_proj")}

    def rms(v, w):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + d.norm_eps) * w

    T = len(x)
    q = (rms(x @ f["q_a"].T, mla.q_a_norm) @ f["q_b"].T).reshape(T, d.heads, -1)
    q_rope = apply_interleaved(q[..., d.qk_nope_head_dim:], cos, sin)
    ckv = x @ f["kv_a"].T
    c = rms(ckv[:, : d.kv_lora_rank], mla.kv_a_norm)  # (T, c)
    k_rope = apply_interleaved(ckv[:, None, d.kv_lora_rank:], cos, sin)[:, 0]
    kv = (c @ f["kv_b"].T).reshape(T, d.heads, d.qk_nope_head_dim + d.v_head_dim)
    k_nope, v = kv[..., : d.qk_nope_head_dim], kv[..., d.qk_nope_head_dim:]
    scores = (np.einsum("thd,shd->hts", q[..., : d.qk_nope_head_dim], k_nope)
              + np.einsum("thr,sr->hts", q_rope, k_rope)) * d.scale
    mask = np.triu(np.ones((T, T), bool), 1) | ~keep
    scores[:, mask] = -np.inf
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hts,shv->thv", p, v).reshape(T, -1) @ f["o_proj"].T


@pytest.mark.parametrize("kind", ["f32", "int4"])
def test_absorbed_mla_matches_the_expanded_form(kind):
    """Prefill longer than one query block, then decode token by token over the 24 + 8 = 32-float cache."""
    rng = np.random.default_rng(0)
    mla = make_mla(rng, kind)
    T = QUERY_BLOCK + 30
    x = rng.standard_normal((T, H)).astype(np.float32)
    cos, sin = Rope(DIMS.qk_rope_head_dim, 10000.0).cos_sin(np.arange(T))
    keep = rng.random((T, T)) < 0.6  # a sparse selection, as DSA gives
    np.fill_diagonal(keep, True)
    want = expanded(mla, x.astype(np.float64), cos, sin, keep)
    cache, got = MLACache(DIMS), []
    for a, b in [(0, T - 5)] + [(t, t + 1) for t in range(T - 5, T)]:  # prefill, then decode
        _, q_nope, q_rope = mla.query(x[a:b], cos[a:b], sin[a:b])
        mla.compress(x[a:b], cos[a:b], sin[a:b], cache)
        got.append(mla.attend(q_nope, q_rope, cache, keep[a:b, :b]))
    got = np.concatenate(got)
    assert cache.latent.view().shape == (T, 24) and cache.k_rope.view().shape == (T, 8)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_selecting_every_key_is_dense_attention_bit_for_bit():
    rng = np.random.default_rng(1)
    mla = make_mla(rng, "int8")
    T = QUERY_BLOCK + 3
    x = rng.standard_normal((T, H)).astype(np.float32)
    cos, sin = Rope(DIMS.qk_rope_head_dim, 10000.0).cos_sin(np.arange(T))
    _, q_nope, q_rope = mla.query(x, cos, sin)
    cache = MLACache(DIMS)
    mla.compress(x, cos, sin, cache)
    scores = rng.standard_normal((T, T)).astype(np.float32)
    every = select_topk(scores, 0, T)
    assert every.all()
    dense = mla.attend(q_nope, q_rope, cache, None)
    assert np.array_equal(mla.attend(q_nope, q_rope, cache, every), dense)
    assert not np.array_equal(mla.attend(q_nope, q_rope, cache, select_topk(scores, 0, 4)), dense)


def test_interleaved_rope_is_a_complex_rotation_of_pairs():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 2, 8)).astype(np.float32)
    pos = np.array([0, 1, 7, 100, 4000])
    cos, sin = Rope(8, 10000.0).cos_sin(pos)
    got = apply_interleaved(x, cos, sin)
    angle = pos[:, None] * (1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8))  # (T, 4)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * angle)[:, None]
    want = np.concatenate([z.real, z.imag], axis=-1)  # transformers' de-interleaved output layout
    np.testing.assert_allclose(got, want, atol=2e-4)


def test_select_topk_is_causal_and_breaks_ties_to_the_earlier_key():
    scores = np.array([[5, 1, 1, 1, 9], [0, 2, 2, 2, 9], [3, 3, 3, 3, 3]], np.float32)
    keep = select_topk(scores, 2, 2)  # queries at positions 2, 3, 4
    assert keep.tolist() == [[True, True, False, False, False],  # only keys 0..2 are causal; 0 wins, then 1 (tie)
                             [False, True, True, False, False],
                             [True, True, False, False, False]]
    assert select_topk(scores, 0, 5).all() and select_topk(scores, 0, 9).all()


@pytest.mark.parametrize("T,S,k", [(5, 50, 7), (40, 40, 8), (1, 1000, 100), (300, 300, 17)])
def test_select_topk_equals_a_stable_sort_under_heavy_ties(T, S, k):
    """The O(S) selection keeps the same causal keys as a stable sort (ReLU scores tie at 0 often)."""
    rng = np.random.default_rng(T + S)
    scores = rng.integers(0, 6, (T, S)).astype(np.float32)
    start = S - T
    future = np.arange(S)[None, :] > (start + np.arange(T))[:, None]
    ranked = np.where(future, -np.inf, scores)
    ref = np.zeros((T, S), bool)
    np.put_along_axis(ref, np.argsort(-ranked, axis=-1, kind="stable")[:, :k], True, axis=-1)
    keep = select_topk(scores, start, k)
    assert np.array_equal(keep & ~future, ref & ~future) and (keep.sum(-1) == k).all()
