"""The key/value cache of one attention layer, and per-token rows of other attention states."""
import numpy as np

from ..arena import HUGE_PAGE, huge_pages

__all__ = ["KVCache", "Rows"]


def _empty(capacity: int, shape: tuple[int, ...]) -> np.ndarray:
    """An uninitialised float32 (capacity', *shape) array, capacity' >= capacity.

    From one huge page up it gets its own transparent-huge-page mapping, capacity' rounded up to fill
    its pages: decode attention reads every cached row each token, and in 4 KB pages it stalled on
    the TLB (OLMoE-1B-7B size, 150 cached tokens, alternated token by token: 25.84 → 25.09 ms per
    token; BENCHMARKS.md). Smaller arrays stay NumPy's."""
    row = 4 * int(np.prod(shape, dtype=np.int64))
    if capacity * row < HUGE_PAGE or row == 0:
        return np.empty((capacity, *shape), np.float32)
    nbytes = -(-capacity * row // HUGE_PAGE) * HUGE_PAGE
    return huge_pages(nbytes)[: nbytes // row * row].view(np.float32).reshape(-1, *shape)


class KVCache:
    """Keys and values of every token seen so far, grown by doubling."""

    def __init__(self, kv_heads: int, head_dim: int, capacity: int = 64):
        self.k = _empty(capacity, (kv_heads, head_dim))  # (capacity, Hkv, D)
        self.v = _empty(capacity, (kv_heads, head_dim))  # (capacity, Hkv, D)
        self.length = 0

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        """Add k, v (T, Hkv, D) for T new tokens."""
        need = self.reserve(k.shape[0])
        self.k[self.length : need] = k
        self.v[self.length : need] = v
        self.length = need

    def reserve(self, T: int) -> int:
        """Room for T more tokens in `k` and `v` (rows length .. length+T-1, for a kernel to write
        before the caller sets `length`); returns length + T."""
        need = self.length + T
        if need > self.k.shape[0]:
            cap = max(need, 2 * self.k.shape[0])
            for name in ("k", "v"):
                grown = _empty(cap, self.k.shape[1:])
                grown[: self.length] = getattr(self, name)[: self.length]
                setattr(self, name, grown)
        return need

    def view(self) -> tuple[np.ndarray, np.ndarray]:
        """Cached keys and values, (length, Hkv, D) each: views no later `append` changes (it writes
        past them, or into a grown copy), so they are `State.arrays()` as they are."""
        return self.k[: self.length], self.v[: self.length]

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens (`State.truncate`)."""
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class Rows:
    """A per-token array (length, *shape) grown by doubling: an MLA latent, a rope key, indexer keys."""

    def __init__(self, *shape: int, capacity: int = 64):
        self.data = _empty(capacity, shape)  # (capacity, *shape)
        self.length = 0

    def append(self, rows: np.ndarray) -> None:
        """Add rows (T, *shape) for T new tokens."""
        need = self.length + rows.shape[0]
        if need > self.data.shape[0]:
            grown = _empty(max(need, 2 * self.data.shape[0]), self.data.shape[1:])
            grown[: self.length] = self.data[: self.length]
            self.data = grown
        self.data[self.length : need] = rows
        self.length = need

    def view(self) -> np.ndarray:
        """Every row held, (length, *shape): a view no later `append` changes (as `KVCache.view`)."""
        return self.data[: self.length]

    def truncate(self, length: int) -> None:
        """Keep the first `length` rows (`State.truncate`)."""
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length

    @property
    def nbytes(self) -> int:
        return self.data.nbytes
