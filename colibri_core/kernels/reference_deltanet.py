"""float64 NumPy references for the Gated DeltaNet kernels in csrc/deltanet.c.

These are the definitions, written as plainly as possible (token by token, in float64); the C
kernels — the recurrent form and the chunked form alike — must agree with them to float32
rounding. Shapes and the math are documented in csrc/deltanet.h.
"""
from __future__ import annotations

import numpy as np

L2NORM_EPS = 1e-6


def causal_conv1d(x: np.ndarray, weight: np.ndarray, state: np.ndarray, silu: bool = True
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal conv over time. x (n, C), weight (C, K), state (K-1, C) the previous inputs.

    Returns (out (n, C), new state (K-1, C)), float64.
    """
    x, weight, state = (np.asarray(a, np.float64) for a in (x, weight, state))
    n, K = x.shape[0], weight.shape[1]
    xin = np.concatenate([state, x])  # (K-1+n, C)
    out = np.zeros(x.shape, np.float64)
    for j in range(K):
        out += weight[:, j] * xin[j : j + n]
    if silu:
        out = out / (1.0 + np.exp(-out))
    return out, xin[xin.shape[0] - (K - 1):].copy()


def l2norm(x: np.ndarray) -> np.ndarray:
    """x / sqrt(Σx² + 1e-6) over the last axis."""
    return x / np.sqrt((x * x).sum(axis=-1, keepdims=True) + L2NORM_EPS)


def gated_delta_rule(q, k, v, g, beta, state) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule, token by token, in float64.

    q, k (n, Hk, dk); v (n, Hv, dv); g, beta (n, Hv); state (Hv, dk, dv).
    Returns (out (n, Hv, dv), new state (Hv, dk, dv)).
    """
    q, k, v, g, beta, S = (np.array(a, np.float64) for a in (q, k, v, g, beta, state))
    group = v.shape[1] // k.shape[1]
    q = np.repeat(l2norm(q), group, axis=1) / np.sqrt(q.shape[-1])  # (n, Hv, dk)
    k = np.repeat(l2norm(k), group, axis=1)  # (n, Hv, dk)
    out = np.empty(v.shape, np.float64)
    for t in range(v.shape[0]):
        S *= np.exp(g[t])[:, None, None]
        kv = np.einsum("hij,hi->hj", S, k[t])  # (Hv, dv): Sᵀ k
        delta = (v[t] - kv) * beta[t][:, None]
        S += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hij,hi->hj", S, q[t])
    return out, S


def deltanet_block(x, in_qkv, in_z, in_b, in_a, conv_weight, conv_state, neg_a, dt_bias, norm, out_proj, *,
                   key_heads: int, key_dim: int, eps: float, state) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A whole Gated DeltaNet token mixer (csrc/deltanet.h's `deltanet_block`) in float64; matrices as
    float arrays (dequantised). x (n, H); conv_state (K-1, C); state (Hv, dk, dv).

    Returns (out (n, H), new conv_state, new state).
    """
    x = np.asarray(x, np.float64)
    mixed, z, b, a = (x @ np.asarray(w, np.float64).T for w in (in_qkv, in_z, in_b, in_a))
    qkv, conv_state = causal_conv1d(mixed, conv_weight, conv_state)
    n, nk, hv = x.shape[0], key_heads * key_dim, b.shape[1]
    q, k = qkv[:, :nk].reshape(n, key_heads, key_dim), qkv[:, nk : 2 * nk].reshape(n, key_heads, key_dim)
    v = qkv[:, 2 * nk :].reshape(n, hv, -1)
    beta = 1.0 / (1.0 + np.exp(-b))
    y = a + np.asarray(dt_bias, np.float64)
    g = np.asarray(neg_a, np.float64) * np.where(y > 20, y, np.log1p(np.exp(np.minimum(y, 20))))
    o, state = gated_delta_rule(q, k, v, g, beta, state)  # (n, Hv, dv)
    z = z.reshape(o.shape)
    o = o / np.sqrt((o * o).mean(axis=-1, keepdims=True) + eps) * np.asarray(norm, np.float64) * (z / (1.0 + np.exp(-z)))
    return o.reshape(n, -1) @ np.asarray(out_proj, np.float64).T, conv_state, state
