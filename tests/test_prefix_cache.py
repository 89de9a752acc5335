"""The prefix cache (colibri_core/prefix.py): where a prefill stops, what an entry keeps, eviction
under the budget, spilling to disk and finding entries again after a restart (damaged files never
used), and the engine serving prompts from it with the bits of a cold prefill."""
import importlib.util
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from colibri_core import load
from colibri_core.options import EngineOptions
from colibri_core.errors import ColibriError
from colibri_core.kv import SequenceState
from colibri_core.kv.cache import KVCache, Rows
from colibri_core.layers.sink_attention import SlidingWindow
from colibri_core.prefix import PrefixCache, PrefixCacheWarning
from colibri_core.testing.checks import check_prefix_cache_is_invisible


def _state() -> SequenceState:
    """Rows (a KV cache) and a fixed-size part (a sliding window): both kinds an entry keeps."""
    return SequenceState({"layer.0": KVCache(1, 2), "layer.1": SlidingWindow(3, 2)})


def _feed(state: SequenceState, tokens, capture=None, chunk: int = 64) -> None:
    """A stand-in forward: each token's row is (token, token), fed one by one."""
    for t in tokens:
        row = np.full((1, 1, 2), t, np.float32)
        state["layer.0"].append(row, row)
        state["layer.1"].extend(row[0])
        state.advance(1)
        if capture is not None and state.length % chunk == 0:
            capture.reached(state.length)


def test_an_entry_keeps_the_last_and_power_of_two_boundaries_and_restores_them():
    cache = PrefixCache(budget=1 << 20, chunk=64)
    prompt = list(range(1, 11 * 64 + 24))  # 727 tokens: boundaries 64 … 704
    state = _state()
    capture = cache.capture(state, prompt, None)
    # a prefill stops only where a snapshot is taken: the power-of-two boundaries and the last one
    assert capture.stops(0, len(prompt)) == [64, 128, 256, 512, 704] and capture.stops(128, 600) == [256, 512]
    _feed(state, prompt, capture)
    cache.insert(capture)
    (entry,) = cache.entries.values()
    assert sorted(entry.fixed) == [64, 128, 256, 512, 704] and len(entry.tokens) == 704
    # a prompt sharing 416 tokens is restored at 256 (the last kept boundary within them), as fed
    hit = cache.lookup(prompt[:416] + [99, 98])
    assert hit[1] == 256
    restored, fed = _state(), _state()
    cache.restore(hit, restored)
    _feed(fed, prompt[:256])
    a, b = restored.arrays(), fed.arrays()
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert cache.lookup(prompt)[1] == 704 and cache.lookup(prompt[:704])[1] == 512  # a token is always left to feed
    assert cache.lookup([7] + prompt) is None


def test_rows_only_entries_restore_at_every_boundary():
    cache = PrefixCache(budget=1 << 20, chunk=64)
    state = SequenceState({"layer.0": KVCache(1, 2)})
    prompt = list(range(1, 289))
    capture = cache.capture(state, prompt, None)
    assert capture.stops(0, len(prompt)) == []  # rows are cut to any boundary afterwards: one forward
    rows = np.repeat(np.asarray(prompt, np.float32), 2).reshape(-1, 1, 2)  # token t's row: (t, t)
    state["layer.0"].append(rows, rows)
    state.advance(len(prompt))
    cache.insert(capture)
    assert [cache.lookup(prompt[:n] + [0])[1] for n in (80, 144, 208, 288)] == [64, 128, 192, 256]
    restored = SequenceState({"layer.0": KVCache(1, 2)})
    cache.restore(cache.lookup(prompt[:176] + [0]), restored)
    assert restored.length == 128 and restored.arrays()["layer.0.k"][:, 0, 0].tolist() == prompt[:128]


def _insert(cache: PrefixCache, prompt) -> None:
    state = SequenceState({"layer.0": KVCache(1, 256, capacity=512)})  # its own 512-row buffers
    capture = cache.capture(state, prompt, cache.lookup(prompt))
    for t in prompt:
        row = np.full((1, 1, 256), t, np.float32)
        state["layer.0"].append(row, row)
        state.advance(1)
    cache.insert(capture)


def test_extended_entries_are_replaced_and_the_least_recent_evicted_under_the_budget():
    one = 2 * 512 * 256 * 4  # an entry's bytes: keys and values of 512 rows of 256 floats
    cache = PrefixCache(budget=2 * one, chunk=64)
    _insert(cache, [1] * 160)
    _insert(cache, [1] * 320)  # extends the first: it replaces it
    assert [len(e.tokens) for e in cache.entries.values()] == [320] and cache.nbytes == one
    _insert(cache, [1] * 192)  # a prefix of what is held: nothing new
    assert len(cache.entries) == 1
    _insert(cache, [2] * 160)
    cache.restore(cache.lookup([1] * 480), SequenceState({"layer.0": KVCache(1, 256)}))  # [1] * 320: the most recent
    _insert(cache, [3] * 160)  # over the budget: [2]*160, the least recently used, goes
    assert sorted(int(e.tokens[0]) for e in cache.entries.values()) == [1, 3] and cache.nbytes == 2 * one
    cache.clear()
    assert cache.nbytes == 0 and not cache.entries
    off = PrefixCache(budget=0)
    assert off.capture(SequenceState({"layer.0": KVCache(1, 256)}), [1] * 600, None) is None


def test_rows_alone_are_cut_at_any_block_whatever_the_chunk():
    """A state of rows alone is reusable to within 63 tokens of the shared prefix (the layers' aligned
    block), also with the engine's 256-token chunk; a fixed-size part keeps the chunk's boundaries."""
    cache = PrefixCache(budget=1 << 20, chunk=256)
    state = SequenceState({"layer.0": KVCache(1, 2)})
    prompt = list(range(1, 400))
    capture = cache.capture(state, prompt, None)
    rows = np.repeat(np.asarray(prompt, np.float32), 2).reshape(-1, 1, 2)
    state["layer.0"].append(rows, rows)
    state.advance(len(prompt))
    cache.insert(capture)
    assert [cache.lookup(prompt[:n] + [0])[1] for n in (70, 200, 300, 399)] == [64, 192, 256, 384]


def test_a_token_exact_model_is_restored_at_the_token_and_keeps_the_turns_end():
    """With step 1 (`MoEModel.token_exact`) rows are cut at any token, and the state at a turn's end —
    the prompt and the tokens decoded after it — grows the entry; a state with a fixed-size part, or
    one that is not the capture's, keeps the prompt's entry as it was."""
    cache = PrefixCache(budget=1 << 20, chunk=256, step=1)
    state = SequenceState({"layer.0": KVCache(1, 2)})
    prompt = list(range(1, 100))

    def feed(tokens):
        rows = np.repeat(np.asarray(tokens, np.float32), 2).reshape(-1, 1, 2)  # token t's row: (t, t)
        state["layer.0"].append(rows, rows)
        state.advance(len(tokens))

    capture = cache.capture(state, prompt, None)
    feed(prompt)
    cache.insert(capture)
    assert [cache.lookup(prompt[:n] + [0])[1] for n in (64, 70, 99)] == [64, 70, 99]
    assert cache.lookup(prompt[:63] + [0]) is None  # fewer than BLOCK tokens: not worth a restore
    decoded = [500, 501, 502]  # decoded after the prompt
    for t in decoded:
        feed([t])
    assert not capture.ended(SequenceState({"layer.0": KVCache(1, 2)}), prompt + decoded)  # another state
    assert capture.ended(state, prompt + decoded)
    cache.insert(capture)  # extends the prompt's entry: replaces it
    (entry,) = cache.entries.values()
    assert entry.tokens.tolist() == prompt + decoded
    hit = cache.lookup(prompt + decoded + [7, 8])
    assert hit[1] == 102
    # the first restore of all of it is handed the finished state itself, its new rows written past the entry's
    part = SequenceState({"layer.0": KVCache(1, 2)})
    assert cache.restore((entry, 50), part)[0] is part and part.length == 50  # a part of it: copied
    fresh = SequenceState({"layer.0": KVCache(1, 2)})
    adopted, _ = cache.restore(hit, fresh)
    assert adopted is state and fresh.length == 0
    state = adopted
    feed([7, 8])
    assert entry.rows["layer.0.k"][:, 0, 0].tolist() == prompt + decoded  # the entry's rows as they were
    copied, _ = cache.restore(hit, fresh)  # a second restore: a copy
    assert copied is fresh and copied.arrays()["layer.0.k"][:, 0, 0].tolist() == prompt + decoded
    fixed = PrefixCache(budget=1 << 20, chunk=64, step=1)
    state = _state()
    capture = fixed.capture(state, prompt, None)
    _feed(state, prompt + decoded, capture)
    assert not capture.ended(state, prompt + decoded)  # a fixed-size part: only its snapshots are kept


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
    check_prefix_cache_is_invisible(tiny_model, vocab_size=300)


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
    check_prefix_cache_is_invisible(model_dir, vocab)


def test_only_calls_without_a_session_use_the_cache_and_stats_count_it(tiny_model):
    prompt = list(np.random.default_rng(1).integers(3, 300, 100))
    with load(tiny_model, prefill_chunk=64, prefix_cache="64MB") as engine:
        session = engine.new_session()
        engine.generate(prompt, 2, stop_ids=(), session=session)
        assert engine.stats()["prefix_cache_entries"] == 0
        first = engine.generate(prompt, 2, stop_ids=())
        assert first[0] != 5  # so the next prompt leaves this turn's end after the prompt
        engine.generate(prompt + [5, 6], 2, stop_ids=())
        s = engine.stats()
        # the tiny OLMoE is token_exact: the whole prompt is served, and each turn's end is an entry
        assert (s["prefix_cache_hits"], s["prefix_cached_tokens"], s["prefix_cache_entries"]) == (1, 100, 2)
        assert 0 < s["prefix_cache_bytes"] <= s["prefix_cache_budget"] == 64_000_000
    for off in ({"prefix_cache": 0}, {"no_prefix_cache": True}):  # --prefix-cache 0, --no-prefix-cache
        with load(tiny_model, prefill_chunk=64, **off) as engine:
            engine.generate(prompt, 2, stop_ids=())
            engine.generate(prompt, 2, stop_ids=())
            assert engine.stats()["prefix_cached_tokens"] == 0 and engine.stats()["prefix_cache_bytes"] == 0
    with pytest.raises(ColibriError, match="contradict"):
        EngineOptions(prefix_cache="1GB", no_prefix_cache=True)


def test_a_prefill_is_one_forward(tiny_model, monkeypatch):
    """Cold prompts (cache on or off), continued sessions and teacher-forced logits each run one
    forward (the layers' aligned blocks give the bits of forwards cut at the boundaries): each MoE
    layer reads its experts once. The tiny model's state is rows only: nothing to snapshot."""
    with load(tiny_model, prefill_chunk=64) as engine:
        fed = []
        forward = engine.model.forward

        def counted(ids, state, **kw):
            fed.append((state.length, state.length + len(ids)))
            return forward(ids, state, **kw)

        monkeypatch.setattr(engine.model, "forward", counted)
        engine.logits(list(range(3, 203)))
        assert fed == [(0, 200)]
        fed.clear()
        engine.generate(list(range(3, 203)), 1, stop_ids=())
        engine.generate(list(range(3, 203)) + [5], 1, stop_ids=())  # restored at 200 (token_exact)
        assert fed == [(0, 200), (200, 201)]
        fed.clear()
        session = engine.new_session()
        engine.generate(list(range(3, 43)), 1, stop_ids=(), session=session)
        engine.generate(session.ids + list(range(3, 160)), 1, stop_ids=(), session=session)
        assert fed == [(0, 40), (40, 197)]


def test_a_prefill_chunk_inside_a_block_is_refused(tiny_model):
    with pytest.raises(ColibriError, match="multiple of 64"):
        load(tiny_model, prefill_chunk=32)


@pytest.mark.parametrize("bad", ["lots", -1])
def test_a_bad_budget_is_one_line(tiny_model, bad):
    with pytest.raises(ColibriError, match="size|prefix-cache"):
        load(tiny_model, prefix_cache=bad)


# ---- on disk -------------------------------------------------------------------------------------
def _spilling_cache(tmp_path, disk_budget: int, identity=None) -> PrefixCache:
    """A cache too small to keep any entry in RAM: every one spills at once."""
    return PrefixCache(budget=1, chunk=64, directory=tmp_path, identity=identity or {"model": "a"},
                       disk_budget=disk_budget)


def _fill(cache: PrefixCache, prompt) -> SequenceState:
    """Prefill `prompt` into a fresh `_state()` (restored from the cache where it can be), keeping it."""
    state, hit = _state(), cache.lookup(prompt)
    if hit is not None:
        cache.restore(hit, state)
    capture = cache.capture(state, prompt, hit)
    _feed(state, prompt[state.length:], capture, chunk=64)
    cache.insert(capture)
    return state


def test_evicted_entries_spill_to_disk_and_restore_rows_and_snapshots_from_there(tmp_path):
    cache = _spilling_cache(tmp_path, disk_budget=1 << 20)
    prompt = list(range(1, 300))  # boundaries 64 … 256: snapshots at 64, 128, 256
    _fill(cache, prompt)
    assert not cache.entries and cache.stats()["prefix_cache_disk_bytes"] > 0
    (spilled,) = cache.disk.spilled.values()
    assert spilled.fixed == [64, 128, 256] and spilled.path.suffix == ".coli_prefix"
    for shared, at in ((200, 128), (299, 256)):  # a prompt sharing 200 tokens restores at 128
        restored, fed = _state(), _state()
        hit = cache.lookup(prompt[:shared] + [0])
        assert hit[1] == at
        cache.restore(hit, restored)
        _feed(fed, prompt[:at])
        a, b = restored.arrays(), fed.arrays()
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert cache.stats()["prefix_cache_disk_hits"] == 2
    # a new cache of the same identity finds it; another identity's files are another directory's
    assert cache.lookup(prompt)[1] == _spilling_cache(tmp_path, 1 << 20).lookup(prompt)[1] == 256
    assert _spilling_cache(tmp_path, 1 << 20, identity={"model": "b"}).lookup(prompt) is None


def test_a_disk_hit_taking_all_of_an_entry_reads_its_rows_into_the_state_it_hands_over(tmp_path):
    """A state of rows (a float16 KV cache, indexer-style `Rows`): its spilled entry's rows are read
    straight into a fresh state's buffers, which the restore returns; the state given stays fresh."""
    def fresh() -> SequenceState:
        return SequenceState({"layer.0": KVCache(2, 4, "f16"), "layer.0.index": Rows(3)})

    def fill(state: SequenceState, tokens) -> None:
        t = np.asarray(tokens, np.float32)[:, None, None]  # token t's rows: t + 0.25·(element), exact in float16
        state["layer.0"].append(t + 0.25 * np.arange(8).reshape(2, 4), t - 0.25 * np.arange(8).reshape(2, 4))
        state["layer.0.index"].append(t[:, 0] + np.arange(3))
        state.advance(len(tokens))

    cache = _spilling_cache(tmp_path, disk_budget=1 << 20)
    prompt = list(range(1, 193))
    state = fresh()
    capture = cache.capture(state, prompt, None)
    fill(state, prompt)
    cache.insert(capture)
    want = state.arrays()
    given = fresh()
    hit = cache.lookup(prompt + [0], given)  # all 192 tokens: read into a state of its own
    assert hit[1] == 192 and hit[0].state is not None and given.length == 0
    restored, _ = cache.restore(hit, given)
    assert restored is not given and restored.length == 192
    got = restored.arrays()
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) and got[k].dtype == want[k].dtype
                                             for k in got)
    assert all(np.shares_memory(hit[0].rows[k], got[k]) for k in got)  # the entry views the rows read, once
    fill(restored, [500])  # the state grows past the entry's rows, which stay as read
    assert np.array_equal(hit[0].rows["layer.0.k"], want["layer.0.k"])
    # a hit taking part of it is copied into the state given, as from RAM
    cache = _spilling_cache(tmp_path, disk_budget=1 << 20)
    part = cache.lookup(prompt[:100] + [0], given)
    assert part[1] == 64 and part[0].state is None
    assert cache.restore(part, given)[0] is given and given.length == 64


def test_warm_reads_back_the_most_recently_used_entries_that_fit_in_ram(tmp_path):
    """What a restarted server reads while idle: the entries on disk when the cache started, the most
    recently used first, each counted at twice its file (the room a state's buffers leave to grow)."""
    def fresh() -> SequenceState:
        return SequenceState({"layer.0": KVCache(1, 256)})

    spill = _spilling_cache(tmp_path, disk_budget=1 << 30)
    for t in (1, 2, 3):
        state = fresh()
        capture = spill.capture(state, [t] * 128, None)
        rows = np.full((128, 1, 256), t, np.float32)
        state["layer.0"].append(rows, rows)
        state.advance(128)
        spill.insert(capture)
    one = spill.stats()["prefix_cache_disk_bytes"] / 3  # each file's bytes
    assert spill.lookup([1] * 129)[1] == 128  # [1]*128 is now the most recently used
    cache = PrefixCache(budget=int(4 * one) + 1024, chunk=64, directory=tmp_path, identity={"model": "a"})
    assert cache.warm(fresh()) and cache.warm(fresh()) and not cache.warm(fresh())  # [2]*128 would not fit
    assert [int(e.tokens[0]) for e in cache.entries.values()] == [1, 3]
    assert (cache.stats()["prefix_cache_warmed"], cache.stats()["prefix_cache_disk_hits"]) == (2, 0)
    hit = cache.lookup([3] * 129, fresh())  # a RAM hit, handed the state the rows were read into
    assert hit[1] == 128 and hit[0].state is not None and cache.stats()["prefix_cache_disk_hits"] == 0


def test_the_disk_budget_deletes_the_least_recently_used_first(tmp_path):
    probe = _spilling_cache(tmp_path / "probe", disk_budget=1 << 20)
    _fill(probe, [1] * 130)
    one = probe.stats()["prefix_cache_disk_bytes"]  # one entry's file
    cache = _spilling_cache(tmp_path / "cache", disk_budget=int(2.5 * one))
    for t in (1, 2):
        _fill(cache, [t] * 130)
    assert cache.lookup([1] * 131)[1] == 128  # a hit: [1]*… is now the more recent
    _fill(cache, [3] * 130)  # over the budget: [2]*…, the least recently used, is deleted
    files = list((tmp_path / "cache").glob("*/*.coli_prefix"))
    assert len(files) == 2 and sum(f.stat().st_size for f in files) <= 2.5 * one
    assert sorted(int(s.tokens[0]) for s in cache.disk.spilled.values()) == [1, 3]
    _fill(cache, [1] * 200)  # extends [1]*128: that file goes once this one is written
    assert sorted((int(s.tokens[0]), len(s.tokens)) for s in cache.disk.spilled.values()) == [(1, 192), (3, 128)]
    cache.clear()
    assert not list((tmp_path / "cache").glob("*/*.coli_prefix"))


@pytest.fixture
def model_copy(tiny_model, tmp_path) -> Path:
    """The tiny model in a directory of its own: its spilled entries are this test's alone."""
    return Path(shutil.copytree(tiny_model, tmp_path / "model", ignore=shutil.ignore_patterns(".prefix_cache")))


def test_a_restarted_engine_serves_the_extension_from_disk_with_the_bits_of_a_cold_prefill(model_copy):
    rng = np.random.default_rng(5)
    prompt = rng.integers(3, 300, 200).tolist()
    with load(model_copy, prefill_chunk=64) as engine:
        answer = engine.generate(prompt, 4, stop_ids=())
    extension = prompt + answer + rng.integers(3, 300, 90).tolist()  # the conversation's next turn
    with load(model_copy, prefill_chunk=64) as engine:
        warm = engine.generate(extension, 8, stop_ids=())
        s = engine.stats()  # the turn's end, the answer's last token never fed (the tiny OLMoE is token_exact)
        assert s["prefix_cached_tokens"] == 203 and s["prefix_cache_disk_hits"] == 1
    with load(model_copy, prefill_chunk=64, prefix_cache=0) as engine:
        assert engine.generate(extension, 8, stop_ids=()) == warm


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x20  # in the arrays: only the record's checksum tells
    path.write_bytes(bytes(data))


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "another model's"])
def test_a_damaged_spilled_entry_is_deleted_with_one_warning_and_never_used(model_copy, damage):
    prompt = np.random.default_rng(6).integers(3, 300, 200).tolist() + [7]
    with load(model_copy, prefill_chunk=64) as engine:  # nothing on disk yet: cold; its entry spills at close
        cold = engine.generate(prompt, 6, stop_ids=())
        ours = engine.prefix_cache.disk.dir
    (path,) = ours.glob("*.coli_prefix")
    if damage == "another model's":  # where ours was, the file of an engine with another prefill chunk
        with load(model_copy, prefill_chunk=128) as engine:
            engine.generate(prompt, 2, stop_ids=())
            theirs = engine.prefix_cache.disk.dir
        (foreign,) = theirs.glob("*.coli_prefix")
        foreign.rename(path)
    else:
        {"flipped byte": _flip, "truncated": _cut}[damage](path)
    with pytest.warns(PrefixCacheWarning) as caught:
        with load(model_copy, prefill_chunk=64) as engine:
            assert engine.generate(prompt, 6, stop_ids=()) == cold
            assert engine.stats()["prefix_cached_tokens"] == 0
            assert not path.exists()
    assert len(caught) == 1 and "deleted it" in str(caught[0].message)
