"""Speculative decoding (colibri_core/drafting.py, Engine.stream): drafting never changes a greedy
token and keeps the sampled distribution; a rejected draft rolls back every state kind exactly.

Tiny random models of every architecture with a state of its own kind (tools/tiny_model.py): OLMoE
(KV cache), GLM-5.2 with an MTP head (MLA latents, DSA indexer keys; the MTP drafter), Qwen3.6
(Gated DeltaNet conv + recurrent states), DeepSeek V4 (sliding window, compressor windows and the
carried half-window, indexer entries), Kimi-Linear (KDA states, MLA), GPT-OSS (GQA sliding windows
beside KV caches)."""
from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import numpy as np
import pytest

from colibri_core import plugins
from colibri_core.drafting import DraftCounters, Drafter, DrafterInfo, GrammarDrafter
from colibri_core.engine import load
from colibri_core.errors import ColibriError
from colibri_core.generate import distribution, verify_draft

pytest.importorskip("transformers", reason="the tiny models are built with transformers (the test extra)")

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("tiny_model", ROOT / "tools" / "tiny_model.py")
tiny_model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tiny_model)

ARCHS = ("olmoe", "glm52", "qwen36", "deepseek_v4", "kimi_linear", "gpt_oss")
PROMPT = [5, 17, 300, 42, 9, 77, 1000, 3, 64, 128, 256, 12, 700]  # 13: inside every compressor window
N = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: tiny_model.build(arch, root / arch, mtp=arch == "glm52") for arch in ARCHS}


class OracleDrafter(Drafter):
    """Drafts the known greedy continuation `want`, k tokens at a time, the j-th of them wrong
    (j cycling through 0 … k: every position rejected in turn, and a whole draft accepted)."""

    name = "oracle"

    def __init__(self, want: list[int], vocab: int, k: int = 4):
        self.want, self.vocab, self.k, self.calls = want, vocab, k, itertools.count()

    def propose(self, ids, limit, constraint=None):
        done = len(ids) - len(PROMPT)  # tokens generated so far
        draft = self.want[done:done + min(self.k, limit)]
        j = next(self.calls) % (self.k + 1)
        if j < len(draft):
            draft[j] = (draft[j] + 1) % self.vocab  # not the model's choice
        return draft


@pytest.fixture
def oracle_drafter(monkeypatch):
    """Register OracleDrafter as drafter "oracle" (its target set by the test)."""
    made = {}
    drafters = dict(plugins.registry().drafters())
    drafters["oracle"] = DrafterInfo("oracle", lambda model: made.get("drafter"), "test")
    monkeypatch.setattr(plugins.registry(), "_drafters", drafters)
    return made


@pytest.mark.parametrize("arch", ARCHS)
def test_rejection_at_every_draft_position_rolls_back_exactly(models, arch, oracle_drafter):
    """Drafts wrong at each position in turn (and wholly right): the tokens and the state after are
    those of decoding without drafts, bit for bit. A state of rows only (OLMoE's KV, GLM-5.2's
    latents and indexer keys) drops the rejected rows in place; the others are restored and the
    kept tokens fed again."""
    with load(models[arch], activations="f32", usage=False) as engine:
        vocab = tiny_model.VOCAB
        forward, calls = engine.model.forward, []
        engine.model.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)

        def replays(run):  # forwards beyond one per step: the rollbacks' replays
            c0, f0 = len(calls), engine.drafting.forwards
            out = run()
            return out, (len(calls) - c0) - (engine.drafting.forwards - f0)

        plain = engine.new_session()
        want, base = replays(lambda: engine.generate(PROMPT, N, stop_ids=(), draft="off", session=plain))
        oracle_drafter["drafter"] = OracleDrafter(want, vocab)
        drafted = engine.new_session()
        got, extra = replays(lambda: engine.generate(PROMPT, N, stop_ids=(), draft="oracle", session=drafted))
        stats = engine.drafting.stats()
        assert got == want
        assert (extra == base) == (arch in ("olmoe", "glm52")), (arch, extra, base)  # truncated, or replayed
        assert stats["draft_accepted"] > 0 and stats["draft_accepted"] < stats["draft_drafted"]
        a, b = plain.state.arrays(), drafted.state.arrays()
        assert plain.ids == drafted.ids and a.keys() == b.keys()
        for name in a:
            assert np.array_equal(a[name], b[name]), f"{arch}: state array {name} differs after rollbacks"
        after_plain = engine.generate(plain.ids + [want[-1]], 4, stop_ids=(), draft="off", session=plain)
        after_drafted = engine.generate(drafted.ids + [got[-1]], 4, stop_ids=(), draft="off", session=drafted)
        assert after_plain == after_drafted


def test_glm52_mtp_drafts_never_change_greedy_tokens(models):
    """GLM-5.2's MTP head drafts one token ahead (a random head: nearly every draft rejected, so the
    rollback runs at every step); the greedy tokens are those without drafts."""
    with load(models["glm52"], activations="f32", usage=False, cache_slots=2) as engine:
        off = engine.generate(PROMPT, N, stop_ids=(), draft="off")
        on = engine.generate(PROMPT, N, stop_ids=(), draft="mtp")
        stats = engine.stats()
    assert on == off
    assert stats["draft_drafted"] >= N - 2


def test_glm52_mtp_chains_drafts_while_the_model_takes_them(models):
    """A head that knows the greedy continuation but for every 7th position: its chains grow to
    MTP_CHAIN drafts while the model takes them whole and fall back to one after a rejection (the
    rows of chained drafts dropped from the head's cache); the tokens are those without drafts."""
    from colibri_core.drafting import MTP_CHAIN

    with load(models["glm52"], activations="f32", usage=False) as engine:
        want = engine.generate(PROMPT, N, stop_ids=(), draft="off")
        seq, model = PROMPT + want, engine.model
        real, sizes = model.mtp_forward, []

        def knowing_head(hidden, next_ids, state, keep=None):
            start = state.length  # row t: the hidden state at start + t → the token at start + t + 2
            logits = real(hidden, next_ids, state, keep)  # the head's cache and last_mtp_hidden as ever
            knows = np.full_like(logits, -1e9)
            for t in range(len(next_ids)):
                pos = start + t + 2
                if pos < len(seq):
                    knows[t, seq[pos] if pos % 7 else (seq[pos] + 1) % logits.shape[1]] = 0.0
            sizes.append(len(next_ids))
            return knows

        model.mtp_forward = knowing_head
        d = engine.drafting
        before = (sum(d.drafted.values()), sum(d.accepted.values()), d.forwards, d.tokens)
        got = engine.generate(PROMPT, N, stop_ids=(), draft="mtp")
        drafted, accepted, forwards, tokens = (b - a for a, b in zip(before, (
            sum(d.drafted.values()), sum(d.accepted.values()), d.forwards, d.tokens)))
    assert got == want
    assert MTP_CHAIN > 1 and 0 < accepted < drafted, (drafted, accepted)  # some chains cut short
    assert tokens / forwards > 2, (tokens, forwards)  # beyond what one draft per step can give
    assert sizes.count(1) > 0  # chained calls: one row each, on the head's own output


def test_a_seed_gives_the_same_tokens_whatever_drafted(models):
    """Sampling draws each token as decoding without drafts does, and keeps a draft iff it is that
    token: the engine's auto rule (which depends on every earlier call), the head, the grammar or
    no drafts at all give one seed the same tokens, in one engine and after a session resumes in a
    fresh one (its drafters new)."""
    kw = dict(temperature=0.8, seed=3, stop_ids=())
    with load(models["glm52"], activations="f32", usage=False) as engine:
        want = engine.generate(PROMPT, N, draft="off", **kw)
        for draft in ("auto", "mtp", "auto", "grammar", "auto"):
            assert engine.generate(PROMPT, N, draft=draft, **kw) == want, draft
        assert engine.stats()["draft_drafted"] > 0
        session = engine.new_session()
        first = engine.generate(PROMPT, 6, session=session, draft="mtp", **kw)
        then = engine.generate(PROMPT + first + [7], N, session=session, draft="mtp", **kw)
        engine.generate(PROMPT, 6, session="s", draft="mtp", **kw)
    with load(models["glm52"], activations="f32", usage=False) as fresh:
        assert fresh.generate(PROMPT + first + [7], N, session="s", draft="mtp", **kw) == then


class ReadingDrafter(Drafter):
    """Drafts the known greedy continuation `want` whole, 4 tokens at a time; each proposal adds 64
    to the store's count of experts absent from its cache, as a head's own layer reading them would."""

    name = "oracle"

    def __init__(self, engine, want: list[int]):
        self.engine, self.want, self.asked = engine, want, []  # asked: the forward each proposal is for

    def propose(self, ids, limit, constraint=None):
        self.asked.append(self.engine.drafting.forwards)
        self.engine.store.counters.absent += 64
        done = len(ids) - len(PROMPT)
        return self.want[done:done + min(4, limit)]


@pytest.mark.parametrize("slots", [2, 16])
def test_auto_stops_a_drafter_whose_forwards_read_more_experts(models, oracle_drafter, slots):
    """`--draft auto` where a layer's cache cannot hold its experts (2 of 16 slots) weighs the experts
    read from disk per kept token: a drafter whose forwards need many more than forwards without
    drafts is left out once the forward after its first (without it) gives that baseline, but for
    retries after AUTO_RETRY forwards, then twice as many each time; with every expert cached (16
    slots) a read is an expert's first and the drafter drafts at every forward. The tokens are
    those without drafts."""
    from colibri_core.drafting import AUTO_RETRY

    with load(models["olmoe"], activations="f32", usage=False, cache_slots=slots, pin_gb=0) as engine:
        want = engine.generate(PROMPT, 160, stop_ids=(), draft="off")
        drafter = oracle_drafter["drafter"] = ReadingDrafter(engine, want)
        engine.drafting = DraftCounters()  # no baseline yet; AUTO_RETRY's turns from this generation's start
        assert engine.generate(PROMPT, 160, stop_ids=(), draft="auto") == want
        forwards = engine.drafting.forwards
    if slots < 16:  # one draft, the baseline forward, then the retries alone, twice as far apart each time
        assert forwards > 4 * AUTO_RETRY, forwards
        retries = [AUTO_RETRY * 2**k for k in range(8) if AUTO_RETRY * 2**k < forwards]
        assert drafter.asked == [0] + retries, drafter.asked
    else:
        assert drafter.asked == list(range(forwards)), drafter.asked


def test_mtp_needs_a_head(models):
    with load(models["olmoe"], usage=False) as engine:
        assert engine.generate(PROMPT, 4, stop_ids=(), draft="mtp") == engine.generate(PROMPT, 4, stop_ids=(), draft="off")
        assert engine.drafting.stats()["draft_drafted"] == 0  # no head: nothing drafted, nothing changes
        with pytest.raises(ColibriError, match="unknown draft mode"):
            engine.generate(PROMPT, 4, draft="sometimes")


class Forcing:
    """A stand-in constraint (the structured.Constraint protocol): of every 6 tokens, the last 3 are
    forced to `script`; any token is allowed at the others."""

    def __init__(self, vocab: int, script: list[int]):
        self.vocab, self.script, self.n = vocab, script, 0

    def forced(self):
        at = self.n % 6
        return self.script[at - 3:] if at >= 3 else []

    def mask(self):
        forced = self.forced()
        m = np.zeros(self.vocab, bool) if forced else np.ones(self.vocab, bool)
        if forced:
            m[forced[0]] = True
        return m

    def advance(self, token):
        if not self.mask()[token]:
            raise ValueError(f"token {token} is not allowed")
        self.n += 1

    def rollback(self, n):
        self.n -= n

    def finished(self):
        return False


@pytest.mark.parametrize("arch", ARCHS)
def test_grammar_drafts_forced_tokens(models, arch):
    """The tokens a constraint forces are drafted and verified in one forward with the token before
    them; the output is that of generating under the same constraint without drafts."""
    with load(models[arch], activations="f32", usage=False) as engine:
        V = engine.model.forward(np.array(PROMPT[:1]), engine.model.new_state()).shape[1]
        script = [7, 8, 9]
        off = engine.generate(PROMPT, N, stop_ids=(), draft="off", constraint=Forcing(V, script))
        on = engine.generate(PROMPT, N, stop_ids=(), draft="grammar", constraint=Forcing(V, script))
        stats = engine.drafting.stats()
    assert on == off
    assert stats["draft_forced_tokens"] > 0 and stats["tokens_per_forward"] > 1


def test_grammar_drafter_proposes_forced_tokens():
    class C:
        def forced(self):
            return [4, 5, 6]

    assert GrammarDrafter().propose([1, 2], 2, C()) == [4, 5]
    assert GrammarDrafter().propose([1, 2], 2, None) == []


def test_speculative_sampling_keeps_the_distribution():
    """verify_draft: accepted with p(draft), else from p without it — the marginal is p (20,000 draws)."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(12).astype(np.float32) * 2
    p = distribution(logits, 0.8, top_p=0.95, top_k=8)
    for draft in (int(np.argmax(p)), int(np.argsort(p)[-3])):
        counts = np.bincount([verify_draft(logits, draft, rng, 0.8, 0.95, 8)[1] for _ in range(20000)], minlength=12)
        assert 0.5 * np.abs(counts / counts.sum() - p).sum() < 0.02
    assert verify_draft(logits, 3, rng) == (int(np.argmax(logits)) == 3, int(np.argmax(logits)))


def test_sampled_generation_with_drafts_keeps_the_models_distribution(models, oracle_drafter):
    """Sampling (temperature 1, top-k 6) with the greedy guess drafted for the second token: over 600
    seeds its distribution is the model's own p(· | prompt, first token) (the first token forced by a
    constraint, so every sample shares it): total variation within sampling noise."""
    with load(models["olmoe"], activations="f32", usage=False) as engine:
        greedy = engine.generate(PROMPT, 2, stop_ids=(), draft="off")
        drafter = oracle_drafter["drafter"] = OracleDrafter(greedy, tiny_model.VOCAB, k=1)
        drafter.calls = itertools.repeat(1)  # never corrupted: the greedy guess
        V = engine.model.forward(np.array(PROMPT[:1]), engine.model.new_state()).shape[1]

        class First(Forcing):  # the first token forced to the greedy one, then anything
            def forced(self):
                return [greedy[0]] if self.n == 0 else []

        seconds = [engine.generate(PROMPT, 3, temperature=1.0, top_k=6, seed=s, stop_ids=(), draft="oracle",
                                   constraint=First(V, []))[1] for s in range(600)]
        stats = engine.drafting.stats()
        p = distribution(engine.logits(PROMPT + greedy[:1])[-1], 1.0, top_k=6)
    assert 0 < stats["draft_accepted"] < stats["draft_drafted"]  # accepted and rejected both happened
    counts = np.bincount(seconds, minlength=p.size) / len(seconds)
    assert 0.5 * np.abs(counts - p).sum() < 0.08
