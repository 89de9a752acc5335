"""The expert store: routed experts read from the container on demand into a per-layer LRU cache.

Every expert, hit or miss, is handed to the kernels as the same QTensor views of one extent, so
what the cache holds changes speed only.
"""
from __future__ import annotations

from collections import OrderedDict


class ExpertStore:
    """Per-layer LRU caches of `slots` experts each, filled from `container` on a miss."""

    def __init__(self, container, slots: int):
        if slots < 1:
            raise ValueError("the expert cache needs at least one slot per layer")
        self.container = container
        self.slots = min(slots, container.n_experts)
        self.cache: dict[int, OrderedDict] = {layer: OrderedDict() for layer in container.moe_layers}
        self.expert_hits = 0
        self.expert_misses = 0
        self.bytes_read = 0
        self.layer_hits = {layer: 0 for layer in container.moe_layers}
        self.layer_misses = {layer: 0 for layer in container.moe_layers}

    def get(self, layer: int, expert: int):
        """(gate, up, down) QTensors of one expert."""
        cache = self.cache[layer]
        weights = cache.get(expert)
        if weights is not None:
            cache.move_to_end(expert)
            self.expert_hits += 1
            self.layer_hits[layer] += 1
            return weights
        weights = self.container.read_expert(layer, expert)
        self.expert_misses += 1
        self.layer_misses[layer] += 1
        self.bytes_read += self.container.layer_expert_nbytes(layer)
        if len(cache) >= self.slots:
            cache.popitem(last=False)
        cache[expert] = weights
        return weights

    @property
    def resident_bytes(self) -> int:
        """Bytes the expert cache holds now."""
        return sum(len(c) * self.container.layer_expert_nbytes(layer) for layer, c in self.cache.items())

    def stats(self) -> dict:
        lookups = self.expert_hits + self.expert_misses
        return {
            "expert_hits": self.expert_hits,
            "expert_misses": self.expert_misses,
            "hit_rate": self.expert_hits / lookups if lookups else 0.0,
            "bytes_read": self.bytes_read,
            "cache_slots_per_layer": self.slots,
            "cache_bytes": self.resident_bytes,
            "layer_hit_rate": {
                layer: self.layer_hits[layer] / max(1, self.layer_hits[layer] + self.layer_misses[layer])
                for layer in self.cache
            },
        }
