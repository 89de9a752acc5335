"""Shared-KV attention with sinks over a sliding window plus extra (compressed) entries, and the
grouped low-rank output projection (DeepSeek V4).

One K = V vector per token is shared by every head (multi-query, `kv_heads` 1). Each head has a
learned **sink** logit that joins the softmax and takes probability mass without contributing a
value. A query at position p sees the window's keys at positions (p − window, p] and the extra
entries its mask allows.
"""
from __future__ import annotations

import numpy as np

from ..kernels.deltanet import query_blocks  # aligned query blocks: the bits of any cut of the forward
from ..probe import timed
from .linear import linear

__all__ = ["SlidingWindow", "sink_attention", "grouped_linear", "split_rows"]

class SlidingWindow:
    """The last `window - 1` K=V rows of one layer (what the next query can still see), replaced —
    never modified in place — on every call, so `rows` is a state array as it is. A fixed-size part
    of a `kv.SequenceState` (rows that left the window are gone: it cannot be cut to a prefix):
    array "PART.window"."""

    per_token = False

    def __init__(self, window: int, dim: int):
        self.window = window
        self.rows = np.zeros((0, dim), np.float32)  # (≤ window - 1, D), oldest first
        self.varying = {"window": window - 1}

    def arrays(self) -> dict[str, np.ndarray]:
        return {"window": self.rows}

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        self.rows = np.array(arrays["window"], np.float32)

    def empty(self) -> SlidingWindow:
        return SlidingWindow(self.window, self.rows.shape[1])

    def extend(self, kv: np.ndarray) -> np.ndarray:
        """Append the new tokens' rows kv (T, D); returns the rows the new queries may see (kept + T)."""
        rows = np.concatenate([self.rows, kv.astype(np.float32, copy=False)])
        self.rows = rows[max(len(rows) - (self.window - 1), 0):].copy()
        return rows


@timed("attention")
def sink_attention(q: np.ndarray, rows: np.ndarray, start: int, window: int, extra: np.ndarray | None,
                   extra_mask: np.ndarray | None, sinks: np.ndarray, scale: float) -> np.ndarray:
    """q (T, heads, D) at positions start … start + T − 1; rows (R, D) the window's keys = values,
    the last T of them the new tokens'; extra (E, D) compressed entries with extra_mask (T, E) (None:
    none); sinks (heads,). Returns (T, heads, D): softmax over [q·k · scale …, sink] of the visible
    keys, the sink's share dropped, times the values."""
    T = len(q)
    first = start + T - len(rows)  # the position of rows[0]
    out = np.empty(q.shape, np.float32)
    sink = np.asarray(sinks, np.float32)[None, :, None]  # (1, heads, 1)
    # aligned blocks, each over exactly the keys its queries may see from the block's first query's
    # window to its last query's extra entry, a few queries each alone: a query's bits never depend
    # on where the forward began or ends (kernels.deltanet.BLOCK)
    for a, b in query_blocks(start, T):
        lo, hi = max(start + a - window + 1 - first, 0), start + b - first  # the rows seen: rows[lo:hi]
        pos, row_pos = start + np.arange(a, b), first + np.arange(lo, hi)  # (n,), (hi - lo,)
        mask = (row_pos[None, :] <= pos[:, None]) & (row_pos[None, :] > pos[:, None] - window)  # (n, hi - lo)
        keys = rows[lo:hi]
        if extra is not None:
            seen = np.flatnonzero(extra_mask[a:b].any(axis=0))
            n = int(seen[-1]) + 1 if len(seen) else 0  # the entries up to the last one seen
            keys = np.concatenate([keys, extra[:n]])  # (hi - lo + n, D)
            mask = np.concatenate([mask, extra_mask[a:b, :n]], axis=1)
        logits = np.matmul(q[a:b], keys.T) * np.float32(scale)  # (n, heads, keys)
        logits = np.where(mask[:, None, :], logits, np.float32(-np.inf))
        top = np.maximum(logits.max(axis=-1, keepdims=True), sink)  # (n, heads, 1)
        e = np.exp(logits - top)
        total = e.sum(axis=-1, keepdims=True) + np.exp(sink - top)
        out[a:b] = np.matmul(e / total, keys)
    return out


def split_rows(w, parts: int) -> list:
    """A weight (rows, cols) cut into `parts` equal row blocks, keeping its format: int8 / int4 / fp4
    scales are per row, so a row block is exact; fp8 scales cover 128 rows, so a block whose rows are
    not a multiple of 128 is dequantised to float32 first (tiny test models; real ones split at 1024)."""
    from ..quant import FP8_BLOCK, QTensor, dequantize

    if not isinstance(w, QTensor):
        return np.split(np.asarray(w), parts)
    n = w.rows // parts
    if w.kind == "fp8" and n % FP8_BLOCK:
        w = QTensor("f32", w.rows, w.cols, dequantize(w))
    per = n // FP8_BLOCK if w.kind == "fp8" else n  # scale rows per block
    return [QTensor(w.kind, n, w.cols, w.data[i * n:(i + 1) * n],
                    None if w.scales is None else w.scales[i * per:(i + 1) * per], w.act) for i in range(parts)]


def grouped_linear(x: np.ndarray, ws: list) -> np.ndarray:
    """Block-diagonal projection: x (T, g, d_in), ws g weights (d_out, d_in) → (T, g · d_out), group i
    through ws[i] (DeepSeek V4's o_a: the heads in g groups, each projected on its own)."""
    return np.concatenate([linear(np.ascontiguousarray(x[:, i]), w) for i, w in enumerate(ws)], axis=-1)
