"""The key/value cache of one attention layer, and per-token rows of other attention states: the
per-token parts of a `kv.SequenceState`."""
import numpy as np

from ..arena import HUGE_PAGE, huge_pages
from ..errors import ColibriError

__all__ = ["KVCache", "Rows", "WindowKV"]

# The KV caches' element type: "f32" keeps keys and values as computed (the oracle's arithmetic, the
# default); "f16" rounds each to float16 when it is stored (half the memory and the bytes decode
# attention reads per token; an explicit choice, as llama.cpp's default cache type), and attention
# widens them back exactly. The engine passes its choice to the model's `new_state(kv_cache)`.
KV_CACHES = {"f32": np.float32, "f16": np.float16}


def check_cache_type(name: str) -> str:
    """`name` if it is a KV cache type, else one clear error."""
    if name not in KV_CACHES:
        raise ColibriError(f"unknown KV cache type {name!r} (expected one of {', '.join(KV_CACHES)})")
    return name


def _empty(capacity: int, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """An uninitialised (capacity', *shape) array of `dtype`, capacity' >= capacity.

    From one huge page up it gets its own transparent-huge-page mapping, capacity' rounded up to fill
    its pages: decode attention reads every cached row each token, and in 4 KB pages it stalled on
    the TLB (OLMoE-1B-7B size, 150 cached tokens, alternated token by token: 25.84 → 25.09 ms per
    token; BENCHMARKS.md). Its pages are taken when it is made, not by the decode step whose row
    first reaches one: in a VM a fresh page can take milliseconds, and the first token after a
    2048-token prompt (one new page per layer's keys and values) took 250-280 ms instead of 60-75.
    Smaller arrays are NumPy's, their 4 KB pages taken alike (else each decoded token's row, 4-8 KB
    at OLMoE size, would fault a page in each of them)."""
    row = np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64))
    if capacity * row < HUGE_PAGE or row == 0:
        a = np.empty((capacity, *shape), dtype)
        a.reshape(-1).view(np.uint8)[::4096] = 0  # one byte of each 4 KB page: the kernel gives it now
        return a
    nbytes = -(-capacity * row // HUGE_PAGE) * HUGE_PAGE
    buf = huge_pages(nbytes)
    buf[::HUGE_PAGE] = 0  # one byte of each huge page
    return buf[: nbytes // row * row].view(dtype).reshape(-1, *shape)


def _grown(need: int, capacity: int) -> int:
    """The capacity a full array grows to: twice what is needed, so a prompt that fills it exactly
    is not followed by a copy of the whole cache at the first decoded token (OLMoE-1B-7B size, a
    2048-token prompt, float16: 512 MB of new pages and a copy of the 256 MB held, in that step)."""
    return 2 * max(need, capacity)


class KVCache:
    """Keys and values of every token seen so far, grown by doubling; elements of cache type
    `kv_cache` ("f32", or "f16": the engine's choice, given to `new_state`). A per-token part of a
    `kv.SequenceState`: arrays "PART.k", "PART.v" (length, Hkv, D)."""

    per_token = True

    def __init__(self, kv_heads: int, head_dim: int, kv_cache: str = "f32", capacity: int = 64):
        self.kv_cache = check_cache_type(kv_cache)
        dtype = KV_CACHES[kv_cache]
        self.k = _empty(capacity, (kv_heads, head_dim), dtype)  # (capacity, Hkv, D)
        self.v = _empty(capacity, (kv_heads, head_dim), dtype)  # (capacity, Hkv, D)
        self.length = 0

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        """Add k, v (T, Hkv, D) for T new tokens (rounded to nearest when the cache is float16, as
        the kernels store them: `kernels.f16_from_f32`)."""
        need = self.reserve(k.shape[0])
        self.k[self.length : need] = k
        self.v[self.length : need] = v
        self.length = need

    def reserve(self, T: int) -> int:
        """Room for T more tokens in `k` and `v` (rows length .. length+T-1, for a kernel to write
        before the caller sets `length`); returns length + T."""
        need = self.length + T
        if need > self.k.shape[0]:
            cap = _grown(need, self.k.shape[0])
            for name in ("k", "v"):
                grown = _empty(cap, self.k.shape[1:], self.k.dtype)
                grown[: self.length] = getattr(self, name)[: self.length]
                setattr(self, name, grown)
        return need

    def view(self) -> tuple[np.ndarray, np.ndarray]:
        """Cached keys and values, (length, Hkv, D) each: views no later `append` changes (it writes
        past them, or into a grown copy), so they are `State.arrays()` as they are."""
        return self.k[: self.length], self.v[: self.length]

    def arrays(self) -> dict[str, np.ndarray]:
        k, v = self.view()
        return {"k": k, "v": v}

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        self.append(arrays["k"], arrays["v"])  # rounded to this cache's type as they are stored

    def fill(self, T: int) -> dict[str, np.ndarray]:
        """`Part.fill`: this fresh cache holds T tokens, their rows {"k", "v"} (T, Hkv, D) for the caller to write."""
        self.length = self.reserve(T)
        return self.arrays()

    def empty(self) -> "KVCache":
        return KVCache(*self.k.shape[1:], self.kv_cache)

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens (`State.truncate`)."""
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class WindowKV:
    """Keys and values of a sliding-window attention layer: only the rows a later token can still
    see (the last `window` − 1), float32 (a fixed-size state, whatever the KV cache type: its
    memory is bounded by the window). A fixed-size part of a `kv.SequenceState` (rows that left the
    window are gone: it cannot be cut to a prefix): arrays "PART.k", "PART.v" (≤ window − 1, Hkv, D),
    oldest first.

    It has `KVCache`'s interface for `layers.attention.gqa_block`: `length` is the rows held (the
    attention kernel's row numbers, positions relative to the oldest row held), `reserve(T)` makes
    room for T more. A call's new rows go after the held ones; once more than `SPARE` windows' worth
    are held, the last window − 1 move to the front (one copy per `SPARE` − 1 windows of decoded
    tokens, not one per token), so memory stays a few windows whatever the context, a long prompt's
    rows included once the next call comes."""

    per_token = False
    SPARE = 4  # the arrays' capacity in windows (at least: a call's rows all fit)

    def __init__(self, kv_heads: int, head_dim: int, window: int):
        self.window = window
        self.k = _empty(self.SPARE * window, (kv_heads, head_dim))  # (capacity, Hkv, D)
        self.v = _empty(self.SPARE * window, (kv_heads, head_dim))  # (capacity, Hkv, D)
        self.length = 0
        self.varying = {"k": window - 1, "v": window - 1}

    def reserve(self, T: int) -> int:
        """Room for T more rows after the held ones (only the last window − 1 kept when it moves
        them: a row before those is seen by no later token); returns length + T."""
        if self.length + T <= self.k.shape[0]:
            return self.length + T
        keep = min(self.length, self.window - 1)
        cap = max(self.SPARE * self.window, keep + T)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old if cap <= old.shape[0] <= self.SPARE * self.window else _empty(cap, old.shape[1:], old.dtype)
            new[:keep] = old[self.length - keep:self.length]  # np copies overlapping slices correctly
            setattr(self, name, new)
        self.length = keep
        return keep + T

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        """Add k, v (T, Hkv, D) for T new tokens."""
        need = self.reserve(k.shape[0])
        self.k[self.length:need] = k
        self.v[self.length:need] = v
        self.length = need

    def view(self) -> tuple[np.ndarray, np.ndarray]:
        """Every held row, (length, Hkv, D) each (the attention kernel's rows 0 .. length − 1):
        views the next `reserve` may move rows over."""
        return self.k[:self.length], self.v[:self.length]

    def arrays(self) -> dict[str, np.ndarray]:
        first = max(self.length - (self.window - 1), 0)  # the rows a later token can see
        return {"k": self.k[first:self.length].copy(), "v": self.v[first:self.length].copy()}  # copies: see view

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        self.append(arrays["k"], arrays["v"])

    def empty(self) -> "WindowKV":
        return WindowKV(*self.k.shape[1:], self.window)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class Rows:
    """A per-token array (length, *shape) grown by doubling, float32: an MLA latent, a rope key,
    indexer keys. A per-token part of a `kv.SequenceState`: array "PART" (length, *shape)."""

    per_token = True

    def __init__(self, *shape: int, capacity: int = 64):
        self.data = _empty(capacity, shape)  # (capacity, *shape)
        self.length = 0

    def append(self, rows: np.ndarray) -> None:
        """Add rows (T, *shape) for T new tokens."""
        need = self.length + rows.shape[0]
        if need > self.data.shape[0]:
            grown = _empty(_grown(need, self.data.shape[0]), self.data.shape[1:])
            grown[: self.length] = self.data[: self.length]
            self.data = grown
        self.data[self.length : need] = rows
        self.length = need

    def fill(self, T: int) -> dict[str, np.ndarray]:
        """`Part.fill`: these fresh rows hold T tokens, {"": (T, *shape)} for the caller to write."""
        if T > self.data.shape[0]:  # fresh: nothing to copy
            self.data = _empty(_grown(T, self.data.shape[0]), self.data.shape[1:])
        self.length = T
        return self.arrays()

    def view(self) -> np.ndarray:
        """Every row held, (length, *shape): a view no later `append` changes (as `KVCache.view`)."""
        return self.data[: self.length]

    def arrays(self) -> dict[str, np.ndarray]:
        return {"": self.view()}

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        self.append(arrays[""])

    def empty(self) -> "Rows":
        return Rows(*self.data.shape[1:])

    def truncate(self, length: int) -> None:
        """Keep the first `length` rows (`State.truncate`)."""
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length

    @property
    def nbytes(self) -> int:
        return self.data.nbytes
