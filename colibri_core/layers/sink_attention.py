"""Shared-KV attention with sinks over a sliding window plus extra (compressed) entries, and the
grouped low-rank output projection (DeepSeek V4).

One K = V vector per token is shared by every head (multi-query, `kv_heads` 1). Each head has a
learned **sink** logit that joins the softmax and takes probability mass without contributing a
value. A query at position p sees the window's keys at positions (p − window, p] and the extra
entries its mask allows.
"""
from __future__ import annotations

import numpy as np

from ..kernels.deltanet import EXACT_BATCH  # a short forward: every query computed as if alone
from ..probe import timed
from .linear import linear

__all__ = ["SlidingWindow", "sink_attention", "grouped_linear", "split_rows"]

QUERY_BLOCK = 64  # queries per block: bounds the (block, heads, keys) logits of a long prefill


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
    T, heads, _ = q.shape
    R = len(rows)
    row_pos = start + T - R + np.arange(R)  # (R,) position of each window row
    keys = rows if extra is None else np.concatenate([rows, extra])  # (R + E, D)
    out = np.empty(q.shape, np.float32)
    sink = np.asarray(sinks, np.float32)[None, :, None]  # (1, heads, 1)
    if T <= EXACT_BATCH:  # each query over exactly the keys it sees: the bits it gets alone (a verified draft)
        for t in range(T):
            last = R - T + t  # the row of the query's own token
            seen = rows[max(last - window + 1, 0):last + 1]
            if extra is not None:
                seen = np.concatenate([seen, extra[np.flatnonzero(extra_mask[t])]])
            logits = np.matmul(q[t:t + 1], seen.T) * np.float32(scale)  # (1, heads, n)
            top = np.maximum(logits.max(axis=-1, keepdims=True), sink)
            e = np.exp(logits - top)
            out[t:t + 1] = np.matmul(e / (e.sum(axis=-1, keepdims=True) + np.exp(sink - top)), seen)
        return out
    for t0 in range(0, T, QUERY_BLOCK):
        t1 = min(t0 + QUERY_BLOCK, T)
        pos = start + np.arange(t0, t1)  # (b,)
        mask = (row_pos[None, :] <= pos[:, None]) & (row_pos[None, :] > pos[:, None] - window)  # (b, R)
        if extra is not None:
            mask = np.concatenate([mask, extra_mask[t0:t1]], axis=1)  # (b, R + E)
        logits = np.matmul(q[t0:t1], keys.T) * np.float32(scale)  # (b, heads, R + E)
        logits = np.where(mask[:, None, :], logits, np.float32(-np.inf))
        top = np.maximum(logits.max(axis=-1, keepdims=True), sink)  # (b, heads, 1)
        e = np.exp(logits - top)
        total = e.sum(axis=-1, keepdims=True) + np.exp(sink - top)
        out[t0:t1] = np.matmul(e / total, keys)
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
