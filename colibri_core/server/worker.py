"""One generation at a time: a bounded first-in-first-out queue in front of a worker thread.

The engine is not thread-safe, so one thread, the worker, is its only user: it runs every
generation, and it publishes what the rest of the server may know of the engine as a `Snapshot`
(snapshot.py) after loading, after every generated token and at the end of every job. HTTP
handlers (on the event loop) submit a `Job` and read its events back through an asyncio queue;
for statistics and the expert map they read `Worker.snapshot`. Beyond `max_queue` waiting jobs a
request is refused at once (`QueueFull` → 429 with Retry-After). A job whose client went away is
cancelled: dropped from the queue if it has not started, stopped between two tokens if it has.
"""
from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field, replace

from ..errors import ColibriError
from . import memory
from .snapshot import Snapshot, take
from .text import TextStream

log = logging.getLogger("colibri.server")


@dataclass
class Params:
    """A request resolved against the model's defaults: exactly what the engine runs."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]  # stop strings
    stop_ids: tuple[int, ...]  # end-of-sequence ids (empty with ignore_eos)
    constraint: object | None = None  # structured.Constraint: the tokens allowed (response_format, grammar, tools)


@dataclass
class Delta:
    """New text of a running job; `finish` ("stop" | "length") on its last delta."""

    text: str
    finish: str | None = None


@dataclass
class End:
    """The job is over; `turn` is its record (tokens, timings, expert traffic)."""

    turn: dict


@dataclass
class Failed:
    """The job failed inside the engine: a server-side problem (e.g. a damaged expert file)."""

    message: str


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"the server is busy: the request queue is full; retry in {retry_after} s")
        self.retry_after = retry_after


@dataclass
class Job:
    kind: str  # "chat" | "completion"
    prompt_ids: list[int]
    params: Params
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # Delta… then End or Failed
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)
    tokens: int = 0  # generated so far (the worker counts them)
    tokens_at_cancel: int | None = None  # how many there were when the client went away

    def emit(self, event) -> None:
        """From the worker thread: hand `event` to the handler waiting on the event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed: the server is shutting down
            self.cancelled.set()


def _number_stats(engine) -> dict:
    """The engine's numeric counters (other engineers add counters: read whatever is there)."""
    return {k: v for k, v in engine.stats().items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def time_split(before: dict, after: dict, total: float) -> dict:
    """Seconds of one turn spent in attention, expert compute, waiting for disk, and everything else.

    "disk" is the store's I/O stall time (reads overlapped with compute do not count); expert
    compute is the MoE blocks' time without that wait; attention is the attention kernel over the KV cache (projections,
    norms and routers are "other").
    """
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    disk = d.get("io_stall_seconds", 0.0)
    attention = d.get("attention_seconds", 0.0)
    experts = max(0.0, d.get("moe_seconds", 0.0) - disk)
    other = max(0.0, total - attention - experts - disk)
    return {"attention": attention, "experts": experts, "disk": disk, "other": other}


IDLE_TRIM_SECONDS = 1.0  # after a turn, this long with nothing to run: give freed memory back


class Worker:
    """Runs jobs one by one on its own thread; at most `max_queue` wait behind the running one."""

    def __init__(self, engine, max_queue: int, on_turn=None):
        self.engine = engine  # touched by the worker thread only, once it runs
        self.max_queue = max_queue
        self.on_turn = on_turn or (lambda turn: None)  # called (worker thread) with each turn record
        self.waiting: deque[Job] = deque()
        self.running: Job | None = None
        self.snapshot: Snapshot = take(engine)  # the engine after loading; replaced, never changed
        self.turn_seconds: deque[float] = deque(maxlen=20)  # recent turn durations, for Retry-After
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="colibri-generate", daemon=True)
        self._thread.start()

    # ---- the event-loop side ----------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._cv:
            room = self.max_queue + (1 if self.running is None and not self.waiting else 0)
            if len(self.waiting) >= room:
                raise QueueFull(self.retry_after())
            self.waiting.append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        with self._cv:
            if job.tokens_at_cancel is None:
                job.tokens_at_cancel = job.tokens
            job.cancelled.set()
            if job in self.waiting:
                self.waiting.remove(job)

    def retry_after(self) -> int:
        """Seconds until a queue slot is likely free: one average turn (at least 1 s)."""
        recent = list(self.turn_seconds)
        return max(1, min(600, math.ceil(sum(recent) / len(recent)))) if recent else 1

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            for job in [*self.waiting, *([self.running] if self.running else [])]:
                job.cancelled.set()
            self.waiting.clear()
            self._cv.notify()
        self._thread.join(timeout=10)
        if not self._thread.is_alive():  # the engine's only user is gone: close it (the prefix cache's
            self.engine.close()  # entries still in RAM are written to disk, found again after a restart)

    # ---- the worker thread -------------------------------------------------------------------
    def _loop(self) -> None:
        trimmed = True
        while True:
            with self._cv:
                while not self.waiting and not self._stop:
                    if not self._cv.wait(timeout=None if trimmed else IDLE_TRIM_SECONDS) and not trimmed:
                        memory.trim()  # idle since the last turn: its freed pages go back
                        trimmed = True
                trimmed = False
                if self._stop:
                    return
                job = self.running = self.waiting.popleft()
            try:
                if not job.cancelled.is_set():
                    self._generate(job)
            except ColibriError as e:
                job.emit(Failed(str(e)))
            except Exception as e:  # a bug: report it, keep serving
                log.error("generation failed:\n%s", traceback.format_exc())
                job.emit(Failed(f"internal error: {type(e).__name__}: {e}"))
            finally:
                if self.snapshot.live is not None:  # the job failed: nothing runs any more
                    self.snapshot = replace(self.snapshot, live=None)
                with self._cv:
                    self.running = None

    def _publish(self, live: dict | None) -> None:
        """Replace the snapshot with the engine as it is now (worker thread, between two steps)."""
        self.snapshot = take(self.engine, live)

    def _generate(self, job: Job) -> None:
        engine, p = self.engine, job.params
        before = _number_stats(engine)
        started = time.perf_counter()
        # cached_tokens: the prompt's tokens the prefix cache served, known once its prefill is done
        live = {"kind": job.kind, "prompt_tokens": len(job.prompt_ids), "cached_tokens": None, "tokens": 0,
                "started": started, "first_token": None}
        self._publish(live)
        text = TextStream(engine.tokenizer, p.stop)
        finish, n, first = "cancelled", 0, None
        # persistent sessions (issue 5) plug in here: a request's session → engine.stream(session=...)
        structure = {} if p.constraint is None else {"constraint": p.constraint}  # its forced tokens drafted
        tokens = engine.stream(job.prompt_ids, p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed,
                               stop_ids=p.stop_ids, session=None, **structure)
        try:
            for token in tokens:
                n = job.tokens = n + 1
                if first is None:
                    first = live["first_token"] = time.perf_counter()
                    cached = _number_stats(engine).get("prefix_cached_tokens", 0) - before.get("prefix_cached_tokens", 0)
                    live["cached_tokens"] = cached
                live["tokens"] = n
                self._publish(live)  # the token's pass is done: statistics and map as they are now
                piece = text.push(token)
                whole = False  # the last token allowed ends the grammar too: "stop", not "length"
                if n >= p.max_tokens and p.constraint is not None:
                    next(tokens, None)  # the engine's last step: it advances the constraint past `token`, then ends
                    whole = p.constraint.finished()
                done = ("stop" if text.stopped or token in p.stop_ids or whole
                        else "length" if n >= p.max_tokens else None)
                if done:
                    finish = done
                    job.emit(Delta(piece + text.flush(), finish))
                    break
                if piece:
                    job.emit(Delta(piece))
                if job.cancelled.is_set():
                    break
            else:  # the engine ended the answer on its own (an end-of-sequence token it does not yield)
                if not job.cancelled.is_set():
                    finish = "stop"
                    job.emit(Delta(text.flush(), finish))
        finally:
            tokens.close()
        end = time.perf_counter()
        after = _number_stats(engine)
        self.turn_seconds.append(end - job.arrived)
        decode = end - first if first is not None and n > 1 else 0.0
        turn = {
            "kind": job.kind,
            "finish_reason": finish,
            "prompt_tokens": len(job.prompt_ids),
            "completion_tokens": n,
            "queue_seconds": started - job.arrived,
            "time_to_first_token": (first - job.arrived) if first is not None else None,
            "prefill_seconds": (first - started) if first is not None else None,
            "seconds": end - started,
            "decode_tokens_per_second": (n - 1) / decode if decode > 0 else 0.0,
            "split": time_split(before, after, end - started),
            "expert_hits": after.get("expert_hits", 0) - before.get("expert_hits", 0),
            "expert_misses": after.get("expert_misses", 0) - before.get("expert_misses", 0),
            "bytes_read": after.get("bytes_read", 0) - before.get("bytes_read", 0),
            # speculative decoding: tokens drafted, and those of them the model accepted
            "draft_drafted": after.get("draft_drafted", 0) - before.get("draft_drafted", 0),
            "draft_accepted": after.get("draft_accepted", 0) - before.get("draft_accepted", 0),
            # prompt tokens restored from the prefix cache, not prefilled (colibri_core/prefix.py)
            "cached_tokens": after.get("prefix_cached_tokens", 0) - before.get("prefix_cached_tokens", 0),
            "finished_at": time.time(),
            # tokens generated after the client went away (the one in flight when it did): at most 1
            "tokens_after_cancel": None if job.tokens_at_cancel is None else n - job.tokens_at_cancel,
        }
        self.on_turn(turn)
        self._publish(None)  # the turn's end: its routing history saved, the hot-store revised
        job.emit(End(turn))
