"""The aging LFU cache policy (store/policies.py): its choices, and that the tokens do not depend on
it. (tests/test_store.py's placement invariance runs every core policy at the default period.)"""
import numpy as np
import pytest

from colibri_core import load, plugins
from colibri_core.store import policies
from colibri_core.store.policies import LFU, LRU, AgingLFU

E = 4  # experts of the layer in the unit tests


def use(policy, *experts) -> None:
    for e in experts:
        policy.on_hit(e)


def test_counts_halve_at_each_period():
    p = AgingLFU(slots=2, n_experts=E)
    assert p.period == policies.AGING_PERIOD * E
    use(p, *[0] * (p.period - 3), 1, 1)
    assert p.uses[:2] == [p.period - 3, 2]
    use(p, 1)  # the period's last use: every count halves, rounded down
    assert p.uses[:2] == [(p.period - 3) // 2, 1]
    use(p, *[2] * (p.period - 1))  # one short of the next halving
    assert p.uses[:3] == [(p.period - 3) // 2, 1, p.period - 1]
    use(p, 2)
    assert p.uses[:3] == [(p.period - 3) // 4, 0, p.period // 2]


def test_a_steady_workload_keeps_the_frequent_expert_as_lfu_does():
    """Expert 0 used often, long ago; expert 1 once, just now: LRU drops 0, both LFUs keep it."""
    choices = {}
    for cls in (LRU, LFU, AgingLFU):
        p = cls(slots=2, n_experts=E)
        use(p, *[0, 2, 0, 3] * 8, 1)
        choices[cls.__name__] = p.victim([0, 1])
    assert choices == {"LRU": 0, "LFU": 1, "AgingLFU": 1}


def test_after_a_shift_the_old_favourite_is_forgotten():
    """Expert 0 was the favourite for two periods; then the workload moves to experts 1 and 2 for
    two periods: LFU still keeps 0 over 1 (more uses this session), the aging LFU drops 0."""
    lfu, aging = LFU(slots=2, n_experts=E), AgingLFU(slots=2, n_experts=E)
    for p in (lfu, aging):
        use(p, *[0] * (2 * aging.period))
        use(p, *[1, 2] * aging.period)
    assert lfu.victim([0, 1]) == 1
    assert aging.victim([0, 1]) == 0
    assert aging.uses[1] > aging.uses[0]


def test_equal_counts_tie_to_the_least_recently_used():
    p = AgingLFU(slots=2, n_experts=E)
    use(p, 3, 2)
    assert p.victim([2, 3]) == 3
    use(p, 3)
    assert p.victim([2, 3]) == 2


def test_inserts_count_as_uses_and_evictions_keep_the_count():
    """As LFU: an expert's uses count while it is not cached too, so one that returns often wins."""
    p = AgingLFU(slots=2, n_experts=E)
    p.on_insert(1)
    p.on_insert(1)
    p.on_evict(1)
    p.on_insert(2)
    p.on_insert(1)
    assert p.uses[1:3] == [3, 1] and p.victim([1, 2]) == 2


def test_registered_beside_lru_and_lfu():
    info = plugins.Registry().cache_policy("lfu_aging")
    assert info.plugin == "colibri" and isinstance(info.factory(slots=2, n_experts=E), AgingLFU)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """2 MoE layers × 8 experts, top-2."""
    from colibri_core.convert import convert_checkpoint
    from colibri_olmoe.demo import write_checkpoint

    d = tmp_path_factory.mktemp("aging")
    write_checkpoint(d / "hf", vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                     num_experts=8, num_experts_per_tok=2, seed=5)
    convert_checkpoint(d / "hf", d / "m", "int4", progress=False)
    return d / "m"


PROMPTS = [list(range(3, 19)), list(range(40, 47)), list(range(100, 130, 3))]


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfu_aging"])
def test_tokens_are_bit_identical_under_every_policy_solo_and_batched(model, policy, monkeypatch):
    """Streamed with 2 of 8 experts cached, the counts halved every 8 uses (many halvings in the run):
    the same logits bits and tokens as with every expert resident, alone and in a batch."""
    with load(model, cache_slots=8, prefetch=False, usage=False) as e:
        want_logits = [e.logits(p) for p in PROMPTS]
        want = [e.generate(p, 12, stop_ids=()) for p in PROMPTS]
    monkeypatch.setattr(policies, "AGING_PERIOD", 1)
    with load(model, cache_slots=2, pin_gb=0, usage=False, policy=policy) as e:
        assert all(np.array_equal(e.logits(p), w) for p, w in zip(PROMPTS, want_logits))
        assert [e.generate(p, 12, stop_ids=()) for p in PROMPTS] == want
        assert e.generate_batch(PROMPTS, 12, stop_ids=()) == want
        s = e.stats()
        layer = e.container.moe_layers[0]
        counts, hits = e.store.policies[layer], e.store.counters.layer_hits[layer]
    assert s["policy"] == policy and s["expert_misses"] > 0
    if policy == "lfu_aging":  # halved: counts kept under two periods' uses, though hits alone passed that
        assert counts.period == 8 and sum(counts.uses) <= 2 * counts.period < hits
