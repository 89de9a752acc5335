"""Grouped-query attention over a KV cache (MHA is the case kv_heads == heads)."""
import numpy as np

from ..kv.cache import KVCache
from ..probe import timed


@timed("attention")
def gqa_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, cache: KVCache, scale: float) -> np.ndarray:
    """Causal attention of new tokens over everything cached so far.

    q (T, H, D) for the T new tokens; k, v (T, Hkv, D) are appended to `cache` first.
    Returns (T, H * D).
    """
    start = cache.length
    cache.append(k, v)
    keys, values = cache.view()  # (S, Hkv, D), S = start + T
    T, H, D = q.shape
    S, Hkv, _ = keys.shape
    group = H // Hkv
    qg = q.reshape(T, Hkv, group, D).transpose(1, 2, 0, 3)  # (Hkv, group, T, D)
    scores = np.matmul(qg, keys.transpose(1, 2, 0)[:, None]) * np.float32(scale)  # (Hkv, group, T, S)
    future = np.arange(S)[None, :] > (start + np.arange(T))[:, None]  # (T, S): key after query
    scores[..., future] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.matmul(probs, values.transpose(1, 0, 2)[:, None])  # (Hkv, group, T, D)
    return out.transpose(2, 0, 1, 3).reshape(T, H * D).astype(np.float32, copy=False)
