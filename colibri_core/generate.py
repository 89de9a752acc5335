"""Sampling, reproducible from a seed: greedy, temperature, top-k, top-p (nucleus), min-p; logit bias and
the repetition, frequency and presence penalties; log-probabilities of what was chosen.

A choice follows vLLM's order: the logits (V,) get `logit_bias` added, then the penalties for the tokens
seen so far (`Sampling.shape`); temperature 0 takes their argmax; otherwise softmax(z / temperature)
is cut to the tokens of at least min_p × the most likely one's probability, then to the top_k, then to
the smallest set reaching top_p (`distribution`), and one draw of the seeded generator picks a token.
Log-probabilities (`Token`) are of the model's own distribution, log_softmax of the raw logits, before
any of that (vLLM's default, `raw_logprobs`): what the model thinks of a token, whatever the knobs.
"""
from __future__ import annotations

import math
import numbers
from collections import deque
from dataclasses import dataclass
from typing import Mapping, NamedTuple

import numpy as np

from .errors import ColibriError


def distribution(logits: np.ndarray, temperature: float, top_p: float = 1.0, top_k: int = 0,
                 min_p: float = 0.0) -> np.ndarray:
    """The probabilities (V,) float64 that `sample` draws from at temperature > 0: softmax of
    logits / temperature, restricted to the tokens of at least min_p × the largest probability,
    then to the top_k, then to the smallest set reaching top_p."""
    z = logits.astype(np.float64) / temperature
    if min_p > 0:  # p >= min_p * p_max  <=>  z >= z_max + log(min_p)
        z = np.where(z < z.max() + math.log(min_p), -np.inf, z)
    if top_k > 0:
        kth = np.partition(z, -top_k)[-top_k] if top_k < z.size else -np.inf
        z = np.where(z < kth, -np.inf, z)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(cum, top_p)) + 1]  # smallest set reaching top_p
        mask = np.zeros_like(probs)
        mask[keep] = probs[keep]
        probs = mask / mask.sum()
    return probs


def sample(logits: np.ndarray, rng: np.random.Generator, temperature: float = 0.0,
           top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> int:
    """One token id from logits (V,). Temperature 0 is greedy (ties go to the lowest id)."""
    if temperature <= 0:
        return int(np.argmax(logits))
    probs = distribution(logits, temperature, top_p, top_k, min_p)
    return int(rng.choice(probs.size, p=probs))


def verify_draft(logits: np.ndarray, draft: int, rng: np.random.Generator, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> tuple[bool, int]:
    """Speculative sampling of a deterministic draft: (accepted, token). The token is `sample`'s, from
    the same one draw, and the draft is accepted iff it is that token: accepted with probability
    p(draft), else a token from p with the draft removed — the scheme of speculative sampling for a
    draft of one certain token. Drawing exactly what decoding without drafts draws, a seed gives the
    same tokens whether, when and what anything drafted (the engine's auto rule, a session resumed
    with fresh drafters); greedy, accepted iff the draft is the argmax."""
    token = sample(logits, rng, temperature, top_p, top_k, min_p)
    return token == draft, token


def _integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Sampling:
    """How one generation chooses its tokens; every field checked when it is made (a ColibriError
    naming the first one out of its range; NaN is out of every one). The defaults change nothing."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus: the smallest set of tokens reaching this much probability
    top_k: int = 0  # the k most likely tokens (0: no cut; a k past the vocabulary neither)
    min_p: float = 0.0  # only tokens of at least min_p × the most likely one's probability
    presence_penalty: float = 0.0  # subtracted from the logit of every token seen (OpenAI's)
    frequency_penalty: float = 0.0  # subtracted once per time a token was seen (OpenAI's)
    repetition_penalty: float = 1.0  # a seen token's logit divided by it if positive, else multiplied (CTRL's)
    # which tokens the penalties see: None, vLLM's and OpenAI's rule (presence and frequency count the
    # answer's tokens, repetition every token of prompt and answer); N, llama.cpp's `repeat_last_n`: all
    # three count the last N tokens of prompt and answer together (0: no penalty at all)
    penalty_last_n: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), by id; -inf: banned

    def __post_init__(self):
        if not (_number(self.temperature) and self.temperature >= 0):
            raise ColibriError(f"temperature must be 0 (greedy) or more, got {self.temperature}")
        if not (_number(self.top_p) and 0 < self.top_p <= 1):
            raise ColibriError(f"top_p must be more than 0 and at most 1, got {self.top_p}")
        if not (_integer(self.top_k) and 0 <= self.top_k < 1 << 31):  # the server's bound too
            raise ColibriError(f"top_k must be 0 (no cut) or more and below 2**31, got {self.top_k!r}")
        if not (_number(self.min_p) and 0 <= self.min_p <= 1):
            raise ColibriError(f"min_p must be from 0 (no cut) to 1, got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _number(getattr(self, name)):
                raise ColibriError(f"{name} must be a finite number (0: none), got {getattr(self, name)}")
        if not (_number(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ColibriError(f"repetition_penalty must be more than 0 (1: none), got {self.repetition_penalty}")
        if self.penalty_last_n is not None and not (_integer(self.penalty_last_n) and self.penalty_last_n >= 0):
            raise ColibriError(f"penalty_last_n must be 0 or more (or none), got {self.penalty_last_n!r}")
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        bias = {}
        for token, value in pairs:
            if not (_integer(token) and token >= 0):
                raise ColibriError(f"logit_bias: a token id must be an integer of 0 or more, got {token!r}")
            if not (_number(value) or value == -math.inf):
                raise ColibriError(f"logit_bias: the bias of token {token} must be a finite number or -inf, "
                                   f"got {value}")
            bias[int(token)] = float(value)
        object.__setattr__(self, "logit_bias", tuple(sorted(bias.items())))

    @property
    def draw(self) -> tuple[float, float, int, float]:
        """`sample`'s and `verify_draft`'s arguments after the generator: temperature, top_p, top_k, min_p."""
        return self.temperature, self.top_p, self.top_k, self.min_p

    @property
    def penalised(self) -> bool:
        return (self.penalty_last_n != 0 and (self.presence_penalty != 0 or self.frequency_penalty != 0
                                              or self.repetition_penalty != 1))

    def shape(self, logits: np.ndarray, ids: list[int], n_prompt: int) -> np.ndarray:
        """The logits (V,) a choice is made from, after `ids` (the prompt's n_prompt tokens, then the
        answer so far): the bias added, then the penalties; `logits` itself when there are none."""
        if not self.logit_bias and not self.penalised:
            return logits
        z = logits.astype(np.float64)  # a copy, (V,)
        if self.logit_bias:
            tokens, bias = np.array([t for t, _ in self.logit_bias]), np.array([b for _, b in self.logit_bias])
            if tokens[-1] >= z.size:
                raise ColibriError(f"logit_bias names token {tokens[-1]}, past this model's vocabulary "
                                   f"({z.size} tokens)")
            z[tokens] += bias
        if self.penalised:
            seq = np.asarray(ids, np.int64)
            if self.penalty_last_n is None:
                answer, seen = seq[n_prompt:], seq
            else:
                answer = seen = seq[max(0, seq.size - self.penalty_last_n):]
            if self.repetition_penalty != 1:
                hit = np.unique(seen)
                with np.errstate(over="ignore"):  # an overflow is refused below
                    z[hit] = np.where(z[hit] > 0, z[hit] / self.repetition_penalty, z[hit] * self.repetition_penalty)
            tokens, counts = np.unique(answer, return_counts=True)
            z[tokens] -= self.frequency_penalty * counts + self.presence_penalty
            if z.max() == np.inf:  # a penalty of extreme size: no distribution is left to sample
                raise ColibriError(f"the penalties (repetition {self.repetition_penalty}, frequency "
                                   f"{self.frequency_penalty}, presence {self.presence_penalty}) overflow the logits")
        return z


class Token(NamedTuple):
    """A chosen token with its log-probability under the model's distribution, and the `k` most
    likely tokens' ((id, logprob), most likely first; ties by id)."""

    id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: np.ndarray, token: int, k: int) -> Token:
    """`token` and the top k of log_softmax(logits) (V,), computed in float64."""
    z = logits.astype(np.float64)
    lp = z - (z.max() + np.log(np.exp(z - z.max()).sum()))
    k = min(k, lp.size)
    best = np.argpartition(-lp, k - 1)[:k] if k else np.array([], np.int64)
    best = best[np.lexsort((best, -lp[best]))]
    return Token(int(token), float(lp[token]), tuple((int(t), float(lp[t])) for t in best))


class Sampler:
    """One generation's choices: its `Sampling`, its seeded generator (one draw per token sampled), the
    prompt's length (what the penalties count as the answer), and, with `logprobs` = k, a `Token` for
    every token chosen, in order, waiting in `chosen` for the caller to take."""

    def __init__(self, sampling: Sampling, seed: int | None, n_prompt: int, logprobs: int | None = None):
        if logprobs is not None and not (_integer(logprobs) and logprobs >= 0):
            raise ColibriError(f"logprobs must be 0 or more (the most likely tokens listed), got {logprobs!r}")
        self.sampling, self.n_prompt, self.logprobs = sampling, n_prompt, logprobs
        self.rng = np.random.default_rng(seed)
        self.chosen: deque[Token] = deque()

    def _scores(self, logits: np.ndarray, ids: list[int], constraint) -> np.ndarray:
        z = self.sampling.shape(logits, ids, self.n_prompt)
        if constraint is not None:
            z = np.where(constraint.mask(), z, z.dtype.type(-np.inf))
        if self.sampling.logit_bias and z.max() == -np.inf:
            raise ColibriError("logit_bias bans every token that may come next")
        return z

    def _record(self, logits: np.ndarray, token: int) -> int:
        if self.logprobs is not None:
            self.chosen.append(token_logprobs(logits, token, self.logprobs))
        return token

    def pick(self, logits: np.ndarray, ids: list[int], constraint=None) -> int:
        """The token after `ids` (prompt and answer so far), from the model's logits (V,) there; only
        what `constraint` (structured.Constraint) allows."""
        return self._record(logits, sample(self._scores(logits, ids, constraint), self.rng, *self.sampling.draw))

    def verify(self, logits: np.ndarray, draft: int, ids: list[int], constraint=None) -> tuple[bool, int]:
        """`verify_draft` of `draft` after `ids`, from the same shaped distribution `pick` draws from."""
        ok, token = verify_draft(self._scores(logits, ids, constraint), draft, self.rng, *self.sampling.draw)
        return ok, self._record(logits, token)
