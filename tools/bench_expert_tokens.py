"""Several tokens per expert: `moe_experts` at 2–16 tokens an expert against the machine's read bandwidth.

Batched requests, drafts verified together and prefill chunks run each expert on several tokens, and
one call reads each expert's weights once for all of them, so a call is judged as a matrix-vector
one is: the experts' bytes over the call's time, against the read probe (`planning.ReadProbe`,
the same threads) measured in the same run. 8 OLMoE-size experts (2048 → 1024 → 2048), every token
routed to all 8 (`colibri_core.bench.kernels.run_expert_tokens_case`'s setup, for each weight kind
and arithmetic); the code paths and the probe take turns call by call, so a host whose speed drifts
moves them alike. Run it under the CPU lock:

    flock /tmp/colibri-cpu.lock .venv/bin/python tools/bench_expert_tokens.py [--tokens 2,4,8,16]
        [--kinds int4,int8] [--acts int8,f32] [--simd avx512,avx2] [--json]
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from colibri_core import kernels
from colibri_core.bench.kernels import MIN_SECONDS, WORKING_SET, _on_paths, cpu_name, random_qtensor, simd_paths
from colibri_core.planning import ReadProbe

HIDDEN, INTER, EXPERTS = 2048, 1024, 8


def expert_pool(rng: np.random.Generator, kind: str, working_set: int) -> tuple[list[dict], int]:
    """Copies of 8 experts, enough to leave the last-level cache, and one expert's bytes."""
    expert_bytes = 3 * random_qtensor(rng, kind, INTER, HIDDEN).nbytes
    pool = [{e: (random_qtensor(rng, kind, INTER, HIDDEN), random_qtensor(rng, kind, INTER, HIDDEN),
                 random_qtensor(rng, kind, HIDDEN, INTER)) for e in range(EXPERTS)}
            for _ in range(max(1, working_set // (EXPERTS * expert_bytes)))]
    return pool, expert_bytes


def measure(pool: list[dict], expert_bytes: int, per_expert: int, act: str, paths: list[str], probe: ReadProbe,
            rng: np.random.Generator, min_seconds: float) -> list[dict]:
    """One row per path: `per_expert` tokens routed to all 8 experts, one moe_experts call each time."""
    x = rng.standard_normal((per_expert, HIDDEN), dtype=np.float32)
    ids = np.tile(np.arange(EXPERTS), (per_expert, 1))  # (tokens, 8)
    outs = np.zeros((per_expert, EXPERTS, HIDDEN), np.float32)
    at = [0]

    def call():
        kernels.moe_experts(outs, x, ids, pool[at[0] % len(pool)], act)
        at[0] += 1

    per_path, read = _on_paths(call, paths, probe, min_seconds)
    return [{"simd": p, "tokens": per_expert, "activations": act, "ms": s * 1e3,
             "gbps": EXPERTS * expert_bytes / s / 1e9, "read_gbps": read / 1e9,
             "fraction_of_read": EXPERTS * expert_bytes / s / read} for p, s in per_path.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="2,4,8,16", help="tokens per expert, comma separated")
    ap.add_argument("--kinds", default="int4,int8", help="weight kinds")
    ap.add_argument("--acts", default="int8,f32", help="activation arithmetics (int8: fast, f32: exact)")
    ap.add_argument("--simd", default="simd", help="code paths: simd (every SIMD path this CPU runs), or names, comma separated")
    ap.add_argument("--min-seconds", type=float, default=MIN_SECONDS, help="per path and measurement")
    ap.add_argument("--working-set-mb", type=int, default=WORKING_SET // 2**20,
                    help="MB of weights the calls cycle through, and the read probe reads (>> the last-level cache)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args()
    paths = [p for p in simd_paths("all") if p != "portable"] if args.simd == "simd" else \
        [p for name in args.simd.split(",") for p in simd_paths(name)]
    default = kernels.simd()
    working_set = args.working_set_mb * 2**20
    rng, probe = np.random.default_rng(0), ReadProbe(working_set)
    rows = []
    try:
        for kind in args.kinds.split(","):
            pool, expert_bytes = expert_pool(rng, kind, working_set)
            for act in args.acts.split(","):
                for t in (int(v) for v in args.tokens.split(",")):
                    for r in measure(pool, expert_bytes, t, act, paths, probe, rng, args.min_seconds):
                        rows.append({"kind": kind, **r})
            del pool
    finally:
        kernels.set_simd(default)
    if args.json:
        print(json.dumps({"cpu": cpu_name(), "threads": kernels.threads(), "rows": rows}, indent=1))
        return
    print(f"{cpu_name()}, {kernels.threads()} threads; 8 experts of 2048 -> 1024 -> 2048, every token routed to all 8")
    print(f"{'weights':<8}{'act':<6}{'tok':>4}" + "".join(f"  {p + ' ms':>11}{'% read':>7}" for p in paths) + "  read GB/s")
    for i in range(0, len(rows), len(paths)):
        group = rows[i:i + len(paths)]
        r0 = group[0]
        line = f"{r0['kind']:<8}{r0['activations']:<6}{r0['tokens']:>4}"
        line += "".join(f"  {r['ms']:>11.3f}{100 * r['fraction_of_read']:>6.0f}%" for r in group)
        print(line + f"  {r0['read_gbps']:.1f}")


if __name__ == "__main__":
    main()
