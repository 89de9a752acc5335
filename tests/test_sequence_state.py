"""The one generic state (colibri_core/kv/state.py) without a model: every kind of part named,
saved and restored; another model's arrays refused in one line before anything changes; truncation
only when every part is per-token rows; copies independent of their original."""
import numpy as np
import pytest

from colibri_core.kv import SequenceState
from colibri_core.kv.cache import KVCache, Rows
from colibri_core.layers.compressor import CompressorState
from colibri_core.layers.deltanet import DeltaNetDims, DeltaNetState
from colibri_core.layers.mla import MLACache, MLADims
from colibri_core.layers.sink_attention import SlidingWindow

RNG = np.random.default_rng(0)
DIMS = MLADims(heads=2, q_lora_rank=8, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4, scale=0.5)


def rows_state(kv_cache="f32") -> SequenceState:
    return SequenceState({"layer.0": KVCache(2, 4, kv_cache), "layer.1": MLACache(DIMS), "layer.1.index_k": Rows(3)})


def feed_rows(state: SequenceState, T: int) -> None:
    state["layer.0"].append(*RNG.standard_normal((2, T, 2, 4), dtype=np.float32))
    state["layer.1"].latent.append(RNG.standard_normal((T, 6), dtype=np.float32))
    state["layer.1"].k_rope.append(RNG.standard_normal((T, 2), dtype=np.float32))
    state["layer.1.index_k"].append(RNG.standard_normal((T, 3), dtype=np.float32))
    state.advance(T)


def mixed_state() -> SequenceState:
    return SequenceState({"layer.0": DeltaNetState(DeltaNetDims(1, 2, 3, 3, 4)), "layer.1": KVCache(2, 4),
                          "layer.2": SlidingWindow(4, 5), "layer.2.compressor": CompressorState(5, 10, 4)})


def feed_mixed(state: SequenceState, T: int) -> None:
    state["layer.0"].recurrent += np.float32(T)  # updated in place, as the kernels do
    state["layer.1"].append(*RNG.standard_normal((2, T, 2, 4), dtype=np.float32))
    state["layer.2"].extend(RNG.standard_normal((T, 5), dtype=np.float32))
    c = state["layer.2.compressor"]
    c.buffer_kv = c.buffer_gate = RNG.standard_normal((T % 4, 10), dtype=np.float32)
    state.advance(T)


def test_a_state_of_rows_keeps_its_names_and_round_trips():
    state = rows_state()
    feed_rows(state, 5)
    arrays = state.arrays()
    assert list(arrays) == ["layer.0.k", "layer.0.v", "layer.1.latent", "layer.1.k_rope", "layer.1.index_k"]
    assert arrays["layer.0.k"].shape == (5, 2, 4) and arrays["layer.1.index_k"].shape == (5, 3)
    restored = rows_state()
    restored.load_arrays({k: v.copy() for k, v in arrays.items()})  # no "length": the rows say it
    assert restored.length == 5 and all(np.array_equal(restored.arrays()[k], a) for k, a in arrays.items())


def test_a_state_with_a_fixed_part_saves_its_length_and_copies_what_changes_in_place():
    state = mixed_state()
    feed_mixed(state, 6)
    arrays = state.arrays()
    assert list(arrays)[:3] == ["length", "layer.0.conv", "layer.0.recurrent"] and arrays["length"].tolist() == [6]
    assert {"layer.2.window", "layer.2.compressor.entries", "layer.2.compressor.carry_gate"} <= arrays.keys()
    before = arrays["layer.0.recurrent"].copy()
    feed_mixed(state, 1)
    assert np.array_equal(arrays["layer.0.recurrent"], before), "arrays() must not change with a later forward"
    restored = mixed_state()
    restored.load_arrays(arrays)
    assert restored.length == 6 and np.array_equal(restored["layer.0"].recurrent, before)
    assert np.array_equal(restored["layer.2"].rows, arrays["layer.2.window"])


@pytest.mark.parametrize("edit, message", [
    (lambda a: a.pop("layer.1.v"), "state array layer.1.v is missing: the state is not from this model"),
    (lambda a: a.update(extra=np.zeros(1)), "state array extra is unexpected: the state is not from this model"),
    (lambda a: a.update({"layer.0.recurrent": np.zeros((1, 3, 4), np.float32)}),
     r"state array layer.0.recurrent has shape \[1, 3, 4\], this model needs \[2, 3, 3\] for 6 tokens"),
    (lambda a: a.update({"layer.1.k": np.zeros((5, 2, 4), np.float32)}),
     r"state array layer.1.k has shape \[5, 2, 4\], this model needs \[6, 2, 4\] for 6 tokens"),
    (lambda a: a.update({"layer.2.window": np.zeros((4, 5), np.float32)}),
     r"state array layer.2.window has shape \[4, 5\], this model needs \[≤3, 5\] for 6 tokens"),
    (lambda a: a.update({"layer.2.compressor.buffer_kv": np.zeros((2, 3), np.float32)}),
     r"state array layer.2.compressor.buffer_kv has shape \[2, 3\], this model needs \[≤3, 10\]"),
    (lambda a: a.update(length=np.array([1.5])), "state array length is float64 \\[1\\], not one token count"),
])
def test_another_models_arrays_are_refused_before_anything_changes(edit, message):
    state = mixed_state()
    feed_mixed(state, 6)
    arrays = dict(state.arrays())
    edit(arrays)
    fresh = mixed_state()
    with pytest.raises(ValueError, match=message) as e:
        fresh.load_arrays(arrays)
    assert len(str(e.value).splitlines()) == 1 and "not from this model" in str(e.value)
    assert fresh.length == 0 and fresh["layer.1"].length == 0 and not fresh["layer.0"].recurrent.any()
    assert len(fresh["layer.2"].rows) == 0


def test_truncate_cuts_rows_only():
    state, never = rows_state(), rows_state()
    feed_rows(state, 7)
    arrays = {k: v.copy() for k, v in state.arrays().items()}
    never.load_arrays({k: v[:4] for k, v in arrays.items()})
    assert state.truncate(4) and state.length == 4
    assert all(np.array_equal(a, never.arrays()[k]) for k, a in state.arrays().items())
    mixed = mixed_state()
    feed_mixed(mixed, 3)
    held = mixed["layer.1"].length
    assert not mixed.truncate(1) and mixed.length == 3 and mixed["layer.1"].length == held


def test_copy_is_independent_and_keeps_the_cache_type():
    for state, feed in ((rows_state("f16"), feed_rows), (mixed_state(), feed_mixed)):
        feed(state, 5)
        twin = state.copy()
        assert twin.length == 5 and twin.arrays().keys() == state.arrays().keys()
        assert all(np.array_equal(twin.arrays()[k], a) for k, a in state.arrays().items())
        feed(twin, 2)
        assert state.length == 5 and twin.length == 7
    assert rows_state("f16").copy()["layer.0"].k.dtype == np.float16
