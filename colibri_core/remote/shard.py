"""ShardServer: one Ray actor's body — a shard of routed experts held in RAM on its node, computed
with colibri's own kernels. Plain Python (tested without Ray); client.py wraps it with `ray.remote`.

The actor opens its own copy of the container (the same path as the driver's, or one given for its
node), refuses one whose experts differ from the driver's (`identity`), and reads its experts in a
background thread, so it answers as soon as the container is open: an expert asked for before the
thread reached it is read at once, and `prefetch` (the driver's lookahead) moves guesses forward.
Every extent is checked (crc32 against its trailer and the manifest) as in the local store.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time

import numpy as np


def identity(container) -> str:
    """A digest of what makes two containers compute the same experts: the source's fingerprint,
    the quantisation and the expert section (every extent's layout and crc32)."""
    m = container.manifest
    blob = json.dumps([m.get("source", {}).get("fingerprint"), m.get("quant"), m.get("experts")], sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class ShardServer:
    def __init__(self, model_dir: str, experts: dict[int, list[int]], expected_identity: str, warm: bool = True):
        from ..container import Container
        from ..errors import ColibriError

        self.container = Container(model_dir)
        got = identity(self.container)
        if got != expected_identity:
            raise ColibriError(f"{model_dir} on this node holds another model or conversion than the driver's "
                               f"(identity {got} != {expected_identity})")
        self.wanted = [(int(layer), int(e)) for layer, es in experts.items() for e in es]
        self.owned = {int(layer): frozenset(int(e) for e in es) for layer, es in experts.items()}
        self.tensors: dict[tuple[int, int], tuple] = {}
        self._lock = threading.Lock()
        self._queue = list(self.wanted)  # the loader's order; prefetch moves guesses to the front
        self.delay = 0.0  # seconds added to every compute (tests: a slow node)
        self.started = time.time()
        self.load_seconds: float | None = None
        self.calls = 0
        self._loader = threading.Thread(target=self._load_all, name="colibri-shard-load", daemon=True)
        if warm:
            self._loader.start()

    # ---- loading ---------------------------------------------------------------------------
    def _load_all(self) -> None:
        t0 = time.perf_counter()
        while True:
            with self._lock:
                if not self._queue:
                    break
                key = self._queue.pop(0)
            self._get(*key)
        self.load_seconds = time.perf_counter() - t0

    def _get(self, layer: int, expert: int):
        t = self.tensors.get((layer, expert))
        if t is None:
            t = self.container.read_expert(layer, expert)  # crc32-checked
            self.tensors[layer, expert] = t
        return t

    def prefetch(self, layer: int, experts: list[int]) -> None:
        """Read these experts next (the driver's lookahead guessed them)."""
        front = [(layer, int(e)) for e in experts if int(e) in self.owned.get(layer, ()) and (layer, int(e)) not in
                 self.tensors]
        with self._lock:
            self._queue = front + [k for k in self._queue if k not in front]

    # ---- computing ---------------------------------------------------------------------------
    def compute(self, layer: int, x: np.ndarray, ids: np.ndarray, activations: str, kind,
                limit: float | None, alpha: float | None = None, biases: dict | None = None) -> np.ndarray:
        """The slots (t, r) of `ids` (n, k) whose expert this shard holds (the others are -1), in
        row-major order: (m, H) float32, each FFN_{ids[t, r]}(x[t]) as the local MoE block computes it
        (`activations` the kernels' arithmetic; `kind`, `limit`, `alpha` and the experts' `biases`
        {expert: (gate_bias, up_bias, down_bias)} the block's `ExpertFFN`; a plugin's `ExpertFunction`
        `kind` arrives by name and is imported here, so its module must be installed on this node)."""
        from ..layers.moe import run_experts

        if self.delay:
            time.sleep(self.delay)
        self.calls += 1
        ids = np.asarray(ids, np.int64)
        need = sorted(set(ids[ids >= 0].tolist()))
        missing = [e for e in need if e not in self.owned.get(layer, ())]
        if missing:
            raise ValueError(f"shard does not hold layer {layer} experts {missing}")
        experts = {e: self._get(layer, e) for e in need}
        outs = np.zeros((*ids.shape, x.shape[1]), np.float32)
        run_experts(outs, np.ascontiguousarray(x, np.float32), ids, experts, limit, glu=kind, act=activations, alpha=alpha,
                    biases=biases)
        return outs[ids >= 0]

    # ---- status ------------------------------------------------------------------------------
    def ready(self) -> dict:
        """This shard's state (also the driver's liveness probe)."""
        from .. import kernels

        return {"node": _node_id(), "pid": os.getpid(), "experts": len(self.wanted), "loaded": len(self.tensors),
                "load_seconds": self.load_seconds, "simd": kernels.simd(), "calls": self.calls}

    def set_delay(self, seconds: float) -> None:
        """Make every compute take `seconds` longer (tests and drills: a slow node)."""
        self.delay = float(seconds)


def _node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # not in a Ray worker
        return None
