"""The engine: a container, its architecture's model, the expert store, and the decode loop.

    engine = load("models/olmoe-int4", ram="4GB")
    ids = engine.generate(prompt_ids, max_new_tokens=32)           # new tokens only
    logits = engine.logits(ids)                                     # (len(ids), vocab) float32
"""
from __future__ import annotations

import numbers
import resource
import threading
import time
import warnings
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import numpy as np
from filelock import FileLock

from . import batch as batching, planning, plugins
from .container import Container
from .container.native import NativeCheckpoint, is_checkpoint
from .container.reader import MANIFEST
from .convert import CONTEXT_KEYS, generation_defaults, parse_config, read_config
from .demo import is_demo
from .errors import ColibriError
from .experts import ExpertSource
from .drafting import AUTO_MIN_ACCEPTANCE, AUTO_RETRY, DRAFT_MODES, DraftCounters
from .generate import Sampler, Sampling
from .kernels.deltanet import BLOCK, EXACT_BATCH
from .kv.session import PersistentSession, SessionWarning, session_path
from .kv.session import lock as lock_session
from .model import MoEModel, Weights
from .options import EngineOptions
from .prefix import DIRNAME as PREFIX_DIRNAME, PrefixCache
from .probe import Probe, recording
from .store import ExpertStore
from .statedir import state_dir
from .store.usage import USAGE_FILE, UsageHistory
from .tokenizer import Tokenizer

class Session:
    """A token sequence and the model state holding all of it but the last sampled token."""

    def __init__(self, state):
        self.state = state
        self.ids: list[int] = []  # tokens whose state is in `state`


BUSY = ("this engine is already generating (an engine runs one generation at a time, or one batch of them: finish or close the other "
        "stream first, or give each thread its own engine)")


def _integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_sampling(max_new_tokens: int, seed: int | None) -> None:
    """A ColibriError naming the length or seed out of its range (`Sampling` checks the rest)."""
    if not (_integer(max_new_tokens) and max_new_tokens >= 1):  # 3.5 or inf would never be reached
        raise ColibriError(f"max_new_tokens must be an integer of at least 1, got {max_new_tokens!r}")
    if seed is not None and not (_integer(seed) and seed >= 0):
        raise ColibriError(f"seed must be 0 or more (or none: random), got {seed}")


class Engine:
    def __init__(self, model_dir: str | Path, options: EngineOptions | None = None, **settings):
        """Open `model_dir` with `options` (colibri_core/options.py), or with its fields as keywords
        (`settings`; given both, the keywords replace those fields of `options`)."""
        self.model_dir = Path(model_dir)
        options = EngineOptions(**settings) if options is None else replace(options, **settings)
        self.options = options  # every setting checked (one line each) before anything loads
        self.activations = options.activations  # the kernels' arithmetic: "f32" (exact) or "int8"
        self.kv_cache = options.kv_cache  # the KV caches' element type: "f32" or "f16"
        registry = plugins.registry()
        self.arch = registry.resolve(read_config(model_dir), where=str(model_dir))  # a missing plugin first
        policy_info = registry.cache_policy(options.policy)
        # the bundled demo keeps no routing history (it fits any sensible budget whole, so a hot-store has
        # nothing to do); sessions, the prefix cache's spill and the routing history go to the state
        # directory (statedir.py): --state-dir, or beside a converted container colibri may write in,
        # never into a checkpoint run as it is
        usage = False if is_demo(model_dir) and options.usage is True else options.usage
        native = is_checkpoint(model_dir) and not (Path(model_dir) / MANIFEST).exists()
        self.sessions_dir = state_dir(model_dir, options.state_dir, checkpoint=native)
        model_cls = registry.model_class(self.arch)
        if native:
            # a Hugging Face / official checkpoint run as it is (container/native.py)
            cfg = parse_config(model_cls, read_config(model_dir), model_dir)
            self.container = NativeCheckpoint(model_dir, model_cls.layout(cfg), self.arch.name, options.activations)
        else:
            self.container = Container(model_dir, options.activations)  # its weights carry the arithmetic
        self.store = self.experts = None
        self.closed = False
        self._busy = threading.Lock()  # held while a generation runs: one at a time (BUSY)
        try:  # what fails past here closes what was opened: the container's files, the store's I/O threads
            if self.arch.name != self.container.architecture:
                raise ColibriError(f"{model_dir}: container is for architecture {self.container.architecture}, "
                                   f"but config.json is served by {self.arch.name} ({self.arch.plugin})")
            cfg = parse_config(model_cls, self.container.config, model_dir)
            layout = model_cls.layout(cfg)
            resident = self.container.resident()
            self.resident_bytes = sum(t.nbytes for t in resident.values())
            weights = Weights(resident, str(model_dir))
            # read once: the split's hot-store share comes from it, then the store counts routing in it
            history = None if usage is False else UsageHistory(
                self.container, self.sessions_dir / USAGE_FILE if usage is True else usage)
            self.split = self._split(options.ram, options.cache_slots, options.pin_gb, history, layout.top_k)
            self.store = ExpertStore(self.container, self.split.cache_slots, policy_info,
                                     pinned=self.split.pinned_experts, transient=self.split.transient_experts,
                                     prefetch=options.prefetch, lookahead=options.lookahead,
                                     direct=planning.read_direct(options.direct, self.split.cache_slots,
                                                                 self.container.n_experts),
                                     direct_asked=options.direct is not None,
                                     mirror=None if options.mirror is None else str(options.mirror),
                                     io_threads=options.io_threads,
                                     usage=history)
            remote = None
            if options.ray is not None:  # expert shards on the Ray cluster's other nodes, the store a cache in front (remote/)
                if not isinstance(self.container, Container):
                    raise ColibriError("--ray needs a converted container (colibri convert), not a checkpoint run as it is")
                from .remote.client import RemoteExperts

                remote = RemoteExperts(self.container, options.remote_config())
            self.experts = ExpertSource(self.store, remote)  # what the MoE block asks for experts (experts.py)
            self.model = model_cls(cfg, weights, self.experts)
            weights.check_all_taken()
            if type(self.model).routers is MoEModel.routers:
                raise ColibriError(f"plugin {self.arch.plugin} {self.arch.version}: {self.arch.name} declares no "
                                   "routers (MoEModel.routers; see docs/plugins.md)")
            routed = tuple(self.model.routers())
            if sorted(routed) != sorted(self.container.moe_layers):
                raise ColibriError(f"plugin {self.arch.plugin} {self.arch.version}: {self.arch.name} declares routers "
                                   f"for layers {list(routed)}, but its MoE layers are {list(self.container.moe_layers)}")
        except BaseException:
            self.close()
            raise
        self.generation = generation_defaults(model_dir)
        self._tokenizer: Tokenizer | None = None
        self.probe = Probe(self.container.n_experts)  # seconds per section, routing per (layer, expert)
        self._sessions: dict[str, PersistentSession] = {}
        self._session_locks: dict[str, FileLock] = {}  # name -> its lock (kv/session.py), held until close
        self.drafting = DraftCounters()  # speculative decoding: drafted, accepted, tokens per forward
        self._drafters = weakref.WeakKeyDictionary()  # session -> (its state, {name: Drafter or None})
        self.counters = {"prompt_tokens": 0, "generated_tokens": 0, "prefill_seconds": 0.0,
                         "decode_seconds": 0.0, "time_to_first_token": 0.0,
                         "prefix_cache_hits": 0, "prefix_cached_tokens": 0}  # prompts, and their tokens, restored
        # the states of recent prompts (prefix.py), beside the budget, sized as `colibri plan` shows:
        # calls without a session use it; evicted ones spill beside the model, bound to what sets a
        # state's bits (the session identity, the arithmetic, the plugin's version); a model computing
        # each token as alone however its forwards are cut reuses rows to the token (prefix.py)
        c = self.container
        identity = {"architecture": c.architecture, "fingerprint": c.manifest["source"]["fingerprint"],
                    "quant": c.quant, "activations": self.activations, "kv_cache": self.kv_cache,
                    "plugin": f"{self.arch.plugin} {self.arch.version}"}
        self.prefix_cache = PrefixCache(planning.prefix_cache_budget(options.prefix_cache, self.split.budget),
                                        options.prefill_chunk, self.sessions_dir / PREFIX_DIRNAME, identity,
                                        step=1 if self.model.token_exact else BLOCK)

    def _split(self, ram, cache_slots, pin_gb, history: UsageHistory | None, top_k: int) -> planning.Split:
        """The budget split (planning.split, the rule `colibri plan` shows): the state grows beside
        the budget; `cache_slots` overrides the cache part; `history` chooses the hot-store's share."""
        c = self.container
        return planning.split(ram, self.resident_bytes, c.expert_nbytes, len(c.moe_layers), c.n_experts, top_k,
                              pin_gb=pin_gb, history=history, cache_slots=cache_slots)

    @property
    def context_length(self) -> int | None:
        """The longest sequence the model was made for (config.json's max_position_embeddings or its
        kin, CONTEXT_KEYS); None where the config names none."""
        config = self.container.config
        return next((int(config[k]) for k in CONTEXT_KEYS if isinstance(config.get(k), int)), None)

    # ---- text ------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = Tokenizer.from_dir(self.model_dir)
        return self._tokenizer

    # ---- the model -------------------------------------------------------------------------
    def new_session(self) -> Session:
        return Session(self.new_state())

    def open_session(self, name: str) -> PersistentSession:
        """The persistent session `name` (STATE/.sessions/NAME.coli_session, STATE the state directory:
        `sessions_dir`, statedir.py), resumed if saved before.

        Pass it (or just its name) as `stream`/`generate`'s ``session=``: each call saves the turn.
        A saved file from another model or format version is moved aside with a `SessionWarning`
        (also in ``session.notice``) and the session starts fresh; a file damaged after some whole
        turns is kept whole beside it (``.bad``) and the session resumes at the last whole turn; a
        save cut short by a crash has its bytes kept (``.torn``) and the session resumes from the
        turn before. A session is used by one engine at a time: another
        engine or process opening it, or saving to it, gets a ColibriError until this one is closed.
        """
        if name not in self._sessions:
            c = self.container
            identity = {"architecture": c.architecture, "fingerprint": c.manifest["source"]["fingerprint"],
                        "quant": c.quant}
            if session_path(self.sessions_dir, name).parent.is_dir():  # else nothing to lock until it writes
                self._lock_session(name)
            session = PersistentSession(self, self.sessions_dir, identity, name,
                                        before_write=lambda: self._lock_session(name))
            if session.notice:
                warnings.warn(session.notice, SessionWarning, stacklevel=2)
            self._sessions[name] = session
        return self._sessions[name]

    def _lock_session(self, name: str) -> None:
        """Hold session `name`'s lock from now until `close`: two engines (or processes) appending to
        one session file would tear it, and every turn would be lost at the next open."""
        if name not in self._session_locks:
            self._session_locks[name] = lock_session(session_path(self.sessions_dir, name))

    def new_state(self):
        """A fresh per-sequence state of the model, its KV caches of this engine's type."""
        return self.model.new_state(kv_cache=self.kv_cache)

    def _token_ids(self, ids) -> list[int]:
        """`ids` as ints; a ColibriError if the engine is closed or one is no token of the model's
        vocabulary (NumPy would have read -1 as the last row, and 3.7 as 3)."""
        if self.closed:
            raise ColibriError("this engine is closed")
        vocab = self.model.vocab_size
        out = []
        for i in ids:
            if not _integer(i) or i < 0 or i >= vocab:
                raise ColibriError(f"token id {i!r} is not in this model's vocabulary (0 .. {vocab - 1})")
            out.append(int(i))
        return out

    def logits(self, ids) -> np.ndarray:
        """Teacher-forced logits, float32 (len(ids), vocab), in one forward: the last row is bit for bit
        what `stream` samples the first new token from (`_pieces`: cut or not, the same bits)."""
        ids = np.asarray(self._token_ids(ids), np.int64)
        if not self._busy.acquire(blocking=False):
            raise ColibriError(BUSY)
        try:
            out = self.model.forward(ids, self.new_state())
            self.store.end_turn()
        finally:
            self._busy.release()
        return out

    def _pieces(self, start: int, end: int, capture):
        """The forwards that feed positions start … end − 1: one (each MoE layer reads the union of its
        tokens' experts once), cut where `capture` snapshots fixed-size state parts (`Capture.stops`:
        none for a state of rows, else a few, at chunk × 2^k and the last boundary), and, in a batch
        with other generations running, at every multiple of the prefill chunk (their streams go on
        between the chunks: batch.py). Cut or not, every position gets the same bits: the layers
        compute in blocks aligned at absolute positions (kernels.deltanet.BLOCK), so a prefix
        restored at a boundary equals a cold prefill (prefix.py), and a chunked prompt an uncut one."""
        stops = [*(capture.stops(start, end) if capture is not None else ()), end]
        chunk = self.options.prefill_chunk
        while start < end:  # decided piece by piece: a generation may join the batch meanwhile
            stop = next(s for s in stops if s > start)
            if batching.others_running():
                stop = min(stop, (start // chunk + 1) * chunk)
            yield start, stop
            start = stop

    def _feed(self, session: Session, ids: list[int], last_only: bool = True, capture=None) -> np.ndarray:
        """Bring `session` to `ids` (reusing the longest prefix it holds), in `_pieces`; logits of the
        last token (V,), or of every token fed (T, V). The session's drafters see the model's hidden
        states, and `capture` (prefix.Capture) each piece. A forward that fails leaves the state
        half-fed: `stream` puts the session back."""
        n = len(session.ids)
        if not (n < len(ids) and ids[:n] == session.ids):
            session.state, session.ids, n = self.new_state(), [], 0
        out = []
        for start, end in self._pieces(n, len(ids), capture):
            if batching.current() is None:
                self.store.new_step()  # a forward of its own (a batch begins each of its steps)
            with self.probe.listening():
                out.append(self.model.forward(np.asarray(ids[start:end], np.int64), session.state,
                                              last_only=last_only))
            session.ids = ids[:end]
            self._tell_drafters(session, start, self.model.last_hidden)
            if capture is not None:
                capture.fed(start, end, self.model.last_hidden)
            batching.pause()  # in a batch: this generation's forward of the step is done
        return out[-1][-1] if last_only else np.concatenate(out)

    def _tell_drafters(self, session, start: int, hidden) -> None:
        """Drafter.observe for each of the session's drafters: the hidden states (T, H) of positions
        start … start + T − 1, or None."""
        for drafter in self._session_drafters(session).values():
            if drafter is not None:
                drafter.observe(start, hidden)

    def _session_drafters(self, session) -> dict:
        """The drafters of `session` ({name: Drafter, or None where one does not apply}), built anew
        when the session's state is (a fresh sequence)."""
        state, drafters = self._drafters.get(session, (None, None))
        if drafters is None or state is not session.state:
            registry = plugins.registry().drafters()
            drafters = {name: info.factory(self.model) for name, info in registry.items()}
            self._drafters[session] = (session.state, drafters)
        return drafters

    def _choose_drafters(self, session, draft: str, constraint) -> list:
        """The drafters to ask this step, in order: the grammar's forced tokens first (free), then the
        others; `auto` leaves out one whose recent acceptance does not repay verifying it, and tries
        it again every AUTO_RETRY forwards; where a layer's cache cannot hold all its experts, also one
        whose forwards need more of them from disk per kept token than forwards without drafts (the
        forward after its first that read, then one in AUTO_RETRY, measure those), tried again after
        AUTO_RETRY forwards, then twice as many each time it is still costly (drafting.py says why,
        at ABSENT_WINDOW)."""
        if draft == "off":
            return []
        drafters = self._session_drafters(session)
        if draft != "auto":
            return [drafters[draft]] if drafters.get(draft) is not None else []
        chosen = [] if constraint is None or drafters.get("grammar") is None else [drafters["grammar"]]
        counters, turn = self.drafting, self.drafting.forwards % AUTO_RETRY
        models = {name: d for name, d in drafters.items() if d is not None and name != "grammar"}
        streamed = self.split.cache_slots < self.container.n_experts  # else every read is an expert's first
        if streamed and (turn == AUTO_RETRY // 2 or counters.absent_per_token(None) is None) and \
                any(counters.reading(name) for name in models):
            return chosen  # the baseline (as soon as a drafter has read, then every AUTO_RETRY): no model drafts
        for name, d in models.items():
            costly = streamed and counters.costly(name)
            if counters.acceptance.get(name, 1.0) >= AUTO_MIN_ACCEPTANCE and not costly:
                counters.retry_every.pop(name, None)
                chosen.append(d)
            elif counters.retry(name, costly):
                chosen.append(d)
        return chosen

    def _step(self, session, ids: list[int], drafters: list, constraint, sampler: Sampler, remaining: int,
              stop: set) -> tuple[list[int], int | None]:
        """Feed ids[-1], with the first drafter's proposals after it: (the drafts accepted, the token chosen
        after them, or None where an accepted draft ends the generation: a stop id, the grammar done).
        Each draft is verified against the distribution decoding without it samples from: the same
        constraint, bias and penalties (of ids and the drafts accepted before it)."""
        limit = min(remaining - 1, EXACT_BATCH - 1)  # never past max_new_tokens; one exact forward
        name, drafts = None, []
        absent = self._absent()  # the drafter's own reads (an MTP head's experts) count as its forward's
        for drafter in drafters if limit > 0 else ():
            drafts = [int(t) for t in drafter.propose(ids, limit, constraint)][:limit]
            if drafts:
                name = drafter.name
                break
        self.drafting.forwards += 1
        if not drafts:
            self.drafting.tokens += 1
            token = sampler.pick(self._feed(session, ids), ids, constraint)
            self.drafting.record_absent(None, self._absent() - absent, 1)
            return [], token
        kept, kept_ids = session.state.arrays(), list(session.ids)  # the rollback point (views / copies)
        logits = self._feed(session, ids + drafts, last_only=False)[-1 - len(drafts):]  # (1 + d, V)
        accepted, token = [], None
        for i, d in enumerate(drafts):
            ok, choice = sampler.verify(logits[i], d, ids + accepted, constraint)
            if not ok:
                token = choice
                break
            accepted.append(d)
            if constraint is not None:
                constraint.advance(d)
            if d in stop or (constraint is not None and constraint.finished()):
                break
        else:
            token = sampler.pick(logits[-1], ids + accepted, constraint)
        self.drafting.record(name, len(drafts), len(accepted))
        self.drafting.tokens += 1 + len(accepted)
        if len(accepted) < len(drafts):
            keep = len(ids) + len(accepted)  # ids[-1] and the accepted drafts: bit for bit what decoding computes
            if session.state.truncate(keep):  # a state of rows: the rejected drafts' rows dropped in place
                session.ids = session.ids[:keep]
                start = len(kept_ids) if ids[:len(kept_ids)] == kept_ids else 0  # where the forward began (`_feed`)
                hidden = self.model.last_hidden  # what it said of the rejected positions is void
                self._tell_drafters(session, start, None if hidden is None else hidden[:keep - start])
            else:  # roll back: the state before the forward, then ids[-1] + accepted again
                state = self.new_state()
                state.load_arrays(kept)
                self._drafters[session] = (state, self._drafters[session][1])  # the same sequence: its drafters stay
                session.state, session.ids = state, kept_ids
                self._feed(session, ids + accepted)  # a short forward: bit for bit what the verification computed
        self.drafting.record_absent(name, self._absent() - absent, 1 + len(accepted))
        return accepted, token

    def _absent(self) -> int:
        """Experts needed so far that were neither cached nor pinned (`StoreCounters.absent`)."""
        return self.store.counters.absent if self.store is not None else 0

    def stream(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: int | None = None, *, min_p: float = 0.0, presence_penalty: float = 0.0,
               frequency_penalty: float = 0.0, repetition_penalty: float = 1.0, penalty_last_n: int | None = None,
               logit_bias=None, logprobs: list | None = None, top_logprobs: int = 0, stop_ids=None,
               session: Session | PersistentSession | str | None = None, constraint=None,
               draft: str = "auto") -> Iterator[int]:
        """Yield new token ids one by one. Stops after `max_new_tokens` or a stop id (yielded).

        Sampling (generate.py, in vLLM's order): `logit_bias` ({token id: added to its logit}, -inf
        bans), the penalties (`Sampling`: presence and frequency count the answer's tokens,
        repetition every token of prompt and answer; `penalty_last_n` = N: all three the last N
        tokens, llama.cpp's rule), then greedy at temperature 0, else min_p, top_k, top_p and one
        draw of the generator seeded with `seed`. A `logprobs` list gets a `generate.Token` for each
        token, appended before it is yielded: its log-probability under the model's own distribution
        (the raw logits' log_softmax, before the knobs: vLLM's default) and the `top_logprobs` most
        likely tokens'.

        `stop_ids` defaults to generation_config.json's eos_token_id; pass () to never stop early.
        Without a `session` the prompt starts from the longest prefix the prefix cache holds
        (`engine.prefix_cache`, prefix.py; stats() counts `prefix_cached_tokens`), with the very
        tokens and logits of a cold prefill, and its states are kept there for later prompts.
        A `session` keeps its state across calls: a prompt that extends it is prefilled only past
        what the session already holds. A persistent session (`open_session`, or its name) is
        saved when the call ends (also when the caller stops iterating early). A call that fails
        (a read error, MemoryError, Ctrl-C) leaves the session as it was before it, unsaved.
        `constraint` (colibri_core.structured): only the tokens it allows are sampled, and generation
        ends when it is finished. `draft` (colibri_core.drafting): "auto" (the grammar's forced tokens
        and the model's MTP head while it pays), "mtp", "grammar" or "off"; drafting never changes
        a greedy token, and keeps the sampled distribution.
        """
        batched = batching.current() is not None  # a generation of a batch (`batch`), which holds the lock
        if not batched and not self._busy.acquire(blocking=False):
            raise ColibriError(BUSY)
        try:
            yield from self._stream(prompt_ids, max_new_tokens, temperature, top_p, top_k, seed, stop_ids, session,
                                    constraint, draft, logprobs, top_logprobs, min_p=min_p,
                                    presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                    repetition_penalty=repetition_penalty, penalty_last_n=penalty_last_n,
                                    logit_bias=logit_bias or ())
        finally:
            if not batched:
                self._busy.release()

    def batch(self) -> batching.Batch:
        """Several generations decoded together (batch.py): `add` them (each with `stream`'s
        parameters), `step` until none runs; each MoE layer reads the union of their experts once a
        step, the dense weights once for all, and each gets the tokens it gets alone. The engine runs
        nothing else until the batch is closed (`with engine.batch() as b:`)."""
        if not self._busy.acquire(blocking=False):
            raise ColibriError(BUSY)
        return batching.Batch(self.stream, self._busy.release, self.store.new_step)

    def generate_batch(self, prompts, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                       top_k: int = 0, seed: int | None = None, **stream) -> list[list[int]]:
        """`generate` for each of `prompts` (lists of token ids), decoded together (`batch`): the
        same tokens, each MoE layer's experts read once a step for all. A failed generation raises
        its error once the others are done."""
        with self.batch() as b:
            runs = [b.add(p, max_new_tokens, temperature, top_p, top_k, seed, **stream) for p in prompts]
            while b.running():
                b.step()
        for g in runs:
            if g.error is not None:
                raise g.error
        return [g.tokens for g in runs]

    def _stream(self, prompt_ids, max_new_tokens, temperature, top_p, top_k, seed, stop_ids, session, constraint,
                draft, logprobs=None, top_logprobs=0, **knobs) -> Iterator[int]:
        """`stream`'s generation; `knobs`: the rest of `Sampling`'s fields."""
        prompt_ids = self._token_ids(prompt_ids)
        if not prompt_ids:
            raise ColibriError("the prompt is empty")
        check_sampling(max_new_tokens, seed)
        sampler = Sampler(Sampling(temperature, top_p, top_k, **knobs), seed, len(prompt_ids),
                          None if logprobs is None else top_logprobs)
        if draft not in DRAFT_MODES and draft not in plugins.registry().drafters():
            raise ColibriError(f"unknown draft mode {draft!r}: choose one of {', '.join(DRAFT_MODES)} or a "
                               f"registered drafter ({', '.join(plugins.registry().drafters())})")
        stop = set(self.generation.get("eos_token_id", []) if stop_ids is None else stop_ids)
        if isinstance(session, str):
            session = self.open_session(session)
        cached = session is None  # a call of its own: its prompt may start from the prefix cache
        session = session or self.new_session()
        # the session as it was, put back if the call fails: no later forward modifies these arrays
        # (the kv.State contract): views of the caches, copies of fixed-size states (once per call)
        kept_ids = list(session.ids)
        kept = session.state.arrays() if kept_ids else None  # a fresh state is put back as a fresh one
        t0 = time.perf_counter()
        ids = list(prompt_ids)
        save = getattr(session, "save", lambda: None)
        try:
            capture = self._restore(session, prompt_ids) if cached else None
            logits = self._feed(session, prompt_ids, capture=capture)
            if capture is not None:
                self.prefix_cache.insert(capture)
            self.counters["prompt_tokens"] += len(prompt_ids)
            self.counters["prefill_seconds"] += time.perf_counter() - t0
            # (token, already advanced in the constraint): chosen, to yield in order
            pending = [(sampler.pick(logits, ids, constraint), False)]
            produced = 0
            while pending:
                token, advanced = pending.pop(0)
                if produced == 0:
                    self.counters["time_to_first_token"] = time.perf_counter() - t0
                produced += 1
                self.counters["generated_tokens"] += 1
                if logprobs is not None:
                    logprobs.append(sampler.chosen.popleft())  # the Token recorded as it was chosen
                yield token
                ids.append(token)
                if constraint is not None and not advanced:  # an accepted draft was, when verified
                    constraint.advance(token)
                if pending:  # accepted drafts, verified (stops and the grammar's end were checked then)
                    continue
                if token in stop or produced == max_new_tokens or (constraint is not None and constraint.finished()):
                    break
                t1 = time.perf_counter()
                accepted, after = self._step(session, ids, self._choose_drafters(session, draft, constraint),
                                             constraint, sampler, max_new_tokens - produced, stop)
                pending = [(t, True) for t in accepted] + ([] if after is None else [(after, False)])
                self.counters["decode_seconds"] += time.perf_counter() - t1
        except GeneratorExit:  # the caller stopped early: the state is whole, keep the turn
            save()
            self._keep_turn(capture, session)
            self._end_turn()
            raise
        except BaseException:  # e.g. a forward failed midway (a read error, Ctrl-C): its state is half-fed
            session.state, session.ids = self.new_state(), []  # never reused, even if what follows fails
            if kept is not None:
                state = self.new_state()
                state.load_arrays(kept)
                session.state, session.ids = state, kept_ids
            raise
        save()
        self._keep_turn(capture, session)
        self._end_turn()  # only after a whole turn: routing history, hot-store revision

    def _keep_turn(self, capture, session: Session) -> None:
        """The prefix cache's entry of this call grows to the turn's end where the model allows
        (`Capture.ended`): the next turn of the conversation is prefilled from there."""
        if capture is not None and capture.ended(session.state, session.ids):
            self.prefix_cache.insert(capture)

    def _end_turn(self) -> None:
        """The store's end of a turn (routing history, hot-store revision); in a batch, at the end of
        the step, never while the others are mid-forward."""
        me = batching.current()
        if me is None:
            self.store.end_turn()
        else:
            me.batch.defer(self.store.end_turn)

    def _restore(self, session: Session, prompt_ids: list[int]):
        """Load the longest cached prefix of `prompt_ids` into the fresh `session` (prefix.py); the
        `Capture` its prefill fills for the cache (None: the cache is off)."""
        hit = self.prefix_cache.lookup(prompt_ids, session.state)
        if hit is not None:
            session.state, hidden = self.prefix_cache.restore(hit, session.state)
            session.ids = prompt_ids[:hit[1]]
            self._tell_drafters(session, 0, hidden)  # an MTP head drafts as after a cold prefill
            self.counters["prefix_cache_hits"] += 1
            self.counters["prefix_cached_tokens"] += hit[1]
            if batching.current() is not None:
                batching.current().cached_tokens = hit[1]
        return self.prefix_cache.capture(session.state, prompt_ids, hit, hidden=self.model.has_mtp)

    def generate(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None, **options) -> list[int]:
        """New token ids only (temperature 0 is greedy); `options`: `stream`'s keywords (min_p, the
        penalties, logit_bias, logprobs, top_logprobs, stop_ids, session, constraint, draft)."""
        return list(self.stream(prompt_ids, max_new_tokens, temperature, top_p, top_k, seed, **options))

    # ---- embeddings ----------------------------------------------------------------------------
    def embed(self, ids) -> np.ndarray:
        """The embedding of token ids `ids`, float32 (H,): the mean over its tokens of the model's last
        decoder layer's output (its `l_out`, the residual stream before the final norm), from the very
        forwards a prefill runs, in pieces of `prefill_chunk` tokens (cut or not, the same bits), the
        logits left uncomputed but the last. The sequence's state is then dropped: no session is
        touched, and the prefix cache is neither read nor fed (it keeps states, not the hidden states
        of every position, so it could not serve an embedding). At most `context_length` tokens.

        A generation of a batch may call it (`stream`'s rule): the server's worker embeds in its batch,
        a prefill chunk per step. A ColibriError where the plugin records no layer output, or one that
        is not a row per token (a model of several residual streams): there is no final hidden state to
        pool."""
        ids = self._token_ids(ids)
        if not ids:
            raise ColibriError("there is nothing to embed: no token ids")
        if self.context_length is not None and len(ids) > self.context_length:
            raise ColibriError(f"{len(ids)} tokens to embed; this model's context is {self.context_length}")
        batched = batching.current() is not None  # a generation of a batch (`batch`), which holds the lock
        if not batched and not self._busy.acquire(blocking=False):
            raise ColibriError(BUSY)
        try:
            state, chunk, rows = self.new_state(), self.options.prefill_chunk, []
            for start in range(0, len(ids), chunk):  # pieces bound the layer outputs held while recording
                piece = np.asarray(ids[start:start + chunk], np.int64)
                if not batched:
                    self.store.new_step()  # a forward of its own (a batch begins each of its steps)
                with recording(("l_out",)) as recorder, self.probe.listening():
                    self.model.forward(piece, state, last_only=True)
                rows.append(self._last_layer_output(recorder, len(piece)))  # (T_piece, H)
                batching.pause()  # in a batch: this entry's forward of the step is done
            self._end_turn()
        finally:
            if not batched:
                self._busy.release()
        return np.mean(np.concatenate(rows), axis=0, dtype=np.float64).astype(np.float32)

    def _last_layer_output(self, recorder, tokens: int) -> np.ndarray:
        """The last decoder layer's `l_out` (tokens, H) a forward recorded, or a ColibriError saying why
        this architecture has none to pool."""
        layers = recorder.layers("l_out")
        out = recorder.get("l_out", layers[-1]) if layers else None
        where = f"plugin {self.arch.plugin} {self.arch.version}: {self.arch.name}"
        if out is None:
            raise ColibriError(f"{where} records no layer output (`record(i, l_out=h)` after each layer, "
                               "docs/plugins.md): it has no hidden states to embed with")
        if out.ndim != 2 or len(out) != tokens:
            raise ColibriError(f"{where} gives no embeddings: its layers' output is {out.shape} for {tokens} tokens, "
                               "not one hidden state per token (several residual streams)")
        return out

    def stats(self) -> dict:
        c = self.counters
        decoded = max(0, c["generated_tokens"] - 1)
        return {
            **c,
            "decode_tokens_per_second": decoded / c["decode_seconds"] if c["decode_seconds"] else 0.0,
            **self.experts.stats(),  # the store's counters, the remote shards' (remote_*)
            **self.drafting.stats(),
            **self.prefix_cache.stats(),  # bytes and entries held; hits and cached tokens are counters
            **{f"{name}_seconds": s for name, s in list(self.probe.seconds.items())},  # attention, moe, disk
            "resident_bytes": self.resident_bytes,
            "ram_budget": self.split.budget,
            "pin_share": self.split.pin_share,  # the hot-store's share of the expert budget the history chose
            "activations": self.activations,  # the kernels' arithmetic: "f32" (exact) or "int8"
            "kv_cache": self.kv_cache,  # the KV caches' element type: "f32" or "f16"
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }

    def close(self) -> None:
        if getattr(self, "prefix_cache", None) is not None:
            self.prefix_cache.close()  # its entries spill to disk, found again by the next engine
        if self.experts is not None:
            self.experts.close()  # the remote shards
        if self.store is not None:
            self.store.close()
        for held in getattr(self, "_session_locks", {}).values():
            held.release()
        self._session_locks = {}
        self.container.close()
        self.closed = True  # what needs the store and files says so (`_token_ids`), never a crash in C

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def load(model_dir: str | Path, options: EngineOptions | None = None, **settings) -> Engine:
    """Open a converted model directory (or a checkpoint run as it is) with `options`, or with
    EngineOptions' fields as keywords (colibri_core/options.py: each one's meaning and default):

        load(dir, ram="2GB")                      # the budget for weights and the expert cache
        load(dir, cache_slots=8, pin_gb=1.5)      # experts cached per layer; the hot-store's size
        load(dir, prefetch=True, direct=False, mirror=None, policy="lfu_aging", io_threads=4, usage=True)
        load(dir, activations="int8", kv_cache="f16")    # a different arithmetic: changes the output
        load(dir, ray="auto", ray_split="layer", ray_timeout=5.0, ray_options={"retry": 1.0})

    All but `activations` and `kv_cache` change only speed: the tokens are the same.
    """
    return Engine(model_dir, options, **settings)
