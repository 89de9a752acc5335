"""The expert store's counters, and where its experts are (`Placement`).

- ``expert_hits`` / ``expert_misses``: experts a layer needed that were resident (cached, pinned,
  or already being read by a prefetch) / that had to be read when the layer asked for them.
- ``bytes_read``: bytes read from disk for experts (demand reads, prefetches and pinning).
- ``prefetch_issued``: reads started by router lookahead; ``prefetch_used``: those a layer then
  needed; ``prefetch_recall``: of the experts layers needed, the share the lookahead predicted;
  ``prefetch_skipped``: guesses not read because guesses of their rank for their layer were lately
  mostly wrong.
- ``io_stall_seconds``: time a layer waited for reads after computing everything else it could;
  ``layer_io_stall_seconds``: the same per MoE layer (where the disk holds decode back).
- ``layer_hit_rate``: hits / lookups per MoE layer.
- ``absent``: experts a layer needed that were neither cached nor pinned (a pinned expert whose
  background read has not started yet is one of ``expert_misses``, never of these): what
  `--draft auto` weighs.
- ``steps``: forward steps (a solo forward, or one step of a batch: every running generation's
  forward); ``step_rereads``: reads of an expert already read in the same step (0 when every layer
  reads the union of its step's experts once; more when the cache evicts one before a later use).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StoreCounters:
    expert_hits: int = 0
    expert_misses: int = 0
    absent: int = 0
    bytes_read: int = 0
    reads: int = 0
    read_seconds: float = 0.0  # summed wall time of the reads themselves (in the I/O threads)
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_skipped: int = 0
    predicted_needed: int = 0  # needed experts the lookahead had predicted
    needed_after_prediction: int = 0  # needed experts in layers that had a prediction
    io_stall_seconds: float = 0.0
    mirror_reads: int = 0
    steps: int = 0
    step_rereads: int = 0
    layer_hits: dict = field(default_factory=dict)
    layer_misses: dict = field(default_factory=dict)
    layer_stall: dict = field(default_factory=dict)  # layer -> io_stall_seconds in that layer

    def lookup(self, layer: int, hit: bool, n: int = 1) -> None:
        """Count `n` lookups in `layer`, all hits or all misses."""
        if hit:
            self.expert_hits += n
            self.layer_hits[layer] = self.layer_hits.get(layer, 0) + n
        else:
            self.expert_misses += n
            self.layer_misses[layer] = self.layer_misses.get(layer, 0) + n

    def stall(self, layer: int, seconds: float) -> None:
        self.io_stall_seconds += seconds
        self.layer_stall[layer] = self.layer_stall.get(layer, 0.0) + seconds

    def as_dict(self, layers) -> dict:
        lookups = self.expert_hits + self.expert_misses
        return {
            "expert_hits": self.expert_hits,
            "expert_misses": self.expert_misses,
            "hit_rate": self.expert_hits / lookups if lookups else 0.0,
            "bytes_read": self.bytes_read,
            "reads": self.reads,
            "read_seconds": self.read_seconds,
            "prefetch_issued": self.prefetch_issued,
            "prefetch_used": self.prefetch_used,
            "prefetch_skipped": self.prefetch_skipped,
            "prefetch_recall": (self.predicted_needed / self.needed_after_prediction
                                if self.needed_after_prediction else 0.0),
            "io_stall_seconds": self.io_stall_seconds,
            "layer_io_stall_seconds": {layer: self.layer_stall.get(layer, 0.0) for layer in layers},
            "mirror_reads": self.mirror_reads,
            "steps": self.steps,
            "step_rereads": self.step_rereads,
            "layer_hit_rate": {
                layer: self.layer_hits.get(layer, 0) / max(1, self.layer_hits.get(layer, 0) + self.layer_misses.get(layer, 0))
                for layer in layers
            },
        }


@dataclass(frozen=True)
class Placement:
    """Which experts each MoE layer holds (`ExpertStore.placement`): what the server's dashboard draws."""

    slots: int  # cache slots per layer
    cached: dict[int, frozenset[int]]  # layer -> experts in its cache (some may still be being read)
    pinned: dict[int, frozenset[int]]  # layer -> experts in the hot-store (some may be queued, not read yet)
