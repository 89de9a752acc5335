"""Compressed KV (DeepSeek V4's CSA and HCA layers): every `rate` tokens are pooled into one entry by
gated softmax pooling, and the lightning indexer that picks, per query, the entries worth attending.

A `Compressor` projects each token to a value `kv` and a gate (plus a learned bias `ape` by position
in the window), buffers tokens until a window of `rate` is whole, then emits

    entry_w = rope( RMSNorm( Σ_slots softmax_slots(gate) ⊙ kv ) )   at position w · rate

(the softmax runs over the window's slots, per feature, in float32). With `overlap` (CSA) the
projections are twice the entry width: the second half of window w and the *first* half of window
w − 1 form the 2·rate slots of entry w (for w = 0 the missing half gets weight 0), so the first half
of the last whole window is carried from call to call. Query t sees entry w iff w < (t + 1) // rate
(its window is whole by t).

The carried state (`CompressorState`): the entries so far, the unfinished window's projections and
the carried half-window. It is all a session needs to continue bit-identically mid-window.
"""
from __future__ import annotations

import numpy as np

from ..kernels.deltanet import query_blocks
from ..kv.cache import Rows
from .linear import linear
from .norm import rms_norm
from .rope import Rope, rotate_tail_interleaved
from .router import topk

__all__ = ["Compressor", "CompressorState", "CompressedIndexer", "visible_entries"]


class CompressorState:
    """One compressor's carried state for one sequence. A fixed-size part of a `kv.SequenceState`
    (a window folds its tokens in: it cannot be cut to a prefix): arrays "PART.entries", "PART.buffer_kv",
    "PART.buffer_gate", "PART.carry_kv", "PART.carry_gate", none modified by a later call (entries
    are append-only rows; the rest is replaced)."""

    per_token = False

    def __init__(self, width: int, proj_width: int, rate: int):
        self.width, self.proj_width, self.rate = width, proj_width, rate
        self.entries = Rows(width)  # (E, width): every entry emitted so far
        self.buffer_kv = np.zeros((0, proj_width), np.float32)  # (< rate, P): the unfinished window
        self.buffer_gate = np.zeros((0, proj_width), np.float32)  # (< rate, P), without ape
        self.carry_kv = np.zeros((0, width), np.float32)  # (rate or 0, width): CSA, the last window's first half
        self.carry_gate = np.zeros((0, width), np.float32)  # (rate or 0, width), ape included
        self.varying = {"entries": None, "buffer_kv": rate - 1, "buffer_gate": rate - 1, "carry_kv": rate,
                        "carry_gate": rate}

    def arrays(self) -> dict[str, np.ndarray]:
        return {"entries": self.entries.view(), "buffer_kv": self.buffer_kv, "buffer_gate": self.buffer_gate,
                "carry_kv": self.carry_kv, "carry_gate": self.carry_gate}

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        self.entries.append(arrays["entries"])
        for name in ("buffer_kv", "buffer_gate", "carry_kv", "carry_gate"):
            setattr(self, name, np.array(arrays[name], np.float32))

    def empty(self) -> CompressorState:
        return CompressorState(self.width, self.proj_width, self.rate)


class Compressor:
    """Gated-pooling compressor. wkv, wgate (P, H) with P = width (HCA) or 2 · width (CSA, `overlap`);
    ape (rate, P) float32; norm (width,) the entries' RMSNorm; `rope` rotates each entry's trailing
    rope dims at its window's first position."""

    def __init__(self, wkv, wgate, ape: np.ndarray, norm: np.ndarray, rate: int, width: int, overlap: bool,
                 rope: Rope, eps: float):
        self.wkv, self.wgate, self.ape, self.norm = wkv, wgate, np.asarray(ape, np.float32), norm
        self.rate, self.width, self.overlap, self.rope, self.eps = rate, width, overlap, rope, eps
        self.proj_width = 2 * width if overlap else width

    def new_state(self) -> CompressorState:
        return CompressorState(self.width, self.proj_width, self.rate)

    def __call__(self, x: np.ndarray, state: CompressorState) -> np.ndarray:
        """Add tokens x (T, H); returns every entry so far (E, width) (a view)."""
        kv = np.concatenate([state.buffer_kv, linear(x, self.wkv)])  # (B + T, P)
        gate = np.concatenate([state.buffer_gate, linear(x, self.wgate)])  # (B + T, P)
        m, d = self.rate, self.width
        n = len(kv) // m  # windows now whole
        state.buffer_kv, state.buffer_gate = kv[n * m:].copy(), gate[n * m:].copy()
        if n == 0:
            return state.entries.view()
        kv = kv[: n * m].reshape(n, m, -1)  # (n, m, P)
        gate = gate[: n * m].reshape(n, m, -1) + self.ape  # (n, m, P)
        if self.overlap:  # slots of entry w: window w-1's first half, then window w's second half
            slots_kv = np.zeros((n, 2 * m, d), np.float32)
            slots_gate = np.full((n, 2 * m, d), -np.inf, np.float32)
            slots_kv[:, m:], slots_gate[:, m:] = kv[..., d:], gate[..., d:]
            slots_kv[1:, :m], slots_gate[1:, :m] = kv[:-1, :, :d], gate[:-1, :, :d]
            if len(state.carry_kv):
                slots_kv[0, :m], slots_gate[0, :m] = state.carry_kv, state.carry_gate
            state.carry_kv, state.carry_gate = kv[-1, :, :d].copy(), gate[-1, :, :d].copy()
            kv, gate = slots_kv, slots_gate
        e = np.exp(gate - gate.max(axis=1, keepdims=True))
        pooled = (kv * (e / e.sum(axis=1, keepdims=True))).sum(axis=1)  # (n, width)
        pooled = rms_norm(pooled.astype(np.float32), self.norm, self.eps)
        first = state.entries.length
        cos, sin = self.rope.cos_sin((first + np.arange(n)) * m)
        state.entries.append(rotate_tail_interleaved(pooled[:, None, :], cos, sin)[:, 0])
        return state.entries.view()


def visible_entries(positions: np.ndarray, n_entries: int, rate: int) -> np.ndarray:
    """(T, E) bool: query at position p sees entry w iff w < (p + 1) // rate (its window is whole)."""
    return np.arange(n_entries)[None, :] < ((np.asarray(positions) + 1) // rate)[:, None]


class CompressedIndexer:
    """The lightning indexer over compressed entries (CSA): its own compressor (index_head_dim wide,
    with overlap) gives keys K; query heads q_h = rope(wq_b · q_residual); each visible entry scores
    Σ_h (w_h / √heads) · ReLU(q_h · K) / √head_dim with w = weights_proj · x; the `topk` best visible
    entries are kept (ties to the lower index)."""

    def __init__(self, compressor: Compressor, wq_b, weights_proj, heads: int, head_dim: int, topk: int):
        self.compressor, self.wq_b, self.weights_proj = compressor, wq_b, weights_proj
        self.heads, self.head_dim, self.topk = heads, head_dim, topk

    def select(self, x: np.ndarray, q_residual: np.ndarray, positions: np.ndarray, cos: np.ndarray,
               sin: np.ndarray, state: CompressorState) -> np.ndarray:
        """Tokens x (T, H), q_residual (T, q_lora) at `positions` (T,) (cos, sin (T, r) of the
        compressed rope there) → (T, E) bool, the entries each query attends to."""
        keys = self.compressor(x, state)  # (E, D)
        T, E = len(x), len(keys)
        if E == 0:
            return np.zeros((T, 0), bool)
        q = rotate_tail_interleaved(linear(q_residual, self.wq_b).reshape(T, self.heads, self.head_dim), cos, sin)
        w = linear(x, self.weights_proj) * np.float32(self.heads ** -0.5)  # (T, heads)
        index = np.zeros((T, E), np.float32)  # (T, E); the entries a block cannot see yet stay 0, never chosen
        for a, b in query_blocks(int(positions[0]), T):  # as attention's blocks: bits whatever the forward's cut
            n = min(E, (int(positions[b - 1]) + 1) // self.compressor.rate)  # the entries its last query sees
            scores = np.maximum(np.matmul(q[a:b], keys[:n].T), 0) * np.float32(self.head_dim ** -0.5)  # (b-a, heads, n)
            index[a:b, :n] = (scores * w[a:b, :, None]).sum(axis=1)
        visible = visible_entries(positions, E, self.compressor.rate)
        chosen = topk(np.where(visible, index, -np.inf), min(self.topk, E))  # (T, k)
        keep = np.zeros((T, E), bool)
        np.put_along_axis(keep, chosen, True, axis=-1)
        return keep & visible
