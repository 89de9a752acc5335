"""SiTU-GLU, Kimi K3's gated linear unit: a SwiGLU whose linear gate factor and up projection are
soft-capped (tanh), the sigmoid seeing the raw gate (transformers' `Inkling2SoftcappedSwiGLU` with
caps 4 and 25 is the same function):

    situ(g, u) = 4·tanh(g/4) · σ(g) · 25·tanh(u/25)
    out = down( situ(gate x, up x) )

Used by K3's routed experts (through the core's MoE block, `ContainerLayout.expert_activation`
"situ"), its shared experts and its dense layer.
"""
from __future__ import annotations

import numpy as np

from .. import kernels
from ..quant import QTensor
from .linear import linear

__all__ = ["GATE_CAP", "UP_CAP", "situ", "situ_mlp"]

GATE_CAP = 4.0  # soft cap of the gate's linear factor
UP_CAP = 25.0  # soft cap of the up projection


def situ(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """4·tanh(g/4)·σ(g) · 25·tanh(u/25), float32, elementwise."""
    g, u = gate.astype(np.float32, copy=False), up.astype(np.float32, copy=False)
    with np.errstate(over="ignore"):  # exp overflowing to inf gives σ = 0, as it should
        sig = np.float32(1) / (np.float32(1) + np.exp(-g))
    capped_g = np.tanh(g / np.float32(GATE_CAP)) * np.float32(GATE_CAP)
    capped_u = np.tanh(u / np.float32(UP_CAP)) * np.float32(UP_CAP)
    return (capped_g * sig * capped_u).astype(np.float32)


def situ_mlp(x: np.ndarray, gate, up, down) -> np.ndarray:
    """x (T, H) → (T, H). gate, up (I, H) and down (H, I): QTensors or float32 arrays. Quantised
    weights of one kind run as one fused C call, the routed experts' kernel (`kernels.expert_ffn`)."""
    if all(isinstance(w, QTensor) for w in (gate, up, down)) and gate.kind == up.kind == down.kind:
        return kernels.expert_ffn(gate, up, down, np.ascontiguousarray(x, np.float32), glu="situ")
    return linear(situ(linear(x, gate), linear(x, up)), down)
