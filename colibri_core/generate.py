"""Sampling: greedy, temperature, top-k and top-p (nucleus), reproducible from a seed."""
from __future__ import annotations

import numpy as np


def distribution(logits: np.ndarray, temperature: float, top_p: float = 1.0, top_k: int = 0) -> np.ndarray:
    """The probabilities (V,) float64 that `sample` draws from at temperature > 0: softmax of
    logits / temperature, restricted to the top_k and then to the smallest set reaching top_p."""
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
    return probs


def sample(logits: np.ndarray, rng: np.random.Generator, temperature: float = 0.0,
           top_p: float = 1.0, top_k: int = 0) -> int:
    """One token id from logits (V,). Temperature 0 is greedy (ties go to the lowest id)."""
    if temperature <= 0:
        return int(np.argmax(logits))
    probs = distribution(logits, temperature, top_p, top_k)
    return int(rng.choice(probs.size, p=probs))


def verify_draft(logits: np.ndarray, draft: int, rng: np.random.Generator, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0) -> tuple[bool, int]:
    """Speculative sampling of a deterministic draft: (accepted, token). The token is `sample`'s, from
    the same one draw, and the draft is accepted iff it is that token: accepted with probability
    p(draft), else a token from p with the draft removed — the scheme of speculative sampling for a
    draft of one certain token. Drawing exactly what decoding without drafts draws, a seed gives the
    same tokens whether, when and what anything drafted (the engine's auto rule, a session resumed
    with fresh drafters); greedy, accepted iff the draft is the argmax."""
    token = sample(logits, rng, temperature, top_p, top_k)
    return token == draft, token
