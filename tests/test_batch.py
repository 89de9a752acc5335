"""Continuous batching in the engine (colibri_core/batch.py, `Engine.batch`): generations decoded
together get the tokens and states they get alone; a step runs each weight-reading call once for
all of them (the dense products, the attention blocks, each MoE layer over the union of their
experts); a long prompt is prefilled in chunks between the others' steps; cancellation, errors and
the engine's lock behave."""
import numpy as np
import pytest

from colibri_core import batch as batching
from colibri_core import load
from colibri_core.errors import ColibriError
from colibri_core.testing.checks import ConformanceFailure, check_batch_equals_solo

VOCAB = 300  # tests/conftest.py's tiny model


def test_a_batch_equals_each_generation_alone(tiny_model):
    check_batch_equals_solo(tiny_model, VOCAB)


def test_the_check_fails_when_rows_depend_on_each_other(tiny_model, monkeypatch):
    """A stacked product whose rows depend on the batch (here: a tilt added to the outputs when
    several generations share it) is caught: the check can fail."""
    by_rows = batching.by_rows

    def leaky(fn):
        run = by_rows(fn)

        def spoiled(xs):
            out = run(xs)
            if len(xs) > 1 and isinstance(out[0], np.ndarray):
                out = [o + np.float32(0.05) * np.arange(o.shape[-1], dtype=np.float32) for o in out]
            return out
        return spoiled

    monkeypatch.setattr(batching, "by_rows", leaky)
    with pytest.raises(ConformanceFailure, match="batch_equals_solo: generation"):
        check_batch_equals_solo(tiny_model, VOCAB)


@pytest.mark.parametrize("resident", [False, True])
def test_a_step_reads_each_weight_once_for_all_generations(tiny_model, monkeypatch, resident):
    """A decode step of three generations runs each weight-reading call (dense products, attention
    blocks, MoE layers; with every expert resident, whole decoder layers) once, on the three's rows:
    the same calls as a step of one generation."""
    together, runs = batching.together, []

    def counted(key, argument, run):
        if batching.current()._calling:  # a call inside one run for the group (the attention block's steps)
            return together(key, argument, run)

        def once(arguments):
            runs.append((key[0], len(arguments)))
            return run(arguments)
        return together(key, argument, once)

    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    per_step = {}
    with load(tiny_model, prefix_cache=0, cache_slots=10**6 if resident else 1) as engine:
        c = engine.container
        for layer in c.moe_layers if resident else ():
            for e in range(c.n_experts):
                engine.store.get(layer, e)
        for n in (1, 3):
            with engine.batch() as b:
                for p in prompts[:n]:
                    b.add(p, 6, stop_ids=(), draft="off")
                b.step()  # the prompts
                monkeypatch.setattr(batching, "together", counted)
                b.step()  # a decode step each
                monkeypatch.undo()
                per_step[n], runs[:] = sorted(runs), []
    assert {kind for kind, _ in per_step[1]} == ({"layer", "linear"} if resident else {"attn_block", "moe", "linear"})
    assert per_step[3] == [(kind, 3) for kind, _ in per_step[1]]


def test_a_streamed_layer_reads_the_union_of_its_experts_once(tiny_model):
    """With one expert slot per layer (every expert read from disk when needed), a step of three
    generations reads no more experts than the distinct experts they route to, each once."""
    with load(tiny_model, prefix_cache=0, cache_slots=1, prefetch=False) as engine:
        with engine.batch() as b:
            for p in ([5, 6, 7], [8, 9, 10, 11], [12, 13]):
                b.add(p, 4, stop_ids=(), draft="off")
            b.step()
            before, latest = engine.stats(), []
            real = engine.probe.add_route

            def route(layer, ids):  # the experts each layer's stacked rows route to
                latest.append((layer, np.unique(ids).size))
                return real(layer, ids)
            engine.probe.add_route = route
            b.step()
            del engine.probe.add_route
            after = engine.stats()
    routed = sum(n for _, n in latest)
    assert len(latest) == 2  # one MoE call per layer for the three generations (tiny model: 2 layers)
    assert 0 < after["expert_misses"] - before["expert_misses"] <= routed
    assert after["steps"] == before["steps"] + 1 and after["step_rereads"] == 0


def test_a_long_prompt_is_prefilled_in_chunks_between_the_others_steps(tiny_model):
    with load(tiny_model, prefix_cache=0, prefill_chunk=64) as engine:
        with engine.batch() as b:
            short = b.add([5, 6, 7], 20, stop_ids=(), draft="off")
            b.step()
            long = b.add(list(np.arange(300) % 250 + 3), 2, stop_ids=(), draft="off")
            steps = 0
            while not long.tokens:
                b.step()
                steps += 1
            # 300 tokens in chunks of 64: five forwards, each beside a decode step of the short one
            assert steps == 6 and len(short.tokens) >= 5
            while b.running():
                b.step()
        assert long.tokens == engine.generate(list(np.arange(300) % 250 + 3), 2, stop_ids=(), draft="off")


def test_cancel_ends_a_generation_at_its_next_pause_and_keeps_its_session(tiny_model):
    with load(tiny_model, prefix_cache=0) as engine:
        session = engine.new_session()
        engine.generate([5, 6, 7], 3, stop_ids=(), session=session)
        ids, arrays = list(session.ids), session.state.arrays()
        with engine.batch() as b:
            other = b.add([8, 9], 10, stop_ids=(), draft="off")
            g = b.add([5, 6, 7, 1, 2, 3], 10, stop_ids=(), session=session)
            b.step()
            b.step()
            g.cancel()
            b.step()
            assert g.done and g.error is None and not other.done
            while b.running():
                b.step()
        assert len(other.tokens) == 10
        assert session.ids == ids  # the failed call put the session back as it was
        assert all(np.array_equal(arrays[k], v) for k, v in session.state.arrays().items())


def test_a_failed_generation_leaves_the_others_running(tiny_model):
    with load(tiny_model, prefix_cache=0) as engine:
        with engine.batch() as b:
            good = b.add([5, 6, 7], 4, stop_ids=())
            bad = b.add([5, VOCAB + 7], 4, stop_ids=())
            while b.running():
                b.step()
        assert isinstance(bad.error, ColibriError) and "vocabulary" in str(bad.error)
        assert good.error is None and len(good.tokens) == 4
        with pytest.raises(ColibriError, match="vocabulary"):
            engine.generate_batch([[5, 6], [VOCAB]], 2)


def test_the_engine_runs_nothing_else_while_a_batch_is_open(tiny_model):
    with load(tiny_model, prefix_cache=0) as engine:
        with engine.batch() as b:
            with pytest.raises(ColibriError, match="already generating"):
                engine.generate([5, 6], 2)
            g = b.add([5, 6], 50, stop_ids=())
            b.step()
        assert g.done and len(g.tokens) < 50  # closing the batch cancelled it
        assert engine.generate_batch([[5, 6], [7]], 3, stop_ids=()) == [engine.generate([5, 6], 3, stop_ids=()),
                                                                        engine.generate([7], 3, stop_ids=())]


def test_on_token_false_ends_a_generation_and_saves_its_turn(tiny_model):
    with load(tiny_model, prefix_cache=0) as engine:
        session = engine.new_session()
        with engine.batch() as b:
            g = b.add([5, 6, 7], 50, stop_ids=(), session=session, on_token=lambda t: len(session.ids) < 6)
            while b.running():
                b.step()
        assert g.error is None and 1 <= len(g.tokens) < 50
        assert session.ids[:3] == [5, 6, 7]
