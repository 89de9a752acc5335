"""The per-sequence state protocol (`State`) and the one state every shipped architecture uses:
`SequenceState`, named parts of the core's state kinds, with saving, loading and its validation,
truncation and copying written here once.

A model declares its state in `new_state` and writes no State class:

    def new_state(self, kv_cache: str = "f32") -> kv.SequenceState:
        return kv.SequenceState({f"layer.{i}": KVCache(heads, head_dim, kv_cache) for i in range(layers)})

and its forward finds a part by name (`state["layer.3"]`) and calls `state.advance(T)` once it has
run T tokens. The kinds (each a part; every one says which it is, `per_token`):

- per-token rows, one row per token, never changed once written, cut to any prefix (`truncate`):
  `kv.cache.KVCache` (keys and values, "PART.k", "PART.v"), `kv.cache.Rows` (DSA indexer keys:
  "PART"), `layers.mla.MLACache` (latent and rope key: "PART.latent", "PART.k_rope");
- fixed-size states, which fold tokens in and cannot drop them (a prefix cache is to checkpoint
  them at positions it chooses instead): `layers.deltanet.DeltaNetState` and `layers.kda.KDAState`
  ("PART.conv", "PART.recurrent"), `layers.sink_attention.SlidingWindow` ("PART.window"),
  `kv.cache.WindowKV` (a GQA sliding window's keys and values: "PART.k", "PART.v"),
  `layers.compressor.CompressorState` ("PART.entries", "PART.buffer_kv", … ).
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

__all__ = ["LENGTH", "Part", "SequenceState", "State"]

LENGTH = "length"  # the array holding a state's token count where its rows cannot tell it


class State:
    """Base class of an architecture's per-sequence state (`SequenceState` is the core's)."""

    @property
    def length(self) -> int:
        """Tokens whose state is held."""
        raise NotImplementedError

    def arrays(self) -> dict[str, np.ndarray]:
        """Everything needed to resume, as named arrays (e.g. "layer.3.k": (length, Hkv, D)).

        Arrays no later forward modifies (part of the plugin contract): the engine takes them
        before a call and, if the call fails midway (a read error, MemoryError, Ctrl-C), rebuilds
        the session's state from them (`load_arrays` into a fresh state). So rows appended to a
        cache are views (rows once written never change: `KVCache.view`, `Rows.view`), and a state
        updated in place (a recurrent state) is copied, unless it is replaced rather than modified.
        Taken once per call, not per token."""
        raise NotImplementedError

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore what `arrays()` returned (into a fresh state of the same model)."""
        raise NotImplementedError

    def truncate(self, length: int) -> bool:
        """Forget every token past the first `length`, in place, if this state can: a state made only
        of per-token rows (KV caches, latents, indexer keys) sets their lengths and returns True; one
        that folds tokens into a running state (a recurrence, a compressor's window) cannot and
        returns False (the default). Speculative decoding uses it to drop rejected drafts without
        feeding the kept tokens again; the rows past `length` are then overwritten, so arrays taken
        while they were held stop being valid past `length` (the engine only truncates past the
        arrays it keeps)."""
        return False


class Part(Protocol):
    """One part of a `SequenceState` (a state kind of the core). Per-token parts also have `length`
    and `truncate(length)`; fixed-size ones `varying`: {suffix: most rows (None: any)} for the
    arrays whose first axis varies (a window filling up; the others keep their fresh shape)."""

    per_token: bool  # True: rows per token; False: a fixed-size state

    def arrays(self) -> dict[str, np.ndarray]:
        """{suffix: array}, named "PART.suffix" in the state ("PART" for the suffix ""): views of
        rows, copies of arrays updated in place."""

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore `arrays()` output into this fresh part (the state has checked names and shapes)."""

    def empty(self) -> Part:
        """A fresh part of the same kind and shapes, holding nothing."""

    # Optional, per-token parts only: fill(T) -> {suffix: array}, this fresh part now holding T
    # tokens whose rows the caller writes into the (T, …) arrays returned, views of the part's own
    # buffers in its element type. A reader of saved rows writes them there straight from a file
    # (the prefix cache's disk hits), where `load_arrays` would copy them once more.


class SequenceState(State):
    """A sequence's state: named parts (see the module docstring), in the order given.

    `arrays()` names each part's arrays after it, plus "length" (1,) int64 where a part is
    fixed-size (per-token rows tell the length themselves, so a state of rows only has no such
    array: the names every shipped plugin's sessions were saved with)."""

    def __init__(self, parts: dict[str, Part]):
        self.parts = dict(parts)
        self._length = 0

    def __getitem__(self, name: str) -> Part:
        return self.parts[name]

    @property
    def length(self) -> int:
        return self._length

    def advance(self, n: int) -> None:
        """The forward ran `n` more tokens (its parts hold them)."""
        self._length += n

    @property
    def per_token(self) -> bool:
        """Every part is per-token rows: the state cuts to any prefix."""
        return all(p.per_token for p in self.parts.values())

    def _named(self):
        """(array name, part name, suffix, array) of every part's arrays, in order."""
        for name, part in self.parts.items():
            for suffix, a in part.arrays().items():
                yield (f"{name}.{suffix}" if suffix else name), name, suffix, a

    def arrays(self) -> dict[str, np.ndarray]:
        out = {} if self.per_token else {LENGTH: np.array([self._length], np.int64)}
        out.update((key, a) for key, _, _, a in self._named())
        return out

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore `arrays()` output into this fresh state. Arrays of another model (another name or
        shape) raise a one-line ValueError naming the first mismatch, before anything is changed."""
        want = self.arrays()
        odd = sorted(set(arrays) ^ set(want))
        if odd:
            raise ValueError(f"state array {odd[0]} is {'unexpected' if odd[0] in arrays else 'missing'}: "
                             "the state is not from this model")
        length = self._saved_length(arrays, want)
        loads: dict[str, dict[str, np.ndarray]] = {name: {} for name in self.parts}
        for key, name, suffix, fresh in self._named():
            got = np.shape(arrays[key])
            least, most = _first_axis(self.parts[name], suffix, fresh, length)
            if (len(got) != fresh.ndim or got[1:] != fresh.shape[1:] or got[0] < least
                    or (most is not None and got[0] > most)):
                first = least if least == most else "any" if most is None else f"≤{most}"
                need = ", ".join(map(str, [first, *fresh.shape[1:]]))
                raise ValueError(f"state array {key} has shape {list(got)}, this model needs [{need}] for {length} "
                                 "tokens: the state is not from this model")
            loads[name][suffix] = arrays[key]
        for name, part in self.parts.items():
            part.load_arrays(loads[name])
        self._length = length

    def _saved_length(self, arrays: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> int:
        """The token count `arrays` hold: their "length", or the rows' (a state of rows only)."""
        if LENGTH in want:
            n = np.asarray(arrays[LENGTH])
            if n.shape != (1,) or n.dtype.kind not in "iu" or n[0] < 0:
                raise ValueError(f"state array {LENGTH} is {n.dtype} {list(n.shape)}, not one token count: "
                                 "the state is not from this model")
            return int(n[0])
        first = np.shape(arrays[next(iter(want))]) if want else (0,)
        return first[0] if first else 0

    def truncate(self, length: int) -> bool:
        if not self.per_token:
            return False
        assert 0 <= length <= self._length, (length, self._length)
        for part in self.parts.values():
            part.truncate(length)
        self._length = length
        return True

    def fill(self, length: int) -> dict[str, np.ndarray] | None:
        """This fresh state of rows now holds `length` tokens, whose rows the caller writes into the
        arrays returned, named as `arrays()` names them (`Part.fill`); None, and nothing changed,
        where a part is fixed-size or has no `fill`."""
        if not self.per_token or not all(hasattr(p, "fill") for p in self.parts.values()):
            return None
        out = {}
        for name, part in self.parts.items():
            out.update(((f"{name}.{suffix}" if suffix else name), a) for suffix, a in part.fill(length).items())
        self._length = length
        return out

    def empty(self) -> SequenceState:
        """A fresh state of the same parts, holding nothing."""
        return SequenceState({name: part.empty() for name, part in self.parts.items()})

    def copy(self) -> SequenceState:
        """An independent state holding the same tokens (fresh parts, loaded from `arrays()`)."""
        twin = self.empty()
        twin.load_arrays(self.arrays())
        return twin


def _first_axis(part: Part, suffix: str, fresh: np.ndarray, length: int) -> tuple[int, int | None]:
    """(least, most) rows along the first axis that array `suffix` of `part` (`fresh` in a fresh
    part) holds in a state of `length` tokens; most None: any."""
    if part.per_token:
        return length, length
    if suffix in part.varying:
        return 0, part.varying[suffix]
    return fresh.shape[0], fresh.shape[0]
