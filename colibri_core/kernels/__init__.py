"""colibri's C kernels (csrc/, bound with cffi in API mode) and their NumPy references.

    from colibri_core import kernels
    y = kernels.matmul(w, x)                   # x f32 [n, w.cols] -> f32 [n, w.rows] = x @ dequant(w).T
    y = kernels.matmul_t(w, x)                 # x f32 [n, w.rows] -> f32 [n, w.cols] = x @ dequant(w)
    y = kernels.expert_ffn(gate, up, down, x)  # x f32 [n, H] -> f32 [n, H] = down(silu(gate x) * (up x))
    kernels.simd()                             # the C code path in use: "portable"
    kernels.reference.matmul(w, x)             # the NumPy reference of each kernel

Weights are `QTensor`s (colibri_core.quant). Their arrays go to C by pointer and are never copied,
so they may be read-only views of a buffer (``np.frombuffer`` of bytes, an mmap). Everything is
checked here before C sees it: a wrong shape, dtype or kind raises ValueError. The C calls release
the GIL, and each output element is reduced in one fixed order, so results are deterministic.
"""
from __future__ import annotations

import functools

import numpy as np

from colibri_core.kernels import reference
from colibri_core.quant import KINDS, QTensor, layout

try:
    from colibri_core.kernels._colibri_kernels import ffi, lib
except ImportError as e:  # pragma: no cover - only without a build
    raise ImportError(
        "colibri's C kernels (colibri_core.kernels._colibri_kernels) are not built; "
        "install the package (`pip install -e .` in a checkout) to compile csrc/"
    ) from e

__all__ = ["matmul", "matmul_t", "expert_ffn", "simd", "reference"]

_KIND_CODES = {"f32": lib.QKIND_F32, "int8": lib.QKIND_INT8, "int4": lib.QKIND_INT4}
_INT_MAX = 2**31 - 1  # C takes the dimensions as int
_layout = functools.lru_cache(maxsize=1024)(layout)  # a model has few distinct weight shapes


def simd() -> str:
    """The name of the C code path in use (for now always ``"portable"``)."""
    return ffi.string(lib.simd_name()).decode("ascii")


def matmul(w: QTensor, x: np.ndarray) -> np.ndarray:
    """``y = x @ dequant(w).T``: x float32 ``[n, w.cols]`` -> y float32 ``[n, w.rows]``."""
    keep = []  # the cffi buffers: they keep the arrays alive while C reads them
    wm = _qmatrix(w, "w", keep)
    x = _activations(x, w.cols, "matmul: x")
    n = x.shape[0]
    if n == 0 or w.rows == 0 or w.cols == 0:
        return np.zeros((n, w.rows), np.float32)
    y = np.empty((n, w.rows), np.float32)
    _check(lib.matmul(_floats(y, writable=True), wm, _floats(x), n), "matmul")
    return y


def matmul_t(w: QTensor, x: np.ndarray) -> np.ndarray:
    """``y = x @ dequant(w)`` (no transpose): x float32 ``[n, w.rows]`` -> y float32 ``[n, w.cols]``.

    Sums over the rows in order, each weight dequantised first, so `reference.matmul_t` gives the
    same bits."""
    keep = []
    wm = _qmatrix(w, "w", keep)
    x = _activations(x, w.rows, "matmul_t: x")
    n = x.shape[0]
    y = np.empty((n, w.cols), np.float32)
    _check(lib.matmul_t(_floats(y, writable=True), wm, _floats(x), n), "matmul_t")
    return y


def expert_ffn(gate: QTensor, up: QTensor, down: QTensor, x: np.ndarray) -> np.ndarray:
    """``down(silu(gate x) * (up x))``, ``silu(a) = a / (1 + exp(-a))``, fused in one C call.

    gate, up: ``[I, H]``; down: ``[H, I]``, all of one kind; x float32 ``[n, H]`` -> float32 ``[n, H]``.
    """
    keep = []
    gm, um, dm = (_qmatrix(t, name, keep) for t, name in ((gate, "gate"), (up, "up"), (down, "down")))
    if not gate.kind == up.kind == down.kind:
        raise ValueError(
            f"expert_ffn: gate, up and down must have one kind, got {gate.kind}, {up.kind}, {down.kind}"
        )
    inter, hidden = gate.rows, gate.cols
    if (up.rows, up.cols) != (inter, hidden) or (down.rows, down.cols) != (hidden, inter):
        raise ValueError(
            f"expert_ffn: expected gate, up [I, H] and down [H, I]; got gate [{gate.rows}, {gate.cols}], "
            f"up [{up.rows}, {up.cols}], down [{down.rows}, {down.cols}]"
        )
    x = _activations(x, hidden, "expert_ffn: x")
    n = x.shape[0]
    if n == 0 or hidden == 0 or inter == 0:
        return np.zeros((n, hidden), np.float32)
    out = np.empty((n, hidden), np.float32)
    _check(lib.expert_ffn(_floats(out, writable=True), gm, um, dm, _floats(x), n), "expert_ffn")
    return out


# ----------------------------------------------------------------------------
# Argument checks and conversion to C


def _qmatrix(t: QTensor, name: str, keep: list):
    """A C ``QMatrix *`` viewing `t`'s arrays (no copy), after checking them against quant.layout."""
    kind = getattr(t, "kind", None)
    if kind not in _KIND_CODES:
        raise ValueError(f"{name}: unknown quantisation {kind!r} (expected one of {', '.join(KINDS)})")
    rows, cols = t.rows, t.cols
    if not (0 <= rows <= _INT_MAX and 0 <= cols <= _INT_MAX):
        raise ValueError(f"{name}: shape [{rows}, {cols}] out of range")
    if kind == "f32" and t.scales is not None:
        raise ValueError(f"{name}: f32 weights have no scales, got an array")
    m = ffi.new("QMatrix *")
    m.kind, m.rows, m.cols = _KIND_CODES[kind], rows, cols
    for part, dtype, shape in _layout(kind, rows, cols):
        arr = getattr(t, part)
        if not isinstance(arr, np.ndarray) or arr.dtype != dtype or arr.shape != shape:
            got = f"{arr.dtype} {list(arr.shape)}" if isinstance(arr, np.ndarray) else type(arr).__name__
            raise ValueError(f"{name}: {kind} {part} must be {dtype} {list(shape)}, got {got}")
        flags = arr.flags
        if not (flags.c_contiguous and flags.aligned):
            raise ValueError(f"{name}: {kind} {part} must be C-contiguous and aligned (weights are never copied)")
        if arr.size:
            buf = ffi.from_buffer(arr)  # read-only is fine: C only reads weights
            keep.append(buf)
            setattr(m, part, buf)
    return m


def _activations(x, cols: int, what: str) -> np.ndarray:
    """`x` as a C-contiguous float32 ``[n, cols]`` array (copied only when not contiguous)."""
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise ValueError(f"{what} must be float32, got {x.dtype}")
    if x.ndim != 2 or x.shape[1] != cols:
        raise ValueError(f"{what} must be [n, {cols}], got {list(x.shape)}")
    if x.shape[0] > _INT_MAX:
        raise ValueError(f"{what}: {x.shape[0]} rows is too many")
    if x.flags.c_contiguous and x.flags.aligned:
        return x
    return np.array(x, order="C")  # a fresh copy: contiguous and aligned


def _floats(a: np.ndarray, writable: bool = False):
    return ffi.from_buffer("float[]", a, require_writable=writable)


def _check(status: int, kernel: str) -> None:
    if status == lib.COLI_ENOMEM:
        raise MemoryError(f"{kernel}: out of memory for the scratch buffer")
    if status != lib.COLI_OK:
        raise ValueError(f"{kernel}: the C kernel rejected its arguments (status {status})")
