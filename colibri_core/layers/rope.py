"""Rotary position embeddings (the default / ``rotate_half`` layout)."""
import numpy as np

from .. import kernels

__all__ = ["Rope", "apply_rotate_half", "apply_interleaved"]


class Rope:
    """Default RoPE for heads of width `dim`, computed in float32 as `transformers` does."""

    def __init__(self, dim: int, theta: float):
        self.inv_freq = (1.0 / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))).astype(np.float32)  # (dim/2,)

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin of shape (T, dim) for integer positions (T,)."""
        freqs = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]  # (T, dim/2)
        emb = np.concatenate([freqs, freqs], axis=-1)  # (T, dim)
        return np.cos(emb), np.sin(emb)


def apply_rotate_half(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x (T, heads, dim) rotated by cos/sin (T, dim): x*cos + rotate_half(x)*sin (one C call, the same
    float32 operations as kernels.reference.rope_rotate_half, so the same bits)."""
    return kernels.rope_rotate_half(x, cos, sin)


def apply_interleaved(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Interleaved-pair RoPE (DeepSeek, GLM-5): pairs (x0, x1), (x2, x3), … each rotated by one
    frequency. x (T, heads, dim), cos/sin (T, dim) from `Rope.cos_sin` (only the first half is read).

    The result is laid out de-interleaved, [rotated evens | rotated odds], exactly as
    `transformers`' apply_rotary_pos_emb_interleave returns it; queries and keys get the same
    permutation, so their dot products are those of the interleaved layout.
    """
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]  # (T, 1, dim/2)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
