"""`colibri bench kernels`: each C kernel's speed beside the machine's read bandwidth, one run.

Decode is bound by memory bandwidth, so a matrix-vector kernel is judged by the bytes of weights it
streams per second against what the machine can read (measured here, in the same run, with the
same threads, by the probe `colibri plan` measures memory with: `planning.ReadProbe`). Prefill is bound by arithmetic, so matrix-matrix kernels also report GFLOP/s
(2 · rows · cols · tokens per call). Weights are random and larger than the last-level cache, and
the calls cycle through several copies, so every byte comes from RAM as in a real decode.

`--simd all` runs every kernel on each code path this CPU can run (portable, avx2, avx512),
side by side; `--simd NAME` one path. The paths and a pass of the read-bandwidth probe take turns
call by call, so a host whose speed drifts within minutes (a shared VM) moves them alike: each
kernel's "% read" is against the reads taken between its own calls.

JSON shape: {"machine": {"read_gbps": …, "threads": …, "simd": (the default path), "paths": […], "cpu": …},
             "kernels": [{"name": "int4_matvec", "simd": "avx2", "gbps": …, "fraction_of_read": …, …}, …]}
"""
from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass

import numpy as np

from colibri_core import kernels
from colibri_core.arena import huge_pages
from colibri_core.errors import ColibriError
from colibri_core.planning import ReadProbe
from colibri_core.quant import INT4_GROUP, QTensor, layout

MIN_SECONDS = 0.6  # per measurement: repeat calls at least this long
WORKING_SET = 512 * 2**20  # bytes of weights each kernel cycles through (≫ any last-level cache)


@dataclass(frozen=True)
class Case:
    name: str  # e.g. "int4_matvec"
    kind: str  # weight quantisation
    act: str  # activation arithmetic
    rows: int
    cols: int
    tokens: int  # 1: matrix-vector; more: matrix-matrix
    what: str  # one line for the table


CASES = (
    Case("int4_matvec", "int4", "int8", 4096, 4096, 1, "int4 weights, int8 activations (fast mode)"),
    Case("int4_matvec_f32act", "int4", "f32", 4096, 4096, 1, "int4 weights, f32 activations (exact mode)"),
    Case("int8_matvec", "int8", "int8", 4096, 4096, 1, "int8 weights, int8 activations"),
    Case("int8_matvec_f32act", "int8", "f32", 4096, 4096, 1, "int8 weights, f32 activations"),
    Case("f32_matvec", "f32", "f32", 2048, 4096, 1, "f32 weights"),
    Case("int4_matmul", "int4", "int8", 4096, 4096, 32, "32 tokens (prefill), int8 activations"),
    Case("int4_matmul_f32act", "int4", "f32", 4096, 4096, 32, "32 tokens, f32 activations"),
    Case("int8_matmul", "int8", "int8", 4096, 4096, 32, "32 tokens, int8 activations"),
    # DeepSeek's native formats, computed on as loaded (fp8 always in the exact arithmetic)
    Case("fp8_matvec", "fp8", "f32", 4096, 4096, 1, "fp8 e4m3 weights, 128x128 block scales"),
    Case("fp4_matvec", "fp4", "int8", 4096, 4096, 1, "fp4 e2m1 weights, int8 activations"),
    Case("fp4_matvec_f32act", "fp4", "f32", 4096, 4096, 1, "fp4 e2m1 weights, f32 activations"),
    Case("fp8_matmul", "fp8", "f32", 4096, 4096, 32, "32 tokens, fp8 weights"),
    Case("fp4_matmul", "fp4", "int8", 4096, 4096, 32, "32 tokens, fp4 weights, int8 activations"),
)


def random_qtensor(rng: np.random.Generator, kind: str, rows: int, cols: int) -> QTensor:
    """Random weights of the format's full range, made without float quantisation (fast), in huge
    pages as the engine holds weights (`arena`, the store's slabs): with 4 KB pages a 2 MB matrix
    streams slower, a cost of the benchmark, not of the kernel."""
    w = _random_qtensor(rng, kind, rows, cols)
    data = huge_pages(w.data.nbytes).view(w.data.dtype).reshape(w.data.shape)
    data[...] = w.data
    return QTensor(w.kind, w.rows, w.cols, data, w.scales)


def _random_qtensor(rng: np.random.Generator, kind: str, rows: int, cols: int) -> QTensor:
    if kind == "int4":
        data = rng.integers(0, 256, (rows, (cols + 1) // 2), dtype=np.uint8)
        scales = (rng.random((rows, -(-cols // INT4_GROUP)), dtype=np.float32) * 0.02 + 0.001).astype(np.float16)
        return QTensor("int4", rows, cols, data, scales)
    if kind in ("fp8", "fp4"):  # every byte (fp8 without NaN), checkpoint-like UE8M0 scales 2^-15 .. 2^-5
        (_, _, dshape), (_, _, sshape) = layout(kind, rows, cols)
        data = rng.integers(0, 256, dshape, dtype=np.uint8)
        if kind == "fp8":
            data[(data & 0x7F) == 0x7F] ^= 1
        return QTensor(kind, rows, cols, data, rng.integers(112, 123, sshape, dtype=np.uint8))
    if kind == "int8":
        data = rng.integers(-127, 128, (rows, cols), dtype=np.int8)
        return QTensor("int8", rows, cols, data, (rng.random(rows, dtype=np.float32) * 0.01 + 0.001))
    return QTensor("f32", rows, cols, rng.standard_normal((rows, cols), dtype=np.float32))


def _timed_turns(fns: dict, min_seconds: float) -> dict:
    """Median seconds per call of each of `fns` ({name: (setup, call)}), the calls taking turns
    (setup untimed before each) for at least `min_seconds` per fn and 5 calls each, after one
    warm-up call each."""
    for setup, call in fns.values():
        setup()
        call()
    times = {name: [] for name in fns}
    start = time.perf_counter()
    while time.perf_counter() - start < min_seconds * len(fns) or len(times[next(iter(fns))]) < 5:
        for name, (setup, call) in fns.items():
            setup()
            t = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t)
    return {name: float(np.median(v)) for name, v in times.items()}


def _on_paths(call, paths: list[str], probe: ReadProbe, min_seconds: float) -> tuple[dict, float]:
    """({path: median seconds of `call`}, read bytes/s), the paths and the probe taking turns."""
    fns = {p: (lambda p=p: kernels.set_simd(p), call) for p in paths}
    fns["read"] = (lambda: None, probe)
    seconds = _timed_turns(fns, min_seconds)
    return {p: seconds[p] for p in paths}, probe.nbytes / seconds["read"]


def run_case(case: Case, rng: np.random.Generator, working_set: int, min_seconds: float,
             paths: list[str], probe: ReadProbe) -> list[dict]:
    """One row per path: the same weights, the calls cycling through enough copies to leave the cache."""
    w0 = random_qtensor(rng, case.kind, case.rows, case.cols)
    copies = max(1, working_set // w0.nbytes)
    ws = [w0] + [random_qtensor(rng, case.kind, case.rows, case.cols) for _ in range(copies - 1)]
    x = rng.standard_normal((case.tokens, case.cols), dtype=np.float32)
    at = [0]

    def call():
        kernels.matmul(ws[at[0] % len(ws)], x, case.act)
        at[0] += 1

    per_path, read = _on_paths(call, paths, probe, min_seconds)
    rows = []
    for path, seconds in per_path.items():
        row = {"simd": path, "name": case.name, "kind": case.kind, "activations": case.act, "rows": case.rows,
               "cols": case.cols, "tokens": case.tokens, "seconds": seconds, "gbps": w0.nbytes / seconds / 1e9,
               "read_gbps": read / 1e9}
        if case.tokens > 1:
            row["gflops"] = 2.0 * case.rows * case.cols * case.tokens / seconds / 1e9
        rows.append(row)
    return rows


def run_moe_case(rng: np.random.Generator, tokens: int, working_set: int, min_seconds: float, paths: list[str],
                 probe: ReadProbe, n_experts: int = 64, kind: str = "int4") -> list[dict]:
    """One OLMoE-1B-7B MoE layer (64 experts of 2048 -> 1024 -> 2048, int4 or `kind`, top-8) through
    moe_experts, `tokens` tokens routed at random, cycling over enough layers to leave the cache."""
    hidden, inter, k = 2048, 1024, 8
    expert_bytes = 3 * random_qtensor(rng, kind, inter, hidden).nbytes
    layers = max(1, working_set // (n_experts * expert_bytes))
    pool = [{e: (random_qtensor(rng, kind, inter, hidden), random_qtensor(rng, kind, inter, hidden),
                 random_qtensor(rng, kind, hidden, inter)) for e in range(n_experts)} for _ in range(layers)]
    x = rng.standard_normal((tokens, hidden), dtype=np.float32)
    routes = [np.stack([rng.permutation(n_experts)[:k] for _ in range(tokens)]) for _ in range(16)]
    outs = np.zeros((tokens, k, hidden), np.float32)
    at = [0]
    used = [0]

    def call():
        ids = routes[at[0] % len(routes)]
        layer = pool[at[0] % len(pool)]
        experts = {int(e): layer[int(e)] for e in np.unique(ids)}
        kernels.moe_experts(outs, x, ids, experts, "int8")
        used[0] = len(experts)
        at[0] += 1

    per_path, read = _on_paths(call, paths, probe, min_seconds)
    name = "moe_experts" + ("" if kind == "int4" else f"_{kind}") + ("" if tokens == 1 else f"_{tokens}tok")
    rows = []
    for path, seconds in per_path.items():
        row = {"simd": path, "name": name, "kind": kind, "activations": "int8", "rows": inter, "cols": hidden,
               "tokens": tokens, "experts": used[0], "seconds": seconds,
               "gbps": used[0] * expert_bytes / seconds / 1e9, "read_gbps": read / 1e9}
        if tokens > 1:
            row["gflops"] = 2.0 * 3 * inter * hidden * tokens * k / seconds / 1e9
        rows.append(row)
    return rows


def run_expert_tokens_case(rng: np.random.Generator, per_expert: int, working_set: int, min_seconds: float,
                           paths: list[str], probe: ReadProbe, kind: str = "int4") -> list[dict]:
    """8 OLMoE-size experts (2048 -> 1024 -> 2048) through moe_experts with `per_expert` tokens each,
    int8 activations (every token routed to all 8, as batched requests and verified drafts run each
    expert on several tokens): each call reads the 8 experts' weights once, so GB/s is their bytes
    over the call's time."""
    hidden, inter, n = 2048, 1024, 8
    expert_bytes = 3 * random_qtensor(rng, kind, inter, hidden).nbytes
    pool = [{e: (random_qtensor(rng, kind, inter, hidden), random_qtensor(rng, kind, inter, hidden),
                 random_qtensor(rng, kind, hidden, inter)) for e in range(n)}
            for _ in range(max(1, working_set // (n * expert_bytes)))]
    x = rng.standard_normal((per_expert, hidden), dtype=np.float32)
    ids = np.tile(np.arange(n), (per_expert, 1))  # (tokens, 8)
    outs = np.zeros((per_expert, n, hidden), np.float32)
    at = [0]

    def call():
        kernels.moe_experts(outs, x, ids, pool[at[0] % len(pool)], "int8")
        at[0] += 1

    per_path, read = _on_paths(call, paths, probe, min_seconds)
    return [{"simd": path, "name": f"moe_{per_expert}tok_per_expert", "kind": kind, "activations": "int8",
             "rows": inter, "cols": hidden, "tokens": per_expert, "experts": n, "seconds": seconds,
             "gbps": n * expert_bytes / seconds / 1e9, "read_gbps": read / 1e9,
             "gflops": 2.0 * 3 * inter * hidden * per_expert * n / seconds / 1e9} for path, seconds in per_path.items()]


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def simd_paths(which: str | None) -> list[str]:
    """The code paths to measure: None → the one in use, "all" → every one this CPU runs, or NAME."""
    if which is None:
        return [kernels.simd()]
    if which == "all":
        return [p for p in kernels.SIMD_PATHS if kernels.simd_supported(p)]
    if not kernels.simd_supported(which):
        raise ColibriError(f"--simd {which}: this CPU cannot run that path (it can: "
                           f"{', '.join(p for p in kernels.SIMD_PATHS if kernels.simd_supported(p))}, or all)")
    return [which]


def run(seed: int = 0, working_set: int = WORKING_SET, min_seconds: float = MIN_SECONDS, moe_experts: int = 64,
        simd: str | None = None, cases: tuple[Case, ...] = CASES) -> dict:
    """Measure every case on every code path (`simd_paths`), the paths and the read probe taking turns;
    returns the JSON-shaped result. (The keyword arguments shrink the run for a quick check of the
    machinery; the defaults are the benchmark.)"""
    paths, default = simd_paths(simd), kernels.simd()
    probe, rng = ReadProbe(working_set), np.random.default_rng(seed)
    rows = []
    try:
        for c in cases:
            rows += run_case(c, rng, working_set, min_seconds, paths, probe)
        for kind in ("int4", "fp4"):
            for t in (1, 16):
                rows += run_moe_case(rng, t, working_set, min_seconds, paths, probe, moe_experts, kind)
        rows += run_expert_tokens_case(rng, 8, working_set, min_seconds, paths, probe)
    finally:
        kernels.set_simd(default)
    for r in rows:
        r["fraction_of_read"] = r["gbps"] / r["read_gbps"]
    rows.sort(key=lambda r: paths.index(r["simd"]))  # path by path, the cases in order (stable)
    return {"machine": {"read_gbps": float(np.median([r["read_gbps"] for r in rows])), "threads": kernels.threads(),
                        "simd": default, "paths": paths, "cpu": cpu_name(), "load_average": os.getloadavg()[0]},
            "kernels": rows}


def format_table(result: dict) -> str:
    """One line per kernel; per code path its ms, GB/s, % of the read bandwidth (and GFLOP/s)."""
    m, paths = result["machine"], result["machine"]["paths"]
    lines = [f"read bandwidth {m['read_gbps']:.1f} GB/s (median of the passes between the kernels' calls; each "
             f"% read is against those of its own row)  ({m['threads']} threads, default path {m['simd']}, "
             f"{m['cpu']}, load average {m['load_average']:.1f})",
             f"{'':<22} {'':>16} {'':>4}" + "".join(f" {'── ' + p + ' ':─<34}" for p in paths),
             f"{'kernel':<22} {'shape':>16} {'tok':>4}" + f" {'ms':>8} {'GB/s':>7} {'% read':>7} {'GFLOP/s':>8}" * len(paths)]
    by_name: dict[str, dict] = {}
    for r in result["kernels"]:
        by_name.setdefault(r["name"], {})[r["simd"]] = r
    for name, per_path in by_name.items():
        r0 = next(iter(per_path.values()))
        shape = f"{r0['rows']}x{r0['cols']}" + (f" x{r0['experts']}" if "experts" in r0 else "")
        line = f"{name:<22} {shape:>16} {r0['tokens']:>4}"
        for p in paths:
            r = per_path[p]
            gflops = f"{r['gflops']:8.1f}" if "gflops" in r else f"{'':>8}"
            line += f" {r['seconds'] * 1e3:8.3f} {r['gbps']:7.1f} {100 * r['fraction_of_read']:6.0f}% {gflops}"
        lines.append(line)
    return "\n".join(lines)
