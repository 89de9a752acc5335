"""Benchmark: a replayed agent session against the prefix cache — each turn's time to first token
with the cache, without it (--prefix-cache 0), and after a restart (a fresh engine per turn, the
entries found on disk), printed as one JSON object.

    flock /tmp/colibri-cpu.lock .venv/bin/python tools/bench_prefix.py MODEL_DIR [--turns 10]
        [--first 1024] [--growth 256] [--answer 16] [--prefix-cache 2GB]

The session: a first prompt of `--first` random token ids, then each turn adds the model's answer
(`--answer` tokens, greedy) and `--growth` new ids, as an agent that resends the whole conversation
does. The transcript is made once (with the cache) and replayed exactly in the other two modes; the
answers must agree in all three (a cached prefix gives the bits of a cold prefill). The model needs
a context of at least first + turns × (growth + answer) tokens: tools/make_synthetic_olmoe.py's
(4,096) or tools/tiny_model.py's; not the demo's 1,024. Experts are kept resident, so the figures
are prefill compute. The model directory's spilled entries (.prefix_cache) are deleted before and
after. Numbers go to BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np

import colibri_core
from colibri_core.prefix import PREFILL_CHUNK


def _open(model: str, cache: str, chunk: int):
    return colibri_core.load(model, cache_slots=10**6, usage=False, prefetch=False, prefix_cache=cache,
                             prefill_chunk=chunk)


def _turn(engine, prompt: list[int], answer: int) -> tuple[float, list[int], int]:
    """Time to first token (s), the answer, and the prompt tokens the cache served."""
    cached = engine.stats()["prefix_cached_tokens"]
    t0 = time.perf_counter()
    tokens = engine.stream(prompt, answer, stop_ids=())
    out = [next(tokens)]
    ttft = time.perf_counter() - t0
    out += list(tokens)
    return ttft, out, engine.stats()["prefix_cached_tokens"] - cached


def _warm(engine) -> None:
    """The kernels warm, and no entry left from before (a cold first turn)."""
    engine.logits(list(range(2, 66)))
    engine.prefix_cache.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--first", type=int, default=1024, help="token ids of the first prompt")
    ap.add_argument("--growth", type=int, default=256, help="new token ids each later turn adds")
    ap.add_argument("--answer", type=int, default=16, help="tokens generated each turn")
    ap.add_argument("--prefix-cache", default="2GB", help="the cache's RAM budget (its disk budget too)")
    ap.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, help="tokens between the boundaries states "
                    "are kept at (a multiple of 64)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    runs = {"cache": [], "no_cache": [], "restart": []}  # mode -> [(ttft, answer, cached)] per turn

    prompts = []
    with _open(args.model, args.prefix_cache, args.prefill_chunk) as engine:  # the transcript, with the cache
        _warm(engine)
        vocab = engine.model.vocab_size
        context = rng.integers(2, vocab, args.first).tolist()
        for _ in range(args.turns):
            prompts.append(context)
            runs["cache"].append(_turn(engine, context, args.answer))
            context = context + runs["cache"][-1][1] + rng.integers(2, vocab, args.growth).tolist()
        engine.prefix_cache.clear()  # the restart mode starts from an empty disk
    with _open(args.model, "0", args.prefill_chunk) as engine:
        _warm(engine)
        runs["no_cache"] = [_turn(engine, p, args.answer) for p in prompts]
    loads = []
    for i, prompt in enumerate(prompts):  # a restart before every turn: what the last engine spilled at close
        t0 = time.perf_counter()
        with _open(args.model, args.prefix_cache, args.prefill_chunk) as engine:
            loads.append(time.perf_counter() - t0)
            engine.logits(list(range(2, 66)))  # as warm as the others (the cache is not used by logits)
            runs["restart"].append(_turn(engine, prompt, args.answer))
            if i == len(prompts) - 1:
                engine.prefix_cache.clear()  # the model directory as it was

    answers = {mode: [r[1] for r in turns] for mode, turns in runs.items()}
    if not answers["cache"] == answers["no_cache"] == answers["restart"]:
        raise SystemExit("the answers differ between modes: a cached prefix did not give a cold prefill's bits")
    later = slice(1, None)  # turns 2…N: the ones a cache can serve

    def speedup(mode: str) -> float:
        return statistics.median(a[0] / b[0] for a, b in zip(runs["no_cache"][later], runs[mode][later]))

    print(json.dumps({
        "model": os.path.abspath(args.model), "turns": args.turns, "first": args.first, "growth": args.growth,
        "answer": args.answer, "prefix_cache": args.prefix_cache, "prefill_chunk": args.prefill_chunk,
        "prompt_tokens": [len(p) for p in prompts],
        "ttft_s": {mode: [round(r[0], 4) for r in turns] for mode, turns in runs.items()},
        "cached_tokens": {mode: [r[2] for r in turns] for mode, turns in runs.items()},
        "restart_load_s": [round(t, 3) for t in loads],  # each fresh engine's load, before its turn
        "median_speedup_turns_2_on": {"cache": round(speedup("cache"), 2), "restart": round(speedup("restart"), 2)},
        "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d"),
    }, indent=1))


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


if __name__ == "__main__":
    main()
