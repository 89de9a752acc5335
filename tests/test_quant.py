"""quant.py against a straightforward per-element implementation of the formats it documents."""
from __future__ import annotations

import math

import numpy as np
import pytest

from colibri_core import quant

# ----------------------------------------------------------------------------- the reference


def ref_int8(w: np.ndarray):
    """(q int8 [rows, cols], scales f32 [rows]) one element at a time; Python's round() is half-to-even."""
    rows, cols = w.shape
    q = np.zeros((rows, cols), np.int8)
    scales = np.zeros(rows, np.float32)
    for r in range(rows):
        absmax = np.float32(max(abs(float(x)) for x in w[r]))
        s = np.float32(absmax / np.float32(127))
        scales[r] = s
        for c in range(cols):
            v = 0 if s == 0 else round(float(np.float32(w[r, c]) / s))  # the division in float32
            q[r, c] = max(-127, min(127, v))
    return q, scales


def ref_int4(w: np.ndarray):
    """(q int [rows, cols], scales f16 [rows, groups], packed uint8 [rows, ceil(cols/2)])."""
    rows, cols = w.shape
    ngroups = math.ceil(cols / 64)
    q = np.zeros((rows, cols), np.int64)
    scales = np.zeros((rows, ngroups), np.float16)
    for r in range(rows):
        for g in range(ngroups):
            lo, hi = g * 64, min(cols, (g + 1) * 64)
            absmax = np.float32(max(abs(float(x)) for x in w[r, lo:hi]))
            scales[r, g] = np.float16(absmax / np.float32(7))
            s = np.float32(scales[r, g])  # q is computed with the stored float16 scale
            for c in range(lo, hi):
                v = 0 if s == 0 else round(float(np.float32(w[r, c]) / s))
                q[r, c] = max(-8, min(7, v))
    packed = np.zeros((rows, (cols + 1) // 2), np.uint8)
    for r in range(rows):
        for b in range(packed.shape[1]):
            low = q[r, 2 * b] + 8
            high = q[r, 2 * b + 1] + 8 if 2 * b + 1 < cols else 8  # padding nibble: q = 0
            packed[r, b] = low | (high << 4)
    return q, scales, packed


def ref_dequant(q: np.ndarray, scale_of) -> np.ndarray:
    rows, cols = q.shape
    out = np.zeros((rows, cols), np.float32)
    for r in range(rows):
        for c in range(cols):
            out[r, c] = np.float32(q[r, c]) * np.float32(scale_of(r, c))
    return out


def awkward_matrix(rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * rng.choice([1e-3, 0.02, 1.0, 50.0], (rows, 1))).astype(np.float32)
    if rows > 2:
        w[1] = 0  # a zero row
        w[2, : min(cols, 64)] = 0  # a zero group
    return w


SHAPES = [(1, 1), (3, 5), (4, 64), (5, 65), (3, 127), (6, 130), (2, 200)]


# ----------------------------------------------------------------------------- against the reference


@pytest.mark.parametrize("rows, cols", SHAPES)
def test_int8_matches_reference(rows, cols):
    w = awkward_matrix(rows, cols, seed=rows * 1000 + cols)
    t = quant.quantize(w, "int8")
    q, scales = ref_int8(w)
    assert (t.kind, t.rows, t.cols) == ("int8", rows, cols)
    assert t.data.dtype == np.int8 and t.data.shape == (rows, cols)
    assert t.scales.dtype == np.float32 and t.scales.shape == (rows,)
    np.testing.assert_array_equal(t.data, q)
    np.testing.assert_array_equal(t.scales, scales)
    np.testing.assert_array_equal(quant.dequantize(t), ref_dequant(q, lambda r, c: scales[r]))


@pytest.mark.parametrize("rows, cols", SHAPES)
def test_int4_matches_reference(rows, cols):
    w = awkward_matrix(rows, cols, seed=rows * 1000 + cols + 1)
    t = quant.quantize(w, "int4")
    q, scales, packed = ref_int4(w)
    assert (t.kind, t.rows, t.cols) == ("int4", rows, cols)
    assert t.data.dtype == np.uint8 and t.data.shape == (rows, (cols + 1) // 2)
    assert t.scales.dtype == np.float16 and t.scales.shape == (rows, math.ceil(cols / 64))
    np.testing.assert_array_equal(t.scales, scales)
    np.testing.assert_array_equal(t.data, packed)
    np.testing.assert_array_equal(quant.int4_values(t), q)
    np.testing.assert_array_equal(quant.dequantize(t), ref_dequant(q, lambda r, c: scales[r, c // 64]))


@pytest.mark.parametrize("rows, cols", SHAPES)
def test_f32_is_exact(rows, cols):
    w = awkward_matrix(rows, cols, seed=7)
    t = quant.quantize(w, "f32")
    assert t.scales is None and t.data.dtype == np.float32
    np.testing.assert_array_equal(quant.dequantize(t), w)
    # any float input is taken as float32
    np.testing.assert_array_equal(quant.quantize(w.astype(np.float64), "f32").data, w)


# ----------------------------------------------------------------------------- the format's details


def test_round_half_to_even():
    # scale exactly 1 (127 / 127 and 7 / 7): the quotients are the values themselves
    w8 = np.array([[127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5]], np.float32)
    t = quant.quantize(w8, "int8")
    assert t.scales[0] == 1
    assert t.data.tolist() == [[127, 0, 2, 2, 0, -2, -2, 4, 126]]
    w4 = np.array([[7, 0.5, 1.5, 2.5, -2.5, 3.5, -3.5, 6.5, -0.5]], np.float32)
    t = quant.quantize(w4, "int4")
    assert t.scales[0, 0] == 1
    assert quant.int4_values(t).tolist() == [[7, 0, 2, 2, -2, 4, -4, 6, 0]]


def test_int4_packing_order_and_padding_nibble():
    t = quant.quantize(np.array([[7, -2, 3]], np.float32), "int4")  # scale 1, q = 7, -2, 3
    # nibbles q + 8 = 15, 6, 11, then the padding nibble 8; even column in the low nibble
    assert t.data.tolist() == [[15 | 6 << 4, 11 | 8 << 4]]
    t = quant.quantize(np.array([[-7, 0, 1, 7]], np.float32), "int4")  # even cols: no padding
    assert t.data.tolist() == [[1 | 8 << 4, 9 | 15 << 4]]


def test_int4_short_last_group():
    w = np.zeros((2, 70), np.float32)
    w[0, :64] = np.linspace(-7, 7, 64)
    w[0, 64:] = [0.7, -0.35, 0.1, 0, 0.2, -0.7]  # its own scale: 0.1, not 1
    w[1, 64:] = 3.5
    t = quant.quantize(w, "int4")
    assert t.scales.shape == (2, 2) and t.data.shape == (2, 35)
    assert t.scales.tolist() == [[1.0, float(np.float16(np.float32(0.7) / np.float32(7)))], [0.0, 0.5]]
    q = quant.int4_values(t)
    assert q[0, 64:].tolist() == [7, -4, 1, 0, 2, -7]  # -0.35 / 0.1 = -3.5 (f16 scale: 0.09998) -> -4
    assert q[1].tolist() == [0] * 64 + [7] * 6
    np.testing.assert_array_equal(quant.dequantize(t)[1], w[1])


def test_zero_rows_and_groups():
    w = np.zeros((3, 100), np.float32)
    w[1, 80] = 2.0  # row 1: first group zero, second not
    t8 = quant.quantize(w, "int8")
    assert t8.scales.tolist()[0] == 0 and not t8.data[0].any()
    t4 = quant.quantize(w, "int4")
    assert t4.scales[0].tolist() == [0, 0] and t4.scales[1, 0] == 0 and t4.scales[1, 1] > 0
    assert (t4.data[0] == 0x88).all() and (t4.data[2] == 0x88).all()  # q = 0 is nibble 8
    for t in (t8, t4):
        d = quant.dequantize(t)
        assert not d[0].any() and not d[2].any() and not np.isnan(d).any()
        assert abs(d[1, 80] - 2.0) < 1e-3 and np.count_nonzero(d[1]) == 1


def test_int4_scale_is_absmax_over_7_in_f16():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((8, 150)).astype(np.float32)
    t = quant.quantize(w, "int4")
    for r in range(8):
        for g in range(3):
            absmax = np.abs(w[r, g * 64:(g + 1) * 64]).max()
            assert t.scales[r, g] == np.float16(absmax / np.float32(7))
    q = quant.int4_values(t)
    assert q.min() >= -8 and q.max() <= 7
    # the element holding a group's absmax quantises to +-7 (with the f16-rounded scale)
    r, c = np.unravel_index(np.abs(w[:, :64]).argmax(), (8, 64))
    assert abs(q[r, c]) == 7


def test_int8_range():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((50, 33)).astype(np.float32)
    w[0] = -1.0  # an all-negative row: -127, never -128
    w[1, 5] = -1e30
    t = quant.quantize(w, "int8")
    assert t.data.min() >= -127 and t.data.max() <= 127
    assert (t.data[0] == -127).all() and t.data[1, 5] == -127
    np.testing.assert_array_equal(t.scales, (np.abs(w).max(axis=1) / np.float32(127)).astype(np.float32))
    extreme = np.abs(t.data[np.arange(50), np.abs(w).argmax(axis=1)])
    assert (extreme == 127).all()
    err = np.abs(quant.dequantize(t) - w)
    assert (err <= t.scales[:, None] * 0.5 * (1 + 1e-6)).all()


# ----------------------------------------------------------------------------- pack / from_buffer


@pytest.mark.parametrize("kind", quant.KINDS)
@pytest.mark.parametrize("rows, cols", [(1, 1), (3, 5), (5, 65), (16, 45)])
@pytest.mark.parametrize("start", [0, 10, 64])
def test_pack_and_from_buffer(kind, rows, cols, start):
    t = quant.quantize(awkward_matrix(rows, cols, seed=11), kind)
    out = bytearray(b"\xaa" * start)
    quant.pack(t, out)
    assert len(out) == quant.packed_size(kind, rows, cols, start)
    got, end = quant.from_buffer(kind, rows, cols, out, start)
    assert end == len(out)
    assert (got.kind, got.rows, got.cols) == (kind, rows, cols)
    for part, dtype, shape in quant.layout(kind, rows, cols):
        a = getattr(got, part)
        assert a.dtype == dtype and a.shape == shape
        assert np.shares_memory(a, np.frombuffer(out, np.uint8))  # a view, not a copy
        offset = a.__array_interface__["data"][0] - np.frombuffer(out, np.uint8).__array_interface__["data"][0]
        assert offset % 64 == 0 and offset >= start  # each part 64-byte aligned
        np.testing.assert_array_equal(a, getattr(t, part))
    np.testing.assert_array_equal(quant.dequantize(got), quant.dequantize(t))
    assert bytes(out[:start]) == b"\xaa" * start
    # the alignment gaps are zeros
    pos = start
    for part, dtype, shape in quant.layout(kind, rows, cols):
        aligned = -(-pos // 64) * 64
        assert not any(out[pos:aligned])
        pos = aligned + int(np.prod(shape)) * dtype.itemsize


def test_packed_sizes():
    assert quant.packed_size("f32", 2, 3) == 24
    assert quant.packed_size("int8", 2, 3) == 64 + 8  # data 6 bytes, scales at 64
    assert quant.packed_size("int4", 2, 3) == 64 + 4  # data 2x2 bytes, f16 scales 2x1 at 64
    # int4 [4, 130] packed at offset 1: data 4x65 bytes at 64 (ends 324), f16 scales 4x3 at 384
    assert quant.packed_size("int4", 4, 130, 1) == 384 + 24


def test_bad_input():
    with pytest.raises(ValueError):
        quant.quantize(np.zeros(3, np.float32), "int8")
    with pytest.raises(ValueError):
        quant.quantize(np.zeros((2, 2), np.float32), "int3")
    with pytest.raises(ValueError):
        quant.layout("bf16", 2, 2)
