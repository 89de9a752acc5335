"""A pre-norm MoE decoder layer built from the core's blocks, which the core runs as one C call
where it can (a plugin gets that without writing C):

    h = mixer(h)                  an `AttnBlock` (layers.attention.gqa_block: input norm, attention,
                                  + h), or h + GatedDeltaNet(rms_norm(h, input_norm))
    h = h + moe(rms_norm(h, post_norm))      the core's MoE block, with the `shared` expert if any

A plugin builds one `MoEDecoderLayer` per layer and calls ``h = self.decoder_layer(i, L, h, state,
ids, cos, sin)`` from its `forward` (`MoEModel.decoder_layer`). When no recorder listens, the
layer's MoE block is the core's softmax-routed one and the layer and those its lookahead guesses
hold all their experts (a resident model), the whole layer is one C call (`kernels.decoder.MoELayer`;
`MoE.layer_table` decides, `MoE.whole_layer` runs it and counts the routing), in a batch one for all
its generations' rows. Otherwise `steps` runs the blocks one by one — the same C functions in the
same order, so the same bits (tested), each block shared with a batch's other generations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..kernels import AttnBlock
from .attention import gqa_block
from .deltanet import GatedDeltaNet
from .norm import rms_norm
from .shared_expert import SharedExpert

__all__ = ["MoEDecoderLayer"]


@dataclass
class MoEDecoderLayer:
    """One decoder layer's core blocks. Norm weights are as `rms_norm` applies them (a zero-centred
    norm's ``np.float32(1) + w``: the bits `rms_norm_zero_centred` computes)."""

    mixer: AttnBlock | GatedDeltaNet  # the token mixer
    post_norm: np.ndarray  # (H,) the MoE sub-block's RMSNorm weight
    eps: float  # both norms'
    input_norm: np.ndarray | None = None  # (H,) a GatedDeltaNet's input RMSNorm weight (an AttnBlock has its own)
    shared: SharedExpert | None = None  # the shared expert beside the routed ones

    def __post_init__(self):
        if isinstance(self.mixer, GatedDeltaNet) != (self.input_norm is not None):
            raise ValueError("MoEDecoderLayer: a GatedDeltaNet mixer takes an input_norm, an AttnBlock none")
        if not isinstance(self.mixer, (AttnBlock, GatedDeltaNet)):
            raise ValueError(f"MoEDecoderLayer: the mixer must be an AttnBlock or a GatedDeltaNet, "
                             f"got {type(self.mixer).__name__}")

    def steps(self, moe: Callable[..., np.ndarray], layer: int, h: np.ndarray, state, token_ids: np.ndarray,
              cos: np.ndarray | None, sin: np.ndarray | None) -> np.ndarray:
        """The layer block by block: h (T, H) → (T, H); `moe` the model's MoE block (`MoEModel.moe`),
        `state` the layer's (a KV cache or a DeltaNetState), cos, sin (T, head_dim) for attention."""
        if isinstance(self.mixer, AttnBlock):
            h = gqa_block(self.mixer, h, state, cos, sin)
        else:
            h = h + self.mixer(rms_norm(h, self.input_norm, self.eps), state)
        x = rms_norm(h, self.post_norm, self.eps)
        return h + moe(layer, x, h, token_ids, shared=self.shared)
