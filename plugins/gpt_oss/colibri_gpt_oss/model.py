"""GPT-OSS (openai/gpt-oss-20b, gpt-oss-120b): the whole architecture, top to bottom.

Reference: transformers/models/gpt_oss/modeling_gpt_oss.py (the oracle the conformance suite uses).
Every layer: RMSNorm → GQA with q/k/v/o biases, YaRN RoPE (rotate-half, cos/sin × the attention
factor) and a learned sink logit per head in the softmax, over the whole context ("full_attention")
or the last `sliding_window` tokens ("sliding_attention", alternating; the cache holds only the
window) → residual → RMSNorm → MoE (router: linear with bias → top-k → softmax over the k; experts
with gate/up/down biases and the clamped SwiGLU with alpha 1.702, limit 7 and "+1": the core's
`swiglu_oai`) → residual. Final RMSNorm, untied lm_head.

The experts are stored fused and transposed: gate_up_proj (E, H, 2I) with gate and up alternating
along 2I, down_proj (E, I, H) (declared so in `tensors`: (in, out) axes, `interleaved`), their biases
(E, 2I) and (E, H) beside them (resident, float32). The official release holds the experts in
MXFP4 (`gate_up_proj_blocks` / `_scales`, `down_proj_blocks` / `_scales`, rows = output units):
run as they are (`Experts(native="fp4")`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import numpy as np

from colibri_core import kv
from colibri_core.errors import ColibriError
from colibri_core.kv.cache import KVCache, WindowKV
from colibri_core.layers.attention import AttnBlock, gqa_block
from colibri_core.layers.norm import rms_norm
from colibri_core.layers.rope import Rope, yarn_inv_freq
from colibri_core.layers.router import TopKSoftmax
from colibri_core.model import MoEModel, dense, embed, linear
from colibri_core.probe import record
from colibri_core.tensors import Dim, Experts, Tensor, TensorTable

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class GptOssConfig:
    vocab_size: int
    hidden_size: int  # H
    intermediate_size: int  # I: width of one expert
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_local_experts: int  # E routed experts per layer
    num_experts_per_tok: int  # top-k
    sliding_window: int  # tokens a sliding layer's query sees, its own included
    layer_types: tuple[str, ...]  # per layer: "sliding_attention" | "full_attention"
    rms_norm_eps: float
    rope_theta: float
    yarn: tuple[float, int, float, float, bool] | None  # (factor, original_max_position, beta_fast, beta_slow, truncate)
    attention_factor: float  # cos and sin are multiplied by it (YaRN's mscale; 1 without YaRN)
    swiglu_limit: float
    swiglu_alpha: float

    @classmethod
    def from_hf(cls, c: dict) -> GptOssConfig:
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}  # released configs: rope_scaling
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise ColibriError(f"GPT-OSS with rope_type {rope_type!r} is not supported (default or yarn)")
        layers = c["num_hidden_layers"]
        types = tuple(c.get("layer_types") or (LAYER_TYPES[i % 2] for i in range(layers)))
        odd = [t for t in types if t not in LAYER_TYPES]
        if odd or len(types) != layers:
            raise ColibriError(f"layer_types must name {layers} layers, each {' or '.join(LAYER_TYPES)}; got "
                               f"{len(types)}{f' with {odd[0]!r}' if odd else ''}")
        if c.get("tie_word_embeddings"):
            raise ColibriError("GPT-OSS with tied embeddings is not supported (the released models untie them)")
        yarn, factor = None, 1.0
        if rope_type == "yarn":
            factor = float(rope.get("factor") or c["max_position_embeddings"] / rope["original_max_position_embeddings"])
            yarn = (factor, int(rope["original_max_position_embeddings"]), float(rope.get("beta_fast") or 32),
                    float(rope.get("beta_slow") or 1), bool(rope.get("truncate", True)))
        attention_factor = rope.get("attention_factor")
        if attention_factor is None:
            attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0  # YaRN's get_mscale
        heads = c["num_attention_heads"]
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads, num_local_experts=c["num_local_experts"],
            num_experts_per_tok=c.get("num_experts_per_tok") or c["experts_per_token"],
            sliding_window=c.get("sliding_window") or 128, layer_types=types, rms_norm_eps=c.get("rms_norm_eps", 1e-5),
            rope_theta=rope.get("rope_theta", c.get("rope_theta", 150000.0)), yarn=yarn,
            attention_factor=float(attention_factor), swiglu_limit=float(c.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(c.get("swiglu_alpha", 1.702)),
        )


LAYER = "model.layers.{layer}."


class GptOss(MoEModel):
    @classmethod
    def parse_config(cls, config: dict) -> GptOssConfig:
        return GptOssConfig.from_hf(config)

    @classmethod
    def tensors(cls, cfg: GptOssConfig) -> TensorTable:
        """Every tensor, once: the experts saved fused only, transposed, gate and up alternating."""
        H, E, I = Dim("H", cfg.hidden_size), Dim("E", cfg.num_local_experts), Dim("I", cfg.intermediate_size)
        V, D, heads = cfg.vocab_size, cfg.head_dim, cfg.num_attention_heads
        q, kv_ = heads * D, cfg.num_key_value_heads * D
        layer = partial(Tensor, layers=range(cfg.num_hidden_layers))
        return TensorTable(
            resident=dict(
                embed=Tensor("model.embed_tokens.weight", (V, H)),
                input_norm=layer(LAYER + "input_layernorm.weight", (H,)),
                post_norm=layer(LAYER + "post_attention_layernorm.weight", (H,)),
                q=layer(LAYER + "self_attn.q_proj.weight", (q, H)), q_bias=layer(LAYER + "self_attn.q_proj.bias", (q,)),
                k=layer(LAYER + "self_attn.k_proj.weight", (kv_, H)), k_bias=layer(LAYER + "self_attn.k_proj.bias", (kv_,)),
                v=layer(LAYER + "self_attn.v_proj.weight", (kv_, H)), v_bias=layer(LAYER + "self_attn.v_proj.bias", (kv_,)),
                o=layer(LAYER + "self_attn.o_proj.weight", (H, q)), o_bias=layer(LAYER + "self_attn.o_proj.bias", (H,)),
                sinks=layer(LAYER + "self_attn.sinks", (heads,)),
                router_bias=layer(LAYER + "mlp.router.bias", (E,)),
                gate_up_bias=layer(LAYER + "mlp.experts.gate_up_proj_bias", (E, 2 * I), f32=True),  # alternating
                down_bias=layer(LAYER + "mlp.experts.down_proj_bias", (E, H), f32=True),
                norm=Tensor("model.norm.weight", (H,)),
                lm_head=Tensor("lm_head.weight", (V, H)),
            ),
            experts=Experts(
                layers=range(cfg.num_hidden_layers), n=E, hidden=H, intermediate=I, top_k=cfg.num_experts_per_tok,
                router=Tensor(LAYER + "mlp.router.weight", (E, H)),  # float32
                gate_up=Tensor(LAYER + "mlp.experts.gate_up_proj", (E, H, 2 * I)),  # (in, out): x @ W
                down_fused=Tensor(LAYER + "mlp.experts.down_proj", (E, I, H)), interleaved=True,
                activation="swiglu_oai", limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha,
                native="fp4",  # the official release: MXFP4 experts (E2M1, a UE8M0 scale per 32)
            ),
        )

    @classmethod
    def state_floats_per_token(cls, cfg: GptOssConfig) -> list[int]:
        """K and V on full-attention layers; a sliding layer's window is fixed (`fixed_state_floats`)."""
        return [2 * cfg.num_key_value_heads * cfg.head_dim * (t == "full_attention") for t in cfg.layer_types]

    @classmethod
    def kv_cache_floats_per_token(cls, cfg: GptOssConfig) -> list[int]:
        return cls.state_floats_per_token(cfg)  # all of it in KVCaches (the engine's cache type)

    @classmethod
    def fixed_state_floats(cls, cfg: GptOssConfig) -> int:
        """The sliding layers' windows: the last window − 1 tokens' K and V each."""
        sliding = sum(t == "sliding_attention" for t in cfg.layer_types)
        return sliding * 2 * cfg.num_key_value_heads * cfg.head_dim * (cfg.sliding_window - 1)

    def __init__(self, cfg: GptOssConfig, weights, store):
        super().__init__(cfg, weights, store)
        table = self.tensors(cfg)
        top = table.take(weights)
        self.embed_tokens = top["embed"]  # (V, H)
        self.layers = []
        for i, kind in enumerate(cfg.layer_types):
            w = table.take(weights, i)
            gate_up_bias = dense(w["gate_up_bias"])  # (E, 2I): gate and up alternating
            self.layers.append(dict(
                attn=AttnBlock(  # the attention sub-block, one C call (layers.attention.gqa_block)
                    w["input_norm"],  # (H,)
                    w["q"], w["k"], w["v"],  # (heads * D, H), (kv_heads * D, H), (kv_heads * D, H)
                    w["o"],  # (H, heads * D)
                    heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                    eps=cfg.rms_norm_eps, scale=cfg.head_dim ** -0.5,
                    q_bias=w["q_bias"], k_bias=w["k_bias"],  # (heads * D,), (kv_heads * D,)
                    v_bias=w["v_bias"], o_bias=w["o_bias"],  # (kv_heads * D,), (H,)
                    sinks=w["sinks"],  # (heads,)
                    window=cfg.sliding_window if kind == "sliding_attention" else None),
                post_norm=w["post_norm"],  # (H,)
                router=TopKSoftmax(w["router"], cfg.num_experts_per_tok, bias=w["router_bias"],  # (E, H), (E,)
                                   input=partial(rms_norm, weight=w["post_norm"], eps=cfg.rms_norm_eps)),
                expert_biases=(gate_up_bias[:, 0::2], gate_up_bias[:, 1::2], dense(w["down_bias"])),
            ))
        self.norm = top["norm"]  # (H,)
        self.lm_head = top["lm_head"]  # (V, H)
        inv_freq = None if cfg.yarn is None else yarn_inv_freq(cfg.head_dim, cfg.rope_theta, *cfg.yarn)
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, inv_freq)

    def new_state(self, kv_cache: str = "f32") -> kv.SequenceState:
        """Per layer ("layer.{i}"): the KV cache of a full-attention layer, the window of a sliding one."""
        cfg, Hkv, D = self.cfg, self.cfg.num_key_value_heads, self.cfg.head_dim
        return kv.SequenceState({f"layer.{i}": KVCache(Hkv, D, kv_cache) if kind == "full_attention"
                                 else WindowKV(Hkv, D, cfg.sliding_window)  # float32 whatever kv_cache
                                 for i, kind in enumerate(cfg.layer_types)})

    def routers(self) -> dict:
        """Every layer: linear with bias, top-k, softmax over the k, on the post-attention RMSNorm."""
        return {i: L["router"] for i, L in enumerate(self.layers)}

    def expert_biases(self) -> dict:
        """Every layer: the experts' gate (E, I), up (E, I) and down (E, H) biases."""
        return {i: L["expert_biases"] for i, L in enumerate(self.layers)}

    def forward(self, ids: np.ndarray, state: kv.SequenceState, last_only: bool = False) -> np.ndarray:
        cfg = self.cfg
        T = len(ids)
        cos, sin = self.rope.cos_sin(np.arange(state.length, state.length + T))  # (T, D)
        factor = np.float32(cfg.attention_factor)
        cos, sin = cos * factor, sin * factor  # YaRN's attention factor, as transformers scales them
        h = embed(ids, self.embed_tokens)  # (T, H)
        for i, L in enumerate(self.layers):
            # ---- attention: RMSNorm → q, k, v (+ biases) → RoPE → GQA with sinks (windowed) → o_proj (+ bias), + h
            h = gqa_block(L["attn"], h, state[f"layer.{i}"], cos, sin)  # (T, H)
            # ---- routed experts
            x = rms_norm(h, L["post_norm"], cfg.rms_norm_eps)
            h = h + self.moe(i, x, h, ids)
            record(i, l_out=h)  # the residual stream after layer i (for whoever debugs: colibri_core.probe)
        state.advance(T)
        if last_only:
            h = h[-1:]
        return linear(rms_norm(h, self.norm, cfg.rms_norm_eps), self.lm_head)  # (T, V)
