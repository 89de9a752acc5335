"""DeepSeek Sparse Attention (DSA): the lightning indexer and IndexShare.

The indexer scores every cached key s for each new query t,

    I(t, s) = Σ_h w_h(t) · ReLU(q_h(t) · k(s) / sqrt(D)),   w(t) = weights_proj(x_t) / sqrt(n_heads)

in float32, and each query attends only to its `topk` best-scoring causal keys. q comes from the
attention's query latent (``wq_b(q_resid)``, n_heads × D), k is one key per token
(``LayerNorm(wk x)``, D, cached: it is part of the per-token state); the first ``rope_dim`` dims
of both get interleaved RoPE. **IndexShare**: a layer marked "shared" runs no indexer and reuses
the selection of the layer before it. With S ≤ topk every key is selected, which is dense
attention exactly. Reference: transformers/models/glm_moe_dsa/modeling_glm_moe_dsa.py
(GlmMoeDsaIndexer).
"""
from __future__ import annotations

import numpy as np

from ..kernels.deltanet import query_blocks
from ..kv.cache import Rows
from .linear import linear
from .rope import apply_interleaved

__all__ = ["Indexer"]


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm over the last axis (biased variance), float32. x (..., D)."""
    x = x.astype(np.float32, copy=False)
    mean = x.mean(axis=-1, keepdims=True, dtype=np.float32)
    c = x - mean
    var = np.mean(c * c, axis=-1, keepdims=True, dtype=np.float32)
    return c / np.sqrt(var + np.float32(eps)) * weight + bias


def select_topk(scores: np.ndarray, start: int, topk: int) -> np.ndarray:
    """keep (T, S) bool: each query's `topk` best causal keys by `scores` (T, S); query t sits at
    position start + t. Ties go to the earlier key; every causal key is kept when there are ≤ topk."""
    T, S = scores.shape
    future = np.arange(S)[None, :] > (start + np.arange(T))[:, None]  # (T, S)
    if topk >= S:
        return np.ones((T, S), bool)
    ranked = np.where(future, -np.inf, scores)
    kth = np.partition(ranked, S - topk, axis=-1)[:, S - topk, None]  # (T, 1): each row's topk-th best, O(S)
    keep = ranked > kth
    ties = ranked == kth  # fill the rest with the earliest keys scoring exactly kth
    keep |= ties & (np.cumsum(ties, axis=-1) <= topk - keep.sum(axis=-1, keepdims=True))
    return keep


class Indexer:
    """One layer's lightning indexer.

    wq_b (n_heads·D, q_lora), wk (D, H_model), k_norm weight/bias (D,), weights_proj (n_heads, H_model).
    """

    def __init__(self, wq_b, wk, k_norm_weight, k_norm_bias, weights_proj, *, n_heads: int, head_dim: int,
                 rope_dim: int, topk: int, eps: float = 1e-6):
        self.wq_b, self.wk, self.weights_proj = wq_b, wk, weights_proj
        self.k_norm_weight, self.k_norm_bias = k_norm_weight, k_norm_bias
        self.n_heads, self.head_dim, self.rope_dim, self.topk, self.eps = n_heads, head_dim, rope_dim, topk, eps

    def _rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """Interleaved RoPE on the first rope_dim dims of x (T, heads, D)."""
        return np.concatenate([apply_interleaved(x[..., : self.rope_dim], cos, sin), x[..., self.rope_dim:]], axis=-1)

    def select(self, x: np.ndarray, q_resid: np.ndarray, cos: np.ndarray, sin: np.ndarray, keys: Rows) -> np.ndarray:
        """Append the T new tokens' keys to `keys`; keep (T, S) bool: each new query's `topk` best
        causal keys by index score (`select_topk`)."""
        T = len(x)
        k = layer_norm(linear(x, self.wk), self.k_norm_weight, self.k_norm_bias, self.eps)  # (T, D)
        keys.append(self._rope(k[:, None], cos, sin)[:, 0])
        q = self._rope(linear(q_resid, self.wq_b).reshape(T, self.n_heads, self.head_dim), cos, sin)  # (T, nh, D)
        w = linear(x, self.weights_proj) * np.float32(self.n_heads ** -0.5)  # (T, nh)
        k = keys.view()  # (S, D)
        start = len(k) - T  # the first query's position
        keep = np.zeros((T, len(k)), bool)  # (T, S); a block's later keys are future ones, never kept
        # as attention's blocks (mla.py): bits whatever the forward's cut, scratch (block, nh, keys)
        for a, b in query_blocks(start, T):
            end = start + b
            s = np.matmul(q[a:b], k[:end].T) * np.float32(self.head_dim ** -0.5)  # (block, nh, end)
            np.maximum(s, 0, out=s)  # ReLU
            keep[a:b, :end] = select_topk(np.matmul(w[a:b, None, :], s)[:, 0], start + a, self.topk)
        return keep
