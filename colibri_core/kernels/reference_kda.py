"""float64 NumPy reference for Kimi Delta Attention's recurrence (colibri_core/layers/kda.py).

The definition, token by token in float64: the chunked and recurrent forms of `kda_rule` must agree
with it to float32 rounding.
"""
from __future__ import annotations

import numpy as np

from .reference_deltanet import l2norm


def kda_rule(q, k, v, g, beta, state) -> tuple[np.ndarray, np.ndarray]:
    """q, k, v, g (n, Hh, d) (g the per-channel log decay); beta (n, Hh); state (Hh, d, d).

        S ← diag(exp g_t) S;  δ = β (v − Sᵀ k̂);  S += k̂ ⊗ δ;  o = Sᵀ q̂
        q̂ = l2norm(q) · d^-½,  k̂ = l2norm(k)

    Returns (out (n, Hh, d), new state (Hh, d, d)), float64."""
    q, k, v, g, beta, S = (np.array(a, np.float64) for a in (q, k, v, g, beta, state))
    q = l2norm(q) / np.sqrt(q.shape[-1])
    k = l2norm(k)
    out = np.empty(v.shape, np.float64)
    for t in range(v.shape[0]):
        S *= np.exp(g[t])[:, :, None]
        delta = (v[t] - np.einsum("hij,hi->hj", S, k[t])) * beta[t][:, None]
        S += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hij,hi->hj", S, q[t])
    return out, S
