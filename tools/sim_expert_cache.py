"""Trace-driven simulation of the expert store's placement: which split of a slot budget between the
hot-store (pinned from the routing history) and the per-layer cache reads least for a second session.

    python tools/sim_expert_cache.py record --model bench-data/olmoe-synth --trace /tmp/trace.json
    python tools/sim_expert_cache.py simulate --trace /tmp/trace.json

`record` runs the `colibri bench` workload (the same prompts, seeds and lengths) once with every
expert cached, and writes each forward pass's routing per MoE layer and the router lookahead's
prediction for it (routing never depends on placement, so one trace serves every placement).
`simulate` replays it through LRU caches beside pinned sets, in pure Python: the cold session
(prompts, then the warm repeat of the first), then the learned session (the same prompts, the
hot-store chosen from the cold session's counts with `usage.hot_set`, by raw counts or by
`usage.pin_value` as the store does), and prints expert reads per decoded token (the bytes that
decide the disk floor) and the demand misses (the reads decode waits for); then each prompt replayed
with a history recorded without it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from colibri_core.store.store import GuessRecord


def record(model: Path, trace: Path, n_prompts: int, prompt_tokens: int, new_tokens: int, seed: int) -> None:
    """Each forward pass's routing per MoE layer and the router lookahead's guess of the next MoE
    layer's, from the probe's named intermediates (`ffn_moe_ids`, and the router's `predict` on the
    layer's `ffn_inp` and `ffn_moe_tokens`, as the MoE block calls it)."""
    from colibri_core import probe
    from colibri_core.bench.model import _prompts
    from colibri_core.engine import load

    with load(model, cache_slots=10**6, usage=False, prefetch=False) as engine:
        layers = list(engine.container.moe_layers)
        routers, n_experts = engine.model.routers(), engine.container.n_experts
        prompts = _prompts(engine, n_prompts, prompt_tokens, seed)
        steps: list[dict] = []  # one per forward pass: {"decode": bool, "use": {layer: ids}, "pred": {layer: ids}}
        runs = []
        for i, p in enumerate(prompts):  # the cold session's prompts; the warm repeat is prompt 0 again
            with probe.recording(names=("ffn_inp", "ffn_moe_tokens", "ffn_moe_ids")) as rec:
                list(engine.stream(p, new_tokens, temperature=1.0, seed=seed + i, stop_ids=()))
            first = len(steps)
            for j in range(len(rec.tensors[("ffn_moe_ids", layers[0])])):
                use = {layer: rec.get("ffn_moe_ids", layer, j).tolist() for layer in layers}
                pred = {}
                for layer, nxt in zip(layers, layers[1:]):  # each MoE layer guesses its successor's
                    guess = routers[nxt].predict(rec.get("ffn_inp", layer, j), rec.get("ffn_moe_tokens", layer, j))
                    if guess is not None:
                        pred[nxt] = np.asarray(guess).tolist()
                steps.append({"decode": j > 0, "use": use, "pred": pred})  # the bench times every pass after the first
            runs.append([first, len(steps)])
    trace.write_text(json.dumps({"model": str(model), "n_experts": n_experts, "moe_layers": layers, "runs": runs,
                                 "steps": steps}))
    print(f"{len(steps)} forward passes over {len(prompts)} prompts written to {trace}")


class Sim:
    """The store's cache semantics: batch-union lookups, LRU (or LFU seeded with `lfu_prior`) eviction,
    lookahead prefetch of at most `slots` predicted experts (protected while inserted; a single
    token's guesses gated by their (layer, rank)'s precision, as ExpertStore._lookahead does), pinned
    experts never evicted. Reads complete at once: no timing, only what is read."""

    def __init__(self, layers, slots: int, pinned: dict[int, set[int]], prefetch: bool, lfu_prior=None):
        self.slots, self.pinned, self.prefetch = slots, pinned, prefetch
        self.cache = {layer: {} for layer in layers}  # layer -> {expert: last use tick}
        self.prefetched = {layer: set() for layer in layers}
        self.uses = {layer: dict(enumerate(lfu_prior[i])) for i, layer in enumerate(layers)} if lfu_prior is not None else None
        self.clock = 0
        self.c = dict(demand=0, prefetch=0, prefetch_used=0, lookups=0)
        self.guesses: dict[int, list[tuple[int, int]]] = {}  # layer -> (expert, rank) guessed, not resident
        self.record = GuessRecord()

    def _touch(self, layer, e):
        self.clock += 1
        self.cache[layer][e] = self.clock
        if self.uses is not None:
            self.uses[layer][e] = self.uses[layer].get(e, 0) + 1

    def _room(self, layer, protected) -> bool:
        cache = self.cache[layer]
        while len(cache) >= self.slots:
            cand = [e for e in cache if e not in protected]
            if not cand:
                return False
            key = (lambda e: (self.uses[layer].get(e, 0), cache[e])) if self.uses is not None else cache.get
            victim = min(cand, key=key)
            del cache[victim]
            self.prefetched[layer].discard(victim)
        return True

    def step(self, layer, ids, pred):
        need = sorted(set(np.asarray(ids).ravel().tolist()))
        self.c["lookups"] += len(need)
        protected = set(need)
        for e, rank in self.guesses.pop(layer, ()):
            self.record.score(layer, 1, rank, e in protected)  # the next layer's guesses: distance 1
        for e in need:
            if e in self.pinned.get(layer, ()):
                continue
            if e in self.cache[layer]:
                if e in self.prefetched[layer]:
                    self.c["prefetch_used"] += 1
                    self.prefetched[layer].discard(e)
                self._touch(layer, e)
                continue
            self.c["demand"] += 1
            self._room(layer, protected)
            self._touch(layer, e)
        if self.prefetch and pred is not None:
            nxt, pids = pred
            pids = np.asarray(pids)  # (T, k) best first: votes weighted by rank, as the store counts them
            weights = np.broadcast_to(np.arange(pids.shape[1], 0, -1), pids.shape)
            votes = np.bincount(pids.ravel(), weights=weights.ravel())
            order = [int(e) for e in np.argsort(-votes, kind="stable") if votes[e] > 0][: self.slots]
            prot = set(order)
            guesses = self.guesses[nxt] = []
            room = True
            for rank, e in enumerate(order):
                if e in self.cache[nxt] or e in self.pinned.get(nxt, ()):
                    continue
                if pids.shape[0] == 1:
                    guesses.append((e, rank))
                    if not self.record.worth_reading(nxt, 1, rank):
                        continue
                room = room and self._room(nxt, prot)
                if room:
                    self._touch(nxt, e)
                    self.prefetched[nxt].add(e)
                    self.c["prefetch"] += 1


def replay(trace, sim: Sim, run_ids) -> dict:
    """Replay runs; the counters over decode steps only, per decoded token."""
    layers = trace["moe_layers"]
    nxt = dict(zip(layers, layers[1:]))
    tot = dict(demand=0, prefetch=0, prefetch_used=0, lookups=0)
    tokens = 0
    for r in run_ids:
        a, b = trace["runs"][r]
        for s in trace["steps"][a:b]:
            before = dict(sim.c)
            for layer in layers:
                p = s["pred"].get(str(nxt.get(layer))) if nxt.get(layer) is not None else None
                sim.step(layer, s["use"][str(layer)], (nxt[layer], p) if p is not None else None)
            if s["decode"]:
                tokens += 1
                for k in tot:
                    tot[k] += sim.c[k] - before[k]
    return {"reads": (tot["demand"] + tot["prefetch"]) / tokens, "demand": tot["demand"] / tokens,
            "wasted": (tot["prefetch"] - tot["prefetch_used"]) / tokens, "tokens": tokens}


def counts_of(trace, run_ids) -> np.ndarray:
    layers = trace["moe_layers"]
    counts = np.zeros((len(layers), trace["n_experts"]), np.int64)
    for r in run_ids:
        a, b = trace["runs"][r]
        for s in trace["steps"][a:b]:
            for i, layer in enumerate(layers):
                counts[i] += np.bincount(np.asarray(s["use"][str(layer)]).ravel(), minlength=trace["n_experts"])
    return counts


def _pinned(layers, pairs) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for li, e in pairs:
        out.setdefault(layers[li], set()).add(e)
    return out


def simulate(trace_path: Path) -> None:
    from colibri_core.store.usage import hot_set, pin_value

    trace = json.loads(trace_path.read_text())
    layers, E = trace["moe_layers"], trace["n_experts"]
    L, n = len(layers), len(trace["runs"])
    cold_runs = list(range(n)) + [0]  # the bench's cold session: the prompts, then the warm repeat
    history = counts_of(trace, cold_runs)
    print(f"{L} MoE layers × {E} experts; the cold session routes to {int((history > 0).sum())} distinct "
          f"(layer, expert) pairs. Per decoded token: expert reads (demand misses, wasted prefetches)")

    def row(hist, runs, budget, share, prefetch=True):
        pinned_n = int(share * budget)
        slots = (budget - pinned_n) // L
        by_count = replay(trace, Sim(layers, slots, _pinned(layers, hot_set(hist, pinned_n)), prefetch), runs)
        by_value = replay(trace, Sim(layers, slots, _pinned(layers, hot_set(pin_value(hist, slots), pinned_n)),
                                     prefetch), runs)
        f = lambda r: f"{r['reads']:5.1f} ({r['demand']:4.1f}, {r['wasted']:3.1f})"  # noqa: E731
        return f"pin {pinned_n:4d} + {slots:2d} slots: by count {f(by_count)}, by pin_value {f(by_value)}"

    for frac in (0.25, 0.375, 0.5):
        budget = int(frac * L * E)
        print(f"\nbudget {budget} experts ({100 * frac:.1f}%), the learned session (the same prompts):")
        for prefetch in (True, False):
            cold = replay(trace, Sim(layers, budget // L, {}, prefetch), list(range(n)))
            print(f"  prefetch {'on' if prefetch else 'off'}: cold LRU {budget // L} slots: {cold['reads']:.1f} "
                  f"({cold['demand']:.1f}, {cold['wasted']:.1f})")
            for share in (0.5, 0.625, 0.75, 0.875):
                print("    " + row(history, list(range(n)), budget, share, prefetch))
            lfu = replay(trace, Sim(layers, budget // L, {}, prefetch, lfu_prior=history), list(range(n)))
            print(f"    LFU seeded with the history, {budget // L} slots, nothing pinned: {lfu['reads']:.1f} "
                  f"({lfu['demand']:.1f}, {lfu['wasted']:.1f})")
        for held_out in range(n):  # history without one prompt, replayed on it: does the hot-store generalise?
            seen = [i for i in range(n) if i != held_out]
            hist = counts_of(trace, seen + seen[:1])
            cold = replay(trace, Sim(layers, budget // L, {}, True), [held_out])
            print(f"  unseen prompt {held_out}: cold {cold['reads']:.1f} ({cold['demand']:.1f}); "
                  + row(hist, [held_out], budget, 0.75))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--model", type=Path, required=True)
    rec.add_argument("--trace", type=Path, required=True)
    rec.add_argument("--prompts", type=int, default=3)
    rec.add_argument("--prompt-tokens", type=int, default=8)
    rec.add_argument("--new-tokens", type=int, default=8)
    rec.add_argument("--seed", type=int, default=0)
    sim = sub.add_parser("simulate")
    sim.add_argument("--trace", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "record":
        record(a.model, a.trace, a.prompts, a.prompt_tokens, a.new_tokens, a.seed)
    else:
        simulate(a.trace)


if __name__ == "__main__":
    sys.exit(main())
