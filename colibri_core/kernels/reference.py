"""NumPy references for the C kernels in csrc/: the same float32 operations in the same order.

csrc/matmul.c fixes the order in which every output element is reduced (16 interleaved lanes and a
fixed pairwise tree for ``act="f32"``; exact integer sums per block of 64 and 8 lanes for
``act="int8"``). The functions here compute exactly that order with NumPy's elementwise float32
operations, so for `matmul` the C kernels (every code path) must agree **bit for bit**:

- ``f32``, ``act="f32"``:  ``L[l] += w[j] * x[j]`` for ``j ≡ l (mod 16)``; ``y = tree16(L)``
- ``int8``, ``act="f32"``: the same with ``w = q``, then ``y = tree16(L) * scale``
- ``int4``, ``act="f32"``: per group of 64 (in order) ``A[l] = lo[l] xe[l] + lo[l+16] xe[l+16]
  + hi[l] xo[l] + hi[l+16] xo[l+16]`` (left to right; lo/hi the even/odd columns),
  ``S[l] += A[l] * scale[g]``; ``y = tree16(S)``
- ``fp8`` (any ``act``): per block b of 128 columns (in order) ``A[l] = v[l] x[l]``, then
  ``A[l] += v[l + 16i] x[l + 16i]`` for i = 1..7 (v = e4m3(q), exact; columns of the block),
  ``S[l] += A[l] * 2^(s - 127)`` with the scale of the row's 128×128 block; ``y = tree16(S)``
- ``fp4``, ``act="f32"``: per group g of 32 (in order) ``A[l] = v[2l] x[2l] + v[2l+1] x[2l+1]``
  (left to right; v = 2·e2m1(q), integers), ``S[l] += A[l] * 2^(s - 128)``; ``y = tree16(S)``
- ``act="int8"``: x quantised per block of 64 (`quantize_activations`); ``isum`` per block is an
  exact integer; int4: ``L[g % 8] += float(isum[g]) * (scale[g] * xs[g])``, ``y = tree8(L)``;
  int8: ``L[b % 8] += float(isum[b]) * xs[b]``, ``y = tree8(L) * scale``; fp4: per group of 32
  ``L[g % 8] += float(isum[g]) * (2^(s - 128) * xs[g // 2])`` (isum of v = 2·e2m1), ``y = tree8(L)``.
  f32 and fp8 weights take the f32 arithmetic whatever ``act``.

``expert_ffn`` applies a gated unit (`gated_unit`: SwiGLU, GPT-OSS's SwiGLU, GeGLU, SiTU-GLU) built on
``exp`` and ``tanh``; NumPy's float32 ``exp`` / ``tanh`` and C's may differ in the last bit, so C and
reference agree within float32 rounding there. The numbers
come from `colibri_core.quant` (`int4_values`), the one definition of the formats;
tests/test_kernels.py also checks these references against float64 ``x @ dequantize(w).T``.
"""
from __future__ import annotations

import numpy as np

from colibri_core.quant import (E2M1_VALUES, E4M3_VALUES, FP4_GROUP, FP8_BLOCK, INT4_GROUP, QTensor, dequantize,
                                 e8m0_values, fp4_nibbles, int4_values)

Q8_BLOCK = 64  # columns per activation block in act="int8"


def tree(L: np.ndarray) -> np.ndarray:
    """The fixed pairwise tree over the last axis (16 or 8 lanes): l + l+half, repeatedly."""
    while L.shape[-1] > 1:
        half = L.shape[-1] // 2
        L = L[..., :half] + L[..., half:]
    return L[..., 0]


def _pad_cols(a: np.ndarray, multiple: int) -> np.ndarray:
    pad = -a.shape[-1] % multiple
    return np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)]) if pad else a


def _lanes(terms: np.ndarray, lanes: int) -> np.ndarray:
    """L[l] = 0, += terms[..., j] for j ≡ l (mod lanes) in order (zero terms pad the end); tree(L)."""
    t = _pad_cols(terms, lanes)
    L = np.zeros(t.shape[:-1] + (lanes,), np.float32)
    for j0 in range(0, t.shape[-1], lanes):
        L = L + t[..., j0:j0 + lanes]
    return tree(L)


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x float32 ``[n, cols]`` -> q int8 ``[n, nblocks * 64]`` (zeros past cols), xs float32 ``[n, nblocks]``.

    Per block of 64: ``xs = absmax / 127``, ``q = rint(x * (127 / absmax))`` (half to even), 0 for a
    zero block; a block holding inf or NaN gets q = 0 and xs = NaN.
    """
    x = np.asarray(x, np.float32)
    n, cols = x.shape
    blocks = _pad_cols(x, Q8_BLOCK).reshape(n, -1, Q8_BLOCK)  # (n, nblocks, 64)
    finite = np.isfinite(blocks).all(axis=-1)
    amax = np.where(np.isfinite(blocks), np.abs(blocks), np.float32(0)).max(axis=-1, initial=np.float32(0))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # inf where absmax < 127 / FLT_MAX
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
        q = np.clip(np.rint(blocks * inv[..., None]), -127, 127)
        q[np.isnan(q)] = 0  # 0 · inf: a zero in a block whose absmax < 127 / FLT_MAX overflows inv
    q = np.where(finite[..., None], q, 0).astype(np.int8).reshape(n, -1)
    xs = np.where(finite, amax / np.float32(127), np.float32(np.nan)).astype(np.float32)
    return q, xs


def dequantize_activations(x: np.ndarray) -> np.ndarray:
    """The float32 values ``act="int8"`` stands x for: q * xs per block, ``[n, cols]``."""
    q, xs = quantize_activations(x)
    return (q.reshape(len(q), -1, Q8_BLOCK) * xs[..., None]).reshape(len(q), -1)[:, : np.shape(x)[1]].astype(np.float32)


def matmul(w: QTensor, x: np.ndarray, act: str = "f32") -> np.ndarray:
    """``x @ dequantize(w).T`` in the C kernels' order: x float32 ``[n, w.cols]`` -> float32 ``[n, w.rows]``."""
    x = np.asarray(x, np.float32)
    if w.kind == "fp8":  # always the exact arithmetic
        v = _pad_cols(E4M3_VALUES[w.data], FP8_BLOCK).reshape(w.rows, -1, FP8_BLOCK)  # (rows, B, 128)
        xb = _pad_cols(x, FP8_BLOCK).reshape(len(x), 1, -1, FP8_BLOCK)  # (n, 1, B, 128)
        A = v[..., :16] * xb[..., :16]
        for i in range(1, 8):
            A = A + v[..., 16 * i:16 * i + 16] * xb[..., 16 * i:16 * i + 16]  # (n, rows, B, 16)
        scales = e8m0_values(w.scales)[np.arange(w.rows) // FP8_BLOCK]  # (rows, B)
        S = np.zeros((len(x), w.rows, 16), np.float32)
        for b in range(scales.shape[1]):
            S = S + A[:, :, b, :] * scales[None, :, b, None]
        return tree(S)
    if w.kind == "fp4" and act == "int8":
        v = _pad_cols((E2M1_VALUES * 2).astype(np.int64)[fp4_nibbles(w)], FP4_GROUP).reshape(w.rows, -1, FP4_GROUP)
        G = v.shape[1]
        xq, xs = quantize_activations(x)  # (n, B * 64), (n, B), B = ceil(G / 2)
        isum = np.einsum("rgj,ngj->nrg", v, xq[:, : G * FP4_GROUP].astype(np.int64).reshape(len(x), G, FP4_GROUP))
        half = (e8m0_values(w.scales) * np.float32(0.5)).astype(np.float32)  # (rows, G)
        c = half[None, :, :] * xs[:, None, np.arange(G) // 2]  # (n, rows, G)
        return _lanes(isum.astype(np.float32) * c, 8)
    if w.kind == "fp4":
        twice = (E2M1_VALUES * 2).astype(np.float32)
        v = _pad_cols(twice[fp4_nibbles(w)], FP4_GROUP).reshape(w.rows, -1, FP4_GROUP)  # (rows, G, 32)
        xg = _pad_cols(x, FP4_GROUP).reshape(len(x), 1, -1, FP4_GROUP)  # (n, 1, G, 32)
        A = v[..., 0::2] * xg[..., 0::2]
        A = A + v[..., 1::2] * xg[..., 1::2]  # (n, rows, G, 16)
        half = (e8m0_values(w.scales) * np.float32(0.5)).astype(np.float32)  # 2^(s - 128) (exact, even 2^-128)
        S = np.zeros((len(x), w.rows, 16), np.float32)
        for g in range(half.shape[1]):
            S = S + A[:, :, g, :] * half[None, :, g, None]
        return tree(S)
    if w.kind == "f32" or (act == "f32" and w.kind == "int8"):
        q = np.asarray(w.data, np.float32) if w.kind == "f32" else w.data.astype(np.float32)  # [rows, cols]
        y = _lanes(x[:, None, :] * q[None, :, :], 16)  # (n, rows)
        return y if w.kind == "f32" else y * w.scales.astype(np.float32)
    if act == "f32" and w.kind == "int4":
        q = _pad_cols(int4_values(w).astype(np.float32), INT4_GROUP).reshape(w.rows, -1, 64)  # (rows, G, 64)
        xg = _pad_cols(x, INT4_GROUP).reshape(len(x), 1, -1, 64)  # (n, 1, G, 64)
        lo, hi, xe, xo = q[..., 0::2], q[..., 1::2], xg[..., 0::2], xg[..., 1::2]  # even / odd columns
        A = lo[..., :16] * xe[..., :16]
        A = A + lo[..., 16:] * xe[..., 16:]
        A = A + hi[..., :16] * xo[..., :16]
        A = A + hi[..., 16:] * xo[..., 16:]  # (n, rows, G, 16)
        scales = w.scales.astype(np.float32)  # (rows, G)
        S = np.zeros((len(x), w.rows, 16), np.float32)
        for g in range(scales.shape[1]):
            S = S + A[:, :, g, :] * scales[None, :, g, None]
        return tree(S)
    if act == "int8":
        xq, xs = quantize_activations(x)  # (n, B * 64), (n, B)
        if w.kind == "int8":
            q = _pad_cols(w.data.astype(np.int64), Q8_BLOCK)
            isum = np.einsum("rbj,nbj->nrb", q.reshape(w.rows, -1, 64), xq.astype(np.int64).reshape(len(x), -1, 64))
            return _lanes(isum.astype(np.float32) * xs[:, None, :], 8) * w.scales.astype(np.float32)
        if w.kind == "int4":
            q = _pad_cols(int4_values(w).astype(np.int64), INT4_GROUP)
            isum = np.einsum("rgj,ngj->nrg", q.reshape(w.rows, -1, 64), xq.astype(np.int64).reshape(len(x), -1, 64))
            c = w.scales.astype(np.float32)[None, :, :] * xs[:, None, :]  # (n, rows, G)
            return _lanes(isum.astype(np.float32) * c, 8)
    raise ValueError(f"unknown quantisation {w.kind!r} or activation arithmetic {act!r}")


def matmul_t(w: QTensor, x: np.ndarray) -> np.ndarray:
    """``x @ dequantize(w)``: x float32 ``[n, w.rows]`` -> float32 ``[n, w.cols]``, summed over the
    rows in order as the C kernel does (so the two agree bit for bit)."""
    x = np.asarray(x, np.float32)
    wd = dequantize(w)
    y = np.zeros((x.shape[0], w.cols), np.float32)
    for r in range(w.rows):
        y += x[:, r : r + 1] * wd[r]
    return y


def silu(a: np.ndarray) -> np.ndarray:
    """``a / (1 + exp(-a))`` in float32 (exp overflowing to inf gives -0, as in C)."""
    a = np.asarray(a, np.float32)
    with np.errstate(over="ignore"):
        return a / (np.float32(1) + np.exp(-a))


def gated_unit(kind: str, g: np.ndarray, u: np.ndarray, limit: float = np.inf, alpha: float | None = None) -> np.ndarray:
    """The experts' gated unit h = glu(g, u) elementwise in float32, g = gate x, u = up x (csrc/colibri.h
    ExpertMath), ``clamp`` keeping a NaN:

    - "swiglu": ``silu(min(g, limit)) · clamp(u, ±limit)`` (limit inf: the plain SwiGLU; DeepSeek V4: 10)
    - "swiglu_oai": GPT-OSS's ``(clamp(u, ±limit) + 1) · g' / (1 + exp(-alpha g'))``, ``g' = min(g, limit)``
    - "geglu_tanh": ``gelu_tanh(g) · u`` (`gelu_pytorch_tanh`) as ``g / (1 + exp(-2z)) · u``,
      ``z = √(2/π)(g + 0.044715 g³)`` (``0.5 (1 + tanh z) = σ(2z)``)
    - "situ": Kimi K3's ``4 tanh(g/4) σ(g) · 25 tanh(u/25)`` (`layers.situ`)
    """
    g, u, one, lim = np.asarray(g, np.float32), np.asarray(u, np.float32), np.float32(1), np.float32(limit)
    with np.errstate(over="ignore", invalid="ignore"):
        if kind in ("swiglu", "swiglu_oai"):
            g = np.where(g > lim, lim, g)
            u = np.where(u > lim, lim, np.where(u < -lim, -lim, u))
            if kind == "swiglu":
                return silu(g) * u
            return (u + one) * (g / (one + np.exp(-(np.float32(alpha) * g))))
        if kind == "geglu_tanh":
            z = np.float32(0.7978845608) * (g + np.float32(0.044715) * (g * g * g))
            return g / (one + np.exp(-(np.float32(2) * z))) * u
        if kind == "situ":
            return (np.tanh(g / np.float32(4)) * np.float32(4)) * (one / (one + np.exp(-g))) * (np.tanh(u / np.float32(25)) * np.float32(25))
    raise ValueError(f"unknown gated unit {kind!r}")


def expert_ffn(gate: QTensor, up: QTensor, down: QTensor, x: np.ndarray, act: str = "f32",
               limit: float = np.inf, glu: str = "swiglu", alpha: float | None = None,
               bias: tuple | None = None) -> np.ndarray:
    """``down(glu(gate x + gate_bias, up x + up_bias)) + down_bias``: x float32 ``[n, H]`` -> float32
    ``[n, H]``; gate, up ``[I, H]``, down ``[H, I]``; `bias` None or (gate_bias, up_bias, down_bias),
    each None for none; `glu`, `limit`, `alpha` as `gated_unit`'s."""
    gb, ub, db = bias or (None, None, None)
    g, u = matmul(gate, x, act), matmul(up, x, act)  # [n, I] each
    g = g if gb is None else g + np.asarray(gb, np.float32)
    u = u if ub is None else u + np.asarray(ub, np.float32)
    y = matmul(down, gated_unit(glu, g, u, limit, alpha), act)  # [n, H]
    return y if db is None else y + np.asarray(db, np.float32)


def exact(w: QTensor, x: np.ndarray, act: str = "f32") -> np.ndarray:
    """float64 ``x @ dequantize(w).T`` (x as ``act`` stands it for): what every order approximates."""
    xv = dequantize_activations(x) if act == "int8" and w.kind in ("int8", "int4", "fp4") else np.asarray(x, np.float32)
    return xv.astype(np.float64) @ dequantize(w).astype(np.float64).T


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: x / sqrt(mean(x²) + eps) * weight.  x (..., D), weight (D,)."""
    x = x.astype(np.float32, copy=False)
    var = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
    return (x * (np.float32(1) / np.sqrt(var + np.float32(eps)))) * weight


def rope_rotate_half(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x (T, heads, dim) rotated by cos/sin (T, dim): x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int, scale: float,
              window: int | None = None, sinks: np.ndarray | None = None) -> np.ndarray:
    """Causal GQA attention: q (T, H, D) at rows start.., keys / values (S, Hkv, D) -> (T, H * D).
    `window`: the query of row r sees rows r - window + 1 .. r only; `sinks` (H,): a logit per head
    joining its softmax (its share of the mass dropped, no value), as transformers' GPT-OSS."""
    T, H, D = q.shape
    S, Hkv, _ = keys.shape
    group = H // Hkv
    qg = q.reshape(T, Hkv, group, D).transpose(1, 2, 0, 3)  # (Hkv, group, T, D)
    scores = np.matmul(qg, keys.transpose(1, 2, 0)[:, None]) * np.float32(scale)  # (Hkv, group, T, S)
    rows = start + np.arange(T)[:, None]  # (T, 1): each query's row
    hidden = np.arange(S)[None, :] > rows  # (T, S): key after query
    if window is not None:
        hidden |= np.arange(S)[None, :] <= rows - window  # key left the window
    scores[..., hidden] = -np.inf
    sink = None if sinks is None else np.asarray(sinks, np.float32).reshape(Hkv, group, 1, 1)
    top = scores.max(axis=-1, keepdims=True) if sink is None else np.maximum(scores.max(axis=-1, keepdims=True), sink)
    probs = np.exp(scores - top)
    total = probs.sum(axis=-1, keepdims=True)
    probs /= total if sink is None else total + np.exp(sink - top)
    out = np.matmul(probs, values.transpose(1, 0, 2)[:, None])  # (Hkv, group, T, D)
    return out.transpose(2, 0, 1, 3).reshape(T, H * D).astype(np.float32, copy=False)


def softmax_topk(logits: np.ndarray, k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over all experts, then top-k (ties to the lower index); optionally renormalise the
    chosen weights to sum 1. logits (T, E) → weights (T, k) float32, ids (T, k) int64."""
    z = logits.astype(np.float32) - logits.max(axis=-1, keepdims=True)
    probs = np.exp(z)
    probs /= probs.sum(axis=-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, ids, axis=-1)
    if renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights.astype(np.float32), ids


def moe_combine(outs: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Σ_rank weights[t, r] · outs[t, r], summed in rank order. outs (T, k, H), weights (T, k) → (T, H)."""
    out = outs[:, 0] * weights[:, :1]
    for r in range(1, outs.shape[1]):
        out += outs[:, r] * weights[:, r : r + 1]
    return out
