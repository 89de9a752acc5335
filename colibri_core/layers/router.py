"""Routers: token → (expert ids, expert weights)."""
import numpy as np

from .. import kernels


def topk(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores per row, largest first; ties go to the lower index. (T, E) → (T, k)."""
    return np.argsort(-scores, axis=-1, kind="stable")[:, :k]


def softmax_topk(logits: np.ndarray, k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over all experts, then top-k; optionally renormalise the chosen weights to sum 1.

    logits (T, E) → weights (T, k) float32, ids (T, k) int64. One C call (kernels.softmax_topk;
    NumPy reference: kernels.reference.softmax_topk).
    """
    return kernels.softmax_topk(logits, k, renormalize)


def sigmoid_group_topk(logits: np.ndarray, bias: np.ndarray, k: int, n_group: int, topk_group: int,
                       renormalize: bool, scaling: float) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V3 style routing (GLM-5, DeepSeek V3, Kimi): sigmoid scores, group-limited choice.

    scores = sigmoid(logits) in float32. Experts are *chosen* on scores + `bias` (the
    e_score_correction_bias): the E experts form `n_group` equal groups, a group scores the sum of
    its 2 best biased scores, only the `topk_group` best groups compete, and the top-k of those
    are chosen. The *weights* are the unbiased scores of the chosen experts, divided by their sum
    (+ 1e-20) when `renormalize`, times `scaling` (routed_scaling_factor).

    logits (T, E), bias (E,) → weights (T, k) float32, ids (T, k) int64 (best biased score first).
    """
    T, E = logits.shape
    scores = np.float32(1) / (np.float32(1) + np.exp(-logits.astype(np.float32)))  # (T, E)
    choice = scores + bias.astype(np.float32)  # (T, E)
    if n_group > 1:
        grouped = choice.reshape(T, n_group, E // n_group)  # (T, G, E/G)
        group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)  # (T, G): sum of the best 2
        keep = np.zeros((T, n_group), bool)
        np.put_along_axis(keep, topk(group_scores, topk_group), True, axis=-1)
        choice = np.where(np.repeat(keep, E // n_group, axis=-1), choice, np.float32(-np.inf))
    ids = topk(choice, k)
    weights = np.take_along_axis(scores, ids, axis=-1)  # (T, k) unbiased
    if renormalize:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + np.float32(1e-20))
    return (weights * np.float32(scaling)).astype(np.float32), ids
