"""Where a forward pass spends its time, and which experts the routers pick: for whoever listens.

The engine listens around each forward pass (`with probe.listening(): model.forward(...)`); the
shared layers report into the listening probe through two tiny hooks, so every architecture built
from the core's layers is measured without code of its own:

    @timed("attention")           # on a layer function: seconds spent inside it
    route(layer, ids)             # the router's choice, ids (T, k): counted per (layer, expert)

The listener is a context variable, so a probe only sees the thread (and pass) it listens in;
with no listener the hooks cost one lookup. Recording never changes a result.

A second, debugging listener records *named intermediates* (llama.cpp's ``cb(cur, name, il)``):
``record(layer, name=tensor)`` from the core's MoE block and each plugin's forward, kept by a
`Recorder` only while one listens (``with probe.recording() as rec: engine.logits(ids)``). The
conformance kit uses it to name the first layer and sub-block where an engine leaves its oracle.
"""
from __future__ import annotations

import functools
import time
from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np

__all__ = ["record"]  # what a plugin may use (docs/plugins.md); the rest serves the core and the kit

_listening: ContextVar[Probe | None] = ContextVar("colibri_probe", default=None)


class Probe:
    """Seconds per named section, and routing counts per (layer, expert)."""

    def __init__(self, n_experts: int):
        self.n_experts = n_experts
        # section name → seconds summed over every pass; the core layers report these two
        self.seconds: dict[str, float] = {"attention": 0.0, "moe": 0.0}
        self.routed: dict[int, np.ndarray] = {}  # layer → (E,) int64: tokens routed to each expert
        self.latest: dict[int, list[int]] = {}  # layer → expert ids of the most recent token
        self.passes = 0  # forward passes recorded
        self._routes: list[tuple[int, np.ndarray]] = []  # this pass's (layer, ids), counted when it ends

    @contextmanager
    def listening(self):
        token = _listening.set(self)
        try:
            yield self
        finally:
            _listening.reset(token)
            self._count_routes()
            self.passes += 1

    def add_seconds(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def add_route(self, layer: int, ids: np.ndarray) -> None:
        """Layer `layer` routed its tokens to ids (T, k): counted into `routed` and `latest` when the
        pass ends, not between its kernels (a NumPy call there ran on caches the weights had just
        swept: 1-4 % of an OLMoE-size decode step, with the store's count of the same ids)."""
        self._routes.append((layer, ids))

    def _count_routes(self) -> None:
        for layer, ids in self._routes:
            counts = self.routed.get(layer)
            if counts is None:
                counts = self.routed[layer] = np.zeros(self.n_experts, np.int64)
            counts += np.bincount(ids.ravel(), minlength=self.n_experts)[: self.n_experts]
            self.latest[layer] = ids[-1].tolist()
        self._routes.clear()


def timed(name: str):
    """Decorator: add the seconds spent in the function to the listening probe's section `name`."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kw):
            probe = _listening.get()
            if probe is None:
                return fn(*args, **kw)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                probe.add_seconds(name, time.perf_counter() - t0)

        return inner

    return wrap


def spent(name: str, seconds: float) -> None:
    """Add `seconds` to the listening probe's (if any) section `name`: what `timed` adds, for a fused
    call that times its parts itself."""
    probe = _listening.get()
    if probe is not None:
        probe.add_seconds(name, seconds)


def route(layer: int, ids: np.ndarray) -> None:
    """Tell the listening probe (if any) which experts layer `layer` routed each token to: ids (T, k)."""
    probe = _listening.get()
    if probe is not None:
        probe.add_route(layer, ids)


# ---- named intermediates ---------------------------------------------------------------------
# llama.cpp's ``cb(cur, "ffn_moe_out", il)``: the core's MoE block and each plugin's forward name the
# tensors they compute, per layer; a `Recorder` keeps copies while someone listens (the conformance
# kit, to find where an engine first diverges from its oracle). Names the core records:
#
#     ffn_inp          (T, H)  the residual stream entering a MoE sub-block (MoE's `residual`)
#     ffn_norm         (T, H)  the router's input (the layer's pre-MoE norm of ffn_inp)
#     ffn_moe_ids      (T, k)  the experts each token was routed to, best first
#     ffn_moe_weights  (T, k)  their weights
#     ffn_moe_tokens   (T,)    the token ids the router was given
#     ffn_moe_out      (T, H)  the routed experts' weighted sum (no shared expert)
#
# and every plugin's forward records ``l_out`` (T, H), the residual stream after each decoder layer
# (one line: ``record(i, l_out=h)``), so a divergence can be pinned to a layer.

_recording: ContextVar[Recorder | None] = ContextVar("colibri_record", default=None)


class Recorder:
    """Copies of the named intermediates recorded while it listens: ``tensors[(name, layer)]`` is the
    list of every pass's tensor, in call order; ``calls`` the (name, layer) of every record, in order.
    `names` (optional) keeps only those names."""

    def __init__(self, names=None):
        self.names = None if names is None else frozenset(names)
        self.tensors: dict[tuple[str, int], list[np.ndarray]] = {}
        self.calls: list[tuple[str, int]] = []

    def add(self, layer: int, tensors: dict) -> None:
        for name, value in tensors.items():
            if self.names is not None and name not in self.names:
                continue
            self.tensors.setdefault((name, layer), []).append(np.array(value, copy=True))
            self.calls.append((name, layer))

    def get(self, name: str, layer: int, call: int = -1) -> np.ndarray | None:
        """The tensor `name` of `layer` from one call (default: the latest); None if never recorded."""
        seen = self.tensors.get((name, layer))
        return None if not seen else seen[call]

    def layers(self, name: str) -> list[int]:
        """The layers that recorded `name`, in the order they first did."""
        return list(dict.fromkeys(layer for n, layer in self.calls if n == name))


@contextmanager
def recording(names=None):
    """Record named intermediates (this thread, this context) into a fresh `Recorder`, yielded."""
    recorder = Recorder(names)
    token = _recording.set(recorder)
    try:
        yield recorder
    finally:
        _recording.reset(token)


def listening() -> bool:
    """Whether a recorder listens on this thread (a fused block that skips an intermediate asks)."""
    return _recording.get() is not None


def record(layer: int, **tensors) -> None:
    """Name intermediates of layer `layer` for the listening recorder (if any): ``record(i, l_out=h)``.
    With nobody listening it costs one context-variable lookup; recording never changes a result."""
    recorder = _recording.get()
    if recorder is not None:
        recorder.add(layer, tensors)
