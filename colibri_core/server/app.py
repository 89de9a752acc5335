"""The HTTP server: an OpenAI-compatible API, health, tokenizer, Prometheus metrics, and the dashboard.

    GET  /health                   503 while the model loads, then 200
    GET  /v1/models                the one model this server serves
    POST /v1/chat/completions      chat (the model's own template), streamed as SSE or not
    POST /v1/completions           completion of a prompt (text or token ids), streamed or not
    POST /v1/embeddings            mean-pooled hidden states of texts or token ids (embeddings.py)
    POST /tokenize  /detokenize    text ↔ token ids with the model's tokenizer
    GET  /metrics                  Prometheus text (colibri_ prefix)
    GET  /api/stats  /api/brain    JSON the dashboard draws (queue, timings, memory, the expert map)
    GET  /api/atlas                every expert's 3D position, topic shares, tier and heat (atlas.py)
    GET  /openapi.json             the OpenAPI 3.1 document, generated from the request models (openapi.py)
    GET  /  /atlas                 the dashboard and its Atlas page (`colibri web`)

The model loads on a thread after the server starts listening; requests are validated on the
event loop, then decoded together (up to --parallel) by the `Worker`, the engine's only user once it
is loaded. /metrics, /api/stats, /api/brain and the once-a-second sampler read the `Snapshot` the
worker publishes between two steps, never the engine (whose tokenizer, chat template and generation
defaults are read-only and shared); chat templates and tokenizers run on worker threads, never on
the event loop. Every error is a JSON body of the OpenAI form with a 4xx status (503 while
loading); a 500 is a bug. security.py guards every route (Host, Origin, the API key).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import secrets
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..errors import ColibriError
from ..options import EngineOptions
from . import brain, memory, metrics as metrics_mod
from . import atlas_view, openapi, security, structure
from .schemas import (CHARS_PER_TOKEN, ApiError, Limits, Sampling, invalid, parse_chat, parse_completion, parse_detokenize,
                      parse_json, parse_tokenize)
from .embeddings import encoded, parse_embeddings
from .snapshot import Snapshot
from .text import ChatText
from .worker import Delta, EmbeddingJob, End, Failed, Job, Params, QueueFull, Worker

log = logging.getLogger("colibri.server")
# The dashboard's files: package data (pyproject: package-data), found through importlib.resources;
# installed as files, so a real directory StaticFiles can serve.
STATIC = Path(str(resources.files(__package__) / "static"))
GREEDY_BELOW = 1e-5  # a temperature below this samples greedily (vLLM's rule): 1/T would overflow the logits


@dataclass
class ServerConfig:
    model_dir: Path
    model_name: str | None = None  # the model id clients send (default: the directory's name)
    engine: EngineOptions = field(default_factory=EngineOptions)  # the engine's settings, as `colibri run`'s
    parallel: int = 4  # requests decoded together (continuous batching: server/worker.py, batch.py)
    max_queue: int = 16  # requests that may wait behind the running ones; more get 429
    api_key: str | None = None  # if set, every endpoint but /health needs "Bearer KEY" (or the dashboard's cookie)
    dashboard: bool = False  # serve the dashboard at / (`colibri web`)
    max_body_bytes: int = 16 << 20
    # request body bytes all connections together may hold while they arrive (more: 503, memory.BodyBudget):
    # four bodies of the largest size at once
    max_body_bytes_in_flight: int = 64 << 20
    max_tokens: int | None = None  # most tokens one request may generate (None: the context)
    allow_origins: tuple[str, ...] = ()  # foreign web origins (or "*") allowed to call the API (CORS)
    # Host names served besides loopback's, IP addresses and its own (or "*"): a reverse proxy's public name
    trusted_hosts: tuple[str, ...] = ()
    host: str = "127.0.0.1"  # where it listens: its name is a Host the server answers to
    body_timeout: float = 30.0  # seconds for a request body to arrive whole (408 after)
    header_timeout: float = 10.0  # seconds for a request's headers to arrive whole (the connection closed after)
    tokenize_threads: int = 2  # chat templates and tokenizers run at most this many at once, off the event loop

    def __post_init__(self):
        if self.api_key is not None and not self.api_key.strip():
            raise ColibriError("the API key is empty: give a key (--api-key KEY or COLIBRI_API_KEY), or none to serve "
                               "without one")
        if not 1 <= self.parallel <= 256:
            raise ColibriError(f"--parallel must be from 1 to 256, got {self.parallel}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ColibriError(f"--max-tokens must be at least 1, got {self.max_tokens}")
        if self.max_body_bytes_in_flight < self.max_body_bytes:  # a body of the largest size could never arrive
            raise ColibriError(f"max_body_bytes_in_flight ({self.max_body_bytes_in_flight}) is less than "
                               f"max_body_bytes ({self.max_body_bytes})")
        for origin in self.allow_origins:
            if origin != "*":
                try:
                    security.normalize_origin(origin)
                except ValueError as e:
                    raise ColibriError(f"--allow-origin: {e}") from None
        for host in self.trusted_hosts:
            if host != "*" and not security.is_host_name(host):
                raise ColibriError(f"--trusted-host: {host!r} is not a host name (a name or an IP address, as in "
                                   "the Host header, without scheme or path: e.g. llm.example.com)")


class Server:
    """Everything the handlers share: the engine (None while loading), its worker, the metrics.

    The handlers use the engine only for its read-only parts (tokenizer, generation defaults);
    everything that changes as it runs they read from `snapshot()`."""

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.model_id = cfg.model_name or Path(cfg.model_dir).resolve().name
        self.engine = None
        self.worker: Worker | None = None
        self.template = None
        self.chat_text: ChatText | None = None  # a conversation's token ids, typed special tokens as text
        self.context_length: int | None = None
        self.ram_budget: int | None = None
        self.load_error: str | None = None
        self.loaded = threading.Event()
        self.on_loaded = None  # called (loader thread) once loading ends, well or not
        self.metrics = metrics_mod.Metrics()
        self.created = int(time.time())
        self.limits = Limits(max_tokens=cfg.max_tokens, max_body_bytes=cfg.max_body_bytes)
        # chat templates and tokenizers: a pool of their own, so the threads are a fixed number
        self.text_pool = ThreadPoolExecutor(cfg.tokenize_threads, thread_name_prefix="colibri-text")
        self.bodies = memory.BodyBudget(cfg.max_body_bytes_in_flight)  # request bodies still arriving

    # ---- loading ------------------------------------------------------------------------------
    def load(self) -> None:
        from ..chat_template import ChatTemplate
        from ..engine import load

        cfg = self.cfg
        try:
            engine = load(cfg.model_dir, cfg.engine)
            engine.tokenizer  # noqa: B018 — read tokenizer.json now, not on the first request
            self.template = ChatTemplate.from_dir(engine.model_dir)
            self.chat_text = ChatText(engine.tokenizer)
            self.context_length = engine.context_length
            self.ram_budget = engine.split.budget or None  # none with --cache-slots alone
            vocab = engine.tokenizer.tok.get_vocab_size(with_added_tokens=True)
            self.limits = Limits(self.context_length, vocab, cfg.max_tokens, cfg.max_body_bytes)
            self.worker = Worker(engine, cfg.max_queue, on_turn=self.metrics.add_turn, parallel=cfg.parallel)
            self.engine = engine
        except ColibriError as e:
            self.load_error = str(e)
        except Exception as e:  # a bug, but the server must still say why it cannot serve
            log.error("loading failed:\n%s", traceback.format_exc())
            self.load_error = f"cannot load {cfg.model_dir}: {type(e).__name__}: {e}"
        finally:
            self.loaded.set()
            if self.on_loaded:
                self.on_loaded(self)

    def ready(self):
        if self.engine is None:
            if self.load_error:
                raise ApiError(503, f"the model failed to load: {self.load_error}", type="server_error",
                               code="model_load_failed")
            raise ApiError(503, "the model is loading; retry shortly", type="server_error", code="model_loading",
                           headers={"Retry-After": "1"})
        return self.engine

    # ---- request checks (who may ask is security.Guard's business) -------------------------------
    def parse(self, parser, body: dict):
        """`parser(body, limits)`, then the model must be loaded and be the one asked for. A malformed
        request is a 400 even while loading; the bounds known only once loaded (the vocabulary) are
        checked again if loading ended in between."""
        lim = self.limits
        req = parser(body, lim)
        self.ready()
        if self.limits is not lim:
            req = parser(body, self.limits)
        model = req.sampling.model if hasattr(req, "sampling") else req["model"]
        self.check_model(model)
        return req

    def check_model(self, model: str | None) -> None:
        """The model asked for must be this one, by its id (never by a path: the server does not say
        where the model lives, nor confirm a guess)."""
        if model is None or model == self.model_id:
            return
        raise ApiError(404, f"the model '{model}' does not exist: this server serves '{self.model_id}'",
                       param="model", code="model_not_found")

    def resolve(self, s: Sampling, n_prompt: int, param: str) -> Params:
        """The request's sampling, with generation_config.json's defaults, checked against the context."""
        gen = self.engine.generation
        ctx = self.context_length
        if n_prompt == 0:
            raise invalid(param, f"'{param}' is empty: there is nothing to complete")
        if ctx is not None and n_prompt >= ctx:
            raise invalid(param, f"this model's maximum context length is {ctx} tokens, but the prompt has "
                          f"{n_prompt} tokens", "context_length_exceeded")
        max_tokens = s.max_tokens
        if max_tokens is None:
            room = ctx - n_prompt if ctx is not None else 2048
            max_tokens = min(room, gen["max_new_tokens"]) if isinstance(gen.get("max_new_tokens"), int) else room
            max_tokens = min(max_tokens, self.cfg.max_tokens or max_tokens)  # the operator's cap
        elif ctx is not None and n_prompt + max_tokens > ctx:
            raise invalid(s.max_tokens_param, f"this model's maximum context length is {ctx} tokens, but {n_prompt + max_tokens} "
                          f"were requested ({n_prompt} in the prompt, {max_tokens} to generate)",
                          "context_length_exceeded")

        def default(value, key, fallback):
            return value if value is not None else gen.get(key, fallback)

        temperature = float(default(s.temperature, "temperature", 1.0))
        return Params(
            max_tokens=max_tokens,
            temperature=0.0 if temperature < GREEDY_BELOW else temperature,
            top_p=float(default(s.top_p, "top_p", 1.0)),
            top_k=int(default(s.top_k, "top_k", 0)),
            seed=s.seed,
            stop=s.stop,
            stop_ids=() if s.ignore_eos else tuple(gen.get("eos_token_id", [])),
            knobs={"min_p": float(default(s.min_p, "min_p", 0.0)), "presence_penalty": s.presence_penalty,
                   "frequency_penalty": s.frequency_penalty,
                   "repetition_penalty": float(default(s.repetition_penalty, "repetition_penalty", 1.0)),
                   "penalty_last_n": s.penalty_last_n, "logit_bias": s.logit_bias},
            logprobs=s.logprobs,
        )

    def snapshot(self) -> Snapshot | None:
        """The engine as the worker last published it; None until the model is loaded."""
        return self.worker.snapshot if self.engine is not None else None

    def queue_state(self) -> dict:
        w = self.worker
        return {"waiting": len(w.waiting) if w else 0, "running": len(w.running) if w else 0,
                "parallel": self.cfg.parallel, "capacity": self.cfg.max_queue}


    async def off_loop(self, fn, *args):
        """Run `fn` (a chat template, a tokenizer) on a worker thread, at most `tokenize_threads` at
        once, so a long prompt never stalls the event loop (health checks, streams, metrics)."""
        return await asyncio.get_running_loop().run_in_executor(self.text_pool, functools.partial(fn, *args))

    def _bound(self, n_chars: int, param: str) -> None:
        if n_chars > self.limits.max_chars:
            raise invalid(param, f"the prompt is {n_chars} characters; this server tokenizes at most "
                          f"{self.limits.max_chars} ({CHARS_PER_TOKEN} per token of its context)", "context_length_exceeded")

    async def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids (special tokens written in it are tokens, as in a raw completion)."""
        self._bound(len(text), param)
        return await self.off_loop(self.engine.tokenizer.encode, text, add_special_tokens)

    async def encode_chat(self, messages: list[dict], tools=None, add_generation_prompt: bool = True) -> list[int]:
        """A conversation through the chat template, as token ids; special tokens typed in a message
        stay text (text.ChatText). A conversation the template refuses (or fails on) is a 400."""
        if self.template is None:
            raise invalid("messages", "this model has no chat template (chat_template.jinja or tokenizer_config.json); "
                          "use /v1/completions", "no_chat_template")
        self._bound(sum(len(m["content"]) for m in messages), "messages")  # before the template runs on it

        def run():
            text = self.template.render(self.chat_text.mask(messages), add_generation_prompt=add_generation_prompt,
                                        tools=tools)
            self._bound(len(text), "messages")
            return self.chat_text.encode(text)
        try:
            return await self.off_loop(run)
        except ApiError:
            raise
        except ColibriError as e:  # the template refused the conversation (raise_exception)
            raise invalid("messages", str(e)) from None
        except Exception as e:  # a template reading a field of a shape it does not expect
            raise invalid("messages", f"the chat template cannot render these messages: {type(e).__name__}: {e}") from None


async def read_json(request: Request, server: Server) -> dict:
    """The body as a JSON object; larger than `max_body_bytes` (declared, or as it arrives, also when
    chunked) is a 413 before more is read; one that would take the bodies arriving on all connections
    past `max_body_bytes_in_flight` (declared, or as it arrives) is a 503 with Retry-After, also
    before more is read (memory.BodyBudget); a body that takes longer than `body_timeout` is a 408."""
    limit, budget = server.cfg.max_body_bytes, server.bodies
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:  # refused before it is read
        raise ApiError(413, f"the request body is {declared} bytes; at most {limit} are accepted",
                       code="request_too_large", headers={"Connection": "close"})

    def busy() -> ApiError:  # made when raised: one kept in a local would be in a cycle with its own traceback
        return ApiError(503, f"the server is receiving as many request body bytes at once as it holds "
                        f"({budget.limit}); retry shortly", type="server_error", code="server_busy",
                        headers={"Retry-After": "1", "Connection": "close"})

    if declared.isdigit() and budget.held + int(declared) > budget.limit:
        raise busy()
    taken = 0  # bytes of the budget this body holds: what has arrived (a declared length held nothing)

    async def read() -> bytearray:
        nonlocal taken
        body = bytearray()
        try:
            async for chunk in request.stream():
                if len(body) + len(chunk) > limit:
                    raise ApiError(413, f"the request body is more than {limit} bytes; at most {limit} are accepted",
                                   code="request_too_large", headers={"Connection": "close"})
                if not budget.take(len(chunk)):
                    raise busy()
                taken += len(chunk)
                body += chunk  # the chunk is freed at once: a body is held once, not as chunks and their join
        except BaseException:  # refused, timed out, its client gone: the exception's frames, in a cycle with
            body.clear()  # asyncio's task, would hold the bytes until the next garbage collection
            raise
        return body

    try:
        raw = await asyncio.wait_for(read(), server.cfg.body_timeout)
    except ClientDisconnect:  # nobody will read the answer
        raise ApiError(499, "the client went away before its request arrived", code="client_closed") from None
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {server.cfg.body_timeout:g} s",
                       code="request_timeout", headers={"Connection": "close"}) from None
    finally:
        budget.give(taken)
    return parse_json(raw)


async def wait_disconnect(request: Request) -> None:
    """Return once the client has gone away (after the body has been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# ---- generation responses -----------------------------------------------------------------------
def _usage(turn: dict) -> dict:
    """OpenAI's usage block; the prompt tokens the prefix cache served go where OpenAI counts cached
    ones; drafted tokens where it counts a prediction's tokens (Predicted Outputs): accepted ones are
    part of the completion, rejected ones cost a forward but are not."""
    return {"prompt_tokens": turn["prompt_tokens"], "completion_tokens": turn["completion_tokens"],
            "total_tokens": turn["prompt_tokens"] + turn["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": turn["cached_tokens"]},
            "completion_tokens_details": {"accepted_prediction_tokens": turn["draft_accepted"],
                                          "rejected_prediction_tokens": turn["draft_drafted"] - turn["draft_accepted"]}}


class Choice:
    """One of a request's answers (OpenAI's `n`): its job, and the state of its shaping."""

    def __init__(self, generation: Generation, index: int, job: Job):
        self.index, self.job = index, job
        self.text_offset = len(generation.echo)  # where the next token's text begins (completions' logprobs.text_offset)
        # tool calls as they stream (structure.py): text held until it is known not to be a call
        self.calls = structure.CallStream(generation.forced_call) if generation.tools else None
        self.ended = False  # End or Failed received


class Generation:
    """One accepted request: the jobs of its `n` choices in the worker's queue, and how its answer is
    shaped. The choices after the first join the batch once the first's prompt is prefilled, so they
    start from its state in the prefix cache (worker.Job.after)."""

    def __init__(self, server: Server, kind: str, prompt_ids: list[int], choices: list[Params], sampling: Sampling,
                 echo: str = "", tools: bool = False, forced_call: str | None = None):
        self.server, self.kind, self.sampling, self.echo = server, kind, sampling, echo
        self.tools = tools  # the answer may be tool calls (structure.py): answered as `tool_calls`
        self.forced_call = forced_call  # the function the answer's first call is known to be (structure.forced_name)
        self.endpoint = "chat" if kind == "chat" else "completions"
        self.object = "chat.completion" if kind == "chat" else "text_completion"
        self.chunk_object = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()  # (choice, event) of every choice, as they come
        jobs, lead = [], None
        for params in choices:
            job = Job(kind, prompt_ids, params, loop, events=self.events, after=lead)
            jobs.append(job)
            lead = lead or (job if server.engine.prefix_cache.budget else None)  # no cache: all start at once
        self.choices = [Choice(self, i, job) for i, job in enumerate(jobs)]
        self.by_job = {id(c.job): c for c in self.choices}
        try:
            server.worker.submit(*jobs)
        except QueueFull as e:
            server.metrics.count(self.endpoint, "rejected")
            raise ApiError(429, str(e), type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(e.retry_after)}) from None

    @property
    def finished(self) -> bool:
        return all(c.ended for c in self.choices)

    def cancel(self) -> None:
        """The client has gone: drop the jobs from the queue, or stop them at the next token."""
        live = [c.job for c in self.choices if not c.ended and not c.job.cancelled.is_set()]
        for job in live:
            self.server.worker.cancel(job)
        if live:
            self.server.metrics.count(self.endpoint, "cancelled")

    async def next_event(self) -> tuple[Choice, object]:
        """The next event of any choice (worker.Job.emit puts (job, event) on the shared queue)."""
        job, event = await self.events.get()
        choice = self.by_job[id(job)]
        if isinstance(event, (End, Failed)):
            choice.ended = True
        return choice, event

    def usage(self, turns: list[dict]) -> dict:
        """OpenAI's usage of the whole request: the prompt counted once (with the first choice's cached
        tokens: it prefilled the prompt the others start from), the choices' completions summed."""
        first = turns[0]
        return _usage({"prompt_tokens": first["prompt_tokens"], "cached_tokens": first["cached_tokens"],
                       **{k: sum(t[k] for t in turns) for k in ("completion_tokens", "draft_accepted", "draft_drafted")}})

    def _logprobs(self, choice: Choice, entries: list[dict] | None, whole: bool = False) -> dict | None:
        """Tokens' log-probabilities (worker.logprob_entry's) in the answer's shape: chat's
        {"content": [...]}, or completions' tokens / token_logprobs / top_logprobs / text_offset;
        None for none (a chunk without tokens, a request that asked for none), but a `whole`
        answer's when asked for, even of no token."""
        if not entries and not (whole and self.sampling.logprobs is not None):
            return None
        if self.kind == "chat":
            return {"content": entries, "refusal": None}
        offsets = []
        for e in entries:
            offsets.append(choice.text_offset)
            choice.text_offset += len(e["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                "text_offset": offsets}

    def _chunk(self, choice: Choice, text: str | None, finish: str | None, first: bool = False,
               calls: list | None = None, logprobs: list[dict] | None = None) -> dict:
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            if calls:
                delta = {"tool_calls": calls}
            body = {"index": choice.index, "delta": delta, "logprobs": self._logprobs(choice, logprobs),
                    "finish_reason": finish}
        else:
            body = {"index": choice.index, "text": text or "", "logprobs": self._logprobs(choice, logprobs),
                    "finish_reason": finish}
        chunk = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.server.model_id,
                 "system_fingerprint": None, "choices": [body]}
        if self.sampling.include_usage:
            chunk["usage"] = None
        return chunk

    def _delta_chunks(self, choice: Choice, event: Delta, scores: list[dict]):
        """The chunks of one delta of `choice`; `scores` are its log-probabilities not sent yet (they
        go with the next chunk, and are emptied once sent)."""
        pending = scores + (event.logprobs or [])
        scores.clear()
        text, deltas = event.text, []
        if choice.calls is not None:  # text held until it is known not to be a call
            text, deltas = choice.calls.push(event.text)
            if event.finish:
                rest, more = choice.calls.flush()
                text, deltas = text + rest, deltas + more
            if deltas:
                yield self._chunk(choice, None, None, calls=deltas, logprobs=pending)
                pending = []
            if text:
                yield self._chunk(choice, text, None, logprobs=pending)
                pending = []
            if event.finish:
                finish = "tool_calls" if choice.calls.called and event.finish == "stop" else event.finish
                yield self._chunk(choice, None, finish, logprobs=pending)
                pending = []
        elif text or event.finish:
            yield self._chunk(choice, text, event.finish, logprobs=pending)
            pending = []
        scores += pending

    async def events_sse(self):
        """The server-sent events of a streamed answer, ending with `data: [DONE]`: each chunk holds
        one choice's delta (its `index` says which)."""
        def sse(obj) -> bytes:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()

        for choice in self.choices:
            if self.kind == "chat":
                yield sse(self._chunk(choice, None, None, first=True))
            elif self.echo:
                yield sse(self._chunk(choice, self.echo, None))
        scores = {c.index: [] for c in self.choices}
        turns = {}
        while not self.finished:
            choice, event = await self.next_event()
            if isinstance(event, Delta):
                for chunk in self._delta_chunks(choice, event, scores[choice.index]):
                    yield sse(chunk)
            elif isinstance(event, End):
                turns[choice.index] = event.turn
            else:  # Failed: the engine could not go on (e.g. a damaged expert file)
                self.cancel()
                self.server.metrics.count(self.endpoint, "error")
                yield sse(ApiError(500, event.message, type="server_error", code="generation_failed").body())
                break
        else:
            self.server.metrics.count(self.endpoint, "ok")
            if self.sampling.include_usage:
                yield sse({"id": self.id, "object": self.chunk_object, "created": self.created,
                           "model": self.server.model_id, "system_fingerprint": None, "choices": [],
                           "usage": self.usage([turns[i] for i in sorted(turns)])})
        yield b"data: [DONE]\n\n"

    async def answer(self, request: Request) -> Response:
        """The whole answer as one JSON response (cancelled if the client leaves first)."""
        gone = asyncio.create_task(wait_disconnect(request))
        texts = {c.index: [] for c in self.choices}
        scores = {c.index: [] for c in self.choices}
        finish, turns = {}, {}
        try:
            while not self.finished:
                get = asyncio.ensure_future(self.next_event())
                done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    self.cancel()
                    return Response(status_code=499)  # nobody is listening any more
                choice, event = get.result()
                if isinstance(event, Delta):
                    texts[choice.index].append(event.text)
                    scores[choice.index] += event.logprobs or []
                    finish[choice.index] = event.finish or finish.get(choice.index)
                elif isinstance(event, End):
                    turns[choice.index] = event.turn
                else:
                    self.cancel()
                    self.server.metrics.count(self.endpoint, "error")
                    raise ApiError(500, event.message, type="server_error", code="generation_failed")
        finally:
            gone.cancel()
        self.server.metrics.count(self.endpoint, "ok")
        bodies = []
        for choice in self.choices:
            i = choice.index
            text, end = "".join(texts[i]), finish.get(i)
            logprobs = self._logprobs(choice, scores[i], whole=True)
            if self.kind == "chat":
                message = {"role": "assistant", "content": text}
                if self.tools:  # the calls as streamed, merged: one cut short by max_tokens included
                    content, calls = structure.answer_calls(text, self.forced_call)
                    message = {"role": "assistant", "content": None, "tool_calls": calls} if calls else \
                        {"role": "assistant", "content": content}
                    end = "tool_calls" if calls and end == "stop" else end
                bodies.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": end})
            else:
                bodies.append({"index": i, "text": self.echo + text, "logprobs": logprobs, "finish_reason": end})
        return JSONResponse({"id": self.id, "object": self.object, "created": self.created, "model": self.server.model_id,
                             "system_fingerprint": None, "choices": bodies,
                             "usage": self.usage([turns[i] for i in sorted(turns)])})

    async def respond(self, request: Request) -> Response:
        if self.sampling.stream:
            return EventStream(self)
        return await self.answer(request)


class EventStream(Response):
    """A server-sent event stream that cancels its generation the moment the client disconnects."""

    def __init__(self, generation: Generation):
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]  # no content-length: the body is open-ended
        self.generation = generation

    async def __call__(self, scope, receive, send) -> None:
        async def stream():
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.generation.events_sse():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await asyncio.sleep(0)  # let the loop notice a lost connection (and serve others) between chunks
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass

        streaming, watching = asyncio.ensure_future(stream()), asyncio.ensure_future(watch())
        try:
            done, _ = await asyncio.wait({streaming, watching}, return_when=asyncio.FIRST_COMPLETED)
            if streaming in done:
                streaming.result()  # re-raise a failure of our own
        except OSError:  # the connection broke while sending
            pass
        finally:
            for task in (streaming, watching):
                task.cancel()
            self.generation.cancel()  # a no-op once the job has ended


# ---- handlers -------------------------------------------------------------------------------------
def server_of(request: Request) -> Server:
    return request.app.state.server


async def health(request: Request) -> Response:
    server = server_of(request)
    if server.engine is not None:
        return JSONResponse({"status": "ok", "model": server.model_id})
    status = "error" if server.load_error else "loading"  # why it failed is for the key holders (/api/stats)
    return JSONResponse({"status": status, "model": server.model_id}, status_code=503)


def _model_card(server: Server) -> dict:
    """The model as /v1/models shows it: its id, never where it lives on disk."""
    return {"id": server.model_id, "object": "model", "created": server.created, "owned_by": "colibri",
            "max_model_len": server.context_length}


async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(server_of(request))]})


async def get_model(request: Request) -> Response:
    server = server_of(request)
    server.check_model(request.path_params["model"])
    return JSONResponse(_model_card(server))


async def _choices(server: Server, params: Params, n: int, shape) -> list[Params]:
    """The parameters of each of `n` choices: a constraint of its own (a grammar's state is one
    generation's), and with a seed, seed + i for choice i (so they differ, and each is reproducible)."""
    places = server.cfg.parallel + server.cfg.max_queue
    if n > places:
        raise invalid("n", f"n={n} is more choices than this server holds at once ({places}: --parallel "
                      "plus --queue)")
    choices = []
    for i in range(n):
        seed = params.seed + i if params.seed is not None else None
        constraint = await server.off_loop(structure.constraint, server.engine, shape)
        choices.append(replace(params, seed=seed, constraint=constraint))
    return choices


async def chat_completions(request: Request) -> Response:
    server = server_of(request)
    req = server.parse(parse_chat, await read_json(request, server))
    shape = req.structure
    messages = await server.off_loop(structure.chat_messages, server.template, req.messages, shape) if shape.tools \
        else req.messages
    ids = await server.encode_chat(messages, req.tools)
    choices = await _choices(server, server.resolve(req.sampling, len(ids), "messages"), req.n, shape)
    return await Generation(server, "chat", ids, choices, req.sampling, tools=shape.calls_tools,
                            forced_call=structure.forced_name(shape) if shape.calls_tools else None).respond(request)


async def completions(request: Request) -> Response:
    server = server_of(request)
    req = server.parse(parse_completion, await read_json(request, server))
    engine = server.engine
    ids = await server.encode(req.prompt, "prompt") if isinstance(req.prompt, str) else req.prompt
    echo = "" if not req.echo else req.prompt if isinstance(req.prompt, str) else engine.tokenizer.decode(ids)
    choices = await _choices(server, server.resolve(req.sampling, len(ids), "prompt"), req.n, req.structure)
    return await Generation(server, "completion", ids, choices, req.sampling, echo).respond(request)


async def embeddings(request: Request) -> Response:
    """One vector per input (embeddings.py says what it is), computed in the worker's batch."""
    server = server_of(request)
    req = server.parse(parse_embeddings, await read_json(request, server))
    context, batch = server.context_length, []
    for i, item in enumerate(req["input"]):
        name = "input" if len(req["input"]) == 1 else f"input[{i}]"
        ids = await server.encode(item, name) if isinstance(item, str) else item
        if not ids:
            raise invalid(name, f"'{name}' is empty: there is nothing to embed")
        if context is not None and len(ids) > context:
            raise invalid(name, f"this model's maximum context length is {context} tokens, but '{name}' has "
                          f"{len(ids)} tokens", "context_length_exceeded")
        batch.append(ids)
    job = EmbeddingJob(batch, asyncio.get_running_loop())
    try:
        server.worker.submit(job)
    except QueueFull as e:
        server.metrics.count("embeddings", "rejected")
        raise ApiError(429, str(e), type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": str(e.retry_after)}) from None
    gone = asyncio.ensure_future(wait_disconnect(request))
    answer = asyncio.ensure_future(job.events.get())
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not answer.done():  # nobody is listening any more
        answer.cancel()
        server.worker.cancel(job)
        server.metrics.count("embeddings", "cancelled")
        return Response(status_code=499)
    _, event = answer.result()
    if isinstance(event, Failed):
        server.metrics.count("embeddings", "error")
        raise ApiError(500, event.message, type="server_error", code="embedding_failed")
    server.metrics.count("embeddings", "ok")
    tokens = sum(map(len, batch))
    return JSONResponse({
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encoded(v, req["base64"])}
                 for i, v in enumerate(event.vectors)],
        "model": server.model_id,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    })


async def tokenize(request: Request) -> Response:
    server = server_of(request)
    v = server.parse(parse_tokenize, await read_json(request, server))
    special = v["add_special_tokens"] if v["add_special_tokens"] is not None else v["add_special"]
    if v["messages"] is not None:
        add_prompt = v["add_generation_prompt"] if v["add_generation_prompt"] is not None else True
        ids = await server.encode_chat(v["messages"], add_generation_prompt=add_prompt)
    else:
        text = v["content"] if v["content"] is not None else v["prompt"]
        if text is None:
            raise invalid("content", "send the text to tokenize as 'content' (or 'prompt'), a string, or 'messages'",
                          "missing_required_parameter")
        ids = await server.encode(text, "content", add_special_tokens=special is not False)
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": server.context_length})


async def detokenize(request: Request) -> Response:
    server = server_of(request)
    v = server.parse(parse_detokenize, await read_json(request, server))
    engine = server.engine
    text = await server.off_loop(engine.tokenizer.decode, v["tokens"])
    return JSONResponse({"content": text, "prompt": text})  # llama-server's name, and vLLM's


async def openapi_json(request: Request) -> Response:
    server = server_of(request)
    return JSONResponse(openapi.document(server.limits, model_id=server.model_id, api_key=bool(server.cfg.api_key),
                                         dashboard=server.cfg.dashboard))


async def prometheus_metrics(request: Request) -> Response:
    # the text format generate_latest writes, by the name Prometheus negotiates it with
    return Response(generate_latest(server_of(request).metrics.registry),
                    media_type="text/plain; version=0.0.4; charset=utf-8")


async def api_stats(request: Request) -> Response:
    """Everything the dashboard shows but the brain map: one JSON document."""
    server = server_of(request)
    try:
        since = float(request.query_params.get("since", 0))  # an empty one is no number
        if not math.isfinite(since):
            raise ValueError
    except ValueError:
        raise invalid("since", "'since' must be a number (a time in seconds since the epoch)") from None
    snap = server.metrics.snapshot()
    out = {"model": server.model_id, "loaded": server.engine is not None,
           "load_error": server.load_error, "context_length": server.context_length,
           "max_tokens": server.cfg.max_tokens, "uptime_seconds": time.time() - server.metrics.started, "queue": server.queue_state(),
           "requests": [{"endpoint": e, "outcome": o, "count": n} for (e, o), n in sorted(snap["requests"].items())],
           "turns": snap["turns"][-20:], "history": [h for h in snap["history"] if h["t"] > since], "running": []}
    snap = server.snapshot()
    if snap is not None:
        out["architecture"] = snap.architecture
        out["engine"] = {k: v for k, v in snap.stats.items()  # the mirror and stripe directories' paths: not published
                         if isinstance(v, (int, float, str, bool, dict)) and k not in ("mirror", "stripe")}
        out["memory"] = brain.memory(snap, server.ram_budget)
        now = time.perf_counter()
        for live in snap.running:  # the jobs decoding together, in the order they joined
            first = live["first_token"]
            out["running"].append({
                "kind": live["kind"], "prompt_tokens": live["prompt_tokens"], "tokens": live["tokens"],
                "cached_tokens": live["cached_tokens"],  # None while prefilling
                "seconds": now - live["started"], "prefilling": first is None,
                "tokens_per_second": (live["tokens"] - 1) / (now - first)
                if first is not None and live["tokens"] > 1 and now > first else 0.0})
    return JSONResponse(out)


async def api_brain(request: Request) -> Response:
    """The expert map: tiers, routing heat and the latest token's experts, per (layer, expert)."""
    server = server_of(request)
    server.ready()
    snap = server.snapshot()
    since = request.query_params.get("since")
    if since is not None and since.isdigit() and int(since) == snap.passes:
        return JSONResponse({"passes": snap.passes, "unchanged": True})
    return JSONResponse(brain.brain(snap))


async def api_atlas(request: Request) -> Response:
    """The Atlas: every expert's 3D position and topic shares (the model's `colibri atlas` file) with
    this server's tiers and routing heat; 404 until `colibri atlas` has characterised the model."""
    server = server_of(request)
    engine = server.ready()
    snap = server.snapshot()
    try:
        doc = await server.off_loop(atlas_view.document, engine, snap, server.model_id)
    except ColibriError:  # its message names the model's files: a client is told what to run, not where
        raise ApiError(404, "this model has no atlas yet: run `colibri atlas --model MODEL` where it lives",
                       code="no_atlas") from None
    return JSONResponse(doc)


async def dashboard(request: Request) -> Response:
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


async def atlas_page(request: Request) -> Response:
    return FileResponse(STATIC / "atlas.html", headers={"Cache-Control": "no-cache"})


async def root(request: Request) -> Response:
    server = server_of(request)
    return JSONResponse({"name": "colibri", "model": server.model_id, "status": "ok" if server.engine else "loading",
                         "endpoints": ["/health", "/v1/models", "/v1/chat/completions", "/v1/completions", "/tokenize",
                                       "/detokenize", "/metrics", "/api/stats", "/api/brain", "/api/atlas",
                                       "/openapi.json"],
                         "dashboard": "run `colibri web` for the dashboard"})


# ---- errors ---------------------------------------------------------------------------------------
async def api_error(request: Request, exc: ApiError) -> Response:
    if exc.status not in (429, 499) and exc.status < 500 and request.url.path.startswith("/v1/"):
        endpoint = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}.get(request.url.path)
        if endpoint:
            server_of(request).metrics.count(endpoint, "invalid")
    return error_response(exc.body(), exc.status, exc.headers)


def error_response(body: dict, status: int, headers=None) -> Response:
    """An error as JSON, escaped to ASCII: a message quoting any input renders, whatever it holds."""
    return Response(json.dumps(body), status_code=status, headers=headers, media_type="application/json")


async def http_error(request: Request, exc: HTTPException) -> Response:
    codes = {404: "not_found", 405: "method_not_allowed"}
    message = {404: f"no such endpoint: {request.method} {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
    return error_response(ApiError(exc.status_code, message, code=codes.get(exc.status_code)).body(),
                          exc.status_code, getattr(exc, "headers", None))


async def internal_error(request: Request, exc: Exception) -> Response:
    log.error("internal error on %s %s:\n%s", request.method, request.url.path, traceback.format_exc())
    body = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error", code="internal_error")
    return error_response(body.body(), 500)


# ---- the app --------------------------------------------------------------------------------------
def create_app(cfg: ServerConfig) -> Starlette:
    """The ASGI app; the model starts loading (on a thread) when the app starts up."""
    server = Server(cfg)
    routes = [
        Route("/health", health),
        Route("/v1/models", list_models),
        Route("/v1/models/{model:path}", get_model),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/metrics", prometheus_metrics),
        Route("/api/stats", api_stats),
        Route("/api/brain", api_brain),
        Route("/api/atlas", api_atlas),
        Route("/openapi.json", openapi_json),
    ]
    if cfg.dashboard:
        routes += [Route("/", dashboard), Route("/atlas", atlas_page),
                   Mount("/static", StaticFiles(directory=STATIC), name="static")]
    else:
        routes.append(Route("/", root))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        threading.Thread(target=server.load, name="colibri-load", daemon=True).start()
        sampler = asyncio.ensure_future(_sample_every_second(server))
        try:
            yield
        finally:
            sampler.cancel()
            if server.worker is not None:
                await asyncio.get_running_loop().run_in_executor(None, server.worker.stop)
            server.text_pool.shutdown(wait=False, cancel_futures=True)

    server.metrics.registry.register(metrics_mod.Exporter(server.metrics, server.model_id, server.snapshot,
                                                          server.queue_state))
    policy = security.Policy(cfg.api_key, cfg.allow_origins, cfg.host, cfg.trusted_hosts)
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        ApiError: api_error, HTTPException: http_error, Exception: internal_error},
        middleware=[Middleware(security.Guard, policy=policy, dashboard=cfg.dashboard)])
    app.state.server = server
    return app


async def _sample_every_second(server: Server) -> None:
    while True:
        await asyncio.sleep(1.0)
        snap = server.snapshot()
        if snap is not None:
            try:
                server.metrics.sample(snap.stats)
            except Exception:  # a sample lost is no reason to stop sampling
                log.warning("metrics sample failed:\n%s", traceback.format_exc())
