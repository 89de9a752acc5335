"""Kimi K3's parts against the `transformers` classes that implement the same math (partial oracles;
no transformers class implements K3 itself):

- KDA with the −5 lower-bounded decay: `glm5_next`'s Glm5NextTextLinearAttention
  (`linear_lower_bound`), its output gate made full rank (g_a_proj → identity, g_b_proj → a full
  [Hh·dv, H] matrix, K3's g_proj);
- gated NoPE MLA with a q_lora query: `kimi_linear`'s KimiLinearAttention, its o_proj input
  multiplied by σ(g_proj x) (K3's output gate);
- SiTU-GLU: `inkling2`'s Inkling2SoftcappedSwiGLU with caps 4 and 25.

Each compares colibri's part — as the K3 model runs it — with the oracle on a 70-token sequence
(the oracle's KDA prefill crosses its 64-token chunk), and the prefill-then-decode path with the
oracle's rows.
"""
import numpy as np
import pytest
import torch
from kimi_k3_reference import TINY_K3

from colibri_core.layers.kda import KDAState
from colibri_core.layers.mla import MLACache
from colibri_core.layers.situ import situ, situ_mlp
from colibri_kimi_k3.model import KimiK3

T = 70


def f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().numpy().copy()


def close(got: np.ndarray, want: np.ndarray, what: str, rel=1e-5):
    err, tol = np.abs(got - want).max(), rel * max(1.0, np.abs(want).max())
    assert err <= tol, f"{what}: max difference {err:.3g} > {tol:.3g}"


def k3_model(**text):
    """A KimiK3 without weights: its config (the tiny K3's, edited) and its layer builder."""
    model = object.__new__(KimiK3)
    model.cfg = KimiK3.parse_config({"text_config": {**TINY_K3, **text}})
    return model


@pytest.fixture(scope="module")
def x():
    torch.manual_seed(0)
    return torch.randn(1, T, TINY_K3["hidden_size"])


def test_kda_lower_bound_and_full_rank_gate_match_glm5_next(x):
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextLinearAttention

    H, lin = TINY_K3["hidden_size"], TINY_K3["linear_attn_config"]
    Hh, d = lin["num_heads"], lin["head_dim"]
    config = Glm5NextTextConfig(hidden_size=H, num_hidden_layers=1, linear_num_heads=Hh, linear_head_dim=d,
                                linear_conv_kernel_dim=lin["short_conv_kernel_size"], linear_lower_bound=-5.0,
                                rms_norm_eps=TINY_K3["rms_norm_eps"], hidden_act="silu",
                                layer_types=["linear_attention"], mlp_layer_types=["dense"], pad_token_id=0)
    torch.manual_seed(1)
    oracle = Glm5NextTextLinearAttention(config, 0)
    oracle.g_a_proj = torch.nn.Identity()  # K3's output gate is full rank: g_proj [Hh·dv, H]
    oracle.g_b_proj = torch.nn.Linear(H, Hh * d, bias=False)
    with torch.no_grad():
        fg = oracle.forget_gate
        fg.A_log.copy_(torch.log(torch.empty(Hh).uniform_(1, 16)))
        fg.dt_bias.copy_(torch.randn(Hh * d) * 0.5)
        oracle.o_norm.weight.add_(torch.randn(d) * 0.1)
        oracle.conv1d.weight.mul_(3)
        want = f32(oracle(x))[0]  # (T, H): prefill of the whole sequence, chunked

    n = Hh * d
    conv = f32(oracle.conv1d.weight)  # (3n, 1, K): q, k, v stacked
    sd = {"self_attn." + k: f32(v) for k, v in {
        "q_proj.weight": oracle.q_proj.weight, "k_proj.weight": oracle.k_proj.weight,
        "v_proj.weight": oracle.v_proj.weight, "f_a_proj.weight": fg.f_a_proj.weight,
        "f_b_proj.weight": fg.f_b_proj.weight, "A_log": torch.cat([fg.A_log, torch.zeros(2)]),  # K3 pads A_log
        "dt_bias": fg.dt_bias, "b_proj.weight": oracle.b_proj.weight, "g_proj.weight": oracle.g_b_proj.weight,
        "o_norm.weight": oracle.o_norm.weight, "o_proj.weight": oracle.o_proj.weight}.items()}
    sd.update({f"self_attn.{c}_conv1d.weight": conv[i * n:(i + 1) * n] for i, c in enumerate("qkv")})
    model = k3_model()
    layer = model._layer(weights(model.cfg, sd, 1), 1)
    xs = f32(x)[0]
    close(layer.mixer(xs, KDAState(model.cfg.kda)), want, "KDA prefill vs glm5_next (its chunked form)")
    state = KDAState(model.cfg.kda)  # prefill 66 tokens, then decode one by one
    parts = [layer.mixer(xs[:66], state)] + [layer.mixer(xs[t:t + 1], state) for t in range(66, T)]
    close(np.concatenate(parts), want, "KDA prefill + decode vs glm5_next")


def test_gated_mla_matches_kimi_linear_attention_with_an_output_gate(x):
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

    c = TINY_K3
    H, heads, vd = c["hidden_size"], c["num_attention_heads"], c["v_head_dim"]
    config = KimiLinearConfig(hidden_size=H, num_attention_heads=heads, num_key_value_heads=heads,
                              q_lora_rank=c["q_lora_rank"], kv_lora_rank=c["kv_lora_rank"],
                              qk_nope_head_dim=c["qk_nope_head_dim"], qk_rope_head_dim=c["qk_rope_head_dim"],
                              v_head_dim=vd, num_hidden_layers=1, pad_token_id=0, bos_token_id=0, eos_token_id=0,
                              vocab_size=16)
    config._attn_implementation = "eager"
    torch.manual_seed(2)
    oracle = KimiLinearAttention(config, 0)
    g_proj = torch.nn.Linear(H, heads * vd, bias=False)
    with torch.no_grad():
        oracle.q_a_layernorm.weight.add_(torch.randn(c["q_lora_rank"]) * 0.1)
        oracle.kv_a_layernorm.weight.add_(torch.randn(c["kv_lora_rank"]) * 0.1)
        hook = oracle.o_proj.register_forward_pre_hook(lambda m, args: (args[0] * torch.sigmoid(g_proj(x)),))
        mask = torch.triu(torch.full((T, T), float("-inf")), 1)[None, None]
        want = f32(oracle(x, mask)[0])[0]  # (T, H)
        hook.remove()

    a = {k: f32(v) for k, v in oracle.state_dict().items()}
    sd = {"self_attn." + k: v for k, v in a.items()}
    sd["self_attn.g_proj.weight"] = f32(g_proj.weight)
    model = k3_model()
    layer = model._layer(weights(model.cfg, sd, 3), 3)
    xs = f32(x)[0]
    close(layer.mixer(xs, MLACache(model.cfg.mla)), want, "gated MLA prefill vs kimi_linear")
    cache = MLACache(model.cfg.mla)
    parts = [layer.mixer(xs[:50], cache)] + [layer.mixer(xs[t:t + 1], cache) for t in range(50, T)]
    close(np.concatenate(parts), want, "gated MLA prefill + decode vs kimi_linear")


def test_situ_glu_matches_inkling2_softcapped_swiglu():
    from types import SimpleNamespace

    from transformers.models.inkling2.modeling_inkling2 import Inkling2SoftcappedSwiGLU

    oracle = Inkling2SoftcappedSwiGLU(SimpleNamespace(mlp_gate_softcap=4.0, mlp_up_softcap=25.0))
    rng = np.random.default_rng(3)
    g = np.concatenate([rng.standard_normal(4000) * 8, np.linspace(-90, 90, 361)]).astype(np.float32)
    u = np.concatenate([rng.standard_normal(4000) * 40, np.linspace(-200, 200, 361)]).astype(np.float32)
    want = f32(oracle(torch.from_numpy(g), torch.from_numpy(u)))
    close(situ(g, u), want, "SiTU-GLU vs inkling2", rel=1e-6)
    # the MLP around it (dense layer, shared experts, each routed expert)
    x = rng.standard_normal((9, 32)).astype(np.float32)
    gate, up, down = (rng.standard_normal(s).astype(np.float32) for s in ((24, 32), (24, 32), (32, 24)))
    with torch.no_grad():
        t = lambda a: torch.from_numpy(a)  # noqa: E731
        want = f32(torch.nn.functional.linear(oracle(t(x) @ t(gate).T, t(x) @ t(up).T), t(down)))
    close(situ_mlp(x, gate, up, down), want, "SiTU MLP vs inkling2")


def weights(cfg, sd: dict, i: int):
    """Layer i's tensors by checkpoint name: the oracle's (`sd`, by name within the layer), and zeros
    of the right shape for those the test does not look at (norms, the MLP)."""
    shapes = KimiK3.resident_shapes(cfg)

    def get(name):
        local = name.split(f"layers.{i}.", 1)[1]
        return sd[local] if local in sd else np.zeros(shapes[name], np.float32)

    return get
