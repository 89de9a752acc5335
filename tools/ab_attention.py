"""The attention kernel of two builds side by side: each revision's csrc/ compiled as the package
compiles it (colibri_core/kernels/_build.py's flags) into a shared object of its own, both loaded in
one process and called in turn, call after call, so a host whose speed drifts moves both alike.
OLMoE-1B-7B's attention (16 heads of 128, a float16 cache): T new tokens after S − T cached, median
and best of the rounds with 2 threads, then 1; the two outputs must be the same bits.

    flock /tmp/colibri-cpu.lock .venv/bin/python tools/ab_attention.py HEAD~1 HEAD --tokens 128 --context 3331

A revision is anything `git archive` takes, or `.` for the working tree. COLIBRI_SIMD picks the path
(avx2, avx512) as for the engine.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from colibri_core.kernels._build import COMPILE_ARGS, LIBRARIES  # noqa: E402

HEADS, HEAD_DIM, KV_F16 = 16, 128, 1


def build(rev: str, out: Path) -> ctypes.CDLL:
    """`rev`'s csrc/ as a shared object in `out`."""
    src = ROOT / "csrc"
    if rev != ".":
        src = out / "src"
        src.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "csrc"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
        src = src / "csrc"
    lib = out / "kernels.so"
    subprocess.run(["gcc", *COMPILE_ARGS, "-shared", "-fPIC", f"-I{src}", *map(str, sorted(src.glob("*.c"))),
                    "-o", str(lib), *(f"-l{name}" for name in LIBRARIES)], check=True)
    return ctypes.CDLL(str(lib))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("revs", nargs=2, help="the two revisions (`.`: the working tree)")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens T")
    ap.add_argument("--context", type=int, default=3331, help="rows S, the new tokens' included")
    ap.add_argument("--rounds", type=int, default=25)
    args = ap.parse_args()
    T, S = args.tokens, args.context
    rng = np.random.default_rng(0)
    q = rng.standard_normal((T, HEADS, HEAD_DIM), np.float32)
    k, v = (rng.standard_normal((S, HEADS, HEAD_DIM)).astype(np.float16) for _ in range(2))
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        libs = []
        for i, rev in enumerate(args.revs):
            (Path(tmp) / str(i)).mkdir()
            libs.append(build(rev, Path(tmp) / str(i)))
        for threads in (2, 1):
            times, outs = [[], []], [None, None]
            for lib in libs:
                lib.threads_set(threads)
            for _ in range(args.rounds):
                for i, lib in enumerate(libs):
                    out = np.empty((T, HEADS * HEAD_DIM), np.float32)
                    t0 = time.perf_counter()
                    rc = lib.attention(ptr(out), ptr(q), T, HEADS, HEAD_DIM, ptr(k), ptr(v), S, HEADS, S - T,
                                       ctypes.c_float(HEAD_DIM ** -0.5), 0, None, KV_F16)
                    times[i].append(time.perf_counter() - t0)
                    if rc != 0:
                        raise SystemExit(f"{args.revs[i]}: attention returned {rc}")
                    outs[i] = out
            if not np.array_equal(outs[0], outs[1]):
                raise SystemExit("the two builds' outputs differ")
            med = [statistics.median(t) * 1e3 for t in times]
            print(f"{threads} thread{'s' if threads > 1 else ''}, {T} new tokens after {S - T}: "
                  + " · ".join(f"{rev} median {m:.1f} ms (best {min(t) * 1e3:.1f})" for rev, m, t in zip(args.revs, med, times))
                  + f" · ratio {med[1] / med[0]:.3f}, the same bits")


if __name__ == "__main__":
    main()
