"""The shared expert: a resident MLP every token goes through beside the routed experts, with the
routed experts' gated unit (SwiGLU, clamped at `limit` if given, or Kimi K3's SiTU-GLU), optionally
scaled by a per-token sigmoid gate (Qwen2-MoE, Qwen3.5/3.6):

    out = sigmoid(expert_gate · x) · down( silu(gate x) · (up x) )

A plugin builds one per MoE layer and hands it to the core's MoE block (`self.moe(..., shared=...)`),
which runs it in the same C call as the routed experts when the layer holds all of them — one more
rank after the routed ones — with the bits of ``moe(...) + shared(x)``.
"""
from __future__ import annotations

import numpy as np

from .. import kernels
from ..quant import QTensor
from .linear import linear
from .mlp import swiglu_mlp
from .situ import situ_mlp

__all__ = ["SharedExpert"]


class SharedExpert:
    """gate, up (I, H) and down (H, I): QTensors or float32 arrays; expert_gate (1, H) float32, or
    None for an ungated shared expert; `limit` the SwiGLU clamp (None: none); `glu` "swiglu" or
    "situ" (Kimi K3)."""

    def __init__(self, gate, up, down, expert_gate=None, limit: float | None = None, glu: str = "swiglu"):
        if glu not in ("swiglu", "situ"):
            raise ValueError(f"SharedExpert: glu must be 'swiglu' or 'situ', got {glu!r}")
        self.gate, self.up, self.down, self.expert_gate = gate, up, down, expert_gate
        self.limit, self.glu = limit, glu
        fused = all(isinstance(w, QTensor) for w in (gate, up, down)) and gate.kind == up.kind == down.kind
        self.table = kernels.ExpertTable([(gate, up, down)]) if fused else None  # for kernels.moe_block

    def scale(self, x: np.ndarray) -> np.ndarray | None:
        """Each token's weight (T,) float32: sigmoid(expert_gate · x); None (1) when ungated."""
        if self.expert_gate is None:
            return None
        return kernels.sigmoid(linear(x, self.expert_gate))[:, 0]  # the kernels' exp: the fused layer's bits

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x (T, H) → (T, H), on its own (the MoE block's fused call gives the same bits)."""
        if self.glu == "situ":
            out = situ_mlp(x, self.gate, self.up, self.down)
        else:
            out = swiglu_mlp(x, self.gate, self.up, self.down, limit=self.limit)
        scale = self.scale(x)
        return out if scale is None else scale[:, None] * out  # (T, 1) * (T, H)
