"""The routed experts' math a plugin declares (`ContainerLayout.expert_activation`, `swiglu_limit`,
`swiglu_alpha` → `layout.ExpertMath` → the MoE block's `ExpertFFN`): checked in one line, the kinds
the C kernels compute, and the same bits on a Ray shard as in the local block. The kernels
themselves are tested in tests/test_kernels.py (every kind, path, arithmetic and placement)."""
import numpy as np
import pytest

from colibri_core import kernels
from colibri_core.errors import ColibriError
from colibri_core.layers.moe import MoE, ExpertFFN
from colibri_core.layout import EXPERT_ACTIVATIONS, ContainerLayout, ExpertMath, ExpertNames

NAMES = ExpertNames(per_expert={p: f"l{{layer}}.e{{expert}}.{p}" for p in ("gate", "up", "down")})


def layout(**math) -> ContainerLayout:
    return ContainerLayout(resident=(), keep_f32=(), moe_layers=(0,), n_experts=4, top_k=2, hidden=8, intermediate=6,
                           experts=NAMES, **math)


def test_the_declared_kinds_are_the_kernels_kinds():
    assert set(EXPERT_ACTIVATIONS) == set(kernels.GLUS)


@pytest.mark.parametrize("declared,math", [
    (dict(), ExpertMath("swiglu", None, None)),
    (dict(swiglu_limit=10.0), ExpertMath("swiglu", 10.0, None)),  # DeepSeek V4
    (dict(expert_activation="swiglu_oai"), ExpertMath("swiglu_oai", 7.0, 1.702)),  # GPT-OSS's defaults
    (dict(expert_activation="swiglu_oai", swiglu_limit=5.0, swiglu_alpha=2.0), ExpertMath("swiglu_oai", 5.0, 2.0)),
    (dict(expert_activation="geglu_tanh"), ExpertMath("geglu_tanh", None, None)),
    (dict(expert_activation="situ"), ExpertMath("situ", None, None)),  # Kimi K3
])
def test_a_layout_declares_its_expert_math(declared, math):
    assert layout(**declared).expert_math == math
    ffn = MoE(None, {}, None, declared.get("swiglu_limit"), declared.get("expert_activation", "swiglu"),
              declared.get("swiglu_alpha")).ffn
    assert (ffn.activation, ffn.limit, ffn.alpha) == (math.activation, math.limit, math.alpha)


@pytest.mark.parametrize("declared,message", [
    (dict(expert_activation="gelu"), "unknown expert activation 'gelu' .*swiglu_oai, geglu_tanh"),
    (dict(expert_activation="situ", swiglu_limit=7.0), "'situ' has no clamp"),
    (dict(swiglu_alpha=1.702), "swiglu_alpha goes with the expert activation 'swiglu_oai' only"),
    (dict(swiglu_limit=0.0), "swiglu_limit must be a finite positive number, got 0.0"),
    (dict(expert_activation="swiglu_oai", swiglu_alpha=float("nan")), "swiglu_alpha must be a finite number"),
    (dict(expert_activation="swiglu_oai", swiglu_limit="7"), "swiglu_limit must be a finite positive number"),
])
def test_math_the_kernels_do_not_compute_is_one_line(declared, message):
    with pytest.raises(ColibriError, match=message) as e:
        layout(**declared)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("math", [ExpertFFN("swiglu_oai"), ExpertFFN("geglu_tanh"), ExpertFFN("swiglu", 0.5)])
def test_a_shard_computes_every_kind_as_the_local_block(tiny_model, math):
    """The fields the driver sends a Ray shard (`RemoteExperts.dispatch`) give its slots the bits
    of the local block's `ExpertFFN`, and another math gives other bits (the fields are used)."""
    from colibri_core.container import Container
    from colibri_core.remote.shard import ShardServer, identity

    c = Container(tiny_model)
    layer, mine = c.moe_layers[0], [1, 2, 6]
    shard = ShardServer(str(tiny_model), {layer: mine}, identity(c), warm=False)
    rng = np.random.default_rng(3)
    x = rng.normal(0, 2, (4, c.hidden)).astype(np.float32)
    ids = np.array([[1, 2], [6, 0], [2, 6], [3, 1]])
    held = np.isin(ids, mine)
    want = np.zeros((4, 2, c.hidden), np.float32)
    math(want, x, ids, {e: c.read_expert(layer, e) for e in mine})
    got = shard.compute(layer, x, np.where(held, ids, -1), c.activations, math.activation, math.limit, math.alpha)
    assert np.array_equal(got.view(np.uint32), want[held].view(np.uint32))
    plain = shard.compute(layer, x, np.where(held, ids, -1), c.activations, "swiglu", None)
    assert not np.allclose(plain, got)
    c.close()
