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
from colibri_core.layers.attention import AttnBlock
from colibri_core.layers.norm import rms_norm
from colibri_core.layers.rope import Rope
from colibri_core.layers.router import SoftmaxTopK
from colibri_core.model import MoEDecoderLayer, MoEModel, embed, linear
from colibri_core.probe import record
from colibri_core.tensors import Dim, Experts, Tensor, TensorTable


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


LAYER = "model.layers.{layer}."


class Olmoe(MoEModel):
    token_exact = True  # every layer computes a token as alone (AttnBlock, the core MoE): rows reused to the token

    @classmethod
    def parse_config(cls, config: dict) -> OlmoeConfig:
        return OlmoeConfig.from_hf(config)

    @classmethod
    def tensors(cls, cfg: OlmoeConfig) -> TensorTable:
        """Every tensor, once: the layout and the resident shapes derive from it."""
        H, I, E = Dim("H", cfg.hidden_size), Dim("I", cfg.intermediate_size), Dim("E", cfg.num_experts)
        V, layers = cfg.vocab_size, range(cfg.num_hidden_layers)
        q, kv_ = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        layer = partial(Tensor, layers=layers)
        expert = LAYER + "mlp.experts.{expert}."
        return TensorTable(
            resident=dict(
                embed=Tensor("model.embed_tokens.weight", (V, H)),
                input_norm=layer(LAYER + "input_layernorm.weight", (H,)),
                post_norm=layer(LAYER + "post_attention_layernorm.weight", (H,)),
                q=layer(LAYER + "self_attn.q_proj.weight", (q, H)), k=layer(LAYER + "self_attn.k_proj.weight", (kv_, H)),
                v=layer(LAYER + "self_attn.v_proj.weight", (kv_, H)), o=layer(LAYER + "self_attn.o_proj.weight", (H, q)),
                q_norm=layer(LAYER + "self_attn.q_norm.weight", (q,)), k_norm=layer(LAYER + "self_attn.k_norm.weight", (kv_,)),
                norm=Tensor("model.norm.weight", (H,)),
                lm_head=Tensor("lm_head.weight", (V, H)),
            ),
            experts=Experts(
                layers=layers, n=E, hidden=H, intermediate=I, top_k=cfg.num_experts_per_tok,
                router=Tensor(LAYER + "mlp.gate.weight", (E, H)),  # float32
                gate=Tensor(expert + "gate_proj.weight", (I, H)), up=Tensor(expert + "up_proj.weight", (I, H)),
                down=Tensor(expert + "down_proj.weight", (H, I)),
                gate_up=Tensor(LAYER + "mlp.experts.gate_up_proj", (E, 2 * I, H)),  # transformers' fused save
                down_fused=Tensor(LAYER + "mlp.experts.down_proj", (E, H, I)),
            ),
        )

    @classmethod
    def state_floats_per_token(cls, cfg: OlmoeConfig) -> list[int]:
        return [2 * cfg.num_key_value_heads * cfg.head_dim] * cfg.num_hidden_layers  # K and V

    @classmethod
    def kv_cache_floats_per_token(cls, cfg: OlmoeConfig) -> list[int]:
        return cls.state_floats_per_token(cfg)  # all of it in KVCaches (the engine's cache type)

    def __init__(self, cfg: OlmoeConfig, weights, store):
        super().__init__(cfg, weights, store)
        table = self.tensors(cfg)
        top = table.take(weights)
        self.embed_tokens = top["embed"]  # (V, H)
        self.layers: list[MoEDecoderLayer] = []
        self.layer_routers: list[SoftmaxTopK] = []
        for i in range(cfg.num_hidden_layers):
            w = table.take(weights, i)
            self.layers.append(MoEDecoderLayer(
                mixer=AttnBlock(  # the attention sub-block (layers.attention.gqa_block)
                    w["input_norm"],  # (H,)
                    w["q"], w["k"], w["v"],  # (heads * D, H), (kv_heads * D, H), (kv_heads * D, H)
                    w["o"],  # (H, heads * D)
                    heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                    eps=cfg.rms_norm_eps, scale=cfg.head_dim ** -0.5,
                    qk_norm="whole",  # QK-norm over the full projected width, not per head
                    q_norm=w["q_norm"], k_norm=w["k_norm"],  # (heads * D,), (kv_heads * D,)
                    clip=cfg.clip_qkv),
                post_norm=w["post_norm"],  # (H,)
                eps=cfg.rms_norm_eps,
            ))
            self.layer_routers.append(SoftmaxTopK(w["router"], cfg.num_experts_per_tok, cfg.norm_topk_prob,  # (E, H) f32
                                                  input=partial(rms_norm, weight=w["post_norm"], eps=cfg.rms_norm_eps)))
        self.norm = top["norm"]  # (H,)
        self.lm_head = top["lm_head"]  # (V, H)
        self.rope = Rope(cfg.head_dim, cfg.rope_theta)

    def new_state(self, kv_cache: str = "f32") -> kv.SequenceState:
        """Per layer ("layer.{i}"), the KV cache."""
        cfg = self.cfg
        return kv.SequenceState({f"layer.{i}": KVCache(cfg.num_key_value_heads, cfg.head_dim, kv_cache)
                                 for i in range(cfg.num_hidden_layers)})

    def routers(self) -> dict:
        """Every layer: softmax over all experts, top-k, on the post-attention RMSNorm of the residual."""
        return dict(enumerate(self.layer_routers))

    def forward(self, ids: np.ndarray, state: kv.SequenceState, last_only: bool = False) -> np.ndarray:
        cfg = self.cfg
        T = len(ids)
        cos, sin = self.rope.cos_sin(np.arange(state.length, state.length + T))  # (T, D)
        h = embed(ids, self.embed_tokens)  # (T, H)
        for i, L in enumerate(self.layers):
            # attention: RMSNorm → q, k, v → q/k RMSNorm → clip → RoPE → GQA over the cache → o_proj, + h;
            # then the routed experts on RMSNorm(h), + h: one C call where the layer can take it
            h = self.decoder_layer(i, L, h, state[f"layer.{i}"], ids, cos, sin)  # (T, H)
            record(i, l_out=h)  # the residual stream after layer i (for whoever debugs: colibri_core.probe)
        state.advance(T)
        if last_only:
            h = h[-1:]
        return linear(rms_norm(h, self.norm, cfg.rms_norm_eps), self.lm_head)  # (T, V)
