"""The base every architecture's model class builds on, and the resident-weight helpers (`linear`,
`linears`, `dense`, `embed`: defined with the blocks, in layers/linear.py, and public here).

An architecture's ``model.py`` subclasses `MoEModel`: it parses ``config.json`` into its config
dataclass, describes its container layout, takes its resident tensors from `Weights` by name
(anything left untaken, or taken but absent, is an error) and runs its layer graph in `forward`.
"""
from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import numpy as np

from . import batch
from .errors import ColibriError
from .kv import State
from .layers.decoder import MoEDecoderLayer
from .layers.linear import dense, embed, linear, linears
from .layers.moe import MoE
from .layers.router import Router
from .layout import ContainerLayout
from .tensors import TensorTable

__all__ = ["MoEModel", "MoEDecoderLayer", "Weights", "linear", "linears", "embed", "dense"]


_kept: ContextVar[dict] = ContextVar("colibri_model_kept", default={})  # {(model id, what): array}


def _moe_rows(moe: MoE, layer: int, shared, parts: list[tuple]) -> list[np.ndarray]:
    """`moe` over every generation's rows stacked: x, residual, token_ids (and expert_input) of each
    concatenated, the (T_all, H) result cut back per generation."""
    x, residual, token_ids, *expert_input = (batch.stack(list(column)) for column in zip(*parts))
    out = moe(layer, x, residual, token_ids, *(expert_input or [None]), shared)  # (T_all, H)
    return batch.cut(out, [len(p[0]) for p in parts])


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


class MoEModel:
    """One architecture's forward pass over resident weights and the expert store: the model half of
    the plugin contract (docs/plugins.md). The core calls exactly the methods below.

    From the config alone (classmethods: `convert` and `plan` call them before any weight exists):
      parse_config(config)            config.json (dict) → the architecture's config dataclass
      tensors(cfg)                    every tensor declared once (`colibri_core.tensors.TensorTable`);
                                      `layout` and `resident_shapes` derive from it by default
      layout(cfg)                     the container layout: resident tensors, routed experts, top-k
      resident_shapes(cfg)            every resident tensor's shape, by checkpoint name
      state_floats_per_token(cfg)     per layer, the state floats each token adds
      kept_apart_floats_per_token(cfg)  optional: growing state kept beside the layers' (DSA indexer keys)
      kv_cache_floats_per_token(cfg)  optional: the part of the layers' state held in `KVCache`s
      fixed_state_floats(cfg)         optional: state that does not grow (recurrent + conv states)
    With the weights (the engine builds the model once per load):
      __init__(cfg, weights, store)   take every resident tensor from `weights`; keep `store` (the core's
                                      `experts.ExpertSource`) for `moe`
      routers()                       per MoE layer, its declared `Router` (run by the core, lookahead too)
      lookahead()                     optional: which MoE layer each layer's lookahead predicts
      new_state(kv_cache)             a fresh per-sequence `colibri_core.kv.SequenceState`
      forward(ids, state, last_only)  logits of new tokens; MoE layers call `self.moe(...)`; after each
                                      decoder layer ``probe.record(i, l_out=h)`` (the residual stream:
                                      free unless someone records; lets the conformance kit name the
                                      layer where a plugin leaves transformers)
      vocab_size                      optional: the logits' width (default: cfg.vocab_size)
      token_exact                     optional, default False: True where every token gets the same bits
                                      however its sequence's forwards are cut, one token or many (each
                                      layer computes a token exactly as alone, as the core's AttnBlock
                                      and MoE do; not blocks aligned at BLOCK, nor chunked recurrences).
                                      The prefix cache then reuses rows to the token and keeps a turn's
                                      end (prefix.py); the kit's `one_forward_is_pieces` checks it
    A model with a multi-token-prediction head (GLM-5.2) also declares it, for the core's `mtp`
    drafter (colibri_core/drafting.py):
      has_mtp                         True: the three below exist
      new_mtp_state()                 the head's own fresh state
      mtp_forward(hidden, next_ids, state)  the head's logits (T, V) for tokens t + 2; sets
                                      `last_mtp_hidden` (T, H), a chained draft's stand-in hidden state
      last_hidden                     set by `forward`: its final-normalised hidden states (T, H)
    """

    has_mtp = False
    token_exact = False

    # Kept per generation (a context variable): the generations of a batch run their forwards
    # interleaved (colibri_core/batch.py), and each reads back its own.
    @property
    def last_hidden(self) -> np.ndarray | None:
        """(T, H): the final-normalised hidden states `forward` kept (where `has_mtp`), or None."""
        return _kept.get().get((id(self), "hidden"))

    @last_hidden.setter
    def last_hidden(self, value: np.ndarray | None) -> None:
        _kept.set({**_kept.get(), (id(self), "hidden"): value})

    @property
    def last_mtp_hidden(self) -> np.ndarray | None:
        """(T, H): the stand-in hidden states `mtp_forward` kept, or None."""
        return _kept.get().get((id(self), "mtp"))

    @last_mtp_hidden.setter
    def last_mtp_hidden(self, value: np.ndarray | None) -> None:
        _kept.set({**_kept.get(), (id(self), "mtp"): value})

    @classmethod
    def parse_config(cls, config: dict) -> Any:
        """config.json (a dict) → this architecture's config dataclass."""
        raise NotImplementedError

    @classmethod
    def tensors(cls, cfg) -> TensorTable:
        """Every tensor of the checkpoint, each declared once: name pattern, shape, whether it stays
        float32, released checkpoints' names, the experts' form. `__init__` takes them with
        `TensorTable.take`."""
        raise NotImplementedError

    @classmethod
    def layout(cls, cfg) -> ContainerLayout:
        """Which checkpoint tensors are resident, which are routed experts, which stay f32; top-k.
        Default: derived from `tensors(cfg)`."""
        return cls.tensors(cfg).layout()

    @classmethod
    def resident_shapes(cls, cfg) -> dict[str, tuple[int, ...]]:
        """Every resident tensor's shape by checkpoint name, from the config alone (for `plan`:
        sized with the layout's quantisation rules, before any weight is read). Default: derived
        from `tensors(cfg)`."""
        return cls.tensors(cfg).resident_shapes()

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

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding and width of the logits: token ids are checked against it."""
        return int(self.cfg.vocab_size)

    def new_mtp_state(self):
        """The MTP head's fresh state (only where `has_mtp`)."""
        raise NotImplementedError(f"{type(self).__name__} has no MTP head")

    def mtp_forward(self, hidden: np.ndarray, next_ids: np.ndarray, state) -> np.ndarray:
        """The MTP head: hidden (T, H) the model's `last_hidden` rows, next_ids (T,) → logits (T, V)
        (only where `has_mtp`)."""
        raise NotImplementedError(f"{type(self).__name__} has no MTP head")

    def routers(self) -> dict[int, Router]:
        """Every MoE layer's router ({absolute layer index: Router}), exactly the layout's
        `moe_layers`, in the order the forward pass runs them."""
        raise NotImplementedError

    def expert_biases(self) -> dict[int, tuple]:
        """{MoE layer: (gate_bias (E, I), up_bias (E, I), down_bias (E, H))} float32, resident tensors
        the routed experts add (GPT-OSS); each may be None. Default: none."""
        return {}

    def lookahead(self) -> dict[int, int] | None:
        """{MoE layer: the MoE layer whose experts its lookahead predicts}. Default (None): each
        router's successor in `routers()`. Override to leave out a layer the forward pass does not
        run next (GLM-5.2's MTP layer)."""
        return None

    def new_state(self, kv_cache: str = "f32") -> State:
        """Fresh per-sequence state: a `colibri_core.kv.SequenceState` of the core's state kinds
        (KV caches, latents, recurrent states), its `KVCache`s of element type `kv_cache` ("f32" or
        "f16", the engine's `--kv-cache`)."""
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
        moe = self._moe_block()
        # in a batch (colibri_core/batch.py): one call for every generation at this layer, their rows
        # stacked, so the layer reads the union of their experts once
        parts = (x, residual, token_ids) if expert_input is None else (x, residual, token_ids, expert_input)
        return batch.together(("moe", id(self), layer, id(shared), expert_input is None), parts,
                              lambda all_parts: _moe_rows(moe, layer, shared, all_parts))

    def decoder_layer(self, layer: int, block: MoEDecoderLayer, h: np.ndarray, state, token_ids: np.ndarray,
                      cos: np.ndarray | None = None, sin: np.ndarray | None = None) -> np.ndarray:
        """A decoder layer built from the core's blocks (`layers.decoder.MoEDecoderLayer`): h (T, H)
        → h + mixer, + the MoE block (`moe`) on its post-norm, over `state` (the layer's KV cache or
        DeltaNet state) with cos, sin (T, rotary_dim) for attention. One C call where the layer can
        take it (`MoE.layer_table`, `MoE.whole_layer`; in a batch one for all its generations),
        else block by block: the same bits either way. Call it from `forward`; never override it."""
        moe = self._moe_block()
        table = moe.layer_table(layer, block)
        if table is None:
            return block.steps(self.moe, layer, h, state, token_ids, cos, sin)
        # in a batch: one call for every generation at this layer, their rows stacked
        return batch.together(("layer", id(self), layer, id(block)), (h, state, cos, sin),
                              lambda parts: moe.whole_layer(layer, block, table, parts))

    def _moe_block(self) -> MoE:
        """The core's MoE block over `routers()`, built on first use."""
        if self._moe is None:
            layout = self.layout(self.cfg)
            self._moe = MoE(self.store, self.routers(), self.lookahead(), layout.swiglu_limit, layout.expert_activation,
                            layout.swiglu_alpha, self.expert_biases())
        return self._moe
