"""Router lookahead beyond one layer (--lookahead N): the MoE block guesses up to three MoE layers
ahead, the store reads as many distances as it is told, scores and gates each (layer, distance)
apart, counts hits per distance, and no depth ever changes a token."""
from pathlib import Path

import numpy as np
import pytest

from colibri_core import load
from colibri_core.cli import store_report
from colibri_core.demo import demo_model
from colibri_core.errors import ColibriError
from colibri_core.layers.moe import LOOKAHEAD_DISTANCES, MoE
from colibri_core.layers.router import SoftmaxTopK
from colibri_core.options import EngineOptions
from colibri_core.store.store import Lookahead
from conftest import resident_baseline, store_model

PROMPT = [5, 17, 40, 99, 230, 7, 61, 300, 12, 1000]
N_NEW = 12


@pytest.fixture(scope="module")
def baseline():
    """The demo model's logits and greedy tokens with every expert resident and no lookahead."""
    return resident_baseline(demo_model(), PROMPT, N_NEW, slots=8)


@pytest.mark.parametrize("depth", [None, 1, 2, 3], ids=["off", "depth-1", "depth-2", "depth-3"])
def test_tokens_are_bit_identical_at_every_lookahead_depth(baseline, depth):
    """2 of the demo's 8 experts cached a layer, so guesses evict and are evicted: the same logits,
    bit for bit, and the same tokens with the lookahead off and 1, 2, 3 layers deep; each distance
    asked for reads."""
    logits, tokens = baseline
    options = dict(prefetch=False) if depth is None else dict(lookahead=depth)
    with load(demo_model(), cache_slots=2, usage=False, **options) as e:
        got = e.logits(PROMPT)
        assert got.dtype == np.float32 and np.array_equal(got, logits)
        assert e.generate(PROMPT, N_NEW, stop_ids=()) == tokens
        s = e.stats()
    assert s["lookahead_depth"] == (depth or 0)
    assert list(s["prefetch_by_distance"]) == list(range(1, (depth or 0) + 1))
    for d, counts in s["prefetch_by_distance"].items():
        assert counts["issued"] > 0, f"distance {d} never read: {s['prefetch_by_distance']}"
        assert counts["used"] <= counts["issued"] and 0 < counts["recall"] <= 1
    if depth:
        assert s["prefetch_by_distance"][1]["used"] > 0
        assert s["prefetch_issued"] == sum(c["issued"] for c in s["prefetch_by_distance"].values())


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """4 MoE layers × 16 experts, top-2: room to guess right and wrong."""
    return store_model(tmp_path_factory.mktemp("lookahead"))


def test_each_distance_is_gated_on_its_own_guesses(model):
    """Layer `first` guesses `second` (distance 1) and `third` (distance 2), always right for 12
    steps, then distance 2 always wrong: distance 1 reads from its first guess (PREFETCH_MIN_PRECISION),
    distance 2 only once 9 right guesses in a row have earned it (PREFETCH_MIN_PRECISION_AHEAD) and
    stops at its first wrong one; the counters say so per distance."""
    pairs = [[2, 3], [4, 5], [6, 7]]  # 3 pairs through 4 slots: each guess is of experts the cache lacks
    with load(model, cache_slots=4, usage=False, lookahead=2) as e:
        s = e.store
        first, second, third = list(s.layer_index)[:3]
        for i in range(18):
            need = pairs[i % 3]
            far_guess = need if i < 12 else [10 + i % 3 * 2, 11 + i % 3 * 2]
            ahead = [Lookahead(second, lambda g=need: np.array([g])),
                     Lookahead(third, lambda g=far_guess: np.array([g]), distance=2)]
            for layer, ids, predict in ((first, [0, 1], ahead), (second, need, ()), (third, need, ())):
                for _ in s.experts(layer, np.array([ids]), predict=predict):
                    pass
        near, far = s.by_distance[1], s.by_distance[2]
    assert near.issued == near.used == 36 and near.skipped == 0 and near.recall() == 1.0
    assert far.skipped == 2 * 9 + 2 * 5 and far.issued == 2 * 3 + 2 and far.used == 2 * 3
    assert far.recall() == pytest.approx(12 / 18)


def test_the_store_asks_for_no_guess_deeper_than_its_lookahead(model):
    """A guess past `lookahead` layers (or any, with prefetch off) is never computed."""
    asked = []
    for options, want in ((dict(lookahead=1), [1]), (dict(lookahead=3), [1, 2, 3]), (dict(prefetch=False), [])):
        asked.clear()
        with load(model, cache_slots=4, usage=False, **options) as e:
            layers = list(e.store.layer_index)
            ahead = [Lookahead(layers[d], lambda d=d: asked.append(d) or np.array([[d, d + 1]]), distance=d)
                     for d in (1, 2, 3)]
            for _ in e.store.experts(layers[0], np.array([[0, 1]]), predict=ahead):
                pass
        assert asked == want, options


def test_the_block_guesses_along_the_declared_lookahead():
    """Each layer guesses the layers its `lookahead` leads to, nearest first, at most
    LOOKAHEAD_DISTANCES; a layer the plugin leaves out ends the chain."""
    routers = {layer: SoftmaxTopK(np.zeros((8, 4), np.float32), 2, False) for layer in (0, 1, 2, 3, 5)}
    assert MoE(None, routers).ahead == {0: [1, 2, 3], 1: [2, 3, 5], 2: [3, 5], 3: [5], 5: []}
    assert MoE(None, routers, {0: 1, 1: 2, 3: 5}).ahead == {0: [1, 2], 1: [2], 2: [], 3: [5], 5: []}
    assert LOOKAHEAD_DISTANCES == 3


@pytest.mark.parametrize("depth", [0, 4, True, 1.5])
def test_a_lookahead_out_of_range_is_one_line(depth):
    with pytest.raises(ColibriError, match=r"^--lookahead must be 1 to 3 MoE layers, got"):
        EngineOptions(lookahead=depth)


def test_stats_show_prefetch_hits_per_distance(model):
    with load(model, cache_slots=4, usage=False, lookahead=2) as e:
        e.generate(PROMPT[:6], N_NEW, stop_ids=())
        report = store_report(e)
        by_distance = e.stats()["prefetch_by_distance"]
    line = next(line for line in report.splitlines() if line.startswith("lookahead depth 2: "))
    for d, c in by_distance.items():
        assert f"distance {d} issued {c['issued']} used {c['used']} skipped {c['skipped']}" in line


def test_the_recall_tool_scores_every_distance_on_the_demo():
    """tools/lookahead_recall.py: on the trained demo (4 MoE layers) layer 0 is scored at 1, 2 and 3
    layers ahead, the last layer at none, and the guesses beat chance (2 of 8 experts: 25 %)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lookahead_recall", Path(__file__).parents[1] / "tools" / "lookahead_recall.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    result = tool.measure(demo_model(), 2, 8, 6)
    assert result["tokens"] == 2 * 5
    assert {layer: list(per) for layer, per in result["layers"].items()} == {0: [1, 2, 3], 1: [1, 2], 2: [1]}
    assert all(0.25 < r <= 1 for r in result["distance"].values())
