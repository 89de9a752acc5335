"""ExpertStore: where a layer's routed experts come from.

Per MoE layer: a cache of `slots` experts under an eviction policy, plus the experts pinned in the
hot-store (chosen from the routing history, revised at turn boundaries with hysteresis). A layer
asks for the *batch union* of its experts (`experts`): each one is read at most once; the reads
start at once on the C I/O pool, and the layer computes the experts already resident while they
run, then the read ones in groups as they arrive; misses past the layer's free slots (a cache under
top-k slots a layer) are read at once into buffers of their own (`transient`), dropped once computed,
up to the budget's allowance. Before that it asks the caller for its guesses of
the next `lookahead` MoE layers' experts (router lookahead: the core's MoE block runs each later
layer's declared router on the current residual stream) and queues reads for them, nearest first,
behind this layer's own, so later layers' reads overlap this layer's compute; each guess is scored
when its layer runs, and a rank whose guesses for that layer from that distance have lately been
mostly wrong is not read (PREFETCH_MIN_PRECISION). A demand read that finds the cache full takes
the slot of a wrong guess still being read rather than wait for that read (which ends as an orphan).

Pinned experts are read in the background, hottest first, behind the demand reads: at most one at
a time while layers' reads are in flight, one per I/O thread while the disk is idle (`warm_up`
reads them all at once and waits). A layer that needs a pinned expert not read yet reads it at once.

The store is a passive cache: it knows no model, engine or plugin registry. It is handed the
container, the eviction policy and what to read; it is told what will be needed. It is asked for
experts by the expert source (colibri_core/experts.py), which with remote shards
(colibri_core/remote) keeps it the cache in front of them: the source asks it which experts are
`resident`, has the others computed remotely and passes those as `skip`, tells the lookahead which
experts a live shard serves (`Lookahead.elsewhere`: never read from disk ahead), and has it `fill`
free slots with experts a shard computed.

Placement changes speed only: every expert is handed to the kernels as the same QTensor views of
its extent, verified (crc32 computed by the I/O thread against the trailer and the manifest, layer
and expert) on every read from disk, so an I/O error or
corruption raises an error (or falls back to the primary copy) and never produces a wrong token;
a failed read leaves nothing cached, so the next request for that expert reads it again.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import numpy as np

from .. import kernels
from ..errors import ColibriError
from . import mirror as mirror_mod
from .io import IOPool
from .policies import PolicyInfo
from .stats import Placement, StoreCounters
from .usage import UsageHistory, hot_set, pin_value, warn

# Router lookahead reads a single token's guess of a given rank (its router's first choice, second …)
# for a layer only while the guesses of that rank for that layer the cache lacked have lately been
# right often enough: (right + 2) / (guesses + 3) ≥ PREFETCH_MIN_PRECISION, the counts decayed by
# PREFETCH_DECAY per guess (a memory of ~20 guesses; a (layer, rank) starts at 2/3, and a wrong
# first guess stops it until it scores better). A wrong guess costs a read, its checksum and a slot.
# Measured (BENCHMARKS.md) on the first synthetic OLMoE, whose later layers routed nearly every token
# to the same experts: with the hot-store holding those (a learned session at 50 % of the experts)
# nearly every guess the cache lacked was wrong, and reading them cost 15 % of decode time; leaving
# out ranks under 0.65 (against 0.5) cut cold 25 % decode time 7 %; scoring per layer (the early
# layers' guesses were right far more often than the late ones') cut misses 8–14 %. On the corrected
# model the guesses are mostly right and the gate changes neither reads (±2 %) nor time.
PREFETCH_MIN_PRECISION = 0.65
PREFETCH_DECAY = 0.95
# The gate scores each distance apart ((layer, distance, rank)); a guess two or three MoE layers ahead
# (--lookahead 2, 3) is read only at PREFETCH_MIN_PRECISION_AHEAD, so it starts unread and earns its
# reads (9 right in a row). It saves only the head start over the nearer guess that would read the
# same expert a layer later, while a wrong one costs a read and a slot as any: gated at 0.65 like the
# next layer's, reading 2 and 3 layers ahead read 7 % and 12 % more bytes a token than 1 layer (a cold
# 50 % session at OLMoE size, skewed routers; the reads' precision 91 % and 88 % against 93 %) for no
# time; at 0.9, 0.3 % and 0.6 % more, the I/O stall 2-3 ms a token less (BENCHMARKS.md).
PREFETCH_MIN_PRECISION_AHEAD = 0.9


class GuessRecord:
    """How often the lookahead's guesses of each (layer, distance, rank) were right lately
    (PREFETCH_MIN_PRECISION)."""

    def __init__(self):
        self._counts: dict[tuple[int, int, int], list[float]] = {}  # (layer, distance, rank) -> [right, guesses], decayed

    def score(self, layer: int, distance: int, rank: int, right: bool) -> None:
        counts = self._counts.setdefault((layer, distance, rank), [0.0, 0.0])
        counts[0] = counts[0] * PREFETCH_DECAY + right
        counts[1] = counts[1] * PREFETCH_DECAY + 1

    def worth_reading(self, layer: int, distance: int, rank: int) -> bool:
        right, guessed = self._counts.get((layer, distance, rank), (0.0, 0.0))
        return (right + 2) / (guessed + 3) >= (PREFETCH_MIN_PRECISION if distance == 1 else PREFETCH_MIN_PRECISION_AHEAD)


class Lookahead(NamedTuple):
    """What a layer tells the store of a later MoE layer (router lookahead): `guess()` returns the ids
    (T, k) that layer will likely need, each token's likeliest first, or None; `distance` how many MoE
    layers ahead it is (1: the next); the experts of that layer in `elsewhere` are computed elsewhere
    (a live remote shard) and never read ahead here."""

    layer: int
    guess: Callable[[], np.ndarray | None]
    elsewhere: frozenset = frozenset()
    distance: int = 1


@dataclass
class DistanceCounts:
    """The lookahead's counters of one distance (`ExpertStore.stats()["prefetch_by_distance"]`)."""

    issued: int = 0  # reads started for its guesses
    used: int = 0  # of those, experts their layer then needed (prefetch hits)
    skipped: int = 0  # guesses not read: the gate
    predicted_needed: int = 0  # experts layers needed that its guess had named
    needed: int = 0  # experts needed in layers it guessed

    def recall(self) -> float:
        """Of the experts layers needed, the share this distance's guesses named."""
        return self.predicted_needed / self.needed if self.needed else 0.0

    def as_dict(self) -> dict:
        return {"issued": self.issued, "used": self.used, "skipped": self.skipped, "recall": self.recall()}


@dataclass
class StoreConfig:
    slots: int  # cache slots per MoE layer (pinned experts are not counted here)
    policy: PolicyInfo  # eviction policy (`Registry.cache_policy(name)`: colibri_register_cache_policies)
    pinned: int = 0  # hot-store capacity in experts, over all MoE layers (0: no pinning)
    prefetch: bool = True  # router lookahead prefetch of later layers' experts
    lookahead: int = 1  # MoE layers ahead the lookahead reads (1: the next; at most layers.moe.LOOKAHEAD_DISTANCES)
    direct: bool = False  # read with O_DIRECT (falls back where refused: with a warning if `direct_asked`)
    direct_asked: bool = True  # O_DIRECT was asked for (--direct), not chosen by default (planning.read_direct)
    mirror: str | None = None  # a byte-identical copy of the container on another disk
    io_threads: int = 4  # threads of the C I/O pool
    transient: int = 0  # reads a layer may have beyond its cache slots (buffers of their own, dropped once computed)
    usage: UsageHistory | None = None  # the routing history to count routing in and pin from (None: none)


class _Entry:
    """An expert in a cache or the hot-store: being read (`read`), parsed (`tensors`), or (hot-store
    only) neither yet: queued for a background read. `prefetched`: the distance of the lookahead
    guess that read it, until a layer uses it (0: not a prefetch)."""

    __slots__ = ("read", "tensors", "prefetched")

    def __init__(self, read=None, tensors=None, prefetched: int = 0):
        self.read, self.tensors, self.prefetched = read, tensors, prefetched


class ExpertStore:
    """Per-layer expert caches and hot-store over the container (its stripe directory, its mirror),
    with counters (also per disk read from: `disks`)."""

    def __init__(self, container, slots: int, policy: PolicyInfo, **options):
        """Per-layer caches of `slots` experts of the open `container`, evicting under `policy`; the
        other options are `StoreConfig`'s. Starts the I/O threads last, after everything that can
        fail; `close` them."""
        if slots < 1:
            raise ValueError("the expert cache needs at least one slot per layer")
        self.config = cfg = StoreConfig(slots=slots, policy=policy, **options)
        self.container = container
        self.slots = min(slots, container.n_experts)
        layers = tuple(container.moe_layers)
        self.layer_index = {layer: i for i, layer in enumerate(layers)}
        self.policies = {layer: policy.factory(slots=self.slots, n_experts=container.n_experts) for layer in layers}
        self.cache: dict[int, dict[int, _Entry]] = {layer: {} for layer in layers}
        self.pinned: dict[int, dict[int, _Entry]] = {layer: {} for layer in layers}
        self.counters = StoreCounters()
        self._step_reads: set[tuple[int, int]] = set()  # (layer, expert) read since `new_step`
        self._predicted: dict[tuple[int, int], set[int]] = {}  # (layer, distance) -> experts guessed for it
        self._guesses: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (layer, distance) -> (expert, rank) guessed, not resident
        self._guess_record = GuessRecord()
        self.by_distance = {d: DistanceCounts() for d in range(1, cfg.lookahead + 1)}
        self._tables: dict = {}  # layer -> kernels.ExpertTable of a layer holding all its experts (`resident_table`)
        self._pin_queue: list[tuple[int, int]] = []  # (layer, expert) pinned but not read yet, hottest first
        self._pin_reads: list = []  # background reads of pinned experts that may be in flight
        self._layer_reads: list = []  # demand and lookahead reads that may be in flight
        self._orphans: list = []  # reads of experts evicted while in flight (wrong prefetches)
        self.pool = None  # the I/O threads, started once nothing before them has failed
        self.sources = [mirror_mod.Source(container, cfg.direct, "primary", cfg.direct_asked)]
        self.stripe = self.sources[0].stripe  # experts striped across two disks (`colibri stripe`), or None
        self.disks: dict[str, dict] = {}  # "primary" | "stripe" | "mirror" -> reads, bytes and read seconds (`--stats`)
        self.primary_share = 1.0
        self._retired = []  # a mirror that failed (its files are closed with the others)
        try:
            if cfg.mirror is not None:
                m = mirror_mod.open_mirror(container, cfg.mirror)
                self.sources.append(mirror_mod.Source(m, cfg.direct, "mirror", cfg.direct_asked))
                bw = [s.measure() for s in self.sources]
                self.primary_share = bw[0] / (bw[0] + bw[1])
            else:
                self.sources[0].fd(layers[0]) if layers else None  # O_DIRECT refused: say so now
            self.usage = cfg.usage
            self.pool = IOPool(cfg.io_threads, keep_huge_pages=self.slots == container.n_experts)
            if cfg.pinned and self.usage is not None:
                self._repin()
        except BaseException:
            self.close()
            raise

    # ---- a layer's experts ---------------------------------------------------------------
    def experts(self, layer: int, ids: np.ndarray, predict: Sequence[Lookahead] = (), skip=frozenset(),
                record: bool = True):
        """Yield {expert: (gate, up, down)} groups covering the batch union of `ids` (T, k).

        First the experts already resident, then the others as their reads arrive (each group: the
        next to arrive and every other that has meanwhile). `predict` (later layers, nearest first):
        once this layer's reads are queued, for each of them up to `lookahead` layers ahead whose
        experts are not all resident already, the store asks for its guess and starts reading the
        guessed experts. Call `next` only after computing the
        group yielded before: its experts may then be evicted. Experts in `skip` are computed
        elsewhere (remote shards): neither read nor counted; `record` False leaves the routing
        history alone (a second call for the same tokens: the experts of a remote shard that
        failed; `get`).
        """
        c = self.counters
        self._reap_orphans()
        if self.usage is not None and record:
            self.usage.record(self.layer_index[layer], ids)
        need = sorted(set(np.asarray(ids).ravel().tolist()).difference(skip))  # the batch union, ascending
        protected = set(need)  # never evicted until computed
        for d, counts in self.by_distance.items():  # score the lookahead's guesses for this layer
            predicted = self._predicted.pop((layer, d), None)
            if predicted is not None:
                counts.needed += len(need)
                counts.predicted_needed += len(predicted.intersection(need))
                if d == 1:  # `prefetch_recall`: the next layer's guess, as before there were others
                    c.needed_after_prediction += len(need)
                    c.predicted_needed += len(predicted.intersection(need))
            for e, rank in self._guesses.pop((layer, d), ()):
                self._guess_record.score(layer, d, rank, e in protected)
        cache, pinned, policy = self.cache[layer], self.pinned[layer], self.policies[layer]
        ready, waiting = {}, []
        for e in need:
            entry = pinned.get(e) or cache.get(e)
            c.absent += entry is None
            if entry is not None and entry.read is None and entry.tensors is None:  # pinned, not read yet
                entry.read = self._submit(layer, e)
                self._layer_reads.append(entry.read)
                entry = None  # … a miss: read on demand
            c.lookup(layer, entry is not None)
            if entry is None:
                waiting.append(e)
                continue
            if e in cache:
                policy.on_hit(e)
            if entry.prefetched:
                c.prefetch_used += 1
                self.by_distance[entry.prefetched].used += 1
                entry.prefetched = 0
            if entry.read is None or self.pool.done(entry.read):
                ready[e] = self._tensors(layer, e, entry, stall=False)
            else:
                waiting.append(e)
        # demand reads first, as many as the cache has room for now; past that, while the layer needs
        # more experts than its cache holds (a budget under top-k slots a layer), up to `transient`
        # more into buffers of their own, dropped once computed, so that all of them are read at once
        transient: dict[int, _Entry] = {}
        for e in waiting:
            if e in cache or e in pinned:
                continue
            if self._make_room(layer, protected, block=False, demand=True):
                self._insert(layer, e, prefetched=0)
            elif len(transient) < self.config.transient:
                transient[e] = _Entry(read=self._submit(layer, e))
                self._layer_reads.append(transient[e].read)
        self._lookahead(predict)  # queued behind this layer's reads
        self._read_pinned()  # … and the hot-store behind both
        if ready:
            yield ready
            protected.difference_update(ready)
        # experts being read first: a deferred one may need the slot of one of them once computed.
        # Wait for the first still waiting; every other one whose read has finished meanwhile
        # joins its group, so the kernels run once per batch of arrivals, not once per expert.
        def held(e: int) -> _Entry | None:
            return pinned.get(e) or cache.get(e) or transient.get(e)

        waiting.sort(key=lambda e: held(e) is None)
        try:
            while waiting:
                e, waiting = waiting[0], waiting[1:]
                entry = held(e)
                if entry is None:  # deferred: the cache was full of experts this layer still needed
                    self._make_room(layer, protected, block=True, demand=True)
                    entry = self._insert(layer, e, prefetched=0)
                group = {e: self._tensors(layer, e, entry, stall=True)}
                still = []
                for other in waiting:
                    entry = held(other)
                    if entry is not None and self._settled(entry):
                        group[other] = self._tensors(layer, other, entry, stall=False)
                    else:
                        still.append(other)
                waiting = still
                yield group
                protected.difference_update(group)
                for computed in group:
                    transient.pop(computed, None)
        finally:  # a pass that stopped early: reads of its own still in flight end as orphans
            self._orphans += [entry.read for entry in transient.values() if entry.read is not None]

    def resident_table(self, layer: int, predict: Sequence[Lookahead] = ()):
        """The C table (kernels.ExpertTable) of every expert of `layer` when the layer holds all of
        them, read, none a prefetch not yet used, with the lookahead `predict` started as `experts`
        does; else None (call `experts`, which does both). The caller then counts the routing it
        ran over the table (`count_resident`).

        A layer that holds all its experts never evicts one (nothing new can come in), so the table
        stays valid until the layer changes (`_changed`); the MoE block runs such a layer in one C
        call, without per-expert Python. (The cache policy hears of no hits there: it has nothing
        to choose in that layer.)"""
        table = self._tables.get(layer)
        if table is None:
            if not self.holds_all(layer):
                return None
            cache, pinned = self.cache[layer], self.pinned[layer]
            entries = [pinned.get(e) or cache.get(e) for e in range(self.container.n_experts)]
            if any(entry is None or entry.prefetched or not (entry.tensors is not None or
                   (entry.read is not None and self.pool.done(entry.read))) for entry in entries):
                return None
            table = self._tables[layer] = kernels.ExpertTable(
                [self._tensors(layer, e, entry, stall=False) for e, entry in enumerate(entries)])
        self._lookahead(predict)
        if self._pin_queue:
            self._read_pinned()
        return table

    def holds_all(self, layer: int) -> bool:
        """Whether the layer's cache and hot store hold every one of its experts (read or being read)."""
        return len(self.cache[layer]) + len(self.pinned[layer]) == self.container.n_experts

    def count_resident(self, layer: int, ids: np.ndarray) -> None:
        """Count the lookups of `ids` (T, k), routed over `resident_table(layer)`: the batch union,
        every one a hit, and the routing into the usage history, as `experts` counts its own."""
        if self.usage is not None:
            self.usage.record(self.layer_index[layer], ids)
        self.counters.lookup(layer, True, len(set(ids.ravel().tolist())))

    def _changed(self, layer: int) -> None:
        """Layer `layer`'s experts changed (an insert, an eviction, a failed read, re-pinning)."""
        self._tables.pop(layer, None)

    def resident(self, layer: int) -> set[int]:
        """Experts of `layer` ready here now (cached or pinned, read; not those still being read)."""
        return {e for d in (self.cache[layer], self.pinned[layer]) for e, entry in d.items()
                if entry.tensors is not None or (entry.read is not None and self.pool.done(entry.read))}

    def fill(self, layer: int, experts) -> int:
        """Start reading `experts` (computed elsewhere this time: remote shards) into the layer's free
        cache slots, never evicting, so later tokens compute them here: the store as a cache in front
        of the shards (the expert source asks). Returns how many reads it started."""
        cache, pinned, n = self.cache[layer], self.pinned[layer], 0
        for e in sorted(experts):
            if len(cache) >= self.slots:
                break
            if e not in cache and e not in pinned:
                self._insert(layer, e, prefetched=0)
                n += 1
        return n

    def get(self, layer: int, expert: int):
        """(gate, up, down) QTensors of one expert (reads it if it is not resident). Not routing:
        the routing history is left alone (tools that read every expert in would skew it)."""
        for group in self.experts(layer, np.array([[expert]]), record=False):
            return group[expert]

    # ---- reads ---------------------------------------------------------------------------
    def _submit(self, layer: int, expert: int, which: int | None = None):
        """Start reading one expert from source `which` (0 primary, 1 mirror; default: the mirror's
        weighted choice)."""
        c = self.counters
        if which is None:
            which = 0 if len(self.sources) == 1 else mirror_mod.choose(layer, expert, self.primary_share)
        src = self.sources[which]
        extents = src.container.expert_extents(layer, expert)  # a striped expert's: in the stripe directory
        path, offset, nbytes = extents[0]
        if len(extents) == 1:  # a container's extent: one pread, crc'd by the I/O thread
            read = self.pool.submit(src.fd_for(path, nbytes), offset, nbytes, layer=layer, expert=expert, source=src,
                                    path=path, crc_hole=src.container.crc_hole(layer))
        else:  # a checkpoint run as it is, its expert's tensors apart: sorted reads
            read = self.pool.submit_group([(src.fd_for(p, n), o, n) for p, o, n in extents], layer=layer,
                                          expert=expert, source=src, path=path)
        c.reads += 1
        c.bytes_read += sum(n for _, _, n in extents)
        c.mirror_reads += which
        disk = self.disks.setdefault(src.disk(layer, expert), {"reads": 0, "bytes": 0, "read_seconds": 0.0})
        disk["reads"] += 1
        disk["bytes"] += sum(n for _, _, n in extents)
        if (layer, expert) in self._step_reads:
            c.step_rereads += 1
        self._step_reads.add((layer, expert))
        return read

    def new_step(self) -> None:
        """A forward step begins (a solo forward, or a batch's step for all its generations):
        `step_rereads` counts an expert read twice within one."""
        self.counters.steps += 1
        self._step_reads.clear()

    def _insert(self, layer: int, expert: int, prefetched: int) -> _Entry:
        entry = _Entry(read=self._submit(layer, expert), prefetched=prefetched)
        self._changed(layer)
        self._layer_reads.append(entry.read)
        self.cache[layer][expert] = entry
        self.policies[layer].on_insert(expert)
        return entry

    def _tensors(self, layer: int, expert: int, entry: _Entry, stall: bool):
        """The parsed, verified tensors of `entry`, waiting for its read if need be."""
        if entry.tensors is not None:
            return entry.tensors
        read = entry.read
        waited = self.pool.wait(read)
        if stall:
            self.counters.stall(layer, waited)
        self.counters.read_seconds += read.req.seconds
        buf, err = self.pool.result(read)
        src = read.source
        self.disks[src.disk(layer, expert)]["read_seconds"] += read.req.seconds
        try:
            if err:
                raise ColibriError(f"cannot read layer {layer} expert {expert} from {read.path}: {err}")
            tensors = src.container.expert_views(buf, layer, expert, crc=read.req.crc)
        except ColibriError as e:
            if src is not self.sources[0]:  # a mirror read failed: read the primary
                if len(self.sources) > 1:  # the first mirror failure: one warning, then primary only
                    warn(f"reading from mirror {src.container.path} failed ({e}); reading from the primary "
                         f"{self.container.path} instead, and not using the mirror again this session")
                    self._retired.append(self.sources.pop())
                which = 0
            elif len(self.sources) > 1:  # the primary failed: the mirror's copy
                warn(f"{e}; reading it from mirror {self.sources[1].container.path} instead")
                which = 1
            else:  # nothing left to read from: the next request for this expert reads it again
                self._forget(layer, expert, entry)
                raise
            entry.read = self._submit(layer, expert, which)
            return self._tensors(layer, expert, entry, stall)
        entry.tensors, entry.read = tensors, None
        return tensors

    def _forget(self, layer: int, expert: int, entry: _Entry) -> None:
        """Drop the entry of a read that failed: never a hit later, the next request reads it again
        (a pinned expert goes back to not read yet)."""
        self._changed(layer)
        if self.pinned[layer].get(expert) is entry:
            self.pinned[layer][expert] = _Entry()
        elif self.cache[layer].get(expert) is entry:
            del self.cache[layer][expert]
            self.policies[layer].on_evict(expert)
        entry.read = None

    def _settled(self, entry: _Entry) -> bool:
        return entry.read is None or self.pool.done(entry.read)

    def _victim(self, layer: int, candidates: list[int]) -> int:
        victim = self.policies[layer].victim(candidates)
        if victim not in candidates:
            info = self.config.policy
            raise ColibriError(f"cache policy {info.name} ({info.plugin}) chose expert {victim!r}, "
                               f"which is not one of the evictable experts {candidates}")
        return victim

    def _orphan(self, layer: int, expert: int) -> None:
        """Evict an expert whose read is in flight: its buffer lives on with the read until it ends."""
        self._changed(layer)
        self._orphans.append(self.cache[layer].pop(expert).read)
        self.policies[layer].on_evict(expert)

    def _reap_orphans(self) -> None:
        """Release the reads of evicted experts that have finished."""
        running = []
        for read in self._orphans:
            if self.pool.done(read):
                self.pool.wait(read)
            else:
                running.append(read)
        self._orphans = running

    def _evict(self, layer: int, expert: int) -> None:
        self._changed(layer)
        entry = self.cache[layer].pop(expert)
        if entry.read is not None:
            self.pool.wait(entry.read)  # done already (only settled entries are evicted): releases it
        self.policies[layer].on_evict(expert)

    def _make_room(self, layer: int, protected: set[int], block: bool, demand: bool = False) -> bool:
        """Evict until the layer's cache has a free slot; False if that needs waiting and not `block`.

        For a `demand` read, a prefetch still in flight that this layer does not need (a wrong guess)
        gives up its slot at once rather than after its read, the farthest guess's first (the least
        likely right): the read finishes as an orphan."""
        cache = self.cache[layer]
        while len(cache) >= self.slots:
            candidates = [e for e, entry in cache.items() if e not in protected and self._settled(entry)]
            if not candidates and demand:
                guessed = {e: entry.prefetched for e, entry in cache.items() if e not in protected and entry.prefetched}
                farthest = max(guessed.values(), default=0)
                guesses = [e for e, d in guessed.items() if d == farthest]
                if guesses:
                    self._orphan(layer, self._victim(layer, guesses))
                    continue
            if candidates:
                self._evict(layer, self._victim(layer, candidates))
                continue
            if not block:
                return False
            loading = [entry for e, entry in cache.items() if e not in protected]
            if not loading:
                raise AssertionError("the expert cache is full of experts the layer still needs")
            self.counters.stall(layer, self.pool.wait(loading[0].read))
        return True

    # ---- router lookahead ----------------------------------------------------------------
    def _lookahead(self, predict: Sequence[Lookahead]) -> None:
        """Start reading the experts each of `predict` (nearest first) up to `lookahead` layers ahead
        says its layer will need: the nearer layers' reads queue first."""
        if not self.config.prefetch:
            return
        for p in predict:
            if p.distance <= self.config.lookahead:
                self._guess_ahead(p)

    def _guess_ahead(self, predict: Lookahead) -> None:
        """Start reading the experts `predict.guess()` says its layer will need (but those computed
        `elsewhere`)."""
        nxt, d = predict.layer, predict.distance
        if self.holds_all(nxt):
            return  # every expert of that layer is resident: nothing to predict
        ids = predict.guess()
        if ids is None:
            return
        ids = np.asarray(ids)  # (T, k), each token's best first as the core's routers return them
        T, k = ids.shape
        # votes weighted by rank (k for a token's first choice … 1 for its last): when the cache
        # cannot take every predicted expert, the likeliest go first (a last choice is right less often)
        rank_weights = np.broadcast_to(np.arange(k, 0, -1), (T, k))
        votes = np.bincount(ids.ravel(), weights=rank_weights.ravel(), minlength=self.container.n_experts)
        order = np.argsort(-votes, kind="stable")[: np.count_nonzero(votes)].tolist()  # voted for, most first
        self._predicted[nxt, d] = set(order)
        if predict.elsewhere:  # computed by a live remote shard: nothing to read here
            order = [e for e in order if e not in predict.elsewhere]
        wanted = order[: self.slots]  # never more than the cache holds
        protected = set(wanted)
        cache, pinned, counts = self.cache[nxt], self.pinned[nxt], self.by_distance[d]
        guesses = self._guesses[nxt, d] = []  # (expert, rank) a single token guessed and the cache lacks
        room = True
        for rank, e in enumerate(wanted):
            if e in cache or e in pinned:
                continue
            if T == 1:
                guesses.append((e, rank))
                if not self._guess_record.worth_reading(nxt, d, rank):
                    self.counters.prefetch_skipped += 1
                    counts.skipped += 1
                    continue
            room = room and self._make_room(nxt, protected, block=False)
            if room:
                self._insert(nxt, e, prefetched=d)
                self.counters.prefetch_issued += 1
                counts.issued += 1

    # ---- hot-store and history -----------------------------------------------------------
    def _read_pinned(self) -> None:
        """Start background reads of queued pinned experts: one in flight while demand or lookahead
        reads are, one per I/O thread while none is."""
        self._layer_reads = [r for r in self._layer_reads if not self.pool.done(r)]
        self._pin_reads = [r for r in self._pin_reads if not self.pool.done(r)]
        room = (1 if self._layer_reads else self.config.io_threads) - len(self._pin_reads)
        while room > 0 and self._pin_queue:
            layer, e = self._pin_queue.pop(0)
            entry = self.pinned[layer].get(e)
            if entry is None or entry.read is not None or entry.tensors is not None:
                continue  # demoted since, or already read on demand
            entry.read = self._submit(layer, e)
            self._pin_reads.append(entry.read)
            room -= 1

    def warm_up(self) -> tuple[float, int]:
        """Read every queued pinned expert now and wait for all of the hot-store: (seconds, experts read)."""
        t0 = time.perf_counter()
        n = sum(entry.tensors is None for pinned in self.pinned.values() for entry in pinned.values())
        for layer, e in self._pin_queue:
            entry = self.pinned[layer].get(e)
            if entry is not None and entry.read is None and entry.tensors is None:
                entry.read = self._submit(layer, e)
        self._pin_queue = []
        for layer, pinned in self.pinned.items():
            for e, entry in pinned.items():
                self._tensors(layer, e, entry, stall=False)
        return time.perf_counter() - t0, n

    def _repin(self) -> None:
        """Revise the pinned set from the routing history (usage.pin_value; hysteresis: usage.hot_set)."""
        if self.usage is None or not self.config.pinned:
            return
        self._tables.clear()
        layers = list(self.layer_index)
        current = {(self.layer_index[layer], e) for layer in layers for e in self.pinned[layer]}
        want = hot_set(pin_value(self.usage.counts, self.slots), self.config.pinned, current)
        for li, e in sorted(current - want):  # demote: into the cache if it has room, else drop
            layer = layers[li]
            entry = self.pinned[layer].pop(e)
            if entry.read is None and entry.tensors is None:
                continue  # still queued: nothing to keep
            if len(self.cache[layer]) < self.slots:
                self.cache[layer][e] = entry
                self.policies[layer].on_insert(e)
            elif entry.read is not None:
                self.pool.wait(entry.read)
        counts = self.usage.counts
        for li, e in sorted(want - current, key=lambda p: (-counts[p], p)):  # promote: from the cache, or queue its read
            layer = layers[li]
            if e in self.cache[layer]:
                self.pinned[layer][e] = self.cache[layer].pop(e)
                self.policies[layer].on_evict(e)
            else:
                self.pinned[layer][e] = _Entry()
                self._pin_queue.append((layer, e))
        self._read_pinned()

    def end_turn(self) -> None:
        """A turn finished well: save the routing history and revise the hot-store."""
        if self.usage is None:
            return
        self.usage.end_turn()
        self.usage.save()
        self._repin()

    # ---- bookkeeping ---------------------------------------------------------------------
    def _pinned_read(self, layer: int) -> int:
        """Pinned experts of `layer` read or being read (not queued)."""
        return sum(1 for entry in self.pinned[layer].values() if entry.read is not None or entry.tensors is not None)

    @property
    def resident_bytes(self) -> int:
        """Bytes the expert cache and the hot-store hold now (queued pinned experts not counted)."""
        nbytes = self.container.layer_expert_nbytes
        return sum((len(c) + self._pinned_read(layer)) * nbytes(layer) for layer, c in self.cache.items())

    def placement(self) -> Placement:
        """Which experts each MoE layer holds now (cached ones may still be being read, pinned ones
        queued): a copy, safe to keep and to read from another thread."""
        return Placement(slots=self.slots,
                         cached={layer: frozenset(cache) for layer, cache in self.cache.items()},
                         pinned={layer: frozenset(pinned) for layer, pinned in self.pinned.items()})

    def stats(self) -> dict:
        pinned = sum(len(p) for p in self.pinned.values())
        return {
            **self.counters.as_dict(self.cache),
            "cache_slots_per_layer": self.slots,
            "cache_bytes": sum(len(c) * self.container.layer_expert_nbytes(layer) for layer, c in self.cache.items()),
            "pinned_experts": pinned,
            "pinned_bytes": sum(self._pinned_read(layer) * self.container.layer_expert_nbytes(layer) for layer in self.pinned),
            "pinned_queued": pinned - sum(self._pinned_read(layer) for layer in self.pinned),
            "pin_capacity": self.config.pinned,
            "policy": self.config.policy.name,
            "prefetch": self.config.prefetch,
            "lookahead_depth": self.config.lookahead if self.config.prefetch else 0,
            "prefetch_by_distance": {d: counts.as_dict() for d, counts in self.by_distance.items()
                                     if self.config.prefetch},
            "direct_io": self.sources[0].direct,
            "mirror": str(self.config.mirror) if self.config.mirror else None,
            "mirror_in_use": len(self.sources) > 1,
            "stripe": str(self.stripe.directory) if self.stripe is not None else None,
            "stripe_share": self.stripe.share if self.stripe is not None else 0.0,
            "disks": {d: dict(counts) for d, counts in self.disks.items()},
            "io_threads": self.config.io_threads,
            "transient_reads": self.config.transient,
            "history_tokens": self.usage.tokens if self.usage is not None else 0,
        }

    def close(self) -> None:
        """Wait for reads in flight, drop every cached expert, close the files."""
        if self.pool is not None:
            self.pool.close()
        for d in (*self.cache.values(), *self.pinned.values()):
            d.clear()
        for s in (*self.sources, *self._retired):
            s.close()
