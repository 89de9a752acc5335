"""The base every architecture's model class builds on, and the resident-weight helpers.

An architecture's ``model.py`` subclasses `MoEModel`: it parses ``config.json`` into its config
dataclass, describes its container layout, takes its resident tensors from `Weights` by name
(anything left untaken, or taken but absent, is an error) and runs its layer graph in `forward`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import kernels
from .errors import ColibriError
from .layout import ContainerLayout
from .quant import QTensor, dequantize


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


def embed(ids: np.ndarray, table) -> np.ndarray:
    """Rows `ids` (T,) of an embedding table (QTensor or ndarray (V, H)) as float32 (T, H)."""
    if not isinstance(table, QTensor):
        return np.asarray(table[ids], np.float32)
    rows = QTensor(table.kind, len(ids), table.cols, table.data[ids],
                   None if table.scales is None else table.scales[ids])
    return dequantize(rows)


class MoEModel:
    """One architecture's forward pass over resident weights and the expert store.

    Subclasses implement the four methods below; the engine calls nothing else.
    """

    @classmethod
    def parse_config(cls, config: dict) -> Any:
        """config.json (a dict) → this architecture's config dataclass."""
        raise NotImplementedError

    @classmethod
    def layout(cls, cfg) -> ContainerLayout:
        """Which checkpoint tensors are resident, which are routed experts, which stay f32."""
        raise NotImplementedError

    @classmethod
    def resident_shapes(cls, cfg) -> dict[str, tuple[int, ...]]:
        """Every resident tensor's shape by checkpoint name, from the config alone (for `plan`:
        sized with the layout's quantisation rules, before any weight is read)."""
        raise NotImplementedError

    @classmethod
    def state_floats_per_token(cls, cfg) -> list[int]:
        """Per layer, the floats its state grows by per token (K + V for GQA; 576 for GLM-5.2's MLA
        latent + rope key; 0 for a fixed-size recurrent state). State kept apart (e.g. DSA indexer
        keys) is reported by its own classmethod, named in the plugin's docstring."""
        raise NotImplementedError

    def __init__(self, cfg, weights: Weights, store):
        self.cfg = cfg
        self.store = store

    def new_state(self):
        """Fresh per-sequence state (KV caches, …) with a `length` attribute (tokens seen)."""
        raise NotImplementedError

    def predict_experts(self, layer: int, hidden: np.ndarray) -> np.ndarray | None:
        """Router lookahead (optional): the expert ids (T, k) MoE layer `layer`'s router picks for the
        residual stream `hidden` (T, H) of an earlier layer. The store calls it to prefetch; the
        default, None, means no prediction. It never changes an output, only what is read early."""
        return None

    def forward(self, ids: np.ndarray, state, last_only: bool = False) -> np.ndarray:
        """Run new tokens `ids` (T,) after the `state.length` tokens already in `state`.

        Returns logits float32 (T, vocab), or (1, vocab) for the last token when `last_only`.
        """
        raise NotImplementedError
