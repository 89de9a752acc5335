"""Up to `parallel` generations decoded together, behind a bounded first-in-first-out queue.

The engine is not thread-safe, so one thread, the worker, is its only user: it runs the engine's
batch (colibri_core/batch.py), where every running job advances by one forward per step (a decode
step, a verified draft, or a chunk of its prompt) and each MoE layer reads the union of their
experts once; a job joins between two steps as soon as a place is free, and leaves when it ends.
Each job's tokens are bit for bit those it gets alone. The worker publishes what the rest of the
server may know of the engine as a `Snapshot` (snapshot.py) after loading, after every step and
at the end of every job. HTTP handlers (on the event loop) submit a `Job` and read its events
back through an asyncio queue; for statistics and the expert map they read `Worker.snapshot`.
Beyond `max_queue` waiting jobs a request is refused at once (`QueueFull` → 429 with
Retry-After). A job whose client went away is cancelled: dropped from the queue if it has not
started, stopped after its current forward if it has. An `EmbeddingJob` takes a place like a
generation: its inputs' forwards (Engine.embed) run in the batch, a prefill chunk per step.
"""
from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

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
    # the rest of generate.Sampling (min_p, presence_penalty, frequency_penalty, repetition_penalty,
    # penalty_last_n, logit_bias), as Engine.stream's keywords
    knobs: dict = field(default_factory=dict)
    logprobs: int | None = None  # the most likely tokens listed with each token's log-probability (None: none)


@dataclass
class Delta:
    """New text of a running job; `finish` ("stop" | "length") on its last delta; with logprobs, those
    of the tokens since the last delta (`logprob_entry`'s)."""

    text: str
    finish: str | None = None
    logprobs: list[dict] | None = None


def logprob_entry(tokenizer, t) -> dict:
    """A generate.Token in OpenAI's chat shape: {"token", "logprob", "bytes", "top_logprobs"}, each
    token's text decoded alone (special tokens as their text) and its UTF-8 bytes."""
    def one(token: int, logprob: float) -> dict:
        text = tokenizer.decode([token], skip_special_tokens=False)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {**one(t.id, t.logprob), "top_logprobs": [one(i, lp) for i, lp in t.top]}


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


@dataclass(eq=False)  # each job is itself (the worker keys its running jobs by them)
class Job:
    kind: str  # "chat" | "completion"
    prompt_ids: list[int]
    params: Params
    loop: asyncio.AbstractEventLoop
    # (job, event): Delta… then End or Failed; the choices of one request (OpenAI's `n`) share one queue
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)
    tokens: int = 0  # generated so far (the worker counts them)
    tokens_at_cancel: int | None = None  # how many there were when the client went away
    # a job that joins the batch only once this one's prompt is prefilled (or it has ended): OpenAI's
    # `n`, whose other choices then start from that prompt's state in the prefix cache
    after: Job | None = None

    def emit(self, event) -> None:
        """From the worker thread: hand `event` to the handler waiting on the event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (self, event))
        except RuntimeError:  # the event loop has closed: the server is shutting down
            self.cancelled.set()


@dataclass(eq=False)
class EmbeddingJob:
    """Inputs to embed (lists of token ids), answered by one `Embedded` (or `Failed`) event; it waits,
    joins and is cancelled as a `Job` does."""

    inputs: list[list[int]]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # (job, event), as a Job's
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)
    tokens: int = 0  # it generates none (Worker.cancel reads them)
    tokens_at_cancel: int | None = None
    after: None = None  # never held back (Job.after)
    emit = Job.emit


@dataclass
class Embedded:
    """An embedding job's vectors, float32 (H,) each, in the order of its inputs."""

    vectors: list


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
    """Runs up to `parallel` jobs together on its own thread; at most `max_queue` wait behind them."""

    def __init__(self, engine, max_queue: int, on_turn=None, parallel: int = 1):
        self.engine = engine  # touched by the worker thread only, once it runs
        self.max_queue = max_queue
        self.parallel = parallel
        self.on_turn = on_turn or (lambda turn: None)  # called (worker thread) with each turn record
        self.waiting: deque[Job] = deque()
        self.running: dict[Job, _Running] = {}  # the jobs in the batch, in the order they joined
        self.snapshot: Snapshot = take(engine)  # the engine after loading; replaced, never changed
        self.turn_seconds: deque[float] = deque(maxlen=20)  # recent turn durations, for Retry-After
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="colibri-generate", daemon=True)
        self._thread.start()

    # ---- the event-loop side ----------------------------------------------------------------
    def submit(self, *jobs: Job) -> None:
        """Queue `jobs` (one request's), all or none: each needs a place in the batch or in the queue."""
        with self._cv:
            if len(self.waiting) + len(self.running) + len(jobs) > self.max_queue + self.parallel:
                raise QueueFull(self.retry_after())
            self.waiting.extend(jobs)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        with self._cv:
            if job.tokens_at_cancel is None:
                job.tokens_at_cancel = job.tokens
            job.cancelled.set()
            if job in self.waiting:
                self.waiting.remove(job)

    def retry_after(self) -> int:
        """Seconds until a queue slot is likely free: one average turn over the places (at least 1 s)."""
        recent = list(self.turn_seconds)
        return max(1, min(600, math.ceil(sum(recent) / len(recent) / self.parallel))) if recent else 1

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            for job in [*self.waiting, *self.running]:
                job.cancelled.set()
            self.waiting.clear()
            self._cv.notify()
        self._thread.join(timeout=10)
        if not self._thread.is_alive():  # the engine's only user is gone: close it (the prefix cache's
            self.engine.close()  # entries still in RAM are written to disk, found again after a restart)

    # ---- the worker thread -------------------------------------------------------------------
    def _loop(self) -> None:
        with self.engine.batch() as batch:  # the engine runs nothing else while the server does
            trimmed, warming = True, True
            while True:
                with self._cv:
                    while not self.waiting and not self.running and not self._stop:
                        if warming:  # nothing to run: read back one entry the prefix cache spilled before
                            self._cv.release()  # a request may come meanwhile
                            try:
                                warming = self.engine.prefix_cache.warm(self.engine.new_state())
                                self._publish()
                            except Exception:  # a bug: serve without the rest
                                log.error("warming the prefix cache failed:\n%s", traceback.format_exc())
                                warming = False
                            finally:
                                self._cv.acquire()
                            continue
                        if not self._cv.wait(timeout=None if trimmed else IDLE_TRIM_SECONDS) and not trimmed:
                            memory.trim()  # idle since the last turn: its freed pages go back
                            trimmed = True
                    trimmed = False
                    if self._stop:
                        return  # closing the batch cancels what still runs
                    for job in list(self.waiting):  # join the batch, first come first, unless held
                        if len(self.running) >= self.parallel:
                            break
                        if job.after is not None and not self._prefilled(job.after):
                            continue
                        self.waiting.remove(job)
                        if job.cancelled.is_set():
                            continue
                        try:
                            start = _Embedding if isinstance(job, EmbeddingJob) else _Running
                            self.running[job] = start(self, batch, job)
                        except Exception as e:  # a bug: report it, keep serving
                            log.error("a job could not start:\n%s", traceback.format_exc())
                            job.emit(Failed(f"internal error: {type(e).__name__}: {e}"))
                for job, run in list(self.running.items()):
                    if job.cancelled.is_set():
                        run.generation.cancel()
                try:
                    batch.step()
                except Exception:  # a bug in the batch itself: every running job fails, the server goes on
                    log.error("a batch step failed:\n%s", traceback.format_exc())
                    for run in self.running.values():
                        run.generation.cancel()
                        run.generation.error = run.generation.error or RuntimeError("the batch step failed")
                with self._cv:
                    ended = [self.running.pop(job) for job, run in list(self.running.items()) if run.generation.done]
                self._publish()  # before their ends are sent: a client then sees its request gone
                for run in ended:
                    run.end()

    def _prefilled(self, job: Job) -> bool:
        """`job`'s prompt has been prefilled (its state is in the prefix cache), or it has ended."""
        return job.tokens > 0 or (job not in self.running and job not in self.waiting)

    def _publish(self) -> None:
        """Replace the snapshot with the engine as it is now (worker thread, between two steps)."""
        self.snapshot = take(self.engine, [run.live for run in self.running.values()])


class _Running:
    """A job in the batch: its generation, the text streamed so far, its live figures."""

    def __init__(self, worker: Worker, batch, job: Job):
        engine, p = worker.engine, job.params
        self.worker, self.job = worker, job
        self.started = time.perf_counter()
        self.before = _number_stats(engine)  # with others running beside it, the engine's counters over its turn
        # cached_tokens: the prompt's tokens the prefix cache served, known once its prefill is done
        self.live = {"kind": job.kind, "prompt_tokens": len(job.prompt_ids), "cached_tokens": None, "tokens": 0,
                     "started": self.started, "first_token": None}
        self.text = TextStream(engine.tokenizer, p.stop)
        self.tail = ""  # the text of the token a stop string ended on, sent with the finish
        self.first: float | None = None
        self.scores = None if p.logprobs is None else []  # a generate.Token per token (Engine.stream's logprobs)
        self.scored = 0  # of them sent with a delta
        structure = {} if p.constraint is None else {"constraint": p.constraint}  # its forced tokens drafted
        self.generation = batch.add(job.prompt_ids, p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed,
                                    stop_ids=p.stop_ids, on_token=self._token, logprobs=self.scores,
                                    top_logprobs=p.logprobs or 0, **p.knobs, **structure)

    def _logprobs(self) -> list[dict] | None:
        """The log-probabilities of the tokens since the last delta (an end-of-sequence token is no
        part of the text, nor of them); None when the request asked for none."""
        if self.scores is None:
            return None
        new, self.scored = self.scores[self.scored:], len(self.scores)
        return [logprob_entry(self.worker.engine.tokenizer, t) for t in new if t.id not in self.job.params.stop_ids]

    def _token(self, token: int) -> bool:
        """Each new token, as the engine yields it: False ends the generation (a stop string, or the
        client went away)."""
        job, live = self.job, self.live
        n = job.tokens = job.tokens + 1
        if self.first is None:
            self.first = live["first_token"] = time.perf_counter()
            live["cached_tokens"] = self.generation.cached_tokens
        live["tokens"] = n
        piece = self.text.push(token)
        if self.text.stopped:
            self.tail = piece
            return False
        if piece:
            job.emit(Delta(piece, logprobs=self._logprobs()))
        return not job.cancelled.is_set()

    def end(self) -> None:
        """The generation is over: its last delta and its turn record."""
        job, p, g, engine = self.job, self.job.params, self.generation, self.worker.engine
        n = len(g.tokens)
        if g.error is not None:
            if isinstance(g.error, ColibriError):
                job.emit(Failed(str(g.error)))
            else:  # a bug: report it, keep serving
                log.error("generation failed:\n%s", "".join(traceback.format_exception(g.error)))
                job.emit(Failed(f"internal error: {type(g.error).__name__}: {g.error}"))
            return
        if job.cancelled.is_set():
            finish = "cancelled"
        elif self.text.stopped or (g.tokens and g.tokens[-1] in p.stop_ids) or (
                p.constraint is not None and p.constraint.finished()):
            finish = "stop"  # a stop string, an end-of-sequence token, or the grammar's end
        elif n >= p.max_tokens:
            finish = "length"
        else:  # the engine ended the answer on its own (an end-of-sequence token it does not yield)
            finish = "stop"
        if finish != "cancelled":
            job.emit(Delta(self.tail + self.text.flush(), finish, self._logprobs()))
        end = time.perf_counter()
        after = _number_stats(engine)
        before, first, started = self.before, self.first, self.started
        self.worker.turn_seconds.append(end - job.arrived)
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
            # the engine's counters over the turn: with other jobs running beside it, theirs too
            "split": time_split(before, after, end - started),
            "expert_hits": after.get("expert_hits", 0) - before.get("expert_hits", 0),
            "expert_misses": after.get("expert_misses", 0) - before.get("expert_misses", 0),
            "bytes_read": after.get("bytes_read", 0) - before.get("bytes_read", 0),
            # speculative decoding: tokens drafted, and those of them the model accepted
            "draft_drafted": after.get("draft_drafted", 0) - before.get("draft_drafted", 0),
            "draft_accepted": after.get("draft_accepted", 0) - before.get("draft_accepted", 0),
            # prompt tokens restored from the prefix cache, not prefilled (colibri_core/prefix.py)
            "cached_tokens": g.cached_tokens,
            "concurrent": len(self.worker.running) + 1,  # jobs in the batch as this one ended, itself included
            "finished_at": time.time(),
            # tokens generated after the client went away (the one in flight when it did): at most 1
            "tokens_after_cancel": None if job.tokens_at_cancel is None else n - job.tokens_at_cancel,
        }
        self.worker.on_turn(turn)
        job.emit(End(turn))


class _Embedding:
    """An embedding job in the batch: an entry that only prefills (Engine.embed on each input in turn,
    a chunk a step, so the streams beside it go on), its vectors sent whole when it ends."""

    def __init__(self, worker: Worker, batch, job: EmbeddingJob):
        self.worker, self.job = worker, job
        self.started = time.perf_counter()
        self.vectors = []
        self.live = {"kind": "embedding", "prompt_tokens": sum(map(len, job.inputs)), "cached_tokens": 0,
                     "tokens": 0, "started": self.started, "first_token": None}

        def embed():  # an entry of the batch is a token iterator: this one yields none
            for ids in job.inputs:
                self.vectors.append(worker.engine.embed(ids))
            yield from ()

        self.generation = batch.run(embed)

    def end(self) -> None:
        job, error = self.job, self.generation.error
        self.worker.turn_seconds.append(time.perf_counter() - job.arrived)
        if isinstance(error, ColibriError):
            job.emit(Failed(str(error)))
        elif error is not None:  # a bug: report it, keep serving
            log.error("embedding failed:\n%s", "".join(traceback.format_exception(error)))
            job.emit(Failed(f"internal error: {type(error).__name__}: {error}"))
        elif not job.cancelled.is_set():
            job.emit(Embedded(self.vectors))
