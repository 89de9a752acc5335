"""The tiered expert store: placement never changes an output; history, hot-store, prefetch,
O_DIRECT, mirror and policies; faults give a warning or a clear error, never a wrong token."""
import gc
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import warnings
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from colibri_core import kernels, load, plugins
from colibri_core.errors import ColibriError
from colibri_core.kernels.decoder import MoELayer
from colibri_core.store import io
from colibri_core.store.store import Lookahead
from colibri_core.store.usage import USAGE_FILE, ColibriWarning, hot_set, pin_value

from conftest import colibri, resident_baseline, store_model

PROMPT = list(range(3, 23))  # 20 tokens: prefill routes a batch union per layer
N_NEW = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """4 MoE layers × 16 experts, top-2: enough experts for eviction and prediction to matter."""
    return store_model(tmp_path_factory.mktemp("store"))


@pytest.fixture(scope="module")
def baseline(model):
    """Logits and greedy tokens with every expert resident, no prefetch, no history."""
    return resident_baseline(model, PROMPT, N_NEW, slots=16)


def copy_model(model: Path, dst: Path) -> Path:
    shutil.copytree(model, dst)
    return dst


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def check_same(engine, baseline, turns: int = 2) -> None:
    """Bit-identical logits and identical tokens, over `turns` turns (the hot-store is revised between)."""
    logits, tokens = baseline
    for _ in range(turns):
        got = engine.logits(PROMPT)
        assert got.dtype == np.float32 and np.array_equal(got, logits)
        assert engine.generate(PROMPT, N_NEW, stop_ids=()) == tokens


# ---- placement invariance: every axis ------------------------------------------------------------

PLACEMENTS = {
    "1-slot": dict(cache_slots=1),
    "3-slots": dict(cache_slots=3),
    "all-resident": dict(cache_slots=16),
    "prefetch-off-1-slot": dict(cache_slots=1, prefetch=False),
    "prefetch-on-3-slots": dict(cache_slots=3, prefetch=True),
    "direct": dict(cache_slots=2, direct=True),
    "lru": dict(cache_slots=2, policy="lru"),
    "lfu": dict(cache_slots=2, policy="lfu"),
    "lfu_aging": dict(cache_slots=2, policy="lfu_aging"),
    "io-1-thread": dict(cache_slots=2, io_threads=1),
    "io-2-threads": dict(cache_slots=2, io_threads=2),
    "ram-budget": dict(ram="budget-30%"),
}


@pytest.mark.parametrize("name", PLACEMENTS)
def test_placement_invariance(model, baseline, name):
    kw = dict(PLACEMENTS[name])
    if kw.get("ram") == "budget-30%":
        with load(model, cache_slots=1, usage=False) as e:
            c = e.container
            kw["ram"] = e.resident_bytes + int(0.3 * len(c.moe_layers) * c.n_experts * c.expert_nbytes)
    with load(model, usage=False, **kw) as e:
        check_same(e, baseline)
        s = e.stats()
    if kw.get("cache_slots", 16) < 16:
        assert s["expert_misses"] > 0  # the placement really streamed experts


def test_a_layer_holding_all_its_experts_runs_in_one_call(model, baseline, monkeypatch):
    """Every expert read: each MoE layer is one C call (the store's resident_table; OLMoE's softmax
    router inside it, and its attention: the whole decoder layer, kernels.decoder.MoELayer), with
    the same bits as the per-group path a 1-slot cache takes, and every lookup a hit."""
    calls = []
    for name in ("moe_block", "moe_block_softmax"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, real=real, **kw: calls.append(1) or real(*a, **kw))
    real_layer = MoELayer.__call__
    monkeypatch.setattr(MoELayer, "__call__", lambda *a, **kw: calls.append(1) or real_layer(*a, **kw))
    with load(model, cache_slots=16, usage=False) as e:
        c = e.container
        for layer in c.moe_layers:
            for expert in range(c.n_experts):
                e.store.get(layer, expert)
        before = e.stats()
        check_same(e, baseline)
        s = e.stats()
    assert len(calls) >= len(c.moe_layers)
    assert s["expert_misses"] == before["expert_misses"] and s["expert_hits"] > before["expert_hits"]
    calls.clear()
    with load(model, cache_slots=1, usage=False) as e:
        check_same(e, baseline)
        assert e.store.resident_table(c.moe_layers[0]) is None
    assert not calls


def test_pinning_on_gives_the_same_outputs(model, baseline, tmp_path):
    """The hot-store pins after the first turn; outputs stay identical across revisions."""
    history = tmp_path / "usage.json"
    with load(model, cache_slots=1, pin_gb=12 * 8192 / 1e9, usage=history) as e:
        assert e.stats()["pinned_experts"] == 0  # no history yet
        check_same(e, baseline, turns=3)
        s = e.stats()
        assert 0 < s["pinned_experts"] <= s["pin_capacity"]
    with load(model, cache_slots=1, pin_gb=12 * 8192 / 1e9, usage=history) as e:
        assert e.stats()["pinned_experts"] > 0  # pinned at start from the saved history
        check_same(e, baseline)


def test_pinned_experts_are_read_in_the_background_and_once(model, baseline, tmp_path):
    """At load the hot-store starts one read per I/O thread and queues the rest (hottest first);
    a layer needing a queued one reads it at once (a miss); `warm_up` reads the rest; each once."""
    history = tmp_path / "usage.json"
    pin = dict(cache_slots=1, pin_gb=12 * 8192 / 1e9, usage=history)
    with load(model, **pin) as e:
        check_same(e, baseline, turns=1)
    with load(model, io_threads=1, **pin) as e:
        s = e.stats()
        assert s["pinned_experts"] == 12 and s["reads"] == 1 and s["pinned_queued"] == 11
        placement = e.store.placement()  # what the server's snapshot shows: queued experts too
        assert placement.slots == 1 and sum(map(len, placement.pinned.values())) == 12
        assert set(placement.pinned) == set(placement.cached) == set(e.container.moe_layers)
        layer, expert = e.store._pin_queue[-1]  # the coldest queued
        e.store.get(layer, expert)
        assert e.stats()["expert_misses"] == 1 and e.store.pinned[layer][expert].tensors is not None
        seconds, n = e.store.warm_up()
        s = e.stats()
        assert n == 11 and seconds >= 0 and s["pinned_queued"] == 0 and s["reads"] == 12
        assert all(entry.tensors is not None for p in e.store.pinned.values() for entry in p.values())
        check_same(e, baseline)
    with load(model, io_threads=2, **pin) as e:  # no warm-up: queued experts read on demand or in the background
        check_same(e, baseline)


def test_a_read_in_flight_is_computed_before_a_deferred_read_needs_its_slot(model, monkeypatch):
    """One slot holding a lookahead read still in flight that the layer needs, and a miss with a
    lower id: the read in flight is yielded first, then its slot goes to the miss."""
    with load(model, cache_slots=1, usage=False, prefetch=False) as e:
        s = e.store
        s.config.transient = 0  # no reads past the slots (as when a prefill's batch union exceeds them)
        layer = next(iter(s.layer_index))
        s._insert(layer, 7, prefetched=True)  # as the lookahead does
        monkeypatch.setattr(s.pool, "done", lambda read: False)  # not finished when the layer asks
        got = [sorted(group) for group in s.experts(layer, np.array([[0, 7]]))]
    assert got == [[7], [0]]


def test_reads_past_the_slots_start_at_once(model, baseline, monkeypatch):
    """A cache of fewer slots than top-k (1 of 2 here): the layer's other misses are read into buffers
    of their own, every read started before the first is waited for — not one at a time as computed
    experts free their slots — and dropped once computed; no output changes."""
    with load(model, cache_slots=1, usage=False, prefetch=False) as e:
        s = e.store
        assert s.config.transient == 1
        layer = next(iter(s.layer_index))
        events = []
        submit, wait = s.pool.submit, s.pool.wait
        monkeypatch.setattr(s.pool, "submit", lambda *a, **kw: events.append("submit") or submit(*a, **kw))
        monkeypatch.setattr(s.pool, "wait", lambda read: events.append("wait") or wait(read))
        got = [sorted(group) for group in s.experts(layer, np.array([[0, 7]]))]
        assert events[:3] == ["submit", "submit", "wait"] and sorted(sum(got, [])) == [0, 7]
        assert list(s.cache[layer]) == [0]  # the transient read is not cached
        monkeypatch.undo()
        check_same(e, baseline)


def test_everything_at_once(model, baseline, tmp_path):
    mirror = copy_model(model, tmp_path / "mirror")
    history = tmp_path / "usage.json"
    with load(model, cache_slots=1, pin_gb=0.0001, policy="lfu", direct=True, mirror=mirror, usage=history,
              io_threads=3) as e:
        e.store.primary_share = 0.5  # half the experts from each copy, whatever the measured bandwidths
        check_same(e, baseline, turns=3)
        s = e.stats()
    assert s["mirror_reads"] > 0 and s["mirror_in_use"] and s["pinned_experts"] > 0


@pytest.mark.parametrize("threads", ["1", "2"])
def test_kernel_thread_count_invariance(model, baseline, threads, tmp_path):
    """COLIBRI_THREADS (the kernels' thread count) changes nothing: a fresh process per count."""
    code = ("import sys, numpy as np; from colibri_core import load\n"
            f"e = load(sys.argv[1], cache_slots=2, usage=False)\n"
            f"np.save(sys.argv[2], e.logits({PROMPT}))\n"
            f"print(e.generate({PROMPT}, {N_NEW}, stop_ids=()))\n")
    out = tmp_path / "logits.npy"
    r = subprocess.run([sys.executable, "-c", code, str(model), str(out)], capture_output=True, text=True,
                       env={**os.environ, "COLIBRI_THREADS": threads})
    assert r.returncode == 0, r.stderr
    assert np.array_equal(np.load(out), baseline[0])
    assert r.stdout.strip() == str(baseline[1])


# ---- counters and prefetch -----------------------------------------------------------------------

def test_counters_and_lookahead_prefetch(model):
    with load(model, cache_slots=4, usage=False) as e:
        e.generate(PROMPT, N_NEW, stop_ids=())
        s = e.stats()
    for key in ("expert_hits", "expert_misses", "bytes_read", "prefetch_issued", "prefetch_used",
                "prefetch_recall", "io_stall_seconds", "layer_hit_rate"):
        assert key in s
    assert s["prefetch_issued"] > 0 and 0 < s["prefetch_used"] <= s["prefetch_issued"]
    assert 0 < s["prefetch_recall"] <= 1
    assert s["bytes_read"] == s["reads"] * e.container.expert_nbytes
    assert set(s["layer_hit_rate"]) == set(s["layer_io_stall_seconds"]) == set(e.container.moe_layers)
    assert sum(s["layer_io_stall_seconds"].values()) == pytest.approx(s["io_stall_seconds"])
    with load(model, cache_slots=4, usage=False, prefetch=False) as e:
        e.generate(PROMPT, N_NEW, stop_ids=())
        assert e.stats()["prefetch_issued"] == 0


def test_lookahead_stops_reading_a_rank_whose_guesses_are_wrong_and_starts_again(model):
    """A rank whose guesses for a layer the cache lacked were lately mostly wrong is predicted, scored,
    not read (prefetch_skipped); its guesses for another layer still are; once its guesses come right
    again, it is read again."""
    with load(model, cache_slots=4, usage=False) as e:
        s = e.store
        first, second, third = list(s.layer_index)[:3]
        guess = {"ids": None}

        def predict(layer):  # the store is told which layer the guess is for, and asks for it
            return Lookahead(layer, lambda: np.array([guess["ids"]]))

        def step(guessed, needed):  # layer `first` guesses `second`'s experts; then `second` runs
            guess["ids"] = guessed
            for layer, ids in ((first, [0, 1]), (second, needed)):
                for _ in s.experts(layer, np.array([ids]), predict=[predict(second)] if layer == first else ()):
                    pass

        c = s.counters
        for i in range(6):  # wrong every time: both ranks stop after their first wrong guess
            step([2 + 2 * i, 3 + 2 * i], [14, 15])
        assert c.prefetch_issued == 2 and c.prefetch_skipped == 10
        guess["ids"] = [4, 5]  # the same ranks guessing another layer's experts: still read
        for _ in s.experts(second, np.array([[14, 15]]), predict=[predict(third)]):
            pass
        assert c.prefetch_issued == 4 and c.prefetch_skipped == 10
        for i in range(12):  # right every time: the ranks earn their reads back
            step([8 + 2 * (i % 3), 9 + 2 * (i % 3)], [8 + 2 * (i % 3), 9 + 2 * (i % 3)])
        assert c.prefetch_issued > 2


class Shards:
    """Two remote shards as `ExpertSource` drives them (remote.client.RemoteExperts's methods, no Ray):
    shard 0 holds experts 0-7 of every layer and answers with the local kernels' slots, shard 1 holds
    8-15 and fails every call."""

    cfg = SimpleNamespace(fill_local=True)

    def __init__(self, container):
        self.container, self.sent, self.calls = container, [], None

    def serving(self, layer):  # shard 1 is down once it failed: shard 0's experts
        return frozenset(range(8))

    def watch(self, layer, guess):
        return guess

    def dispatch(self, layer, x, ids, resident, ffn):
        experts = frozenset(np.unique(ids).tolist()) - resident
        self.sent.append(experts)
        self.calls = (x, ids, ffn)
        return SimpleNamespace(layer=layer, experts=experts)

    def collect(self, sent, outs):
        x, ids, ffn = self.calls
        answered = {e for e in sent.experts if e < 8}
        ffn(outs, x, ids, {e: self.container.read_expert(sent.layer, e) for e in answered})
        return sent.experts - answered

    def stats(self):
        return {"remote_shards": 2}


def test_the_source_computes_a_failed_shards_experts_here_within_the_call(model):
    """ExpertSource in front of remote shards: the experts resident here are computed here, the
    others sent to their shard; a failed shard's experts are read and computed here in the same call,
    so every slot is the local block's; the lookahead reads nothing a live shard serves; free cache
    slots then take what a shard computed (`fill`), never what this layer computed here."""
    from colibri_core.experts import ExpertSource
    from colibri_core.layers.moe import ExpertFFN

    with load(model, cache_slots=16, usage=False) as e:
        c = e.container
        layer, nxt = c.moe_layers[:2]
        for expert in (3, 12):
            e.store.get(layer, expert)  # resident here: never sent
        shards = Shards(c)
        source = ExpertSource(e.store, shards)
        rng = np.random.default_rng(4)
        x = rng.normal(0, 1, (6, c.hidden)).astype(np.float32)
        ids = np.stack([rng.permutation(16)[:2] for _ in range(6)])
        ids[0] = [3, 12]
        outs = np.zeros((6, 2, c.hidden), np.float32)
        ffn = ExpertFFN()
        guess = np.array([[0, 8], [1, 9]])  # the next layer's guess: 0 and 1 on the live shard
        asked = []
        assert source.compute(layer, outs, x, ids, ffn, [(nxt, lambda: guess)], lambda: asked.append(1) or "shared") \
            == "shared" and asked == [1]
        want = np.zeros_like(outs)
        ffn(want, x, ids, {expert: c.read_expert(layer, expert) for expert in np.unique(ids).tolist()})
        assert np.array_equal(outs, want)
        sent = shards.sent[0]
        assert {3, 12}.isdisjoint(sent) and sent == set(np.unique(ids).tolist()) - {3, 12}
        placement = e.store.placement()
        assert placement.cached[nxt] == {8, 9}  # the lookahead read none of the live shard's experts
        failed = {expert for expert in sent if expert >= 8}
        assert failed <= placement.cached[layer]  # read here once their shard failed
        assert placement.cached[layer] == {3, 12} | sent and source.local_fills == len(sent - failed)
        assert source.stats()["remote_local_fills"] == source.local_fills


def test_batch_union_reads_each_expert_once(model):
    """A prefill of many tokens reads each needed expert of a layer once, even with a 1-slot cache
    that cannot hold them together (reads are issued as slots free up, never twice)."""
    with load(model, cache_slots=1, usage=False, prefetch=False) as e:
        e.logits(PROMPT)
        s = e.stats()
    assert s["expert_hits"] == 0 and s["reads"] == s["expert_misses"]
    assert s["expert_misses"] <= len(e.container.moe_layers) * e.container.n_experts


def test_run_stats_prints_every_counter(tiny_model, tmp_path):
    m = copy_model(tiny_model, tmp_path / "m")
    r = colibri("run", "--model", m, "--cache-slots", "2", "--max-tokens", "4", "--stats", "--policy", "lfu", "hi")
    assert r.returncode == 0, r.stderr
    for word in ("expert_hits", "expert_misses", "bytes_read", "prefetch_issued", "prefetch_used",
                 "prefetch_skipped", "prefetch_recall", "io_stall_seconds", "per-layer hit rate",
                 "per-layer I/O stall", "(lfu)"):
        assert word in r.stderr


# ---- routing history and hot-store ---------------------------------------------------------------

def test_usage_file_is_written_atomically_with_a_fingerprint(model, tmp_path):
    m = copy_model(model, tmp_path / "m")
    with load(m, cache_slots=2) as e:
        e.generate(PROMPT, 4, stop_ids=())
        e.generate(PROMPT[:5], 3, stop_ids=())
    d = json.loads((m / USAGE_FILE).read_text())
    assert d["format"] == "colibri-usage" and d["version"] == 1 and d["fingerprint"].startswith("sha256:")
    assert d["turns"] == 2 and d["tokens"] == (20 + 3) + (5 + 2)  # prompt + decoded tokens fed
    assert [sum(row) for row in d["counts"]] == [2 * d["tokens"]] * 4  # top-2 in every MoE layer
    assert sorted(p.name for p in m.iterdir() if p.name.startswith(".coli")) == [USAGE_FILE]  # no temporaries
    with load(m, cache_slots=2) as e:  # the next session continues the history
        assert e.stats()["history_tokens"] == d["tokens"]


@pytest.mark.parametrize("usage", [None, 0, 1.0])
def test_usage_other_than_a_switch_or_a_path_is_one_clear_error(model, tmp_path, monkeypatch, usage):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ColibriError, match="usage must be True, False or a file path"):
        load(model, cache_slots=2, usage=usage)
    assert list(tmp_path.iterdir()) == []  # nothing written (usage=None once wrote ./None)


@pytest.mark.parametrize("damage", ["garbage", "flipped-count", "flipped-trace", "trace-out-of-range", "foreign", "version"])
def test_bad_usage_file_is_ignored_with_one_warning(model, baseline, tmp_path, damage):
    m = copy_model(model, tmp_path / "m")
    with load(m, cache_slots=2) as e:
        e.generate(PROMPT, 2, stop_ids=())
    path = m / USAGE_FILE
    d = json.loads(path.read_text())
    if damage == "garbage":
        path.write_bytes(b"\x00\x01 not json")
    elif damage == "flipped-count":
        d["counts"][0][0] += 1
        path.write_text(json.dumps(d))
    elif damage == "flipped-trace":
        d["trace"][0][0][0] ^= 1
        path.write_text(json.dumps(d))
    elif damage == "trace-out-of-range":  # a valid checksum over an expert the model does not have
        d["trace"][0][0][0] = 16
        d["trace_crc32"] = zlib.crc32(json.dumps(d["trace"], separators=(",", ":")).encode())
        path.write_text(json.dumps(d))
    elif damage == "foreign":
        d["fingerprint"] = "sha256:" + "0" * 64
        path.write_text(json.dumps(d))
    else:
        d["version"] = 99
        path.write_text(json.dumps(d))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with load(m, cache_slots=2, pin_gb=0.001) as e:
            assert e.stats()["history_tokens"] == 0 and e.stats()["pinned_experts"] == 0
            check_same(e, baseline, turns=1)
    msgs = [str(w.message) for w in caught if issubclass(w.category, ColibriWarning)]
    assert len(msgs) == 1 and "ignoring routing history" in msgs[0], msgs
    assert json.loads(path.read_text())["fingerprint"] != "sha256:" + "0" * 64  # replaced by a good one


def test_hot_store_pins_automatically_with_enough_history(model, tmp_path):
    m = copy_model(model, tmp_path / "m")
    with load(m, cache_slots=16) as e:
        c = e.container
        budget = e.resident_bytes + int(0.5 * len(c.moe_layers) * c.n_experts * c.expert_nbytes)
    with load(m, ram=budget) as e:
        assert e.stats()["pin_capacity"] == 0  # no history: the whole expert budget is cache
        slots_before = e.stats()["cache_slots_per_layer"]
        for i in range(3):
            e.generate([i + 3, *PROMPT], 4, stop_ids=())
    with load(m, ram=budget) as e:
        s = e.stats()
    assert s["history_tokens"] >= 32 and s["pin_capacity"] > 0 and s["pinned_experts"] > 0 and s["pin_share"] > 0
    assert s["cache_slots_per_layer"] < slots_before
    r = colibri("plan", "--model", m, "--ram", str(budget), "--context", "0", "--disk-bw", "1GB", "--mem-bw", "1GB", "--json")
    assert r.returncode == 0, r.stderr
    split = json.loads(r.stdout)["split"]  # the plan splits as the engine did, with the share the history chose
    assert (split["pinned_experts"], split["cache_slots"], split["pin_share"]) == (s["pin_capacity"], s["cache_slots_per_layer"], s["pin_share"])
    assert s["cache_bytes"] + s["pin_capacity"] * c.expert_nbytes + e.resident_bytes <= budget


def test_default_hot_store_leaves_the_cache_top_k_slots_per_layer():
    """With history, PIN_SHARE of the expert budget is pinned, but never so much that a layer's
    cache holds fewer than top_k experts (a token's unpinned experts would be read one by one);
    an explicit --pin-gb is taken as given."""
    from colibri_core.planning import split_budget
    from colibri_core.store.usage import PIN_SHARE

    nbytes, layers, E, k = 100, 16, 64, 8
    fit = 16 * 16  # a quarter of the experts
    s = split_budget(fit * nbytes, 0, 0, nbytes, layers, E, pin_share=PIN_SHARE, top_k=k)
    assert s.cache_slots == k and s.pinned_experts == fit - layers * k  # the floor binds: 128 pinned, not 192
    s = split_budget(2 * fit * nbytes, 0, 0, nbytes, layers, E, pin_share=PIN_SHARE, top_k=k)
    assert s.pinned_experts == int(2 * fit * PIN_SHARE) and s.cache_slots >= k  # the share binds
    s = split_budget(fit * nbytes, 0, 0, nbytes, layers, E, pin_bytes=192 * nbytes, pin_share=PIN_SHARE, top_k=k)
    assert s.pinned_experts == 192 and s.cache_slots == 3 and s.transient_experts == 5  # 4 slots less the reads past them
    s = split_budget(layers * 4 * nbytes, 0, 0, nbytes, layers, E, pin_share=PIN_SHARE, top_k=k)
    assert s.pinned_experts == 0 and s.cache_slots == 3  # too small for the floor: all cache, less
    assert s.transient_experts == k - 3  # the reads past a layer's slots (test_reads_past_the_slots_…)


def _history(model, path, route, tokens: int):
    """A routing history of `tokens` tokens, each routed in every MoE layer to `route(rng, t)`."""
    from colibri_core.container import Container
    from colibri_core.store.usage import UsageHistory

    history, rng = UsageHistory(Container(model), path), np.random.default_rng(0)
    for layer in range(len(history.moe_layers)):
        history.record(layer, np.array([route(rng, t) for t in range(tokens)]))
    return history


def test_the_history_chooses_the_hot_store_share_that_its_trace_misses_least_with(model, tmp_path):
    """Lasting skew (each layer's experts Zipf-popular, token after token) is pinned at the largest
    share. Routing spread evenly and then, for the traced last 256 tokens, kept to experts 8-13
    gets less: a hot set chosen from the routing before the trace predicts the traced tokens only
    by chance, and pinning takes the cache slots they need (a hot set chosen from the traced tokens
    themselves would be 8-13 and score the largest share best). Below MIN_HISTORY_TOKENS nothing is
    pinned; a history written before traces gets the default share."""
    from colibri_core.store.usage import PIN_SHARE, TRACE_TOKENS

    E, top_k = 16, 2  # the fixture's experts per layer and top-k; budgets of 8 and 12 experts a layer
    zipf = 1 / np.arange(1, E + 1)
    lasting = _history(model, tmp_path / "a", lambda rng, t: rng.choice(E, top_k, replace=False, p=zipf / zipf.sum()), 600)
    assert lasting.pin_share(32, top_k) == lasting.pin_share(48, top_k) == PIN_SHARE
    lately = _history(model, tmp_path / "b", lambda rng, t: rng.choice(E, top_k, replace=False) if t < 600 - TRACE_TOKENS
                      else 8 + rng.choice(6, top_k, replace=False), 600)
    assert lately.pin_share(32, top_k) < PIN_SHARE and lately.pin_share(48, top_k) < PIN_SHARE
    assert _history(model, tmp_path / "c", lambda rng, t: [t % E, (t + 1) % E], 31).pin_share(32, top_k) == 0.0
    lasting.past_trace = lasting.session_trace = [[] for _ in lasting.moe_layers]  # as read from an older file
    assert lasting.pin_share(32, top_k) == PIN_SHARE


def test_reading_an_expert_in_is_not_routing(model, tmp_path):
    """`store.get` (what tools call to read every expert in) leaves the routing history alone."""
    with load(model, cache_slots=16, usage=tmp_path / "usage.json") as e:
        e.store.get(e.container.moe_layers[0], 5)
        assert e.store.usage.tokens == 0 and not e.store.usage.counts.any() and not any(e.store.usage.trace)


def test_the_trace_is_saved_and_read_back_bounded(model, tmp_path):
    """The history file keeps the last TRACE_TOKENS tokens' routing per MoE layer, checksummed; a
    damaged trace makes the whole file ignored (test_bad_usage_file_is_ignored_with_one_warning)."""
    from colibri_core.container import Container
    from colibri_core.store.usage import TRACE_TOKENS, UsageHistory

    path = tmp_path / "usage.json"
    history = _history(model, path, lambda rng, t: [t % 16, (t + 3) % 16], TRACE_TOKENS + 10)
    assert history.save()
    again = UsageHistory(Container(model), path)
    assert again.trace == history.trace and len(again.trace[0]) == TRACE_TOKENS
    assert again.trace[0][0] == [10 % 16, 13 % 16]  # the first 10 tokens fell out


def test_pin_value_pins_where_the_cache_cannot_hold_a_layers_routing():
    counts = np.array([[10, 9, 5, 5, 0, 0], [30, 0, 0, 0, 0, 20]])
    # layer 1 routes to 2 experts, which a 2-slot cache holds: layer 0's wider routing is pinned first
    assert hot_set(counts, 2) == {(1, 0), (1, 5)}
    assert hot_set(pin_value(counts, 2), 2) == {(0, 0), (0, 1)}
    assert hot_set(pin_value(counts, 2), 3) == {(0, 0), (0, 1), (1, 0)}  # capacity left: the most routed
    assert hot_set(pin_value(counts, 0), 2) == hot_set(counts, 2)  # no cache: by counts alone
    assert ((pin_value(counts, 2) > 0) == (counts > 0)).all()  # never-routed experts are worth nothing


def test_hot_set_hysteresis():
    counts = np.array([[10, 9, 1, 0], [8, 0, 0, 7]])
    assert hot_set(counts, 3) == {(0, 0), (0, 1), (1, 0)}
    assert hot_set(counts, 0) == set()
    assert hot_set(np.zeros((2, 4), int), 3) == set()  # never-routed experts are never pinned
    current = {(0, 0), (0, 1), (1, 0)}
    counts[1, 3] = 11  # a newcomer a bit hotter than the coldest pinned (8): no swap
    assert hot_set(counts, 3, current) == current
    counts[1, 3] = 30  # far hotter: it replaces the coldest
    assert hot_set(counts, 3, current) == {(0, 0), (0, 1), (1, 3)}


# ---- policies as plugins -------------------------------------------------------------------------

def policy_plugin(name, factory, *more):
    import types

    from colibri_core.hookspecs import hookimpl

    @hookimpl
    def colibri_register_cache_policies(register):
        register(name, factory, "a test policy")
        for args in more:
            register(*args)

    module = types.ModuleType(f"colibri_policy_{name.replace(' ', '_')}")
    module.colibri_register_cache_policies = colibri_register_cache_policies
    return module


def test_core_policies_are_registered_through_the_hook():
    reg = plugins.Registry()
    policies = reg.cache_policies()
    assert {"lru", "lfu"} <= set(policies) and policies["lru"].plugin == "colibri"
    with pytest.raises(ColibriError, match="unknown cache policy 'nope': choose one of lfu, lfu_aging, lru"):
        reg.cache_policy("nope")


@pytest.mark.parametrize("name, factory, fragment", [
    ("Bad Name", lambda **kw: None, "lower_snake_case"),
    ("fine", "not callable", "not callable"),
    ("lru", lambda **kw: None, "already registered by colibri"),
])
def test_bad_policy_registrations_name_the_plugin(name, factory, fragment):
    reg = plugins.Registry()
    reg.add("pol", "colibri-pol", "1.2", policy_plugin(name, factory))
    with pytest.raises(ColibriError, match=f"plugin colibri-pol 1.2.*{fragment}"):
        reg.cache_policies()


def test_a_plugin_policy_runs_and_a_bad_victim_is_refused(model, baseline, monkeypatch):
    from colibri_core.store.policies import CachePolicy

    class MRU(CachePolicy):  # most recently used: a deliberately different placement
        def __init__(self, slots, n_experts):
            super().__init__(slots, n_experts)
            self.order = []

        def on_hit(self, e):
            self.order = [x for x in self.order if x != e] + [e]

        on_insert = on_hit

        def victim(self, candidates):
            return max(candidates, key=lambda e: self.order.index(e) if e in self.order else -1)

    class Wrong(CachePolicy):
        def victim(self, candidates):
            return 999

    reg = plugins.Registry()
    reg.load_entry_points()
    reg.add("pol", "colibri-pol", "1.0", policy_plugin("mru", MRU, ("wrong", Wrong)))
    monkeypatch.setattr(plugins, "_registry", reg)
    with load(model, cache_slots=2, policy="mru", usage=False) as e:
        check_same(e, baseline, turns=1)
        assert e.stats()["policy"] == "mru"
    with load(model, cache_slots=1, policy="wrong", usage=False) as e:
        with pytest.raises(ColibriError, match="cache policy wrong \\(colibri-pol\\) chose expert 999"):
            e.generate(PROMPT, 2, stop_ids=())


# ---- O_DIRECT ------------------------------------------------------------------------------------

def test_direct_io_on_disk(model, baseline, tmp_path):
    """O_DIRECT where the filesystem allows it; where it refuses, the one-line fallback warning."""
    m = copy_model(model, tmp_path / "m")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with load(m, cache_slots=2, direct=True, usage=False) as e:
            check_same(e, baseline, turns=1)
            direct = e.stats()["direct_io"]
    refusals = [str(w.message) for w in caught if "O_DIRECT refused" in str(w.message)]
    assert refusals == ([] if direct else refusals[:1]) and (direct or len(refusals) == 1)


@pytest.mark.parametrize("where", ["tmpfs", "refusing-filesystem"])
def test_direct_io_refused_falls_back_with_a_message(model, baseline, tmp_path, monkeypatch, where):
    """Where the filesystem refuses O_DIRECT: one warning, page-cache reads, the same outputs.

    tmpfs refused O_DIRECT before Linux 6.6 and accepts it since; where this machine's /dev/shm
    accepts it, the refusal is exercised through a filesystem that answers EINVAL, as old tmpfs does.
    """
    shm = Path("/dev/shm")
    if where == "tmpfs":
        if not shm.is_dir():
            pytest.skip(reason="no /dev/shm on this machine")
        m = shm / f"colibri-test-{os.getpid()}"
        shutil.rmtree(m, ignore_errors=True)
        copy_model(model, m)
        fd, err = io._open_direct(str(m / "experts" / "layer-000.bin"), 4096)
        if fd >= 0:
            io.close_fd(fd)
        if err == 0:
            shutil.rmtree(m)
            pytest.skip(reason=f"this kernel's tmpfs accepts O_DIRECT (Linux {os.uname().release}); the refusal is "
                        f"tested by the refusing-filesystem case")
    else:
        m = copy_model(model, tmp_path / "m")
        import errno

        monkeypatch.setattr(io, "_open_direct", lambda path, probe: (-errno.EINVAL, errno.EINVAL))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with load(m, cache_slots=2, direct=True, usage=False) as e:
                check_same(e, baseline, turns=1)
                assert e.stats()["direct_io"] is False
        msgs = [str(w.message) for w in caught if issubclass(w.category, ColibriWarning)]
        assert len(msgs) == 1 and "O_DIRECT refused" in msgs[0] and "page cache" in msgs[0]
    finally:
        shutil.rmtree(m, ignore_errors=True)


def test_the_default_read_path_is_o_direct_where_experts_are_streamed(model, baseline, tmp_path, monkeypatch):
    """Without --direct/--no-direct: O_DIRECT where experts are read while decoding (fewer slots than
    experts), the page cache where every expert is cached; a refusal of the default is silent (the
    page cache serves), and --no-direct is page-cache reads. Outputs identical throughout."""
    import errno

    m = copy_model(model, tmp_path / "m")
    accepts = io._open_direct(str(m / "experts" / "layer-000.bin"), 4096)
    if accepts[0] >= 0:
        io.close_fd(accepts[0])
    for slots, asked, expected in [(2, None, accepts[1] == 0), (16, None, False), (2, False, False)]:
        with load(m, cache_slots=slots, direct=asked, usage=False) as e:
            check_same(e, baseline, turns=1)
            assert e.stats()["direct_io"] is expected, (slots, asked)
    monkeypatch.setattr(io, "_open_direct", lambda path, probe: (-errno.EINVAL, errno.EINVAL))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with load(m, cache_slots=2, usage=False) as e:
            check_same(e, baseline, turns=1)
            assert e.stats()["direct_io"] is False
    assert not [w for w in caught if "O_DIRECT" in str(w.message)]


def test_io_pool_reads_what_python_reads(tmp_path):
    data = os.urandom(5 * 4096 + 100)
    f = tmp_path / "data.bin"
    f.write_bytes(data)
    pool = io.IOPool(threads=2)
    fd, refused = io.open_expert_file(str(f), False)
    reads = [pool.submit(fd, off, 4096) for off in (0, 8192, 4096 * 4)]
    reads.append(pool.submit(fd, 4096 * 5, 8192))  # past the end of the file
    for r in reads[:3]:
        pool.wait(r)
        buf, err = pool.result(r)
        assert err is None and bytes(buf) == data[r.req.offset: r.req.offset + 4096]
        assert int(io.ffi.cast("uintptr_t", r.ptr)) % 4096 == 0
    pool.wait(reads[3])
    assert "short read" in pool.result(reads[3])[1]
    bad = pool.submit(-1, 0, 4096)
    pool.wait(bad)
    assert pool.result(bad)[1] == os.strerror(9)  # EBADF
    io.close_fd(fd)
    pool.close()


# ---- mirror --------------------------------------------------------------------------------------

def test_mirror_with_different_contents_is_refused(model, tmp_path):
    from colibri_core.convert import convert_checkpoint
    from colibri_olmoe.demo import write_checkpoint

    write_checkpoint(tmp_path / "hf", vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
                     num_experts=16, num_experts_per_tok=2, seed=4)  # another model of the same shape
    convert_checkpoint(tmp_path / "hf", tmp_path / "other", "int4", progress=False)
    with pytest.raises(ColibriError, match="is not a copy of .*manifest differs"):
        load(model, cache_slots=2, mirror=tmp_path / "other", usage=False)
    m = copy_model(model, tmp_path / "mirror")
    flip_byte(m / "experts" / "layer-002.bin", 5 * 8192 + 100)  # an extent the start-up check samples
    with pytest.raises(ColibriError, match="mirror .* differs from .*layer-002.bin expert 5"):
        load(model, cache_slots=2, mirror=m, usage=False)
    with pytest.raises(ColibriError, match="mirror refused"):
        load(model, cache_slots=2, mirror=tmp_path / "missing", usage=False)


def test_mirror_read_error_falls_back_to_the_primary_with_one_warning(model, baseline, tmp_path):
    m = copy_model(model, tmp_path / "mirror")
    for layer in range(4):  # corrupt experts the start-up check does not sample (it checks 0, 5, 10, 15)
        for e in (1, 2, 3, 4, 6, 7, 8, 9, 11, 12, 13, 14):
            flip_byte(m / "experts" / f"layer-{layer:03d}.bin", e * 8192 + 10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with load(model, cache_slots=2, mirror=m, usage=False) as e:
            e.store.primary_share = 0.0  # every read goes to the mirror first
            check_same(e, baseline)
            s = e.stats()
    msgs = [str(w.message) for w in caught if issubclass(w.category, ColibriWarning)]
    assert len(msgs) == 1 and "mirror" in msgs[0] and "primary" in msgs[0], msgs
    assert s["mirror_reads"] >= 1 and not s["mirror_in_use"]


def test_primary_read_error_is_read_from_the_mirror(model, baseline, tmp_path):
    """A damaged extent in the primary is read from the mirror's copy (a warning each time), and
    the tokens are those of the undamaged model; without a mirror the same read is a clear error."""
    primary = copy_model(model, tmp_path / "primary")
    m = copy_model(model, tmp_path / "mirror")
    for layer in range(4):
        for e in (1, 2, 3):  # experts the mirror's start-up check does not sample (it checks 0, 5, 10, 15)
            flip_byte(primary / "experts" / f"layer-{layer:03d}.bin", e * 8192 + 10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with load(primary, cache_slots=2, mirror=m, usage=False) as e:
            e.store.primary_share = 1.0  # every read goes to the primary first
            check_same(e, baseline)
            s = e.stats()
    msgs = [str(w.message) for w in caught if issubclass(w.category, ColibriWarning)]
    assert msgs and all("corrupt expert data" in w and "from mirror" in w for w in msgs), msgs
    assert s["mirror_reads"] == len(msgs) and s["mirror_in_use"]
    with load(primary, cache_slots=2, usage=False) as e, pytest.raises(ColibriError, match="corrupt expert data"):
        check_same(e, baseline)


def test_mirror_choice_is_deterministic_and_weighted(model, tmp_path):
    from colibri_core.store.mirror import choose

    picks = [choose(layer, e, 0.75) for layer in range(40) for e in range(64)]
    assert picks == [choose(layer, e, 0.75) for layer in range(40) for e in range(64)]
    assert 0.7 < picks.count(0) / len(picks) < 0.8
    m = copy_model(model, tmp_path / "mirror")
    with load(model, cache_slots=2, mirror=m, usage=False) as e:
        assert 0 < e.store.primary_share < 1 and e.store.sources[1].bandwidth > 0


# ---- I/O errors and corruption never give a wrong token ------------------------------------------

def test_corrupt_expert_on_disk_is_an_error_not_a_wrong_token(model, tmp_path):
    m = copy_model(model, tmp_path / "m")
    with load(m, cache_slots=1, usage=False) as e:
        for layer in range(4):
            for x in range(16):
                flip_byte(m / "experts" / f"layer-{layer:03d}.bin", x * 8192 + 200)
        with pytest.raises(ColibriError, match="corrupt expert data .* checksum mismatch"):
            e.generate(PROMPT, 4, stop_ids=())
    assert not (m / USAGE_FILE).exists()


def test_truncated_expert_file_after_start_is_a_clear_error(model, tmp_path):
    m = copy_model(model, tmp_path / "m")
    with load(m, cache_slots=1, usage=False, prefetch=False) as e:
        for layer in range(4):
            os.truncate(m / "experts" / f"layer-{layer:03d}.bin", 8192)  # only expert 0 is left
        with pytest.raises(ColibriError, match="cannot read layer .* expert .*short read"):
            e.generate(PROMPT, 4, stop_ids=())


# ---- plan and doctor -----------------------------------------------------------------------------

def test_plan_from_a_directory_and_from_config_alone(model, tmp_path):
    r = colibri("plan", "--model", model, "--ram", "20MB", "--context", "128", "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    sp = p["split"]
    assert p["model"]["moe_layers"] == 4 and p["experts_total"] == 64 and p["model"]["expert_nbytes"] == 8192
    assert sp["dense"] + sp["state"] + sp["cache_bytes"] + sp["pinned_bytes"] <= 20 * 10**6
    assert p["disk_bandwidth"] > 0 and p["memory_bandwidth"] > 0 and p["floor_seconds_per_token"]["floor"] >= 0
    with load(model, cache_slots=1, usage=False) as e:
        assert p["model"]["dense_bytes"] == e.resident_bytes
    cfg = tmp_path / "config.json"
    shutil.copy(model / "config.json", cfg)  # no weights beside it
    r2 = colibri("plan", "--config", cfg, "--quant", "int4", "--ram", "20MB", "--context", "128", "--json",
                 "--disk-bw", "2GB", "--mem-bw", "10GB")
    assert r2.returncode == 0, r2.stderr
    assert json.loads(r2.stdout)["model"] == p["model"]
    assert json.loads(r2.stdout)["disk_bandwidth"] == 2e9
    r3 = colibri("plan", "--config", cfg, "--quant", "int4", "--ram", "20KB", "--disk-bw", "1GB", "--mem-bw", "1GB")
    assert r3.returncode == 1 and "below this model's minimum" in r3.stderr
    text = colibri("plan", "--model", model, "--ram", "1MB", "--context", "16", "--disk-bw", "1GB", "--mem-bw", "1GB")
    assert text.returncode == 0 and "expert cache" in text.stdout and "floor per token" in text.stdout
    assert colibri("plan").returncode == 1


def test_plan_splits_the_budget_as_run_does(model, tmp_path):
    """Without --context, `plan --ram X` is the split `run --ram X` makes (the state beside it)."""
    m = copy_model(model, tmp_path / "m")
    for ram in ("300KB", "500KB"):
        r = colibri("plan", "--model", m, "--ram", ram, "--json", "--disk-bw", "1GB", "--mem-bw", "1GB")
        assert r.returncode == 0, r.stderr
        sp = json.loads(r.stdout)["split"]
        with load(m, ram=ram) as e:
            s = e.stats()
        assert sp["state"] == 0 and (sp["cache_slots"], sp["pinned_experts"]) == (s["cache_slots_per_layer"],
                                                                                 s["pinned_experts"]), (ram, sp)


def test_doctor_deep_catches_one_flipped_byte_and_writes_nothing(model, tmp_path):
    m = copy_model(model, tmp_path / "m")
    before = sorted(p.name for p in m.rglob("*"))
    r = colibri("doctor", "--model", m, "--deep")
    assert r.returncode == 0, r.stdout + r.stderr
    for check in ("kernels", "plugin", "files", "free disk", "RAM", "O_DIRECT", "checksums (deep)"):
        assert check in r.stdout
    flip_byte(m / "experts" / "layer-003.bin", 9 * 8192 + 77)
    r = colibri("doctor", "--model", m, "--deep")
    assert r.returncode == 1 and "FAIL  checksums (deep)" in r.stdout and "layer 3 expert 9" in r.stdout
    assert sorted(p.name for p in m.rglob("*")) == before
    (m / "experts" / "layer-000.bin").unlink()
    r = colibri("doctor", "--model", m)
    assert r.returncode == 1 and "FAIL  files" in r.stdout


def test_doctor_fails_what_run_refuses(model, tmp_path):
    """A container whose manifest names another architecture than its config.json (run refuses it
    before loading), and a path whose parent does not exist either: FAIL lines, never a traceback."""
    m = copy_model(model, tmp_path / "m")
    manifest = m / "colibri.yaml"  # edited, its checksum line dropped (as the shipped demo's manifest has none)
    text = manifest.read_text().replace("architecture: olmoe", "architecture: glm52", 1)
    manifest.write_text(text[:text.rstrip("\n").rfind("\n") + 1])
    r = colibri("doctor", "--model", m)
    assert r.returncode == 1 and "FAIL  config" in r.stdout and "glm52" in r.stdout, r.stdout + r.stderr
    r = colibri("doctor", "--model", tmp_path / "no" / "such" / "dir")
    assert r.returncode == 1 and "FAIL  files" in r.stdout and "Traceback" not in r.stderr, r.stdout + r.stderr


def test_doctor_checks_a_checkpoint_run_as_it_is(tiny_checkpoint, tmp_path):
    """`run --model HF_DIR` serves a checkpoint without conversion: doctor checks it too (it said
    "not a colibri container"), and finds a shard cut short."""
    r = colibri("doctor", "--model", tiny_checkpoint, "--deep")
    assert r.returncode == 0 and "PASS  files" in r.stdout and "checkpoint run as it is" in r.stdout, r.stdout
    assert "WARN  checksums (deep)" in r.stdout
    m = tmp_path / "hf"
    shutil.copytree(tiny_checkpoint, m)
    shard = sorted(m.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-1000])
    r = colibri("doctor", "--model", m)
    assert r.returncode == 1 and "FAIL  files" in r.stdout and shard.name in r.stdout, r.stdout + r.stderr


@pytest.mark.system
def test_bench_protocol_smoke(model, tmp_path):
    """The benchmark command runs end to end on a tiny model (numbers are not checked: not a test gate)."""
    m = copy_model(model, tmp_path / "m")
    r = colibri("bench", "--model", m, "--budgets", "0.5", "--prompts", "2", "--prompt-tokens", "4",
                "--new-tokens", "3", "--no-drop", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    sess = d["budgets"][0]["sessions"]
    assert set(sess) == {"cold", "learned"} and "warm_repeat" in sess["cold"] and d["activations"] == "f32"
    assert d["policy"] == "lfu_aging" and d["disk_bandwidth"] > 0 and d["disk_bandwidth_sequential"] > 0
    for key in ("tokens_per_second", "ttft_seconds", "hit_rate", "bytes_read_per_token", "prefetch_recall",
                "io_stall_seconds_per_token", "layer_io_stall_seconds_per_token", "floor_seconds_per_token",
                "vs_floor", "cpu_steal", "measured_floor_seconds_per_token", "vs_measured_floor"):
        assert key in sess["cold"] and key in sess["learned"]
    assert sess["cold"]["measured_floor_seconds_per_token"] > 0
    assert not (m / USAGE_FILE).exists()  # the model's own history is never touched
    r = colibri("bench", "--model", m, "--policy", "nope")
    assert r.returncode != 0 and "unknown cache policy 'nope'" in r.stderr


def test_bench_refuses_a_model_larger_than_memory(model, monkeypatch):
    """The resident pass holds every expert: a model that cannot fit is refused at once, in one line."""
    from colibri_core.bench.model import run_protocol

    monkeypatch.setattr("colibri_core.sizes.available_memory", lambda: 4096)
    with pytest.raises(ColibriError, match="colibri bench measures compute with every expert in memory"):
        run_protocol(model, say=lambda msg: pytest.fail(f"measured before refusing: {msg}"))


def test_measured_floor_reads_whole_extents_and_carries_the_rest(model):
    """The bench's measured floor reads what it is asked per token, in whole checksummed extents
    (what does not make a whole extent is read with a later token), into reused buffers."""
    from colibri_core.bench.model import _TokenReads
    from colibri_core.container import Container
    from colibri_core.container.reader import TRAILER

    c = Container(model)
    nbytes = c.layer_expert_nbytes(c.moe_layers[0])
    reads = _TokenReads(c)
    try:
        batches = [reads.start(2.5 * nbytes) for _ in range(4)]  # 2, 3, 2, 3 extents
        assert [len(b) for b in batches] == [2, 3, 2, 3]
        for batch in batches:
            reads.finish(batch)
            for r in batch:
                crc = TRAILER.unpack_from(r.buf, nbytes - TRAILER.size)[0]
                assert r.req.got == nbytes and r.req.crc == crc
        assert len(reads.spare[nbytes]) == 10
        again = reads.start(3 * nbytes)
        assert len(reads.spare[nbytes]) == 7  # three of the ten reused, none allocated
        reads.finish(again)
    finally:
        reads.close()


def test_measured_floor_does_not_read_again_the_disk_probes_extents(model, tmp_path, monkeypatch):
    """The bench's disk probe and its measured floor draw their random extents independently: below
    O_DIRECT a cache (a VM host's page cache) may still hold what the probe read minutes before,
    and reading the same extents again, in the same order, would flatter the floor."""
    from colibri_core.bench import model as bench

    drawn = []  # the extent indices each _TokenReads drew, in order

    class Recorded(bench._TokenReads):
        def __init__(self, container, seed=0):
            super().__init__(container, seed)
            mine, pick = [], self.rng.randrange
            drawn.append(mine)
            self.rng.randrange = lambda n: mine.append(pick(n)) or mine[-1]

    monkeypatch.setattr(bench, "_TokenReads", Recorded)
    bench.run_protocol(copy_model(model, tmp_path / "m"), fractions=(0.5,), n_prompts=1, prompt_tokens=2,
                       new_tokens=3, drop=False, say=lambda msg: None)
    probe, floor = drawn
    assert len(probe) >= 8 and len(floor) >= 8 and floor[:8] != probe[:8]


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 63, 64, 65, 79, 80, 127, 128, 129, 255, 256, 257, 511,
                               512 + 16, 4095, 8192 + 13, (1 << 20) + 77])
def test_io_crc32_matches_zlib(n, tmp_path):
    """The I/O threads' crc32 (csrc/io_pool.c: carry-less multiply, 512-bit folds where the CPU has
    them, else the tables), its 128-bit and table-only versions against the reference, zlib.crc32,
    at awkward sizes, and the container's Python checksums built on it (reader.crc32 of bytes, a
    slice and an array); and the extent checksum a read computes (leaving out the trailer's crc
    field) and reader.extent_crc against zlib's of the same bytes."""
    import zlib

    from colibri_core.container.reader import crc32, extent_crc

    data = os.urandom(n)
    for crc in (io.lib.io_crc32, io.lib.io_crc32_clmul128, io.lib.io_crc32_portable):
        assert crc(0, data, n) == zlib.crc32(data)
        assert crc(7, data, n) == zlib.crc32(data, 7)
        assert crc(0xFFFFFFFF, data, n) == zlib.crc32(data, 0xFFFFFFFF)
    assert crc32(data) == zlib.crc32(data) and crc32(data, 7) == zlib.crc32(data, 7)
    assert crc32(memoryview(data)[n // 3:]) == zlib.crc32(data[n // 3:])
    words = np.frombuffer(data[: n // 4 * 4], dtype=np.float32).reshape(-1, 1)
    assert crc32(words) == zlib.crc32(words)
    if n >= 16:
        assert extent_crc(data) == zlib.crc32(data[n - 12:], zlib.crc32(data[: n - 16]))
        f = tmp_path / "extent.bin"
        f.write_bytes(data)
        pool = io.IOPool(1)
        fd, _ = io.open_expert_file(str(f), False)
        r = pool.submit(fd, 0, n, crc_hole=(n - 16, 4))
        pool.wait(r)
        assert r.req.crc == zlib.crc32(data[n - 12:], zlib.crc32(data[: n - 16]))
        io.close_fd(fd)
        pool.close()


def test_io_buffers_are_aligned_and_reused():
    """io_alloc: 4096-aligned; a freed buffer is handed out again for a read of the same size (no
    fresh pages to fault in per expert), never for another size."""
    lib = io.lib
    a = lib.io_alloc(3 * 4096)
    assert int(io.ffi.cast("uintptr_t", a)) % 4096 == 0
    lib.io_free(a)
    b = lib.io_alloc(3 * 4096)
    assert b == a
    c = lib.io_alloc(5 * 4096)
    assert c != a and int(io.ffi.cast("uintptr_t", c)) % 4096 == 0
    lib.io_free(b)
    lib.io_free(c)
    # 2 MB and more: slabs of huge pages, buffers of one size back to back from a 2 MB boundary, a
    # freed one's memory the next of its size
    addr = lambda buf: int(io.ffi.cast("uintptr_t", buf))
    for n in (2 << 20, 3 * (1 << 20) + 12345, 9 << 20):
        stride = -(-n // 4096) * 4096
        bufs = [lib.io_alloc(n) for _ in range(3)]
        assert addr(bufs[0]) % (2 << 20) == 0 and [addr(b) - addr(bufs[0]) for b in bufs] == [0, stride, 2 * stride]
        for buf in bufs:
            io.ffi.memmove(buf, b"\x5a" * n, n)  # the whole buffer is writable
        lib.io_free(bufs[1])
        again = lib.io_alloc(n)
        assert again == bufs[1]
        for buf in (bufs[0], again, bufs[2]):
            lib.io_free(buf)


def test_io_pool_reads_extents_of_several_megabytes(tmp_path):
    """A read into a large (mapped, huge-page) buffer, with and without O_DIRECT where allowed."""
    data = os.urandom(5 * (1 << 20) + 3 * 4096)
    f = tmp_path / "big.bin"
    f.write_bytes(data)
    pool = io.IOPool(threads=2)
    for direct in (False, True):
        fd, refused = io.open_expert_file(str(f), direct)
        r = pool.submit(fd, 4096, len(data) - 4096)
        pool.wait(r)
        buf, err = pool.result(r)
        assert err is None and bytes(buf) == data[4096:], f"direct={direct} (refused: {refused})"
        io.close_fd(fd)
    pool.close()


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping holding `addr` (/proc/self/smaps): "hg" huge pages asked for, "nh" refused."""
    start = None
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            start = lo <= addr < hi
        elif start and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def _linux_at_least(*version: int) -> bool:
    m = re.match(r"(\d+)\.(\d+)", platform.release())
    return sys.platform.startswith("linux") and m is not None and tuple(map(int, m.groups())) >= version


@pytest.mark.skipif(not _linux_at_least(5, 14), reason=f"slabs fault their buffers in with MADV_POPULATE_WRITE, "
                    f"Linux 5.14+ only; this is {platform.system()} {platform.release()}")
def test_slabs_take_small_pages_once_huge_ones_fault_slowly(tmp_path):
    """The I/O thread faults each fresh buffer of a huge-page slab in before reading into it, timed;
    once 64 MB of them cost more than the limit, later slabs take 4 KB pages — the same bytes read.
    Limit 0: every fault is slow; a limit no fault reaches: huge pages stay; a pool filling a cache
    of every expert (`keep_huge_pages`) times nothing, so keeps them at limit 0 too."""
    lib, addr, page = io.lib, lambda read: int(io.ffi.cast("uintptr_t", read.ptr)), 4096
    data = os.urandom((4 << 20) + 6 * page)
    f = tmp_path / "extent.bin"
    f.write_bytes(data)
    fd, _ = io.open_expert_file(str(f), False)
    try:  # sizes of their own (4 MB + 6 … 1 pages): fresh slabs, whatever other tests left
        for pages, limit, keep, small in ((6, 1e9, False, False), (4, 0.0, True, False), (2, 0.0, False, True)):
            n = (4 << 20) + pages * page
            lib.io_slab_fault_limit(limit)
            pool = io.IOPool(threads=2, keep_huge_pages=keep)
            assert not lib.io_slab_small_pages()
            reads = [pool.submit(fd, 0, n) for _ in range(17)]  # 68 MB into fresh huge-page buffers
            for r in reads:
                pool.wait(r)
                assert bytes(pool.result(r)[0]) == data[:n]
            assert "hg" in _vm_flags(addr(reads[0])) and bool(lib.io_slab_small_pages()) == small
            later = pool.submit(fd, 0, n - page)  # a new size: a new slab
            pool.wait(later)
            assert bytes(pool.result(later)[0]) == data[: n - page]
            assert ("nh" if small else "hg") in _vm_flags(addr(later))
            pool.close()
            del reads, later
            gc.collect()
        assert lib.io_slab_small_pages()  # a pool keeping huge pages forgets an earlier pool's switch
        io.IOPool(threads=1, keep_huge_pages=True).close()
        assert not lib.io_slab_small_pages()
    finally:
        lib.io_slab_fault_limit(-1)  # the default, nothing measured
        io.close_fd(fd)
    assert not lib.io_slab_small_pages()


def test_bench_callback_leaves_other_bench_subcommands_alone():
    """`colibri bench --model DIR` is a callback on the bench group: `colibri bench kernels` (or any
    other subcommand) runs as before, and a bare `colibri bench` shows help."""
    import typer
    from typer.testing import CliRunner

    from colibri_core.bench import model as bench_model

    app, bench_app = typer.Typer(), typer.Typer()
    app.add_typer(bench_app, name="bench")
    bench_model.register(bench_app)

    @bench_app.command("kernels")
    def kernels():
        print("kernels ran")

    r = CliRunner().invoke(app, ["bench", "kernels"], env={"COLIBRI_MODEL": ""})
    assert r.exit_code == 0 and r.output.strip() == "kernels ran", r.output
    r = CliRunner().invoke(app, ["bench"], env={"COLIBRI_MODEL": ""})
    assert r.exit_code == 0 and "--model" in r.output
