"""Grouped-query attention over a KV cache (MHA is the case kv_heads == heads)."""
import numpy as np

from .. import kernels
from ..kv.cache import KVCache
from ..probe import timed

__all__ = ["gqa_attention"]


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
