"""DeepSeek's native weight formats, computed on as they are: fp8 (e4m3 with a UE8M0 scale per
128×128 block) and fp4 (E2M1 nibbles with a UE8M0 scale per 32 columns).

The formats against torch's own dtypes and hand-made examples; the C dequantisation against
`quant.dequantize` and the C products against `kernels.reference` **bit for bit** (every weight is
a float32 exactly, and csrc/matmul.c fixes the order of every sum), on awkward sizes, every code
path and thread count; the references against float64; and the core's layers running such weights
unchanged.
"""
import itertools

import numpy as np
import pytest
from test_kernels import assert_close, assert_same_bits, bits, ffn_bound, magnitude, read_only_copy, supported_paths

from colibri_core import kernels, quant
from colibri_core.kernels import reference
from colibri_core.quant import QTensor

NATIVE = quant.NATIVE_KINDS
SIZES = (1, 3, 31, 33, 127, 130, 257)
EPS = 1e-5


def random_native(rng, kind, rows, cols, scale_range=(112, 128), nan=False) -> QTensor:
    """Every byte / nibble value at random (fp8 without its NaN bytes unless `nan`), UE8M0 scales in
    `scale_range`, like a checkpoint's (2^-15 .. 2^0)."""
    (_, _, dshape), (_, _, sshape) = quant.layout(kind, rows, cols)
    data = rng.integers(0, 256, dshape, dtype=np.uint8)
    if kind == "fp8" and not nan:
        data[(data & 0x7F) == 0x7F] ^= 1  # 0x7f / 0xff (NaN) -> 0x7e / 0xfe (±448)
    scales = rng.integers(scale_range[0], scale_range[1] + 1, sshape, dtype=np.uint8)
    return QTensor(kind, rows, cols, data, scales)


@pytest.fixture(params=kernels.SIMD_PATHS)
def simd_path(request):
    """Each SIMD code path in turn (as in test_kernels); the CPU's best one after."""
    if not kernels.simd_supported(request.param):
        pytest.skip(reason=f"this CPU lacks the {request.param} path's instructions: it cannot be tested here")
    kernels.set_simd(request.param)
    yield request.param
    kernels.set_simd("auto")


@pytest.fixture
def thread_counts():
    before = kernels.threads()
    yield (1, 2, 3, 7)
    kernels.set_threads(before)


def random_x(rng, n, cols, scale=1.0):
    x = (scale * rng.standard_normal((n, cols))).astype(np.float32)
    if n >= 3:
        x[1] = 0.0
    return x


# ----------------------------------------------------------------------------
# The formats


def test_e4m3_every_byte_matches_torch_and_the_container_reader():
    torch = pytest.importorskip("torch")
    from colibri_core.container.reader import FP8_E4M3
    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(quant.E4M3_VALUES, want, equal_nan=True)
    assert np.array_equal(quant.E4M3_VALUES, FP8_E4M3, equal_nan=True)
    got = np.array([kernels.lib.e4m3_to_f32(q) for q in range(256)], np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan) and nan.sum() == 2  # 0x7f, 0xff
    assert np.array_equal(bits(got)[~nan], bits(want)[~nan])  # signed zeros and subnormals too


def test_e8m0_every_byte_is_a_power_of_two():
    s = np.arange(256, dtype=np.uint8)
    want = np.full(256, np.nan, np.float32)
    want[:255] = np.ldexp(np.float64(1), np.arange(255) - 127)  # 2^-127 is a float32 subnormal
    got = quant.e8m0_values(s)
    assert np.array_equal(got, want, equal_nan=True)
    c = np.array([kernels.lib.e8m0_to_f32(v) for v in range(256)], np.float32)
    assert np.array_equal(bits(c)[:255], bits(want)[:255]) and np.isnan(c[255])
    torch = pytest.importorskip("torch")
    if hasattr(torch, "float8_e8m0fnu"):
        t = torch.from_numpy(s).view(torch.float8_e8m0fnu).float().numpy()
        assert np.array_equal(t, got, equal_nan=True)


def test_e2m1_values_and_nibble_order():
    # sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 is subnormal (m / 2)
    n = np.arange(16)
    e, m = (n >> 1) & 3, n & 1
    mag = np.where(e == 0, m * 0.5, 2.0 ** (e - 1) * (1 + m / 2))
    want = np.where(n & 8, -mag, mag).astype(np.float32)
    assert np.array_equal(bits(quant.E2M1_VALUES), bits(want))  # nibble 8 is -0
    # [1, 4]: bytes 0x21, 0xf9 -> columns 0.5 (low nibble first), 1, -0.5, -6; scale byte 128 = 2^1
    t = QTensor("fp4", 1, 4, np.array([[0x21, 0xF9]], np.uint8), np.array([[128]], np.uint8))
    assert quant.dequantize(t).tolist() == [[1.0, 2.0, -1.0, -12.0]]
    assert kernels.dequantize(t).tolist() == [[1.0, 2.0, -1.0, -12.0]]


def test_fp8_block_scales_cover_128_by_128():
    rows, cols = 130, 200  # 2 x 2 blocks, the last ones short
    data = np.full((rows, cols), 0x38, np.uint8)  # e4m3 1.0
    scales = np.array([[127, 128], [126, 130]], np.uint8)  # 1, 2 / 0.5, 8
    w = quant.dequantize(QTensor("fp8", rows, cols, data, scales))
    assert (w[:128, :128] == 1).all() and (w[:128, 128:] == 2).all()
    assert (w[128:, :128] == 0.5).all() and (w[128:, 128:] == 8).all()


def test_layout_pack_and_from_buffer():
    assert quant.layout("fp8", 300, 200) == [("data", np.dtype(np.uint8), (300, 200)),
                                             ("scales", np.dtype(np.uint8), (3, 2))]
    assert quant.layout("fp4", 7, 65) == [("data", np.dtype(np.uint8), (7, 33)),
                                          ("scales", np.dtype(np.uint8), (7, 3))]
    rng = np.random.default_rng(1)
    for kind in NATIVE:
        t = random_native(rng, kind, 5, 65)
        buf = bytearray(b"x" * 10)
        quant.pack(t, buf)
        assert len(buf) == quant.packed_size(kind, 5, 65, 10)
        got, end = quant.from_buffer(kind, 5, 65, bytes(buf), 10)
        assert end == len(buf) and np.array_equal(got.data, t.data) and np.array_equal(got.scales, t.scales)


@pytest.mark.parametrize("kind", NATIVE)
def test_quantize_does_not_write_the_native_formats(kind):
    assert kind in quant.ALL_KINDS and kind not in quant.KINDS
    with pytest.raises(ValueError, match="loaded as it is"):
        quant.quantize(np.ones((2, 2), np.float32), kind)


# ----------------------------------------------------------------------------
# Dequantisation in C


@pytest.mark.parametrize("kind", quant.ALL_KINDS)
def test_c_dequantize_is_quant_dequantize_bit_for_bit(kind):
    rng = np.random.default_rng([7, quant.ALL_KINDS.index(kind)])
    for rows, cols in itertools.product((1, 3, 129, 200), SIZES):
        if kind in NATIVE:  # every scale byte, NaN bytes included
            w = random_native(rng, kind, rows, cols, (0, 255), nan=True)
        else:
            w = quant.quantize(rng.standard_normal((rows, cols)).astype(np.float32), kind)
        got, want = kernels.dequantize(w), quant.dequantize(w)
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan), (kind, rows, cols)
        assert np.array_equal(bits(got)[~nan], bits(want)[~nan]), (kind, rows, cols)


# ----------------------------------------------------------------------------
# Products: bit for bit against the reference, on every path and thread count


@pytest.mark.parametrize("kind", NATIVE)
def test_matmul_matches_reference_bit_for_bit(simd_path, kind):
    for rows, cols in itertools.product((1, 3, 127, 130), SIZES):
        rng = np.random.default_rng([rows, cols, NATIVE.index(kind)])
        w = random_native(rng, kind, rows, cols)
        for n, act in itertools.product((1, 2, 5), kernels.ACTIVATIONS):
            x = random_x(rng, n, cols)
            assert_same_bits(kernels.matmul(w, x, act), reference.matmul(w, x, act),
                             f"{simd_path} {kind} act={act} [{rows}, {cols}] n={n}")


def test_every_fp8_byte_and_fp4_nibble_on_every_path(simd_path):
    """One-hot activations pick single weights out of a row: each product is the weight itself."""
    fp8 = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint8)[None]  # [1, 254]
    w = QTensor("fp8", 1, 254, fp8, np.array([[127, 120]], np.uint8))
    assert np.array_equal(kernels.matmul(w, np.eye(254, dtype=np.float32))[:, 0], quant.dequantize(w)[0])  # -0 as +0
    fp4 = np.arange(256, dtype=np.uint8)[None]  # [1, 512]: every nibble, low and high
    w = QTensor("fp4", 1, 512, fp4, np.arange(110, 126, dtype=np.uint8)[None])
    x = np.eye(512, dtype=np.float32)
    assert np.array_equal(kernels.matmul(w, x)[:, 0], quant.dequantize(w)[0])
    assert_same_bits(kernels.matmul(w, x, "int8"), reference.matmul(w, x, "int8"))


def test_fp8_always_takes_the_exact_arithmetic():
    rng = np.random.default_rng(4)
    w = random_native(rng, "fp8", 130, 300)
    x = random_x(rng, 3, 300)
    assert_same_bits(kernels.matmul(w, x, "int8"), kernels.matmul(w, x, "f32"))
    assert_same_bits(reference.matmul(w, x, "int8"), reference.matmul(w, x, "f32"))


@pytest.mark.parametrize("kind", NATIVE)
def test_matmul_model_sizes_bit_for_bit(simd_path, kind):
    """DeepSeek V4's widths (4096 hidden, 2048 expert intermediate) and a wide odd one."""
    rng = np.random.default_rng(5)
    for (rows, cols), n, act in itertools.product([(130, 4096), (9, 2048), (5, 4097)], (1, 3, 37), kernels.ACTIVATIONS):
        w = random_native(rng, kind, rows, cols)
        x = random_x(rng, n, cols, scale=4.0)
        assert_same_bits(kernels.matmul(w, x, act), reference.matmul(w, x, act),
                         f"{simd_path} {kind} {act} [{rows}, {cols}] n={n}")


@pytest.mark.parametrize("kind", NATIVE)
def test_matmul_same_bits_on_every_thread_count(simd_path, thread_counts, kind):
    rng = np.random.default_rng(11)
    w = random_native(rng, kind, 301, 1000)
    x = random_x(rng, 3, 1000)
    for act in kernels.ACTIVATIONS:
        want = reference.matmul(w, x, act)
        for n in thread_counts:
            kernels.set_threads(n)
            assert_same_bits(kernels.matmul(w, x, act), want, f"{act}, {n} threads")


@pytest.mark.parametrize("kind", NATIVE)
@pytest.mark.parametrize("act", ["f32", "int8"])
def test_reference_matches_float64(kind, act):
    """The fixed-order reference is x @ dequantize(w).T (x as int8 activations stand it for, with
    fp4 weights) within float32 rounding."""
    rng = np.random.default_rng(7)
    w = random_native(rng, kind, 130, 300)
    x = random_x(rng, 5, 300)
    xv = reference.dequantize_activations(x) if act == "int8" and kind == "fp4" else x
    assert_close(reference.matmul(w, x, act), reference.exact(w, x, act).astype(np.float32), EPS * magnitude(w, xv))


@pytest.mark.parametrize("kind", NATIVE)
def test_nan_weights_and_scales_give_nan(kind):
    rng = np.random.default_rng(8)
    w = random_native(rng, kind, 130, 300)
    if kind == "fp8":
        w.data[0, 5] = 0x7F  # row 0
    w.scales[-1, -1] = 255  # the last row's last group (fp4), rows 128-129's last block (fp8)
    x = random_x(rng, 2, 300)
    for act in kernels.ACTIVATIONS:
        y, want = kernels.matmul(w, x, act), reference.matmul(w, x, act)
        assert np.isnan(y[:, -1]).all() and (kind == "fp4" or np.isnan(y[:, 0]).all())
        assert np.isfinite(y[:, 1:128]).all() and np.array_equal(np.isnan(y), np.isnan(want))
        assert_same_bits(y[:, 1:128], want[:, 1:128])


def test_matmul_multi_mixes_every_kind():
    rng = np.random.default_rng(12)
    ws = [random_native(rng, "fp8", 130, 200), random_native(rng, "fp4", 64, 200),
          quant.quantize(rng.standard_normal((33, 200)).astype(np.float32), "int4"), random_native(rng, "fp8", 3, 200)]
    x = random_x(rng, 3, 200)
    for act in kernels.ACTIVATIONS:
        for y, w in zip(kernels.matmul_multi(ws, x, act), ws):
            assert_same_bits(y, kernels.matmul(w, x, act))


@pytest.mark.parametrize("kind", NATIVE)
@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 65), (130, 63), (200, 127)])
def test_matmul_t_matches_reference_bit_for_bit(kind, rows, cols):
    rng = np.random.default_rng([rows, cols])
    w = random_native(rng, kind, rows, cols)
    x = random_x(rng, 3, rows)
    assert_same_bits(kernels.matmul_t(w, x), reference.matmul_t(w, x))


@pytest.mark.parametrize("kind", NATIVE)
def test_weights_are_read_in_place(kind):
    rng = np.random.default_rng(13)
    w = random_native(rng, kind, 127, 130)
    x = random_x(rng, 5, 130)
    y = kernels.matmul(w, x)
    assert_same_bits(kernels.matmul(read_only_copy(w), x), y)
    assert_same_bits(kernels.matmul(w, x[2:3]), y[2:3])


# ----------------------------------------------------------------------------
# Experts, and the core's layers unchanged


def expert(rng, kind, hidden, inter):
    return (random_native(rng, kind, inter, hidden), random_native(rng, kind, inter, hidden),
            random_native(rng, kind, hidden, inter))


@pytest.mark.parametrize("kind", NATIVE)
@pytest.mark.parametrize("hidden,inter", [(1, 1), (65, 63), (130, 127), (64, 200)])
def test_expert_ffn_matches_reference(kind, hidden, inter):
    rng = np.random.default_rng([hidden, inter])
    gate, up, down = expert(rng, kind, hidden, inter)
    x = random_x(rng, 3, hidden, scale=3.0)
    for act in kernels.ACTIVATIONS:
        act_ref = "f32" if kind == "fp8" else act
        assert_close(kernels.expert_ffn(gate, up, down, x, act), reference.expert_ffn(gate, up, down, x, act_ref),
                     ffn_bound(gate, up, down, x, act_ref))


@pytest.mark.parametrize("kind", NATIVE)
def test_moe_experts_is_expert_ffn_per_slot_on_every_path_and_thread_count(kind, thread_counts):
    rng = np.random.default_rng(14)
    T, k, E, hidden, inter = 5, 3, 6, 130, 200
    experts = {e: expert(rng, kind, hidden, inter) for e in range(E)}
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)])
    x = random_x(rng, T, hidden, scale=3.0)
    ready = {e: experts[e] for e in (4, 0, 2)}
    for limit, act in itertools.product((None, 0.5), kernels.ACTIVATIONS):
        want = np.full((T, k, hidden), 7.0, np.float32)
        for t, r in itertools.product(range(T), range(k)):
            if ids[t, r] in ready:
                want[t, r] = kernels.expert_ffn(*ready[ids[t, r]], x[t:t + 1], act, limit=limit)[0]
        for path, n in itertools.product(supported_paths(), thread_counts):
            kernels.set_simd(path)
            kernels.set_threads(n)
            outs = np.full((T, k, hidden), 7.0, np.float32)
            kernels.moe_experts(outs, x, ids, ready, act, limit=limit)
            assert_same_bits(outs, want, f"{path}, {n} threads, limit {limit}, {act}")
        kernels.set_simd("auto")


def test_the_core_layers_run_native_weights_unchanged():
    from colibri_core.layers.mlp import swiglu_mlp
    from colibri_core.layers.moe import run_experts
    from colibri_core.model import linear, linears
    rng = np.random.default_rng(15)
    x = random_x(rng, 4, 256)
    wq, wk = random_native(rng, "fp8", 192, 256), random_native(rng, "fp8", 64, 256)
    assert_same_bits(linear(x, wq), reference.matmul(wq, x))
    for y, w in zip(linears(x, [wq, wk]), (wq, wk)):
        assert_same_bits(y, reference.matmul(w, x))
    dense = expert(rng, "fp8", 256, 320)
    assert_same_bits(swiglu_mlp(x, *dense), kernels.expert_ffn(*dense, x))
    experts = {3: expert(rng, "fp4", 256, 96), 5: expert(rng, "fp4", 256, 96)}
    ids = np.array([[3, 5], [5, 3], [3, 5], [5, 3]])
    outs = np.zeros((4, 2, 256), np.float32)
    run_experts(outs, x, ids, experts, limit=10.0)
    for t, r in itertools.product(range(4), range(2)):
        assert_same_bits(outs[t, r], kernels.expert_ffn(*experts[ids[t, r]], x[t:t + 1], limit=10.0)[0])


# ----------------------------------------------------------------------------
# Errors


def test_wrong_native_arrays_are_rejected_before_c():
    rng = np.random.default_rng(16)
    w = random_native(rng, "fp8", 130, 200)
    x = random_x(rng, 1, 200)
    with pytest.raises(ValueError, match=r"fp8 scales must be uint8 \[2, 2\]"):
        kernels.matmul(QTensor("fp8", 130, 200, w.data, w.scales[:1]), x)
    with pytest.raises(ValueError, match=r"fp4 scales must be uint8 \[3, 7\]"):
        kernels.matmul(QTensor("fp4", 3, 200, np.zeros((3, 100), np.uint8), np.zeros((3, 7), np.float32)), x)
    with pytest.raises(ValueError, match="unknown quantisation 'fp6'"):
        kernels.matmul(QTensor("fp6", 130, 200, w.data, w.scales), x)
