"""Speculative decoding: drafters propose the tokens that come next, the model verifies them all in one
forward (each routed expert read once for every drafted position), and every draft accepted is a
token that cost no forward of its own.

Drafters come from the hook ``colibri_register_drafters(register)``: ``register(name, factory,
description)``; ``factory(model)`` builds one for a loaded model, or returns None where it does not
apply (a model without an MTP head). The core registers two:

- ``grammar``: the tokens a structured-output constraint forces next (JSON keys, punctuation, tool-call
  scaffolding): drafted with no model at all, and always accepted, since nothing else is allowed;
- ``mtp``: the model's multi-token-prediction head (GLM-5.2: ``mtp_forward``): its input at position
  p is the model's final hidden state there and token p + 1; chained, it drafts further tokens
  from its own output (as vLLM and SGLang run one MTP layer for several speculative tokens).

A drafter is asked, before a forward, for up to `limit` tokens to follow the sequence `ids` (whose
last token is about to be fed): ``propose(ids, limit, constraint) -> list[int]``. After every
forward the engine tells it what the model computed: ``observe(start, hidden)``, the final hidden
states (T, H) of positions start … start + T − 1 (None if the model exposes none), positions at or
past `start` replacing what an earlier, rolled-back forward said of them.

Verification (`Engine.stream`): the sampled token and its drafts go through one forward of at most
`kernels.deltanet.EXACT_BATCH` tokens, whose logits are bit for bit those of decoding each alone.
Greedy: a draft is accepted while it is the model's own choice, so the tokens are those of decoding
without drafts. Sampling: the drafters here are deterministic (a one-hot proposal q), so standard
speculative sampling accepts draft d with probability p(d) and otherwise samples from p with d
removed: the model's distribution exactly. A rejection rolls the state back: a state of rows only
drops the rejected drafts in place (`kv.State.truncate`) and the drafters are told again what the
forward said of the kept positions; any other state is restored as it was before the forward and
the accepted tokens are fed again.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .hookspecs import hookimpl

if TYPE_CHECKING:  # numpy is imported where it is used: listing plugins imports none of it
    import numpy as np

__all__ = ["Drafter"]  # the public API: what a plugin subclasses

DRAFT_MODES = ("auto", "mtp", "grammar", "off")
AUTO_MIN_ACCEPTANCE = 0.35  # `--draft auto` stops drafting with the model's head below this acceptance …
AUTO_RETRY = 16  # … and tries it again after this many forwards
ACCEPTANCE_DECAY = 0.9  # the acceptance estimate's memory, per draft
# Where a layer's cache cannot hold all its experts, `--draft auto` also stops a drafter whose
# forwards need more experts from disk per token they keep than forwards without drafts: a
# verification reads the union of its tokens' experts, which a small cache may not hold (the tiny
# trained GLM-5.2 with MTP drafts read 1.41x the bytes a generated token at 4 of 16 slots, 2.4x at
# 8; BENCHMARKS.md). The forward after a drafter's first read, then one in AUTO_RETRY, runs without
# the model's drafters for that baseline. Experts absent from cache and hot-store
# (`StoreCounters.absent`) follow the routing and the budget, and, a little, the timing of reads (a
# read in flight is never evicted, so the cache may drop another expert): the machine can change
# which forwards draft, never a token.
ABSENT_WINDOW = 8  # the forwards each estimate is taken over (a drafter's: its latest run of them)
ABSENT_MARGIN = 0.1  # … and a drafter is costly past (1 + this) times the forwards without drafts;
AUTO_RETRY_MAX = 256  # its retries, each a costly verification, come twice as far apart up to this
MTP_CHAIN = 3  # tokens the MTP head drafts per step at most (the first from the model's hidden state, the rest chained)


class Drafter:
    """What the engine asks of a drafter (see the module docstring)."""

    name: str = ""

    def propose(self, ids: list[int], limit: int, constraint=None) -> list[int]:
        raise NotImplementedError

    def observe(self, start: int, hidden: np.ndarray | None) -> None:
        """The model fed positions start … start + T − 1; their final hidden states (T, H) or None."""


@dataclass
class DrafterInfo:
    """One registered drafter."""

    name: str
    factory: Callable  # factory(model) -> Drafter | None
    description: str = ""
    plugin: str = ""  # set by the core: the distribution that registered it


class GrammarDrafter(Drafter):
    """The tokens the constraint forces next (llguidance's fast-forward tokens)."""

    name = "grammar"

    def propose(self, ids, limit, constraint=None):
        return list(constraint.forced())[:limit] if constraint is not None and limit > 0 else []


class MTPDrafter(Drafter):
    """The model's MTP head. Position p's input is the model's hidden state at p and token p + 1,
    both verified, so the head's own cache holds verified positions only; a chained draft (the
    head run again on its own output, `last_mtp_hidden`, and the token it drafted) adds rows past
    them, dropped (`State.truncate`) before the head goes on. Needs a model that declares `has_mtp`
    (`MoEModel`: ``new_mtp_state()``, ``mtp_forward(hidden, next_ids, state)``, ``last_hidden``,
    ``last_mtp_hidden``); chains where the head's state truncates."""

    name = "mtp"

    def __init__(self, model, chain: int = MTP_CHAIN):
        import numpy as np

        self.model = model
        self.state = model.new_mtp_state()  # rows for positions 0 … fed − 1 (+ `speculative`)
        self.hidden = np.zeros((0, 0), np.float32)  # (n, H): positions fed … fed + n − 1, not yet given to the head
        self.speculative = 0  # rows the chained drafts added to the head's state
        self.chain = chain if self.state.truncate(0) else 1
        self.depth = 1  # drafts the next proposal may chain (`_adapt_depth`)
        self.last: tuple[int, list[int]] | None = None  # (where the last proposal began, its drafts)

    def _drop_speculative(self) -> None:
        if self.speculative:
            self.state.truncate(self.state.length - self.speculative)
            self.speculative = 0

    def observe(self, start, hidden):
        import numpy as np

        self._drop_speculative()
        fed = self.state.length
        if hidden is None or start + len(hidden) <= fed:
            return
        if start < fed:  # the head has these positions already
            hidden, start = hidden[fed - start:], fed
        kept = self.hidden[: start - fed] if len(self.hidden) else np.zeros((0, hidden.shape[1]), np.float32)
        self.hidden = np.concatenate([kept, hidden.astype(np.float32, copy=False)])

    def propose(self, ids, limit, constraint=None):
        import numpy as np

        self._drop_speculative()
        self._adapt_depth(ids)
        fed = self.state.length
        n = len(self.hidden)
        if limit < 1 or n == 0 or fed + n != len(ids) - 1:
            return []  # the head is not in step with the model (e.g. nothing observed yet)
        logits = self.model.mtp_forward(self.hidden, np.asarray(ids[fed + 1:], np.int64), self.state)  # (n, V)
        self.hidden = self.hidden[:0]
        if constraint is not None:  # a grammar's next states are not simulated: one draft
            return [int(np.argmax(np.where(constraint.mask(), logits[-1], -np.inf)))]
        drafts = [int(np.argmax(logits[-1]))]
        while len(drafts) < min(limit, self.depth):
            logits = self.model.mtp_forward(self.model.last_mtp_hidden[-1:], np.asarray(drafts[-1:], np.int64), self.state)
            self.speculative += 1
            drafts.append(int(np.argmax(logits[-1])))
        self.last = (len(ids), drafts)
        return drafts

    def _adapt_depth(self, ids) -> None:
        """One draft more after a proposal the model took whole (up to `chain`), back to one after a
        rejection: long chains where the head keeps agreeing, no wasted chained drafts elsewhere.
        Read from the tokens alone, so it is the same on every machine and at every RAM budget."""
        if self.last is None:
            return
        at, prev = self.last
        taken = ids[at:at + len(prev)] == prev and len(ids) > at + len(prev)  # and the model went on past them
        self.depth = min(self.chain, self.depth + 1) if taken else 1
        self.last = None


def mtp_drafter(model) -> Drafter | None:
    return MTPDrafter(model) if model.has_mtp else None


@hookimpl
def colibri_register_drafters(register):
    register("grammar", lambda model: GrammarDrafter(), "the tokens a structured-output grammar forces next")
    register("mtp", mtp_drafter, "the model's multi-token-prediction head (GLM-5.2)")


class DraftCounters:
    """What drafting did in one engine: drafted / accepted per drafter, forwards, forced tokens."""

    def __init__(self):
        self.drafted: dict[str, int] = {}
        self.accepted: dict[str, int] = {}
        self.forwards = 0  # forwards of generated tokens (with or without drafts)
        self.tokens = 0  # tokens those forwards fed and kept
        self.acceptance: dict[str, float] = {}  # decayed acceptance rate per drafter (auto mode)
        # (experts absent from cache and hot-store, tokens kept) of the latest ABSENT_WINDOW forwards
        # with each drafter's drafts and (None) without drafts (auto mode)
        self.absent: dict[str | None, collections.deque] = {}
        self._absent_at: dict[str | None, int] = {}  # `forwards` at each one's last record
        self.retry_every: dict[str, int] = {}  # a drafter left out: forwards between its retries

    def record(self, name: str, drafted: int, accepted: int) -> None:
        self.drafted[name] = self.drafted.get(name, 0) + drafted
        self.accepted[name] = self.accepted.get(name, 0) + accepted
        rate = self.acceptance.get(name, 1.0)
        for i in range(drafted):
            rate = rate * ACCEPTANCE_DECAY + (1 - ACCEPTANCE_DECAY) * (i < accepted)
        self.acceptance[name] = rate

    def record_absent(self, name: str | None, absent: int, kept: int) -> None:
        """The forward just counted, with `name`'s drafts (None: none), kept `kept` tokens and needed
        `absent` experts neither cached nor pinned. A drafter's first forward after forwards without
        it starts its window again (a retry: what it measured before is that old)."""
        window = self.absent.setdefault(name, collections.deque(maxlen=ABSENT_WINDOW))
        if name is not None and self._absent_at.get(name) != self.forwards - 1:
            window.clear()
        self._absent_at[name] = self.forwards
        window.append((absent, kept))

    def absent_per_token(self, name: str | None) -> float | None:
        """Experts absent from cache and hot-store per token kept, over `name`'s window (None: none yet)."""
        window = self.absent.get(name)
        return sum(a for a, _ in window) / sum(k for _, k in window) if window else None

    def costly(self, name: str) -> bool:
        """Whether `name`'s forwards lately needed more experts from disk per kept token than
        forwards without drafts (False until both are measured)."""
        mine, without = self.absent_per_token(name), self.absent_per_token(None)
        return mine is not None and without is not None and mine > without * (1 + ABSENT_MARGIN)

    def retry(self, name: str, costly: bool) -> bool:
        """Whether the coming forward retries `name`, left out: every AUTO_RETRY forwards, or, while
        its retries find it `costly`, every AUTO_RETRY · 2^k (at most AUTO_RETRY_MAX)."""
        every = self.retry_every.get(name, AUTO_RETRY)
        if self.forwards % every:
            return False
        self.retry_every[name] = min(2 * every, AUTO_RETRY_MAX) if costly else AUTO_RETRY
        return True

    def reading(self, name: str) -> bool:
        """Whether `name`'s latest forwards needed experts from disk (then `costly` needs a baseline)."""
        return bool(self.absent_per_token(name))

    def stats(self) -> dict:
        drafted, accepted = sum(self.drafted.values()), sum(self.accepted.values())
        return {"draft_drafted": drafted, "draft_accepted": accepted,
                "draft_acceptance": accepted / drafted if drafted else 0.0,
                "draft_forced_tokens": self.accepted.get("grammar", 0),
                "tokens_per_forward": self.tokens / self.forwards if self.forwards else 0.0}
