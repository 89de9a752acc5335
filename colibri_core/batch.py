"""Continuous batching: the forwards of several running generations as one.

Each generation in a `Batch` is a greenlet running the engine's own generation loop
(`Engine._stream`: its own state, prefix cache lookup, sampling, constraint, drafts), so everything
a single generation does, a batched one does the same way. The batch advances them in steps: a
step resumes every generation until it has run one forward (a decode step, a verified draft, or a
chunk of its prompt) or finished. Inside a forward, every call that reads shared weights asks
`together`: the resident matrix products (`layers.linear`), the attention sub-blocks
(`layers.attention.gqa_block`) and the MoE layers (`MoEModel.moe`) pause there, and once every
generation of the step has paused, the batch runs each such call once on all the rows waiting at
it, stacked: the dense weights and the union of the experts the rows route to are read once per
step for all of them. Attention and state stay per sequence.

Semantics: every kernel computes each row independently of the others (the reduction-order
contract), so a generation's tokens are bit for bit those it gets alone, whatever runs beside it
(the conformance kit's `batch_equals_solo` check). Greenlets, not threads: one thread runs
everything in a fixed order, the C kernels keep their own threads, and a pause costs a
microsecond.

    with engine.batch() as batch:
        a = batch.add(prompt_a, 32)
        b = batch.add(prompt_b, 32, temperature=0.8, seed=1)
        while batch.running():
            batch.step()                # one forward of each running generation
        a.tokens, b.tokens
"""
from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from greenlet import getcurrent, greenlet


class Cancelled(BaseException):
    """Raised inside a cancelled generation at its next pause: its generation loop unwinds (the
    session is put back as it was before the call)."""


@dataclass
class _Run:
    """Handed by the hub to the first generation waiting at a call: run it for `group`."""

    group: list[Generation]


class Generation:
    """One generation running in a batch: its tokens so far, and how it ended.

    `tokens` grows by each token as the engine yields it (`on_token(token)` is called with it too;
    returning False ends the generation there, as a caller stopping `stream` early does). `done`
    once it has ended; `error` the exception that ended it, if any (a ColibriError is the caller's
    to report; the batch goes on with the others)."""

    def __init__(self, batch: Batch, run: Callable[[], Any], on_token: Callable[[int], Any] | None):
        self.batch = batch
        self.tokens: list[int] = []
        self.cached_tokens = 0  # of its prompt, restored from the prefix cache rather than prefilled
        self.on_token = on_token
        self.done = False
        self.error: BaseException | None = None
        self.cancelled = False
        self._stream = run  # () -> the engine's token iterator, started in the greenlet
        self._waiting: tuple | None = None  # (key, argument, run) while paused at `together`
        self._outcome: Any = None  # the result (or exception) `together` hands back for this generation
        self._calling = False  # running a call for its group: the calls inside it are not gathered
        self._greenlet = greenlet(self._main)
        self._greenlet.gr_context = contextvars.copy_context()  # what the caller's context holds (a probe)

    def cancel(self) -> None:
        """End this generation at its next pause (between two forwards, or before it starts): its
        session is left as it was before the call; tokens already yielded stay in `tokens`."""
        self.cancelled = True

    def _main(self) -> None:
        _current[self._greenlet] = self
        try:
            if self.cancelled:
                return
            tokens = self._stream()
            try:
                for token in tokens:
                    self.tokens.append(token)
                    if (self.on_token is not None and self.on_token(token) is False) or self.cancelled:
                        break
            finally:
                tokens.close()  # a generation stopped early saves its turn, as `stream` does
        except Cancelled:
            pass
        except BaseException as e:  # the caller reads it; the batch goes on with the others
            self.error = e
        finally:
            self.done = True
            del _current[self._greenlet]


_current: dict[greenlet, Generation] = {}  # the running greenlets that are a batch's generations


def current() -> Generation | None:
    """The batched generation the calling code runs in, or None (a call of its own)."""
    return _current.get(getcurrent())


def together(key, argument, run: Callable[[list], list]):
    """`run([argument])[0]`, or, inside a batch, the same for every generation waiting at `key`:
    `run(arguments)` once with one argument per generation, in the batch's order, each getting
    its own result. `key` names the call and its weights (e.g. ("linear", id(w))); `run` must give
    each argument's result exactly as it would alone (each row computed independently)."""
    me = current()
    if me is None or me._calling:  # alone, or inside a call run for the group (its own calls run as they are)
        return run([argument])[0]
    me._waiting = (key, argument, run)
    order = me.batch._hub.switch()
    if not isinstance(order, _Run):
        return order  # another generation of the group ran the call
    me._calling = True
    try:
        results = run([g._waiting[1] for g in order.group])
    except BaseException as e:
        for g in order.group[1:]:
            g._outcome = e
        raise
    finally:
        me._waiting, me._calling = None, False
    for g, result in zip(order.group[1:], results[1:]):
        g._outcome = result
    return results[0]


def pause() -> None:
    """Called by the engine after each forward of a generation: inside a batch, its step is done
    (the others run theirs); a cancelled generation stops here."""
    me = current()
    if me is None:
        return
    me.batch._hub.switch()
    if me.cancelled:
        raise Cancelled


def others_running() -> bool:
    """Whether the calling generation shares its batch with others still running (its prompt is
    then fed in chunks, so their streams go on between them)."""
    me = current()
    return me is not None and any(not g.done and g is not me for g in me.batch.generations)


def stack(arrays: list[np.ndarray]) -> np.ndarray:
    """The generations' rows one after the other (T_all, …): the array itself when alone."""
    return np.concatenate(arrays) if len(arrays) > 1 else arrays[0]


def cut(out: np.ndarray, lengths: list[int]) -> list[np.ndarray]:
    """`out`'s rows (T_all, …) cut back into each generation's, `lengths` rows each."""
    return np.split(out, np.cumsum(lengths)[:-1])


def by_rows(fn: Callable[[np.ndarray], Any]) -> Callable[[list[np.ndarray]], list]:
    """A `together` run for a row-wise `fn`: fn over the generations' rows stacked (T_all, …) in one
    call, its result (an array, or a list of arrays) cut back into each generation's rows."""
    def run(xs: list[np.ndarray]) -> list:
        if len(xs) == 1:
            return [fn(xs[0])]
        lengths = [len(x) for x in xs]
        out = fn(stack(xs))
        if isinstance(out, np.ndarray):
            return cut(out, lengths)
        return [list(parts) for parts in zip(*(cut(o, lengths) for o in out))]
    return run


class Batch:
    """Generations advanced together, one forward each per step (module docstring). Built by
    `Engine.batch()`, a context manager: the engine runs nothing else while it is open, and
    closing it cancels what still runs. Not thread-safe: one thread adds, steps and cancels."""

    def __init__(self, start: Callable[..., Any], release: Callable[[], None],
                 on_step: Callable[[], None] = lambda: None):
        self.generations: list[Generation] = []
        self._on_step = on_step  # told as each step begins (the store counts experts read twice in one)
        self._start = start  # Engine.stream (a generation of a batch does not take the engine's lock)
        self._release = release  # the engine's lock, given back by `close`
        self._hub: greenlet | None = None
        self._deferred: list[Callable[[], None]] = []

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add(self, *stream, on_token: Callable[[int], Any] | None = None, **options) -> Generation:
        """A generation with `Engine.stream`'s arguments (prompt_ids, max_new_tokens, sampling,
        stop_ids, session, constraint, draft, …), joining at the next step. Its arguments are
        checked then (a bad one ends it with a ColibriError in `error`)."""
        return self.run(lambda: self._start(*stream, **options), on_token)

    def run(self, tokens: Callable[[], Any], on_token: Callable[[int], Any] | None = None) -> Generation:
        """An entry of any other engine call that pauses between forwards as `stream` does (e.g.
        Engine.embed's prefill chunks): `tokens()` returns its token iterator (possibly empty),
        started in the entry's greenlet at the next step."""
        g = Generation(self, tokens, on_token)
        self.generations.append(g)
        return g

    def running(self) -> int:
        return sum(not g.done for g in self.generations)

    def defer(self, fn: Callable[[], None]) -> None:
        """Run `fn` at the end of the step (the store's end of a turn: never while others are mid-forward)."""
        if fn not in self._deferred:
            self._deferred.append(fn)

    def step(self) -> None:
        """One forward of every running generation (a new one starts: its prompt's first chunk)."""
        self._hub = getcurrent()
        self._on_step()
        live = [g for g in self.generations if not g.done]
        for g in live:
            g._greenlet.parent = self._hub
            self._resume(g, None)
        while True:
            waiting = [g for g in live if g._waiting is not None and not g.done]
            if not waiting:
                break
            keys = [g._waiting[0] for g in waiting]
            key = max(dict.fromkeys(keys), key=keys.count)  # the call most are waiting at (the first of ties)
            group = [g for g in waiting if g._waiting[0] == key]
            self._resume(group[0], _Run(group))
            for g in group[1:]:
                g._waiting = None
                self._resume(g, g._outcome)
        self.generations = [g for g in self.generations if not g.done]
        deferred, self._deferred = self._deferred, []
        for fn in deferred:
            fn()

    def _resume(self, g: Generation, value) -> None:
        if g.done:
            return
        if isinstance(value, BaseException):
            g._greenlet.throw(value)
        elif value is None:
            g._greenlet.switch()  # started, or back from its pause
        else:
            g._greenlet.switch(value)

    def close(self) -> None:
        """Cancel what still runs and let each unwind at its pause (sessions put back, turns ended)."""
        try:
            for g in self.generations:
                g.cancel()
            while self.running():
                self.step()
        finally:
            if self._release is not None:
                self._release, release = None, self._release
                release()
