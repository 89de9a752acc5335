"""The prefix cache: the states of recent prompts, kept in RAM under a byte budget, so that a prompt
sharing a prefix with an earlier one is prefilled only past the longest part of it that can be
reused bit for bit.

    cache = PrefixCache(budget=2 << 30, chunk=256)
    hit = cache.lookup(prompt)                    # None, or (entry, b): the state of prompt[:b] is held
    state, _ = cache.restore(hit, state)          # a fresh state (or the entry's own) now holds prompt[:b]
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

A model that computes every token exactly as alone, however its forwards are cut (`MoEModel.token_exact`:
OLMoE's layers, the core's GQA attention and MoE; the kit checks it), has no blocks: every position is
such a point, the cache's `step` is 1 instead of BLOCK (a prefix of fewer than BLOCK tokens is still
neither kept nor restored: not worth it), and for a state of rows alone the state at a
turn's end — the prompt and the tokens decoded after it — is a cold prefill's and is kept too
(`Capture.ended`): a conversation's next turn is prefilled from exactly where the last one stopped.
That entry's state is finished, so the first restore taking all of its tokens is handed the state
itself (`Entry.state`), not a copy: it writes its new rows past the entry's, in buffers that
already have room for them (at OLMoE-1B-7B's dimensions cut to 4 layers, 3,087 rows in float16,
the copy's fresh pages and copying took ≈ 0.2 s of a 0.5–0.7 s turn). The entry stays valid — no
later write touches its rows — and the state is handed over once; a later restore copies.

What an entry holds (`Entry`), by state kind (kv/state.py): per-token rows (KV caches, MLA latents,
indexer keys) as views of the prompt's state, cut when restored to any multiple of the step (a state
of rows alone is reusable to within step − 1 tokens of the shared prefix, whatever the chunk); fixed-size parts
(DeltaNet / KDA states, sliding windows, compressors) snapshotted at some boundaries as they are
reached: the last one and those at chunk × 2^k (a bounded number: log2 of the prompt's chunks + 1),
plus the snapshots inherited from the entry it was restored from. An entry whose tokens a newer one
extends is dropped for it. Entries are evicted least recently used first once the arrays they hold
(each buffer counted once, however many entries view it) pass the budget.

The index is a list scanned with one vectorised comparison per entry: for 500 entries of 8,192
tokens a lookup takes about 9 ms on one core, next to a prefill of seconds (a radix tree would pay
off at many thousands of entries).

On disk (`Disk`, given a directory). An entry evicted from RAM, and every entry when the cache
closes, is written to MODEL/.prefix_cache/ID/HASH.coli_prefix: a session file (kv/session.py's
format and writer, so checksummed and atomic: a temporary file, fsync, rename) with one record whose
arrays are the entry's (its tokens as the ids, its rows cut to them, each snapshot as "@B/NAME", the
hidden states as "__hidden__") and whose meta names its boundaries. ID hashes the identity the
header holds (the model's architecture, source fingerprint and quantisation, the arithmetic, the
plugin and colibri versions, the prefill chunk: whatever changes a state's bits), so engines of
other settings keep their own entries. A new cache indexes the files of its ID from their first
bytes (header, the record's JSON, the ids) and reads an entry's arrays only when a prompt hits it,
checking every checksum then (a hit taking all of a rows-only entry reads its rows straight into a
fresh state's buffers: `Disk.load`; `PrefixCache.warm` reads the entries of before a restart back
into RAM ahead of their prompts, as a server does while idle); a file that is foreign, cut short or
damaged is deleted with one `PrefixCacheWarning`, never used. The files of every ID together stay under the disk budget, the
least recently used (by modification time: a hit touches its file) deleted first; an entry whose
tokens another extends is deleted once that one is written.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from isal.isal_zlib import crc32

from . import __version__
from .errors import ColibriError
from .fsio import SESSION_HEADER_BYTES
from .kernels.deltanet import BLOCK
from .kv.session import FORMAT_VERSION, HEAD, IDS, MAGIC, RECORD, RECORD_MAGIC, SessionFile
from .kv.state import LENGTH, SequenceState

__all__ = ["DEFAULT_SHARE", "DIRNAME", "PREFILL_CHUNK", "Capture", "Disk", "Entry", "PrefixCache",
           "PrefixCacheWarning"]

PREFILL_CHUNK = 256  # tokens between the boundaries a state is kept at: a multiple of BLOCK
DEFAULT_SHARE = 0.1  # the cache's default budget: this share of the engine's RAM budget, beside it
DIRNAME = ".prefix_cache"  # beside the model (or the demo's state dir), as sessions are
SUFFIX = ".coli_prefix"
HIDDEN = "__hidden__"  # an entry file's array of hidden states (an MTP drafter's input)


class PrefixCacheWarning(UserWarning):
    """A spilled entry was not used (foreign, cut short, damaged) or could not be written."""


def _kept(boundaries, last: int, chunk: int) -> list[int]:
    """The boundaries whose fixed-size snapshots an entry keeps: `last`, and chunk × 2^k."""
    return sorted(b for b in set(boundaries) if b == last or (b // chunk) & (b // chunk - 1) == 0)


def _usable(tokens: np.ndarray, boundaries, shared: int, step: int) -> int:
    """The furthest position ≤ `shared` a state of `tokens` can be restored at (0: none): for rows
    only (`boundaries` None) any multiple of `step` (rows cut there are a cold prefill's, whatever
    the chunk), else the furthest of the boundaries snapshotted."""
    if boundaries is None:
        b = min(shared, len(tokens)) // step * step
        return b if b >= BLOCK else 0  # fewer tokens are not worth a restore
    return max((b for b in boundaries if b <= shared), default=0)


def _shared(tokens: np.ndarray, ids: np.ndarray) -> int:
    """How many leading tokens `ids` shares with `tokens`, leaving ids' last token out (its logits
    choose the first new token)."""
    n = min(len(tokens), len(ids) - 1)
    differ = np.flatnonzero(tokens[:n] != ids[:n])
    return int(differ[0]) if len(differ) else n


def _extends(longer: np.ndarray, shorter: np.ndarray) -> bool:
    return len(longer) >= len(shorter) and np.array_equal(longer[: len(shorter)], shorter)


def _root(a: np.ndarray) -> np.ndarray:
    """The array owning `a`'s memory (a view's base, followed to the end)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


@dataclass(eq=False)
class Entry:
    """One prompt's reusable states: its first `len(tokens)` tokens (a multiple of the chunk, or of the
    cache's step for rows alone), rows for them, and fixed-size snapshots at some of the boundaries
    (None: the state is rows only, usable at every multiple of the step)."""

    tokens: np.ndarray  # (R,) int64
    rows: dict[str, np.ndarray]  # per-token parts' arrays, (≥ R, …) views
    fixed: dict[int, dict[str, np.ndarray]] | None  # boundary -> fixed-size parts' arrays there
    hidden: np.ndarray | None = None  # (R, H) the model's final hidden states: an MTP drafter's input
    roots: list[np.ndarray] = field(default_factory=list)  # the buffers it keeps alive, once each
    state: SequenceState | None = None  # a finished state holding exactly `tokens`, whose rows these view:
    # handed to the first restore of all of them (its new rows go past ours), then None

    def usable(self, shared: int, step: int) -> int:
        """The furthest position ≤ `shared` this entry's state can be restored at (0: none)."""
        return _usable(self.tokens, self.fixed, shared, step)


class Capture:
    """What the prefill of one prompt leaves for the cache: the engine stops its forwards at `stops`
    and calls `fed` after each; `PrefixCache.insert` makes an entry of it."""

    def __init__(self, state: SequenceState, prompt: list[int], chunk: int, step: int, inherited: dict[int, dict],
                 hidden: list[np.ndarray] | None):
        self.chunk, self.state = chunk, state
        parts = state.parts.items()
        # SequenceStates over the same part objects, for the names `arrays()` gives them
        self._rows = SequenceState({name: p for name, p in parts if p.per_token})
        fixed = {name: p for name, p in parts if not p.per_token}
        self._fixed = SequenceState(fixed) if fixed else None
        self.step = chunk if fixed else step  # rows alone are cut at any multiple of the step (`_usable`)
        self.tokens = np.asarray(prompt[: len(prompt) // self.step * self.step], np.int64)  # (R,)
        self.snapshots = dict(inherited)  # boundary -> fixed-size arrays ({} for a state of rows)
        self.hidden = hidden  # (T, H) rows of the positions fed so far, in order; None: not kept
        self._ended = False  # `ended`: the state holds the turn's end and no forward will extend it

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

    def ended(self, state: SequenceState, ids: list[int]) -> bool:
        """The turn ended with `state` holding `ids`, the prompt and the tokens decoded after it. A
        state of rows cut at any token (step 1), whose entry keeps no hidden states, is then a cold
        prefill's of `ids`: the entry grows to them (True: insert it again); else nothing changes."""
        if (self.step != 1 or self.hidden is not None or state is not self.state or state.length != len(ids)
                or len(ids) <= len(self.tokens)):
            return False
        self.tokens, self._ended = np.asarray(ids, np.int64), True
        return True

    def entry(self) -> Entry | None:
        """The entry (None: nothing reusable, a prompt shorter than one chunk or than BLOCK)."""
        if len(self.tokens) < BLOCK:
            return None
        fixed = None
        if self._fixed is not None:
            fixed = {b: self.snapshots[b] for b in _kept(self.snapshots, len(self.tokens), self.chunk)}
            if not fixed:
                return None
        rows = self._rows.arrays()  # views of the rows held now (no later forward changes them)
        finished = self.state if self._ended else None
        hidden = None
        if self.hidden is not None and sum(len(h) for h in self.hidden) >= len(self.tokens):
            hidden = np.concatenate(self.hidden)[: len(self.tokens)]
        held = [*rows.values(), *(a for s in (fixed or {}).values() for a in s.values()),
                *([] if hidden is None else [hidden])]
        roots = list({id(r): r for r in map(_root, held)}.values())
        return Entry(self.tokens, rows, fixed, hidden, roots, finished)


class PrefixCache:
    """Entries by token prefix, least recently used first out, under `budget` bytes (0: off); with a
    `directory`, evicted entries spill there (`Disk`, under `disk_budget` bytes: by default the RAM
    budget) and are found again by a later cache of the same `identity` (the model's; the prefill
    chunk and colibri's version are added)."""

    def __init__(self, budget: int, chunk: int = PREFILL_CHUNK, directory: Path | None = None,
                 identity: dict | None = None, disk_budget: int | None = None, step: int = BLOCK):
        if chunk % BLOCK:  # a boundary inside a block: the state there depends on the tokens after it
            raise ColibriError(f"prefill_chunk must be a multiple of {BLOCK} (the layers' aligned block), got {chunk}")
        assert step in (1, BLOCK), step
        self.budget, self.chunk, self.step = budget, chunk, step
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # id -> entry, least recently used first
        self._buffers: dict[int, list] = {}  # id(root) -> [root, entries holding it]
        self.nbytes = 0
        self.disk = None
        self.disk_hits = self.warmed = 0  # prompts restored from a spilled entry; entries `warm` read back
        self._unwarmed: list[Spilled] = []  # the entries on disk at the start, the most recently used last
        if budget and directory is not None:
            identity = {**(identity or {}), "colibri": __version__, "prefill_chunk": chunk}
            self.disk = Disk(Path(directory), identity, budget if disk_budget is None else disk_budget, step)
            self._unwarmed = sorted(self.disk.spilled.values(), key=_used)

    def lookup(self, prompt: list[int], state: SequenceState | None = None) -> tuple[Entry, int] | None:
        """The entry and boundary b restoring the most of `prompt`: prompt[:b] is held, and b leaves
        at least one token to feed (its logits choose the first new token). None: no such entry.
        An entry on disk restoring more than any in RAM is read (and kept in RAM, budget allowing);
        given the fresh `state` the prompt is to be restored into, one restoring all of its tokens
        is read into a state like it (`Disk.load`), which `restore` then returns in its place."""
        if not self.budget:
            return None
        ids = np.asarray(prompt, np.int64)
        best = None
        for entry in self.entries.values():
            b = entry.usable(_shared(entry.tokens, ids), self.step)
            if b and (best is None or b > best[1]):
                best = entry, b
        while self.disk is not None:  # a spilled entry that fails its checks is deleted: try the next best
            spilled, b = max(((s, s.usable(_shared(s.tokens, ids), self.step)) for s in self.disk.spilled.values()),
                             key=lambda hit: hit[1], default=(None, 0))
            if b <= (best[1] if best else 0):
                break
            entry = self.disk.load(spilled, state if b == len(spilled.tokens) else None)
            if entry is not None:
                self.disk_hits += 1
                self._add(entry)
                return entry, b
        return best

    def warm(self, state: SequenceState | None = None) -> bool:
        """Read back the most recently used of the entries that were on disk when the cache started
        and RAM lacks, if it fits beside what RAM holds (counted at twice its file: a state of rows is
        read into a fresh state like `state`, `Disk.load`, whose buffers leave room to grow). Returns
        whether there may be more to read. A server calls it while it has nothing to run, one entry
        at a time, so the conversations it served before a restart are RAM hits again, their next
        turns as quick as an uninterrupted server's (BENCHMARKS.md, *Many clients at once*); entries
        spilled since are not read back (RAM evicted them)."""
        while self._unwarmed:
            spilled = self._unwarmed.pop()
            if self.disk.spilled.get(spilled.path.name) is not spilled:  # deleted or replaced since
                continue
            if any(_extends(e.tokens, spilled.tokens) for e in self.entries.values()):
                continue
            if self.nbytes + 2 * spilled.nbytes > self.budget:  # the others were used longer ago
                self._unwarmed.clear()
                break
            entry = self.disk.load(spilled, state)
            if entry is not None:
                self.warmed += 1
                self._add(entry)
            return bool(self._unwarmed)
        return False

    def restore(self, hit: tuple[Entry, int], state: SequenceState) -> tuple[SequenceState, np.ndarray | None]:
        """The state of the hit's prefix: loaded into `state` (fresh), or the entry's own finished
        state where it holds exactly the prefix (handed over once: module docstring); the entry
        becomes the most recent. Returns that state, and the hidden states (b, H) of the prefix where
        the entry keeps them, else None."""
        entry, b = hit
        if entry.state is not None and entry.state.length == b == len(entry.tokens):
            state, entry.state = entry.state, None
        else:
            arrays = {key: a[:b] for key, a in entry.rows.items()}
            if entry.fixed is not None:
                arrays.update(entry.fixed[b])
            state.load_arrays(arrays)  # copies the rows: the entry's stay as they are
        if id(entry) in self.entries:  # else read from disk and larger than the RAM budget: not kept
            self.entries.move_to_end(id(entry))
        return state, None if entry.hidden is None else entry.hidden[:b]

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
        return Capture(state, prompt, self.chunk, self.step, inherited, rows)

    def insert(self, capture: Capture) -> None:
        """Keep what `capture` holds (`_add`)."""
        entry = capture.entry()
        if entry is not None:
            self._add(entry)

    def _add(self, entry: Entry) -> None:
        """Keep `entry`, unless an entry already extends it; drop the entries it extends (their
        snapshots up to where it was restored are its own), then spill the least recently used
        while over budget (an entry larger than the whole budget is not kept in RAM)."""
        for old in list(self.entries.values()):
            if _extends(old.tokens, entry.tokens):
                self.entries.move_to_end(id(old))
                return
            if _extends(entry.tokens, old.tokens):
                self._drop(old)
        self.entries[id(entry)] = entry
        for root in entry.roots:
            held = self._buffers.setdefault(id(root), [root, 0])
            self.nbytes += root.nbytes if held[1] == 0 else 0
            held[1] += 1
        while self.nbytes > self.budget and self.entries:
            old = next(iter(self.entries.values()))
            if self.disk is not None:
                self.disk.spill(old)
            self._drop(old)

    def _drop(self, entry: Entry) -> None:
        del self.entries[id(entry)]
        for root in entry.roots:
            held = self._buffers[id(root)]
            held[1] -= 1
            if held[1] == 0:
                del self._buffers[id(root)]
                self.nbytes -= root.nbytes

    def close(self) -> None:
        """Spill every entry (the least recent first: the files' times keep the order), then forget them."""
        for entry in list(self.entries.values()):
            if self.disk is not None:
                self.disk.spill(entry)
            self._drop(entry)

    def clear(self) -> None:
        """Forget every entry, in RAM and on disk."""
        for entry in list(self.entries.values()):
            self._drop(entry)
        if self.disk is not None:
            self.disk.clear()

    def stats(self) -> dict:
        disk = self.disk
        return {"prefix_cache_bytes": self.nbytes, "prefix_cache_entries": len(self.entries),
                "prefix_cache_budget": self.budget,
                "prefix_cache_disk_hits": self.disk_hits,  # prompts restored from a spilled entry
                "prefix_cache_warmed": self.warmed,  # spilled entries read back while idle (`warm`)
                "prefix_cache_disk_bytes": 0 if disk is None else disk.nbytes}


@dataclass(eq=False)
class Spilled:
    """An entry on disk as the first bytes of its file tell it; its arrays are read on a hit."""

    path: Path
    tokens: np.ndarray  # (R,) int64
    fixed: list[int] | None  # the boundaries it keeps snapshots at (None: rows only)
    nbytes: int  # the file's size

    def usable(self, shared: int, step: int) -> int:
        return _usable(self.tokens, self.fixed, shared, step)


@dataclass
class _Record:
    """An entry file's record as its header and JSON tell it (kv/session.py's format)."""

    arrays: list[dict]  # name, dtype, shape, mode, offset, nbytes of each array, in the order stored
    meta: dict  # {"boundaries": the boundaries of its snapshots, or None}
    data: int  # the bytes of the arrays, the record's last
    crc: int  # the CRC-32 of the record's payload
    size: int  # the file's bytes (its record ends the file)


class _Damaged(Exception):
    """A spilled entry that must not be used: the message says why."""


class Disk:
    """The entries spilled under `root`/ID (module docstring): `spilled` indexes this identity's
    files by name; `budget` bounds the bytes of every identity's files together; `step` is the cache's."""

    def __init__(self, root: Path, identity: dict, budget: int, step: int = BLOCK):
        self.root, self.identity, self.budget, self.step = root, identity, budget, step
        self.dir = root / hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
        self.writable = True  # False after a write failed (a read-only model directory): warned once
        self.spilled: dict[str, Spilled] = {}
        for tmp in self.dir.glob(f"*{SUFFIX}.tmp"):  # a write a kill cut short (SessionFile's temporary)
            tmp.unlink(missing_ok=True)
        for path in sorted(self.dir.glob(f"*{SUFFIX}")):
            try:
                self.spilled[path.name] = self._peek(path)
            except _Damaged as e:
                self._discard(path, str(e))

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.spilled.values())

    def _peek(self, path: Path) -> Spilled:
        """The entry in `path` from its first bytes (the session header, the record's JSON, the ids),
        its length checked against the file's size; checksums are checked when it is read (`load`)."""
        try:
            with open(path, "rb") as f:
                record, _ = self._head(f)
                ids = record.arrays[0]  # SessionFile.append writes the ids first, at offset 0
                if ids["name"] != IDS or ids["offset"] != 0:
                    raise _Damaged("has no token ids first")
                tokens = np.frombuffer(_read(f, ids["nbytes"]), np.dtype(ids["dtype"])).astype(np.int64)
                fixed = record.meta["boundaries"]
                fixed = None if fixed is None else [int(b) for b in fixed]
        except OSError as e:
            raise _Damaged(f"is unreadable ({e.strerror or e})") from None
        except (ValueError, KeyError, TypeError, IndexError, RecursionError, struct.error) as e:
            raise _Damaged(f"is damaged ({type(e).__name__})") from None
        step = self.step if fixed is None else self.identity["prefill_chunk"]
        if not len(tokens) or len(tokens) % step:
            raise _Damaged(f"holds {len(tokens)} tokens, not a multiple of {step}")
        return Spilled(path, tokens, fixed, record.size)

    def _head(self, f) -> tuple[_Record, int]:
        """The entry file open as `f`, read up to its first array (the session header, the record's
        header and JSON; `f` left there): its `_Record`, and the CRC-32 of the record's payload so
        far. Raises `_Damaged`, or what reading and parsing it raise."""
        size = os.fstat(f.fileno()).st_size
        magic, version, n = HEAD.unpack(_read(f, HEAD.size))
        if magic != MAGIC or version != FORMAT_VERSION or n > SESSION_HEADER_BYTES:
            raise _Damaged("is not a prefix cache file of this colibri (or its header is damaged)")
        identity, (crc,) = _read(f, n), struct.unpack("<I", _read(f, 4))
        if crc32(identity) != crc:
            raise _Damaged("has a damaged header")
        identity = json.loads(identity)
        if identity != self.identity:
            differ = sorted(k for k in identity.keys() | self.identity.keys()
                            if identity.get(k) != self.identity.get(k))
            raise _Damaged(f"was written by another model or with other settings ({', '.join(differ)} differ)")
        magic, length, crc = RECORD.unpack(_read(f, RECORD.size))
        if magic != RECORD_MAGIC or f.tell() + length != size:
            raise _Damaged("is cut short" if f.tell() + length > size else "has a damaged record header")
        m = _read(f, 4)
        raw = _read(f, min(struct.unpack("<I", m)[0], length))
        head = json.loads(raw)
        return _Record(head["arrays"], head["meta"], length - 4 - len(raw), crc, size), crc32(raw, crc32(m))

    def load(self, spilled: Spilled, state: SequenceState | None = None) -> Entry | None:
        """The spilled entry, read whole with its record's checksum checked, its file touched (the
        most recently used); None, the file deleted with a warning, if it is not whole or not this
        model's. Given `state`, a fresh state of rows (left as it is), the entry's rows are read
        straight into a fresh state of the same parts (`SequenceState.fill`), the entry's finished
        state: the restore taking all of its tokens is handed it, so its rows are written once, by
        the read (read into memory of their own and copied into the KV caches, a restore of 3,203
        rows at OLMoE-1B-7B's dimensions cut to 4 layers, 100 MB, took 103–107 ms; 68–73 ms now)."""
        fresh = state.empty() if isinstance(state, SequenceState) and spilled.fixed is None else None
        rows = (fresh.fill(len(spilled.tokens)) if fresh is not None else None) or {}
        try:
            try:
                with open(spilled.path, "rb", buffering=0) as f:
                    record, crc = self._head(f)  # the file as it is now
                    arrays = _read_arrays(f, record, crc, rows)
            except OSError as e:
                raise _Damaged(f"is unreadable ({e.strerror or e})") from None
            except (ValueError, KeyError, TypeError, IndexError, RecursionError, struct.error) as e:
                raise _Damaged(f"is damaged ({type(e).__name__})") from None
            if IDS not in arrays:
                raise _Damaged("holds no token ids")
            entry = _entry(arrays, record.meta)
            if not np.array_equal(entry.tokens, spilled.tokens):
                raise _Damaged("holds other tokens than its header says")
            if rows and all(entry.rows.get(name) is a for name, a in rows.items()):
                entry.state = fresh  # every row of it read in place
        except _Damaged as e:
            self._discard(spilled.path, str(e))
            return None
        self._touch(spilled.path)
        return entry

    def spill(self, entry: Entry) -> None:
        """Write `entry` (unless a spilled entry holds its tokens or extends them, or it is larger
        than the budget); delete the spilled entries it extends, then the least recently used files
        while over budget."""
        if not self.writable or any(_extends(s.tokens, entry.tokens) for s in self.spilled.values()):
            return
        arrays = {name: a[: len(entry.tokens)] for name, a in entry.rows.items()}
        for b, snapshot in (entry.fixed or {}).items():
            arrays.update((f"@{b}/{name}", a) for name, a in snapshot.items())
        if entry.hidden is not None:
            arrays[HIDDEN] = entry.hidden
        if sum(a.nbytes for a in arrays.values()) > self.budget:
            return
        path = self.dir / (hashlib.sha256(entry.tokens.tobytes()).hexdigest()[:32] + SUFFIX)
        meta = {"boundaries": None if entry.fixed is None else sorted(entry.fixed)}
        try:
            SessionFile(path, self.identity).append(entry.tokens.tolist(), arrays, meta, continues=False)
            self._touch(path)
            size = path.stat().st_size
        except (ColibriError, OSError) as e:
            self.writable = False
            warnings.warn(f"prefix cache: cannot write to {self.dir} ({e}); its entries stay in RAM only",
                          PrefixCacheWarning, stacklevel=2)
            return
        for name, old in list(self.spilled.items()):
            if _extends(entry.tokens, old.tokens):
                self._delete(old.path)
        self.spilled[path.name] = Spilled(path, entry.tokens, meta["boundaries"], size)
        self._trim()

    def _trim(self) -> None:
        """Delete the least recently used entry files, of every identity, while they pass the budget."""
        files = []
        for path in self.root.glob(f"*/*{SUFFIX}"):
            try:
                st = path.stat()
            except OSError:  # deleted meanwhile by another engine
                continue
            files.append((st.st_mtime_ns, st.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.budget:
                break
            self._delete(path)
            total -= size

    def _touch(self, path: Path) -> None:
        """Make `path` the most recently used (a clock finer than the file system's own stamps)."""
        now = time.time_ns()
        os.utime(path, ns=(now, now))

    def _discard(self, path: Path, why: str) -> None:
        warnings.warn(f"prefix cache: the spilled entry {path} {why}; deleted it", PrefixCacheWarning, stacklevel=3)
        self._delete(path)

    def _delete(self, path: Path) -> None:
        if path.parent == self.dir:
            self.spilled.pop(path.name, None)
        try:
            path.unlink(missing_ok=True)
        except OSError:  # a directory we may not write: the entry is forgotten all the same
            pass

    def clear(self) -> None:
        for spilled in list(self.spilled.values()):
            self._delete(spilled.path)


def _read_arrays(f, record: _Record, crc: int, into: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays of `record`, read from `f` (at its first array, `crc` the payload's CRC-32
    before it), each into `into`'s array of its name where that has its shape and type, else into
    fresh NumPy memory (huge pages where the kernel gives them: about twice as fast to fill as a bytes
    object's); `_Damaged` unless they fill the record and it passes its checksum."""
    arrays, at = {}, 0
    for e in record.arrays:
        dtype, shape = np.dtype(e["dtype"]), tuple(e["shape"])
        if (e["mode"] != "set" or e["offset"] != at or e["nbytes"] != dtype.itemsize * math.prod(shape)
                or at + e["nbytes"] > record.data):
            raise _Damaged("has a damaged record")
        a = into.get(e["name"])
        if a is None or a.shape != shape or a.dtype != dtype:
            a = np.empty(shape, dtype)
        raw = a.reshape(-1).view(np.uint8)  # `a` is contiguous: a view
        if f.readinto(raw) != len(raw):
            raise _Damaged("is cut short")
        crc, at = crc32(raw, crc), at + len(raw)
        arrays[e["name"]] = a
    if at != record.data or crc != record.crc:
        raise _Damaged("fails its checksum" if at == record.data else "has a damaged record")
    return arrays


def _used(spilled: Spilled) -> int:
    """When `spilled` was last used (its file's time: a hit touches it), 0 if its file is gone."""
    try:
        return spilled.path.stat().st_mtime_ns
    except OSError:
        return 0


def _read(f, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise _Damaged("is cut short")
    return data


def _entry(arrays: dict[str, np.ndarray], meta: dict) -> Entry:
    """The `Entry` an entry file's arrays (`Disk.spill`) make, its shapes checked against its tokens."""
    tokens = arrays.pop(IDS).astype(np.int64)
    hidden = arrays.pop(HIDDEN, None)
    fixed = None
    try:
        if meta["boundaries"] is not None:
            fixed = {int(b): {} for b in meta["boundaries"]}
            for key in [k for k in arrays if k.startswith("@")]:
                b, name = key[1:].split("/", 1)
                fixed[int(b)][name] = arrays.pop(key)
    except (KeyError, TypeError, ValueError):
        raise _Damaged("has snapshots its meta does not name") from None
    if fixed is not None and not all(fixed.values()):
        raise _Damaged("lacks a snapshot its meta names")
    if any(len(a) != len(tokens) for a in arrays.values()) or (hidden is not None and len(hidden) != len(tokens)):
        raise _Damaged("holds rows for another number of tokens")
    held = [*arrays.values(), *(a for s in (fixed or {}).values() for a in s.values()),
            *([] if hidden is None else [hidden])]
    return Entry(tokens, arrays, fixed, hidden, list({id(r): r for r in map(_root, held)}.values()))
