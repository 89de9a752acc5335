"""Routers: token → (expert ids, expert weights), declared by a plugin and run by the core.

A plugin builds one `Router` per MoE layer from its resident weights and returns them from
`MoEModel.routers()`. The core's MoE block (`layers.moe.MoE`) calls `route` on the layer's own
input, and `predict` on the residual stream of an *earlier* layer to guess which experts this
layer will need (router lookahead: the store starts reading them while the earlier layer
computes). A router is the layer's routing and nothing else: it owns no experts and no cache.

The shared kinds live here; a plugin whose routing is none of them subclasses `Router`.

    route(x, token_ids)        x (T, H) the router's input, token_ids (T,) → weights (T, k) f32, ids (T, k) i64,
                               each token's best expert first
    predict(residual, token_ids)  residual (T, H) of an earlier layer → ids (T, k), best first, or None
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .. import kernels
from .linear import linear

__all__ = ["Router", "SoftmaxTopK", "TopKSoftmax", "SigmoidGroupTopK", "SqrtSoftplusTopK", "HashRouter",
           "topk", "softmax_topk", "sigmoid_group_topk", "sqrt_softplus"]


def topk(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores per row, largest first; ties go to the lower index. (T, E) → (T, k)."""
    return np.argsort(-scores, axis=-1, kind="stable")[:, :k]


def softmax_topk(logits: np.ndarray, k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over all experts, then top-k; optionally renormalise the chosen weights to sum 1.

    logits (T, E) → weights (T, k) float32, ids (T, k) int64. One C call (kernels.softmax_topk;
    NumPy reference: kernels.reference.softmax_topk).
    """
    return kernels.softmax_topk(logits, k, renormalize)


def _choose(scores: np.ndarray, bias: np.ndarray | None, k: int, n_group: int, topk_group: int) -> np.ndarray:
    """Top-k ids (T, k) of `scores` + `bias`, group-limited: the E experts form `n_group` equal groups, a
    group scores the sum of its 2 best biased scores and only the `topk_group` best groups compete."""
    T, E = scores.shape
    choice = scores if bias is None else scores + bias.astype(np.float32)  # (T, E)
    if n_group > 1:
        grouped = choice.reshape(T, n_group, E // n_group)  # (T, G, E/G)
        group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)  # (T, G): sum of the best 2
        keep = np.zeros((T, n_group), bool)
        np.put_along_axis(keep, topk(group_scores, topk_group), True, axis=-1)
        choice = np.where(np.repeat(keep, E // n_group, axis=-1), choice, np.float32(-np.inf))
    return topk(choice, k)


def _weights(scores: np.ndarray, ids: np.ndarray, renormalize: bool, scaling: float) -> np.ndarray:
    """The chosen experts' unbiased scores (T, k), divided by their sum (+ 1e-20) when `renormalize`,
    times `scaling`."""
    weights = np.take_along_axis(scores, ids, axis=-1)  # (T, k)
    if renormalize:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + np.float32(1e-20))
    return (weights * np.float32(scaling)).astype(np.float32)


def sigmoid_group_topk(logits: np.ndarray, bias: np.ndarray, k: int, n_group: int, topk_group: int,
                       renormalize: bool, scaling: float) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V3 style routing (GLM-5, DeepSeek V3, Kimi): sigmoid scores, group-limited choice.

    scores = sigmoid(logits) in float32. Experts are *chosen* on scores + `bias` (the
    e_score_correction_bias), group-limited (`_choose`); the *weights* are the unbiased scores of
    the chosen experts, divided by their sum (+ 1e-20) when `renormalize`, times `scaling`
    (routed_scaling_factor).

    logits (T, E), bias (E,) → weights (T, k) float32, ids (T, k) int64 (best biased score first).
    """
    scores = np.float32(1) / (np.float32(1) + np.exp(-logits.astype(np.float32)))  # (T, E)
    ids = _choose(scores, bias, k, n_group, topk_group)
    return _weights(scores, ids, renormalize, scaling), ids


def sqrt_softplus(logits: np.ndarray) -> np.ndarray:
    """sqrt(softplus(logits)) in float32 (DeepSeek V4's expert scores). (T, E) → (T, E)."""
    x = logits.astype(np.float32)
    return np.sqrt(np.logaddexp(np.float32(0), x)).astype(np.float32)


class Router:
    """One MoE layer's declared routing.

    `k` experts per token. `input` maps the residual stream entering the MoE sub-block to the
    router's input (the layer's pre-MoE norm): the lookahead applies it to an earlier layer's
    residual stream. Subclasses implement `route`; `predict` defaults to routing that input.
    """

    k: int
    input: Callable[[np.ndarray], np.ndarray]

    def route(self, x: np.ndarray, token_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """x (T, H), token_ids (T,) → weights (T, k) float32, ids (T, k) int64, best first: arrays
        of their own, not a reused buffer (the probe and the usage history keep the ids until the
        forward pass ends or the counts are read)."""
        raise NotImplementedError

    def predict(self, residual: np.ndarray, token_ids: np.ndarray) -> np.ndarray | None:
        """Lookahead: the ids (T, k), best first, this router will likely choose, given the residual
        stream (T, H) of an earlier layer; None if it cannot guess. Applied to this layer's own
        residual stream it must reproduce `route`'s ids (the conformance kit checks it)."""
        return self.route(self.input(residual), token_ids)[1]


def _identity(x: np.ndarray) -> np.ndarray:
    return x


class SoftmaxTopK(Router):
    """Softmax over all experts, top-k, optionally renormalised (OLMoE, Qwen-MoE, Mixtral)."""

    def __init__(self, weight, k: int, renormalize: bool, input=_identity):
        self.weight = weight  # (E, H) float32
        self.k, self.renormalize, self.input = k, renormalize, input

    def route(self, x, token_ids):
        return softmax_topk(linear(x, self.weight), self.k, self.renormalize)


class TopKSoftmax(Router):
    """The top-k logits (x Wᵀ + optional bias; ties to the lower index), then a softmax over those k,
    the largest first (GPT-OSS, with a bias; Mixtral's routing without one)."""

    def __init__(self, weight, k: int, bias: np.ndarray | None = None, input=_identity):
        self.weight, self.bias = weight, bias  # (E, H) float32, (E,) float32 or None
        self.k, self.input = k, input

    def route(self, x, token_ids):
        logits = linear(x, self.weight)  # (T, E)
        if self.bias is not None:
            logits = logits + self.bias
        ids = topk(logits, self.k)  # (T, k)
        top = np.take_along_axis(logits, ids, axis=-1)
        w = np.exp(top - top[:, :1])
        return (w / w.sum(axis=-1, keepdims=True)).astype(np.float32), ids.astype(np.int64)


class SigmoidGroupTopK(Router):
    """Sigmoid scores, choice on score + correction bias, group-limited, renormalised × scaling
    (GLM-5, DeepSeek V3, Kimi). See `sigmoid_group_topk`."""

    def __init__(self, weight, bias: np.ndarray, k: int, n_group: int = 1, topk_group: int = 1,
                 renormalize: bool = True, scaling: float = 1.0, input=_identity):
        self.weight, self.bias = weight, bias  # (E, H) float32, (E,) float32
        self.k, self.n_group, self.topk_group = k, n_group, topk_group
        self.renormalize, self.scaling, self.input = renormalize, scaling, input

    def route(self, x, token_ids):
        return sigmoid_group_topk(linear(x, self.weight), self.bias, self.k, self.n_group, self.topk_group,
                                  self.renormalize, self.scaling)


class SqrtSoftplusTopK(Router):
    """scores = sqrt(softplus(logits)); top-k on scores + bias (no groups); weights the chosen
    unbiased scores renormalised × scaling (DeepSeek V4's learned layers)."""

    def __init__(self, weight, bias: np.ndarray | None, k: int, scaling: float = 1.0, input=_identity):
        self.weight, self.bias = weight, bias  # (E, H) float32, (E,) float32 or None
        self.k, self.scaling, self.input = k, scaling, input

    def route(self, x, token_ids):
        scores = sqrt_softplus(linear(x, self.weight))  # (T, E)
        ids = _choose(scores, self.bias, self.k, 1, 1)
        return _weights(scores, ids, True, self.scaling), ids


class HashRouter(Router):
    """Experts fixed per token id by a table (DeepSeek V4's first layers): ids = table[token_id];
    weights the sqrt-softplus scores of those experts, renormalised × scaling. It cannot guess from
    a residual stream, and does not need to: its lookahead reads the table for the token ids."""

    def __init__(self, weight, table: np.ndarray, scaling: float = 1.0, input=_identity):
        self.weight = weight  # (E, H) float32
        self.table = np.asarray(table, np.int64)  # (vocab, k): tid2eid
        self.k, self.scaling, self.input = self.table.shape[1], scaling, input

    def route(self, x, token_ids):
        ids = self.table[np.asarray(token_ids, np.int64)]  # (T, k)
        scores = sqrt_softplus(linear(x, self.weight))  # (T, E)
        return _weights(scores, ids, True, self.scaling), ids

    def predict(self, residual, token_ids):
        return self.table[np.asarray(token_ids, np.int64)]
