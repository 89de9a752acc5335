"""Binding of the whole-decoder-layer call (csrc/decoder.c): one pre-norm MoE layer of the core's
blocks, from the residual stream in to the residual stream out, in one crossing into C.

    layer = decoder.MoELayer(mixer, post_norm, eps, router, k, renormalize, ...)   # once per layer
    out, weights, ids = layer(h, table, [T], cos=cos, sin=sin, caches=[(k, v, start)])   # attention
    out, weights, ids = layer(h, table, [T], states=[(conv, recurrent)])                 # Gated DeltaNet

Several sequences (a batch's generations) go in one call, their rows stacked: lengths [T1, T2, …]
and a cache (or states) each.

`colibri_core.layers.decoder` decides when a layer may take it (and counts its routing after).
"""
from __future__ import annotations

import numpy as np

from colibri_core.kernels import (AttnBlock, ExpertTable, _act_code, _activations, _check, _floats, _math, _qmatrix,
                                  _vector)
from colibri_core.kernels._colibri_kernels import ffi, lib
from colibri_core.kernels.deltanet import DeltaNetBlock
from colibri_core.quant import QTensor


class MoELayer:
    """A pre-norm MoE decoder layer as one C call (csrc/decoder.h's `moe_layer`):

        h1 = mixer(h)   an `AttnBlock` (its own input norm and residual), or
                        h + `DeltaNetBlock`(rms_norm(h, input_norm))
        x = rms_norm(h1, post_norm)
        out = h1 + Σ_rank weight · expert(x) + sigmoid(x · shared_gateᵀ) · shared(x)

    with the softmax router (`router` (E, H), top `k`, `renormalize`) and the experts of the
    call's `ExpertTable` (the shared expert, a table of one, as one more rank; `shared_gate` (1, H)
    or None) — each step the C function the step-by-step path calls, in the same order, so the same
    bits. `glu`, `limit`, `alpha`: the experts' gated unit (`moe_block`'s). Built once per layer
    (checks the shapes, keeps the C struct); called per forward pass."""

    def __init__(self, mixer: AttnBlock | DeltaNetBlock, post_norm: np.ndarray, eps: float, router: QTensor, k: int,
                 renormalize: bool, *, input_norm: np.ndarray | None = None, shared: ExpertTable | None = None,
                 shared_gate: QTensor | None = None, glu: str = "swiglu", limit: float | None = None,
                 alpha: float | None = None):
        hidden = router.cols
        if isinstance(mixer, DeltaNetBlock) != (input_norm is not None) or not isinstance(mixer, (AttnBlock, DeltaNetBlock)):
            raise ValueError("moe_layer: the mixer is an AttnBlock, or a DeltaNetBlock with its input_norm")
        if mixer.hidden != hidden or not 1 <= k <= router.rows:
            raise ValueError(f"moe_layer: the mixer's width {mixer.hidden}, the router's [{router.rows}, {hidden}] "
                             f"and k {k} do not fit")
        if shared is not None and (shared.n != 1 or shared.hidden != hidden):
            raise ValueError(f"moe_layer: shared must be a table of one expert of width {hidden}")
        if shared_gate is not None and (shared is None or (shared_gate.rows, shared_gate.cols) != (1, hidden)):
            raise ValueError(f"moe_layer: shared_gate must be [1, {hidden}], with a shared expert")
        norms = [_vector(post_norm, hidden, "post_norm")]
        if input_norm is not None:
            norms.append(_vector(input_norm, hidden, "input_norm"))
        c = ffi.new("MoELayer *")
        if isinstance(mixer, AttnBlock):
            c.attn = mixer._c
        else:
            c.deltanet, c.input_norm = mixer._c, ffi.from_buffer("float[]", norms[1])
        c.mixer_act = _act_code(mixer.act)
        c.post_norm, c.eps = ffi.from_buffer("float[]", norms[0]), eps
        c.router, c.k, c.renormalize = _qmatrix(router, "router"), k, int(renormalize)
        if shared is not None:
            c.shared = shared._c
        if shared_gate is not None:
            c.shared_gate, c.gate_act = _qmatrix(shared_gate, "shared_gate"), _act_code(None, [shared_gate])
        c.math = _math(glu, limit, alpha)
        self.mixer, self.shared, self.hidden, self.k, self.n_experts = mixer, shared, hidden, k, router.rows
        self._c, self._keep = c, (norms, router, shared_gate)  # the struct points into these (and mixer, shared)
        self._seconds = ffi.new("double[2]")

    def __call__(self, h: np.ndarray, table: ExpertTable, lengths: list[int], *, cos=None, sin=None, caches=None,
                 states=None, act: str | None = None):
        """h (T, H), the rows of len(`lengths`) sequences stacked (a batch's generations; each gets
        the bits it gets alone) → out (T, H), weights float32 (T, k), ids int64 (T, k) (the routing,
        best first). An attention mixer takes cos, sin (T, rotary_dim) and `caches`, each sequence's
        (k_cache, v_cache, start) (`AttnBlock.seqs`); a DeltaNet one `states`, each sequence's
        (conv_state, state), advanced in place. `act` the experts' arithmetic (None: the table's)."""
        h = _activations(h, self.hidden, "moe_layer: h")
        T, k = h.shape[0], self.k
        if table.n != self.n_experts or table.hidden != self.hidden or table._bias != ffi.NULL:
            raise ValueError(f"moe_layer: the table must hold {self.n_experts} experts of width {self.hidden}, no biases")
        if sum(lengths) != T:
            raise ValueError(f"moe_layer: the sequences' lengths {lengths} do not add up to h's {T} rows")
        out, weights, ids = np.empty_like(h), np.empty((T, k), np.float32), np.empty((T, k), np.int64)
        if not T:
            return out, weights, ids
        null = ffi.NULL
        if isinstance(self.mixer, AttnBlock):
            (seq_T, cos, sin, kc, vc, starts), kv = self.mixer.c_args(lengths, cos, sin, caches)
            conv = rec = null
        else:
            seq_T, conv, rec = self.mixer.c_args(lengths, states)
            cos = sin = kc = vc = starts = null
            kv = lib.KV_F32
        _check(lib.moe_layer(_floats(out, writable=True), ffi.from_buffer("int64_t[]", ids, require_writable=True),
                             _floats(weights, writable=True), _floats(h), len(lengths), seq_T, self._c, table._c, table.n,
                             cos, sin, kc, vc, starts, kv, conv, rec, _act_code(act or table.act), self._seconds),
               "moe_layer")
        return out, weights, ids

    def seconds(self) -> tuple[float, float]:
        """The seconds spent so far in the mixer and in the MoE sub-block, and start again from 0."""
        mixer, moe = self._seconds[0], self._seconds[1]
        self._seconds[0] = self._seconds[1] = 0.0
        return mixer, moe
