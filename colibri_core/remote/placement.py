"""Which routed experts live on which Ray node (pure: no Ray, no I/O; `colibri plan --ray` prints it).

Two ways to cut a model into shards, one shard per node:
- ``expert`` (default): every MoE layer's experts are split into contiguous id ranges, one range per
  node, sized to the node's share of the cluster's RAM. Each layer calls every node that holds one
  of the experts its tokens chose, in parallel; the load is spread evenly over the nodes.
- ``layer``: contiguous ranges of MoE layers per node (a layer cut at a node's edge is split by
  expert id). A layer calls one node (two at an edge): fewer calls per token, one node busy at a time.

A node holds at most `share` of its Ray `memory` resource; what the cluster cannot hold stays with
the local store (read from disk), from the last layers' (``layer``) or highest ids' (``expert``) end.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import comb

SPLITS = ("expert", "layer")
RAM_SHARE = 0.8  # of a node's Ray `memory` resource a shard may fill


@dataclass(frozen=True)
class Node:
    id: str  # Ray node id (hex)
    address: str  # its IP
    memory: int  # bytes of Ray `memory` resource


@dataclass
class Shard:
    index: int
    node: Node
    experts: dict[int, tuple[int, ...]] = field(default_factory=dict)  # MoE layer -> expert ids, ascending
    nbytes: int = 0

    @property
    def n_experts(self) -> int:
        return sum(len(e) for e in self.experts.values())

    def describe(self) -> str:
        """'layers 1-3 experts 0-7' style ranges."""
        parts = []
        for layer, es in self.experts.items():
            parts.append(f"{layer}:{_ranges(es)}")
        return " ".join(parts)


def _ranges(es) -> str:
    out, start, prev = [], None, None
    for e in es:
        if start is None:
            start = prev = e
        elif e == prev + 1:
            prev = e
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = e
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(out)


def nodes_from_ray(ray_nodes: list[dict], exclude: str | None = None) -> list[Node]:
    """The alive nodes of `ray.nodes()` with memory, but `exclude` (the driver's own node), by id."""
    out = []
    for n in ray_nodes:
        if not n.get("Alive") or n.get("NodeID") == exclude:
            continue
        mem = int(n.get("Resources", {}).get("memory", 0))
        if mem > 0:
            out.append(Node(n["NodeID"], n.get("NodeManagerAddress", "?"), mem))
    return sorted(out, key=lambda n: n.id)


def place(nodes: list[Node], layer_nbytes: dict[int, int], n_experts: int, split: str = "expert",
          share: float = RAM_SHARE) -> list[Shard]:
    """One shard per node with room for an expert (MoE layers `layer_nbytes` {layer: bytes per expert})."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} (expected one of {', '.join(SPLITS)})")
    caps = [int(n.memory * share) for n in nodes]
    shards = [Shard(i, n) for i, n in enumerate(nodes)]
    if not nodes:
        return []
    layers = list(layer_nbytes)
    if split == "layer":  # the (layer, expert) list in order, cut in runs proportional to the nodes' room
        items = [(layer, e) for layer in layers for e in range(n_experts)]
        fit, room = 0, sum(caps)
        while fit < len(items) and layer_nbytes[items[fit][0]] <= room:  # what the cluster can hold
            room -= layer_nbytes[items[fit][0]]
            fit += 1
        start = 0
        for s in shards:
            end = fit if s.index == len(shards) - 1 else min(fit, start + round(fit * caps[s.index] / sum(caps)))
            for layer, e in items[start:end]:
                if s.nbytes + layer_nbytes[layer] > caps[s.index]:
                    break
                s.experts[layer] = s.experts.get(layer, ()) + (e,)
                s.nbytes += layer_nbytes[layer]
                start += 1
    else:  # each layer's ids cut in ranges proportional to the nodes' room
        total = sum(layer_nbytes[layer] * n_experts for layer in layers)
        cover = min(1.0, sum(caps) / total) if total else 0.0
        weights = [c / sum(caps) if sum(caps) else 0.0 for c in caps]
        for layer in layers:
            nb, start = layer_nbytes[layer], 0
            want = int(n_experts * cover)
            counts = [int(want * w) for w in weights]
            for j in sorted(range(len(counts)), key=lambda j: -weights[j])[: want - sum(counts)]:
                counts[j] += 1  # the rounding's leftovers to the roomiest nodes
            for s, count in zip(shards, counts):
                count = min(count, (caps[s.index] - s.nbytes) // nb if nb else count)
                if count > 0:
                    s.experts[layer] = tuple(range(start, start + count))
                    s.nbytes += count * nb
                    start += count
    return [s for s in shards if s.experts]


def expected_calls(shards: list[Shard], n_experts: int, top_k: int) -> float:
    """Remote calls per generated token under uniform routing: per MoE layer, each shard holding m of
    the layer's experts is called unless none of the token's top_k is among them."""
    calls = 0.0
    for s in shards:
        for es in s.experts.values():
            calls += 1 - comb(n_experts - len(es), top_k) / comb(n_experts, top_k)
    return calls


def local_experts(shards: list[Shard], layers, n_experts: int) -> int:
    """Experts no shard holds (read from the local disk)."""
    held = sum(s.n_experts for s in shards)
    return len(list(layers)) * n_experts - held


def cluster_plan(nodes: list[Node], layers, n_experts: int, expert_nbytes: int, top_k: int, split: str = "expert",
                 share: float = RAM_SHARE) -> dict:
    """What `colibri plan --ray` prints: each node's shard and RAM, what stays local, calls per token."""
    layers = list(layers)
    shards = place(nodes, {layer: expert_nbytes for layer in layers}, n_experts, split, share)
    held = {s.node.id: s for s in shards}
    return {
        "split": split,
        "nodes": [{"node": n.id, "address": n.address, "memory": n.memory, "room": int(n.memory * share),
                   "experts": held[n.id].n_experts if n.id in held else 0,
                   "bytes": held[n.id].nbytes if n.id in held else 0,
                   "placement": held[n.id].describe() if n.id in held else ""} for n in nodes],
        "experts_remote": sum(s.n_experts for s in shards),
        "experts_local": local_experts(shards, layers, n_experts),
        "remote_calls_per_token": expected_calls(shards, n_experts, top_k),
        "max_calls_per_layer": max((sum(1 for s in shards if layer in s.experts) for layer in layers), default=0),
    }
