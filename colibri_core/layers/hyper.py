"""Manifold-constrained hyper-connections (mHC; DeepSeek V4): the residual stream is `n` parallel
streams, mixed around every sub-block (attention, MoE) by weights computed from the streams.

For streams h (T, n, H), a `HyperConnection` computes from RMS(flatten(h)) · fn (unweighted RMS over
the n·H values, in float32):

    pre  = σ(a_pre · s_pre + b_pre) + eps            (T, n)   collapses the streams into the block's input
    post = 2 σ(a_post · s_post + b_post)              (T, n)   spreads the block's output over the streams
    comb = softmax(a_comb · s_comb + b_comb) + eps    (T, n, n) mixes the streams themselves, made
           (nearly) doubly stochastic by Sinkhorn: a column normalisation, then `iters - 1` rounds of
           row and column normalisations (each sum + eps)

    block input  x = Σ_j pre_j h_j                                 (T, H)
    new streams  h'_k = post_k · block(x) + Σ_j comb_jk h_j         (T, n, H)

`HyperHead` collapses the streams once more before the final norm: Σ_j (σ(a_j s + b_j) + eps) h_j.
"""
from __future__ import annotations

import numpy as np

from .linear import linear

__all__ = ["HyperConnection", "HyperHead"]


def _rms(flat: np.ndarray, eps: float) -> np.ndarray:
    """Unweighted RMSNorm over the last axis, float32. (T, D) → (T, D)."""
    flat = flat.astype(np.float32, copy=False)
    return flat / np.sqrt(np.mean(flat * flat, axis=-1, keepdims=True) + np.float32(eps))


def _sigmoid(a: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.float32(1) / (np.float32(1) + np.exp(-a))


class HyperConnection:
    """The mHC around one sub-block. fn ((2 + n) n, n H), base ((2 + n) n,), scale (3,) float32."""

    def __init__(self, fn, base: np.ndarray, scale: np.ndarray, n: int, iters: int, eps: float, norm_eps: float):
        self.fn, self.base, self.scale = fn, np.asarray(base, np.float32), np.asarray(scale, np.float32)
        self.n, self.iters, self.eps, self.norm_eps = n, iters, np.float32(eps), norm_eps

    def weights(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Streams h (T, n, H) → pre (T, n), post (T, n), comb (T, n, n), all float32."""
        T, n, _ = h.shape
        mixes = linear(_rms(h.reshape(T, -1), self.norm_eps), self.fn)  # (T, (2 + n) n)
        b, s = self.base, self.scale
        pre = _sigmoid(mixes[:, :n] * s[0] + b[:n]) + self.eps
        post = np.float32(2) * _sigmoid(mixes[:, n:2 * n] * s[1] + b[n:2 * n])
        logits = mixes[:, 2 * n:].reshape(T, n, n) * s[2] + b[2 * n:].reshape(n, n)
        e = np.exp(logits - logits.max(axis=-1, keepdims=True))
        comb = e / e.sum(axis=-1, keepdims=True) + self.eps  # softmax over the last axis
        comb = comb / (comb.sum(axis=-2, keepdims=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(axis=-1, keepdims=True) + self.eps)
            comb = comb / (comb.sum(axis=-2, keepdims=True) + self.eps)
        return pre.astype(np.float32), post.astype(np.float32), comb.astype(np.float32)

    @staticmethod
    def collapse(h: np.ndarray, pre: np.ndarray) -> np.ndarray:
        """The block's input Σ_j pre_j h_j: h (T, n, H), pre (T, n) → (T, H)."""
        return (pre[:, :, None] * h).sum(axis=1, dtype=np.float32)

    @staticmethod
    def expand(h: np.ndarray, out: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
        """New streams post_k · out + Σ_j comb_jk h_j: h (T, n, H), out (T, H) → (T, n, H)."""
        return post[:, :, None] * out[:, None, :] + np.matmul(comb.transpose(0, 2, 1), h)


class HyperHead:
    """The final collapse of the streams: fn (n, n H), base (n,), scale (1,) float32."""

    def __init__(self, fn, base: np.ndarray, scale: np.ndarray, eps: float, norm_eps: float):
        self.fn, self.base, self.scale = fn, np.asarray(base, np.float32), np.asarray(scale, np.float32)
        self.eps, self.norm_eps = np.float32(eps), norm_eps

    def __call__(self, h: np.ndarray) -> np.ndarray:
        """Streams h (T, n, H) → (T, H)."""
        T = h.shape[0]
        mixes = linear(_rms(h.reshape(T, -1), self.norm_eps), self.fn)  # (T, n)
        pre = _sigmoid(mixes * self.scale[0] + self.base) + self.eps
        return HyperConnection.collapse(h, pre.astype(np.float32))
