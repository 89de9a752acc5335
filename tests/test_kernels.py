"""The C kernels against their NumPy references, on awkward sizes, for every weight kind, activation
arithmetic, SIMD code path and thread count.

`matmul` must equal `reference.matmul` **bit for bit**: the reference computes the C kernels' fixed
reduction order (csrc/matmul.c) with NumPy float32 operations, and the int8-activation sums are
exact integers. expert_ffn applies silu, where NumPy's exp and C's expf may differ in the last bit,
so it is compared within float32 rounding — and bit for bit across code paths, thread counts and
batches, where C is compared with itself. The references themselves are checked against float64
``x @ dequantize(w).T`` within 1e-5 of each element's magnitude (the sum of |terms|).

A code path this CPU lacks is skipped with its reason in the summary (pytest -ra), never silently.
"""
import dataclasses
import itertools
import os
import subprocess
import sys

import numpy as np
import pytest

from colibri_core import kernels, quant
from colibri_core.errors import ColibriError
from colibri_core.kernels import reference
from colibri_core.quant import KINDS, QTensor

SIZES = (1, 3, 63, 65, 127, 130, 200)
TOKENS = (1, 2, 5)
EPS = 1e-5
MODES = [("f32", "f32"), ("int8", "f32"), ("int8", "int8"), ("int4", "f32"), ("int4", "int8")]  # (kind, act)


def random_weights(rng, rows, cols, kind) -> QTensor:
    """Normal weights with the corners of the formats: a zero row (scale 0) and a tiny row
    (int4 scales that are float16 subnormals)."""
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    if rows >= 2:
        w[0] = 0.0
        w[1] *= 1e-6
    return quant.quantize(w, kind)


def random_x(rng, n, cols, scale=1.0) -> np.ndarray:
    """Normal activations with a zero token (int8 blocks of scale 0) when there is room for one."""
    x = (scale * rng.standard_normal((n, cols))).astype(np.float32)
    if n >= 3:
        x[1] = 0.0
    return x


def magnitude(w: QTensor, x: np.ndarray) -> np.ndarray:
    """float64 [n, rows]: sum_j |x_j| |w_rj|, what a rounding error is measured against."""
    return np.abs(x.astype(np.float64)) @ np.abs(quant.dequantize(w).astype(np.float64)).T


def assert_close(got, want, bound):
    assert got.dtype == np.float32 and got.shape == want.shape
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    worst = np.unravel_index(np.argmax(err - bound), err.shape) if err.size else None
    assert np.all(err <= bound), (
        f"off by {err[worst]:.3g} at {worst}, allowed {bound[worst]:.3g} (got {got[worst]!r}, want {want[worst]!r})"
    )


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


def assert_same_bits(got, want, what=""):
    assert got.shape == want.shape, what
    diff = bits(got) != bits(want)
    assert not diff.any(), f"{what}: {diff.sum()} of {diff.size} differ, first at {np.argwhere(diff)[0]}: " \
                           f"{got[tuple(np.argwhere(diff)[0])]!r} vs {want[tuple(np.argwhere(diff)[0])]!r}"


def read_only_copy(t: QTensor) -> QTensor:
    """The same tensor viewed from an immutable bytes buffer, as the expert store hands it over."""
    buf = bytearray()
    quant.pack(t, buf)
    ro, _ = quant.from_buffer(t.kind, t.rows, t.cols, bytes(buf))
    assert not ro.data.flags.writeable
    return ro


@pytest.fixture(params=kernels.SIMD_PATHS)
def simd_path(request):
    """Each SIMD code path in turn (forced, as COLIBRI_SIMD does); the CPU's best one after."""
    name = request.param
    if not kernels.simd_supported(name):
        pytest.skip(reason=f"this CPU lacks the {name} path's instructions: it cannot be tested here")
    kernels.set_simd(name)
    yield name
    kernels.set_simd("auto")


@pytest.fixture
def thread_counts():
    """Yields the thread counts to try; restores the kernels' thread count after."""
    before = kernels.threads()
    yield (1, 2, 3, 7)
    kernels.set_threads(before)


def supported_paths():
    return [p for p in kernels.SIMD_PATHS if kernels.simd_supported(p)]


# ----------------------------------------------------------------------------
# float16 scales


def test_f16_to_f32_every_bit_pattern():
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    want = h.view(np.float16).astype(np.float32)
    got = np.array([kernels.lib.f16_to_f32(int(v)) for v in h], np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(bits(got)[~nan], bits(want)[~nan])  # zeros (both signs), subnormals, inf


# ----------------------------------------------------------------------------
# matmul: bit for bit against the reference, on every path


@pytest.mark.parametrize("kind,act", MODES)
def test_matmul_matches_reference_bit_for_bit(simd_path, kind, act):
    for rows, cols in itertools.product(SIZES, SIZES):
        rng = np.random.default_rng([rows, cols, KINDS.index(kind)])
        w = random_weights(rng, rows, cols, kind)
        for n in TOKENS:
            x = random_x(rng, n, cols)
            assert_same_bits(kernels.matmul(w, x, act), reference.matmul(w, x, act),
                             f"{simd_path} {kind} act={act} [{rows}, {cols}] n={n}")


@pytest.mark.parametrize("kind,act", MODES)
def test_matmul_model_sizes_bit_for_bit(simd_path, kind, act):
    """Widths of real models (2048, 768, 1024) and a wide odd one, where the SIMD main loops run;
    1 token (the matrix-vector loop), 3, 37 and 70 (the several-token loops, past their blocks of 16
    and 32; from 64 tokens the AVX-512 path's VNNI rows)."""
    rng = np.random.default_rng(5)
    for (rows, cols), n in itertools.product([(70, 2048), (33, 768), (9, 1024), (5, 4097)], (1, 3, 37, 70)):
        w = random_weights(rng, rows, cols, kind)
        x = random_x(rng, n, cols, scale=4.0)
        assert_same_bits(kernels.matmul(w, x, act), reference.matmul(w, x, act),
                         f"{simd_path} {kind} {act} [{rows}, {cols}] n={n}")


@pytest.mark.parametrize("kind,act", MODES)
def test_reference_matches_float64(kind, act):
    """The fixed-order float32 reference is x @ dequantize(w).T (with x as int8 activations stand
    it for) within float32 rounding."""
    rng = np.random.default_rng(7)
    w = random_weights(rng, 130, 200, kind)
    x = random_x(rng, 5, 200)
    xv = reference.dequantize_activations(x) if act == "int8" and kind != "f32" else x
    assert_close(reference.matmul(w, x, act), reference.exact(w, x, act).astype(np.float32), EPS * magnitude(w, xv))


def test_int8_activations_round_to_the_nearest_step():
    rng = np.random.default_rng(8)
    x = random_x(rng, 4, 130, scale=3.0)
    x[0, 5] = 1e-30  # a tiny value in a normal block
    q, xs = reference.quantize_activations(x)
    assert q.shape == (4, 192) and xs.shape == (4, 3) and np.all(q[:, 130:] == 0)
    step = np.repeat(xs, 64, axis=1)[:, :130]
    assert np.all(np.abs(reference.dequantize_activations(x) - x) <= step / 2 * (1 + 1e-6))
    assert np.all(np.abs(q) <= 127) and np.all(np.abs(q).reshape(4, 3, 64).max(axis=2)[[0, 2, 3]] == 127)
    assert np.all(q[1] == 0) and np.all(xs[1] == 0)  # the zero token


def identity_weights(n: int, kind: str) -> QTensor:
    """An n x n identity in int8 (scale 1 per row) or int4 (q = 1 on the diagonal, scales 1)."""
    if kind == "int8":
        return QTensor("int8", n, n, np.eye(n, dtype=np.int8), np.ones(n, np.float32))
    nib = np.full((n, n + n % 2), 8, np.uint8)  # q + 8
    nib[np.arange(n), np.arange(n)] = 9
    data = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
    return QTensor("int4", n, n, data, np.ones((n, -(-n // 64)), np.float16))


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_int8_activations_quantise_alike_on_every_path(simd_path, kind):
    """Through an identity matrix each output is its column's q times its block's scale: the SIMD
    quantisers (whole blocks of 64) give the reference's q, ties to even, clamps and edge blocks
    included, in both column orders (int8 weights: natural; int4: even columns, then odd)."""
    cols = 64 * 5 + 10  # five whole blocks and a partial one (the scalar loop)
    rng = np.random.default_rng(10)
    x = random_x(rng, 3, cols, scale=2.0)
    x[0, :64] = np.arange(64) - 31.5
    x[0, 0] = 127.0  # absmax 127: inv = 1, so the halves stay halves and round to even
    x[0, 1:9] = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5]
    x[0, 64:128] = 0.0  # a zero block: q = 0, scale 0
    x[0, 130], x[0, 131] = -0.0, 1e-38  # absmax 1e-38 < 127 / FLT_MAX: 127 / absmax is inf, 0 · inf
    x[0, 128:130] = 0.0
    x[0, 132:192] = 0.0
    x[2, 200] = -np.abs(x[2, 192:256]).max() * 1.0000001  # the block's absmax: x · inv just past -127
    w = identity_weights(cols, kind)
    y = kernels.matmul(w, x, "int8")
    assert_same_bits(y, reference.matmul(w, x, "int8"), f"{simd_path} {kind}")
    q, xs = reference.quantize_activations(x)
    assert list(q[0, 1:9]) == [0, 2, 2, 0, -2, -2, 126, -126] and q[0, 0] == 127  # half to even
    assert np.all(q[0, 64:128] == 0) and q[0, 131] == 127 and np.all(q[0, 128:131] == 0)
    assert q[2, 200] == -127 and np.all(q[1] == 0)  # random_x's token 1 is zeros
    step = np.repeat(xs, 64, axis=1)[:, :cols]
    nz = step > 0
    assert np.array_equal(np.rint(y[nz] / step[nz]), q[:, :cols][nz].astype(np.float32))


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_int8_activations_with_inf_or_nan_give_nan(simd_path, kind):
    rng = np.random.default_rng(9)
    w = random_weights(rng, 4, 130, kind)
    x = random_x(rng, 2, 130)
    x[0, 70] = np.inf  # block 1 of token 0
    y = kernels.matmul(w, x, "int8")
    assert np.isnan(y[0]).all() and np.isfinite(y[1]).all()
    assert_same_bits(y[1:], reference.matmul(w, x[1:], "int8"))


@pytest.mark.parametrize("kind,act", MODES)
def test_matmul_same_bits_on_every_thread_count(simd_path, thread_counts, kind, act):
    rng = np.random.default_rng(11)
    w = random_weights(rng, 301, 1000, kind)  # enough work to be split into tasks
    x = random_x(rng, 3, 1000)
    want = reference.matmul(w, x, act)
    for n in thread_counts:
        kernels.set_threads(n)
        assert_same_bits(kernels.matmul(w, x, act), want, f"{n} threads")


@pytest.mark.parametrize("kind", KINDS)
def test_matmul_is_deterministic_and_reads_weights_in_place(kind):
    rng = np.random.default_rng(11)
    w = random_weights(rng, 127, 130, kind)
    x = rng.standard_normal((5, 130)).astype(np.float32)
    y = kernels.matmul(w, x)
    assert np.array_equal(bits(kernels.matmul(w, x)), bits(y))
    assert np.array_equal(bits(kernels.matmul(read_only_copy(w), x)), bits(y))
    x_ro = np.frombuffer(x.tobytes(), np.float32).reshape(x.shape)
    assert np.array_equal(bits(kernels.matmul(w, x_ro)), bits(y))
    # a strided x is made contiguous; each token's result does not depend on the batch
    wide = np.zeros((5, 260), np.float32)
    wide[:, ::2] = x
    assert np.array_equal(bits(kernels.matmul(w, wide[:, ::2])), bits(y))
    assert np.array_equal(bits(kernels.matmul(w, x[2:3])), bits(y[2:3]))


def test_matmul_multi_is_each_matmul():
    rng = np.random.default_rng(12)
    ws = [random_weights(rng, 130, 200, "int4"), random_weights(rng, 64, 200, "int8"),
          random_weights(rng, 3, 200, "f32"), random_weights(rng, 200, 200, "int4")]
    x = random_x(rng, 3, 200)
    for act in kernels.ACTIVATIONS:
        for y, w in zip(kernels.matmul_multi(ws, x, act), ws):
            assert_same_bits(y, kernels.matmul(w, x, act))


def test_matmul_each_is_each_matmul():
    """Products of their own inputs in one call (MLA's per-head values): every kind and shape, rows
    of one matrix as views, a matrix without rows; the bits of separate calls, in both arithmetics."""
    rng = np.random.default_rng(14)
    big = random_weights(rng, 96, 130, "int4")
    views = [quant.QTensor("int4", 32, 130, big.data[i:i + 32], big.scales[i:i + 32]) for i in (0, 32, 64)]
    ws = [*views, random_weights(rng, 64, 200, "int8"), random_weights(rng, 3, 7, "f32"),
          random_weights(rng, 0, 65, "int4"), random_weights(rng, 130, 63, "int4")]
    for n in (1, 3):
        xs = [random_x(rng, n, w.cols) for w in ws]
        xs[0] = np.asfortranarray(xs[0])  # copied contiguous
        for act in kernels.ACTIVATIONS:
            for y, w, x in zip(kernels.matmul_each(ws, xs, act), ws, xs):
                assert_same_bits(y, kernels.matmul(w, x, act))
    assert [y.shape for y in kernels.matmul_each(ws[:2], [np.zeros((0, 130), np.float32)] * 2)] == [(0, 32)] * 2
    assert kernels.matmul_each([], []) == []
    with pytest.raises(ValueError, match="every x needs 1 rows"):
        kernels.matmul_each(ws[:2], [random_x(rng, 1, 130), random_x(rng, 2, 130)])
    with pytest.raises(ValueError, match="one input per weight"):
        kernels.matmul_each(ws[:2], [random_x(rng, 1, 130)])
    with pytest.raises(ValueError, match=r"matmul_each: x must be \[n, 200\]"):
        kernels.matmul_each([ws[3]], [random_x(rng, 1, 130)])


def test_the_weights_carry_the_arithmetic():
    """A weight's `act` (set where it is parsed, from the engine's options) chooses its products'
    arithmetic; `act=` overrides it for one call; the weights of one call must agree."""
    rng = np.random.default_rng(13)
    w = random_weights(rng, 65, 200, "int4")
    fast = dataclasses.replace(w, act="int8")
    x = random_x(rng, 2, 200)
    assert_same_bits(kernels.matmul(fast, x), reference.matmul(w, x, "int8"))
    assert_same_bits(kernels.matmul(w, x), reference.matmul(w, x, "f32"))
    assert_same_bits(kernels.matmul(fast, x, act="f32"), reference.matmul(w, x, "f32"))
    exact_f32 = dataclasses.replace(random_weights(rng, 3, 200, "f32"), act="int8")  # f32 weights: exact regardless
    assert kernels.weights_act([fast, exact_f32]) == "int8"
    with pytest.raises(ValueError, match="different activation arithmetics: f32, int8"):
        kernels.matmul_multi([w, fast], x)
    with pytest.raises(ColibriError, match="unknown activation arithmetic 'q4'"):
        kernels.matmul(w, x, act="q4")


def test_matmul_no_tokens():
    w = quant.quantize(np.ones((3, 65), np.float32), "int4")
    assert kernels.matmul(w, np.zeros((0, 65), np.float32)).shape == (0, 3)


# ----------------------------------------------------------------------------
# expert_ffn and moe_experts


def ffn_bound(gate, up, down, x, act) -> np.ndarray:
    """How far expert_ffn may drift from the reference, per output: errors of EPS * magnitude in
    gate x and up x, carried through silu (|silu'| < 1.1) and down; with int8 activations also one
    quantisation step of h (a last-bit difference in silu can move h across a rounding boundary)."""
    g, u = reference.matmul(gate, x, act).astype(np.float64), reference.matmul(up, x, act).astype(np.float64)
    s = g / (1 + np.exp(-np.clip(g, -80, 80)))
    xv = reference.dequantize_activations(x) if act == "int8" else x
    h_mag = 1.1 * magnitude(gate, xv) * np.abs(u) + np.abs(s) * magnitude(up, xv) + np.abs(s * u)
    d = np.abs(quant.dequantize(down).astype(np.float64))
    bound = EPS * (h_mag @ d.T)
    if act == "int8":
        _, hs = reference.quantize_activations((s * u).astype(np.float32))
        step = np.repeat(hs, 64, axis=1)[:, : down.cols].astype(np.float64)
        bound += 1e-3 * np.abs(h_mag @ d.T) + step @ d.T
    return bound


@pytest.mark.parametrize("kind,act", MODES)
@pytest.mark.parametrize("hidden,inter", [(1, 1), (3, 5), (65, 63), (130, 127), (200, 3), (64, 200)])
def test_expert_ffn_matches_reference(kind, act, hidden, inter):
    rng = np.random.default_rng([hidden, inter, KINDS.index(kind)])
    gate = random_weights(rng, inter, hidden, kind)
    up = random_weights(rng, inter, hidden, kind)
    down = random_weights(rng, hidden, inter, kind)
    for n in TOKENS:
        x = random_x(rng, n, hidden, scale=3.0)  # silu far into both tails
        y = kernels.expert_ffn(gate, up, down, x, act)
        assert_close(y, reference.expert_ffn(gate, up, down, x, act), ffn_bound(gate, up, down, x, act))


def expert_set(rng, n_experts, hidden, inter, kind):
    return {e: (random_weights(rng, inter, hidden, kind), random_weights(rng, inter, hidden, kind),
                random_weights(rng, hidden, inter, kind)) for e in range(n_experts)}


@pytest.mark.parametrize("kind,act", MODES)
@pytest.mark.parametrize("T", [5, 150])
def test_moe_experts_is_expert_ffn_per_slot_on_every_path_and_thread_count(kind, act, thread_counts, T):
    """One batched call fills exactly the slots of its experts, each bit for bit what expert_ffn
    gives for that token alone — on every code path and thread count; with 150 tokens each expert
    has ≈ 75, past the several-token kernels' blocks and the VNNI rows' threshold."""
    rng = np.random.default_rng(14)
    k, E, hidden, inter = 3, 6, 130, 200
    experts = expert_set(rng, E, hidden, inter, kind)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)])  # (T, k), distinct per token
    x = random_x(rng, T, hidden)
    ready = {e: experts[e] for e in (4, 0, 2)}  # a subset, in no particular order
    want = np.full((T, k, hidden), 7.0, np.float32)
    for t, r in itertools.product(range(T), range(k)):
        if ids[t, r] in ready:
            want[t, r] = kernels.expert_ffn(*ready[ids[t, r]], x[t:t + 1], act)[0]
    for path, n in itertools.product(supported_paths(), thread_counts):
        kernels.set_simd(path)
        kernels.set_threads(n)
        outs = np.full((T, k, hidden), 7.0, np.float32)
        kernels.moe_experts(outs, x, ids, ready, act)
        assert_same_bits(outs, want, f"{path}, {n} threads")
    kernels.set_simd("auto")


@pytest.mark.parametrize("kind", KINDS)
def test_expert_ffn_is_deterministic_and_reads_weights_in_place(kind):
    rng = np.random.default_rng(13)
    gate, up = (random_weights(rng, 127, 65, kind) for _ in range(2))
    down = random_weights(rng, 65, 127, kind)
    x = rng.standard_normal((5, 65)).astype(np.float32)
    y = kernels.expert_ffn(gate, up, down, x)
    assert np.array_equal(bits(kernels.expert_ffn(gate, up, down, x)), bits(y))
    ro = [read_only_copy(t) for t in (gate, up, down)]
    assert np.array_equal(bits(kernels.expert_ffn(*ro, x)), bits(y))
    assert np.array_equal(bits(kernels.expert_ffn(gate, up, down, x[4:])), bits(y[4:]))


def test_expert_ffn_no_tokens():
    gate = up = quant.quantize(np.ones((5, 3), np.float32), "int8")
    down = quant.quantize(np.ones((3, 5), np.float32), "int8")
    assert kernels.expert_ffn(gate, up, down, np.zeros((0, 3), np.float32)).shape == (0, 3)


# ----------------------------------------------------------------------------
# Errors: checked in Python, before C


def test_matmul_rejects_bad_arguments():
    w = quant.quantize(np.ones((4, 65), np.float32), "int4")
    x = np.ones((2, 65), np.float32)
    with pytest.raises(ValueError, match=r"\[n, 65\], got \[2, 64\]"):
        kernels.matmul(w, np.ones((2, 64), np.float32))
    with pytest.raises(ValueError, match=r"\[n, 65\], got \[65\]"):
        kernels.matmul(w, np.ones(65, np.float32))
    with pytest.raises(ValueError, match="float32, got float64"):
        kernels.matmul(w, x.astype(np.float64))
    with pytest.raises(ValueError, match="unknown quantisation 'int3'"):
        kernels.matmul(QTensor("int3", 4, 65, w.data, w.scales), x)
    with pytest.raises(ValueError, match=r"int4 data must be uint8 \[4, 33\], got uint8 \[4, 32\]"):
        kernels.matmul(QTensor("int4", 4, 65, w.data[:, :32].copy(), w.scales), x)
    with pytest.raises(ValueError, match=r"int4 scales must be float16 \[4, 2\], got float32"):
        kernels.matmul(QTensor("int4", 4, 65, w.data, w.scales.astype(np.float32)), x)
    with pytest.raises(ValueError, match="C-contiguous"):
        f = np.ones((65, 4), np.float32).T
        kernels.matmul(QTensor("f32", 4, 65, f), x)
    with pytest.raises(ColibriError, match="unknown activation arithmetic"):
        kernels.matmul(w, x, "int4")


def test_expert_ffn_rejects_bad_arguments():
    rng = np.random.default_rng(0)
    gate, up = (quant.quantize(rng.standard_normal((5, 3)), "int8") for _ in range(2))
    down = quant.quantize(rng.standard_normal((3, 5)), "int8")
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match="one kind, got int8, int8, int4"):
        kernels.expert_ffn(gate, up, quant.quantize(rng.standard_normal((3, 5)), "int4"), x)
    with pytest.raises(ValueError, match=r"down \[3, 6\]"):
        kernels.expert_ffn(gate, up, quant.quantize(rng.standard_normal((3, 6)), "int8"), x)
    with pytest.raises(ValueError, match=r"up \[5, 4\]"):
        kernels.expert_ffn(gate, quant.quantize(rng.standard_normal((5, 4)), "int8"), down, x)
    with pytest.raises(ValueError, match=r"\[n, 3\], got \[2, 5\]"):
        kernels.expert_ffn(gate, up, down, np.ones((2, 5), np.float32))
    outs = np.zeros((2, 1, 3), np.float32)
    with pytest.raises(ValueError, match=r"down \[3, 6\]"):
        kernels.moe_experts(outs, x, np.zeros((2, 1), np.int64),
                            {0: (gate, up, quant.quantize(rng.standard_normal((3, 6)), "int8"))})


# ----------------------------------------------------------------------------
# Code paths and threads: chosen at run time, forced by the environment


def test_the_best_path_the_cpu_has_is_the_default():
    assert kernels.simd() == supported_paths()[-1]
    assert "portable" in supported_paths()


def test_set_simd_and_set_threads_reject_what_cannot_run():
    with pytest.raises(ColibriError, match="unknown SIMD path 'sse9'"):
        kernels.set_simd("sse9")
    missing = [p for p in kernels.SIMD_PATHS if not kernels.simd_supported(p)]
    for p in missing:
        with pytest.raises(ColibriError, match=f"SIMD path '{p}' needs .*which this CPU lacks"):
            kernels.set_simd(p)
    with pytest.raises(ColibriError, match="from 1 to 256"):
        kernels.set_threads(0)


def _run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env})


def test_environment_forces_the_path_and_the_threads():
    r = _run_python("from colibri_core import kernels; print(kernels.simd(), kernels.threads())",
                    COLIBRI_SIMD="portable", COLIBRI_THREADS="3")
    assert r.returncode == 0 and r.stdout.split() == ["portable", "3"], r.stderr


@pytest.mark.parametrize("value,message", [("sse9", "unknown SIMD path"), ("", None)])
def test_environment_rejects_an_unknown_path(value, message):
    r = _run_python("from colibri_core import kernels; print(kernels.simd())", COLIBRI_SIMD=value)
    if message is None:
        assert r.returncode == 0 and r.stdout.strip() == supported_paths()[-1]
    else:
        assert r.returncode != 0 and f"COLIBRI_SIMD={value}: {message}" in r.stderr


def test_environment_rejects_a_path_this_cpu_lacks_or_bad_threads():
    missing = [p for p in kernels.SIMD_PATHS if not kernels.simd_supported(p)]
    for p in missing:
        r = _run_python("import colibri_core.kernels", COLIBRI_SIMD=p)
        assert r.returncode != 0 and f"COLIBRI_SIMD={p}: SIMD path '{p}' needs" in r.stderr
    r = _run_python("import colibri_core.kernels", COLIBRI_THREADS="many")
    assert r.returncode != 0 and "COLIBRI_THREADS='many'" in r.stderr


# ----------------------------------------------------------------------------
# Per-token layers: RMSNorm, RoPE, attention


def exp_inputs() -> np.ndarray:
    """A dense sweep over the whole range e^x is finite and non-zero in, every float around its
    ends, random bit patterns, and the special values."""
    rng = np.random.default_rng(41)
    ends = [np.float32(v) for v in (88.72283935546875, -104.0, 0.0, -87.33654, -103.27893)]
    near = [np.nextafter(e, np.float32(s * np.inf), dtype=np.float32) for e in ends for s in (1, -1)]
    nudged = np.array([v for e in ends for v in (e, *near)], np.float32)
    nudged = np.concatenate([nudged + np.float32(0)] + [np.array([np.nextafter(v, np.float32(d), dtype=np.float32)
                                                                 for v in nudged], np.float32) for d in (np.inf, -np.inf)])
    special = np.array([np.inf, -np.inf, np.nan, -0.0, 1e-45, -1e-45, 1e-38, 3.4e38, -3.4e38], np.float32)
    return np.concatenate([np.linspace(-106, 90, 2_000_003, dtype=np.float32), nudged, special,
                           rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)])


def test_exp_is_the_same_bits_on_every_path_and_within_1_ulp():
    """The kernels' own e^x (attention's softmax, the experts' SiLU): identical on every path, within
    1 ulp of e^x (a subnormal step below 2^-126), inf / 0 / NaN where e^x is."""
    x = exp_inputs()
    got = {}
    for path in supported_paths():
        kernels.set_simd(path)
        got[path] = kernels.exp(x)
    kernels.set_simd("auto")
    base = got["portable"]
    for path, y in got.items():
        assert_same_bits(y, base, f"exp on {path}")
    nan = np.isnan(x)
    assert np.isnan(base[nan]).all()
    with np.errstate(over="ignore", invalid="ignore"):
        exact = np.exp(x.astype(np.float64))
        want = exact[~nan].astype(np.float32)  # inf where it overflows, 0 where it underflows
    y = base[~nan]
    big = np.isinf(want) | (want == 0)
    assert np.array_equal(y[big], want[big]), "inf / 0 where e^x overflows / underflows"
    ulp = np.spacing(np.maximum(np.abs(want[~big]), np.float32(2.0 ** -126))).astype(np.float64)
    err = np.abs(y[~big].astype(np.float64) - exact[~nan][~big]) / ulp
    assert err.max() <= 1.0, f"{err.max():.2f} ulp at x = {x[~nan][~big][err.argmax()]!r}"


def test_sigmoid_is_one_over_one_plus_the_kernels_exp():
    """A gate's sigmoid (the shared expert's, gated attention's) is 1 / (1 + exp(−x)) with the
    kernels' exp, in float32: the bits NumPy gives on that exp (the fused decoder layer computes it
    in C), within 2.5 ulp of the true value; 0 where the exp overflows (below −88.72, where the true
    value is subnormal) and 1 far above."""
    x = exp_inputs()
    x = x[~np.isnan(x)]
    y = kernels.sigmoid(x)
    with np.errstate(over="ignore"):
        assert_same_bits(y, np.float32(1) / (np.float32(1) + kernels.exp(-x)), "sigmoid")
        exact = 1 / (1 + np.exp(-x.astype(np.float64)))
    finite = -x <= np.float32(88.72283935546875)  # e^−x a float32
    ulp = np.spacing(exact[finite].astype(np.float32)).astype(np.float64)
    assert (np.abs(y[finite] - exact[finite]) / ulp).max() <= 2.5
    assert y[~finite].max() == 0 and y[x > 20].min() == 1


def test_rms_norm_matches_reference():
    rng = np.random.default_rng(20)
    for shape in [(1, 1), (3, 63), (5, 2048), (2, 3, 130)]:
        x = (3 * rng.standard_normal(shape)).astype(np.float32)
        w = rng.standard_normal(shape[-1]).astype(np.float32)
        got, want = kernels.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5)
        assert_close(got, want, 1e-6 * np.abs(want) + 1e-30)


def test_rope_matches_reference_bit_for_bit():
    rng = np.random.default_rng(21)
    for T, heads, dim in [(1, 1, 2), (3, 4, 64), (5, 16, 128)]:
        x = rng.standard_normal((T, heads, dim)).astype(np.float32)
        ang = rng.standard_normal((T, dim)).astype(np.float32)
        cos, sin = np.cos(ang), np.sin(ang)
        assert_same_bits(kernels.rope_rotate_half(x, cos, sin), reference.rope_rotate_half(x, cos, sin))


@pytest.mark.parametrize("T,H,Hkv,D,start", [(1, 1, 1, 1, 0), (1, 16, 16, 128, 37), (5, 8, 2, 64, 0),
                                             (3, 32, 4, 128, 1500), (7, 6, 3, 20, 9),
                                             (37, 4, 4, 128, 45), (22, 8, 2, 64, 70)])
def test_attention_matches_reference_on_every_thread_count(thread_counts, T, H, Hkv, D, start):
    """Several new tokens (blocks of 16, tiles of 32 cached ones, 4 tokens at a time, past each) give
    every token the bits it gets fed alone, on every path and thread count."""
    rng = np.random.default_rng([T, H, D, start])
    S = start + T
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    k, v = (rng.standard_normal((S, Hkv, D)).astype(np.float32) for _ in range(2))
    want = reference.attention(q, k, v, start, D ** -0.5)
    got = kernels.attention(q, k, v, start, D ** -0.5)
    assert_close(got, want, 1e-5 * (np.abs(v).max() + np.abs(want)))
    for n in thread_counts:
        kernels.set_threads(n)
        assert_same_bits(kernels.attention(q, k, v, start, D ** -0.5), got, f"{n} threads")
    for t in range(T):
        alone = kernels.attention(q[t:t + 1], k[:start + t + 1], v[:start + t + 1], start + t, D ** -0.5)
        assert_same_bits(alone, got[t:t + 1], f"token {t} alone")
    for path in supported_paths():  # the SIMD loops keep the portable lane order: the same bits
        kernels.set_simd(path)
        assert_same_bits(kernels.attention(q, k, v, start, D ** -0.5), got, f"path {path}")
    kernels.set_simd("auto")


@pytest.mark.parametrize("T,H,Hkv,D,start", [(1, 1, 1, 1, 0), (1, 16, 16, 128, 37), (1, 32, 4, 128, 300),
                                             (1, 6, 3, 20, 9), (1, 5, 5, 64, 40), (5, 8, 2, 64, 0),
                                             (37, 4, 4, 128, 45), (7, 6, 3, 20, 9)])
def test_attention_over_a_float16_cache_is_the_float32_attention_over_it_widened(thread_counts, T, H, Hkv, D, start):
    """A float16 KV cache is read as it is (decode: converted inside the dot products; several
    tokens: as tiles are copied; other shapes: a widened copy of the row), each element widened
    exactly: the bits of the float32 kernel over the same values, on every path and thread count."""
    rng = np.random.default_rng([T, H, D, start, 16])
    S = start + T
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    k16, v16 = (rng.standard_normal((S, Hkv, D)).astype(np.float16) for _ in range(2))
    want = kernels.attention(q, k16.astype(np.float32), v16.astype(np.float32), start, D ** -0.5)
    for path in supported_paths():
        kernels.set_simd(path)
        for n in thread_counts:
            kernels.set_threads(n)
            assert_same_bits(kernels.attention(q, k16, v16, start, D ** -0.5), want, f"path {path}, {n} threads")
    kernels.set_simd("auto")


def test_f16_from_f32_rounds_as_numpy_on_every_path():
    """The float16 cache's rounding (nearest, ties to even; overflow to inf; subnormals; NaN stays
    NaN) is NumPy's astype on every path, and the same bits on every path (NaN payloads too)."""
    rng = np.random.default_rng(22)
    x = np.concatenate([rng.standard_normal(20000).astype(np.float32) * np.float32(scale)
                        for scale in (1e-8, 1e-6, 1e-5, 1e-3, 1, 1e3, 6e4, 1e5)])
    edges = [0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, -65520, 2 ** -25, -(2 ** -25), 2 ** -24,
             3 * 2 ** -26, 2 ** -14, 2 ** -14 * (1 - 2 ** -11), 1 + 2 ** -11, 1 + 3 * 2 ** -11]
    raw = rng.integers(0, 2 ** 32, 50000, dtype=np.uint64).astype(np.uint32).view(np.float32)  # every kind of float
    x = np.concatenate([x, np.array(edges, np.float32), raw])
    nan = np.isnan(x)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16)
    first = None
    for path in supported_paths():
        kernels.set_simd(path)
        got = kernels.f16_from_f32(x)
        diff = got[~nan].view(np.uint16) != want[~nan].view(np.uint16)
        assert not diff.any(), f"path {path}: {diff.sum()} differ, first {x[~nan][diff][0]!r}"
        assert np.isnan(got[nan]).all()
        first = got if first is None else first
        assert (got.view(np.uint16) == first.view(np.uint16)).all(), f"path {path} differs from {supported_paths()[0]}"
    kernels.set_simd("auto")


def test_layers_reject_bad_shapes():
    with pytest.raises(ValueError, match="rms_norm: weight must be"):
        kernels.rms_norm(np.ones((2, 4), np.float32), np.ones(3, np.float32), 1e-5)
    with pytest.raises(ValueError, match="rope"):
        kernels.rope_rotate_half(np.ones((1, 2, 3), np.float32), np.ones((1, 3), np.float32), np.ones((1, 3), np.float32))
    with pytest.raises(ValueError, match="start \\+ T <= S"):
        kernels.attention(np.ones((2, 4, 8), np.float32), np.ones((1, 2, 8), np.float32), np.ones((1, 2, 8), np.float32), 0, 1.0)


@pytest.mark.parametrize("kind,act", MODES)
@pytest.mark.parametrize("glu,limit", [("swiglu", None), ("swiglu", 0.7), ("situ", None)])
def test_moe_block_is_moe_experts_then_combine(kind, act, glu, limit):
    """The one-call MoE layer (every expert at hand) gives the bits of the two calls it replaces."""
    rng = np.random.default_rng(23)
    E, hidden, inter = 6, 130, 200
    table = expert_set(rng, E, hidden, inter, kind)
    block = kernels.ExpertTable([table[e] for e in range(E)])
    for T, k in [(1, 3), (5, 2), (4, 6)]:
        ids = np.stack([rng.permutation(E)[:k] for _ in range(T)])  # (T, k)
        x, w = random_x(rng, T, hidden), rng.random((T, k)).astype(np.float32)
        union = {int(e): table[int(e)] for e in sorted(set(ids.ravel().tolist()))}
        outs = np.zeros((T, k, hidden), np.float32)
        kernels.moe_experts(outs, x, ids, union, act, limit=limit, glu=glu)
        got = kernels.moe_block(x, ids, w, block, act, limit=limit, glu=glu)
        assert_same_bits(got, kernels.moe_combine(outs, w))
    with pytest.raises(ValueError, match="rejected"):
        kernels.moe_block(x, np.full_like(ids, E), w, block)  # an expert the table lacks


@pytest.mark.parametrize("kind,act", MODES)
@pytest.mark.parametrize("glu,limit", [("swiglu", None), ("swiglu", 0.7), ("situ", None)])
def test_moe_block_runs_a_shared_expert_as_one_more_rank(kind, act, glu, limit):
    """A shared expert in the one-call MoE layer (another width than the routed experts, gated per
    token or not) gives the bits of adding scale · expert_ffn after the call."""
    rng = np.random.default_rng(29)
    E, hidden, inter = 5, 130, 200
    table = expert_set(rng, E, hidden, inter, kind)
    block = kernels.ExpertTable([table[e] for e in range(E)])
    shared = expert_set(rng, 1, hidden, 72, kind)[0]
    one = kernels.ExpertTable([shared])
    for T, k in [(1, 2), (4, 3)]:
        ids = np.stack([rng.permutation(E)[:k] for _ in range(T)])  # (T, k)
        x, w = random_x(rng, T, hidden), rng.random((T, k)).astype(np.float32)
        routed = kernels.moe_block(x, ids, w, block, act, limit=limit, glu=glu)
        alone = kernels.expert_ffn(*shared, x, act, limit=limit, glu=glu)
        scale = rng.random(T).astype(np.float32)
        got = kernels.moe_block(x, ids, w, block, act, limit=limit, glu=glu, shared=one, shared_scale=scale)
        assert_same_bits(got, routed + scale[:, None] * alone, "gated")
        got = kernels.moe_block(x, ids, w, block, act, limit=limit, glu=glu, shared=one)
        assert_same_bits(got, routed + alone, "ungated")
    with pytest.raises(ValueError, match="one expert"):
        kernels.moe_block(x, ids, w, block, shared=block)


@pytest.mark.parametrize("kind,act", MODES)
@pytest.mark.parametrize("router_kind", ["f32", "int8"])
def test_moe_block_softmax_is_the_router_then_moe_block(kind, act, router_kind):
    """The one-call MoE layer with its softmax router inside (the f32 router of OLMoE and Qwen, or a
    quantised one) gives the bits of matmul, softmax_topk and moe_block called one by one, and that
    routing — renormalised or not, with a shared expert or not, for any number of tokens."""
    rng = np.random.default_rng(31)
    E, hidden, inter = 6, 130, 200
    table = expert_set(rng, E, hidden, inter, kind)
    block = kernels.ExpertTable([table[e] for e in range(E)])
    one = kernels.ExpertTable([expert_set(rng, 1, hidden, 72, kind)[0]])
    router = random_weights(rng, E, hidden, router_kind)
    for T, k, renormalize, shared in [(1, 2, False, None), (1, 6, True, one), (5, 3, True, None), (4, 1, False, one), (0, 2, True, None)]:
        x = random_x(rng, T, hidden)
        w, ids = kernels.softmax_topk(kernels.matmul(router, x, act), k, renormalize)
        want = kernels.moe_block(x, ids, w, block, act, shared=shared)
        out, got_w, got_ids = kernels.moe_block_softmax(x, router, k, renormalize, block, act, shared=shared)
        assert_same_bits(out, want, f"T={T}")
        assert_same_bits(got_w, w, "weights")
        assert np.array_equal(got_ids, ids) and got_ids.dtype == np.int64
    with pytest.raises(ValueError, match="router must be"):
        kernels.moe_block_softmax(x, random_weights(rng, E - 1, hidden, "f32"), 2, True, block)


def test_moe_combine_matches_reference_bit_for_bit():
    rng = np.random.default_rng(22)
    for T, k, H in [(1, 1, 1), (1, 8, 2048), (5, 3, 65)]:
        outs = rng.standard_normal((T, k, H)).astype(np.float32)
        w = rng.random((T, k)).astype(np.float32)
        assert_same_bits(kernels.moe_combine(outs, w), reference.moe_combine(outs, w))


def test_bench_kernels_reports_every_kernel_beside_the_read_bandwidth():
    """The machinery of `colibri bench kernels`, shrunk (no timing is asserted)."""
    from colibri_core.bench import kernels as bench

    result = bench.run(working_set=1 << 20, min_seconds=0.0, moe_experts=8)
    assert result["machine"]["read_gbps"] > 0 and result["machine"]["simd"] == kernels.simd()
    assert result["machine"]["paths"] == [kernels.simd()]
    names = [r["name"] for r in result["kernels"]]
    assert names[0] == "int4_matvec" and "moe_experts" in names and "int4_matmul" in names
    for r in result["kernels"]:
        assert r["gbps"] > 0 and r["fraction_of_read"] > 0 and ("gflops" in r) == (r["tokens"] > 1)
    assert "int4_matvec" in bench.format_table(result)


@pytest.mark.system
def test_bench_kernels_measures_every_code_path_side_by_side():
    """`colibri bench kernels --simd all`: every kernel on every path this CPU runs, one line each;
    the path in use afterwards is the one before; a path the CPU lacks is one clear error."""
    from colibri_core.bench import kernels as bench

    before = kernels.simd()
    paths = [p for p in kernels.SIMD_PATHS if kernels.simd_supported(p)]
    small = tuple(dataclasses.replace(c, rows=128, cols=256) for c in bench.CASES)
    result = bench.run(working_set=1 << 20, min_seconds=0.0, moe_experts=8, simd="all", cases=small)
    assert kernels.simd() == before and result["machine"]["paths"] == paths and "portable" in paths
    per_name = {}
    for r in result["kernels"]:
        per_name.setdefault(r["name"], []).append(r["simd"])
    assert all(seen == paths for seen in per_name.values()), per_name
    table = bench.format_table(result).splitlines()
    assert all(p in table[1] for p in paths) and len(table) == 3 + len(per_name)
    missing = [p for p in kernels.SIMD_PATHS if not kernels.simd_supported(p)]
    for p in missing:
        with pytest.raises(ColibriError, match=f"--simd {p}: this CPU cannot run that path"):
            bench.run(simd=p)
    with pytest.raises(ColibriError, match="--simd sse9"):
        bench.run(simd="sse9")


# ----------------------------------------------------------------------------
# matmul_t: x @ dequant(w), MLA's absorbed key projection


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 65), (63, 130), (130, 63), (200, 127), (64, 3)])
def test_matmul_t_matches_reference_bit_for_bit(simd_path, kind, rows, cols):
    rng = np.random.default_rng(rows * 1000 + cols)
    w = read_only_copy(random_weights(rng, rows, cols, kind))
    for n in TOKENS:
        x = rng.standard_normal((n, rows)).astype(np.float32)
        got = kernels.matmul_t(w, x)
        assert np.array_equal(bits(got), bits(reference.matmul_t(w, x)))
        want = x.astype(np.float64) @ quant.dequantize(w).astype(np.float64)
        assert_close(got, want, np.abs(x.astype(np.float64)) @ np.abs(quant.dequantize(w).astype(np.float64)))
    assert kernels.matmul_t(w, np.zeros((0, rows), np.float32)).shape == (0, cols)
    with pytest.raises(ValueError, match=r"matmul_t: x must be \[n, "):
        kernels.matmul_t(w, np.zeros((1, rows + 1), np.float32))


def test_matmul_t_each_is_each_matmul_t(simd_path, thread_counts):
    """Transposed products of their own inputs in one call, one thread each (MLA's key absorption):
    the bits of separate calls, for every kind, on any thread count."""
    rng = np.random.default_rng(15)
    ws = [random_weights(rng, rows, cols, kind) for kind in KINDS for rows, cols in ((192, 64), (3, 65), (0, 5))]
    for n in TOKENS:
        xs = [rng.standard_normal((n, w.rows)).astype(np.float32) for w in ws]
        want = [reference.matmul_t(w, x) for w, x in zip(ws, xs)]
        for threads in thread_counts:
            kernels.set_threads(threads)
            for y, w_ in zip(kernels.matmul_t_each(ws, xs), want):
                assert_same_bits(y, w_)
    assert kernels.matmul_t_each([], []) == []
    with pytest.raises(ValueError, match="every x needs 1 rows"):
        kernels.matmul_t_each(ws[:2], [np.zeros((1, 192), np.float32), np.zeros((2, 3), np.float32)])


@pytest.mark.parametrize("T,E,k", [(1, 1, 1), (1, 64, 8), (5, 128, 8), (3, 7, 7), (2, 600, 9), (0, 4, 2)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_softmax_topk_matches_reference(T, E, k, renormalize):
    rng = np.random.default_rng([T, E, k])
    logits = (rng.standard_normal((T, E)) * 4).astype(np.float32)
    w, ids = kernels.softmax_topk(logits, k, renormalize)
    w_ref, ids_ref = reference.softmax_topk(logits, k, renormalize)
    assert ids.dtype == np.int64 and w.dtype == np.float32 and w.shape == ids.shape == (T, k)
    np.testing.assert_array_equal(ids, ids_ref)
    assert_close(w, w_ref, 2e-5 * w_ref + 1e-12)  # within float32 rounding (sums in another order)


def test_softmax_topk_ties_go_to_the_lower_index_and_nan_never_gives_a_bad_id():
    logits = np.array([[1, 3, 3, 0, 3], [np.nan] * 5], np.float32)
    _, ids = kernels.softmax_topk(logits, 4, False)
    np.testing.assert_array_equal(ids[0], [1, 2, 4, 0])
    np.testing.assert_array_equal(ids[0], reference.softmax_topk(logits[:1], 4, False)[1][0])
    assert sorted(ids[1]) == sorted(set(ids[1])) and ids[1].min() >= 0 and ids[1].max() < 5
    with pytest.raises(ValueError, match="k must be 1..5"):
        kernels.softmax_topk(logits, 6, False)


@pytest.mark.parametrize("kind,act", MODES)
def test_expert_ffn_swiglu_limit_clamps_gate_and_up(kind, act):
    """DeepSeek V4's clamped SwiGLU: silu(min(g, L)) · clip(u, ±L). With L above every |g|, |u| it is
    the plain SwiGLU bit for bit; with L inside their range it matches the reference (which clamps),
    differs from the unclamped result, and moe_experts gives each slot exactly expert_ffn's row."""
    rng = np.random.default_rng(15)
    hidden, inter, T, k = 130, 63, 4, 2
    gate, up, down = (random_weights(rng, inter, hidden, kind), random_weights(rng, inter, hidden, kind),
                      random_weights(rng, hidden, inter, kind))
    x = random_x(rng, T, hidden, scale=30.0)
    g = reference.matmul(gate, x, act)
    big = float(np.abs(np.concatenate([g, reference.matmul(up, x, act)])).max()) * 2
    assert_same_bits(kernels.expert_ffn(gate, up, down, x, act, limit=big), kernels.expert_ffn(gate, up, down, x, act),
                     "a limit nothing reaches")
    limit = float(np.median(np.abs(g)))
    y = kernels.expert_ffn(gate, up, down, x, act, limit=limit)
    want = reference.expert_ffn(gate, up, down, x, act, limit=limit)
    assert np.abs(y - want).max() <= 1e-4 * np.abs(want).max()
    assert not np.allclose(y, kernels.expert_ffn(gate, up, down, x, act))
    outs = np.zeros((T, k, hidden), np.float32)
    ids = np.zeros((T, k), np.int64)
    kernels.moe_experts(outs, x, ids, {0: (gate, up, down)}, act, limit=limit)
    for r in range(k):
        assert_same_bits(outs[:, r], y, "moe_experts vs expert_ffn")
    with pytest.raises(ValueError, match="positive"):
        kernels.expert_ffn(gate, up, down, x, act, limit=0.0)


# ----------------------------------------------------------------------------
# The experts' gated units and biases (csrc/colibri.h ExpertMath): every kind, every path, every placement

GATED = [("swiglu", None, None), ("swiglu", 0.7, None), ("swiglu_oai", 7.0, 1.702), ("swiglu_oai", 0.7, 1.702),
         ("geglu_tanh", None, None), ("situ", None, None)]  # (glu, limit, alpha)


def expert_biases(rng, inter, hidden):
    """(gate_bias, up_bias, down_bias) float32, large enough to move every gated unit visibly."""
    return tuple((2 * rng.standard_normal(n)).astype(np.float32) for n in (inter, inter, hidden))


def test_gated_units_are_their_float64_definitions():
    """The float32 references against the models' own formulas in float64: transformers' GPT-OSS
    experts, gelu_pytorch_tanh, DeepSeek V4's clamp, Kimi K3's SiTU."""
    g = np.concatenate([np.linspace(-12, 12, 2001), [0.0, -0.0, 1e-30, -200, 200, np.inf, -np.inf]]).astype(np.float32)
    u = np.roll(g, 777)
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    sig = lambda a: 1 / (1 + np.exp(-a))  # noqa: E731
    with np.errstate(over="ignore", invalid="ignore"):
        gc, uc = np.minimum(g64, 7.0), np.clip(u64, -7.0, 7.0)
        z = np.sqrt(2 / np.pi) * (g64 + 0.044715 * g64**3)
        gu = np.nan_to_num(np.abs(g64 * u64), nan=0.0, posinf=0.0)  # |g u| where finite (clamped units: finite w)
        want = {  # (glu, limit, alpha): (the definition, the argument of its exp)
            ("swiglu", np.inf, None): (g64 * sig(g64) * u64, g64),
            ("swiglu", 7.0, None): (gc * sig(gc) * uc, gc),
            ("swiglu_oai", 7.0, 1.702): ((uc + 1) * (gc * sig(1.702 * gc)), 1.702 * gc),
            ("geglu_tanh", np.inf, None): (0.5 * g64 * (1 + np.tanh(z)) * u64, 2 * z),
            ("situ", np.inf, None): (4 * np.tanh(g64 / 4) * sig(g64) * 25 * np.tanh(u64 / 25), g64),
        }
    for (glu, limit, alpha), (w, arg) in want.items():
        got = reference.gated_unit(glu, g, u, limit, alpha)
        assert got.dtype == np.float32 and np.array_equal(np.isnan(got), np.isnan(w)), glu
        f = np.isfinite(w)
        # float32 roundings, the exp's argument's amplified (|arg| ulps), and float64's own cancellation
        # in 1 + tanh(z) for z << 0
        bound = 1e-6 * (2 + np.minimum(np.abs(arg[f]), 100)) * np.abs(w[f]) + 1e-15 * gu[f]
        assert np.all(np.abs(got[f] - w[f]) <= bound), glu


@pytest.mark.parametrize("kind,act", MODES)
@pytest.mark.parametrize("glu,limit,alpha", GATED)
def test_expert_ffn_gated_units_and_biases_match_reference(simd_path, kind, act, glu, limit, alpha):
    """Each gated unit, with and without biases, against the NumPy reference on awkward sizes; a
    limit or a bias that changes nothing would be caught (the results must differ)."""
    rng = np.random.default_rng([GATED.index((glu, limit, alpha)), KINDS.index(kind)])
    hidden, inter = 130, 63
    gate, up, down = (random_weights(rng, inter, hidden, kind), random_weights(rng, inter, hidden, kind),
                      random_weights(rng, hidden, inter, kind))
    bias = expert_biases(rng, inter, hidden)
    x = random_x(rng, 5, hidden, scale=0.5)
    kw = dict(limit=limit, glu=glu, alpha=alpha)
    ref_kw = dict(limit=np.inf if limit is None else limit, glu=glu, alpha=alpha)
    plain = kernels.expert_ffn(gate, up, down, x, act, **kw)
    for b in (None, bias, (None, bias[1], None)):
        got = kernels.expert_ffn(gate, up, down, x, act, bias=b, **kw)
        want = reference.expert_ffn(gate, up, down, x, act, bias=b, **ref_kw)
        # int8: a last-bit difference in exp (NumPy's vs C's) may move h across a quantisation step
        tol = (1e-5 if act == "f32" else 2e-3) * np.abs(want).max()
        assert np.abs(got - want).max() <= tol, f"bias {b is not None}: off by {np.abs(got - want).max():.3g}"
        if b is not None:
            assert not np.allclose(got, plain, rtol=1e-3, atol=0)
    zero = tuple(np.zeros_like(a) for a in bias)
    assert np.array_equal(kernels.expert_ffn(gate, up, down, x, act, bias=zero, **kw), plain)


@pytest.mark.parametrize("kind,act", MODES)
@pytest.mark.parametrize("glu,limit,alpha", GATED)
def test_gated_units_with_biases_are_the_same_bits_wherever_an_expert_runs(kind, act, glu, limit, alpha, thread_counts):
    """Placement never changes a result: an expert alone (expert_ffn), batched with others
    (moe_experts: streamed, or a Ray shard), in the resident one-call layer (moe_block) and as its
    shared expert give the same bits — on every code path and thread count."""
    rng = np.random.default_rng(37)
    E, T, k, hidden, inter = 5, 6, 2, 130, 72
    experts = expert_set(rng, E, hidden, inter, kind)
    biases = {e: expert_biases(rng, inter, hidden) for e in range(E)}
    biases[3] = (None, biases[3][1], None)  # one expert with an up bias only
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)])  # (T, k)
    x, w = random_x(rng, T, hidden), rng.random((T, k)).astype(np.float32)
    kw = dict(limit=limit, glu=glu, alpha=alpha)
    alone = np.stack([[kernels.expert_ffn(*experts[ids[t, r]], x[t:t + 1], act, bias=biases[ids[t, r]], **kw)[0]
                       for r in range(k)] for t in range(T)])  # (T, k, H)
    table = kernels.ExpertTable([experts[e] for e in range(E)], [biases[e] for e in range(E)])
    shared = kernels.ExpertTable([experts[0]], [biases[0]])
    shared_alone = kernels.expert_ffn(*experts[0], x, act, bias=biases[0], **kw)  # (T, H)
    for path, n in itertools.product(supported_paths(), thread_counts):
        kernels.set_simd(path)
        kernels.set_threads(n)
        outs = np.zeros((T, k, hidden), np.float32)
        kernels.moe_experts(outs, x, ids, {e: experts[e] for e in (4, 1, 3, 0, 2)}, act, biases=biases, **kw)
        assert_same_bits(outs, alone, f"moe_experts, {path}, {n} threads")
        routed = kernels.moe_block(x, ids, w, table, act, **kw)
        assert_same_bits(routed, kernels.moe_combine(alone, w), f"moe_block, {path}, {n} threads")
        got = kernels.moe_block(x, ids, w, table, act, shared=shared, **kw)
        assert_same_bits(got, routed + shared_alone, f"shared expert, {path}, {n} threads")
    kernels.set_simd("auto")


def test_expert_math_rejects_what_it_cannot_compute():
    rng = np.random.default_rng(1)
    gate, up = (quant.quantize(rng.standard_normal((5, 3)), "int8") for _ in range(2))
    down = quant.quantize(rng.standard_normal((3, 5)), "int8")
    x = np.ones((2, 3), np.float32)
    for kw, message in [(dict(glu="gelu"), "unknown gated unit 'gelu'"),
                        (dict(glu="swiglu_oai", limit=7.0), "alpha .* 'swiglu_oai' only"),
                        (dict(glu="swiglu", alpha=1.702), "alpha .* 'swiglu_oai' only"),
                        (dict(glu="swiglu_oai", alpha=float("nan")), "alpha .* 'swiglu_oai' only"),
                        (dict(glu="geglu_tanh", limit=7.0), "'geglu_tanh' has no clamp limit"),
                        (dict(glu="swiglu", limit=-1.0), "limit must be positive"),
                        (dict(bias=(np.zeros(5), np.zeros(5), np.zeros(4))), r"down_bias must be \(3,\), got \[4\]"),
                        (dict(bias=(np.zeros(5), np.zeros(5))), "are \\(gate_bias, up_bias, down_bias\\)")]:
        with pytest.raises(ValueError, match=message):
            kernels.expert_ffn(gate, up, down, x, **kw)
    with pytest.raises(ValueError, match="2 biases for 1 experts"):
        kernels.ExpertTable([(gate, up, down)], [None, None])
