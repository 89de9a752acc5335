"""Rotary position embeddings: the default frequencies and YaRN's, the ``rotate_half`` layout and
the interleaved-pair layouts."""
import math

import numpy as np

from .. import kernels

__all__ = ["Rope", "yarn_inv_freq", "apply_rotate_half", "apply_partial_rotate_half", "apply_interleaved", "rotate_tail_interleaved"]


class Rope:
    """RoPE for heads of width `dim`, computed in float32 as `transformers` does: the default
    frequencies θ^(-2i/dim), or the given `inv_freq` (dim/2,) (e.g. `yarn_inv_freq`)."""

    def __init__(self, dim: int, theta: float, inv_freq: np.ndarray | None = None):
        if inv_freq is None:
            inv_freq = 1.0 / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
        self.inv_freq = np.asarray(inv_freq, np.float32)  # (dim/2,)

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin of shape (T, dim) for integer positions (T,)."""
        freqs = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]  # (T, dim/2)
        emb = np.concatenate([freqs, freqs], axis=-1)  # (T, dim)
        return np.cos(emb), np.sin(emb)


def yarn_inv_freq(dim: int, theta: float, factor: float, original_max_position: int, beta_fast: float = 32,
                  beta_slow: float = 1, truncate: bool = True) -> np.ndarray:
    """YaRN's frequencies (dim/2,) float32, as transformers' `_compute_yarn_parameters`: each frequency
    blends θ^(-2i/dim) (extrapolated, high frequencies) with it divided by `factor` (interpolated, low
    frequencies) along a linear ramp between the dimensions that turn `beta_fast` and `beta_slow`
    times over `original_max_position` tokens. (The attention factor is the caller's: DeepSeek V4
    forces it to 1.)"""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))  # (dim/2,)
    extrapolation = np.float32(1) - ramp.astype(np.float32)
    inv = (np.float32(1) / (np.float32(factor) * pos_freqs)) * (np.float32(1) - extrapolation) + (np.float32(1) / pos_freqs) * extrapolation
    return inv.astype(np.float32)


def apply_rotate_half(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x (T, heads, dim) rotated by cos/sin (T, dim): x*cos + rotate_half(x)*sin (one C call, the same
    float32 operations as kernels.reference.rope_rotate_half, so the same bits)."""
    return kernels.rope_rotate_half(x, cos, sin)


def apply_partial_rotate_half(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x (T, heads, D) with rotate_half RoPE on its leading cos.shape[-1] dims; the rest unchanged.

    cos, sin (T, rotary_dim) from `Rope(rotary_dim, theta)`."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return apply_rotate_half(x, cos, sin)
    return np.concatenate([apply_rotate_half(x[..., :r], cos, sin), x[..., r:]], axis=-1)


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


def rotate_tail_interleaved(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Interleaved-pair RoPE on the *trailing* rope dims of x, in place of them (DeepSeek V4: each head
    is [nope | rope], pairs (x0, x1), (x2, x3), … of the rope part rotated by one frequency each,
    the layout kept). x (T, heads, D); cos, sin (T, r) from `Rope.cos_sin` (r the rope width; only
    the first half is read). The inverse rotation is (cos, -sin).
    """
    r = cos.shape[-1]
    c, s = cos[:, None, : r // 2], sin[:, None, : r // 2]  # (T, 1, r/2)
    rope = x[..., x.shape[-1] - r:]
    x0, x1 = rope[..., 0::2], rope[..., 1::2]
    out = np.array(x, np.float32)
    out[..., x.shape[-1] - r::2] = x0 * c - x1 * s
    out[..., x.shape[-1] - r + 1::2] = x1 * c + x0 * s
    return out
