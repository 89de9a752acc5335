"""Sampling, sessions and the engine's Python API."""
import numpy as np
import pytest

from colibri_core import load
from colibri_core.sizes import parse_size
from colibri_core.errors import ColibriError
from colibri_core.generate import sample


def test_greedy_and_ties():
    rng = np.random.default_rng(0)
    assert sample(np.array([0.1, 3.0, 3.0, -1.0], np.float32), rng) == 1


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = np.random.default_rng(1).standard_normal(100).astype(np.float32)
    best = int(np.argmax(logits))
    rng = np.random.default_rng(2)
    assert all(sample(logits, rng, temperature=1.5, top_k=1) == best for _ in range(20))
    assert all(sample(logits, rng, temperature=1.5, top_p=1e-9) == best for _ in range(20))


def test_top_k_restricts_support():
    logits = np.arange(10, dtype=np.float32)
    rng = np.random.default_rng(3)
    assert {sample(logits, rng, temperature=5.0, top_k=3) for _ in range(200)} == {7, 8, 9}


def test_seeded_sampling_reproduces(tiny_model):
    with load(tiny_model) as engine:
        a = engine.generate([5, 6, 7], 10, temperature=1.0, top_p=0.9, seed=42, stop_ids=())
        b = engine.generate([5, 6, 7], 10, temperature=1.0, top_p=0.9, seed=42, stop_ids=())
    assert a == b and len(a) == 10


def test_session_prefix_reuse_matches_fresh_run(tiny_model, monkeypatch):
    """A session continued by a prompt that extends its conversation is fed only the new tokens (the
    last answer token, never fed, and the two added), and then decodes as a fresh run of the whole
    prompt does."""
    with load(tiny_model) as engine:
        fed = []  # tokens in each forward pass
        forward = engine.model.forward

        def counted(ids, *args, **kw):
            fed.append(len(ids))
            return forward(ids, *args, **kw)

        monkeypatch.setattr(engine.model, "forward", counted)
        session = engine.new_session()
        first = list(engine.stream([5, 6, 7, 8], 5, session=session, stop_ids=()))
        follow = [5, 6, 7, 8] + first + [9, 10]
        fed.clear()
        reused = list(engine.stream(follow, 6, session=session, stop_ids=()))
        assert fed[0] == 3, f"the session's prompt was prefilled with {fed[0]} tokens, not the 3 new ones"
        assert session.state.length == len(follow) + 5
        fed.clear()
        fresh = engine.generate(follow, 6, stop_ids=())
        assert fed[0] == len(follow)
    assert reused == fresh


def test_logits_are_teacher_forced(tiny_model):
    with load(tiny_model) as engine:
        ids = [3, 1, 4, 1, 5, 9, 2, 6]
        full = engine.logits(ids)
        assert full.shape == (8, 300) and full.dtype == np.float32
        assert np.allclose(engine.logits(ids[:5]), full[:5], rtol=1e-5, atol=1e-5)
        tokens = engine.generate(ids, 1, stop_ids=())
        assert tokens == [int(np.argmax(full[-1]))]


def test_stops_at_eos(tiny_model):
    with load(tiny_model) as engine:
        first = engine.generate([5, 6, 7], 1, stop_ids=())[0]
        assert engine.generate([5, 6, 7], 10, stop_ids=[first]) == [first]


def test_parse_size():
    assert parse_size("2GB") == 2 * 10**9 and parse_size("1.5GiB") == int(1.5 * 2**30) and parse_size(123) == 123
    with pytest.raises(ColibriError):
        parse_size("lots")


def test_budget_below_minimum_is_an_error(tiny_model):
    with pytest.raises(ColibriError, match="below this model's minimum"):
        load(tiny_model, ram="1KB")


def test_state_arrays_round_trip(tiny_model):
    """A state flattened to arrays and rebuilt continues exactly like the original."""
    with load(tiny_model) as engine:
        session = engine.new_session()
        list(engine.stream([5, 6, 7, 8, 9], 3, session=session, stop_ids=()))
        restored = engine.new_session()
        restored.state.load_arrays({k: v.copy() for k, v in session.state.arrays().items()})
        restored.ids = list(session.ids)
        follow = session.ids + [11, 12]
        a = list(engine.stream(follow, 6, session=session, stop_ids=()))
        b = list(engine.stream(follow, 6, session=restored, stop_ids=()))
    assert a == b


def test_bad_arguments_are_one_line_errors(tiny_model):
    """A max_new_tokens never reached (3.5, inf), a token id outside the vocabulary (NumPy read -1 as
    the last row), a closed engine (a C pointer error): each a ColibriError naming it."""
    engine = load(tiny_model, usage=False)
    for bad in (3.5, float("inf"), 0):
        with pytest.raises(ColibriError, match="max_new_tokens"):
            engine.generate([5, 6], bad)
    V = engine.model.cfg.vocab_size
    for ids in ([5, -1], [5, V], [5, 6.7]):
        with pytest.raises(ColibriError, match="not in this model's vocabulary"):
            engine.generate(ids, 2)
        with pytest.raises(ColibriError, match="not in this model's vocabulary"):
            engine.logits(ids)
    assert engine.generate(np.array([5, V - 1]), 2)  # NumPy integers are ids
    engine.close()
    with pytest.raises(ColibriError, match="closed"):
        engine.generate([5, 6], 2)
    assert engine.stats()["generated_tokens"] == 2


def test_one_generation_at_a_time(tiny_model):
    """Two threads generating on one engine failed inside the store (an AssertionError, a dict changed
    during iteration): the second now gets a ColibriError saying why; after the first, all is well."""
    with load(tiny_model, usage=False) as engine:
        first = engine.stream([5, 6, 7], 8, stop_ids=())
        next(first)
        with pytest.raises(ColibriError, match="already generating"):
            engine.generate([5, 6], 2)
        with pytest.raises(ColibriError, match="already generating"):
            engine.logits([5, 6])
        rest = list(first)
        assert engine.generate([5, 6, 7], 8, stop_ids=())[1:] == rest
