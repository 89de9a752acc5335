"""The routing history ``.coli_usage`` in the model's state directory (beside a converted model
colibri may write in, else the user's: colibri_core/statedir.py), and the hot set chosen from it.

Every turn adds how often each (MoE layer, expert) was routed to. The file is JSON:

    {"format": "colibri-usage", "version": 1, "fingerprint": "sha256:…",   # of the model
     "moe_layers": [0, 1, …], "n_experts": 64, "turns": 12, "tokens": 873,
     "counts": [[…n_experts ints…] per MoE layer], "crc32": crc32 of the counts' JSON,
     "trace": [[[…expert ids…] per token, the last TRACE_TOKENS] per MoE layer],
     "trace_crc32": crc32 of the trace's JSON}

The trace, the routing of the latest tokens in order, is what `pin_share` replays to choose how much
of the expert budget the hot-store gets; a file without one (written before it existed) is read
whole, and the default share applies.

written atomically (a temporary file renamed over the old one). A history from another model,
another version, or a corrupt file (not JSON, nested too deeply, counts out of range, a checksum
mismatch, larger than any history of the model: `max_file_bytes`, checked before it is read) is
ignored with one warning, never half-used, and replaced at the next save; a state directory that
cannot be written is warned about once and the engine goes on without saving. A save killed midway
leaves the old file whole (and a temporary, removed by the next load).
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np

from ..errors import ColibriError
from ..fsio import read_bounded, remove_stale_temporaries, write_atomic

USAGE_FILE = ".coli_usage"
FORMAT = "colibri-usage"
VERSION = 1
MIN_HISTORY_TOKENS = 32  # tokens of history before the hot-store pins experts by itself
HYSTERESIS = 1.5  # a newcomer replaces a pinned expert only when routed this many times more often
MARGIN = 2  # … and at least this many more times
PENDING = 4096  # recorded batches kept aside at most before they are summed (`record`)
MAX_COUNT = 2**53  # a count beyond this is damage, not history (and int64 sums of such counts cannot overflow)
TRACE_TOKENS = 256  # tokens of routing kept in order, per MoE layer (`pin_share` replays them)
# the hot-store's default share of the expert budget once there is routing history: replaying the
# bench workload (tools/sim_expert_cache.py), a second session with 3/4 pinned (by usage.pin_value)
# reads 44 % (at 25 % of the experts) and 71 % (at 50 %) fewer experts per decoded token than cold
# LRU; with 1/2 pinned by routing count, 7 % and 9 % fewer. Measured (BENCHMARKS.md, issue 3): 15 %
# faster than cold at 50 %, but slower at 25 %, where the smaller cache makes misses wait for slots.
# It is the largest share the history may choose: where routing is popular only for a while (a
# prompt's own experts), a smaller hot-store and a larger cache miss less (BENCHMARKS.md, issue 21).
PIN_SHARE = 0.75
PIN_SHARES = (0.0, 0.25, 0.5, PIN_SHARE)  # the shares the routing history chooses among (`pin_share`)


class ColibriWarning(UserWarning):
    """Something colibri worked around (shown as one `colibri: warning:` line by the CLI)."""


def warn(message: str) -> None:
    warnings.warn(message, ColibriWarning, stacklevel=3)


def model_fingerprint(container) -> str:
    """What a routing history belongs to: the source weights and the expert layout."""
    source = container.manifest.get("source") or {}
    key = json.dumps([source.get("fingerprint"), list(container.moe_layers), container.n_experts])
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def default_pinned(fit: int, moe_layers: int, top_k: int, share: float) -> int:
    """Experts the default hot-store pins with `share` of a budget of `fit` experts: never so many
    that a layer's cache would hold fewer than `top_k` (where the budget allows it). The budget
    split (planning.split_budget) pins this many; `pin_share` replays the history against it."""
    return min(int(fit * share), max(0, fit - moe_layers * top_k))


def _count(c) -> bool:
    """A count the history can hold: an int from 0 to MAX_COUNT (so sums never overflow int64)."""
    return isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= MAX_COUNT


def _json_crc(value: list) -> int:
    """crc32 of `value`'s compact JSON (the counts' and the trace's checksums)."""
    return zlib.crc32(json.dumps(value, separators=(",", ":")).encode())


def max_file_bytes(layers: int, n_experts: int) -> int:
    """The bound on a history file of a model with `layers` MoE layers of `n_experts`: twice the
    largest one `_check` accepts written compactly (each count MAX_COUNT's 16 digits, each trace row
    n_experts ids), plus 64 KiB for the fixed fields; a larger file is damage, refused unread.
    61 layers of 256 experts: 33 MB; the tests' 2 layers of 8: 85 KB."""
    id_bytes = len(str(n_experts)) + 1
    counts = layers * n_experts * (len(str(MAX_COUNT)) + 1)
    trace = layers * TRACE_TOKENS * (n_experts * id_bytes + 2)
    return 2 * (counts + trace) + (64 << 10)


def _trace_ok(trace, layers: int, n_experts: int) -> bool:
    """A trace the history can hold: per MoE layer, up to TRACE_TOKENS rows of expert ids."""
    def rows_ok(rows) -> bool:
        return (isinstance(rows, list) and len(rows) <= TRACE_TOKENS
                and all(isinstance(r, list) and len(r) <= n_experts for r in rows)
                and all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e < n_experts for r in rows for e in r))
    return isinstance(trace, list) and len(trace) == layers and all(map(rows_ok, trace))


class UsageHistory:
    """Routing counts (MoE layers, experts) from earlier turns plus this session's."""

    def __init__(self, container, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else Path(container.path) / USAGE_FILE
        self.fingerprint = model_fingerprint(container)
        self.moe_layers = list(container.moe_layers)
        self.n_experts = container.n_experts
        self.past = np.zeros((len(self.moe_layers), self.n_experts), np.int64)  # from the file
        self.past_turns = self.past_tokens = 0
        self.session = np.zeros_like(self.past)  # this session's counts, not yet saved
        self.past_trace: list[list[list[int]]] = [[] for _ in self.moe_layers]  # from the file
        self.session_trace: list[list[list[int]]] = [[] for _ in self.moe_layers]  # this session's, last TRACE_TOKENS
        self.session_tokens = 0  # tokens routed through the first MoE layer this session
        self.session_turns = 0
        self._pending: list[tuple[int, np.ndarray]] = []  # recorded batches not yet in `session` (`record`)
        self._save_failed = False
        self.load()

    # -- reading

    def load(self) -> None:
        """Read the file if there is one; ignore it with one warning if it is not ours or damaged
        (the next save replaces it). Temporaries a killed save left beside it are removed."""
        remove_stale_temporaries(self.path)
        if not self.path.exists():
            return
        try:
            data = read_bounded(self.path, max_file_bytes(len(self.moe_layers), self.n_experts))
        except ColibriError as e:  # unreadable, or larger than any history of this model
            warn(f"ignoring routing history: {e}; going on without it")
            return
        d, problem = self._check(data)
        if problem:
            warn(f"ignoring routing history {self.path}: {problem}; a new one replaces it after the next turn")
            return
        self.past = np.asarray(d["counts"], np.int64)
        self.past_turns, self.past_tokens = d["turns"], d["tokens"]
        self.past_trace = d.get("trace", self.past_trace)

    def _check(self, data: bytes) -> tuple[dict | None, str | None]:
        """(the parsed file, None) if it is a whole history of this model, else (None, why not)."""
        try:
            d = json.loads(data.decode("utf-8"))
        except RecursionError:
            return None, "it is corrupt (nested too deeply)"
        except ValueError:  # not UTF-8, not JSON, a number too long
            return None, "it is corrupt (not JSON)"
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            return None, "it is not a colibri routing history"
        if d.get("version") != VERSION:
            return None, f"version {str(d.get('version'))[:20]}, this colibri reads version {VERSION}"
        if d.get("fingerprint") != self.fingerprint:
            return None, "it was recorded with another model"
        counts = d.get("counts")
        shape_ok = (d.get("moe_layers") == self.moe_layers and d.get("n_experts") == self.n_experts
                    and isinstance(counts, list) and len(counts) == len(self.moe_layers)
                    and all(isinstance(row, list) and len(row) == self.n_experts and all(map(_count, row))
                            for row in counts))
        if not shape_ok or not all(_count(d.get(k)) for k in ("turns", "tokens")):
            return None, "it is corrupt (bad counts)"
        if d.get("crc32") != _json_crc(counts):
            return None, "it is corrupt (checksum mismatch)"
        if "trace" in d:
            if not _trace_ok(d["trace"], len(self.moe_layers), self.n_experts):
                return None, "it is corrupt (bad trace)"
            if d.get("trace_crc32") != _json_crc(d["trace"]):
                return None, "it is corrupt (trace checksum mismatch)"
        return d, None

    # -- recording

    def record(self, layer_index: int, ids: np.ndarray) -> None:
        """Count one batch's routing (ids (T, k)) in the MoE layer at `layer_index`: kept aside and
        summed when the counts are next read (or PENDING batches are waiting), so the decode step's
        MoE layers add a list entry each, not a NumPy call between their kernels."""
        self._pending.append((layer_index, ids))
        if len(self._pending) >= PENDING:
            self._add_pending()

    def _add_pending(self) -> None:
        for layer_index, ids in self._pending:
            self.session[layer_index] += np.bincount(ids.ravel(), minlength=self.n_experts)[: self.n_experts]
            if layer_index == 0:
                self.session_tokens += ids.shape[0]
            trace = self.session_trace[layer_index]
            trace += ids[-TRACE_TOKENS:].tolist()
            del trace[:-TRACE_TOKENS]
        self._pending.clear()

    @property
    def counts(self) -> np.ndarray:
        """All counts known: the file's and this session's, (MoE layers, experts) int64."""
        self._add_pending()
        return self.past + self.session

    @property
    def tokens(self) -> int:
        self._add_pending()
        return self.past_tokens + self.session_tokens

    @property
    def trace(self) -> list[list[list[int]]]:
        """Per MoE layer, the routing (k expert ids a token) of its last TRACE_TOKENS tokens, oldest first."""
        self._add_pending()
        return [(past + new)[-TRACE_TOKENS:] for past, new in zip(self.past_trace, self.session_trace)]

    def pin_share(self, fit: int, top_k: int) -> float:
        """The share of an expert budget of `fit` experts (of PIN_SHARES) the hot-store should
        get: the one under which the trace, replayed out of sample, misses least (ties: the smaller).

        Each share's hot set is chosen as the store chooses it (`pin_value`, `hot_set`) from the
        routing before the trace when there are MIN_HISTORY_TOKENS of it (then the whole trace is
        replayed), else from the trace's first half (then its second half is replayed): a set chosen
        from the very tokens replayed would score routing that was popular only for a while (one
        prompt's experts) as lasting. The replay runs each layer's cache as LRU beside its pinned
        experts, from empty caches (the hot-store is read before the first prompt). 0.0 below
        MIN_HISTORY_TOKENS and where every expert fits; PIN_SHARE for a history from before traces.
        """
        layers = len(self.moe_layers)
        if self.tokens < MIN_HISTORY_TOKENS or not layers <= fit < layers * self.n_experts:
            return 0.0  # no history yet, or every expert fits (or not one a layer: the split refuses it)
        trace = self.trace
        traced = len(trace[0])  # tokens through the first MoE layer, as `tokens` counts
        if traced < MIN_HISTORY_TOKENS:
            return PIN_SHARE
        if self.tokens - traced >= MIN_HISTORY_TOKENS:
            chosen_from, replayed = self.counts - _trace_counts(trace, self.n_experts), trace
        else:
            chosen_from = _trace_counts([rows[: len(rows) // 2] for rows in trace], self.n_experts)
            replayed = [rows[len(rows) // 2:] for rows in trace]
        best, fewest = 0.0, None
        for share in PIN_SHARES:
            pinned = default_pinned(fit, layers, top_k, share)
            slots = min(self.n_experts, (fit - pinned) // layers)
            pins = hot_set(pin_value(chosen_from, slots), pinned) if pinned else set()
            misses = _lru_misses(replayed, pins, slots)
            if fewest is None or misses < fewest:
                best, fewest = share, misses
        return best

    def end_turn(self) -> None:
        self.session_turns += 1

    def save(self) -> bool:
        """Write past + session counts atomically. False (with one warning, once) if it cannot."""
        counts, trace = self.counts.tolist(), self.trace
        d = {"format": FORMAT, "version": VERSION, "fingerprint": self.fingerprint,
             "moe_layers": self.moe_layers, "n_experts": self.n_experts,
             "turns": self.past_turns + self.session_turns, "tokens": self.tokens,
             "counts": counts, "crc32": _json_crc(counts), "trace": trace, "trace_crc32": _json_crc(trace)}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)  # a state directory not made yet
            write_atomic(self.path, json.dumps(d, separators=(",", ":")).encode())
        except OSError as e:
            if not self._save_failed:
                warn(f"cannot save routing history {self.path} ({e.strerror or e}); going on without it")
            self._save_failed = True
            return False
        return True


def _trace_counts(trace: list[list[list[int]]], n_experts: int) -> np.ndarray:
    """How often each (MoE layer, expert) appears in `trace`: (MoE layers, experts) int64."""
    return np.stack([np.bincount(np.fromiter((e for row in rows for e in row), np.int64), minlength=n_experts)
                     for rows in trace])


def _lru_misses(trace: list[list[list[int]]], pins: set[tuple[int, int]], slots: int) -> int:
    """Experts read replaying `trace` (per MoE layer, tokens' expert ids) through per-layer LRU
    caches of `slots` (at least a token's experts), empty at first, beside the `pins` (layer index,
    expert) that are never read."""
    misses = 0
    for layer, rows in enumerate(trace):
        cache: OrderedDict[int, None] = OrderedDict()  # least recently used first
        for row in rows:
            wanted = [e for e in row if (layer, e) not in pins]
            for e in wanted:
                if e in cache:
                    cache.move_to_end(e)
                else:
                    misses += 1
                    cache[e] = None
            while len(cache) > max(slots, len(wanted)):
                cache.popitem(last=False)
    return misses


def pin_value(counts: np.ndarray, slots: int) -> np.ndarray:
    """What pinning each (MoE layer, expert) is worth beside a cache of `slots` per layer: `hot_set`'s
    input, (MoE layers, experts) float64 like `counts`.

    The cache keeps a layer's next most-routed experts, so pinning a layer's top p covers about its
    top p + slots: an expert is worth first the count of the expert `slots` places below it in its
    layer's ranking (0 past the end: a layer routed to no more experts than its cache holds needs
    no pin; a layer routed widely gets more pins), then its own count (what capacity is left goes
    to the most routed). Never-routed experts are worth 0.
    """
    order = np.argsort(-counts, axis=1, kind="stable")  # each layer's experts, most routed first
    ranked = np.take_along_axis(counts, order, axis=1)
    below = np.zeros(counts.shape)
    below[:, : max(0, counts.shape[1] - slots)] = ranked[:, slots:]
    value = np.empty(counts.shape)
    np.put_along_axis(value, order, below, axis=1)
    return value * (float(counts.max(initial=0)) + 1) + counts


def hot_set(counts: np.ndarray, capacity: int, current: set[tuple[int, int]] | None = None) -> set[tuple[int, int]]:
    """The (layer index, expert) pairs to pin: the `capacity` most routed ones, with hysteresis.

    Starting from `current`, a pair outside it replaces the least routed pinned pair only when routed
    more than HYSTERESIS × as often and MARGIN more times, so the set does not thrash between turns.
    Never-routed experts are never pinned. Ties go to the lower (layer, expert). The store passes
    `pin_value`s as `counts` (the same comparisons, on what a pin is worth).
    """
    if capacity <= 0:
        return set()
    flat = counts.ravel()
    E = counts.shape[1]
    order = sorted((i for i in range(flat.size) if flat[i] > 0), key=lambda i: (-flat[i], i))
    pairs = [(i // E, i % E) for i in order]
    if not current:
        return set(pairs[:capacity])
    count = lambda p: int(counts[p])  # noqa: E731
    pinned = sorted((p for p in current if count(p) > 0), key=lambda p: (count(p), p))[:capacity]
    pinned_set = set(pinned)
    newcomers = [p for p in pairs if p not in pinned_set]
    while len(pinned) < capacity and newcomers:  # room left: take the hottest
        pinned.append(newcomers.pop(0))
    pinned.sort(key=lambda p: (count(p), p))
    for new in newcomers:
        if not pinned or not (count(new) > HYSTERESIS * count(pinned[0]) and count(new) >= count(pinned[0]) + MARGIN):
            break
        pinned.pop(0)
        pinned.append(new)
        pinned.sort(key=lambda p: (count(p), p))
    return set(pinned)
