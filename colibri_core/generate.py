"""Sampling: greedy, temperature, top-k and top-p (nucleus), reproducible from a seed."""
from __future__ import annotations

import numpy as np


def sample(logits: np.ndarray, rng: np.random.Generator, temperature: float = 0.0,
           top_p: float = 1.0, top_k: int = 0) -> int:
    """One token id from logits (V,). Temperature 0 is greedy (ties go to the lowest id)."""
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    if top_k > 0:
        kth = np.partition(z, -top_k)[-top_k] if top_k < z.size else -np.inf
        z = np.where(z < kth, -np.inf, z)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(cum, top_p)) + 1]  # smallest set reaching top_p
        mask = np.zeros_like(probs)
        mask[keep] = probs[keep]
        probs = mask / mask.sum()
    return int(rng.choice(probs.size, p=probs))
