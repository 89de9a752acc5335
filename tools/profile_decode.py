"""Where a decode step's time goes: cProfile over N decoded tokens of a converted model, everything
resident; prints the share of time inside the C kernels and the top Python functions.

    flock /tmp/colibri-cpu.lock python tools/profile_decode.py MODEL_DIR [--tokens 16] [--activations int8]
"""
import argparse
import cProfile
import pstats
import os
import time

import numpy as np

import colibri_core
from colibri_core import kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--activations", default="int8")
    args = ap.parse_args()
    engine = colibri_core.load(args.model, cache_slots=10**6, activations=args.activations)
    c = engine.container
    for layer in c.moe_layers:  # everything resident
        for e in range(c.n_experts):
            engine.store.get(layer, e)
    session = engine.new_session()
    ids = [int(i) for i in np.random.default_rng(0).integers(2, 1000, 16)]
    engine._feed(session, ids)
    t = time.perf_counter()
    for i in range(args.tokens):
        ids.append(3 + i)
        engine._feed(session, ids)
    plain = (time.perf_counter() - t) / args.tokens
    prof = cProfile.Profile()
    prof.enable()
    for i in range(args.tokens):
        ids.append(100 + i)
        engine._feed(session, ids)
    prof.disable()
    stats = pstats.Stats(prof)
    total = stats.total_tt
    in_c = sum(tt for (file, _, name), (_, _, tt, _, _) in stats.stats.items() if "_colibri_kernels" in name)
    numpy_c = sum(tt for (file, _, name), (_, _, tt, _, _) in stats.stats.items()
                  if file == "~" and "_colibri_kernels" not in name)
    print(f"{plain * 1e3:.2f} ms per token without the profiler ({1 / plain:.1f} tok/s), "
          f"{kernels.threads()} threads, {kernels.simd()}, activations {args.activations}")
    print(f"under the profiler: {total / args.tokens * 1e3:.2f} ms per token; C kernels {100 * in_c / total:.0f}%, "
          f"other built-ins (NumPy, dict, …) {100 * numpy_c / total:.0f}%, "
          f"Python code {100 * (total - in_c - numpy_c) / total:.0f}%")
    stats.sort_stats(os.environ.get("SORT", "tottime")).print_stats(int(os.environ.get("TOP", "15")))


if __name__ == "__main__":
    main()
