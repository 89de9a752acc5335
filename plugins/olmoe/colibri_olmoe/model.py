"""OLMoE (allenai/OLMoE-1B-7B): the whole architecture, top to bottom.

Reference: transformers/models/olmoe/modeling_olmoe.py (the oracle the conformance suite uses).
Every layer: RMSNorm → MHA/GQA with QK-norm over the *full* projected width and rotate-half RoPE
→ residual → RMSNorm → MoE (softmax over all experts, top-k, not renormalised unless
``norm_topk_prob``; no shared expert) → residual. Final RMSNorm, untied lm_head.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from colibri_core import kv
from colibri_core.errors import ColibriError
from colibri_core.kv.cache import KVCache
from colibri_core.layers.attention import AttnBlock, gqa_block
from colibri_core.layers.norm import rms_norm
from colibri_core.layers.rope import Rope
from colibri_core.layers.router import SoftmaxTopK
from colibri_core.layout import ContainerLayout, ExpertNames
from colibri_core.model import MoEModel, embed, linear
from colibri_core.probe import record


@dataclass(frozen=True)
class OlmoeConfig:
    vocab_size: int
    hidden_size: int  # H
    intermediate_size: int  # I: width of one expert
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # hidden_size // num_attention_heads
    num_experts: int  # E routed experts per layer
    num_experts_per_tok: int  # top-k
    norm_topk_prob: bool  # renormalise the top-k weights (False for OLMoE-1B-7B)
    rms_norm_eps: float
    rope_theta: float
    clip_qkv: float | None  # clamp q, k, v to ±clip_qkv (None: no clamp)

    @classmethod
    def from_hf(cls, c: dict) -> OlmoeConfig:
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}  # released configs: rope_scaling
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ColibriError(f"OLMoE with rope_type {rope_type!r} is not supported (only default RoPE)")
        heads = c["num_attention_heads"]
        if not c.get("head_dim") and c["hidden_size"] % heads:  # head_dim = hidden_size / heads must be whole
            raise ColibriError(f"hidden_size {c['hidden_size']} is not a multiple of num_attention_heads {heads}")
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
            num_hidden_layers=c["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=c.get("num_key_value_heads") or heads, head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            num_experts=c["num_experts"], num_experts_per_tok=c["num_experts_per_tok"],
            norm_topk_prob=bool(c.get("norm_topk_prob", False)), rms_norm_eps=c.get("rms_norm_eps", 1e-5),
            rope_theta=rope.get("rope_theta", c.get("rope_theta", 10000.0)), clip_qkv=c.get("clip_qkv"),
        )


LAYER = "model.layers.{layer}"
RESIDENT_PER_LAYER = (  # every non-expert tensor of one layer
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate.weight",
)


class Olmoe(MoEModel):
    @classmethod
    def parse_config(cls, config: dict) -> OlmoeConfig:
        return OlmoeConfig.from_hf(config)

    @classmethod
    def layout(cls, cfg: OlmoeConfig) -> ContainerLayout:
        per_layer = [f"{LAYER}.{name}".format(layer=i) for i in range(cfg.num_hidden_layers) for name in RESIDENT_PER_LAYER]
        expert = LAYER + ".mlp.experts.{expert}"
        return ContainerLayout(
            resident=("model.embed_tokens.weight", *per_layer, "model.norm.weight", "lm_head.weight"),
            keep_f32=(r"\.mlp\.gate\.weight$",),  # the router
            moe_layers=tuple(range(cfg.num_hidden_layers)),
            n_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, hidden=cfg.hidden_size, intermediate=cfg.intermediate_size,
            experts=ExpertNames(
                per_expert={"gate": expert + ".gate_proj.weight", "up": expert + ".up_proj.weight",
                            "down": expert + ".down_proj.weight"},
                fused_gate_up=LAYER + ".mlp.experts.gate_up_proj",
                fused_down=LAYER + ".mlp.experts.down_proj",
            ),
        )

    @classmethod
    def resident_shapes(cls, cfg: OlmoeConfig) -> dict[str, tuple[int, ...]]:
        H, V, D = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
        q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
        per_layer = {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
                     "self_attn.q_proj.weight": (q, H), "self_attn.k_proj.weight": (kv, H),
                     "self_attn.v_proj.weight": (kv, H), "self_attn.o_proj.weight": (H, q),
                     "self_attn.q_norm.weight": (q,), "self_attn.k_norm.weight": (kv,),
                     "mlp.gate.weight": (cfg.num_experts, H)}
        layers = {f"{LAYER}.{name}".format(layer=i): per_layer[name]
                  for i in range(cfg.num_hidden_layers) for name in RESIDENT_PER_LAYER}
        return {"model.embed_tokens.weight": (V, H), **layers, "model.norm.weight": (H,), "lm_head.weight": (V, H)}

    @classmethod
    def state_floats_per_token(cls, cfg: OlmoeConfig) -> list[int]:
        return [2 * cfg.num_key_value_heads * cfg.head_dim] * cfg.num_hidden_layers  # K and V

    @classmethod
    def kv_cache_floats_per_token(cls, cfg: OlmoeConfig) -> list[int]:
        return cls.state_floats_per_token(cfg)  # all of it in KVCaches (the engine's cache type)

    def __init__(self, cfg: OlmoeConfig, weights, store):
        super().__init__(cfg, weights, store)
        self.embed_tokens = weights("model.embed_tokens.weight")  # (V, H)
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            w = lambda name: weights(f"{LAYER}.{name}".format(layer=i))  # noqa: E731
            post_norm = w("post_attention_layernorm.weight")  # (H,)
            self.layers.append(dict(
                attn=AttnBlock(  # the attention sub-block, one C call (layers.attention.gqa_block)
                    w("input_layernorm.weight"),  # (H,)
                    w("self_attn.q_proj.weight"),  # (heads * D, H)
                    w("self_attn.k_proj.weight"),  # (kv_heads * D, H)
                    w("self_attn.v_proj.weight"),  # (kv_heads * D, H)
                    w("self_attn.o_proj.weight"),  # (H, heads * D)
                    heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                    eps=cfg.rms_norm_eps, scale=cfg.head_dim ** -0.5,
                    qk_norm="whole",  # QK-norm over the full projected width, not per head
                    q_norm=w("self_attn.q_norm.weight"),  # (heads * D,)
                    k_norm=w("self_attn.k_norm.weight"),  # (kv_heads * D,)
                    clip=cfg.clip_qkv),
                post_norm=post_norm,
                router=SoftmaxTopK(w("mlp.gate.weight"), cfg.num_experts_per_tok, cfg.norm_topk_prob,  # (E, H) f32
                                   input=partial(rms_norm, weight=post_norm, eps=cfg.rms_norm_eps)),
            ))
        self.norm = weights("model.norm.weight")  # (H,)
        self.lm_head = weights("lm_head.weight")  # (V, H)
        self.rope = Rope(cfg.head_dim, cfg.rope_theta)

    def new_state(self, kv_cache: str = "f32") -> kv.SequenceState:
        """Per layer ("layer.{i}"), the KV cache."""
        cfg = self.cfg
        return kv.SequenceState({f"layer.{i}": KVCache(cfg.num_key_value_heads, cfg.head_dim, kv_cache)
                                 for i in range(cfg.num_hidden_layers)})

    def routers(self) -> dict:
        """Every layer: softmax over all experts, top-k, on the post-attention RMSNorm of the residual."""
        return {i: L["router"] for i, L in enumerate(self.layers)}

    def forward(self, ids: np.ndarray, state: kv.SequenceState, last_only: bool = False) -> np.ndarray:
        cfg = self.cfg
        T = len(ids)
        cos, sin = self.rope.cos_sin(np.arange(state.length, state.length + T))  # (T, D)
        h = embed(ids, self.embed_tokens)  # (T, H)
        for i, L in enumerate(self.layers):
            # ---- attention: RMSNorm → q, k, v → q/k RMSNorm → clip → RoPE → GQA over the cache → o_proj, + h
            h = gqa_block(L["attn"], h, state[f"layer.{i}"], cos, sin)  # (T, H)
            # ---- routed experts
            x = rms_norm(h, L["post_norm"], cfg.rms_norm_eps)
            h = h + self.moe(i, x, h, ids)
            record(i, l_out=h)  # the residual stream after layer i (for whoever debugs: colibri_core.probe)
        state.advance(T)
        if last_only:
            h = h[-1:]
        return linear(rms_norm(h, self.norm, cfg.rms_norm_eps), self.lm_head)  # (T, V)
