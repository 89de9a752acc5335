"""The engine's int8-activation arithmetic (`activations="int8"`, COLIBRI_ACTIVATIONS): an explicit
choice, off by default and off for the oracle. It must stay deterministic and placement-invariant,
and close to the exact arithmetic (it quantises activations, so not within the oracle tolerance)."""
import numpy as np
import pytest

import colibri_core
from colibri_core.errors import ColibriError
from colibri_core.quant import QTensor


def test_int8_activations_are_placement_invariant_and_close_to_exact(tiny_model):
    ids = [5, 17, 3, 99, 42, 7, 8, 250]
    with colibri_core.load(tiny_model) as exact:
        assert exact.activations == "f32"
        want = exact.logits(ids)
    got = {}
    for slots in (1, 3, 8):
        with colibri_core.load(tiny_model, cache_slots=slots, activations="int8") as e:
            got[slots] = (e.logits(ids), e.generate(ids, 6, stop_ids=()))
    for slots in (3, 8):
        assert np.array_equal(got[slots][0].view(np.uint32), got[1][0].view(np.uint32))
        assert got[slots][1] == got[1][1]
    assert not np.array_equal(got[1][0], want)  # a different arithmetic, really in use
    assert np.abs(got[1][0] - want).max() <= 0.05 * np.abs(want).max()


def test_activations_option_and_environment(tiny_model, monkeypatch):
    monkeypatch.setenv("COLIBRI_ACTIVATIONS", "int8")
    with colibri_core.load(tiny_model) as e:
        assert e.activations == "int8"
    with colibri_core.load(tiny_model, activations="f32") as e:
        assert e.activations == "f32"
    with pytest.raises(ColibriError, match="unknown activation arithmetic 'int3'"):
        colibri_core.load(tiny_model, activations="int3")


def test_the_weights_carry_the_engines_arithmetic(tiny_model):
    """Nothing ambient: the container stamps each quantised weight it parses, resident or streamed,
    with the engine's arithmetic (QTensor.act), so two engines used in turn keep their own."""
    ids = [5, 17, 3, 99]
    with colibri_core.load(tiny_model, cache_slots=1) as exact, \
            colibri_core.load(tiny_model, cache_slots=1, activations="int8") as fast:
        layer = fast.container.moe_layers[0]
        for engine, act in ((exact, "f32"), (fast, "int8")):
            resident = [t for t in engine.container.resident().values() if isinstance(t, QTensor) and t.kind != "f32"]
            assert resident and {t.act for t in resident} == {act}
            assert {w.act for w in engine.container.read_expert(layer, 0)} == {act}
        first, other, again = exact.logits(ids), fast.logits(ids), exact.logits(ids)
    assert np.array_equal(first.view(np.uint32), again.view(np.uint32)) and not np.array_equal(first, other)
