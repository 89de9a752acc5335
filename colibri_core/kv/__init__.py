"""Per-sequence model state (KV caches, MLA latents, recurrent states) and its persistence.

Every architecture's state is a `State`: it knows how many tokens it holds and can be flattened
to named arrays and rebuilt from them. Sessions (saving a conversation beside the model and
resuming it after a restart) and the engine's rollback of a failed call rely only on this
protocol, so they work for every architecture. A model declares its state as a `SequenceState`
of the core's state kinds (colibri_core/kv/state.py) and writes none of it.
"""
from __future__ import annotations

import numpy as np

from .state import Part, SequenceState, State

__all__ = ["State", "SequenceState", "Part", "cache_arrays", "load_cache_arrays"]


def cache_arrays(caches) -> dict[str, np.ndarray]:
    """Named arrays of a list of per-layer `KVCache`s, for a `State` written by hand (a
    `SequenceState` of `KVCache` parts names the same arrays itself)."""
    out = {}
    for i, cache in enumerate(caches):
        out[f"layer.{i}.k"], out[f"layer.{i}.v"] = cache.view()
    return out


def load_cache_arrays(caches, arrays: dict[str, np.ndarray]) -> None:
    """Fill fresh per-layer `KVCache`s from `cache_arrays` output."""
    for i, cache in enumerate(caches):
        cache.append(arrays[f"layer.{i}.k"], arrays[f"layer.{i}.v"])
