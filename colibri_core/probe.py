"""Where a forward pass spends its time, and which experts the routers pick: for whoever listens.

The engine listens around each forward pass (`with probe.listening(): model.forward(...)`); the
shared layers report into the listening probe through two tiny hooks, so every architecture built
from the core's layers is measured without code of its own:

    @timed("attention")           # on a layer function: seconds spent inside it
    route(layer, ids)             # the router's choice, ids (T, k): counted per (layer, expert)

The listener is a context variable, so a probe only sees the thread (and pass) it listens in;
with no listener the hooks cost one lookup. Recording never changes a result.
"""
from __future__ import annotations

import functools
import time
from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np

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

    @contextmanager
    def listening(self):
        token = _listening.set(self)
        try:
            yield self
        finally:
            _listening.reset(token)
            self.passes += 1

    def add_seconds(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def add_route(self, layer: int, ids: np.ndarray) -> None:
        counts = self.routed.get(layer)
        if counts is None:
            counts = self.routed[layer] = np.zeros(self.n_experts, np.int64)
        counts += np.bincount(ids.ravel(), minlength=self.n_experts)[: self.n_experts]
        self.latest[layer] = ids[-1].tolist()


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


def route(layer: int, ids: np.ndarray) -> None:
    """Tell the listening probe (if any) which experts layer `layer` routed each token to: ids (T, k)."""
    probe = _listening.get()
    if probe is not None:
        probe.add_route(layer, ids)
