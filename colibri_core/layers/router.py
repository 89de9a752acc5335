"""Routers: token → (expert ids, expert weights)."""
import numpy as np


def topk(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores per row, largest first; ties go to the lower index. (T, E) → (T, k)."""
    return np.argsort(-scores, axis=-1, kind="stable")[:, :k]


def softmax_topk(logits: np.ndarray, k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over all experts, then top-k; optionally renormalise the chosen weights to sum 1.

    logits (T, E) → weights (T, k) float32, ids (T, k) int64.
    """
    z = logits.astype(np.float32) - logits.max(axis=-1, keepdims=True)
    probs = np.exp(z)
    probs /= probs.sum(axis=-1, keepdims=True)
    ids = topk(probs, k)
    weights = np.take_along_axis(probs, ids, axis=-1)
    if renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights.astype(np.float32), ids
