"""The prefix cache (colibri_core/prefix.py): aligned prefill pieces, what an entry keeps, eviction
under the budget, and the engine serving prompts from it with the bits of a cold prefill."""
import importlib.util
import time
from pathlib import Path

import numpy as np
import pytest

from colibri_core import load
from colibri_core.errors import ColibriError
from colibri_core.kv import SequenceState
from colibri_core.kv.cache import KVCache
from colibri_core.layers.sink_attention import SlidingWindow
from colibri_core.prefix import PrefixCache, pieces
from colibri_core.testing.checks import check_prefix_cache_is_invisible


def test_pieces_end_at_the_multiples_of_the_chunk():
    assert pieces(0, 10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert pieces(6, 13, 4) == [(6, 8), (8, 12), (12, 13)]
    assert pieces(8, 12, 4) == [(8, 12)]


def _state() -> SequenceState:
    """Rows (a KV cache) and a fixed-size part (a sliding window): both kinds an entry keeps."""
    return SequenceState({"layer.0": KVCache(1, 2), "layer.1": SlidingWindow(3, 2)})


def _feed(state: SequenceState, tokens, capture=None, chunk: int = 2) -> None:
    """A stand-in forward: each token's row is (token, token), fed one by one."""
    for t in tokens:
        row = np.full((1, 1, 2), t, np.float32)
        state["layer.0"].append(row, row)
        state["layer.1"].extend(row[0])
        state.advance(1)
        if capture is not None and state.length % chunk == 0:
            capture.reached(state.length)


def test_an_entry_keeps_the_last_and_power_of_two_boundaries_and_restores_them():
    cache = PrefixCache(budget=1 << 20, chunk=2)
    prompt = list(range(1, 24))  # 23 tokens: boundaries 2 … 22
    state = _state()
    capture = cache.capture(state, prompt, None)
    _feed(state, prompt, capture)
    cache.insert(capture)
    (entry,) = cache.entries.values()
    assert sorted(entry.fixed) == [2, 4, 8, 16, 22] and len(entry.tokens) == 22
    # a prompt sharing 13 tokens is restored at 8 (the last kept boundary within them), as fed
    hit = cache.lookup(prompt[:13] + [99, 98])
    assert hit[1] == 8
    restored, fed = _state(), _state()
    cache.restore(hit, restored)
    _feed(fed, prompt[:8])
    a, b = restored.arrays(), fed.arrays()
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert cache.lookup(prompt)[1] == 22 and cache.lookup(prompt[:22])[1] == 16  # a token is always left to feed
    assert cache.lookup([7] + prompt) is None


def test_rows_only_entries_restore_at_every_boundary():
    cache = PrefixCache(budget=1 << 20, chunk=4)
    state = SequenceState({"layer.0": KVCache(1, 2)})
    prompt = list(range(1, 19))
    capture = cache.capture(state, prompt, None)
    rows = np.repeat(np.asarray(prompt, np.float32), 2).reshape(-1, 1, 2)  # token t's row: (t, t)
    state["layer.0"].append(rows, rows)
    state.advance(len(prompt))
    cache.insert(capture)
    assert [cache.lookup(prompt[:n] + [0])[1] for n in (5, 9, 13, 18)] == [4, 8, 12, 16]
    restored = SequenceState({"layer.0": KVCache(1, 2)})
    cache.restore(cache.lookup(prompt[:11] + [0]), restored)
    assert restored.length == 8 and restored.arrays()["layer.0.k"][:, 0, 0].tolist() == prompt[:8]


def _insert(cache: PrefixCache, prompt) -> None:
    state = SequenceState({"layer.0": KVCache(1, 256)})  # its own 64-row buffers
    capture = cache.capture(state, prompt, cache.lookup(prompt))
    for t in prompt:
        row = np.full((1, 1, 256), t, np.float32)
        state["layer.0"].append(row, row)
        state.advance(1)
    cache.insert(capture)


def test_extended_entries_are_replaced_and_the_least_recent_evicted_under_the_budget():
    one = 2 * 64 * 256 * 4  # an entry's bytes: keys and values of 64 rows of 256 floats
    cache = PrefixCache(budget=2 * one, chunk=4)
    _insert(cache, [1] * 10)
    _insert(cache, [1] * 20)  # extends the first: it replaces it
    assert [len(e.tokens) for e in cache.entries.values()] == [20] and cache.nbytes == one
    _insert(cache, [1] * 12)  # a prefix of what is held: nothing new
    assert len(cache.entries) == 1
    _insert(cache, [2] * 10)
    cache.restore(cache.lookup([1] * 30), SequenceState({"layer.0": KVCache(1, 256)}))  # [1] * 20: the most recent
    _insert(cache, [3] * 10)  # over the budget: [2]*10, the least recently used, goes
    assert sorted(int(e.tokens[0]) for e in cache.entries.values()) == [1, 3] and cache.nbytes == 2 * one
    cache.clear()
    assert cache.nbytes == 0 and not cache.entries
    off = PrefixCache(budget=0)
    assert off.capture(SequenceState({"layer.0": KVCache(1, 256)}), [1] * 600, None) is None


def test_lookup_is_fast_for_hundreds_of_entries():
    """The index is a list scanned with one vectorised comparison per entry (prefix.py)."""
    cache = PrefixCache(budget=1 << 40, chunk=256)
    rng = np.random.default_rng(0)
    for _ in range(500):
        state = SequenceState({"layer.0": KVCache(1, 1)})
        capture = cache.capture(state, rng.integers(0, 50_000, 8192).tolist(), None)
        state["layer.0"].append(np.zeros((8192, 1, 1), np.float32), np.zeros((8192, 1, 1), np.float32))
        state.advance(8192)
        cache.insert(capture)
    prompt = list(cache.entries.values())[250].tokens.tolist() + [1]
    t0 = time.perf_counter()
    hit = cache.lookup(prompt)
    assert hit[1] == 8192 and time.perf_counter() - t0 < 0.2  # about 9 ms on one core; a prefill takes seconds


def test_the_engine_serves_prompts_from_the_cache_with_the_bits_of_a_cold_prefill(tiny_model):
    check_prefix_cache_is_invisible(tiny_model, vocab_size=300, chunk=32)


def test_an_mtp_head_drafts_after_a_restore_as_after_a_cold_prefill(tmp_path):
    """GLM-5.2's MTP drafter reads the model's hidden states: an entry keeps them, and a restored
    call drafts (and accepts) exactly what the cold call does (the check compares the counts)."""
    pytest.importorskip("transformers", reason="the tiny model is built with transformers (the test extra)")
    tools = Path(__file__).resolve().parent.parent / "tools"
    spec = importlib.util.spec_from_file_location("tiny_model", tools / "tiny_model.py")
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    model_dir = tiny.build("glm52", tmp_path / "glm52", mtp=True)
    with load(model_dir) as engine:
        assert engine.model.has_mtp
        vocab = engine.model.vocab_size
    check_prefix_cache_is_invisible(model_dir, vocab, chunk=32)


def test_only_calls_without_a_session_use_the_cache_and_stats_count_it(tiny_model):
    prompt = list(np.random.default_rng(1).integers(3, 300, 100))
    with load(tiny_model, prefill_chunk=32, prefix_cache="64MB") as engine:
        session = engine.new_session()
        engine.generate(prompt, 2, stop_ids=(), session=session)
        assert engine.stats()["prefix_cache_entries"] == 0
        engine.generate(prompt, 2, stop_ids=())
        engine.generate(prompt + [5, 6], 2, stop_ids=())
        s = engine.stats()
        assert (s["prefix_cache_hits"], s["prefix_cached_tokens"], s["prefix_cache_entries"]) == (1, 96, 1)
        assert 0 < s["prefix_cache_bytes"] <= s["prefix_cache_budget"] == 64_000_000
    with load(tiny_model, prefill_chunk=32, prefix_cache=0) as engine:
        engine.generate(prompt, 2, stop_ids=())
        engine.generate(prompt, 2, stop_ids=())
        assert engine.stats()["prefix_cached_tokens"] == 0 and engine.stats()["prefix_cache_bytes"] == 0


def test_prefill_pieces_are_aligned_for_every_prompt(tiny_model, monkeypatch):
    """Cold prompts, continued sessions and teacher-forced logits all cut their forwards at the
    multiples of the chunk; a forward of at most EXACT_BATCH tokens stays whole."""
    with load(tiny_model, prefill_chunk=32) as engine:
        fed = []
        forward = engine.model.forward

        def counted(ids, state, **kw):
            fed.append((state.length, state.length + len(ids)))
            return forward(ids, state, **kw)

        monkeypatch.setattr(engine.model, "forward", counted)
        engine.logits(list(range(3, 73)))
        assert fed == [(0, 32), (32, 64), (64, 70)]
        fed.clear()
        session = engine.new_session()
        engine.generate(list(range(3, 43)), 1, stop_ids=(), session=session)
        engine.generate(session.ids + list(range(3, 60)), 1, stop_ids=(), session=session)
        assert fed == [(0, 32), (32, 40), (40, 64), (64, 96), (96, 97)]


@pytest.mark.parametrize("bad", ["lots", -1])
def test_a_bad_budget_is_one_line(tiny_model, bad):
    with pytest.raises(ColibriError, match="size|prefix-cache"):
        load(tiny_model, prefix_cache=bad)
