"""The C kernels against their NumPy references, on awkward sizes, for every weight kind.

Tolerance: C sums sequentially and NumPy does not, so the two agree within float32 rounding.
Each output element is allowed 1e-5 times its magnitude, the sum of |terms| it adds up
(``|x| @ |W|.T``); for expert_ffn that magnitude is carried through the SwiGLU to first order.
"""
import itertools

import numpy as np
import pytest

from colibri_core import kernels, quant
from colibri_core.kernels import reference
from colibri_core.quant import KINDS, QTensor

SIZES = (1, 3, 63, 65, 127, 130, 200)
TOKENS = (1, 2, 5)
EPS = 1e-5


def random_weights(rng, rows, cols, kind) -> QTensor:
    """Normal weights with the corners of the formats: a zero row (scale 0) and a tiny row
    (int4 scales that are float16 subnormals)."""
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    if rows >= 2:
        w[0] = 0.0
        w[1] *= 1e-6
    return quant.quantize(w, kind)


def magnitude(w: QTensor, x: np.ndarray) -> np.ndarray:
    """float64 [n, rows]: sum_j |x_j| |w_rj|, what a rounding error is measured against."""
    return np.abs(x.astype(np.float64)) @ np.abs(quant.dequantize(w).astype(np.float64)).T


def assert_close(got, want, bound):
    assert got.dtype == np.float32 and got.shape == want.shape
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    worst = np.unravel_index(np.argmax(err - EPS * bound), err.shape) if err.size else None
    assert np.all(err <= EPS * bound), (
        f"off by {err[worst]:.3g} at {worst}, allowed {EPS * bound[worst]:.3g} "
        f"(got {got[worst]!r}, want {want[worst]!r})"
    )


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


def read_only_copy(t: QTensor) -> QTensor:
    """The same tensor viewed from an immutable bytes buffer, as the expert store hands it over."""
    buf = bytearray()
    quant.pack(t, buf)
    ro, _ = quant.from_buffer(t.kind, t.rows, t.cols, bytes(buf))
    assert not ro.data.flags.writeable
    return ro


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
# matmul


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,cols", list(itertools.product(SIZES, SIZES)))
def test_matmul_matches_reference(kind, rows, cols):
    rng = np.random.default_rng([rows, cols, KINDS.index(kind)])
    w = random_weights(rng, rows, cols, kind)
    for n in TOKENS:
        x = rng.standard_normal((n, cols)).astype(np.float32)
        y = kernels.matmul(w, x)
        assert_close(y, reference.matmul(w, x), magnitude(w, x))


@pytest.mark.parametrize("kind", KINDS)
def test_reference_matches_dequantize(kind):
    """The grouped float32 reference is x @ dequantize(w).T, the formats' one definition."""
    rng = np.random.default_rng(7)
    w = random_weights(rng, 130, 200, kind)
    x = rng.standard_normal((5, 200)).astype(np.float32)
    exact = (x.astype(np.float64) @ quant.dequantize(w).astype(np.float64).T).astype(np.float32)
    assert_close(reference.matmul(w, x), exact, magnitude(w, x))


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


def test_matmul_no_tokens():
    w = quant.quantize(np.ones((3, 65), np.float32), "int4")
    assert kernels.matmul(w, np.zeros((0, 65), np.float32)).shape == (0, 3)


# ----------------------------------------------------------------------------
# expert_ffn


def ffn_magnitude(gate, up, down, x) -> np.ndarray:
    """First-order bound on how far a float32 expert_ffn may drift, per output: errors of
    EPS * magnitude in gate x and up x, carried through silu (|silu'| < 1.1) and down."""
    g, u = reference.matmul(gate, x).astype(np.float64), reference.matmul(up, x).astype(np.float64)
    s = g / (1 + np.exp(-np.clip(g, -80, 80)))
    h_mag = 1.1 * magnitude(gate, x) * np.abs(u) + np.abs(s) * magnitude(up, x) + np.abs(s * u)
    return h_mag @ np.abs(quant.dequantize(down).astype(np.float64)).T


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hidden,inter", [(1, 1), (3, 5), (65, 63), (130, 127), (200, 3), (64, 200)])
def test_expert_ffn_matches_reference(kind, hidden, inter):
    rng = np.random.default_rng([hidden, inter, KINDS.index(kind)])
    gate = random_weights(rng, inter, hidden, kind)
    up = random_weights(rng, inter, hidden, kind)
    down = random_weights(rng, hidden, inter, kind)
    for n in TOKENS:
        x = (3 * rng.standard_normal((n, hidden))).astype(np.float32)  # silu far into both tails
        y = kernels.expert_ffn(gate, up, down, x)
        assert_close(y, reference.expert_ffn(gate, up, down, x), ffn_magnitude(gate, up, down, x))


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


def test_simd_names_the_portable_path():
    assert kernels.simd() == "portable"


# ----------------------------------------------------------------------------
# matmul_t: x @ dequant(w), MLA's absorbed key projection


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 65), (63, 130), (130, 63), (200, 127), (64, 3)])
def test_matmul_t_matches_reference_bit_for_bit(kind, rows, cols):
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
