"""Where a decode step's time goes: cProfile over N decoded tokens of a converted model, everything
resident; prints the share of time inside the C kernels and the top Python functions. With
`--per-call`, no profiler: each C entry point is timed where the decode step calls it (calls and
milliseconds per token), and what is left is the Python between them.

    flock /tmp/colibri-cpu.lock python tools/profile_decode.py MODEL_DIR [--tokens 16] [--prompt 16]
        [--activations int8] [--per-call]
"""
import argparse
import cProfile
import collections
import pstats
import os
import sys
import time

import numpy as np

import colibri_core
from colibri_core import kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens: the context the decoded tokens attend to")
    ap.add_argument("--activations", default="int8")
    ap.add_argument("--per-call", action="store_true", help="time each C entry point instead of profiling")
    args = ap.parse_args()
    engine = colibri_core.load(args.model, cache_slots=10**6, activations=args.activations)
    c = engine.container
    for layer in c.moe_layers:  # everything resident
        for e in range(c.n_experts):
            engine.store.get(layer, e)
    session = engine.new_session()
    ids = [int(i) for i in np.random.default_rng(0).integers(2, 1000, args.prompt)]
    engine._feed(session, ids)
    t = time.perf_counter()
    for i in range(args.tokens):
        ids.append(3 + i)
        engine._feed(session, ids)
    plain = (time.perf_counter() - t) / args.tokens
    if args.per_call:
        per_call(engine, session, ids, args.tokens, plain)
        return
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


class _TimedLib:
    """kernels.lib with every C entry point timed into `seconds` and counted into `calls`."""

    def __init__(self, lib):
        self._lib, self.seconds, self.calls = lib, collections.Counter(), collections.Counter()

    def __getattr__(self, name):
        f = getattr(self._lib, name)
        if not callable(f):
            return f

        def timed(*args):
            t = time.perf_counter()
            try:
                return f(*args)
            finally:
                self.seconds[name] += time.perf_counter() - t
                self.calls[name] += 1

        return timed


def per_call(engine, session, ids: list, tokens: int, plain: float) -> None:
    timed = _TimedLib(kernels.lib)
    users = [m for name, m in sys.modules.items()  # every module that calls the library by the name `lib`
             if name.startswith("colibri") and getattr(m, "lib", None) is timed._lib]
    for m in users:
        m.lib = timed
    try:
        t = time.perf_counter()
        for i in range(tokens):
            ids.append(200 + i)
            engine._feed(session, ids)
        step = (time.perf_counter() - t) / tokens
    finally:
        for m in users:
            m.lib = timed._lib
    in_c = sum(timed.seconds.values()) / tokens
    print(f"{plain * 1e3:.2f} ms per token untimed, {step * 1e3:.2f} timed ({kernels.threads()} threads, "
          f"{kernels.simd()}, activations {engine.activations}, context {len(ids) - tokens}..{len(ids)}); "
          f"C calls {in_c * 1e3:.2f} ms, outside them (Python, NumPy) {(step - in_c) * 1e3:.2f} ms")
    for name, sec in timed.seconds.most_common():
        n = timed.calls[name]
        print(f"  {name:24s} {n / tokens:6.1f} calls {sec / tokens * 1e3:8.3f} ms per token {sec / n * 1e6:9.1f} µs per call")


if __name__ == "__main__":
    main()
