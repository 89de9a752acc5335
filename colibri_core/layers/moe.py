"""The routed-expert block: every expert a batch needs, fetched from the store, run by one C kernel.

Placement never changes the result: each expert's FFN is computed by the same kernel wherever its
weights came from, each token's expert outputs land in a fixed slot (its top-k rank), and the
weighted sum over ranks is taken in rank order.
"""
import numpy as np

from .. import kernels


def moe_block(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, store, layer: int) -> np.ndarray:
    """x (T, H), ids / weights (T, k) from the router → (T, H) = Σ_rank weight · expert(x)."""
    T, k = ids.shape
    outs = np.zeros((T, k, x.shape[1]), np.float32)  # (T, k, H): one slot per (token, rank)
    for expert in np.unique(ids):  # ascending expert id
        tok, rank = np.nonzero(ids == expert)
        gate, up, down = store.get(layer, int(expert))
        outs[tok, rank] = kernels.expert_ffn(gate, up, down, x[tok])
    out = outs[:, 0] * weights[:, :1]
    for r in range(1, k):
        out += outs[:, r] * weights[:, r : r + 1]
    return out
