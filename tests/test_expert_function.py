"""A plugin's own expert function (`layout.ExpertFunction`, declared as `Experts(activation=...)`)
instead of a core kind: each slot gets that function's FFN, on every tier the same bits (resident,
streamed at one slot per layer, a Ray shard), the kit's placement checks pass for a plugin using it,
and a function that returns the wrong thing is one error naming it."""
import pickle
from dataclasses import replace

import numpy as np
import pytest
from transformers import OlmoeConfig

from colibri_core.container import Container
from colibri_core.engine import load
from colibri_core.errors import ColibriError
from colibri_core.layers.moe import ExpertFFN, run_experts
from colibri_core.layout import ExpertFunction, ExpertMath
from colibri_core.quant import dequantize
from colibri_core.testing import ConformanceSuite, checks
from colibri_core.testing.oracle import Oracle
from colibri_olmoe.model import Olmoe


# ---- the functions a test plugin declares, by "module:function" ------------------------------
def silu(v: np.ndarray) -> np.ndarray:
    return v / (np.float32(1) + np.exp(-v))


def numpy_swiglu(x, gate, up, down, biases):
    """OLMoE's own expert FFN, written in NumPy: (silu(x gate^T) · x up^T) down^T."""
    return (silu(x @ gate.T) * (x @ up.T)) @ down.T


def relu2_glu(x, gate, up, down, biases):
    """A gated unit no core kind computes: relu(g)^2 · u, with the biases where given."""
    bg, bu, bd = (0, 0, 0) if biases is None else biases
    g, u = x @ gate.T + bg, x @ up.T + bu  # (n, I)
    return (np.maximum(g, 0) ** 2 * u) @ down.T + bd  # (n, H)


def returns_float64(x, gate, up, down, biases):
    return relu2_glu(x, gate, up, down, biases).astype(np.float64)


def returns_one_row(x, gate, up, down, biases):
    return relu2_glu(x, gate, up, down, biases)[:1]


def returns_a_list(x, gate, up, down, biases):
    return relu2_glu(x, gate, up, down, biases).tolist()


def named(fn) -> ExpertFunction:
    return ExpertFunction(f"{__name__}:{fn.__name__}")


def declare(monkeypatch, fn) -> None:
    """The tiny OLMoE plugin, its experts declared with `fn` instead of the core's swiglu."""
    tensors = Olmoe.tensors.__func__

    def with_function(cls, cfg):
        table = tensors(cls, cfg)
        return replace(table, experts=replace(table.experts, activation=named(fn)))

    monkeypatch.setattr(Olmoe, "tensors", classmethod(with_function))


# ---- the slots -----------------------------------------------------------------------------
def slots(c: Container, seed: int = 3):
    """x (5, H), ids (5, 2) and the experts of the first MoE layer they route to."""
    rng = np.random.default_rng(seed)
    layer = c.moe_layers[0]
    x = rng.normal(0, 1, (5, c.hidden)).astype(np.float32)
    ids = np.array([[1, 2], [6, 0], [2, 6], [3, 1], [0, 7]])
    return layer, x, ids, {e: c.read_expert(layer, e) for e in np.unique(ids).tolist()}


def test_each_slot_holds_its_experts_function_with_biases(tiny_model):
    c = Container(tiny_model)
    layer, x, ids, experts = slots(c)
    I, H = experts[0][0].rows, c.hidden
    rng = np.random.default_rng(4)
    E = c.n_experts
    biases = tuple(rng.normal(0, 0.5, shape).astype(np.float32) for shape in ((E, I), (E, I), (E, H)))
    ffn = replace(ExpertFFN(named(relu2_glu)), biases=biases)
    got = np.zeros((*ids.shape, H), np.float32)
    ffn(got, x, ids, experts)
    for (t, r), e in np.ndenumerate(ids):  # the NumPy reference, one slot at a time, float64
        gate, up, down = (dequantize(m).astype(np.float64) for m in experts[e])
        g, u = gate @ x[t] + biases[0][e], up @ x[t] + biases[1][e]
        want = down @ (np.maximum(g, 0) ** 2 * u) + biases[2][e]
        np.testing.assert_allclose(got[t, r], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    c.close()


def test_a_numpy_swiglu_function_computes_what_the_c_kind_does(tiny_model):
    c = Container(tiny_model)
    _, x, ids, experts = slots(c)
    got, kind = (np.zeros((*ids.shape, c.hidden), np.float32) for _ in range(2))
    ExpertFFN(named(numpy_swiglu))(got, x, ids, experts)
    run_experts(kind, x, ids, experts, act="f32")  # the C kernel, in float32 arithmetic
    np.testing.assert_allclose(got, kind, rtol=1e-4, atol=1e-5)
    c.close()


@pytest.mark.parametrize("fn,got", [(returns_float64, r"float64 \[2, 64\]"), (returns_one_row, r"float32 \[1, 64\]"),
                                    (returns_a_list, "list")])
def test_a_function_returning_the_wrong_thing_is_one_error_naming_it(tiny_model, fn, got):
    c = Container(tiny_model)
    _, x, ids, experts = slots(c)
    with pytest.raises(ColibriError, match=rf"expert function {__name__}:{fn.__name__} returned {got} for expert "
                                            r"\d+: it must return float32 \[2, 64\]") as e:
        ExpertFFN(named(fn))(np.zeros((*ids.shape, c.hidden), np.float32), x, ids, experts)
    assert "\n" not in str(e.value)
    c.close()


@pytest.mark.parametrize("make,message", [
    (lambda: ExpertFunction("no_colon_here"), "an expert function is named 'package.module:function'"),
    (lambda: ExpertFunction("colibri_nowhere.mod:f"), "colibri_nowhere.mod:f cannot be imported here: No module"),
    (lambda: ExpertFunction(f"{__name__}:no_such_function"), "cannot be imported here: .* no attribute"),
    (lambda: ExpertFunction("numpy:pi"), "numpy:pi is a float, not a function"),
    (lambda: ExpertMath(named(relu2_glu), 7.0), "takes no swiglu_limit or swiglu_alpha"),
])
def test_a_function_that_cannot_be_called_is_refused_when_declared(make, message):
    with pytest.raises(ColibriError, match=message) as e:
        make()
    assert "\n" not in str(e.value)


def test_a_shard_imports_the_function_by_name_and_gives_the_local_bits(tiny_model):
    """What the driver sends a Ray shard (`RemoteExperts.dispatch`: the ExpertFFN's fields, pickled)
    gives its slots the local block's bits."""
    from colibri_core.remote.shard import ShardServer, identity

    c = Container(tiny_model)
    layer, x, ids, experts = slots(c)
    mine = [1, 2, 6]
    shard = ShardServer(str(tiny_model), {layer: mine}, identity(c), warm=False)
    held = np.isin(ids, mine)
    ffn = ExpertFFN(named(relu2_glu))
    want = np.zeros((*ids.shape, c.hidden), np.float32)
    ffn(want, x, ids, experts)
    sent = pickle.loads(pickle.dumps(ffn.activation))  # Ray pickles it: the name travels, not the code
    got = shard.compute(layer, x, np.where(held, ids, -1), c.activations, sent, None, None)
    assert np.array_equal(got.view(np.uint32), want[held].view(np.uint32))
    c.close()


# ---- a model whose experts use it ------------------------------------------------------------
def run(model_dir, slots: int) -> tuple[np.ndarray, list[int]]:
    prompt = [5, 17, 42, 99, 7, 250, 3, 64]
    with load(model_dir, cache_slots=slots, activations="f32") as engine:
        return engine.logits(prompt), engine.generate(prompt, 8, stop_ids=())


def test_resident_and_streamed_at_one_slot_give_the_same_bits(tiny_model, monkeypatch):
    """All 8 experts resident (where a core kind would take the fused C call) and one slot per layer
    (every expert streamed): the same logits, bit for bit, and the same tokens; and not the core
    swiglu's (the function is what ran, on both tiers)."""
    kind, _ = run(tiny_model, 8)
    declare(monkeypatch, relu2_glu)
    resident, streamed = run(tiny_model, 8), run(tiny_model, 1)
    assert np.array_equal(resident[0], streamed[0]) and resident[1] == streamed[1]
    assert not np.allclose(resident[0], kind, atol=1e-3)


class TinyOlmoeWithAFunction(ConformanceSuite):
    """The plugin's kit suite, its experts computed by `numpy_swiglu` (not collected: the tests
    below run the kit's placement checks and its logits check on it)."""

    hf_config = OlmoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
        initializer_range=0.1, max_position_embeddings=256, eos_token_id=2,
    )


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        declare(mp, numpy_swiglu)
        oracle = Oracle(TinyOlmoeWithAFunction, tmp_path_factory.mktemp("expert-function"))
        assert oracle.layout.expert_activation == named(numpy_swiglu)
        yield oracle


@pytest.mark.parametrize("q", ("f32", "int4"))
def test_the_kits_placement_checks_pass_for_a_plugin_with_a_function(oracle, q):
    TinyOlmoeWithAFunction().test_placement_invariance(oracle, q)
    checks.check_prefetch_invisible(oracle, q)


def test_the_kits_logits_check_passes_for_the_function_of_the_models_own_math(oracle):
    checks.check_logits(oracle, "f32", oracle.logits_ids, TinyOlmoeWithAFunction.rel_tol)
