"""Grouped-query attention over a KV cache (MHA is the case kv_heads == heads)."""
import numpy as np

from .. import kernels
from ..kv.cache import KVCache
from ..probe import timed

__all__ = ["gqa_attention", "gqa_block", "AttnBlock"]

AttnBlock = kernels.AttnBlock  # a layer's weights for `gqa_block`, built once by the plugin


@timed("attention")
def gqa_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, cache: KVCache, scale: float) -> np.ndarray:
    """Causal attention of new tokens over everything cached so far.

    q (T, H, D) for the T new tokens; k, v (T, Hkv, D) are appended to `cache` first.
    Returns (T, H * D). One C call (kernels.attention; NumPy reference: kernels.reference.attention).
    """
    start = cache.length
    cache.append(k, v)
    keys, values = cache.view()  # (S, Hkv, D), S = start + T
    return kernels.attention(q, keys, values, start, scale)


@timed("attention")
def gqa_block(block: kernels.AttnBlock, h: np.ndarray, cache: KVCache, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """The whole pre-norm attention sub-block of a decoder layer in one C call: h (T, H) →
    h + o_proj(attention(RoPE(qk_norm(q, k)), v)) over `cache` with the T new tokens appended;
    cos, sin (T, D). The same bits as the steps one by one (rms_norm, `linears`, the q/k norms,
    `apply_rotate_half`, `gqa_attention`, `linear`, +), with one crossing into C instead of ~10.
    """
    start = cache.length
    need = cache.reserve(len(h))
    out = block(h, cos, sin, cache.k, cache.v, start)
    cache.length = need
    return out
