"""Eviction policies of the per-layer expert cache, and the built-in ones (LRU, LFU, aging LFU).

A policy only ever chooses *which* cached expert to drop; what an expert computes never depends on
it. The store makes one policy object per MoE layer and tells it what happens to that layer's
cache; it asks `victim` only for experts it may drop (never a pinned expert, one still being read,
or one the current layer still needs).

Policies come from the plugin hook ``colibri_register_cache_policies(register)``; the core's own
are registered by this module through the same hook (`colibri_core.plugins.Registry` loads it
first), so ``--policy NAME`` compares placement ideas with one flag.

This module imports nothing heavy: the plugin manager loads it when it starts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..hookspecs import hookimpl

__all__ = ["CachePolicy"]


class CachePolicy:
    """Which cached expert of one MoE layer to evict. Subclass it and override what you need.

    :param slots: the cache's capacity (experts) in this layer, pinned experts not included.
    :param n_experts: routed experts in this layer.
    """

    def __init__(self, slots: int, n_experts: int):
        self.slots = slots
        self.n_experts = n_experts

    def on_hit(self, expert: int) -> None:
        """A cached expert was used again."""

    def on_insert(self, expert: int) -> None:
        """An expert entered the cache (a demand read or a prefetch)."""

    def on_evict(self, expert: int) -> None:
        """An expert left the cache."""

    def victim(self, candidates: list[int]) -> int:
        """One of `candidates` (cached experts that may be dropped, never empty) to evict."""
        raise NotImplementedError


class LRU(CachePolicy):
    """Least recently used: drop the expert whose last use is oldest."""

    def __init__(self, slots: int, n_experts: int):
        super().__init__(slots, n_experts)
        self.clock = 0
        self.last: dict[int, int] = {}  # expert -> tick of its last use

    def on_hit(self, expert: int) -> None:
        self.clock += 1
        self.last[expert] = self.clock

    on_insert = on_hit

    def on_evict(self, expert: int) -> None:
        self.last.pop(expert, None)

    def victim(self, candidates: list[int]) -> int:
        return min(candidates, key=lambda e: self.last.get(e, 0))


class LFU(LRU):
    """Least frequently used over the whole session (uses counted also while not cached), ties
    to the least recently used: experts a workload keeps returning to stay, one-off visitors go."""

    def __init__(self, slots: int, n_experts: int):
        super().__init__(slots, n_experts)
        self.uses = [0] * n_experts

    def on_hit(self, expert: int) -> None:
        super().on_hit(expert)
        self.uses[expert] += 1

    on_insert = on_hit

    def victim(self, candidates: list[int]) -> int:
        return min(candidates, key=lambda e: (self.uses[e], self.last.get(e, 0)))


# The aging LFU halves its counts each time the layer has seen AGING_PERIOD uses per expert of the
# layer (AGING_PERIOD × n_experts hits and inserts), as TinyLFU ages its sketch (Einziger et al.,
# "TinyLFU: A Highly Efficient Cache Admission Policy", 2017): a use a period old weighs half a use
# now, so a workload that moves to other experts replaces the old favourites within a few periods.
# Chosen by measurement (BENCHMARKS.md, "Which experts the cache keeps").
AGING_PERIOD = 16


class AgingLFU(LFU):
    """LFU whose counts fade: every AGING_PERIOD × n_experts uses of the layer, each expert's count
    is halved (rounded down), ties to the least recently used. It keeps LFU's choice on a steady
    workload and forgets a past one within a few periods, where LFU keeps it for the session."""

    def __init__(self, slots: int, n_experts: int):
        super().__init__(slots, n_experts)
        self.period = AGING_PERIOD * n_experts
        self.since_halving = 0  # uses of the layer since the counts were last halved

    def on_hit(self, expert: int) -> None:
        super().on_hit(expert)
        self.since_halving += 1
        if self.since_halving == self.period:
            self.uses = [n // 2 for n in self.uses]
            self.since_halving = 0

    on_insert = on_hit


@dataclass(frozen=True)
class PolicyInfo:
    """One registered cache policy."""

    name: str  # the --policy value, lower_snake_case
    factory: Callable[..., CachePolicy]  # factory(slots=..., n_experts=...) -> a CachePolicy
    description: str = ""
    plugin: str = ""  # set by the core: the distribution that registered it


@hookimpl
def colibri_register_cache_policies(register):
    register("lru", LRU, "least recently used")
    register("lfu", LFU, "least frequently used this session, ties to least recently used")
    register("lfu_aging", AgingLFU, "least frequently used, the counts halved every "
             f"{AGING_PERIOD} uses per expert of the layer; ties to least recently used (default)")
