"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder): the whole architecture, top to bottom.

Reference: transformers/models/qwen3_moe/modeling_qwen3_moe.py (the oracle the conformance suite
uses). Every layer:

    x = RMSNorm(h);  h += GQA(x)    per-head RMSNorm of q and k, rotate-half RoPE
    x = RMSNorm(h);  h += MoE(x)    softmax over all experts, top-k, renormalised if norm_topk_prob
                  or h += MLP(x)    a dense gated MLP on the layers mlp_only_layers /
                                    decoder_sparse_step leave without experts

Experts and MLP share the gated unit config.json's hidden_act names: SiLU (SwiGLU, the released
models) or the tanh GELU (GeGLU, "gelu_pytorch_tanh"; the experts run it in C as the core's
"geglu_tanh").

Final RMSNorm, lm_head (the embedding table when tie_word_embeddings). No shared expert.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from colibri_core import kv
from colibri_core.errors import ColibriError
from colibri_core.kv.cache import KVCache
from colibri_core.layers.attention import gqa_attention
from colibri_core.layers.mlp import swiglu_mlp
from colibri_core.layers.norm import rms_norm
from colibri_core.layers.rope import Rope, apply_rotate_half
from colibri_core.layers.router import SoftmaxTopK
from colibri_core.model import MoEModel, embed, linear, linears
from colibri_core.probe import record
from colibri_core.tensors import Dim, Experts, Tensor, TensorTable

ACTIVATIONS = {"silu": "swiglu", "gelu_pytorch_tanh": "geglu_tanh"}  # hidden_act -> the experts' gated unit


@dataclass(frozen=True)
class Qwen3MoeConfig:
    vocab_size: int  # V
    hidden_size: int  # H
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int  # GQA: each K/V head serves num_attention_heads / num_key_value_heads queries
    head_dim: int  # D: not always hidden_size / num_attention_heads (Qwen3-30B-A3B: 2048 / 32, D = 128)
    num_experts: int  # E routed experts per MoE layer
    num_experts_per_tok: int  # k
    moe_intermediate_size: int  # I: width of one routed expert
    norm_topk_prob: bool  # renormalise the k chosen weights to sum 1
    moe_layers: tuple[int, ...]  # layers with routed experts; the others have a dense MLP
    intermediate_size: int  # width of the dense layers' MLP
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool  # lm_head is the embedding table
    hidden_act: str  # the gated unit's activation, a key of ACTIVATIONS

    @classmethod
    def from_hf(cls, c: dict) -> Qwen3MoeConfig:
        for key, supported in (("attention_bias", False), ("use_sliding_window", False)):
            if c.get(key, supported) != supported:
                raise ColibriError(f"Qwen3-MoE with {key} {c[key]!r} is not supported (only {supported!r})")
        if c.get("hidden_act", "silu") not in ACTIVATIONS:
            raise ColibriError(f"Qwen3-MoE with hidden_act {c['hidden_act']!r} is not supported ({', '.join(ACTIVATIONS)})")
        rope = {"rope_theta": c.get("rope_theta", 10000.0), **(c.get("rope_scaling") or {}),
                **(c.get("rope_parameters") or {})}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ColibriError(f"Qwen3-MoE with RoPE scaling {rope!r} is not supported (only the default RoPE)")
        layers, heads = c["num_hidden_layers"], c["num_attention_heads"]
        experts = c["num_experts"] if "num_experts" in c else c["num_local_experts"]  # transformers 5 writes the latter
        dense, step = set(c.get("mlp_only_layers") or ()), c.get("decoder_sparse_step", 1)
        moe_layers = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)  # as transformers
        if not c.get("head_dim") and c["hidden_size"] % heads:  # head_dim = hidden_size / heads must be whole
            raise ColibriError(f"hidden_size {c['hidden_size']} is not a multiple of num_attention_heads {heads}")
        if experts < 1 or not moe_layers:
            raise ColibriError("this Qwen3-MoE config has no layer with routed experts")
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            num_experts=experts, num_experts_per_tok=c["num_experts_per_tok"],
            moe_intermediate_size=c["moe_intermediate_size"], norm_topk_prob=bool(c.get("norm_topk_prob", False)),
            moe_layers=moe_layers, intermediate_size=c["intermediate_size"],
            rms_norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=float(rope["rope_theta"]),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)), hidden_act=c.get("hidden_act", "silu"),
        )


def gated_mlp(x: np.ndarray, gate, up, down, act: str) -> np.ndarray:
    """The dense layers' MLP down(act(gate x) · up x), x (T, H) → (T, H): SwiGLU in one C call; GeGLU
    with the tanh GELU as transformers' gelu_pytorch_tanh computes it."""
    if act == "silu":
        return swiglu_mlp(x, gate, up, down)
    g = linear(x, gate)  # (T, F)
    gelu = np.float32(0.5) * g * (np.float32(1) + np.tanh(np.float32(np.sqrt(2 / np.pi)) * (g + np.float32(0.044715) * g ** 3)))
    return linear(gelu * linear(x, up), down)


LAYER = "model.layers.{layer}."  # every checkpoint name of layer `layer` starts so


@dataclass
class Layer:
    input_norm: np.ndarray  # (H,)
    qkv: tuple  # q_proj (heads D, H), k_proj (Hkv D, H), v_proj (Hkv D, H)
    o_proj: object  # (H, heads D)
    q_norm: np.ndarray  # (D,): RMSNorm of each query head
    k_norm: np.ndarray  # (D,): RMSNorm of each key head
    post_norm: np.ndarray  # (H,)
    router: SoftmaxTopK | None  # (E, H) float32 weights; None on a dense layer
    mlp: tuple | None  # dense layers: gate (F, H), up (F, H), down (H, F); None on an MoE layer


class Qwen3Moe(MoEModel):
    token_exact = True  # every layer computes a token as alone (gqa_attention, the core MoE): rows reused to the token

    # ---- from the config alone -----------------------------------------------------------------
    @classmethod
    def parse_config(cls, config: dict) -> Qwen3MoeConfig:
        try:
            return Qwen3MoeConfig.from_hf(config)
        except KeyError as e:
            raise ColibriError(f"config.json lacks {e.args[0]!r}, which a Qwen3-MoE model needs") from None

    @classmethod
    def tensors(cls, cfg: Qwen3MoeConfig) -> TensorTable:
        """Every tensor of the checkpoint, each named once, by the key `__init__` takes it under."""
        H, E, I = Dim("H", cfg.hidden_size), Dim("E", cfg.num_experts), Dim("I", cfg.moe_intermediate_size)
        V, D, F = cfg.vocab_size, cfg.head_dim, cfg.intermediate_size
        q_rows, kv_rows = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
        every = partial(Tensor, layers=range(cfg.num_hidden_layers))
        dense = partial(Tensor, layers=[i for i in range(cfg.num_hidden_layers) if i not in cfg.moe_layers])
        expert = LAYER + "mlp.experts.{expert}."
        return TensorTable(
            resident=dict(
                embed=Tensor("model.embed_tokens.weight", (V, H)),
                input_norm=every(LAYER + "input_layernorm.weight", (H,)),
                q_proj=every(LAYER + "self_attn.q_proj.weight", (q_rows, H)),
                k_proj=every(LAYER + "self_attn.k_proj.weight", (kv_rows, H)),
                v_proj=every(LAYER + "self_attn.v_proj.weight", (kv_rows, H)),
                o_proj=every(LAYER + "self_attn.o_proj.weight", (H, q_rows)),
                q_norm=every(LAYER + "self_attn.q_norm.weight", (D,)),
                k_norm=every(LAYER + "self_attn.k_norm.weight", (D,)),
                post_norm=every(LAYER + "post_attention_layernorm.weight", (H,)),
                mlp_gate=dense(LAYER + "mlp.gate_proj.weight", (F, H)),
                mlp_up=dense(LAYER + "mlp.up_proj.weight", (F, H)),
                mlp_down=dense(LAYER + "mlp.down_proj.weight", (H, F)),
                norm=Tensor("model.norm.weight", (H,)),
                **({} if cfg.tie_word_embeddings else {"lm_head": Tensor("lm_head.weight", (V, H))}),
            ),
            experts=Experts(
                layers=cfg.moe_layers, n=E, hidden=H, intermediate=I, top_k=cfg.num_experts_per_tok,
                router=Tensor(LAYER + "mlp.gate.weight", (E, H)),  # float32
                gate=Tensor(expert + "gate_proj.weight", (I, H)), up=Tensor(expert + "up_proj.weight", (I, H)),
                down=Tensor(expert + "down_proj.weight", (H, I)),
                gate_up=Tensor(LAYER + "mlp.experts.gate_up_proj", (E, 2 * I, H)),  # the fused form
                down_fused=Tensor(LAYER + "mlp.experts.down_proj", (E, H, I)),
                activation=ACTIVATIONS[cfg.hidden_act],
            ),
        )

    @classmethod
    def state_floats_per_token(cls, cfg: Qwen3MoeConfig) -> list[int]:
        return [2 * cfg.num_key_value_heads * cfg.head_dim] * cfg.num_hidden_layers  # K and V

    @classmethod
    def kv_cache_floats_per_token(cls, cfg: Qwen3MoeConfig) -> list[int]:
        return cls.state_floats_per_token(cfg)  # all of it in KVCaches (the engine's cache type)

    # ---- with the weights ------------------------------------------------------------------------
    def __init__(self, cfg: Qwen3MoeConfig, weights, store):
        super().__init__(cfg, weights, store)
        table = self.tensors(cfg)
        top = table.take(weights)  # the tensors of no layer
        self.embed_tokens = top["embed"]  # (V, H)
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            w = table.take(weights, i)  # layer i's tensors, by key
            moe = i in cfg.moe_layers
            self.layers.append(Layer(
                input_norm=w["input_norm"], qkv=(w["q_proj"], w["k_proj"], w["v_proj"]), o_proj=w["o_proj"],
                q_norm=w["q_norm"], k_norm=w["k_norm"], post_norm=w["post_norm"],
                router=SoftmaxTopK(w["router"], cfg.num_experts_per_tok, cfg.norm_topk_prob,
                                   input=partial(rms_norm, weight=w["post_norm"], eps=cfg.rms_norm_eps)) if moe else None,
                mlp=None if moe else (w["mlp_gate"], w["mlp_up"], w["mlp_down"]),
            ))
        self.norm = top["norm"]  # (H,)
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else top["lm_head"]  # (V, H)
        self.rope = Rope(cfg.head_dim, cfg.rope_theta)

    def routers(self) -> dict:
        """Each MoE layer's router: softmax top-k on the post-attention RMSNorm of the residual stream."""
        return {i: L.router for i, L in enumerate(self.layers) if L.router is not None}

    def new_state(self, kv_cache: str = "f32") -> kv.SequenceState:
        """Per sequence: one KV cache per layer, "layer.{i}" (arrays "layer.{i}.k", "layer.{i}.v")."""
        cfg = self.cfg
        return kv.SequenceState({f"layer.{i}": KVCache(cfg.num_key_value_heads, cfg.head_dim, kv_cache)
                                 for i in range(cfg.num_hidden_layers)})

    def forward(self, ids: np.ndarray, state: kv.SequenceState, last_only: bool = False) -> np.ndarray:
        cfg = self.cfg
        T, heads, kv_heads, D = len(ids), cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        cos, sin = self.rope.cos_sin(np.arange(state.length, state.length + T))  # (T, D)
        h = embed(ids, self.embed_tokens)  # (T, H)
        for i, L in enumerate(self.layers):
            # ---- attention
            x = rms_norm(h, L.input_norm, cfg.rms_norm_eps)
            q, k, v = linears(x, L.qkv)  # (T, heads D), (T, Hkv D), (T, Hkv D): one kernel call
            q = apply_rotate_half(rms_norm(q.reshape(T, heads, D), L.q_norm, cfg.rms_norm_eps), cos, sin)
            k = apply_rotate_half(rms_norm(k.reshape(T, kv_heads, D), L.k_norm, cfg.rms_norm_eps), cos, sin)
            attn = gqa_attention(q, k, v.reshape(T, kv_heads, D), state[f"layer.{i}"], D ** -0.5)  # (T, heads D)
            h = h + linear(attn, L.o_proj)
            # ---- routed experts, or the dense MLP
            x = rms_norm(h, L.post_norm, cfg.rms_norm_eps)
            if L.router is not None:
                h = h + self.moe(i, x, h, ids)
            else:
                h = h + gated_mlp(x, *L.mlp, cfg.hidden_act)
            record(i, l_out=h)  # the residual stream after layer i: the kit names the first layer that differs
        state.advance(T)  # the state now holds T more tokens
        if last_only:
            h = h[-1:]
        return linear(rms_norm(h, self.norm, cfg.rms_norm_eps), self.lm_head)  # (T, V)
