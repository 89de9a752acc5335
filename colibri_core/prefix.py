"""The prefix cache: the states of recent prompts, kept in RAM under a byte budget, so that a prompt
sharing a prefix with an earlier one is prefilled only past the longest part of it that can be
reused bit for bit.

    cache = PrefixCache(budget=2 << 30, chunk=256)
    hit = cache.lookup(prompt)                    # None, or (entry, b): the state of prompt[:b] is held
    cache.restore(hit, state)                     # a fresh state now holds prompt[:b]
    capture = cache.capture(state, prompt, hit)   # the prefill stops at capture.stops(start, end), and
    cache.insert(capture)                         # calls capture.fed(start, end, hidden) after each forward

Why positions are aligned. A forward of more than `kernels.deltanet.EXACT_BATCH` tokens uses chunked
recurrences and block-wise attention; their blocks are aligned at the absolute multiples of
`kernels.deltanet.BLOCK`, each over exactly the keys up to its own end, so a position's bits depend
only on the tokens before its block's end: a forward cut at multiples of BLOCK gives the bits of one
forward. A boundary b (a multiple of `chunk`, itself a multiple of BLOCK) is therefore a point where
the state of a cold prefill of the whole prompt equals the state of a prefill of prompt[:b], and a
cold prefill is exactly the prefill that restores b and goes on from there. Nothing else is such a
point (the state at a turn's end was decoded token by token, which no cold prefill of the longer
prompt that continues it repeats, so it is never kept). The engine prefills in one forward (each MoE
layer reads its experts once), stopping only where a fixed-size part is snapshotted (`Capture.stops`).

What an entry holds (`Entry`), by state kind (kv/state.py): per-token rows (KV caches, MLA latents,
indexer keys) as views of the prompt's state, cut to any boundary when restored; fixed-size parts
(DeltaNet / KDA states, sliding windows, compressors) snapshotted at some boundaries as they are
reached: the last one and those at chunk × 2^k (a bounded number: log2 of the prompt's chunks + 1),
plus the snapshots inherited from the entry it was restored from. An entry whose tokens a newer one
extends is dropped for it. Entries are evicted least recently used first once the arrays they hold
(each buffer counted once, however many entries view it) pass the budget.

The index is a list scanned with one vectorised comparison per entry: for 500 entries of 8,192
tokens a lookup takes about 9 ms on one core, next to a prefill of seconds (a radix tree would pay
off at many thousands of entries). Disk spill and restart are not here yet.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from .errors import ColibriError
from .kernels.deltanet import BLOCK
from .kv.state import LENGTH, SequenceState

__all__ = ["DEFAULT_SHARE", "PREFILL_CHUNK", "Capture", "Entry", "PrefixCache"]

PREFILL_CHUNK = 256  # tokens between the boundaries a state is kept at: a multiple of BLOCK
DEFAULT_SHARE = 0.1  # the cache's default budget: this share of the engine's RAM budget, beside it


def _kept(boundaries, last: int, chunk: int) -> list[int]:
    """The boundaries whose fixed-size snapshots an entry keeps: `last`, and chunk × 2^k."""
    return sorted(b for b in set(boundaries) if b == last or (b // chunk) & (b // chunk - 1) == 0)


def _root(a: np.ndarray) -> np.ndarray:
    """The array owning `a`'s memory (a view's base, followed to the end)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


@dataclass(eq=False)
class Entry:
    """One prompt's reusable states: its first `len(tokens)` tokens (a multiple of the chunk), rows
    for them, and fixed-size snapshots at some of the boundaries (None: the state is rows only,
    usable at every boundary)."""

    tokens: np.ndarray  # (R,) int64
    rows: dict[str, np.ndarray]  # per-token parts' arrays, (≥ R, …) views
    fixed: dict[int, dict[str, np.ndarray]] | None  # boundary -> fixed-size parts' arrays there
    hidden: np.ndarray | None = None  # (R, H) the model's final hidden states: an MTP drafter's input
    roots: list[np.ndarray] = field(default_factory=list)  # the buffers it keeps alive, once each

    def usable(self, shared: int, chunk: int) -> int:
        """The furthest position ≤ `shared` this entry's state can be restored at (0: none)."""
        if self.fixed is None:
            return min(shared, len(self.tokens)) // chunk * chunk
        return max((b for b in self.fixed if b <= shared), default=0)


class Capture:
    """What the prefill of one prompt leaves for the cache: the engine stops its forwards at `stops`
    and calls `fed` after each; `PrefixCache.insert` makes an entry of it."""

    def __init__(self, state: SequenceState, prompt: list[int], chunk: int, inherited: dict[int, dict],
                 hidden: list[np.ndarray] | None):
        self.chunk = chunk
        self.tokens = np.asarray(prompt[: len(prompt) // chunk * chunk], np.int64)  # (R,)
        parts = state.parts.items()
        # SequenceStates over the same part objects, for the names `arrays()` gives them
        self._rows = SequenceState({name: p for name, p in parts if p.per_token})
        fixed = {name: p for name, p in parts if not p.per_token}
        self._fixed = SequenceState(fixed) if fixed else None
        self.snapshots = dict(inherited)  # boundary -> fixed-size arrays ({} for a state of rows)
        self.hidden = hidden  # (T, H) rows of the positions fed so far, in order; None: not kept

    def stops(self, start: int, end: int) -> list[int]:
        """The boundaries strictly between start and end where a prefill of positions start … end − 1
        stops for `reached` to snapshot the fixed-size parts: none for a state of rows only (its rows
        are cut to any boundary afterwards), else the few an entry keeps (`_kept`)."""
        if self._fixed is None:
            return []
        return _kept(range((start // self.chunk + 1) * self.chunk, end, self.chunk), len(self.tokens), self.chunk)

    def fed(self, start: int, end: int, hidden: np.ndarray | None) -> None:
        """The forward of positions start … end − 1 ran; `hidden` (T, H) its final hidden states."""
        if self.hidden is not None and hidden is not None:
            self.hidden.append(hidden)
        if start % self.chunk == 0 and end % self.chunk == 0:  # from a boundary to a boundary
            self.reached(end)

    def reached(self, boundary: int) -> None:
        """The state now holds exactly the prompt's first `boundary` tokens."""
        if self._fixed is not None and boundary in _kept([boundary], len(self.tokens), self.chunk):
            arrays = self._fixed.arrays()  # copies of what is updated in place
            arrays[LENGTH] = np.array([boundary], np.int64)
            self.snapshots[boundary] = arrays

    def entry(self) -> Entry | None:
        """The entry (None: nothing reusable, a prompt shorter than one chunk)."""
        if not len(self.tokens):
            return None
        fixed = None
        if self._fixed is not None:
            fixed = {b: self.snapshots[b] for b in _kept(self.snapshots, len(self.tokens), self.chunk)}
            if not fixed:
                return None
        rows = self._rows.arrays()  # views of the rows held now (no later forward changes them)
        hidden = None
        if self.hidden is not None and sum(len(h) for h in self.hidden) >= len(self.tokens):
            hidden = np.concatenate(self.hidden)[: len(self.tokens)]
        held = [*rows.values(), *(a for s in (fixed or {}).values() for a in s.values()),
                *([] if hidden is None else [hidden])]
        roots = list({id(r): r for r in map(_root, held)}.values())
        return Entry(self.tokens, rows, fixed, hidden, roots)


class PrefixCache:
    """Entries by token prefix, least recently used first out, under `budget` bytes (0: off)."""

    def __init__(self, budget: int, chunk: int = PREFILL_CHUNK):
        if chunk % BLOCK:  # a boundary inside a block: the state there depends on the tokens after it
            raise ColibriError(f"prefill_chunk must be a multiple of {BLOCK} (the layers' aligned block), got {chunk}")
        self.budget, self.chunk = budget, chunk
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # id -> entry, least recently used first
        self._buffers: dict[int, list] = {}  # id(root) -> [root, entries holding it]
        self.nbytes = 0

    def lookup(self, prompt: list[int]) -> tuple[Entry, int] | None:
        """The entry and boundary b restoring the most of `prompt`: prompt[:b] is held, and b leaves
        at least one token to feed (its logits choose the first new token). None: no such entry."""
        if not self.budget or not self.entries:
            return None
        ids = np.asarray(prompt, np.int64)
        best = None
        for entry in self.entries.values():
            n = min(len(entry.tokens), len(ids) - 1)
            differ = np.flatnonzero(entry.tokens[:n] != ids[:n])
            shared = int(differ[0]) if len(differ) else n
            b = entry.usable(shared, self.chunk)
            if b and (best is None or b > best[1]):
                best = entry, b
        return best

    def restore(self, hit: tuple[Entry, int], state: SequenceState) -> np.ndarray | None:
        """Load the state of the hit's prefix into `state` (fresh); the entry becomes the most recent.
        Returns the hidden states (b, H) of the prefix where the entry keeps them, else None."""
        entry, b = hit
        arrays = {key: a[:b] for key, a in entry.rows.items()}
        if entry.fixed is not None:
            arrays.update(entry.fixed[b])
        state.load_arrays(arrays)  # copies the rows: the entry's stay as they are
        self.entries.move_to_end(id(entry))
        return None if entry.hidden is None else entry.hidden[:b]

    def capture(self, state, prompt: list[int], hit: tuple[Entry, int] | None,
                hidden: bool = False) -> Capture | None:
        """A `Capture` for the prefill of `prompt` into `state` (restored from `hit` if not None),
        keeping the model's hidden states too where `hidden` (a model with an MTP head: its drafter
        gets them back on a restore, so it drafts as after a cold prefill); None where nothing will
        be kept (the cache is off, or the state is not a `SequenceState`)."""
        if not self.budget or not isinstance(state, SequenceState):
            return None
        inherited, rows = {}, [] if hidden else None
        if hit is not None:
            entry, b = hit
            inherited = {c: s for c, s in (entry.fixed or {}).items() if c <= b}
            if hidden:
                rows = None if entry.hidden is None else [entry.hidden[:b]]
        return Capture(state, prompt, self.chunk, inherited, rows)

    def insert(self, capture: Capture) -> None:
        """Keep what `capture` holds, unless an entry already extends it; drop the entries it extends
        (their snapshots up to where it was restored are its own), then the least recently used while
        over budget (an entry larger than the whole budget is not kept)."""
        entry = capture.entry()
        if entry is None:
            return
        for old in list(self.entries.values()):
            n, m = len(old.tokens), len(entry.tokens)
            if n >= m and np.array_equal(old.tokens[:m], entry.tokens):
                self.entries.move_to_end(id(old))
                return
            if np.array_equal(old.tokens, entry.tokens[:n]):
                self._drop(old)
        self.entries[id(entry)] = entry
        for root in entry.roots:
            held = self._buffers.setdefault(id(root), [root, 0])
            self.nbytes += root.nbytes if held[1] == 0 else 0
            held[1] += 1
        while self.nbytes > self.budget and self.entries:
            self._drop(next(iter(self.entries.values())))

    def _drop(self, entry: Entry) -> None:
        del self.entries[id(entry)]
        for root in entry.roots:
            held = self._buffers[id(root)]
            held[1] -= 1
            if held[1] == 0:
                del self._buffers[id(root)]
                self.nbytes -= root.nbytes

    def clear(self) -> None:
        """Forget every entry."""
        for entry in list(self.entries.values()):
            self._drop(entry)

    def stats(self) -> dict:
        return {"prefix_cache_bytes": self.nbytes, "prefix_cache_entries": len(self.entries),
                "prefix_cache_budget": self.budget}
