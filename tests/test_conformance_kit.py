"""The conformance kit checks itself: on a deliberately broken plugin — OLMoE served under another
architecture name, broken in one place at a time — each stricter check fails, and its message names
the check, the layer and the position. Also: transformers' routers are found through the plugin's
(renamed, they are still compared; a declared router found nowhere fails loudly); a layout that
names its experts only fused round-trips; a conversion that fails is reported as itself, for every
test that asks for that quantisation. One tiny oracle (3 layers, 4 experts) for the module."""
import dataclasses
import types

import numpy as np
import pytest
from transformers import OlmoeConfig

from colibri_core import plugins
from colibri_core.hookspecs import Architecture, hookimpl
from colibri_core.layers.attention import gqa_attention
from colibri_core.layers.norm import rms_norm
from colibri_core.layers.rope import apply_rotate_half
from colibri_core.layers.router import SoftmaxTopK
from colibri_core.layout import ExpertNames
from colibri_core.model import embed, linear, linears
from colibri_core.probe import record
from colibri_core.container import dequantize as dequantize_container
from colibri_core.quant import dequantize
from colibri_core.testing import ConformanceSuite, checks
from colibri_core.testing.oracle import Oracle
from colibri_olmoe.model import Olmoe

ARCH = "olmoe_broken_for_the_kit"
FUSED_ARCH = "olmoe_fused_only_for_the_kit"


class ShiftedExperts(SoftmaxTopK):
    """Routes with the checkpoint's gate, then sends each token to the next experts (e ↦ e + 1 mod E)."""

    def __init__(self, router: SoftmaxTopK, n_experts: int):
        super().__init__(router.weight, router.k, router.renormalize, input=router.input)
        self.n_experts = n_experts

    def route(self, x, token_ids):
        weights, ids = super().route(x, token_ids)
        return weights, (ids + 1) % self.n_experts


class BrokenOlmoe(Olmoe):
    """OLMoE with one fault, chosen by `BrokenOlmoe.fault` (None: none):

    - "q_norm": layer 1 skips its q-norm (attention);
    - "router": layer 2 routes to the wrong experts (the checkpoint's gate, its choice shifted);
    - "router_weight": layer 2's router holds its gate with the rows reversed (no tensor of the model);
    - "weights": layer 2 renormalises its top-k weights (the right experts, the wrong weights);
    - "predict": layer 1's declared router predicts from the raw residual stream (no norm);
    - "lookahead": layer 2's lookahead predicts layer 0, which runs before it;
    - "kv_cache": declares none of its state in KV caches (`kv_cache_floats_per_token`).
    """

    fault: str | None = None

    def routers(self) -> dict:
        out = super().routers()
        cfg = self.cfg
        if self.fault == "router":
            out[2] = ShiftedExperts(out[2], cfg.num_experts)
        elif self.fault == "router_weight":
            r = out[2]
            out[2] = SoftmaxTopK(np.ascontiguousarray(dequantize(r.weight)[::-1]), r.k, r.renormalize, input=r.input)
        elif self.fault == "weights":
            out[2] = SoftmaxTopK(out[2].weight, out[2].k, not cfg.norm_topk_prob, input=out[2].input)
        elif self.fault == "predict":
            out[1] = SoftmaxTopK(out[1].weight, out[1].k, out[1].renormalize)  # input: the identity
        return out

    @classmethod
    def kv_cache_floats_per_token(cls, cfg):
        return [0] * cfg.num_hidden_layers if cls.fault == "kv_cache" else super().kv_cache_floats_per_token(cfg)

    def lookahead(self):
        return {0: 1, 1: 2, 2: 0} if self.fault == "lookahead" else None

    def forward(self, ids, state, last_only=False):  # Olmoe.forward, with the q-norm fault
        cfg = self.cfg
        T = len(ids)
        cos, sin = self.rope.cos_sin(np.arange(state.length, state.length + T))
        h = embed(ids, self.embed_tokens)
        for i, L in enumerate(self.layers):
            A = L.mixer  # the layer's kernels.AttnBlock, run step by step
            x = rms_norm(h, A.norm, cfg.rms_norm_eps)
            q, k, v = linears(x, (A.wq, A.wk, A.wv))
            if not (self.fault == "q_norm" and i == 1):
                q = rms_norm(q, A.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, A.k_norm, cfg.rms_norm_eps)
            q = apply_rotate_half(q.reshape(T, cfg.num_attention_heads, cfg.head_dim), cos, sin)
            k = apply_rotate_half(k.reshape(T, cfg.num_key_value_heads, cfg.head_dim), cos, sin)
            v = v.reshape(T, cfg.num_key_value_heads, cfg.head_dim)
            h = h + linear(gqa_attention(q, k, v, state[f"layer.{i}"], cfg.head_dim ** -0.5), A.wo)
            x = rms_norm(h, L.post_norm, cfg.rms_norm_eps)
            h = h + self.moe(i, x, h, ids)
            record(i, l_out=h)
        state.advance(T)
        if last_only:
            h = h[-1:]
        return linear(rms_norm(h, self.norm, cfg.rms_norm_eps), self.lm_head)


class BrokenSuite(ConformanceSuite):  # not collected (no Test prefix): the tests below drive its checks
    hf_config = OlmoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, initializer_range=0.1,
        max_position_embeddings=128, eos_token_id=2,  # an id in the tiny vocabulary
    )
    config_edits = {"architectures": ["BrokenOlmoeForCausalLM"]}  # served by BrokenOlmoe, not colibri-olmoe
    prompt_tokens = 8
    new_tokens = 8


class FusedOnlyOlmoe(Olmoe):
    """OLMoE whose layout names its experts only fused ((E, 2I, H) gate_up, (E, H, I) down), as for a
    model whose checkpoints never held per-expert tensors."""

    @classmethod
    def layout(cls, cfg):
        layout = super().layout(cfg)
        fused = ExpertNames(per_expert={}, fused_gate_up=layout.experts.fused_gate_up, fused_down=layout.experts.fused_down)
        return dataclasses.replace(layout, experts=fused)


class FusedOnlySuite(BrokenSuite):
    config_edits = {"architectures": ["FusedOnlyOlmoeForCausalLM"]}  # served by FusedOnlyOlmoe


@hookimpl
def colibri_register_architectures(register):
    for name, cls in ((ARCH, "BrokenOlmoe"), (FUSED_ARCH, "FusedOnlyOlmoe")):
        register(Architecture(name=name, hf_architectures=(f"{cls}ForCausalLM",), model_types=(),
                              model=f"{__name__}:{cls}"))


@pytest.fixture(scope="module")
def registered():
    """This module's plugins (BrokenOlmoe, FusedOnlyOlmoe), registered while its tests run."""
    reg = plugins.registry()
    module = types.ModuleType("colibri_broken_olmoe")
    module.colibri_register_architectures = colibri_register_architectures
    reg.add("broken-olmoe", "colibri-broken-olmoe", "0.0", module)
    try:
        yield
    finally:
        reg.pm.unregister(module)
        reg.plugins.pop("broken-olmoe", None)
        reg.architectures.pop(ARCH, None)
        reg.architectures.pop(FUSED_ARCH, None)


@pytest.fixture(scope="module")
def oracle(registered, tmp_path_factory):
    return Oracle(BrokenSuite, tmp_path_factory.mktemp("broken"))


@pytest.fixture
def fault(oracle, monkeypatch):
    def set_fault(name):
        monkeypatch.setattr(BrokenOlmoe, "fault", name)
        oracle.forget_engine()

    yield set_fault
    oracle.forget_engine()


def failure(check, *args) -> str:
    with pytest.raises(checks.ConformanceFailure) as e:
        check(*args)
    print(e.value)
    return str(e.value)


def test_unbroken_passes(oracle, fault):
    """The control: without a fault, every check the tests below break passes on the same oracle."""
    fault(None)
    tol = BrokenSuite.rel_tol
    checks.check_greedy(oracle, "f32", BrokenSuite.new_tokens, tol)
    checks.check_logits(oracle, "int4", oracle.logits_ids, tol)
    checks.check_lookahead_predicts_routing(oracle, oracle.logits_ids)
    checks.check_moe_layers(oracle, oracle.logits_ids)
    checks.check_kv_cache_floats(oracle)


def test_skipped_q_norm_fails_greedy_at_a_position_and_logits_at_layer_1_attention(oracle, fault):
    fault("q_norm")
    message = failure(checks.check_greedy, oracle, "f32", BrokenSuite.new_tokens, BrokenSuite.rel_tol)
    assert message.startswith("greedy_f32: position ") and "colibri chose token" in message and "not a tie" in message
    assert "layer 1, attention" in message  # the greedy failure also says where the model diverges
    message = failure(checks.check_logits, oracle, "int4", oracle.logits_ids, BrokenSuite.rel_tol)
    assert message.startswith("logits_int4: max |logit difference|") and " at position " in message
    assert "first divergence: layer 1, attention" in message and "layers before 1 agree" in message


def test_wrong_experts_are_named_as_the_router(oracle, fault):
    fault("router")
    message = failure(checks.check_logits, oracle, "f32", oracle.logits_ids, BrokenSuite.rel_tol)
    assert "first divergence: layer 2, router (the experts chosen): colibri routes to experts" in message
    assert " at position " in message


def _routed_by_router(self, hidden_states):  # OlmoeSparseMoeBlock.forward, through `self.router`
    B, T, H = hidden_states.shape
    flat = hidden_states.view(-1, H)  # (T, H)
    _, weights, ids = self.router(flat)
    return self.experts(flat, ids, weights).reshape(B, T, H)


def test_a_router_at_another_module_name_is_still_compared(oracle, fault, monkeypatch):
    """transformers' routers renamed `mlp.router` (GPT-OSS's name) in the module tree and the forward:
    found through the plugin's declared routers (their weights), so routing is still compared, and a
    router sending tokens to the wrong experts is named as the router."""
    fault(None)
    for layer in oracle.model.model.layers:
        block = layer.mlp
        modules = dict(block._modules)
        modules["router"] = modules.pop("gate")
        monkeypatch.setattr(block, "_modules", modules)
        monkeypatch.setattr(block, "forward", types.MethodType(_routed_by_router, block))
    monkeypatch.setattr(oracle, "_memo", {})  # the oracle's passes again, on the renamed model
    assert not [name for name, _ in oracle.model.named_modules() if name.endswith(".gate")]
    assert oracle.routers().modules == {i: f"model.layers.{i}.mlp.router" for i in range(3)}
    checks.check_moe_layers(oracle, oracle.logits_ids)
    ref = oracle.trace("f32", oracle.logits_ids)
    assert ref.layers("ffn_moe_ids") == ref.layers("ffn_inp") == ref.layers("ffn_norm") == [0, 1, 2]
    fault("router")
    message = failure(checks.check_logits, oracle, "f32", oracle.logits_ids, BrokenSuite.rel_tol)
    assert "first divergence: layer 2, router (the experts chosen): colibri routes to experts" in message


def test_a_declared_router_found_nowhere_fails_loudly(oracle, fault):
    """A router whose weight is no tensor of transformers' model (its rows reversed): its routing cannot
    be compared, so moe_layers fails at its layer, and the logits check blames the router or the
    experts there, never saying that routing agrees."""
    fault("router_weight")
    message = failure(checks.check_moe_layers, oracle, oracle.logits_ids)
    assert message.startswith("moe_layers: layer 2: transformers' routing cannot be compared: its router's weight "
                              "(4, 32), by which the kit finds transformers' router, equals no parameter of "
                              "transformers' model")
    message = failure(checks.check_logits, oracle, "f32", oracle.logits_ids, BrokenSuite.rel_tol)
    assert "first divergence: layer 2, router or experts (transformers' routing was not recorded here: " in message


def test_wrong_expert_weights_are_named_as_the_router(oracle, fault):
    fault("weights")
    message = failure(checks.check_logits, oracle, "f32", oracle.logits_ids, BrokenSuite.rel_tol)
    assert "first divergence: layer 2, router (the weights of the experts chosen" in message


def test_a_predictor_that_is_not_the_routing_fails_at_its_layer(oracle, fault):
    fault("predict")
    checks.check_logits(oracle, "f32", oracle.logits_ids, BrokenSuite.rel_tol)  # routing itself is right
    message = failure(checks.check_lookahead_predicts_routing, oracle, oracle.logits_ids)
    assert message.startswith("lookahead_predicts_routing: layer 1, position ")


def test_a_lookahead_to_an_earlier_layer_fails_moe_layers(oracle, fault):
    fault("lookahead")
    message = failure(checks.check_moe_layers, oracle, oracle.logits_ids)
    assert message == ("moe_layers: layer 2's lookahead predicts layer 0, which the forward pass runs before it")


def test_an_undeclared_kv_cache_fails_kv_cache_floats(oracle, fault):
    fault("kv_cache")
    message = failure(checks.check_kv_cache_floats, oracle)
    assert message.startswith("kv_cache_floats: after a 8-token prompt the state holds 3072 bytes fewer under "
                              "kv_cache='f16' than under 'f32', but kv_cache_floats_per_token [0, 0, 0] says 0")


def test_a_tie_is_accepted_only_below_the_tolerance_and_the_comparison_goes_on(oracle, fault, monkeypatch):
    """The oracle's greedy run is replaced by one that takes its runner-up at position 3 and then
    continues greedily: with a tolerance above the oracle's top-1/top-2 gap there, colibri's token
    is a tie, reported, and the rest is compared teacher-forced from the oracle's token (and agrees);
    with the kit's tolerance it is a failure naming the position, both tokens and the gap."""
    import torch

    fault(None)
    n, P = BrokenSuite.new_tokens, len(oracle.prompt)
    real = oracle.hf_greedy("f32", n)
    ref = oracle.trace("f32", oracle.prompt + real).logits[P - 1 + 3]
    runner_up = int(np.argsort(ref)[-2])
    with torch.no_grad():
        out = oracle.model.generate(torch.tensor([oracle.prompt + real[:3] + [runner_up]]), max_new_tokens=n - 4,
                                    min_new_tokens=n - 4, do_sample=False, pad_token_id=0)
    forced = real[:3] + [runner_up] + out[0, P + 4:].tolist()
    monkeypatch.setitem(oracle._memo, ("hf_greedy", "f32", n), forced)
    gap = float(np.sort(ref)[-1] - np.sort(ref)[-2])
    loose = 1.5 * gap / float(np.abs(ref).max())
    with pytest.warns(checks.TieWarning, match="position 3"):
        ties = checks.check_greedy(oracle, "f32", n, loose)
    assert len(ties) == 1 and ties[0].startswith(f"position 3: colibri {real[3]}, transformers {runner_up}")
    message = failure(checks.check_greedy, oracle, "f32", n, BrokenSuite.rel_tol)
    assert message.startswith(f"greedy_f32: position 3 (new token 4 of {n} after the {P}-token prompt): colibri "
                              f"chose token {real[3]}, transformers {runner_up}; the oracle's logit for its token "
                              f"is {-gap:+.3g} over colibri's")
    assert f"top-1/top-2 gap is {gap:.3g}" in message and "not a tie" in message


def test_a_failed_conversion_is_reported_as_itself_every_time(oracle, monkeypatch):
    """The real conversion error, for the container and the oracle, on every call; nothing left on disk
    (no oracle-int8 directory for a later call to trip over)."""
    calls = []

    def convert(src, dst, q):
        calls.append(q)
        raise RuntimeError(f"the converter broke at {q}")

    monkeypatch.setattr(oracle, "convert", convert)
    monkeypatch.setattr(oracle, "_failed", {})
    monkeypatch.setattr(oracle, "_containers", {})
    monkeypatch.setattr(oracle, "_oracles", {"f32": oracle.model})
    for ask in (oracle.oracle, oracle.container, oracle.oracle):
        with pytest.raises(RuntimeError, match="the converter broke at int8"):
            ask("int8")
    assert calls == ["int8"], "the failed conversion was retried"
    assert not (oracle.root / "oracle-int8").exists()


def test_an_unsupported_name_that_is_no_check_fails_loudly():
    """`unsupported={"plan_matches_container": ...}` (the test's name, not the check's) left the plan
    check running, unnoticed; now every test of the suite fails and lists the names."""
    import pytest

    from colibri_core.testing.conformance import CHECKS, ConformanceSuite

    class Suite(ConformanceSuite):
        unsupported = {"plan_matches_container": "a typo"}

    with pytest.raises(pytest.fail.Exception, match="'plan_matches_container', which is no check"):
        Suite()._check("plan")
    Suite.unsupported = {"plan": "why"}
    with pytest.raises(pytest.skip.Exception, match="declares plan unsupported: why"):
        Suite()._check("plan")
    assert "moe_layers" in CHECKS and "greedy_int4" in CHECKS


def test_a_layout_naming_only_fused_experts_round_trips(registered, tmp_path_factory, tmp_path, monkeypatch):
    """A plugin whose layout names its experts only fused converts the oracle's fused save, and each of
    its tensors round-trips (fused (E, 2I, H) / (E, H, I), quantised per row); a container whose fused
    gate_up comes back with gate and up swapped fails, naming the tensor."""
    oracle = Oracle(FusedOnlySuite, tmp_path_factory.mktemp("fused-only"))
    assert oracle.checkpoint == oracle.fused_checkpoint
    for q in ("f32", "int4"):
        checks.check_container_round_trip(oracle, q, tmp_path / q)
    name = "model.layers.1.mlp.experts.gate_up_proj"

    def swapped(model_dir):
        out = dequantize_container(model_dir)
        gate, up = np.split(out[name], 2, axis=1)  # (E, I, H) each
        out[name] = np.concatenate([up, gate], axis=1)
        return out

    monkeypatch.setattr(checks, "dequantize", swapped)
    message = failure(checks.check_container_round_trip, oracle, "int4", tmp_path / "swapped")
    assert message.startswith(f"container_round_trip: at int4, from hf-fused/: {name} [4, 32, 32] differs after "
                              "the round trip by up to ")
