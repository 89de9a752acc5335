"""The routed-expert block: every expert a batch needs, fetched from the store, run by the C kernels.

Placement never changes the result: each expert's FFN is computed by the same kernel wherever its
weights came from and whichever experts were ready first, each token's expert output lands in a
fixed slot (its top-k rank), and the weighted sum over ranks is taken in rank order.
"""
import numpy as np

from .. import kernels
from ..probe import route, timed


def run_experts(outs: np.ndarray, x: np.ndarray, ids: np.ndarray, experts: dict) -> None:
    """Fill the slots of `experts` ({expert id: (gate, up, down)}) in outs (T, k, H).

    outs[t, r] = FFN_{ids[t, r]}(x[t]) for every (t, r) routed to one of `experts`; each row is
    computed independently of the others, so batching never changes a result.
    """
    kernels.moe_experts(outs, x, ids, experts)  # one C call: every expert, every slot, threads inside


def combine(outs: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Σ_rank weights[t, r] · outs[t, r], summed in rank order. outs (T, k, H), weights (T, k) → (T, H)."""
    return kernels.moe_combine(outs, weights)  # one C call, the same float32 operations as NumPy's


@timed("moe")
def moe_block(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, store, layer: int,
              hidden: np.ndarray | None = None) -> np.ndarray:
    """x (T, H), ids / weights (T, k) from the router → (T, H) = Σ_rank weight · expert(x).

    The store reads the batch union once, yields the experts already resident first and the others
    in groups as their reads arrive, so compute overlaps the reads. `hidden` (T, H), the residual
    stream entering this block, lets the store predict and prefetch the next layer's experts
    (router lookahead).
    """
    route(layer, ids)
    T, k = ids.shape
    outs = np.zeros((T, k, x.shape[1]), np.float32)  # (T, k, H): one slot per (token, rank)
    for ready in store.experts(layer, ids, hidden=hidden):  # {expert: (gate, up, down)}, resident first
        run_experts(outs, x, ids, ready)
    return combine(outs, weights)
