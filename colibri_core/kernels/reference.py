"""NumPy references for the C kernels in csrc/, computed in float32 in the C kernels' grouping.

Each function computes what its C kernel computes, with the same float32 operations in the same
grouping:

- ``f32``:  ``y = x @ W.T``
- ``int8``: ``y = (x @ q.T) * scale`` — the row's scale applied once, after the dot product
- ``int4``: ``y = sum over groups g, in order, of (x[:, g] @ q[:, g].T) * float32(scale[:, g])``
- ``expert_ffn``: ``down(silu(gate x) * (up x))`` from the three products above,
  ``silu(a) = a / (1 + exp(-a))`` in float32.

Only the order of the additions inside one row (f32, int8) or one group (int4) differs — NumPy's
(BLAS) here, strictly sequential in C — so C and reference agree within float32 rounding, not bit
for bit. The numbers come from `colibri_core.quant` (`dequantize`, `int4_values`), the one
definition of the formats; tests/test_kernels.py also checks these references against a float64
``x @ dequantize(w).T``.
"""
from __future__ import annotations

import numpy as np

from colibri_core.quant import INT4_GROUP, QTensor, dequantize, int4_values


def matmul(w: QTensor, x: np.ndarray) -> np.ndarray:
    """``x @ dequantize(w).T``: x float32 ``[n, w.cols]`` -> float32 ``[n, w.rows]``."""
    x = np.asarray(x, np.float32)
    if w.kind == "f32":
        return x @ dequantize(w).T
    if w.kind == "int8":
        q = w.data.astype(np.float32)  # [rows, cols]
        return (x @ q.T) * w.scales.astype(np.float32)
    if w.kind == "int4":
        q = int4_values(w).astype(np.float32)  # [rows, cols]
        scales = w.scales.astype(np.float32)  # [rows, ngroups]
        y = np.zeros((x.shape[0], w.rows), np.float32)
        for g in range(scales.shape[1]):
            cols = slice(g * INT4_GROUP, min((g + 1) * INT4_GROUP, w.cols))
            y += (x[:, cols] @ q[:, cols].T) * scales[:, g]
        return y
    raise ValueError(f"unknown quantisation {w.kind!r}")


def matmul_t(w: QTensor, x: np.ndarray) -> np.ndarray:
    """``x @ dequantize(w)``: x float32 ``[n, w.rows]`` -> float32 ``[n, w.cols]``, summed over the
    rows in order as the C kernel does (so the two agree bit for bit)."""
    x = np.asarray(x, np.float32)
    wd = dequantize(w)
    y = np.zeros((x.shape[0], w.cols), np.float32)
    for r in range(w.rows):
        y += x[:, r : r + 1] * wd[r]
    return y


def silu(a: np.ndarray) -> np.ndarray:
    """``a / (1 + exp(-a))`` in float32 (exp overflowing to inf gives -0, as in C)."""
    a = np.asarray(a, np.float32)
    with np.errstate(over="ignore"):
        return a / (np.float32(1) + np.exp(-a))


def expert_ffn(gate: QTensor, up: QTensor, down: QTensor, x: np.ndarray) -> np.ndarray:
    """``down(silu(gate x) * (up x))``: x float32 ``[n, H]`` -> float32 ``[n, H]``;
    gate, up ``[I, H]``, down ``[H, I]``."""
    h = silu(matmul(gate, x)) * matmul(up, x)  # [n, I]
    return matmul(down, h)
