"""Weight quantisation: the one definition of every on-disk number format.

Formats (all symmetric absmax, round-half-to-even, row-major `[rows, cols]` = `[out, in]`):

- ``f32``:  ``data`` float32 ``[rows, cols]``; no scales.
- ``int8``: ``data`` int8 ``[rows, cols]``, q in [-127, 127]; ``scales`` float32 ``[rows]``,
  scale = absmax(row) / 127.
- ``int4``: groups of 64 along ``cols`` (the last group of a row may be shorter);
  ``scales`` float16 ``[rows, ceil(cols / 64)]``, scale = absmax(group) / 7;
  q = rint(w / scale) clipped to [-8, 7], computed with the stored (float16) scale;
  ``data`` uint8 ``[rows, ceil(cols / 2)]`` holding the nibble q + 8, even column in the low
  nibble; a padding nibble (odd ``cols``) holds 8, i.e. q = 0.

Dequantised value = q * float32(scale). A zero group/row has scale 0 and q 0.

Two more formats are loaded from checkpoints exactly as they are (DeepSeek V3/V4's native weights;
`NATIVE_KINDS`): the kernels compute on them, `quantize` does not write them.

- ``fp8``: ``data`` uint8 ``[rows, cols]``, float8 e4m3fn bytes (1 sign, 4 exponent bits of bias 7,
  3 mantissa bits; exponent 0 subnormal; ``0x7f`` / ``0xff`` NaN); ``scales`` uint8
  ``[ceil(rows / 128), ceil(cols / 128)]``, one UE8M0 byte s per 128×128 block;
  w = e4m3(q) * 2^(s - 127).
- ``fp4``: ``data`` uint8 ``[rows, ceil(cols / 2)]``, E2M1 nibbles (bit 3 the sign, magnitudes
  0, 0.5, 1, 1.5, 2, 3, 4, 6), even column in the low nibble; ``scales`` uint8
  ``[rows, ceil(cols / 32)]``, one UE8M0 byte per 32 columns; w = e2m1(q) * 2^(s - 127).

UE8M0 is a bare exponent: s stands for 2^(s - 127) (s = 0: 2^-127, a float32 subnormal), s = 255
for NaN. Every fp8 / fp4 weight is a float32 exactly (bar overflow to inf at s > 246).
The C kernels read exactly these arrays; `dequantize` is the NumPy reference they are tested against.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

KINDS = ("f32", "int8", "int4")  # the formats `quantize` writes (and a container holds)
NATIVE_KINDS = ("fp8", "fp4")  # checkpoint formats loaded as they are: kernels and dequantize only
ALL_KINDS = KINDS + NATIVE_KINDS
INT4_GROUP = 64
FP8_BLOCK = 128  # rows and columns per fp8 scale
FP4_GROUP = 32  # columns per fp4 scale


def _e4m3_table() -> np.ndarray:
    b = np.arange(256)
    e, m = (b >> 3) & 0xF, b & 0x7
    mag = np.where(e == 0, m * 2.0 ** -9, (8 + m) * 2.0 ** (e - 10.0))
    mag = np.where((b & 0x7F) == 0x7F, np.nan, mag)
    return np.where(b & 0x80, -mag, mag).astype(np.float32)


E4M3_VALUES = _e4m3_table()  # float32 [256]: float8 e4m3fn byte -> value
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)  # nibble -> value


def e8m0_values(s: np.ndarray) -> np.ndarray:
    """float32 2^(s - 127) of UE8M0 bytes `s` (any shape), exactly; 255 is NaN."""
    s = np.asarray(s, np.uint8)
    bits = np.where(s == 0, np.uint32(0x00400000), s.astype(np.uint32) << 23)
    return np.where(s == 255, np.uint32(0x7FC00000), bits).astype(np.uint32).view(np.float32)


@dataclass(frozen=True)
class QTensor:
    """A (possibly quantised) 2-D weight matrix ``[rows, cols]``."""

    kind: str  # "f32" | "int8" | "int4" | "fp8" | "fp4"
    rows: int
    cols: int
    data: np.ndarray  # f32 [rows, cols] | int8 [rows, cols] | uint8 [rows, ceil(cols/2)] (int4, fp4)
    #                   | uint8 [rows, cols] (fp8)
    scales: np.ndarray | None = None  # None | f32 [rows] | f16 [rows, ceil(cols/64)]
    #                   | uint8 [ceil(rows/128), ceil(cols/128)] (fp8) | uint8 [rows, ceil(cols/32)] (fp4)
    # the activation arithmetic of products with this weight (colibri_core.kernels): "f32" exact, or
    # "int8" (activations quantised per block of 64; f32 and fp8 weights compute "f32" regardless).
    # Set where the weight is parsed (the container, from the engine's options); a slice keeps it.
    act: str = "f32"

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scales is None else self.scales.nbytes)


def layout(kind: str, rows: int, cols: int) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """The arrays a QTensor of this kind and shape is made of, in storage order: (part, dtype, shape)."""
    if kind == "f32":
        return [("data", np.dtype(np.float32), (rows, cols))]
    if kind == "int8":
        return [("data", np.dtype(np.int8), (rows, cols)), ("scales", np.dtype(np.float32), (rows,))]
    if kind == "int4":
        return [
            ("data", np.dtype(np.uint8), (rows, (cols + 1) // 2)),
            ("scales", np.dtype(np.float16), (rows, -(-cols // INT4_GROUP))),
        ]
    if kind == "fp8":
        return [
            ("data", np.dtype(np.uint8), (rows, cols)),
            ("scales", np.dtype(np.uint8), (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))),
        ]
    if kind == "fp4":
        return [
            ("data", np.dtype(np.uint8), (rows, (cols + 1) // 2)),
            ("scales", np.dtype(np.uint8), (rows, -(-cols // FP4_GROUP))),
        ]
    raise ValueError(f"unknown quantisation {kind!r} (expected one of {', '.join(ALL_KINDS)})")


def quantize(w: np.ndarray, kind: str) -> QTensor:
    """Quantise a 2-D float matrix ``w [rows, cols]`` to `kind` (one of `KINDS`; the `NATIVE_KINDS`
    are only ever loaded from checkpoints)."""
    if kind in NATIVE_KINDS:
        raise ValueError(f"{kind} is a checkpoint format loaded as it is: quantize writes {', '.join(KINDS)} only")
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize expects a 2-D matrix, got shape {w.shape}")
    rows, cols = w.shape
    if kind == "f32":
        return QTensor("f32", rows, cols, w)
    if kind == "int8":
        scale = (np.abs(w).max(axis=1) / np.float32(127)).astype(np.float32)  # [rows]
        safe = np.where(scale == 0, np.float32(1), scale)
        q = np.clip(np.rint(w / safe[:, None]), -127, 127).astype(np.int8)
        return QTensor("int8", rows, cols, q, scale)
    if kind == "int4":
        ngroups = -(-cols // INT4_GROUP)
        padded = np.zeros((rows, ngroups * INT4_GROUP), np.float32)
        padded[:, :cols] = w
        groups = padded.reshape(rows, ngroups, INT4_GROUP)
        scale16 = (np.abs(groups).max(axis=2) / np.float32(7)).astype(np.float16)  # [rows, ngroups]
        scale = scale16.astype(np.float32)
        safe = np.where(scale == 0, np.float32(1), scale)
        q = np.clip(np.rint(groups / safe[:, :, None]), -8, 7).astype(np.int8)
        q = q.reshape(rows, ngroups * INT4_GROUP)[:, :cols]
        nib = (q + 8).astype(np.uint8)
        if cols % 2:
            nib = np.concatenate([nib, np.full((rows, 1), 8, np.uint8)], axis=1)
        packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
        return QTensor("int4", rows, cols, packed, scale16)
    raise ValueError(f"unknown quantisation {kind!r} (expected one of {', '.join(KINDS)})")


def dequantize(t: QTensor) -> np.ndarray:
    """float32 ``[rows, cols]`` values a QTensor stands for (the reference for every kernel)."""
    if t.kind == "f32":
        return np.asarray(t.data, np.float32).reshape(t.rows, t.cols)
    if t.kind == "int8":
        return t.data.astype(np.float32) * t.scales.astype(np.float32)[:, None]
    if t.kind == "int4":
        q = int4_values(t)  # int8 [rows, cols]
        scale = np.repeat(t.scales.astype(np.float32), INT4_GROUP, axis=1)[:, : t.cols]
        return q.astype(np.float32) * scale
    if t.kind == "fp8":
        scale = e8m0_values(t.scales).repeat(FP8_BLOCK, axis=0).repeat(FP8_BLOCK, axis=1)[: t.rows, : t.cols]
        with np.errstate(over="ignore"):  # inf past float32's range (scales above 2^119), as in C
            return E4M3_VALUES[t.data] * scale
    if t.kind == "fp4":
        scale = np.repeat(e8m0_values(t.scales), FP4_GROUP, axis=1)[:, : t.cols]
        with np.errstate(over="ignore"):
            return E2M1_VALUES[fp4_nibbles(t)] * scale
    raise ValueError(f"unknown quantisation {t.kind!r}")


def int4_values(t: QTensor) -> np.ndarray:
    """The signed int4 values q of an int4 QTensor, int8 ``[rows, cols]``."""
    lo = (t.data & 0x0F).astype(np.int8) - 8
    hi = (t.data >> 4).astype(np.int8) - 8
    q = np.empty((t.rows, t.data.shape[1] * 2), np.int8)
    q[:, 0::2], q[:, 1::2] = lo, hi
    return q[:, : t.cols]


def fp4_nibbles(t: QTensor) -> np.ndarray:
    """The E2M1 nibble of every weight of an fp4 QTensor, uint8 ``[rows, cols]`` (index E2M1_VALUES)."""
    q = np.empty((t.rows, t.data.shape[1] * 2), np.uint8)
    q[:, 0::2], q[:, 1::2] = t.data & 0x0F, t.data >> 4
    return q[:, : t.cols]


def from_buffer(kind: str, rows: int, cols: int, buf, offset: int = 0, act: str = "f32") -> tuple[QTensor, int]:
    """A QTensor viewing `buf` at `offset` (parts packed back to back, each 64-byte aligned), its
    products in arithmetic `act`.

    Returns the tensor and the offset just past it. `pack` writes the same layout.
    """
    parts = {}
    for part, dtype, shape in layout(kind, rows, cols):
        offset = _align(offset, 64)
        n = math.prod(shape)
        parts[part] = np.frombuffer(buf, dtype, n, offset).reshape(shape)
        offset += n * dtype.itemsize
    return QTensor(kind, rows, cols, parts["data"], parts.get("scales"), act), offset


def pack(t: QTensor, out: bytearray) -> None:
    """Append a QTensor's parts to `out` in the layout `from_buffer` reads."""
    for part, _, _ in layout(t.kind, t.rows, t.cols):
        out += bytes(_align(len(out), 64) - len(out))
        out += np.ascontiguousarray(getattr(t, part)).tobytes()


def packed_size(kind: str, rows: int, cols: int, offset: int = 0) -> int:
    """Offset just past a QTensor packed at `offset` (see `pack`)."""
    for _, dtype, shape in layout(kind, rows, cols):
        offset = _align(offset, 64) + int(np.prod(shape)) * dtype.itemsize
    return offset


def _align(n: int, a: int) -> int:
    return -(-n // a) * a
