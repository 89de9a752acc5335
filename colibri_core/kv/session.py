"""Persistent sessions: a conversation's token ids and model state, saved beside the model after
every turn and resumed after a restart with exactly the tokens an uninterrupted run gives.

Works for every architecture through the `State` protocol (``length``, ``arrays()``,
``load_arrays()``): KV caches, MLA latents, indexer keys, recurrent states are all named arrays.

File ``MODEL/.sessions/NAME.coli_session``, append-only, little-endian:

- header: ``b"COLISESS"``, u32 format version, u32 n, n bytes of JSON (the model's identity:
  architecture, the container's source fingerprint, its quantisation), u32 crc32 of the JSON;
- then one record per saved turn: ``b"TURN"``, u64 payload length, u32 crc32 of the payload,
  the payload: u32 m, m bytes of JSON (``meta``, ``length``, ``turn`` and, per array, name, dtype,
  shape, ``set`` or ``append``, byte offset and size), then the array bytes.

A turn is one record: the state and the caller's ``meta`` (the chat's messages, answer included:
`PersistentSession.turn`) together, so a resume always lands on a whole turn. ``turn`` numbers the
conversation's whole turns (0: a conversation started over; files written before it was added
count their records).

A record holds only what changed: arrays that grew by whole tokens along their first axis since
the previous record of the same state are stored as the new rows (``append``); anything else
(fixed-size recurrent states) whole (``set``). A state that does not continue the saved one (a
new conversation, a prompt that rewrote history) starts the file over: written beside it and
renamed over it, so the file stays one snapshot plus the turns since. Token ids are the array
``__ids__``. A record is written with one append and fsync'd; the last complete record is the
session.

Nothing is deleted. A file that breaks off after some whole turns resumes from the last of them,
with a one-line notice, once every byte past them is kept: a crash or ``kill -9`` mid-save leaves
one unfinished record at the end, and nothing whole after the break (no record passes its checksum
there), so those bytes alone go to ``NAME.coli_session.torn``; bytes that still hold a whole record
after the break (a flipped bit in a record's length, magic or data, turns after it) are damage, and
the whole file is copied to ``NAME.coli_session.bad``. The file is then cut back to its whole
turns. A file from another model or format version, or with a damaged header, is moved aside
(``NAME.coli_session.bad``) and the session starts fresh. A file set aside never replaces an
earlier one (``.bad1``, ``.torn1``, … after it).
"""
from __future__ import annotations

import itertools
import json
import os
import re
import struct
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from filelock import FileLock, Timeout
from isal.isal_zlib import crc32  # zlib's CRC-32, the same values, several times faster (ISA-L)

from ..errors import ColibriError
from ..fsio import SESSION_HEADER_BYTES, fsync_dir

MAGIC = b"COLISESS"
FORMAT_VERSION = 1
SUFFIX = ".coli_session"
DIRNAME = ".sessions"
HEAD = struct.Struct("<8sII")  # magic, version, json length
RECORD = struct.Struct("<4sQI")  # magic, payload length, payload crc32
RECORD_MAGIC = b"TURN"
IDS = "__ids__"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def session_path(model_dir: str | os.PathLike, name: str) -> Path:
    """Where session `name` of the model in `model_dir` lives."""
    if not _NAME.fullmatch(name or ""):
        raise ColibriError(f"bad session name {name!r}: use letters, digits, '.', '_' and '-' (not first), "
                           "at most 128 characters")
    return Path(model_dir) / DIRNAME / f"{name}{SUFFIX}"


@dataclass
class Saved:
    """What a session file holds: the last complete turn."""

    ids: list[int]
    arrays: dict[str, np.ndarray]
    meta: dict
    turns: int  # complete records read


@dataclass
class SessionFile:
    """One session's append-only file. `load` first, then `append` once per turn."""

    path: Path
    identity: dict  # must equal the header's for the file to be used
    notice: str | None = None  # why a file was not (wholly) used, one line; None if it was
    _end: int = 0  # offset just past the last complete record (0: no file yet)
    _shapes: dict = field(default_factory=dict)  # shapes the file's state has after its last record

    # ---- reading ----------------------------------------------------------------------------
    def load(self) -> Saved | None:
        """The last whole turn, or None (no file, or a file refused: see `notice`). A file that breaks
        off after its whole turns is resumed from them, its other bytes kept first (module
        docstring): the file is then cut back to its whole turns, so loading it again is quiet."""
        try:  # a fresh save (written beside the file, then renamed) that a kill cut short
            self.path.with_name(self.path.name + ".tmp").unlink(missing_ok=True)
        except OSError:
            pass
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise ColibriError(f"cannot read session file {self.path}: {e.strerror}") from None
        try:
            try:
                arrays, meta, turns, end, why = self.parse(data)
            except Refused as e:
                self._move_aside(str(e))
                return None
            if why is not None:
                self._keep_past(data, end, turns, why)
        except OSError as e:
            raise ColibriError(f"cannot set aside the damaged part of session file {self.path}: "
                               f"{e.strerror or e}") from None
        self._end = end
        self._shapes = {k: v.shape for k, v in arrays.items()}
        if IDS not in arrays:  # no record
            return None
        ids = arrays.pop(IDS)
        return Saved([int(i) for i in ids], arrays, meta, turns)

    def parse(self, data: bytes | memoryview, copy: bool = True) -> tuple[dict, dict, int, int, str | None]:
        """The state (arrays), meta and turn count of the file's last whole record, the offset just
        past that record, and why the file breaks off there (None: it ends there); `Refused` for a
        file that must not be used at all. Reads only: `load` keeps what breaks off and cuts it back
        (the prefix cache parses its one-record entry files with it too). The arrays are copies, or
        with `copy` False views of `data` (unaligned: for a reader that copies them itself)."""
        if len(data) < HEAD.size or data[:8] != MAGIC:
            raise Refused("is not a colibri session file (or its header is damaged)")
        _, version, n = HEAD.unpack_from(data)
        if version != FORMAT_VERSION:
            raise Refused(f"has session format version {version}, this colibri reads version {FORMAT_VERSION}")
        if n > SESSION_HEADER_BYTES:  # checked before its JSON is parsed: a model's identity is a few hundred bytes
            raise Refused(f"has a damaged header ({n} bytes, more than the {SESSION_HEADER_BYTES} a header may be)")
        end = HEAD.size + n + 4
        if len(data) < end or crc32(data[HEAD.size: HEAD.size + n]) != struct.unpack_from("<I", data, end - 4)[0]:
            raise Refused("has a damaged header")
        try:
            identity = json.loads(bytes(data[HEAD.size: HEAD.size + n]))
        except (ValueError, RecursionError):
            identity = None
        if not isinstance(identity, dict):
            raise Refused("has a damaged header")
        if identity != self.identity:
            what = [k for k in sorted(set(identity) | set(self.identity)) if identity.get(k) != self.identity.get(k)]
            raise Refused(f"was saved by another model ({', '.join(what)} differ)")
        arrays: dict[str, np.ndarray] = {}
        meta, turns, pos = {}, 0, end
        while pos < len(data):
            payload, why = _record(data, pos)
            if payload is None:
                return arrays, meta, turns, pos, why
            try:
                arrays, meta, turn = _apply(payload, arrays, copy)
            except (ValueError, KeyError, TypeError, AttributeError, IndexError, OverflowError, RecursionError,
                    struct.error) as e:
                detail = "nested too deeply" if isinstance(e, RecursionError) else " ".join(str(e).split())[:120]
                return arrays, meta, turns, pos, f"is unreadable ({detail})"
            turns, pos = (turns + 1 if turn is None else turn), pos + RECORD.size + len(payload)
        return arrays, meta, turns, pos, None

    def _keep_past(self, data: bytes, end: int, turns: int, why: str) -> None:
        """Keep the bytes of `data` past its whole turns (`end`), then cut the file back to them:
        damage (a whole record after the break) keeps a copy of the whole file in NAME.bad, a torn
        save its own bytes in NAME.torn. `why`: what is wrong with the record at `end`."""
        where = f"resuming after turn {turns}" if turns else "starting fresh"
        if _whole_record_from(data, end):
            kept = self._write_aside(data, ".bad")
            self.notice = (f"session {self.path.stem}: the saved file is damaged at byte {end} (the record of turn "
                           f"{turns + 1} {why}) and holds whole turns after it; kept it whole as {kept.name}; {where}")
        else:
            kept = self._write_aside(data[end:], ".torn")
            self.notice = (f"session {self.path.stem}: dropped an unfinished last save ({len(data) - end} bytes: its "
                           f"record {why}); kept them in {kept.name}; {where}")
        with open(self.path, "r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())

    def _aside_names(self, suffix: str):
        """NAME.coli_session`suffix`, then `suffix`1, `suffix`2, …: a file set aside never replaces an earlier one."""
        yield self.path.with_name(self.path.name + suffix)
        for n in itertools.count(1):
            yield self.path.with_name(f"{self.path.name}{suffix}{n}")

    def _write_aside(self, data: bytes, suffix: str) -> Path:
        """Write `data` to the first free name of `_aside_names(suffix)` (fsync'd); that path."""
        for path in self._aside_names(suffix):
            try:
                with open(path, "xb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            except FileExistsError:
                continue
            fsync_dir(self.path.parent)
            return path

    def _move_aside(self, why: str) -> None:
        bad = next(p for p in self._aside_names(".bad") if not p.exists())
        os.replace(self.path, bad)
        self.notice = f"session {self.path.stem}: the saved file {why}; moved it to {bad.name} and started fresh"
        self._end, self._shapes = 0, {}

    # ---- writing ----------------------------------------------------------------------------
    def append(self, ids: list[int], arrays: dict[str, np.ndarray], meta: dict, continues: bool,
               turn: int | None = None) -> None:
        """Write one turn (number `turn`: the conversation's count of whole turns once it is saved).
        `continues`: the state is the one the file's last record holds, grown by the tokens
        ids[len(saved ids):] (so per-token arrays are written as their new rows only)."""
        arrays = {IDS: np.asarray(ids, np.int64), **arrays}
        prev_len = self._shapes[IDS][0] if continues and IDS in self._shapes else None
        entries, blobs, offset = [], [], 0
        for name, a in arrays.items():
            a = np.ascontiguousarray(a)
            prev = self._shapes.get(name)
            # grown by whole tokens: rows 0..prev_len are the ones the file already holds
            grown = (prev_len is not None and prev is not None and a.ndim >= 1 and len(prev) == a.ndim
                     and prev[0] == prev_len and a.shape[0] == len(ids) and prev[1:] == a.shape[1:])
            mode = "append" if grown else "set"
            blob = (a[prev_len:] if grown else a).tobytes()
            entries.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "mode": mode,
                            "offset": offset, "nbytes": len(blob)})
            blobs.append(blob)
            offset += len(blob)
        head = {"length": len(ids), "meta": meta, "arrays": entries}
        if turn is not None:
            head["turn"] = turn
        head = json.dumps(head).encode()
        payload = b"".join([struct.pack("<I", len(head)), head, *blobs])
        record = RECORD.pack(RECORD_MAGIC, len(payload), crc32(payload)) + payload
        try:
            self._write(record, fresh=prev_len is None)  # a state written whole starts the file over
        except OSError as e:
            raise ColibriError(f"cannot save session {self.path.stem} in {self.path.parent}: "
                               f"{e.strerror or e}") from None
        self._shapes = {name: np.shape(a) for name, a in arrays.items()}

    def _write(self, record: bytes, fresh: bool = False) -> None:
        """Append `record` (fsync'd), or with `fresh` start the file over with it: written beside it
        and renamed over it, so a crash leaves the old file whole."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = self._end == 0 or fresh
        target = self.path.with_name(self.path.name + ".tmp") if new else self.path
        with open(target, "wb" if new else "r+b") as f:
            if new:
                ident = json.dumps(self.identity, sort_keys=True).encode()
                f.write(HEAD.pack(MAGIC, FORMAT_VERSION, len(ident)) + ident + struct.pack("<I", crc32(ident)))
            else:
                f.truncate(self._end)  # drop what a save of ours that failed partway left (`load` kept any other tail)
                f.seek(self._end)
            f.write(record)
            f.flush()
            os.fsync(f.fileno())
            self._end = f.tell()
        if new:
            os.replace(target, self.path)
            fsync_dir(self.path.parent)


class Refused(Exception):
    """A session file that must not be used (another model, another version, damaged)."""


def _record(data: bytes, pos: int) -> tuple[memoryview | None, str]:
    """The payload of the record at `pos` when it is whole (its checksum holds), else None and what
    is wrong with it."""
    if len(data) - pos < RECORD.size:
        return None, "is cut short"
    magic, size, crc = RECORD.unpack_from(data, pos)
    if magic != RECORD_MAGIC:
        return None, "has a damaged header"
    start = pos + RECORD.size
    if size > len(data) - start:
        return None, "runs past the end of the file"
    payload = memoryview(data)[start: start + size]
    if crc32(payload) != crc:
        return None, "fails its checksum"
    return payload, ""


def _whole_record_from(data: bytes, pos: int) -> bool:
    """Whether the bytes from the broken record at `pos` on still hold a whole record: that record's
    own payload running to the end of the file under its checksum (its length or magic damaged), or
    a later record header whose payload passes its checksum. A save cut short holds neither: it
    writes one record at the end of the file, front to back, so it leaves a strict prefix of it."""
    view = memoryview(data)
    if len(data) - pos >= RECORD.size and crc32(view[pos + RECORD.size:]) == RECORD.unpack_from(data, pos)[2]:
        return True
    at = data.find(RECORD_MAGIC, pos + 1)
    while at >= 0:
        if len(data) - at >= RECORD.size:
            _, size, crc = RECORD.unpack_from(data, at)
            start = at + RECORD.size
            if 4 <= size <= len(data) - start and crc32(view[start: start + size]) == crc:
                return True
        at = data.find(RECORD_MAGIC, at + 1)
    return False


def _apply(payload: memoryview, arrays: dict[str, np.ndarray],
           copy: bool = True) -> tuple[dict[str, np.ndarray], dict, int | None]:
    """The arrays after one record's payload is applied to `arrays` (left as they are: a record
    that fails halfway leaves the turn before whole), its meta and its turn number (None in files
    written before records were numbered)."""
    arrays = dict(arrays)
    (n,) = struct.unpack_from("<I", payload)
    head = json.loads(bytes(payload[4: 4 + n]))
    base = 4 + n
    names = set()
    for e in head["arrays"]:
        name, shape, dtype = e["name"], tuple(e["shape"]), np.dtype(e["dtype"])
        raw = payload[base + e["offset"]: base + e["offset"] + e["nbytes"]]
        if len(raw) != e["nbytes"]:
            raise ValueError(f"array {name} runs past its record")
        if e["mode"] == "set":
            a = np.frombuffer(raw, dtype).reshape(shape)
            a = a.copy() if copy else a
        elif e["mode"] == "append":
            old = arrays[name]
            rows = np.frombuffer(raw, dtype).reshape((shape[0] - old.shape[0], *shape[1:]))
            a = np.concatenate([old, rows])
        else:
            raise ValueError(f"unknown mode {e['mode']!r}")
        arrays[name] = a
        names.add(name)
    for name in set(arrays) - names:
        del arrays[name]
    if len(arrays.get(IDS, ())) != head["length"]:
        raise ValueError("token count disagrees with the ids")
    turn, meta = head.get("turn"), head["meta"]
    if not isinstance(meta, dict) or not (turn is None or (isinstance(turn, int) and 0 <= turn < 2**53)):
        raise ValueError("a bad meta or turn number")
    return arrays, meta, turn


class SessionWarning(UserWarning):
    """A saved session could not be (wholly) used: the message says why and what happened."""


def lock(path: Path) -> FileLock:
    """Session file `path`'s lock (PATH.lock, flock), taken exclusively until it is released or the
    process ends; a ColibriError if another engine or process holds it (two engines appending to one
    session file would tear it)."""
    # not per thread: a server locks on its worker thread and closes the engine on another; flock
    # only, never a marker file that a crash would leave behind, locking the session for good
    held = FileLock(path.with_name(path.name + ".lock"), blocking=False, thread_local=False, fallback_to_soft=False)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        held.acquire()
    except Timeout:
        raise ColibriError(f"session {path.stem} is open in another engine or process ({path}); close it "
                           "there, or use another name") from None
    except OSError as e:
        raise ColibriError(f"cannot open session {path.stem} in {path.parent}: {e.strerror}") from None
    return held


class PersistentSession:
    """An engine session (`state`, `ids`: the tokens whose state is held) that is saved to its file
    after every turn (`save`) and resumed from it when opened. `meta` (JSON-able, e.g. the chat's
    messages) is saved with each turn, in the same record as the state. `notice`: one line when the
    saved file was not wholly used. `turns`: whole turns saved since the conversation began.
    `model` makes the fresh states (its `new_state()`: the engine's, so its KV cache type holds)."""

    def __init__(self, model, model_dir: str | os.PathLike, identity: dict, name: str, before_write=None):
        self.name = name
        self.file = SessionFile(session_path(model_dir, name), identity)
        self._before_write = before_write  # called before each write (the engine takes the session's lock)
        self._new_state = model.new_state
        self.state, self.ids, self.meta, self.turns = model.new_state(), [], {}, 0
        self._deferred = 0  # > 0 inside `turn()`: saves wait for the block's end
        saved = self.file.load()
        if saved is not None:
            try:
                self.state.load_arrays(saved.arrays)
                if self.state.length != len(saved.ids):
                    raise ValueError(f"the state holds {self.state.length} tokens, the ids {len(saved.ids)}")
                self.ids, self.meta, self.turns = saved.ids, saved.meta, saved.turns
            except (KeyError, ValueError, TypeError, AttributeError, IndexError) as e:
                self.state = model.new_state()
                self.file._move_aside(f"does not fit this model's state ({type(e).__name__}: {e})")
        self.notice = self.file.notice
        self._mark_saved()

    def _mark_saved(self) -> None:
        self._saved = (self.state, list(self.ids), json.dumps(self.meta, sort_keys=True))

    def save(self) -> None:
        """Append this turn to the file (nothing if nothing changed since the last save; inside
        `turn()`, at the block's end)."""
        if self._deferred:
            return
        state, ids, meta = self._saved
        if self.state is state and self.ids == ids and json.dumps(self.meta, sort_keys=True) == meta:
            return
        continues = self.state is state and self.ids[: len(ids)] == ids
        turn = self.turns + 1 if self.ids else 0  # a conversation started over (no tokens) is turn 0
        if self._before_write is not None:
            self._before_write()
        self.file.append(self.ids, self.state.arrays(), self.meta, continues, turn)
        self.turns = turn
        self._mark_saved()

    @contextmanager
    def turn(self):
        """One turn, saved as one record when the block ends: the engine's save at the end of a
        call is held back, so what the caller adds after it (the chat's answer in `meta`) lands in
        the same record as the state. A block that raises saves nothing (the file keeps the turn
        before; the engine has already put a failed call's state back)."""
        self._deferred += 1
        try:
            yield self
        finally:
            self._deferred -= 1
        self.save()

    def reset(self) -> None:
        """Start the conversation over (the next `save` records the fresh state)."""
        self.state, self.ids, self.meta = self._new_state(), [], {}
