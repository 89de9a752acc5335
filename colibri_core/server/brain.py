"""The expert map and the memory picture the dashboard draws: every (layer, expert) with its tier
(disk / cached / pinned) and its routing heat, and how the RAM budget is spent."""
from __future__ import annotations

TIERS = ("disk", "cached", "pinned")  # the tier codes of `brain()["tiers"]`, 0, 1, 2


def _keys(mapping) -> list:
    """The keys of a dict another thread may be changing (the worker fills the caches)."""
    for _ in range(5):
        try:
            return list(mapping)
        except RuntimeError:  # changed size during iteration: try again
            continue
    return []


def pinned(store) -> dict[int, set[int]]:
    """Pinned experts per layer. The hot-store (issue 3) pins experts; before it exists, none are.

    Accepts a `store.pinned` of either form: {layer: experts} or a set of (layer, expert) pairs.
    """
    p = getattr(store, "pinned", None)
    out: dict[int, set[int]] = {}
    if isinstance(p, dict):
        for layer, experts in list(p.items()):
            out[int(layer)] = {int(e) for e in _keys(experts)}
    elif p:
        for layer, expert in _keys(p):
            out.setdefault(int(layer), set()).add(int(expert))
    return out


def routing_heat(engine) -> dict[int, list[int]]:
    """Tokens routed to each expert, per layer: what this process has seen.

    When the routing history beside the model (`.coli_usage`, issue 3) lands, its counts belong
    here too, so the map shows the user's whole workload and not only this server's lifetime.
    """
    return {layer: counts.tolist() for layer, counts in list(engine.probe.routed.items())}


def brain(engine) -> dict:
    store, c = engine.store, engine.container
    pins = pinned(store)
    heat = routing_heat(engine)
    layers, tiers, heats, latest = list(c.moe_layers), [], [], []
    for layer in layers:
        row = [0] * c.n_experts
        for e in _keys(store.cache.get(layer, {})):
            row[e] = 1
        for e in pins.get(layer, ()):
            row[e] = 2
        tiers.append("".join(map(str, row)))
        heats.append(heat.get(layer, [0] * c.n_experts))
        latest.append(engine.probe.latest.get(layer, []))
    return {
        "layers": layers,  # the MoE layer indices, one row each
        "n_experts": c.n_experts,
        "tier_names": list(TIERS),
        "tiers": tiers,  # per layer one character per expert: "0" disk, "1" cached, "2" pinned
        "heat": heats,  # per layer, per expert: tokens routed to it
        "latest": latest,  # per layer: the experts of the most recent token
        "passes": engine.probe.passes,  # forward passes so far (changes when the map does)
    }


def memory(engine, budget: int | None) -> dict:
    """The RAM budget and where it goes, and how many experts sit in each tier."""
    store, c = engine.store, engine.container
    n_layers = len(c.moe_layers)
    pins = pinned(store)
    cached = sum(len(set(_keys(store.cache.get(layer, {}))) - pins.get(layer, set())) for layer in c.moe_layers)
    n_pinned = sum(len(v) for v in pins.values())
    per = c.expert_nbytes
    return {
        "budget_bytes": budget,
        "resident_bytes": engine.resident_bytes,  # dense weights: embeddings, attention, norms, routers
        "pinned_bytes": n_pinned * per,
        "cache_bytes": cached * per,
        "cache_capacity_bytes": store.slots * n_layers * per,
        "expert_bytes": per,  # one expert (gate + up + down)
        "disk_bytes": n_layers * c.n_experts * per,  # every routed expert, on disk
        "experts": {"total": n_layers * c.n_experts, "pinned": n_pinned, "cached": cached,
                    "disk": n_layers * c.n_experts - cached - n_pinned},
    }
