"""Gated attention (Qwen3.5/3.6 full-attention layers): GQA whose output is scaled by a per-element
sigmoid gate that the query projection produces alongside the query, with per-head zero-centred
QK-norm and partial RoPE (only the leading `rotary_dim` dims of each head rotate).

    q_proj x → per head [q (D) | gate (D)];  q = qnorm(q), k = knorm(k_proj x), v = v_proj x
    q, k ← rotate_half RoPE on dims [0, rotary_dim), the rest passes through
    out = o_proj( attention(q, k, v) · sigmoid(gate) )

These are the steps; a gated `AttnBlock` (`gated=True, rotary_dim=…`, the zero-centred norms' weights
as 1 + w) is the same sub-block, input norm and residual included, in one C call with the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import kernels
from ..kv.cache import KVCache
from .attention import gqa_attention
from .linear import linear, linears
from .norm import rms_norm_zero_centred
from .rope import apply_partial_rotate_half

__all__ = ["GatedAttention", "sigmoid"]


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)) in float32 (exp overflowing to inf gives 0, as it should)."""
    x = x.astype(np.float32, copy=False)
    with np.errstate(over="ignore"):
        return np.float32(1) / (np.float32(1) + np.exp(-x))


@dataclass
class GatedAttention:
    """One gated-attention layer's weights and dimensions (matrices are QTensors or float32 arrays)."""

    q_proj: Any  # (heads * 2D, H): per head [q | gate]
    k_proj: Any  # (kv_heads * D, H)
    v_proj: Any  # (kv_heads * D, H)
    o_proj: Any  # (H, heads * D)
    q_norm: np.ndarray  # (D,) zero-centred RMSNorm weight, per head
    k_norm: np.ndarray  # (D,)
    heads: int
    kv_heads: int
    head_dim: int  # D
    eps: float
    biases: dict | None = None  # "q", "k", "v", "o" -> (out,) when the projections have biases

    def __call__(self, x: np.ndarray, cache: KVCache, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """x (T, H) normalised hidden states; cos, sin (T, rotary_dim) at the tokens' positions → (T, H)."""
        T, D = x.shape[0], self.head_dim
        b = self.biases or {}
        qg, k, v = linears(x, (self.q_proj, self.k_proj, self.v_proj))  # one C call for the three
        qg, k, v = (self._bias(qg, b.get("q")), self._bias(k, b.get("k")), self._bias(v, b.get("v")))
        qg = qg.reshape(T, self.heads, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(T, self.heads * D)
        k, v = k.reshape(T, self.kv_heads, D), v.reshape(T, self.kv_heads, D)
        q = apply_partial_rotate_half(rms_norm_zero_centred(q, self.q_norm, self.eps), cos, sin)  # (T, heads, D)
        k = apply_partial_rotate_half(rms_norm_zero_centred(k, self.k_norm, self.eps), cos, sin)  # (T, kv_heads, D)
        attn = gqa_attention(q, k, v, cache, D ** -0.5)  # (T, heads * D)
        return self._bias(linear(attn * kernels.sigmoid(gate), self.o_proj), b.get("o"))  # the gated AttnBlock's bits

    @staticmethod
    def _bias(y: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        return y if bias is None else y + bias
