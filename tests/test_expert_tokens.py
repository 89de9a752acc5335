"""Several tokens per expert (2–16: batched requests, drafts verified together, a prefill chunk): one
`moe_experts` call reads each expert's weights once for all of its tokens, and each token's output is
bit for bit what that token alone gives — on every SIMD path, weight kind, arithmetic and thread
count — and the several-token row kernels equal the NumPy reference's reduction order bit for bit.

A code path this CPU lacks is skipped with its reason in the summary (pytest -ra), never silently.
"""
import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from colibri_core import kernels, quant
from colibri_core.bench.kernels import random_qtensor
from colibri_core.kernels import reference
from test_kernels import assert_close, assert_same_bits, ffn_bound, random_x, supported_paths, simd_path, thread_counts  # noqa: F401 (fixtures)

# (kind, act): the formats quantize writes, and DeepSeek's native ones as loaded
MODES = [("f32", "f32"), ("int8", "f32"), ("int8", "int8"), ("int4", "f32"), ("int4", "int8"),
         ("fp8", "f32"), ("fp4", "f32"), ("fp4", "int8")]
PER_EXPERT = tuple(range(1, 17))  # tokens per expert: 1 (the dot) and every count the row kernels take


def weights(rng, kind, rows, cols):
    """Normal weights quantised (with a zero row and a tiny one), or random native fp8 / fp4 bytes."""
    if kind in ("fp8", "fp4"):
        return random_qtensor(rng, kind, rows, cols)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    w[0] = 0.0
    w[1] *= 1e-6
    return quant.quantize(w, kind)


def expert_pair(rng, kind, hidden, inter):
    return {e: (weights(rng, kind, inter, hidden), weights(rng, kind, inter, hidden), weights(rng, kind, hidden, inter))
            for e in (3, 1)}


def one_call(experts, x, act) -> np.ndarray:
    """(T, 2, H): every token routed to both experts, all of them in one moe_experts call."""
    T, hidden = x.shape
    outs = np.full((T, 2, hidden), 7.0, np.float32)
    kernels.moe_experts(outs, x, np.tile(np.array([3, 1]), (T, 1)), experts, act)
    return outs


def alone(experts, x, act) -> np.ndarray:
    """one_call's result, token by token: T calls of one token."""
    return np.concatenate([one_call(experts, x[t:t + 1], act) for t in range(x.shape[0])])


@pytest.mark.parametrize("kind,act", MODES)
@pytest.mark.parametrize("hidden,inter", [(130, 200), (576, 256)])  # a row ending inside a group; 9 whole groups
def test_several_tokens_per_expert_are_each_token_alone(kind, act, hidden, inter, thread_counts):
    rng = np.random.default_rng([hidden, inter, MODES.index((kind, act))])
    experts = expert_pair(rng, kind, hidden, inter)
    for per_expert in PER_EXPERT:
        x = random_x(rng, per_expert, hidden)
        first = None
        for path in supported_paths():
            kernels.set_simd(path)
            kernels.set_threads(1)
            want = alone(experts, x, act)
            first = want if first is None else first
            assert_same_bits(want, first, f"{path}: one token at a time against {supported_paths()[0]}")
            for n in thread_counts:
                kernels.set_threads(n)
                assert np.array_equal(one_call(experts, x, act).view(np.uint32), want.view(np.uint32)), \
                    f"{kind} act={act} {per_expert} tokens per expert, {path}, {n} threads"
    kernels.set_simd("auto")


@pytest.mark.parametrize("kind,act", MODES[:5])
def test_several_tokens_per_expert_match_reference(kind, act):
    rng = np.random.default_rng(50)
    hidden, inter = 200, 130
    gate, up, down = expert_pair(rng, kind, hidden, inter)[3]
    x = random_x(rng, 8, hidden, scale=3.0)
    outs = one_call({3: (gate, up, down), 1: (gate, up, down)}, x, act)
    want = reference.expert_ffn(gate, up, down, x, act)
    bound = ffn_bound(gate, up, down, x, act)
    assert_close(outs[:, 0], want, bound)
    assert_close(outs[:, 1], want, bound)


@pytest.mark.parametrize("kind,act", MODES)
def test_several_token_rows_match_reference_bit_for_bit(simd_path, kind, act):
    """The row kernels themselves (through matmul) at every token count up to past their blocks,
    on widths that end inside a group, inside a chunk of 8 groups and on whole chunks; and past the
    AMX path's blocks of 16 rows and its passes of 64 tokens (whole blocks of 1024 columns: int8 rows
    the tiles read in place: their ranges of rows must hold whole blocks)."""
    rng = np.random.default_rng([MODES.index((kind, act)), 7])
    for rows, cols in [(5, 1), (9, 63), (7, 1100), (6, 1024), (3, 576), (37, 130), (300, 1024)]:
        w = weights(rng, kind, rows, cols)
        for n in itertools.chain(range(2, 18), (33, 40, 70)):
            x = random_x(rng, n, cols)
            assert_same_bits(kernels.matmul(w, x, act), reference.matmul(w, x, act),
                             f"{simd_path} {kind} act={act} [{rows}, {cols}] n={n}")


def test_int8_rows_take_the_whole_int8_range(simd_path):
    """-128 and 127 in the weights (a GGUF's Q8_0 may hold -128, which quantize never writes) against
    activations at ±127: the row kernels' integer sums must neither saturate nor wrap."""
    rng = np.random.default_rng(11)
    for rows, cols in [(4, 576), (3, 1100)]:
        data = rng.choice(np.array([-128, 127, -127, 0, 1], np.int8), (rows, cols))
        w = quant.QTensor("int8", rows, cols, data, np.full(rows, 0.01, np.float32))
        for n in (2, 4, 5, 8, 16):
            x = rng.choice(np.array([-1.0, 1.0, 0.5], np.float32), (n, cols))
            assert_same_bits(kernels.matmul(w, x, "int8"), reference.matmul(w, x, "int8"), f"{simd_path} [{rows}, {cols}] n={n}")


def test_bench_expert_tokens_reports_every_path_arithmetic_and_count():
    """tools/bench_expert_tokens.py (the several-token figures in BENCHMARKS.md), on a small working set."""
    paths = [p for p in supported_paths() if p != "portable"] or pytest.skip("no SIMD path on this CPU to measure")
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "tools" / "bench_expert_tokens.py"), "--tokens", "2,3",
                        "--kinds", "int4,int8", "--acts", "int8,f32", "--simd", ",".join(paths), "--min-seconds", "0.01",
                        "--working-set-mb", "32", "--json"], capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    got = {(row["kind"], row["activations"], row["tokens"], row["simd"]) for row in rows}
    assert got == set(itertools.product(("int4", "int8"), ("int8", "f32"), (2, 3), paths))
    assert all(row["ms"] > 0 and row["read_gbps"] > 0 and row["fraction_of_read"] > 0 for row in rows)
