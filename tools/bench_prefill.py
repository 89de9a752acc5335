"""Benchmark: prefill speed of a converted model, everything resident — the logits of one random
prompt, timed over a few rounds, with a hash of them (the same hash: the same bits).

    flock /tmp/colibri-cpu.lock .venv/bin/python tools/bench_prefill.py MODEL_DIR [--tokens 64]
        [--rounds 3] [--activations f32|int8]

To compare two builds, run it alternately from each checkout (a `git worktree` of the other commit,
built with `setup.py build_ext --inplace`, and `PYTHONPATH` set to it). Numbers go to BENCHMARKS.md.
"""
import argparse
import hashlib
import time

import numpy as np

import colibri_core


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=64, help="prompt tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--activations", default="f32", help="f32 (exact, the default) or int8")
    args = ap.parse_args()
    with colibri_core.load(args.model, cache_slots=10**6, usage=False, prefetch=False,
                           activations=args.activations) as engine:
        c = engine.container
        for layer in c.moe_layers:  # everything resident
            for e in range(c.n_experts):
                engine.store.get(layer, e)
        ids = [int(i) for i in np.random.default_rng(0).integers(2, 1000, args.tokens)]
        engine.logits(ids[:8])  # the kernels warm
        times = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            logits = engine.logits(ids)
            times.append(time.perf_counter() - t)
    best, median = min(times), sorted(times)[len(times) // 2]
    print(f"{colibri_core.__file__.rsplit('/', 2)[0]}: prefill {args.tokens} tokens ({args.activations}) "
          f"best {best * 1e3:.0f} ms ({args.tokens / best:.1f} tok/s), median {median * 1e3:.0f} ms; "
          f"logits sha256 {hashlib.sha256(logits.tobytes()).hexdigest()[:12]}")


if __name__ == "__main__":
    main()
