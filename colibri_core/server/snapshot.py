"""What the HTTP side knows of the engine: an immutable copy the worker takes between two steps.

The engine is not thread-safe, and the worker thread is its one user. Handlers on the event loop
(and the once-a-second sampler) never touch it: they read `Worker.snapshot`, which the worker
replaces (one reference assignment) after loading and after every step of its batch. A reader
therefore sees one consistent moment, at most one step old, and never a picture torn in the
middle of a forward pass or of a hot-store revision.

Taking one costs a call of `engine.stats()`, of `ExpertStore.placement()` (the cache and hot-store
sets per layer) and a copy of the (E,) routing counts.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Snapshot:
    """The engine at a step boundary. Nothing in it is changed after it is taken."""

    stats: dict  # engine.stats(): counters, gauges, per-layer dicts (built fresh by each call)
    architecture: str
    layers: tuple[int, ...]  # the MoE layer indices
    n_experts: int
    expert_nbytes: int  # one expert (gate + up + down)
    cache_slots: int  # expert cache slots per layer
    resident_bytes: int  # dense weights: embeddings, attention, norms, routers
    cached: dict[int, frozenset[int]]  # layer → experts in the cache (some may still be being read)
    pinned: dict[int, frozenset[int]]  # layer → experts in the hot-store
    routed: dict[int, np.ndarray]  # layer → (E,) int64: tokens routed to each expert (copies)
    latest: dict[int, list[int]]  # layer → the experts of the most recent token
    passes: int  # forward passes so far
    running: tuple[dict, ...]  # each running job: kind, prompt_tokens, cached_tokens, tokens, started, first_token


def take(engine, running=()) -> Snapshot:
    """A snapshot of `engine`, on the thread that runs it (the worker), between two steps."""
    placement, c, probe = engine.store.placement(), engine.container, engine.probe  # placement: copies
    return Snapshot(
        stats=engine.stats(),
        architecture=engine.arch.name,
        layers=tuple(c.moe_layers),
        n_experts=c.n_experts,
        expert_nbytes=c.expert_nbytes,
        cache_slots=placement.slots,
        resident_bytes=engine.resident_bytes,
        cached=placement.cached,
        pinned=placement.pinned,
        routed={layer: counts.copy() for layer, counts in probe.routed.items()},
        latest=dict(probe.latest),  # its lists are replaced by each pass, never changed
        passes=probe.passes,
        running=tuple(dict(live) for live in running),
    )
