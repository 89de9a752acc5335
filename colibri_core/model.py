"""The base every architecture's model class builds on, and the resident-weight helpers.

An architecture's ``model.py`` subclasses `MoEModel`: it parses ``config.json`` into its config
dataclass, describes its container layout, takes its resident tensors from `Weights` by name
(anything left untaken, or taken but absent, is an error) and runs its layer graph in `forward`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from . import kernels
from .errors import ColibriError
from .kv import State
from .layout import ContainerLayout
from .quant import QTensor, dequantize

__all__ = ["MoEModel", "Weights", "linear", "linears", "embed", "dense"]

if TYPE_CHECKING:
    from .layers.router import Router


class Weights:
    """Resident tensors by checkpoint name; tracks which ones the model took."""

    def __init__(self, tensors: dict[str, Any], where: str):
        self.tensors = tensors
        self.where = where
        self.taken: set[str] = set()

    def __call__(self, name: str):
        """The tensor `name`: a QTensor for a matrix, a float32 ndarray otherwise."""
        if name not in self.tensors:
            raise ColibriError(f"{self.where}: the container lacks tensor {name}")
        self.taken.add(name)
        return self.tensors[name]

    def check_all_taken(self) -> None:
        left = sorted(set(self.tensors) - self.taken)
        if left:
            raise ColibriError(f"{self.where}: the model does not use tensor {left[0]} ({len(left)} unused)")


def linear(x: np.ndarray, w) -> np.ndarray:
    """x (T, in) @ wᵀ → (T, out); `w` a QTensor (C kernel) or a float32 ndarray kept unquantised."""
    if isinstance(w, QTensor):
        return kernels.matmul(w, x)
    return x @ w.T


def linears(x: np.ndarray, ws) -> list[np.ndarray]:
    """``[linear(x, w) for w in ws]``; quantised weights of one width go in one C call (same bits)."""
    if all(isinstance(w, QTensor) for w in ws) and len({w.cols for w in ws}) == 1:
        return kernels.matmul_multi(list(ws), x)
    return [linear(x, w) for w in ws]


def dense(w) -> np.ndarray:
    """A resident tensor as a float32 ndarray: a QTensor dequantised (a 2-D tensor kept f32 arrives as
    a QTensor of kind f32, e.g. a position bias or a hash table), an array as it is."""
    return dequantize(w) if isinstance(w, QTensor) else np.asarray(w, np.float32)


def embed(ids: np.ndarray, table) -> np.ndarray:
    """Rows `ids` (T,) of an embedding table (QTensor or ndarray (V, H)) as float32 (T, H)."""
    if not isinstance(table, QTensor):
        return np.asarray(table[ids], np.float32)
    rows = QTensor(table.kind, len(ids), table.cols, table.data[ids],
                   None if table.scales is None else table.scales[ids])
    return dequantize(rows)


class MoEModel:
    """One architecture's forward pass over resident weights and the expert store: the model half of
    the plugin contract (docs/plugins.md). The core calls exactly the methods below.

    From the config alone (classmethods: `convert` and `plan` call them before any weight exists):
      parse_config(config)            config.json (dict) → the architecture's config dataclass
      layout(cfg)                     the container layout: resident tensors, routed experts, top-k
      resident_shapes(cfg)            every resident tensor's shape, by checkpoint name
      state_floats_per_token(cfg)     per layer, the state floats each token adds
      kept_apart_floats_per_token(cfg)  optional: growing state kept beside the layers' (DSA indexer keys)
      kv_cache_floats_per_token(cfg)  optional: the part of the layers' state held in `KVCache`s
      fixed_state_floats(cfg)         optional: state that does not grow (recurrent + conv states)
    With the weights (the engine builds the model once per load):
      __init__(cfg, weights, store)   take every resident tensor from `weights`; keep `store` for `moe`
      routers()                       per MoE layer, its declared `Router` (run by the core, lookahead too)
      lookahead()                     optional: which MoE layer each layer's lookahead predicts
      new_state()                     a fresh per-sequence `colibri_core.kv.State`
      forward(ids, state, last_only)  logits of new tokens; MoE layers call `self.moe(...)`; after each
                                      decoder layer ``probe.record(i, l_out=h)`` (the residual stream:
                                      free unless someone records; lets the conformance kit name the
                                      layer where a plugin leaves transformers)
    """

    @classmethod
    def parse_config(cls, config: dict) -> Any:
        """config.json (a dict) → this architecture's config dataclass."""
        raise NotImplementedError

    @classmethod
    def layout(cls, cfg) -> ContainerLayout:
        """Which checkpoint tensors are resident, which are routed experts, which stay f32; top-k."""
        raise NotImplementedError

    @classmethod
    def resident_shapes(cls, cfg) -> dict[str, tuple[int, ...]]:
        """Every resident tensor's shape by checkpoint name, from the config alone (for `plan`:
        sized with the layout's quantisation rules, before any weight is read)."""
        raise NotImplementedError

    @classmethod
    def state_floats_per_token(cls, cfg) -> list[int]:
        """Per layer, the floats its state grows by per token (K + V for GQA; 576 for GLM-5.2's MLA
        latent + rope key; 0 for a fixed-size recurrent state)."""
        raise NotImplementedError

    @classmethod
    def kept_apart_floats_per_token(cls, cfg) -> dict[str, list[int]]:
        """Growing state kept beside the layers' own, by name, per layer in floats per token (GLM-5.2:
        {"indexer_keys": [128, 0, …]}). Default: none."""
        return {}

    @classmethod
    def kv_cache_floats_per_token(cls, cfg) -> list[int]:
        """Per layer, the part of `state_floats_per_token` held in `kv.cache.KVCache`s, which store
        the engine's KV cache type (`load(kv_cache="f16")`: 2 bytes a float); the rest stays float32.
        Default: none (a model whose caches are `Rows` or states of its own)."""
        return [0] * len(cls.state_floats_per_token(cfg))

    @classmethod
    def fixed_state_floats(cls, cfg) -> int:
        """State floats that do not grow with the context (Gated DeltaNet: conv + recurrent state of
        every linear-attention layer). Default: 0."""
        return 0

    def __init__(self, cfg, weights: Weights, store):
        self.cfg = cfg
        self.store = store
        self._moe = None  # layers.moe.MoE over `routers()`, built on the first MoE layer run

    def routers(self) -> dict[int, Router]:
        """Every MoE layer's router ({absolute layer index: Router}), exactly the layout's
        `moe_layers`, in the order the forward pass runs them."""
        raise NotImplementedError

    def lookahead(self) -> dict[int, int] | None:
        """{MoE layer: the MoE layer whose experts its lookahead predicts}. Default (None): each
        router's successor in `routers()`. Override to leave out a layer the forward pass does not
        run next (GLM-5.2's MTP layer)."""
        return None

    def new_state(self) -> State:
        """Fresh per-sequence state (KV caches, …): a `colibri_core.kv.State`."""
        raise NotImplementedError

    def forward(self, ids: np.ndarray, state, last_only: bool = False) -> np.ndarray:
        """Run new tokens `ids` (T,) after the `state.length` tokens already in `state`.

        Returns logits float32 (T, vocab), or (1, vocab) for the last token when `last_only`.
        """
        raise NotImplementedError

    def moe(self, layer: int, x: np.ndarray, residual: np.ndarray, token_ids: np.ndarray,
            expert_input: np.ndarray | None = None, shared=None) -> np.ndarray:
        """The core's MoE block for MoE layer `layer` (`colibri_core.layers.moe.MoE`): routes x (T, H)
        with the layer's declared router, starts the lookahead for the next MoE layer from
        `residual` (T, H) (the residual stream x was normalised from), runs the routed experts
        on `expert_input` (default x) → (T, H), plus `shared(x)` given a shared expert
        (`layers.shared_expert.SharedExpert`, run in the same C call where it can). Call it from
        `forward`; never override it."""
        if self._moe is None:
            from .layers.moe import MoE  # the layers import this module's helpers

            layout = self.layout(self.cfg)
            self._moe = MoE(self.store, self.routers(), self.lookahead(), layout.swiglu_limit, layout.expert_activation)
        return self._moe(layer, x, residual, token_ids, expert_input, shared)
