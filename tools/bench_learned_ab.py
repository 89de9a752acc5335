"""Cold versus learned expert store, alternated: the `colibri bench` workload repeated to see past noise.

    flock /tmp/colibri-cpu.lock python tools/bench_learned_ab.py bench-data/olmoe-synth --budget 0.25 --repeats 3

`colibri bench` runs one cold and one learned session per budget, 21 decoded tokens each: on a
shared machine one session's time per token moves by more than the hot-store saves. This runs the
same sessions (the bench's prompts, seeds and lengths; page cache dropped where permitted, O_DIRECT
reads) alternately, each pair with a fresh routing history: cold (prompts, then the warm repeat, which
writes the history), then learned (the hot-store read in full before the prompts, not timed). It
prints per session the decode time and process CPU per token, io stall, reads and misses per token,
then the minimum and median of each.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from colibri_core.bench.model import _prompts, drop_page_cache
from colibri_core.engine import load
from colibri_core.store.plan import sizes_from_container


def session(model: Path, budget: int, history: Path, learned: bool, prompt_tokens: int, new_tokens: int) -> dict:
    drop_page_cache()
    with load(model, ram=budget, usage=history, direct=True) as e:
        warm = e.store.warm_up()[0] if learned else 0.0
        prompts = _prompts(e, 3, prompt_tokens, 0)
        c = e.store.counters
        wall = cpu = stall = 0.0
        n = reads = misses = 0
        for i, p in enumerate(prompts):
            it = e.stream(p, new_tokens, temperature=1.0, seed=i, stop_ids=())
            next(it)  # the first token: prefill, not decode
            c0, w0, s0, r0, m0 = time.process_time(), time.perf_counter(), c.io_stall_seconds, c.reads, c.expert_misses
            n += sum(1 for _ in it)
            wall += time.perf_counter() - w0
            cpu += time.process_time() - c0
            stall, reads, misses = stall + c.io_stall_seconds - s0, reads + c.reads - r0, misses + c.expert_misses - m0
        s = e.stats()
        if not learned:  # the bench's warm repeat, so the history holds what the bench's does
            list(e.stream(prompts[0], new_tokens, temperature=1.0, seed=0, stop_ids=()))
    return {"spt": wall / n, "cpu": cpu / n, "stall": stall / n, "reads": reads / n, "misses": misses / n,
            "warm_up": warm, "pinned": s["pinned_experts"], "slots": s["cache_slots_per_layer"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--budget", type=float, default=0.25, help="expert budget as a fraction of all experts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=8)
    a = ap.parse_args()
    sizes = sizes_from_container(a.model)
    budget = sizes.dense_bytes + int(a.budget * sizes.experts_total * sizes.expert_nbytes)
    runs: dict[str, list[dict]] = {"cold": [], "learned": []}
    with tempfile.TemporaryDirectory(prefix="colibri-ab-") as tmp:
        for r in range(a.repeats):
            for name in runs:
                s = session(a.model, budget, Path(tmp) / f"usage{r}.json", name == "learned", a.prompt_tokens,
                            a.new_tokens)
                runs[name].append(s)
                print(f"{100 * a.budget:.0f}% {name:7s} #{r}: {s['spt']:.3f} s/token, CPU {s['cpu']:.3f} s/token, "
                      f"stall {1e3 * s['stall']:.0f} ms/token, {s['reads']:.1f} reads and {s['misses']:.1f} misses "
                      f"per token; pinned {s['pinned']}, {s['slots']} slots/layer, warm-up {s['warm_up']:.2f} s",
                      flush=True)
    for name, v in runs.items():
        spt = [s["spt"] for s in v]
        print(f"{100 * a.budget:.0f}% {name}: s/token min {min(spt):.3f}, median {statistics.median(spt):.3f}")


if __name__ == "__main__":
    main()
