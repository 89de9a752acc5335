"""RemoteExperts: the driver's side of the remote shards (one Ray actor per shard, shard.py).

The expert source (colibri_core/experts.py) drives it per MoE layer: `dispatch` sends each shard
holding an expert the batch needs (and the local store does not hold ready) one call with the
hidden states of the tokens routed there and their ids (slots of other shards' experts as -1);
the local store computes its own experts meanwhile; then `collect` waits for the shards, at most
`timeout` seconds from the dispatch, and writes each answer into the slots it belongs to. A shard
that raised (its actor or node died) or missed the deadline (a slow node, treated as failed) is
marked down at once, and its experts of this layer are returned to the source, which has the
local store read and compute them: no request is lost, no token changes. `serving(layer)` says
which experts live shards compute (the lookahead reads none of them from disk).

A down shard is tried again after `retry` seconds (doubled after each failure in a row, at most
300 s): a live actor (it was only slow) must answer a probe; a dead one is started again on its
node if it is back, else on another node with room that holds no shard (a replacement node), and
is used again as soon as it has opened its container (it reads its experts in the background,
warmed first where the lookahead guesses).
"""
from __future__ import annotations

import re
import time
import warnings
from dataclasses import dataclass, field

import numpy as np

from ..errors import ColibriError
from . import connect, require_ray
from .placement import RAM_SHARE, Shard, nodes_from_ray, place
from .shard import ShardServer, identity

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)  # seconds
MAX_RETRY = 300.0


class RemoteWarning(UserWarning):
    """A remote shard failed or came back (the CLI prints these as one line each)."""


@dataclass
class RemoteConfig:
    address: str  # the Ray cluster: "auto", HOST:PORT, ray://HOST:PORT
    split: str = "expert"  # "expert" (ids split across nodes per layer) or "layer" (layer ranges per node)
    model_paths: dict[str, str] = field(default_factory=dict)  # node id or IP -> container path there
    default_path: str | None = None  # the container's path on every other node (default: the driver's path)
    timeout: float = 10.0  # seconds a shard has to answer one layer's call; later it counts as failed
    start_timeout: float = 120.0  # seconds an actor has to open its container
    retry: float = 5.0  # seconds before a failed shard is tried again (doubling while it keeps failing)
    share: float = RAM_SHARE  # of each node's Ray memory a shard may fill
    fill_local: bool = True  # read experts computed remotely into free local cache slots (never evicting)


@dataclass
class _ShardState:
    shard: Shard
    path: str
    actor: object = None
    state: str = "starting"  # starting | up | down
    probe: object = None  # a pending ready() call
    probe_t0: float = 0.0
    status: object = None  # a pending ready() call while the shard still reads its experts
    dead: bool = False  # its actor raised or died: start a new one
    failures_in_row: int = 0
    next_try: float = 0.0
    warming: bool = True  # still reading its experts
    calls: int = 0
    seconds: float = 0.0
    failures: int = 0
    rejoins: int = 0
    last_error: str = ""


@dataclass
class _Call:
    shard: int
    rows: np.ndarray  # (n,) the batch rows sent
    sel: np.ndarray  # (n, k) bool: the slots this shard computes
    ref: object
    t0: float
    experts: frozenset


@dataclass
class Sent:
    layer: int
    calls: list
    experts: frozenset  # computed remotely (the store skips them)


def _why(e: BaseException) -> str:
    text = str(e)
    m = re.search(r"ColibriError: (.*)", text)
    if m:
        return m.group(1).strip()
    return f"{type(e).__name__}: {text.strip().splitlines()[0][:200] if text.strip() else ''}"


class RemoteExperts:
    def __init__(self, container, cfg: RemoteConfig):
        self.cfg = cfg
        self.owns_connection = False
        ray = require_ray()
        self.owns_connection = not ray.is_initialized()
        self.ray = connect(cfg.address)
        self.container = container
        self.n_experts = container.n_experts
        self.layers = tuple(container.moe_layers)
        self.identity = identity(container)
        self.driver_node = self.ray.get_runtime_context().get_node_id()
        nodes = nodes_from_ray(self.ray.nodes(), exclude=self.driver_node)
        if not nodes:
            raise ColibriError(f"the Ray cluster at {cfg.address} has no node besides this one to hold experts")
        self.placement = place(nodes, {layer: container.layer_expert_nbytes(layer) for layer in self.layers},
                               self.n_experts, cfg.split, cfg.share)
        if not self.placement:
            raise ColibriError(f"no node of the Ray cluster at {cfg.address} has room for one expert")
        self.c = {"calls": 0, "failures": 0, "timeouts": 0, "rejoins": 0, "bytes_sent": 0, "bytes_received": 0,
                  "seconds": 0.0, "fallback_experts": 0, "prefetches": 0}
        self.latency_counts = [0] * len(LATENCY_BUCKETS)  # cumulative
        self.answered = 0
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._affinity = NodeAffinitySchedulingStrategy
        self._actor_cls = self.ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)(ShardServer)
        self.shards = [_ShardState(s, self._path(s.node)) for s in self.placement]
        self.owner: dict[int, np.ndarray] = {}  # layer -> (E,) the shard computing each expert, -1: none
        self._serving: dict[int, frozenset[int]] = {}  # layer -> experts a live shard computes
        self._next_maintain = 0.0
        try:
            for st in self.shards:
                self._start(st)
            self._await_start()
        except BaseException:
            self.close()
            raise
        self._publish()

    # ---- starting shards -------------------------------------------------------------------
    def _path(self, node) -> str:
        p = self.cfg.model_paths
        return p.get(node.id) or p.get(node.address) or self.cfg.default_path or str(self.container.path)

    def _start(self, st: _ShardState) -> None:
        s = st.shard
        st.path = self._path(s.node)
        st.actor = self._actor_cls.options(
            scheduling_strategy=self._affinity(s.node.id, soft=False), memory=max(1, s.nbytes),
        ).remote(st.path, {layer: list(es) for layer, es in s.experts.items()}, self.identity)
        st.probe, st.probe_t0, st.state, st.dead, st.warming = st.actor.ready.remote(), time.monotonic(), "starting", False, True

    def _await_start(self) -> None:
        """Wait for every shard's actor to open its container; a wrong path or model is one line."""
        probes = [st.probe for st in self.shards]
        self.ray.wait(probes, num_returns=len(probes), timeout=self.cfg.start_timeout)
        for st in self.shards:
            done, _ = self.ray.wait([st.probe], timeout=0)
            if not done:
                self._down(st, f"did not open its container within {self.cfg.start_timeout:g} s", dead=True)
                self.ray.kill(st.actor)
                continue
            try:
                self._up(st, self.ray.get(st.probe))
            except self.ray.exceptions.RayError as e:
                why = _why(e)
                if "ColibriError" in str(e):  # the node's container is missing or another model's
                    raise ColibriError(f"remote shard {st.shard.index} on node {st.shard.node.address}: {why}") from None
                self._down(st, why, dead=True)

    def _up(self, st: _ShardState, info: dict) -> None:
        was = st.state
        st.state, st.probe, st.failures_in_row = "up", None, 0
        st.warming = info.get("loaded", 0) < info.get("experts", 0)
        if was == "down":
            st.rejoins += 1
            self.c["rejoins"] += 1
            warnings.warn(f"remote shard {st.shard.index} is back on node {st.shard.node.address}: its "
                          f"{st.shard.n_experts} experts are computed there again", RemoteWarning, stacklevel=3)
        self._publish()

    def _down(self, st: _ShardState, why: str, dead: bool) -> None:
        st.state, st.probe, st.status, st.dead, st.last_error = "down", None, None, dead, why
        st.failures += 1
        st.failures_in_row += 1
        st.next_try = time.monotonic() + min(MAX_RETRY, self.cfg.retry * 2 ** (st.failures_in_row - 1))
        self.c["failures"] += 1
        warnings.warn(f"remote shard {st.shard.index} on node {st.shard.node.address} failed ({why}): its "
                      f"{st.shard.n_experts} experts are read from the local disk until it is back",
                      RemoteWarning, stacklevel=3)
        self._publish()

    def _publish(self) -> None:
        """Who computes what now: `owner` per layer, and what `serving` answers."""
        owner = {layer: np.full(self.n_experts, -1, np.int64) for layer in self.layers}
        for i, st in enumerate(self.shards):
            if st.state == "up":
                for layer, es in st.shard.experts.items():
                    owner[layer][list(es)] = i
        self.owner = owner
        self._serving = {layer: frozenset(np.flatnonzero(o >= 0).tolist()) for layer, o in owner.items()}

    def serving(self, layer: int) -> frozenset[int]:
        """The experts of MoE layer `layer` a live shard computes now."""
        return self._serving.get(layer, frozenset())

    # ---- failure and rejoin ------------------------------------------------------------------
    def maintain(self) -> None:
        """Probe down shards whose retry time has come, start replacements, settle probes (never blocks)."""
        now = time.monotonic()
        ray = self.ray
        for st in self.shards:
            if st.state == "up":
                if st.warming and st.status is None:
                    st.status = st.actor.ready.remote()
                elif st.status is not None and ray.wait([st.status], timeout=0)[0]:
                    try:
                        info = ray.get(st.status)
                        st.warming = info.get("loaded", 0) < info.get("experts", 0)
                    except ray.exceptions.RayError:
                        pass  # the next compute call finds out
                    st.status = None
                continue
            if st.probe is not None:
                if ray.wait([st.probe], timeout=0)[0]:
                    try:
                        self._up(st, ray.get(st.probe))
                    except ray.exceptions.RayError as e:
                        self._down(st, _why(e), dead=True)
                elif now - st.probe_t0 > (self.cfg.start_timeout if st.dead else self.cfg.timeout):
                    if st.dead:
                        ray.kill(st.actor)
                    self._down(st, "no answer to a probe", dead=st.dead)
                continue
            if now < st.next_try:
                continue
            if not st.dead:  # it was slow: a probe queues behind its late calls
                st.probe, st.probe_t0 = st.actor.ready.remote(), now
                continue
            node = self._replacement(st)
            if node is None:
                st.next_try = now + min(MAX_RETRY, self.cfg.retry * 2 ** st.failures_in_row)
                continue
            try:
                ray.kill(st.actor)
            except Exception:
                pass
            st.shard.node = node
            self._start(st)
            st.state = "down"  # until its probe answers

    def _replacement(self, st: _ShardState):
        """The shard's node if alive, else an alive node holding no live shard with room for it."""
        busy = {o.shard.node.id for o in self.shards if o is not st and (o.state == "up" or o.probe is not None)}
        nodes = nodes_from_ray(self.ray.nodes(), exclude=self.driver_node)
        for n in nodes:
            if n.id == st.shard.node.id:
                return n
        for n in nodes:
            if n.id not in busy and n.memory * self.cfg.share >= st.shard.nbytes:
                return n
        return None

    # ---- a layer's calls -----------------------------------------------------------------------
    def dispatch(self, layer: int, x: np.ndarray, ids: np.ndarray, resident, ffn) -> Sent | None:
        """Send each live shard the tokens of `ids` (T, k) routed to its experts of `layer` that are
        not `resident` here, to compute with `ffn`'s math (`layers.moe.ExpertFFN`); None if there
        is nothing to send."""
        now = time.monotonic()
        if now >= self._next_maintain:
            self._next_maintain = now + 0.25
            self.maintain()
        owner = self.owner.get(layer)
        if owner is None:
            return None
        ids = np.asarray(ids)
        o = owner[ids]  # (T, k) shard of each slot, -1: here
        if resident:
            o[np.isin(ids, np.fromiter(resident, np.int64))] = -1
        if not (o >= 0).any():
            return None
        act = self.container.activations  # the arithmetic the local experts' weights carry (QTensor.act)
        calls, experts = [], set()
        for s in np.unique(o[o >= 0]).tolist():
            sel = o == s
            rows = np.flatnonzero(sel.any(axis=1))
            sub = np.where(sel[rows], ids[rows], -1).astype(np.int64)
            xs = np.ascontiguousarray(x[rows], np.float32)
            es = frozenset(ids[sel].tolist())
            ref = self.shards[s].actor.compute.remote(layer, xs, sub, act, ffn.activation, ffn.limit, ffn.alpha,
                                                      ffn.biases_of(es))
            calls.append(_Call(s, rows, sel[rows], ref, time.perf_counter(), es))
            experts |= es
            self.c["calls"] += 1
            self.c["bytes_sent"] += xs.nbytes + sub.nbytes
        return Sent(layer, calls, frozenset(experts))

    def collect(self, sent: Sent, outs: np.ndarray) -> frozenset:
        """Write each shard's answer into `outs` (T, k, H); the experts of shards that failed or
        missed the deadline (marked down now), for the local store to compute."""
        ray = self.ray
        refs = [c.ref for c in sent.calls]
        t0 = min(c.t0 for c in sent.calls)
        ray.wait(refs, num_returns=len(refs), timeout=max(0.0, t0 + self.cfg.timeout - time.perf_counter()))
        failed = set()
        for c in sent.calls:
            st = self.shards[c.shard]
            if not ray.wait([c.ref], timeout=0)[0]:
                self.c["timeouts"] += 1
                failed |= c.experts
                if st.state == "up":
                    self._down(st, f"no answer within the {self.cfg.timeout:g} s deadline", dead=False)
                continue
            try:
                res = ray.get(c.ref)
                t_idx, r_idx = np.nonzero(c.sel)
                if not isinstance(res, np.ndarray) or res.shape != (len(t_idx), outs.shape[2]):
                    raise ColibriError(f"answered {getattr(res, 'shape', type(res).__name__)}, "
                                       f"expected {(len(t_idx), outs.shape[2])}")
            except (ray.exceptions.RayError, ColibriError) as e:
                failed |= c.experts
                if st.state == "up":
                    self._down(st, _why(e), dead=True)
                continue
            outs[c.rows[t_idx], r_idx] = res
            dt = time.perf_counter() - c.t0
            st.calls += 1
            st.seconds += dt
            self.c["seconds"] += dt
            self.c["bytes_received"] += res.nbytes
            self.answered += 1
            for i, b in enumerate(LATENCY_BUCKETS):
                if dt <= b:
                    self.latency_counts[i] += 1
        self.c["fallback_experts"] += len(failed)
        return frozenset(failed)

    def watch(self, layer: int, guess):
        """`guess` (the lookahead for `layer`) that also asks shards still reading their experts to
        read the guessed ones next."""
        def wrapped():
            ids = guess()
            if ids is not None:
                owner = self.owner.get(layer)
                if owner is not None:
                    ids_u = np.unique(np.asarray(ids))
                    for s in np.unique(owner[ids_u][owner[ids_u] >= 0]).tolist():
                        st = self.shards[s]
                        if st.warming:
                            st.actor.prefetch.remote(layer, ids_u[owner[ids_u] == s].tolist())
                            self.c["prefetches"] += 1
            return ids
        return wrapped

    # ---- status ------------------------------------------------------------------------------
    def stats(self) -> dict:
        c = self.c
        up = [st for st in self.shards if st.state == "up"]
        return {
            "remote_shards": len(self.shards),
            "remote_shards_up": len(up),
            "remote_experts": sum(st.shard.n_experts for st in self.shards),
            "remote_experts_up": sum(st.shard.n_experts for st in up),
            **{f"remote_{k}": v for k, v in c.items()},
            "remote_latency": {"buckets": list(LATENCY_BUCKETS), "counts": list(self.latency_counts),
                               "sum": c["seconds"], "count": self.answered},
            "remote_shard_table": {  # shard index -> its row (a dict: the dashboard's /api/stats keeps dicts)
                st.shard.index: {"shard": st.shard.index, "node": st.shard.node.id, "address": st.shard.node.address,
                 "state": st.state, "experts": st.shard.n_experts, "bytes": st.shard.nbytes,
                 "layers": sorted(st.shard.experts), "placement": st.shard.describe(), "calls": st.calls,
                 "seconds": st.seconds, "failures": st.failures, "rejoins": st.rejoins, "warming": st.warming,
                 "last_error": st.last_error} for st in self.shards},
            "remote_split": self.cfg.split,
            "remote_timeout": self.cfg.timeout,
        }

    def close(self) -> None:
        ray = getattr(self, "ray", None)
        if ray is None:
            return
        for st in getattr(self, "shards", ()):
            if st.actor is not None:
                try:
                    ray.kill(st.actor)
                except Exception:
                    pass
                st.actor = None
        if self.owns_connection and ray.is_initialized():
            ray.shutdown()
