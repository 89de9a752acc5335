"""Benchmark (not a test): resident decode on each SIMD path, the paths taking turns token by token in
one process, so a drifting host moves them alike; prints the median ms a token of each.

    flock /tmp/colibri-cpu.lock python tools/bench_simd_decode.py MODEL_DIR [--paths avx2,avx512]
        [--activations int8] [--tokens 48] [--prompt 64]

Every expert is cached first (the model must fit in RAM). The paths give the same bits, so the
tokens decoded do not depend on which path ran which step.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import colibri_core
from colibri_core import kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--paths", default="avx2,avx512", help="comma-separated SIMD paths (portable, avx2, avx512)")
    ap.add_argument("--activations", default="int8")
    ap.add_argument("--tokens", type=int, default=48, help="decoded tokens, shared among the paths in turn")
    ap.add_argument("--prompt", type=int, default=64)
    args = ap.parse_args()
    paths = args.paths.split(",")
    engine = colibri_core.load(args.model, cache_slots=10**6, activations=args.activations)
    c = engine.container
    for layer in c.moe_layers:  # everything resident
        for e in range(c.n_experts):
            engine.store.get(layer, e)
    session = engine.new_session()
    ids = [int(i) for i in np.random.default_rng(0).integers(2, 1000, args.prompt)]
    engine._feed(session, ids)
    seconds = {p: [] for p in paths}
    for i in range(args.tokens):
        path = paths[i % len(paths)]
        kernels.set_simd(path)
        ids.append(3 + i)
        t = time.perf_counter()
        engine._feed(session, ids)
        seconds[path].append(time.perf_counter() - t)
    print(f"{args.model}: {kernels.threads()} threads, activations {args.activations}, context "
          f"{args.prompt}..{args.prompt + args.tokens}")
    for path, s in seconds.items():
        print(f"  {path:8s} {np.median(s) * 1e3:7.1f} ms a token (min {min(s) * 1e3:.1f}, {len(s)} tokens)")


if __name__ == "__main__":
    main()
