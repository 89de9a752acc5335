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
    for expert, (gate, up, down) in experts.items():
        tok, rank = np.nonzero(ids == expert)
        outs[tok, rank] = kernels.expert_ffn(gate, up, down, x[tok])


def combine(outs: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Σ_rank weights[t, r] · outs[t, r], summed in rank order. outs (T, k, H), weights (T, k) → (T, H)."""
    out = outs[:, 0] * weights[:, :1]
    for r in range(1, outs.shape[1]):
        out += outs[:, r] * weights[:, r : r + 1]
    return out


@timed("moe")
def moe_block(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, store, layer: int) -> np.ndarray:
    """x (T, H), ids / weights (T, k) from the router → (T, H) = Σ_rank weight · expert(x)."""
    route(layer, ids)
    T, k = ids.shape
    outs = np.zeros((T, k, x.shape[1]), np.float32)  # (T, k, H): one slot per (token, rank)
    for expert in np.unique(ids):  # the batch union, ascending expert id
        run_experts(outs, x, ids, {int(expert): store.get(layer, int(expert))})
    return combine(outs, weights)
