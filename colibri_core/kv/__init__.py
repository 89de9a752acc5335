"""Per-sequence model state (KV caches, MLA latents, recurrent states) and its persistence.

Every architecture's state is a `State`: it knows how many tokens it holds and can be flattened
to named arrays and rebuilt from them. Sessions (saving a conversation beside the model and
resuming it after a restart) and the engine's rollback of a failed call rely only on this
protocol, so they work for every architecture.
"""
from __future__ import annotations

import numpy as np

__all__ = ["State", "cache_arrays", "load_cache_arrays"]


class State:
    """Base class of an architecture's per-sequence state."""

    @property
    def length(self) -> int:
        """Tokens whose state is held."""
        raise NotImplementedError

    def arrays(self) -> dict[str, np.ndarray]:
        """Everything needed to resume, as named arrays (e.g. "layer.3.k": (length, Hkv, D)).

        Arrays no later forward modifies (part of the plugin contract): the engine takes them
        before a call and, if the call fails midway (a read error, MemoryError, Ctrl-C), rebuilds
        the session's state from them (`load_arrays` into a fresh state). So rows appended to a
        cache are views (rows once written never change: `KVCache.view`, `Rows.view`), and a state
        updated in place (a recurrent state) is copied, unless it is replaced rather than modified.
        Taken once per call, not per token."""
        raise NotImplementedError

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore what `arrays()` returned (into a fresh state of the same model)."""
        raise NotImplementedError

    def truncate(self, length: int) -> bool:
        """Forget every token past the first `length`, in place, if this state can: a state made only
        of per-token rows (KV caches, latents, indexer keys) sets their lengths and returns True; one
        that folds tokens into a running state (a recurrence, a compressor's window) cannot and
        returns False (the default). Speculative decoding uses it to drop rejected drafts without
        feeding the kept tokens again; the rows past `length` are then overwritten, so arrays taken
        while they were held stop being valid past `length` (the engine only truncates past the
        arrays it keeps)."""
        return False


def cache_arrays(caches) -> dict[str, np.ndarray]:
    """Named arrays of a list of per-layer `KVCache`s."""
    out = {}
    for i, cache in enumerate(caches):
        out[f"layer.{i}.k"], out[f"layer.{i}.v"] = cache.view()
    return out


def load_cache_arrays(caches, arrays: dict[str, np.ndarray]) -> None:
    """Fill fresh per-layer `KVCache`s from `cache_arrays` output."""
    for i, cache in enumerate(caches):
        cache.append(arrays[f"layer.{i}.k"], arrays[f"layer.{i}.v"])
