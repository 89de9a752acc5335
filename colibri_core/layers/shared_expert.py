"""The shared expert: a resident SwiGLU MLP every token goes through, beside the routed experts,
optionally scaled by a per-token sigmoid gate (Qwen2-MoE, Qwen3.5/3.6).

    out = sigmoid(expert_gate · x) · down( silu(gate x) · (up x) )
"""
from __future__ import annotations

import numpy as np

from ..model import linear
from .gated_attention import sigmoid
from .mlp import swiglu_mlp

__all__ = ["shared_expert"]


def shared_expert(x: np.ndarray, gate, up, down, expert_gate=None) -> np.ndarray:
    """x (T, H) → (T, H). gate, up (I, H) and down (H, I): QTensors or float32 arrays;
    expert_gate (1, H) float32, or None for an ungated shared expert."""
    out = swiglu_mlp(x, gate, up, down)  # (T, H)
    if expert_gate is None:
        return out
    return sigmoid(linear(x, expert_gate)) * out  # (T, 1) * (T, H)
