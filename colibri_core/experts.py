"""ExpertSource: the one object the MoE block asks for a layer's routed experts.

Behind it live the local expert store (colibri_core/store: a passive cache, told what to read) and,
with `--ray`, the remote shards (colibri_core/remote). Per MoE layer the block routes, then asks the
source to fill every (token, rank) slot with its expert's FFN, computed with the block's math
(`layers.moe.ExpertFFN`):

- without remote shards, the store yields the experts resident first, the others as their reads
  arrive, and the lookahead for the next MoE layers starts once this layer's reads are queued; a
  layer holding all its experts hands the block one C table instead (`resident_table`);
- with remote shards, every expert of the batch a live shard holds and the store does not hold
  ready goes to its shard first (one call per shard); the store computes the others meanwhile
  (the shards' experts are its `skip`), and the lookahead also warms the shards and reads nothing
  a live one serves (`Lookahead.elsewhere`). Then the shards' answers land in their slots; a shard
  that failed or missed its deadline has its experts read and computed here within the same call,
  so no request is lost and no token changes. Experts a shard computed are read into the layer's
  free cache slots (never evicting; `RemoteConfig.fill_local`), so later tokens compute them here.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .store.store import ExpertStore, Lookahead

# The lookahead as the MoE block hands it over: (a later MoE layer, its guess of ids (T, k) or None),
# nearest first
Predict = Sequence[tuple[int, Callable[[], np.ndarray | None]]]


def lookaheads(predict: Predict) -> list[Lookahead]:
    """The store's `Lookahead`s of `predict`, each with its distance (1: the next MoE layer)."""
    return [Lookahead(nxt, guess, distance=d) for d, (nxt, guess) in enumerate(predict, 1)]


class ExpertSource:
    """The local `store` and, if not None, the `remote` shards (`remote.client.RemoteExperts`) in
    front of which it is a cache. The owner closes the store; `close` stops the shards."""

    def __init__(self, store: ExpertStore, remote=None):
        self.store, self.remote = store, remote
        self.local_fills = 0  # reads `fill` started for experts the shards computed

    def resident_table(self, layer: int, predict: Predict = ()):
        """The C table (kernels.ExpertTable) of every expert of `layer` when all of them are resident
        here and no remote shard computes any, with the lookahead `predict` (later MoE layers, nearest
        first, and their guesses of ids (T, k)) started; else None (call `compute`). The caller then
        counts the routing it ran over the table (`count_resident`)."""
        if self.remote is not None:
            return None
        return self.store.resident_table(layer, lookaheads(predict))

    def holds_all(self, layer: int) -> bool:
        """Whether every expert of `layer` is resident here (none computed remotely)."""
        return self.remote is None and self.store.holds_all(layer)

    def count_resident(self, layer: int, ids: np.ndarray) -> None:
        """Count the routing `ids` (T, k) run over `resident_table(layer)`: hits, and the history."""
        self.store.count_resident(layer, ids)

    def compute(self, layer: int, outs: np.ndarray, x: np.ndarray, ids: np.ndarray, ffn,
                predict: Predict = (), meanwhile: Callable[[], object] | None = None):
        """Fill every slot of outs (T, k, H): outs[t, r] = the FFN of expert ids[t, r] on x[t]
        (x (T, H), ids (T, k)) with the block's math `ffn` (`layers.moe.ExpertFFN`), wherever the
        expert is. `predict` (later MoE layers, nearest first, and their guesses of ids (T, k)):
        the lookahead, started once this layer's reads are queued. `meanwhile` is
        called once, when the first experts are computed and the rest are still being read (or
        computed remotely); its result is returned (None without one)."""
        remote, sent, skip = self.remote, None, frozenset()
        lookahead = lookaheads(predict)
        if remote is not None:  # experts not resident here go to their shard now, one call per shard
            sent = remote.dispatch(layer, x, ids, self.store.resident(layer), ffn)
            skip = frozenset() if sent is None else sent.experts
            # the lookahead also warms the shards, and reads nothing a live one serves
            lookahead = [p._replace(guess=remote.watch(p.layer, p.guess), elsewhere=remote.serving(p.layer))
                         for p in lookahead]
        result = None
        for ready in self.store.experts(layer, ids, predict=lookahead, skip=skip):  # {expert: (gate, up, down)}
            ffn(outs, x, ids, ready)
            if meanwhile is not None:
                result, meanwhile = meanwhile(), None
        if meanwhile is not None:  # nothing was computed here: every expert is on a shard
            result = meanwhile()
        if sent is not None:
            failed = remote.collect(sent, outs)  # the shards' slots; a failed or late shard's experts are …
            if failed:  # … read and computed here, within this call
                here = frozenset(np.unique(ids).tolist()) - failed  # computed already, here or remotely
                for ready in self.store.experts(layer, ids, skip=here, record=False):
                    ffn(outs, x, ids, ready)
            if remote.cfg.fill_local:  # free local slots take what the shards computed: next time it is here
                self.local_fills += self.store.fill(layer, sent.experts - failed)
        return result

    def stats(self) -> dict:
        """The store's counters, and the remote shards' (`remote_*`) where there are some."""
        if self.remote is None:
            return self.store.stats()
        return {**self.store.stats(), **self.remote.stats(), "remote_local_fills": self.local_fills}

    def close(self) -> None:
        """Stop the remote shards (the store is its owner's to close)."""
        if self.remote is not None:
            self.remote.close()
            self.remote = None
