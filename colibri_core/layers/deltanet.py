"""Gated DeltaNet (linear attention with a fixed-size recurrent state), as in Qwen3-Next and
Qwen3.5/3.6. A layer runs as one C call (`kernels.deltanet.DeltaNetBlock`: the projections, causal
conv1d with its rolling state, the decay and β, l2-normalised q/k, the gated delta rule — recurrent
for a few tokens, chunked for a prompt — the gated norm and out_proj):

    [q | k | v] = SiLU(causal_conv1d(in_proj_qkv x))     q, k: (T, Hk, dk); v: (T, Hv, dv)
    β = sigmoid(in_proj_b x)                              (T, Hv)
    g = −exp(A_log) · softplus(in_proj_a x + dt_bias)     (T, Hv), log decay ≤ 0
    o = gated_delta_rule(q, k, v, g, β)                   (T, Hv, dv)
    out = out_proj( RMSNormGated(o, z = in_proj_z x) )    (T, H)

Its state is fixed-size whatever the context length: the last K−1 conv inputs and, per value head,
a [dk, dv] matrix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

import numpy as np

from .. import batch
from ..kernels import deltanet as kernels

__all__ = ["DeltaNetDims", "DeltaNetState", "GatedDeltaNet"]


@dataclass(frozen=True)
class DeltaNetDims:
    key_heads: int  # Hk
    value_heads: int  # Hv, a multiple of Hk: each k head serves Hv/Hk consecutive value heads
    key_dim: int  # dk, per head
    value_dim: int  # dv, per head
    conv_kernel: int  # K

    @property
    def conv_channels(self) -> int:
        """Width of the packed [q | k | v] the conv runs over."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @property
    def state_floats(self) -> int:
        """Floats of one layer's state: conv (K−1, channels) + recurrent (Hv, dk, dv)."""
        return (self.conv_kernel - 1) * self.conv_channels + self.value_heads * self.key_dim * self.value_dim


@dataclass
class DeltaNetState:
    """One Gated DeltaNet layer's state, float32, updated in place. A fixed-size part of a
    `kv.SequenceState`: arrays "PART.conv", "PART.recurrent" (copies)."""

    per_token: ClassVar[bool] = False
    varying: ClassVar[dict] = {}  # both arrays keep their shape
    dims: DeltaNetDims
    conv: np.ndarray = field(init=False)  # (K−1, channels): the last K−1 conv inputs, oldest first
    recurrent: np.ndarray = field(init=False)  # (Hv, dk, dv)

    def __post_init__(self):
        d = self.dims
        self.conv = np.zeros((d.conv_kernel - 1, d.conv_channels), np.float32)
        self.recurrent = np.zeros((d.value_heads, d.key_dim, d.value_dim), np.float32)

    def arrays(self) -> dict[str, np.ndarray]:
        return {"conv": self.conv.copy(), "recurrent": self.recurrent.copy()}

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        self.conv[...] = arrays["conv"]
        self.recurrent[...] = arrays["recurrent"]

    def empty(self) -> DeltaNetState:
        return DeltaNetState(self.dims)


@dataclass
class GatedDeltaNet:
    """One Gated DeltaNet layer's weights (matrices are QTensors or float32 arrays)."""

    dims: DeltaNetDims
    in_proj_qkv: Any  # (channels, H)
    in_proj_z: Any  # (Hv * dv, H)
    in_proj_b: Any  # (Hv, H)
    in_proj_a: Any  # (Hv, H)
    conv_weight: np.ndarray  # (channels, K) float32
    A_log: np.ndarray  # (Hv,)
    dt_bias: np.ndarray  # (Hv,)
    norm: np.ndarray  # (dv,) RMSNormGated weight (plain, not zero-centred)
    out_proj: Any  # (H, Hv * dv)
    eps: float

    @cached_property
    def block(self) -> kernels.DeltaNetBlock:
        """The layer as one C call, built on first use (its weights and −exp(A_log) kept there)."""
        d = self.dims
        return kernels.DeltaNetBlock(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a, self.conv_weight,
                                     -np.exp(np.asarray(self.A_log, np.float32)), self.dt_bias, self.norm, self.out_proj,
                                     key_heads=d.key_heads, value_heads=d.value_heads, key_dim=d.key_dim,
                                     value_dim=d.value_dim, eps=self.eps)

    def __call__(self, x: np.ndarray, state: DeltaNetState) -> np.ndarray:
        """x (T, H) normalised hidden states → (T, H); `state` advances by T tokens. In a batch, one C
        call for every generation's rows (the projections' weights read once, each its own state)."""
        return batch.together(("deltanet", id(self)), (x, state), self._seqs)

    def _seqs(self, parts: list[tuple]) -> list[np.ndarray]:
        lengths = [len(p[0]) for p in parts]
        out = self.block.seqs(batch.stack([p[0] for p in parts]), lengths, [(p[1].conv, p[1].recurrent) for p in parts])
        return batch.cut(out, lengths)
