"""Block attention residuals (Kimi K3): instead of one residual stream, the model keeps the outputs
of past blocks of layers and the running sum (the prefix) of the current block; each sub-layer
reads a softmax mix of them. There is no `transformers` oracle for K3's form (Inkling2's block
attention residual mixes normalised values with a 1/√D scale; K3 mixes the raw values, unscaled):
its check is the float64 NumPy reference in plugins/kimi_k3/tests.

    values  V = [blocks…, prefix]                                   (n, T, H)
    scores  s_i = res_proj · (V_i · rsqrt(mean V_i² + eps) ⊙ res_norm.w)     (no 1/√D)
    mix     Σ_i softmax(s)_i · V_i                                           over the raw values

in float32, every sum in one fixed order (the scores of the real model differ by ~0.02 between
summation orders): the score is one row of the C matmul, the mix is summed in block order.
"""
from __future__ import annotations

import numpy as np

from .linear import linear

__all__ = ["attn_res_mix"]


def attn_res_mix(blocks: list[np.ndarray], prefix: np.ndarray | None, norm: np.ndarray, proj, eps: float) -> np.ndarray:
    """The mix of `blocks` (each (T, H)) and `prefix` ((T, H), or None at a block's start), scored
    with `norm` (H,) (res_norm) and `proj` (1, H) (res_proj) → (T, H) float32. A single value is
    returned as it is."""
    values = list(blocks) if prefix is None else [*blocks, prefix]
    if len(values) == 1:
        return values[0]
    V = np.stack(values).astype(np.float32, copy=False)  # (n, T, H)
    n, T, H = V.shape
    ms = np.add.reduce(V * V, axis=-1, keepdims=True) / np.float32(H)
    normed = V / np.sqrt(ms + np.float32(eps)) * norm.astype(np.float32)
    scores = linear(np.ascontiguousarray(normed.reshape(n * T, H)), proj).reshape(n, T)
    scores = scores - scores.max(axis=0, keepdims=True)
    p = np.exp(scores)
    p = p / p.sum(axis=0, keepdims=True)  # (n, T)
    out = p[0][:, None] * V[0]
    for i in range(1, len(values)):  # in block order
        out = out + p[i][:, None] * V[i]
    return out.astype(np.float32)
