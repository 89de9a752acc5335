"""Matrix products over resident weights, and resident tensors as float32: what every block (and
every plugin's forward, through `colibri_core.model`, which re-exports them) multiplies with.
A weight is a QTensor (computed on by the C kernels in its own format) or a float32 ndarray kept
unquantised."""
from __future__ import annotations

import numpy as np

from .. import batch, kernels
from ..quant import QTensor, dequantize


def linear(x: np.ndarray, w) -> np.ndarray:
    """x (T, in) @ wᵀ → (T, out); `w` a QTensor (C kernel) or a float32 ndarray kept unquantised.
    A QTensor's product is one C call for all the generations of a batch (batch.py: their rows
    stacked, the weights read once, each row's bits its own)."""
    if isinstance(w, QTensor):
        return batch.together(("linear", id(w)), x, batch.by_rows(lambda rows: kernels.matmul(w, rows)))
    return x @ w.T  # NumPy's product, per generation: its bits may depend on the number of rows


def linears(x: np.ndarray, ws) -> list[np.ndarray]:
    """``[linear(x, w) for w in ws]``; quantised weights of one width go in one C call (same bits),
    for all the generations of a batch."""
    if all(isinstance(w, QTensor) for w in ws) and len({w.cols for w in ws}) == 1:
        ws = list(ws)
        return batch.together(("linears", *map(id, ws)), x, batch.by_rows(lambda rows: kernels.matmul_multi(ws, rows)))
    return [linear(x, w) for w in ws]


def dense(w) -> np.ndarray:
    """A resident tensor as a float32 ndarray: a QTensor dequantised (a 2-D tensor kept f32 arrives as
    a QTensor of kind f32, e.g. a position bias or a hash table), an array as it is."""
    return dequantize(w) if isinstance(w, QTensor) else np.asarray(w, np.float32)


def embed(ids: np.ndarray, table) -> np.ndarray:
    """Rows `ids` (T,) of an embedding table (QTensor or ndarray (V, H)) as float32 (T, H)."""
    if not isinstance(table, QTensor):
        return np.asarray(table[ids], np.float32)
    rows = QTensor(table.kind, len(ids), table.cols, table.data[ids],
                   None if table.scales is None else table.scales[ids])
    return dequantize(rows)
