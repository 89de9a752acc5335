"""Grouped-query attention over a KV cache (MHA is the case kv_heads == heads)."""
import numpy as np

from .. import batch, kernels
from ..kv.cache import KVCache
from ..probe import timed
from .linear import linear, linears
from .norm import rms_norm
from .rope import apply_partial_rotate_half

__all__ = ["gqa_attention", "gqa_block", "AttnBlock"]

AttnBlock = kernels.AttnBlock  # a layer's weights for `gqa_block`, built once by the plugin


@timed("attention")
def gqa_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, cache: KVCache, scale: float,
                  window: int | None = None, sinks: np.ndarray | None = None) -> np.ndarray:
    """Causal attention of new tokens over everything cached so far (the last `window` rows with a
    sliding window; `sinks` (H,): a logit per head in the softmax, see kernels.attention).

    q (T, H, D) for the T new tokens; k, v (T, Hkv, D) are appended to `cache` (a `KVCache`, or a
    `WindowKV`) first. Returns (T, H * D). One C call (kernels.attention; NumPy reference:
    kernels.reference.attention).
    """
    cache.append(k, v)
    keys, values = cache.view()  # (S, Hkv, D), the new tokens' the last T
    return kernels.attention(q, keys, values, len(keys) - len(q), scale, window, sinks)


@timed("attention")
def gqa_block(block: kernels.AttnBlock, h: np.ndarray, cache: KVCache, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """The whole pre-norm attention sub-block of a decoder layer in one C call: h (T, H) →
    h + o_proj(attention(RoPE(qk_norm(q, k)), v)) over `cache` with the T new tokens appended;
    cos, sin (T, rotary_dim). The same bits as the steps one by one (rms_norm, `linears`, the q/k norms,
    `apply_rotate_half`, `gqa_attention`, `linear`, +), with one crossing into C instead of ~10.
    """
    return batch.together(("attn_block", id(block)), (h, cache, cos, sin), lambda parts: _blocks(block, parts))


def _blocks(block: kernels.AttnBlock, parts: list[tuple]) -> list[np.ndarray]:
    """`gqa_block` for each (h, cache, cos, sin) of a batch's generations: alone, the fused C call;
    several, the same steps in the same order with each row-wise step run once on every
    generation's rows stacked (the projections' weights read once) and attention per cache."""
    if len(parts) == 1:
        h, cache, cos, sin = parts[0]
        need = cache.reserve(len(h))  # a WindowKV may move its rows (and its length) first
        out = block(h, cos, sin, cache.k, cache.v, need - len(h))
        cache.length = need
        return [out]
    c = block._c  # the block's settings, as its C call reads them
    H, Hkv, D = c.heads, c.kv_heads, c.head_dim
    h, cos, sin = (np.concatenate([p[i] for p in parts]) for i in (0, 2, 3))  # (T_all, …)
    T = len(h)
    q, k, v = linears(rms_norm(h, block.norm, c.eps), (block.wq, block.wk, block.wv))
    q, k, v = (t if b is None else t + b for t, b in zip((q, k, v), block.biases))
    if block.gated:  # per head [q | gate]
        qg = q.reshape(T, H, 2 * D)
        q, gate = qg[..., :D].reshape(T, -1), qg[..., D:].reshape(T, -1)
    if c.qk_norm == kernels.lib.QK_NORM_HEAD:
        q = rms_norm(q.reshape(T, H, D), block.q_norm, c.eps).reshape(T, -1)
        k = rms_norm(k.reshape(T, Hkv, D), block.k_norm, c.eps).reshape(T, -1)
    elif c.qk_norm == kernels.lib.QK_NORM_WHOLE:
        q, k = rms_norm(q, block.q_norm, c.eps), rms_norm(k, block.k_norm, c.eps)
    if c.clip != np.inf:
        q, k, v = (np.clip(t, -c.clip, c.clip) for t in (q, k, v))
    q = apply_partial_rotate_half(q.reshape(T, H, D), cos, sin)
    k = apply_partial_rotate_half(k.reshape(T, Hkv, D), cos, sin)
    v = v.reshape(T, Hkv, D)
    cuts = np.cumsum([len(p[0]) for p in parts])[:-1]
    attended = [gqa_attention(qi, ki, vi, p[1], c.scale, block.window or None, block.sinks)
                for qi, ki, vi, p in zip(*(np.split(t, cuts) for t in (q, k, v)), parts)]
    attended = np.concatenate(attended)  # (T, H D)
    o = linear(attended * kernels.sigmoid(gate) if block.gated else attended, block.wo)
    return np.split(h + (o if block.biases[3] is None else o + block.biases[3]), cuts)
