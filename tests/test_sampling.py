"""Sampling as users know it (colibri_core/generate.py), on the bundled demo model: min_p, the presence,
frequency and repetition penalties, logit_bias and log-probabilities, each checked against a NumPy
formula written out here, seeded, and exact with constraints and speculative drafts."""
from __future__ import annotations

import collections
import math

import numpy as np
import pytest

from colibri_core import load
from colibri_core.demo import demo_model
from colibri_core.errors import ColibriError
from colibri_core.generate import Sampling, Token, distribution, token_logprobs
from colibri_core.structured import Constraint, Vocabulary
from conftest import colibri

LOOPING = "In the beginning"  # greedy, the demo writes ", and the Levites, and the Levites, …"


@pytest.fixture(scope="module")
def engine():
    with load(demo_model()) as e:
        yield e


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    return z - z.max() - np.log(np.exp(z - z.max()).sum())


def most_repeated(words: list[str], n: int = 3) -> int:
    """How often the most frequent run of n words occurs."""
    return max(collections.Counter(zip(*(words[i:] for i in range(n)))).values())


# ---- the formulas, on small arrays ------------------------------------------------------------------
def test_penalties_follow_openai_and_ctrl():
    """OpenAI's: logit − count × frequency − (count > 0) × presence, counting the answer only; CTRL's
    repetition penalty over prompt and answer: a positive logit divided, a negative one multiplied."""
    logits = np.array([2.0, -1.0, 0.5, 3.0, -2.0, 1.0], np.float32)
    prompt, answer = [4], [0, 0, 1]  # token 4 only in the prompt; 0 twice, 1 once in the answer
    s = Sampling(presence_penalty=0.5, frequency_penalty=0.25)
    want = logits.astype(np.float64) - np.array([2 * 0.25 + 0.5, 0.25 + 0.5, 0, 0, 0, 0])
    assert np.array_equal(s.shape(logits, prompt + answer, len(prompt)), want)
    s = Sampling(repetition_penalty=2.0)
    assert np.array_equal(s.shape(logits, prompt + answer, len(prompt)), [1.0, -2.0, 0.5, 3.0, -4.0, 1.0])
    # llama.cpp's repeat_last_n: every penalty counts the last N tokens, prompt and answer alike
    s = Sampling(frequency_penalty=1.0, repetition_penalty=2.0, penalty_last_n=2)
    assert np.array_equal(s.shape(logits, [4, 3, 0, 1], 1), [2.0 / 2 - 1, -1.0 * 2 - 1, 0.5, 3.0, -2.0, 1.0])
    assert Sampling(frequency_penalty=1.0, penalty_last_n=0).shape(logits, [0, 0], 0) is logits  # 0: none
    assert Sampling().shape(logits, [0, 1], 0) is logits  # neutral: the very logits, no copy


def test_logit_bias_adds_and_bans():
    logits = np.zeros(5, np.float32)
    z = Sampling(logit_bias={3: 2.5, 1: -math.inf}).shape(logits, [0], 1)
    assert z.tolist() == [0.0, -math.inf, 0.0, 2.5, 0.0]
    with pytest.raises(ColibriError, match="logit_bias names token 7, past this model's vocabulary"):
        Sampling(logit_bias={7: 1.0}).shape(logits, [0], 1)


def test_min_p_keeps_what_is_at_least_min_p_of_the_best():
    logits = np.log(np.array([0.5, 0.3, 0.1, 0.06, 0.04]))
    p = distribution(logits, 1.0, min_p=0.2)  # kept: p >= 0.1
    assert np.allclose(p, [0.5 / 0.9, 0.3 / 0.9, 0.1 / 0.9, 0, 0])
    assert np.count_nonzero(distribution(logits, 1.0, min_p=1.0)) == 1


def test_token_logprobs_shape_and_order():
    logits = np.array([1.0, 3.0, 3.0, -1.0, 2.0], np.float32)
    t = token_logprobs(logits, 4, 3)
    lp = log_softmax(logits)
    assert t.id == 4 and math.isclose(t.logprob, lp[4]) and [i for i, _ in t.top] == [1, 2, 4]  # ties by id
    assert np.allclose([p for _, p in t.top], lp[[1, 2, 4]])
    assert token_logprobs(logits, 0, 0).top == () and len(token_logprobs(logits, 0, 99).top) == 5
    assert math.isclose(np.exp([p for _, p in token_logprobs(logits, 0, 5).top]).sum(), 1.0)


@pytest.mark.parametrize("field,value,message", [
    ("min_p", 1.5, "min_p must be from 0"), ("min_p", math.nan, "min_p must be from 0"),
    ("presence_penalty", math.inf, "presence_penalty must be a finite number"),
    ("frequency_penalty", math.nan, "frequency_penalty must be a finite number"),
    ("repetition_penalty", 0.0, "repetition_penalty must be more than 0"),
    ("penalty_last_n", -1, "penalty_last_n must be 0 or more"),
    ("logit_bias", {-1: 1.0}, "logit_bias: a token id must be an integer of 0 or more"),
    ("logit_bias", {5: math.nan}, "logit_bias: the bias of token 5 must be a finite number or -inf"),
    ("temperature", -1.0, "temperature must be 0"), ("top_p", 0.0, "top_p must be more than 0"),
    ("top_k", 2.5, "top_k must be 0"),
])
def test_out_of_range_is_one_line_naming_the_knob(engine, field, value, message):
    with pytest.raises(ColibriError, match=message):
        engine.generate([1, 2], 2, **{field: value})


def test_top_logprobs_must_be_a_count(engine):
    with pytest.raises(ColibriError, match="logprobs must be 0 or more"):
        engine.generate([1, 2], 2, logprobs=[], top_logprobs=-1)


# ---- on the demo model ---------------------------------------------------------------------------------
def test_penalties_stop_the_demo_looping(engine):
    ids = engine.tokenizer.encode(LOOPING)
    words = lambda out: engine.tokenizer.decode(out).split()  # noqa: E731
    plain = words(engine.generate(ids, 120, stop_ids=()))
    assert most_repeated(plain) >= 10  # ", and the Levites" over and over
    for knobs in ({"repetition_penalty": 1.3}, {"frequency_penalty": 0.5, "presence_penalty": 0.5},
                  {"repetition_penalty": 1.3, "penalty_last_n": 64}):  # the last: llama.cpp's default window
        assert most_repeated(words(engine.generate(ids, 120, stop_ids=(), **knobs))) <= 3, knobs


def test_logit_bias_forces_and_bans_a_token(engine):
    ids = engine.tokenizer.encode(LOOPING)
    plain = engine.generate(ids, 12, stop_ids=())
    forced = engine.tokenizer.encode(" Egypt", add_special_tokens=False)[0]
    assert engine.generate(ids, 12, stop_ids=(), logit_bias={forced: 100}) == [forced] * 12
    banned = collections.Counter(plain).most_common(1)[0][0]
    for bias in (-100, -math.inf):
        out = engine.generate(ids, 12, stop_ids=(), logit_bias={banned: bias})
        assert banned not in out and out != plain
    sampled = engine.generate(ids, 40, 1.5, seed=3, stop_ids=(), logit_bias={banned: -math.inf})
    assert banned not in sampled


def test_min_p_one_is_greedy_and_a_cut_keeps_the_support(engine):
    ids = engine.tokenizer.encode(LOOPING)
    assert engine.generate(ids, 16, 1.5, seed=1, min_p=1.0, stop_ids=()) == engine.generate(ids, 16, stop_ids=())
    p = np.exp(log_softmax(engine.logits(ids)[-1] / 1.5))
    allowed = set(np.flatnonzero(p >= 0.3 * p.max()).tolist())
    firsts = {engine.generate(ids, 1, 1.5, seed=s, min_p=0.3, stop_ids=())[0] for s in range(40)}
    assert firsts <= allowed and len(allowed) > 1


def test_seeded_with_every_knob_reproduces(engine):
    ids = engine.tokenizer.encode("And God said")
    knobs = dict(min_p=0.05, top_k=40, top_p=0.95, presence_penalty=0.3, frequency_penalty=0.2,
                 repetition_penalty=1.1, logit_bias={5: 2.0})
    a = engine.generate(ids, 40, 0.9, seed=11, stop_ids=(), **knobs)
    assert a == engine.generate(ids, 40, 0.9, seed=11, stop_ids=(), **knobs)
    assert a != engine.generate(ids, 40, 0.9, seed=12, stop_ids=(), **knobs)


def test_greedy_logprobs_are_the_models_log_softmax(engine):
    """A `logprobs` list gets one Token per token, its id the one generated (the same as without it),
    its logprob that of log_softmax(engine.logits) at its position (teacher-forced), the top k sorted,
    the chosen first."""
    ids = engine.tokenizer.encode("And God said")
    plain = engine.generate(ids, 10, stop_ids=())
    tokens = []
    assert engine.generate(ids, 10, stop_ids=(), logprobs=tokens, top_logprobs=5) == plain
    assert all(isinstance(t, Token) for t in tokens) and [t.id for t in tokens] == plain
    lp = np.stack([log_softmax(row) for row in engine.logits(ids + plain)[len(ids) - 1:-1]])  # (10, V)
    for t, row in zip(tokens, lp):
        assert math.isclose(t.logprob, row[t.id], abs_tol=1e-5)
        assert len(t.top) == 5 and t.top[0][0] == t.id  # greedy: the chosen is the most likely
        assert [p for _, p in t.top] == sorted((p for _, p in t.top), reverse=True)
        assert np.allclose([p for _, p in t.top], np.sort(row)[::-1][:5], atol=1e-5)


def test_logprobs_are_raw_whatever_the_knobs(engine):
    """The log-probabilities are the model's (vLLM's raw_logprobs): a bias changes the token chosen,
    never what the model thought of it."""
    ids = engine.tokenizer.encode("And God said")
    forced = engine.tokenizer.encode(" Egypt", add_special_tokens=False)[0]
    scores = []
    engine.generate(ids, 1, stop_ids=(), logit_bias={forced: 100}, logprobs=scores, top_logprobs=2)
    [t] = scores
    assert t.id == forced and math.isclose(t.logprob, log_softmax(engine.logits(ids)[-1])[forced], abs_tol=1e-5)
    assert t.logprob < t.top[0][1]


def test_drafts_keep_penalised_sampling_exact(engine):
    """Under a JSON constraint the grammar drafter's forced tokens are verified against the penalised,
    biased, min-p-cut distribution: tokens and logprobs are those of decoding without drafts."""
    ids = engine.tokenizer.encode("And God said")
    vocab = Vocabulary.of(engine)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                               "count": {"type": "integer"}}, "required": ["name", "count"],
              "additionalProperties": False}
    knobs = dict(min_p=0.02, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2,
                 logit_bias={5: 1.5}, top_logprobs=3, stop_ids=())
    for seed in range(4):
        before = engine.drafting.stats()["draft_accepted"]
        runs = {}
        for draft in ("auto", "off"):
            scores = []
            tokens = engine.generate(ids, 60, 1.0, seed=seed, draft=draft, logprobs=scores,
                                     constraint=Constraint.json_schema(vocab, schema), **knobs)
            runs[draft] = tokens, scores
            if draft == "auto":  # the grammar's forced keys and separators were drafted and accepted
                assert engine.drafting.stats()["draft_accepted"] > before
        assert runs["auto"] == runs["off"] and [t.id for t in runs["off"][1]] == runs["off"][0]


def test_penalties_that_overflow_the_logits_are_an_error():
    with pytest.raises(ColibriError, match="the penalties .* overflow the logits"):
        Sampling(repetition_penalty=5e-324).shape(np.array([1.0, 2.0], np.float32), [1], 0)


# ---- the CLI ---------------------------------------------------------------------------------------------
def test_cli_sampling_options_reach_the_engine(engine):
    """`run`'s sampling options give the engine's answer: a penalty ends the loop, llama.cpp's names
    and its ID+BIAS / ID-BIAS forms work, a bad one is one line."""
    ids = engine.tokenizer.encode(LOOPING)
    levites = engine.tokenizer.encode(" Levites", add_special_tokens=False)[0]

    def run(*options) -> str:
        r = colibri("run", LOOPING, "--max-tokens", "40", *options)
        assert r.returncode == 0, r.stderr
        return r.stdout.rstrip("\n")

    want = engine.tokenizer.decode(engine.generate(ids, 40, stop_ids=(), repetition_penalty=1.3, min_p=0.1,
                                                   penalty_last_n=64, logit_bias={levites: -math.inf})).rstrip("\n")
    assert run("--repeat-penalty", "1.3", "--repeat-last-n", "64", "--min-p", "0.1",
               "--logit-bias", f"{levites}-inf") == want
    assert run("--frequency-penalty", "0.5", "--presence-penalty", "0.5", "--logit-bias", f"{levites}=+2") == \
        engine.tokenizer.decode(engine.generate(ids, 40, stop_ids=(), frequency_penalty=0.5, presence_penalty=0.5,
                                                logit_bias={levites: 2.0})).rstrip("\n")
    for bad, message in (("--logit-bias=12x", "--logit-bias '12x': give TOKEN_ID=BIAS"),
                         ("--logit-bias=1.5.2", "give TOKEN_ID=BIAS"),
                         ("--repetition-penalty=0", "repetition_penalty must be more than 0")):
        r = colibri("run", "x", bad)
        assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
