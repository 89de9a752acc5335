"""Grouped-query attention over a KV cache (MHA is the case kv_heads == heads)."""
import numpy as np

from .. import batch, kernels
from ..kv.cache import KVCache
from ..probe import timed

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
    """`gqa_block` for each (h, cache, cos, sin) of a batch's generations, in one C call: the
    projections on every generation's rows stacked (the weights read once), attention per cache."""
    lengths = [len(p[0]) for p in parts]
    starts = [p[1].reserve(n) - n for p, n in zip(parts, lengths)]  # a WindowKV may move its rows (and length) first
    h, cos, sin = (batch.stack([p[i] for p in parts]) for i in (0, 2, 3))
    out = block.seqs(h, lengths, cos, sin, [(p[1].k, p[1].v, s) for p, s in zip(parts, starts)])
    for p, s, n in zip(parts, starts, lengths):
        p[1].length = s + n
    return batch.cut(out, lengths)
