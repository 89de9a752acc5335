"""A cold streamed session with the router lookahead reading 1, 2 or 3 MoE layers ahead (or off),
each against its measured floor (a benchmark, not a test).

    flock /tmp/colibri-cpu.lock .venv/bin/python tools/bench_lookahead_depth.py bench-data/olmoe-synth-16l --rounds 2 --policy lru

Per session (`--modes`, taking turns each round, a fresh engine each): a cache of `--fraction` of each
layer's experts, O_DIRECT reads, no routing history (so no hot-store: `colibri bench`'s cold session),
one untimed prompt (the cache fills), then `--prompts` prompts of `--prompt-tokens` tokens with
`--tokens` decoded each, sampled at temperature 1 with a seed each, so every session replays the same
tokens. Printed: decode ms a token, MB read a token, I/O stall, the prefetches issued and used (hits)
and the recall at each distance; then the session's measured floor, as `colibri bench` measures it
(colibri_core/bench/model.py, step 5): an engine holding every expert decodes the same prompts while
the I/O pool reads, for each token, as many bytes as the session read a token, every read started with
its token. Last, each mode's median over the rounds.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from colibri_core.bench.model import _loaded_run, _prompts, _run, _TokenReads, drop_page_cache
from colibri_core.container import Container
from colibri_core.engine import load
from colibri_core.planning import sizes_from_container


def session(model: Path, slots: int, mode: str, prompts: list[list[int]], tokens: int, policy: str | None) -> dict:
    """One cold session of `mode` ("off", or the lookahead depth "1", "2", "3") evicting under `policy`
    (None: the default): decode time, bytes read and the lookahead's counters per distance over the
    timed prompts (all but the first)."""
    drop_page_cache()
    options = {} if mode == "off" else {"lookahead": int(mode)}
    if policy is not None:
        options["policy"] = policy
    with load(model, cache_slots=slots, usage=False, direct=True, prefetch=mode != "off", **options) as engine:
        runs = [_run(engine, p, tokens, seed) for seed, p in enumerate(prompts)]
        by_distance = engine.stats()["prefetch_by_distance"]
    timed = runs[1:]
    tok = sum(r["decoded_tokens"] for r in timed)
    return {"s": sum(r["decode_seconds"] for r in timed) / tok,
            "bytes": sum(r["bytes_read_per_token"] * r["decoded_tokens"] for r in timed) / tok,
            "stall": sum(r["decode_io_stall_seconds"] for r in timed) / tok,
            "per_run_bytes": [r["bytes_read_per_token"] for r in runs],
            "by_distance": by_distance}


def measured_floor(model: Path, prompts: list[list[int]], tokens: int, per_run_bytes: list[float], seed: int) -> float:
    """Seconds a decoded token with every expert resident while reading `per_run_bytes` a token
    (one figure per prompt) on the side: `colibri bench`'s measured floor of those prompts."""
    with load(model, cache_slots=10**6, usage=False, prefetch=False) as engine:
        for i, p in enumerate(prompts):  # read every expert the prompts route to
            _run(engine, p, tokens, i)
        reads = _TokenReads(Container(model), seed)
        try:
            loaded = [_loaded_run(engine, p, tokens, i, nbytes, reads)
                      for i, (p, nbytes) in enumerate(zip(prompts, per_run_bytes))][1:]
        finally:
            reads.close()
    return sum(f["seconds_per_token"] for f in loaded) / len(loaded)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--fraction", type=float, default=0.5, help="cache slots a layer, as a share of its experts")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=12, help="tokens decoded after each prompt")
    ap.add_argument("--modes", default="off,1,2,3")
    ap.add_argument("--policy", default=None, help="the cache's eviction policy (default: the engine's)")
    args = ap.parse_args()
    modes = args.modes.split(",")
    n_experts = sizes_from_container(args.model).n_experts
    slots = max(1, round(args.fraction * n_experts))
    with load(args.model, cache_slots=1, usage=False, prefetch=False) as engine:
        prompts = _prompts(engine, args.prompts + 1, args.prompt_tokens, 0)  # the first: untimed
    print(f"{args.model}: {slots} of {n_experts} experts cached a layer, {args.prompts} prompts of "
          f"{args.prompt_tokens} tokens + {args.tokens} decoded, O_DIRECT, no hot-store, page cache "
          f"{'dropped' if drop_page_cache() else 'not dropped'} before each session")
    results = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in modes:
            s = session(args.model, slots, m, prompts, args.tokens, args.policy)
            s["floor"] = measured_floor(args.model, prompts, args.tokens, s["per_run_bytes"], seed=r + 1)
            results[m].append(s)
            distances = " · ".join(f"d{d} issued {c['issued']} used {c['used']} recall {100 * c['recall']:.0f} %"
                                   for d, c in s["by_distance"].items())
            print(f"round {r + 1} lookahead {m:3s} {1e3 * s['s']:6.1f} ms a token ({s['s'] / s['floor']:.2f}× its "
                  f"measured floor {1e3 * s['floor']:.1f}), {s['bytes'] / 1e6:6.1f} MB read a token, stall "
                  f"{1e3 * s['stall']:5.1f} ms{'; ' + distances if distances else ''}", flush=True)
    for m, runs in results.items():
        print(f"median lookahead {m:3s} {1e3 * statistics.median(s['s'] for s in runs):6.1f} ms a token, "
              f"{statistics.median(s['s'] / s['floor'] for s in runs):.2f}× the measured floor, "
              f"{statistics.median(s['bytes'] for s in runs) / 1e6:6.1f} MB read a token")


if __name__ == "__main__":
    main()
