"""The expert map and the memory picture the dashboard draws: every (layer, expert) with its tier
(disk / cached / pinned) and its routing heat, and how the RAM budget is spent.

Both are drawn from a `Snapshot` (snapshot.py), never from the engine itself, which the worker
thread may be running at the same moment.
"""
from __future__ import annotations

from .snapshot import Snapshot

TIERS = ("disk", "cached", "pinned")  # the tier codes of `brain()["tiers"]`, 0, 1, 2


def brain(snap: Snapshot) -> dict:
    """The expert map. Its heat is the tokens routed to each expert that this process has seen:
    when the routing history beside the model (`.coli_usage`, issue 3) lands, its counts belong
    here too, so the map shows the user's whole workload and not only this server's lifetime."""
    tiers, heats, latest = [], [], []
    for layer in snap.layers:
        row = [0] * snap.n_experts
        for e in snap.cached.get(layer, ()):
            row[e] = 1
        for e in snap.pinned.get(layer, ()):
            row[e] = 2
        tiers.append("".join(map(str, row)))
        counts = snap.routed.get(layer)
        heats.append(counts.tolist() if counts is not None else [0] * snap.n_experts)
        latest.append(snap.latest.get(layer, []))
    return {
        "layers": list(snap.layers),  # the MoE layer indices, one row each
        "n_experts": snap.n_experts,
        "tier_names": list(TIERS),
        "tiers": tiers,  # per layer one character per expert: "0" disk, "1" cached, "2" pinned
        "heat": heats,  # per layer, per expert: tokens routed to it
        "latest": latest,  # per layer: the experts of the most recent token
        "passes": snap.passes,  # forward passes so far (changes when the map does)
    }


def memory(snap: Snapshot, budget: int | None) -> dict:
    """The RAM budget and where it goes, and how many experts sit in each tier."""
    n_layers, per = len(snap.layers), snap.expert_nbytes
    cached = sum(len(snap.cached.get(layer, frozenset()) - snap.pinned.get(layer, frozenset())) for layer in snap.layers)
    n_pinned = sum(len(experts) for experts in snap.pinned.values())
    return {
        "budget_bytes": budget,
        "resident_bytes": snap.resident_bytes,  # dense weights: embeddings, attention, norms, routers
        "pinned_bytes": n_pinned * per,
        "cache_bytes": cached * per,
        "cache_capacity_bytes": snap.cache_slots * n_layers * per,
        "expert_bytes": per,  # one expert (gate + up + down)
        "disk_bytes": n_layers * snap.n_experts * per,  # every routed expert, on disk
        "experts": {"total": n_layers * snap.n_experts, "pinned": n_pinned, "cached": cached,
                    "disk": n_layers * snap.n_experts - cached - n_pinned},
    }
