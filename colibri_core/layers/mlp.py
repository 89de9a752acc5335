"""The dense SwiGLU MLP: dense layers (GLM-5.2's first layers, DeepSeek's) and shared experts.

    out = down( silu(gate x) · (up x) ),  with a `limit`: down( silu(min(gate x, L)) · clip(up x, ±L) )

Quantised weights of one kind run as one fused C call, the same kernel as a routed expert.
"""
from __future__ import annotations

import numpy as np

from .. import kernels
from ..kernels.reference import silu
from ..quant import QTensor
from .linear import linear

__all__ = ["swiglu_mlp"]


def swiglu_mlp(x: np.ndarray, gate, up, down, limit: float | None = None) -> np.ndarray:
    """x (T, H) → (T, H). gate, up (I, H) and down (H, I): QTensors or float32 arrays; `limit` clamps
    the gate from above and the up projection both ways (DeepSeek V4's swiglu_limit), None: no clamp."""
    if all(isinstance(w, QTensor) for w in (gate, up, down)) and gate.kind == up.kind == down.kind:
        return kernels.expert_ffn(gate, up, down, np.ascontiguousarray(x, np.float32), limit=limit)
    g, u = linear(x, gate), linear(x, up)
    if limit is not None:
        g, u = np.minimum(g, np.float32(limit)), np.clip(u, np.float32(-limit), np.float32(limit))
    return linear(silu(g) * u, down)
