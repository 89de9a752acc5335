"""colibri's C kernels (csrc/, bound with cffi in API mode) and their NumPy references.

    from colibri_core import kernels
    y = kernels.matmul(w, x)                   # x f32 [n, w.cols] -> f32 [n, w.rows] = x @ dequant(w).T
    q, k, v = kernels.matmul_multi([wq, wk, wv], x)   # one call, one input, several weights
    y = kernels.matmul_t(w, x)                 # x f32 [n, w.rows] -> f32 [n, w.cols] = x @ dequant(w)
    wf = kernels.dequantize(w)                 # f32 [w.rows, w.cols], bit for bit quant.dequantize(w)
    y = kernels.expert_ffn(gate, up, down, x)  # x f32 [n, H] -> f32 [n, H] = down(silu(gate x) * (up x))
    y = kernels.expert_ffn(gate, up, down, x, glu="swiglu_oai", limit=7.0, alpha=1.702, bias=(bg, bu, bd))  # GLUS
    kernels.moe_experts(outs, x, ids, experts) # every ready expert of an MoE layer in one call
    y = kernels.moe_block(x, ids, weights, kernels.ExpertTable(all_experts))  # a whole MoE layer, experts at hand
    h = kernels.AttnBlock(norm, wq, wk, wv, wo, heads=…, …)(h, cos, sin, k_cache, v_cache, start)  # attention sub-block
    y = kernels.matmul(w, x, act="int8")       # the fast arithmetic for one call (default: the weight's, w.act)
    kernels.simd(), kernels.set_simd("avx2")   # the C code path: "portable" | "avx2" | "avx512" | "amx"
    kernels.threads(), kernels.set_threads(2)  # threads inside the kernels
    kernels.reference.matmul(w, x)             # the NumPy reference of each kernel

Weights are `QTensor`s (colibri_core.quant) of any kind in ``quant.ALL_KINDS``: f32, int8, int4 and
the checkpoint-native fp8 / fp4 (DeepSeek's, computed on as they are). Their arrays go to C by pointer and are never copied,
so they may be read-only views of a buffer (``np.frombuffer`` of bytes, an mmap). Everything is
checked here before C sees it: a wrong shape, dtype or kind raises ValueError. The C calls release
the GIL. Each output element is reduced by one thread in one fixed order (csrc/matmul.c), the same
on every code path, so a result depends only on the inputs and the activation arithmetic — not on
the code path, the thread count, or which other tokens or experts shared the call.

Activation arithmetic (``act``): ``"f32"`` multiplies float32 activations by the dequantised
weights (what the `transformers` oracle computes; the conformance kit's mode); ``"int8"`` quantises
the activations to int8 per block of 64 and takes integer dot products (about 3x faster on int4
weights, the arithmetic llama.cpp uses; `reference` models it exactly). f32 and fp8 weights always
use ``"f32"`` (an ``"int8"`` request computes the exact mode for them). A weight carries its
arithmetic (``QTensor.act``: the container that parses it sets it from the engine's options), so a
model's products use it with nothing ambient; ``act=`` overrides it for one call.

Environment: ``COLIBRI_SIMD=portable|avx2|avx512`` forces a code path (one this CPU lacks is an
error), ``COLIBRI_THREADS=N`` sets the kernel threads (default: the CPUs this process may use).
"""
from __future__ import annotations

import functools
import math
import os

import numpy as np

from colibri_core.errors import ColibriError
from colibri_core.kernels import reference
from colibri_core.quant import ALL_KINDS, QTensor, layout

try:
    from colibri_core.kernels._colibri_kernels import ffi, lib
except ImportError as e:  # pragma: no cover - only without a build
    raise ImportError(
        "colibri's C kernels (colibri_core.kernels._colibri_kernels) are not built; "
        "install the package (`pip install -e .` in a checkout) to compile csrc/"
    ) from e

__all__ = ["AttnBlock", "matmul", "matmul_multi", "matmul_each", "matmul_t", "matmul_t_each", "dequantize", "expert_ffn", "moe_experts", "moe_combine", "moe_block", "moe_block_softmax", "ExpertTable", "softmax_topk", "exp", "sigmoid", "rms_norm", "rope_rotate_half", "attention",
           "ACTIVATIONS", "check_activations", "weights_act", "GLUS",
           "simd", "set_simd", "simd_supported", "SIMD_PATHS", "threads", "set_threads", "reference"]

SIMD_PATHS = ("portable", "avx2", "avx512", "amx")
ACTIVATIONS = ("f32", "int8")
# the experts' gated units (csrc/colibri.h ExpertMath; `reference.gated_unit` defines each)
GLUS = {"swiglu": lib.GLU_SWIGLU, "swiglu_oai": lib.GLU_SWIGLU_OAI, "geglu_tanh": lib.GLU_GEGLU_TANH, "situ": lib.GLU_SITU}
_CLAMPED = ("swiglu", "swiglu_oai")  # the gated units with a clamp limit
_ACT_CODES = {"f32": lib.ACT_F32, "int8": lib.ACT_Q8}
_ACT_KINDS = ("int8", "int4", "fp4")  # the weight kinds whose products the "int8" arithmetic changes
_KIND_CODES = {"f32": lib.QKIND_F32, "int8": lib.QKIND_INT8, "int4": lib.QKIND_INT4, "fp8": lib.QKIND_FP8,
               "fp4": lib.QKIND_FP4}
_INT_MAX = 2**31 - 1  # C takes the dimensions as int
_layout = functools.lru_cache(maxsize=1024)(layout)  # a model has few distinct weight shapes
_SIMD_NEEDS = {"avx2": "AVX2 and F16C", "avx512": "AVX-512 F, BW, VL and VNNI",
               "amx": "AVX-512 (as avx512) and AMX-INT8 that the kernel lets a process use"}


# ----------------------------------------------------------------------------
# Configuration: code path, threads, activation arithmetic


def simd() -> str:
    """The name of the C code path in use: ``"portable"``, ``"avx2"``, ``"avx512"`` or ``"amx"``."""
    return ffi.string(lib.simd_name()).decode("ascii")


def simd_supported(name: str) -> bool:
    """Whether this CPU (and build) can run code path `name`."""
    return name in SIMD_PATHS and bool(lib.simd_supported(name.encode("ascii")))


def set_simd(name: str) -> None:
    """Use code path `name` (``"auto"``: the best this CPU has). Never changes a result."""
    status = lib.simd_select(name.encode("ascii"))
    if status == lib.COLI_EINVAL:
        raise ColibriError(f"unknown SIMD path {name!r} (expected one of {', '.join(SIMD_PATHS)}, or auto)")
    if status == lib.COLI_EUNSUPPORTED:
        raise ColibriError(f"SIMD path {name!r} needs {_SIMD_NEEDS[name]}, which this CPU lacks "
                           f"(it has: {', '.join(p for p in SIMD_PATHS if simd_supported(p))})")


def threads() -> int:
    """Threads the kernels use, the calling thread included."""
    return lib.threads_get()


def set_threads(n: int) -> None:
    """Use `n` threads inside the kernels (1..256). Never changes a result."""
    if not isinstance(n, int) or lib.threads_set(n) != lib.COLI_OK:
        raise ColibriError(f"kernel threads must be an integer from 1 to 256, got {n!r}")


def check_activations(mode) -> str:
    """`mode` if it is an activation arithmetic (ACTIVATIONS), else one clear error."""
    if mode not in _ACT_CODES:
        raise ColibriError(f"unknown activation arithmetic {mode!r} (expected one of {', '.join(ACTIVATIONS)})")
    return mode


def weights_act(weights) -> str:
    """The activation arithmetic of a call on `weights` (QTensors): theirs (``QTensor.act``), one
    for all; f32 and fp8 weights compute exact whatever they carry, so they do not count."""
    acts = {w.act for w in weights if w.kind in _ACT_KINDS}
    if len(acts) > 1:
        raise ValueError(f"weights of one call carry different activation arithmetics: {', '.join(sorted(acts))}")
    return acts.pop() if acts else "f32"


def _act_code(act: str | None, weights=()) -> int:
    """The C code of a call's arithmetic: `act` where given (an override), else `weights`' own."""
    return _ACT_CODES[check_activations(act if act is not None else weights_act(weights))]


@functools.lru_cache(maxsize=64)  # a model has one or two; the struct stays alive in the cache
def _math(glu: str, limit: float | None, alpha: float | None):
    """The C ``ExpertMath *`` of a gated unit (GLUS): `limit` the clamp of "swiglu" / "swiglu_oai"
    (None: none; else positive), `alpha` the sigmoid slope "swiglu_oai" needs; the others take neither."""
    if glu not in GLUS:
        raise ValueError(f"unknown gated unit {glu!r} (expected one of {', '.join(GLUS)})")
    if limit is not None and glu not in _CLAMPED:
        raise ValueError(f"the gated unit {glu!r} has no clamp limit (got {limit!r})")
    if limit is not None and not limit > 0:
        raise ValueError(f"SwiGLU limit must be positive, got {limit!r}")
    if (glu == "swiglu_oai") != (alpha is not None) or (alpha is not None and not math.isfinite(alpha)):
        raise ValueError(f"an alpha (a finite number) goes with 'swiglu_oai' only; got {alpha!r} for {glu!r}")
    m = ffi.new("ExpertMath *")
    m.glu, m.limit, m.alpha = GLUS[glu], math.inf if limit is None else float(limit), 0.0 if alpha is None else alpha
    return m


def _check_environment() -> None:
    """COLIBRI_SIMD / COLIBRI_THREADS: an unusable value is a clear error, not a silent fallback."""
    forced = os.environ.get("COLIBRI_SIMD", "")
    if forced and lib.simd_init_status() != lib.COLI_OK:
        try:
            set_simd(forced)
        except ColibriError as e:
            raise ColibriError(f"COLIBRI_SIMD={forced}: {e}") from None
    n = os.environ.get("COLIBRI_THREADS", "")
    if n and not (n.isdigit() and 1 <= int(n) <= 256):
        raise ColibriError(f"COLIBRI_THREADS={n!r}: expected an integer from 1 to 256")


_check_environment()


# ----------------------------------------------------------------------------
# Kernels


def matmul(w: QTensor, x: np.ndarray, act: str | None = None) -> np.ndarray:
    """``y = x @ dequant(w).T``: x float32 ``[n, w.cols]`` -> y float32 ``[n, w.rows]``."""
    return matmul_multi([w], x, act)[0]


def matmul_multi(ws: list[QTensor], x: np.ndarray, act: str | None = None) -> list[np.ndarray]:
    """``[x @ dequant(w).T for w in ws]`` in one C call (weights with one ``cols``); each result is
    bit for bit what `matmul` gives."""
    mats = [_qmatrix(w, "w") for w in ws]
    cols = ws[0].cols
    if any(w.cols != cols for w in ws):
        raise ValueError(f"matmul_multi: every weight needs {cols} columns, got {[w.cols for w in ws]}")
    x = _activations(x, cols, "matmul: x")
    n = x.shape[0]
    ys = [np.empty((n, w.rows), np.float32) for w in ws]
    if n == 0 or cols == 0:
        for y in ys:
            y.fill(0)
        return ys
    yp = ffi.new("float *[]", [_floats(y, writable=True) for y in ys])
    status = lib.matmul_multi(yp, ffi.new("QMatrix *[]", mats), len(mats), _floats(x), n, _act_code(act, ws))
    _check(status, "matmul")
    return ys


def _inputs_each(name: str, ws: list[QTensor], xs: list[np.ndarray], width, x_what: str):
    """`ws`' C matrices, their inputs as float32 ``[n, width(w)]`` arrays (one n for all) and n."""
    if len(ws) != len(xs):
        raise ValueError(f"{name}: one input per weight, got {len(ws)} weights and {len(xs)} inputs")
    mats = [_qmatrix(w, "w") for w in ws]
    xs = [_activations(x, width(w), x_what) for w, x in zip(ws, xs)]
    n = xs[0].shape[0] if xs else 0
    if any(x.shape[0] != n for x in xs):
        raise ValueError(f"{name}: every x needs {n} rows, got {[x.shape[0] for x in xs]}")
    return mats, xs, n


def matmul_each(ws: list[QTensor], xs: list[np.ndarray], act: str | None = None) -> list[np.ndarray]:
    """``[x @ dequant(w).T for w, x in zip(ws, xs)]`` in one C call, each x ``[n, w.cols]`` with one
    n (MLA's per-head value projections); each result is bit for bit what `matmul` gives."""
    mats, xs, n = _inputs_each("matmul_each", ws, xs, lambda w: w.cols, "matmul_each: x")
    ys = [np.empty((n, w.rows), np.float32) for w in ws]
    if n:
        status = lib.matmul_each(ffi.new("float *[]", [_floats(y, writable=True) for y in ys]), ffi.new("QMatrix *[]", mats),
                                 len(mats), ffi.new("float *[]", [_floats(x) for x in xs]), n, _act_code(act, ws))
        _check(status, "matmul_each")
    return ys


def matmul_t_each(ws: list[QTensor], xs: list[np.ndarray]) -> list[np.ndarray]:
    """``[matmul_t(w, x) for w, x in zip(ws, xs)]`` in one C call, one thread per product (MLA's
    per-head key absorption); the same bits."""
    mats, xs, n = _inputs_each("matmul_t_each", ws, xs, lambda w: w.rows, "matmul_t: x")
    ys = [np.empty((n, w.cols), np.float32) for w in ws]
    if ws:
        status = lib.matmul_t_each(ffi.new("float *[]", [_floats(y, writable=True) for y in ys]),
                                   ffi.new("QMatrix *[]", mats), len(mats), ffi.new("float *[]", [_floats(x) for x in xs]), n)
        _check(status, "matmul_t")
    return ys


def matmul_t(w: QTensor, x: np.ndarray) -> np.ndarray:
    """``y = x @ dequant(w)`` (no transpose): x float32 ``[n, w.rows]`` -> y float32 ``[n, w.cols]``.

    Sums over the rows in order, each weight dequantised first, so `reference.matmul_t` gives the
    same bits."""
    return matmul_t_each([w], [x])[0]


def dequantize(w: QTensor) -> np.ndarray:
    """The float32 ``[w.rows, w.cols]`` values of `w`, computed in C: bit for bit `quant.dequantize`."""
    wm = _qmatrix(w, "w")
    out = np.empty((w.rows, w.cols), np.float32)
    if out.size:
        _check(lib.qmatrix_dequantize(_floats(out, writable=True), wm), "dequantize")
    return out


def expert_ffn(gate: QTensor, up: QTensor, down: QTensor, x: np.ndarray, act: str | None = None,
               limit: float | None = None, glu: str = "swiglu", alpha: float | None = None,
               bias: tuple | None = None) -> np.ndarray:
    """``down(glu(gate x + gate_bias, up x + up_bias)) + down_bias`` fused in one C call, `glu` one of
    GLUS (`reference.gated_unit` defines each): "swiglu" ``silu(min(g, limit)) · clip(u, ±limit)`` (limit
    None: the plain SwiGLU), "swiglu_oai" GPT-OSS's ``(clip(u, ±limit) + 1) · g' σ(alpha g')`` with
    ``g' = min(g, limit)``, "geglu_tanh" ``gelu_tanh(g) · u``, "situ" Kimi K3's SiTU-GLU. `bias`:
    None, or (gate_bias ``(I,)``, up_bias ``(I,)``, down_bias ``(H,)``) float32, each None for none.

    gate, up: ``[I, H]``; down: ``[H, I]``, all of one kind; x float32 ``[n, H]`` -> float32 ``[n, H]``.
    """
    _check_expert(gate, up, down)
    gm, um, dm = _qmatrix(gate, "gate"), _qmatrix(up, "up"), _qmatrix(down, "down")
    keep: list = []
    bias_c = _biases([bias], [gate.rows], gate.cols, keep)
    x = _activations(x, gate.cols, "expert_ffn: x")
    n = x.shape[0]
    out = np.zeros((n, gate.cols), np.float32)
    m = _math(glu, limit, alpha)
    if n == 0 or gate.cols == 0:
        return out
    _check(lib.expert_ffn(_floats(out, writable=True), gm, um, dm, bias_c, _floats(x), n, _act_code(act, (gate, up, down)),
                          m), "expert_ffn")
    return out


def moe_experts(outs: np.ndarray, x: np.ndarray, ids: np.ndarray, experts: dict, act: str | None = None,
                limit: float | None = None, glu: str = "swiglu", alpha: float | None = None,
                biases: dict | None = None) -> None:
    """Every expert of `experts` ({expert id: (gate, up, down)}) in one C call, with the gated unit
    `glu`, `limit`, `alpha` and each expert's biases (`biases` {expert id: (gate_bias, up_bias,
    down_bias)}; an expert it lacks has none) as in `expert_ffn`.

    outs float32 ``(T, k, H)``, C-contiguous: ``outs[t, r] = expert_ffn(*experts[ids[t, r]], x[t])``
    for every slot (t, r) whose expert is in `experts`; other slots are left as they are.
    x float32 ``(T, H)``; ids integer ``(T, k)``.
    """
    ids = np.asarray(ids)
    if ids.ndim != 2:
        raise ValueError(f"moe_experts: ids must be (T, k), got {list(ids.shape)}")
    T, k = ids.shape
    hidden = outs.shape[-1] if outs.ndim == 3 else -1
    if outs.dtype != np.float32 or outs.shape != (T, k, hidden) or not outs.flags.c_contiguous:
        raise ValueError(f"moe_experts: outs must be C-contiguous float32 ({T}, {k}, H), got {outs.dtype} {list(outs.shape)}")
    x = _activations(x, hidden, "moe_experts: x")
    if x.shape[0] != T:
        raise ValueError(f"moe_experts: x has {x.shape[0]} tokens, ids {T}")
    if not experts or T == 0:
        return
    if ids.dtype != np.int64 or not ids.flags.c_contiguous:
        ids = np.ascontiguousarray(ids, np.int64)
    keys = np.fromiter(experts, np.int64, len(experts))  # the experts of this call, in dict order
    mats = []
    for gate, up, down in experts.values():
        mats += (_qmatrix(gate, "gate"), _qmatrix(up, "up"), _qmatrix(down, "down"))
    keep: list = []
    bias_c = ffi.NULL if not biases else _biases([biases.get(e) for e in experts],
                                                 [ffn[0].rows for ffn in experts.values()], hidden, keep)
    code = _act_code(act, [w for ffn in experts.values() for w in ffn])
    status = lib.moe_experts(_floats(outs, writable=True), _floats(x), T, k, hidden, ffi.new("QMatrix *[]", mats), bias_c,
                             len(keys), ffi.from_buffer("int64_t[]", ids), ffi.from_buffer("int64_t[]", keys), code,
                             _math(glu, limit, alpha))
    if status == lib.COLI_EINVAL:
        for gate, up, down in experts.values():
            _check_expert(gate, up, down, hidden)
    _check(status, "moe_experts")


class ExpertTable:
    """Every expert of one MoE layer as a C table for `moe_block`: experts[e] = (gate, up, down)
    for e = 0 .. E-1, checked once (one kind per expert, the layer's shapes), kept alive here;
    `biases` None, or biases[e] expert e's (gate_bias, up_bias, down_bias) as `expert_ffn`'s `bias`."""

    def __init__(self, experts: list[tuple[QTensor, QTensor, QTensor]], biases: list | None = None):
        if not experts:
            raise ValueError("ExpertTable: no experts")
        if biases is not None and len(biases) != len(experts):
            raise ValueError(f"ExpertTable: {len(biases)} biases for {len(experts)} experts")
        hidden = experts[0][0].cols
        mats = []
        for gate, up, down in experts:
            _check_expert(gate, up, down, hidden)
            mats += (_qmatrix(gate, "gate"), _qmatrix(up, "up"), _qmatrix(down, "down"))
        self.hidden, self.n = hidden, len(experts)
        self.act = weights_act([w for ffn in experts for w in ffn])  # the arithmetic `moe_block` uses by default
        self._keep: list = [experts]
        self._bias = ffi.NULL if biases is None else _biases(biases, [ffn[0].rows for ffn in experts], hidden, self._keep)
        self._c = ffi.new("QMatrix *[]", mats)


def moe_block(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, table: ExpertTable, act: str | None = None,
              limit: float | None = None, glu: str = "swiglu", shared: ExpertTable | None = None,
              shared_scale: np.ndarray | None = None, alpha: float | None = None) -> np.ndarray:
    """A whole MoE layer whose experts are all in `table`, in one C call: ``Σ_rank weights[t, r] ·
    expert_ffn(*table[ids[t, r]], x[t])``, the same bits as `moe_experts` over the batch union
    then `moe_combine`. x float32 (T, H); ids integer (T, k) in 0 .. E-1; weights (T, k) → (T, H).

    `shared`, a table of one expert (a shared expert), runs in the same call as one more rank after
    the routed ones: ``+ shared_scale[t] · expert_ffn(*shared, x[t])`` (shared_scale (T,) float32,
    None: 1), the bits of this sum done after the call."""
    x = _activations(x, table.hidden, "moe_block: x")
    ids = np.ascontiguousarray(ids, np.int64)
    weights = np.ascontiguousarray(weights, np.float32)
    T = x.shape[0]
    if ids.ndim != 2 or ids.shape[0] != T or weights.shape != ids.shape:
        raise ValueError(f"moe_block: ids and weights must be ({T}, k), got {list(ids.shape)}, {list(weights.shape)}")
    shared_c, bias_c, scale_c = _shared_expert(shared, shared_scale, table, T)
    out = np.empty((T, table.hidden), np.float32)
    m = _math(glu, limit, alpha)
    if T and table.hidden:
        _check(lib.moe_block(_floats(out, writable=True), _floats(x), T, ids.shape[1], table.hidden, table._c, table._bias,
                             table.n, ffi.from_buffer("int64_t[]", ids), _floats(weights), shared_c, bias_c, scale_c,
                             _act_code(act or table.act), m), "moe_block")
    return out


def moe_block_softmax(x: np.ndarray, router: QTensor, k: int, renormalize: bool, table: ExpertTable,
                      act: str | None = None, limit: float | None = None, glu: str = "swiglu",
                      shared: ExpertTable | None = None, shared_scale: np.ndarray | None = None,
                      alpha: float | None = None):
    """`moe_block` with the layer's softmax router in the same C call: logits = `matmul(router, x)`,
    `softmax_topk(logits, k, renormalize)`, then `moe_block` over that routing — the bits of the
    three calls. router (E, H) with E = table.n. Returns out (T, H), weights float32 (T, k) and ids
    int64 (T, k), each token's best expert first."""
    x = _activations(x, table.hidden, "moe_block_softmax: x")
    T = x.shape[0]
    if (router.rows, router.cols) != (table.n, table.hidden) or not 1 <= k <= table.n:
        raise ValueError(f"moe_block_softmax: router must be [{table.n}, {table.hidden}] with 1 <= k <= {table.n}, "
                         f"got [{router.rows}, {router.cols}], k {k}")
    shared_c, bias_c, scale_c = _shared_expert(shared, shared_scale, table, T)
    out, weights, ids = np.empty((T, table.hidden), np.float32), np.empty((T, k), np.float32), np.empty((T, k), np.int64)
    m = _math(glu, limit, alpha)
    if T:
        _check(lib.moe_block_softmax(_floats(out, writable=True), ffi.from_buffer("int64_t[]", ids, require_writable=True),
                                     _floats(weights, writable=True), _floats(x), T, k, table.hidden,
                                     _qmatrix(router, "router"), int(renormalize), table._c, table._bias, table.n,
                                     shared_c, bias_c, scale_c, _act_code(act or table.act), m), "moe_block_softmax")
    return out, weights, ids


def _shared_expert(shared: ExpertTable | None, scale: np.ndarray | None, table: ExpertTable, T: int):
    """C arguments (table, biases, scales) for a shared expert run inside `moe_block` (NULL: none)."""
    if shared is None:
        return ffi.NULL, ffi.NULL, ffi.NULL
    if shared.n != 1 or shared.hidden != table.hidden:
        raise ValueError(f"moe_block: shared must be a table of one expert of width {table.hidden}, "
                         f"got {shared.n} of {shared.hidden}")
    if scale is None:
        return shared._c, shared._bias, ffi.NULL
    scale = np.ascontiguousarray(scale, np.float32)
    if scale.shape != (T,):
        raise ValueError(f"moe_block: shared_scale must be ({T},), got {list(scale.shape)}")
    return shared._c, shared._bias, _floats(scale)


def moe_combine(outs: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``Σ_rank weights[t, r] · outs[t, r]`` in rank order: outs (T, k, H), weights (T, k) -> (T, H)
    (the same float32 operations as the NumPy ``out = o0 w0; out += o_r w_r``, so the same bits)."""
    outs = np.ascontiguousarray(outs, np.float32)
    weights = np.ascontiguousarray(weights, np.float32)
    T, k, H = outs.shape
    if weights.shape != (T, k):
        raise ValueError(f"moe_combine: weights must be ({T}, {k}), got {list(weights.shape)}")
    out = np.empty((T, H), np.float32)
    if out.size:
        _check(lib.moe_combine(_floats(out, writable=True), _floats(outs), _floats(weights), T, k, H), "moe_combine")
    return out


def softmax_topk(logits: np.ndarray, k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """The softmax router in one C call: logits (T, E) → weights float32 (T, k), ids int64 (T, k)
    (the k most probable experts, most probable first, ties to the lower index; weights divided
    by their sum when `renormalize`). `reference.softmax_topk` is the NumPy version."""
    logits = np.ascontiguousarray(logits, np.float32)
    T, E = logits.shape
    if not 1 <= k <= E:
        raise ValueError(f"softmax_topk: k must be 1..{E}, got {k}")
    weights, ids = np.empty((T, k), np.float32), np.empty((T, k), np.int64)
    if T:
        _check(lib.softmax_topk(_floats(weights, writable=True), ffi.from_buffer("int64_t[]", ids, require_writable=True),
                                _floats(logits), T, E, k, int(renormalize)), "softmax_topk")
    return weights, ids


def exp(x: np.ndarray) -> np.ndarray:
    """e^x in float32 by the kernels' own steps (the exp of attention's softmax and the experts'
    SiLU), within 1 ulp of the true value and the same bits on every code path."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty_like(x)
    if x.size:
        _check(lib.exp_f32(_floats(out, writable=True), _floats(x), x.size), "exp")
    return out


def sigmoid(x: np.ndarray) -> np.ndarray:
    """``1 / (1 + e^-x)`` in float32 with the kernels' own exp (`exp`): a gate's sigmoid, the bits the
    fused decoder layer computes (0 where the exp overflows)."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty_like(x)
    if x.size:
        _check(lib.sigmoid_f32(_floats(out, writable=True), _floats(x), x.size), "sigmoid")
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x²) + eps) * weight`` over the last axis: x (..., D), weight (D,) -> float32 (..., D)."""
    x = np.ascontiguousarray(x, np.float32)
    weight = np.ascontiguousarray(weight, np.float32)
    D = x.shape[-1]
    if weight.shape != (D,) or D == 0:
        raise ValueError(f"rms_norm: weight must be ({D},), got {list(weight.shape)}")
    out = np.empty_like(x)
    if x.size:
        _check(lib.rms_norm(_floats(out, writable=True), _floats(x), _floats(weight), x.size // D, D, eps), "rms_norm")
    return out


def rope_rotate_half(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """``x * cos + rotate_half(x) * sin``: x (T, heads, D), cos / sin (T, D) -> float32 (T, heads, D)."""
    x = np.ascontiguousarray(x, np.float32)
    cos, sin = np.ascontiguousarray(cos, np.float32), np.ascontiguousarray(sin, np.float32)
    T, heads, D = x.shape
    if cos.shape != (T, D) or sin.shape != (T, D) or D % 2:
        raise ValueError(f"rope: x (T, heads, D) with D even and cos, sin (T, D); got {list(x.shape)}, {list(cos.shape)}")
    out = np.empty_like(x)
    if x.size:
        _check(lib.rope_rotate_half(_floats(out, writable=True), _floats(x), _floats(cos), _floats(sin), T, heads, D),
               "rope")
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, scale: float, window: int | None = None,
              sinks: np.ndarray | None = None) -> np.ndarray:
    """Causal GQA attention: q (T, H, D) for rows start..start+T-1 over k, v (S, Hkv, D), the new
    tokens' keys and values included (S >= start + T). k and v float16 (a float16 KV cache) are
    read as they are, each element widened exactly: the bits of passing them as float32. `window`:
    the token of row r sees rows r - window + 1 .. r only (None: all before it); `sinks` (H,): a
    logit per head in its softmax's denominator (GPT-OSS). Returns float32 (T, H * D)."""
    q = np.ascontiguousarray(q, np.float32)
    T, H, D = q.shape
    S, Hkv, Dk = k.shape
    if v.shape != k.shape or Dk != D or H % Hkv or not 0 <= start <= S - T:
        raise ValueError(f"attention: q (T, H, D), k and v (S, Hkv, D) with H a multiple of Hkv and "
                         f"start + T <= S; got q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}, start {start}")
    window = _window(window, "attention")
    sinks = None if sinks is None else _vector(sinks, H, "sinks")
    kv = lib.KV_F16 if k.dtype == v.dtype == np.float16 else lib.KV_F32
    k, v = (np.ascontiguousarray(a, np.float16 if kv == lib.KV_F16 else np.float32) for a in (k, v))
    out = np.empty((T, H * D), np.float32)
    if T:
        _check(lib.attention(_floats(out, writable=True), _floats(q), T, H, D, _cache(k), _cache(v), S, Hkv,
                             start, scale, window, ffi.NULL if sinks is None else _floats(sinks), kv), "attention")
    return out


def f16_from_f32(x: np.ndarray) -> np.ndarray:
    """x rounded to float16 as the kernels store a float16 KV cache's rows (nearest, ties to even:
    NumPy's ``astype(np.float16)``). float32 array -> float16 array of its shape."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty(x.shape, np.float16)
    if x.size:
        _check(lib.f16_from_f32(ffi.from_buffer("uint16_t[]", out, require_writable=True), _floats(x), x.size),
               "f16_from_f32")
    return out


class AttnBlock:
    """The pre-norm attention sub-block of one decoder layer as one C call (csrc/colibri.h's
    `attn_block`): rms_norm → q, k, v projections → q/k RMSNorm (`qk_norm` "whole" over each
    projection, "head" per head, None) → clamp to ±`clip` → rotate-half RoPE → the new keys and
    values into the cache → causal attention → output projection + residual. Each step is the C
    function the step-by-step path calls (`rms_norm`, `matmul_multi`, `rope_rotate_half`,
    `attention`, `matmul`), in the same order, so the result is the same bits.

    Options, each off by default: `q_bias`, `k_bias`, `v_bias` (heads·D,), (kv_heads·D,) added to the
    projections and `o_bias` (H,) to the output projection; `sinks` (heads,) a logit per head joining
    its softmax without a value; `window` a sliding window (a token sees its own row and the
    window − 1 before it: its cache may hold only those, `kv.cache.WindowKV`). GPT-OSS uses them all.
    `gated`: wq (and q_bias) give per head [q | gate] (heads·2D rows), and the attention is multiplied
    by `sigmoid(gate)` before the output projection; `rotary_dim`: RoPE on each head's leading
    rotary_dim dims only (cos, sin (T, rotary_dim)). Qwen3.5/3.6 use both.

    Built once per layer (checks the shapes, keeps the C struct); called per forward pass (`seqs`:
    a batch's sequences in one call). Its weights stay readable as attributes (norm, wq, wk, wv, wo,
    q_norm, k_norm, biases, sinks, window).
    """

    def __init__(self, norm: np.ndarray, wq: QTensor, wk: QTensor, wv: QTensor, wo: QTensor, *, heads: int,
                 kv_heads: int, head_dim: int, eps: float, scale: float, qk_norm: str | None = None,
                 q_norm: np.ndarray | None = None, k_norm: np.ndarray | None = None, clip: float | None = None,
                 q_bias: np.ndarray | None = None, k_bias: np.ndarray | None = None, v_bias: np.ndarray | None = None,
                 o_bias: np.ndarray | None = None, sinks: np.ndarray | None = None, window: int | None = None,
                 gated: bool = False, rotary_dim: int | None = None):
        hidden, nq, nkv = wq.cols, heads * head_dim, kv_heads * head_dim
        nqg = 2 * nq if gated else nq
        if (wq.rows, wk.rows, wv.rows, wk.cols, wv.cols, wo.rows, wo.cols) != (nqg, nkv, nkv, hidden, hidden, hidden, nq):
            raise ValueError(f"attn_block: projections must be q [{nqg}, H], k, v [{nkv}, H], o [H, {nq}]; got q "
                             f"[{wq.rows}, {wq.cols}], k [{wk.rows}, {wk.cols}], v [{wv.rows}, {wv.cols}], o [{wo.rows}, {wo.cols}]")
        if qk_norm not in (None, "whole", "head") or (gated and qk_norm == "whole"):
            raise ValueError(f"attn_block: qk_norm must be None, 'whole' (not gated) or 'head', got {qk_norm!r}")
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if heads % kv_heads or head_dim % 2 or not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ValueError(f"attn_block: {heads} heads over {kv_heads} kv heads of {head_dim} (even) floats, "
                             f"{rotary_dim} (even) of them rotated")
        self.hidden, self.kv_heads, self.head_dim, self.rotary_dim, self.gated = hidden, kv_heads, head_dim, rotary_dim, gated
        widths = {None: (0, 0), "whole": (nq, nkv), "head": (head_dim, head_dim)}[qk_norm]
        arrays = [_vector(norm, hidden, "norm")]
        if qk_norm is not None:
            arrays += [_vector(q_norm, widths[0], "q_norm"), _vector(k_norm, widths[1], "k_norm")]
        b = ffi.new("AttnBlock *")
        b.norm = ffi.from_buffer("float[]", arrays[0])
        b.wq, b.wk, b.wv, b.wo = (_qmatrix(w, name) for w, name in ((wq, "wq"), (wk, "wk"), (wv, "wv"), (wo, "wo")))
        b.qk_norm = {None: 0, "whole": lib.QK_NORM_WHOLE, "head": lib.QK_NORM_HEAD}[qk_norm]
        if qk_norm is not None:
            b.q_norm, b.k_norm = (ffi.from_buffer("float[]", a) for a in arrays[1:])
        b.clip = math.inf if clip is None else float(clip)
        b.heads, b.kv_heads, b.head_dim, b.eps, b.scale = heads, kv_heads, head_dim, eps, scale
        options = {name: None if a is None else _vector(a, n, name) for name, a, n in (
            ("q_bias", q_bias, nqg), ("k_bias", k_bias, nkv), ("v_bias", v_bias, nkv), ("o_bias", o_bias, hidden),
            ("sinks", sinks, heads))}
        for field, name in (("bq", "q_bias"), ("bk", "k_bias"), ("bv", "v_bias"), ("bo", "o_bias"), ("sinks", "sinks")):
            if options[name] is not None:
                setattr(b, field, ffi.from_buffer("float[]", options[name]))
        b.window = self.window = _window(window, "attn_block")
        b.gated, b.rotary_dim = int(gated), rotary_dim
        self.biases = tuple(options[n] for n in ("q_bias", "k_bias", "v_bias", "o_bias"))  # (q, k, v, o), None: none
        self.sinks = options["sinks"]
        self._c = b  # points into the arrays here, kept here
        self.act = weights_act((wq, wk, wv, wo))  # the arithmetic a call uses by default
        self.norm, self.wq, self.wk, self.wv, self.wo = arrays[0], wq, wk, wv, wo
        self.q_norm, self.k_norm = (arrays[1], arrays[2]) if qk_norm is not None else (None, None)

    def __call__(self, h: np.ndarray, cos: np.ndarray, sin: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                 start: int, act: str | None = None) -> np.ndarray:
        """h (T, H) → h + attention (T, H) for positions start .. start+T-1; cos, sin (T, rotary_dim);
        k_cache, v_cache (capacity, kv_heads, head_dim), both float32 or both float16 (rows stored
        rounded to nearest, `f16_from_f32`), capacity >= start + T: rows start .. start+T-1 are
        written, rows 0 .. start-1 are the cached tokens."""
        return self.seqs(h, [len(h)], cos, sin, [(k_cache, v_cache, start)], act)

    def seqs(self, h: np.ndarray, lengths: list[int], cos: np.ndarray, sin: np.ndarray, caches: list[tuple],
             act: str | None = None) -> np.ndarray:
        """The block for several sequences in one call (a batch's generations): h (T, H) their rows
        stacked, `lengths` each one's rows, cos, sin (T, rotary_dim) stacked likewise, `caches` each
        one's (k_cache, v_cache, start) as `__call__` takes them → (T, H), each sequence's rows the
        bits of its own call (the products read the weights once for all)."""
        h = _activations(h, self.hidden, "attn_block: h")
        out = np.empty_like(h)
        if len(h):
            args, kv = self.c_args(lengths, cos, sin, caches)
            _check(lib.attn_block(_floats(out, writable=True), _floats(h), len(lengths), args[0], self._c, *args[1:],
                                  _act_code(act or self.act), kv), "attn_block")
        return out

    def c_args(self, lengths: list[int], cos, sin, caches: list[tuple]) -> tuple:
        """A call's (seq_T, cos, sin, k_caches, v_caches, starts) as C takes them and the caches' kv
        code, checked: `lengths` each sequence's rows, `caches` each one's (k_cache, v_cache, start)."""
        T = sum(lengths)
        cos, sin = (np.ascontiguousarray(a, np.float32) for a in (cos, sin))
        if cos.shape != (T, self.rotary_dim) or sin.shape != cos.shape:
            raise ValueError(f"attn_block: cos, sin must be ({T}, {self.rotary_dim}), got {list(cos.shape)}, {list(sin.shape)}")
        if len(caches) != len(lengths) or not lengths or min(lengths) < 0:
            raise ValueError(f"attn_block: one (k_cache, v_cache, start) per sequence, got {len(caches)} for {len(lengths)}")
        shape, dtype = (self.kv_heads, self.head_dim), caches[0][0].dtype
        for (k_cache, v_cache, start), n in zip(caches, lengths):
            for a in (k_cache, v_cache):
                if (a.dtype != dtype or a.dtype not in (np.float32, np.float16) or a.shape[1:] != shape
                        or not a.flags.c_contiguous or start < 0 or a.shape[0] < start + n):
                    raise ValueError(f"attn_block: caches must be C-contiguous, all float32 or all float16, (>= {start + n}, "
                                     f"{shape[0]}, {shape[1]}); got {a.dtype} {list(a.shape)}")
        kv = lib.KV_F16 if dtype == np.float16 else lib.KV_F32
        return (ffi.new("int[]", lengths), _floats(cos), _floats(sin),
                ffi.new("void *[]", [_cache(k, writable=True) for k, _, _ in caches]),
                ffi.new("void *[]", [_cache(v, writable=True) for _, v, _ in caches]),
                ffi.new("int[]", [start for _, _, start in caches])), kv


# ----------------------------------------------------------------------------
# Argument checks and conversion to C


def _window(window, kernel: str) -> int:
    """A sliding window as C takes it (0: none), checked."""
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or not 0 < window <= _INT_MAX:
        raise ValueError(f"{kernel}: window must be a positive int or None, got {window!r}")
    return int(window)


def _vector(a, n: int, name: str) -> np.ndarray:
    a = np.ascontiguousarray(a, np.float32)
    if a.shape != (n,):
        raise ValueError(f"attn_block: {name} must be ({n},), got {list(a.shape)}")
    return a


def _biases(biases: list, inters: list[int], hidden: int, keep: list):
    """A C ``float *[3 * len(biases)]`` of the experts' (gate_bias (I,), up_bias (I,), down_bias
    (hidden,)) float32 vectors, I each expert's width in `inters`, NULL where an expert or one of its
    vectors is None; the arrays are kept alive in `keep`. NULL for no bias at all."""
    if all(b is None for b in biases):
        return ffi.NULL
    ptrs = []
    for b, inter in zip(biases, inters):
        if b is not None and len(b) != 3:
            raise ValueError(f"expert biases are (gate_bias, up_bias, down_bias), got {len(b)} arrays")
        for name, a, n in zip(("gate_bias", "up_bias", "down_bias"), b or (None,) * 3, (inter, inter, hidden)):
            if a is None:
                ptrs.append(ffi.NULL)
                continue
            a = np.ascontiguousarray(a, np.float32)
            if a.shape != (n,):
                raise ValueError(f"expert {name} must be ({n},), got {list(a.shape)}")
            ptrs.append(ffi.from_buffer("float[]", a) if n else ffi.NULL)
            keep += (a, ptrs[-1])
    c = ffi.new("float *[]", ptrs)
    keep.append(c)
    return c


def _check_expert(gate: QTensor, up: QTensor, down: QTensor, hidden: int | None = None) -> None:
    if not gate.kind == up.kind == down.kind:
        raise ValueError(
            f"expert_ffn: gate, up and down must have one kind, got {gate.kind}, {up.kind}, {down.kind}"
        )
    inter, h = gate.rows, gate.cols if hidden is None else hidden
    if (gate.cols, up.rows, up.cols) != (h, inter, h) or (down.rows, down.cols) != (h, inter):
        raise ValueError(
            f"expert_ffn: expected gate, up [I, H] and down [H, I] with H = {h}; got gate [{gate.rows}, {gate.cols}], "
            f"up [{up.rows}, {up.cols}], down [{down.rows}, {down.cols}]"
        )


def _qmatrix(t: QTensor, name: str):
    """A C ``QMatrix *`` viewing `t`'s arrays (no copy), after checking them against quant.layout.

    Built once per tensor and kept on it (with the buffers that keep its arrays alive), so a weight
    used every token costs one attribute lookup here, not a check and a conversion.
    """
    c = getattr(t, "__dict__", {}).get("_coli_qmatrix")
    if c is not None:
        return c[0]
    kind = getattr(t, "kind", None)
    if kind not in _KIND_CODES:
        raise ValueError(f"{name}: unknown quantisation {kind!r} (expected one of {', '.join(ALL_KINDS)})")
    rows, cols = t.rows, t.cols
    if not (0 <= rows <= _INT_MAX and 0 <= cols <= _INT_MAX):
        raise ValueError(f"{name}: shape [{rows}, {cols}] out of range")
    if kind == "f32" and t.scales is not None:
        raise ValueError(f"{name}: f32 weights have no scales, got an array")
    m = ffi.new("QMatrix *")
    keep = [m]
    m.kind, m.rows, m.cols = _KIND_CODES[kind], rows, cols
    for part, dtype, shape in _layout(kind, rows, cols):
        arr = getattr(t, part)
        if not isinstance(arr, np.ndarray) or arr.dtype != dtype or arr.shape != shape:
            got = f"{arr.dtype} {list(arr.shape)}" if isinstance(arr, np.ndarray) else type(arr).__name__
            raise ValueError(f"{name}: {kind} {part} must be {dtype} {list(shape)}, got {got}")
        flags = arr.flags
        if not (flags.c_contiguous and flags.aligned):
            raise ValueError(f"{name}: {kind} {part} must be C-contiguous and aligned (weights are never copied)")
        buf = ffi.from_buffer(arr if arr.size else np.zeros(1, dtype))  # read-only is fine: C only reads
        keep.append(buf)
        setattr(m, part, buf)
    if hasattr(t, "__dict__"):
        object.__setattr__(t, "_coli_qmatrix", (m, keep))  # QTensor is frozen; this is a cache only
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
    if a.size == 0:
        return ffi.NULL
    return ffi.from_buffer("float[]", a, require_writable=writable)


def _cache(a: np.ndarray, writable: bool = False):
    """A KV cache array (float32 or float16) for C."""
    return ffi.from_buffer("float[]" if a.dtype == np.float32 else "uint16_t[]", a, require_writable=writable)


def _check(status: int, kernel: str) -> None:
    if status == lib.COLI_ENOMEM:
        raise MemoryError(f"{kernel}: out of memory for the scratch buffer")
    if status != lib.COLI_OK:
        raise ValueError(f"{kernel}: the C kernel rejected its arguments (status {status})")
