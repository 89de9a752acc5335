"""Qwen3.6-35B-A3B (and the Qwen3.5-MoE family): the whole text model, top to bottom.

Reference: transformers/models/qwen3_5_moe/modeling_qwen3_5_moe.py (`Qwen3_5MoeForCausalLM`, the
oracle the conformance suite uses). A hybrid: `layer_types` says, per layer, which token mixer it has
(Qwen3.6-35B-A3B: 3 Gated DeltaNet layers, then 1 gated attention layer, 10 times):

    x = zRMSNorm(h);  h += GatedDeltaNet(x)      (linear_attention: fixed-size recurrent state)
                   or h += GatedAttention(x)     (full_attention: GQA KV cache, partial RoPE,
                                                  the output · sigmoid of a gate the q projection gives)
    x = zRMSNorm(h);  h += MoE(x) + sigmoid(shared_expert_gate x) · shared_expert(x)

zRMSNorm is the zero-centred RMSNorm x̂ · (1 + w). The MoE router is softmax over all experts, top-k,
always renormalised. Final zRMSNorm, lm_head (tied to the embeddings when `tie_word_embeddings`).
Each layer is a core `MoEDecoderLayer` (the gated attention a gated `AttnBlock` with partial RoPE):
one C call a layer when the model is resident.

Checkpoints come in two shapes: the text model alone (config.json `model_type`
"qwen3_5_moe_text", tensors `model.*`) and the released vision-language checkpoints
(`Qwen3_5MoeForConditionalGeneration`, `model_type` "qwen3_5_moe", the text config nested under
`text_config`, text tensors under `model.language_model.*`; the vision tower `model.visual.*` and
the multi-token-prediction head `mtp.*` are skipped). Routed experts may be per-expert or fused.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from colibri_core import kv
from colibri_core.errors import ColibriError
from colibri_core.kv.cache import KVCache
from colibri_core.layers.attention import AttnBlock
from colibri_core.layers.deltanet import DeltaNetDims, DeltaNetState, GatedDeltaNet
from colibri_core.layers.norm import rms_norm_zero_centred
from colibri_core.layers.rope import Rope
from colibri_core.layers.router import SoftmaxTopK
from colibri_core.layers.shared_expert import SharedExpert
from colibri_core.model import MoEDecoderLayer, MoEModel, embed, linear
from colibri_core.probe import record
from colibri_core.tensors import Dim, Experts, Tensor, TensorTable

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class Qwen36Config:
    vocab_size: int
    hidden_size: int  # H
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # per layer: "linear_attention" (Gated DeltaNet) or "full_attention"
    # gated attention layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # D
    rotary_dim: int  # leading dims of each head that RoPE rotates: head_dim * partial_rotary_factor
    rope_theta: float
    attention_bias: bool  # q/k/v/o projections have biases (False for the released models)
    # Gated DeltaNet layers
    linear_num_key_heads: int  # Hk
    linear_num_value_heads: int  # Hv (a multiple of Hk)
    linear_key_head_dim: int  # dk
    linear_value_head_dim: int  # dv
    linear_conv_kernel_dim: int  # K
    # MoE (every layer)
    num_experts: int  # E routed experts per layer
    num_experts_per_tok: int  # top-k
    moe_intermediate_size: int  # I: width of one routed expert
    shared_expert_intermediate_size: int  # width of the shared expert
    rms_norm_eps: float
    tie_word_embeddings: bool  # lm_head is the embedding table
    prefix: str  # checkpoint name prefix of the text model: "model." or "model.language_model."

    @classmethod
    def from_hf(cls, c: dict) -> Qwen36Config:
        nested = isinstance(c.get("text_config"), dict)
        t = c["text_config"] if nested else c
        if t.get("hidden_act", "silu") != "silu":
            raise ColibriError(f"Qwen3.6 with hidden_act {t['hidden_act']!r} is not supported (only silu)")
        layers = t["num_hidden_layers"]
        types = t.get("layer_types")
        if types is None:
            interval = t.get("full_attention_interval", 4)
            types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
        if len(types) != layers or set(types) - {LINEAR, FULL}:
            raise ColibriError(f"config.json layer_types must list {layers} entries, each {LINEAR!r} or {FULL!r}")
        rope = dict(t.get("rope_parameters") or t.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ColibriError(f"Qwen3.6 with rope_type {rope_type!r} is not supported (only default)")
        if not t.get("head_dim") and t["hidden_size"] % t["num_attention_heads"]:  # head_dim must be whole
            raise ColibriError(f"hidden_size {t['hidden_size']} is not a multiple of num_attention_heads "
                               f"{t['num_attention_heads']}")
        head_dim = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
        partial = rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25))
        hk, hv = t["linear_num_key_heads"], t["linear_num_value_heads"]
        if hv % hk:
            raise ColibriError(f"linear_num_value_heads ({hv}) must be a multiple of linear_num_key_heads ({hk})")
        return cls(
            vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], num_hidden_layers=layers,
            layer_types=tuple(types), num_attention_heads=t["num_attention_heads"],
            num_key_value_heads=t.get("num_key_value_heads") or t["num_attention_heads"], head_dim=head_dim,
            rotary_dim=int(head_dim * partial), rope_theta=float(rope.get("rope_theta", t.get("rope_theta", 10000.0))),
            attention_bias=bool(t.get("attention_bias", False)),
            linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=t["linear_key_head_dim"],
            linear_value_head_dim=t["linear_value_head_dim"], linear_conv_kernel_dim=t["linear_conv_kernel_dim"],
            num_experts=t["num_experts"], num_experts_per_tok=t["num_experts_per_tok"],
            moe_intermediate_size=t["moe_intermediate_size"],
            shared_expert_intermediate_size=t["shared_expert_intermediate_size"],
            rms_norm_eps=t.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", t.get("tie_word_embeddings", False))),
            prefix="model.language_model." if nested else "model.",
        )

    @property
    def deltanet(self) -> DeltaNetDims:
        return DeltaNetDims(self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim,
                            self.linear_value_head_dim, self.linear_conv_kernel_dim)


class Qwen36(MoEModel):
    @classmethod
    def parse_config(cls, config: dict) -> Qwen36Config:
        try:
            return Qwen36Config.from_hf(config)
        except KeyError as e:
            raise ColibriError(f"config.json lacks {e.args[0]!r}, which a Qwen3.6 (qwen3_5_moe) model needs") from None
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise ColibriError(f"config.json is not a valid Qwen3.6 (qwen3_5_moe) config: {e}") from None

    @classmethod
    def tensors(cls, cfg: Qwen36Config) -> TensorTable:
        """Every tensor of the text model, once (routers, the shared-expert gate and the tiny β / decay
        projections stay float32: they are small, and the decay is exponentiated, so an error in it
        compounds over the whole context)."""
        H, E, I = Dim("H", cfg.hidden_size), Dim("E", cfg.num_experts), Dim("I", cfg.moe_intermediate_size)
        D, S, V, dn, p = cfg.head_dim, cfg.shared_expert_intermediate_size, cfg.vocab_size, cfg.deltanet, cfg.prefix
        L = p + "layers.{layer}."
        every = partial(Tensor, layers=range(cfg.num_hidden_layers))
        linear_ = partial(Tensor, layers=[i for i, kind in enumerate(cfg.layer_types) if kind == LINEAR])
        full = partial(Tensor, layers=[i for i, kind in enumerate(cfg.layer_types) if kind == FULL])
        q_rows, kv_rows, o_cols = cfg.num_attention_heads * D * 2, cfg.num_key_value_heads * D, cfg.num_attention_heads * D
        biases = {f"{n}_bias": full(L + f"self_attn.{n}_proj.bias", (rows,))
                  for n, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows), ("o", H))} if cfg.attention_bias else {}
        expert = L + "mlp.experts.{expert}."
        return TensorTable(
            resident=dict(
                embed=Tensor(p + "embed_tokens.weight", (V, H)),
                input_norm=every(L + "input_layernorm.weight", (H,)),
                in_proj_qkv=linear_(L + "linear_attn.in_proj_qkv.weight", (dn.conv_channels, H)),
                in_proj_z=linear_(L + "linear_attn.in_proj_z.weight", (dn.value_heads * dn.value_dim, H)),
                in_proj_b=linear_(L + "linear_attn.in_proj_b.weight", (dn.value_heads, H), f32=True),
                in_proj_a=linear_(L + "linear_attn.in_proj_a.weight", (dn.value_heads, H), f32=True),
                conv1d=linear_(L + "linear_attn.conv1d.weight", (dn.conv_channels, 1, dn.conv_kernel)),
                dt_bias=linear_(L + "linear_attn.dt_bias", (dn.value_heads,)),
                A_log=linear_(L + "linear_attn.A_log", (dn.value_heads,)),
                dn_norm=linear_(L + "linear_attn.norm.weight", (dn.value_dim,)),
                out_proj=linear_(L + "linear_attn.out_proj.weight", (H, dn.value_heads * dn.value_dim)),
                q_proj=full(L + "self_attn.q_proj.weight", (q_rows, H)),
                k_proj=full(L + "self_attn.k_proj.weight", (kv_rows, H)),
                v_proj=full(L + "self_attn.v_proj.weight", (kv_rows, H)),
                o_proj=full(L + "self_attn.o_proj.weight", (H, o_cols)),
                **biases,
                q_norm=full(L + "self_attn.q_norm.weight", (D,)), k_norm=full(L + "self_attn.k_norm.weight", (D,)),
                post_norm=every(L + "post_attention_layernorm.weight", (H,)),
                shared_gate=every(L + "mlp.shared_expert.gate_proj.weight", (S, H)),
                shared_up=every(L + "mlp.shared_expert.up_proj.weight", (S, H)),
                shared_down=every(L + "mlp.shared_expert.down_proj.weight", (H, S)),
                shared_sigmoid=every(L + "mlp.shared_expert_gate.weight", (1, H), f32=True),
                norm=Tensor(p + "norm.weight", (H,)),
                **({} if cfg.tie_word_embeddings else {"lm_head": Tensor("lm_head.weight", (V, H))}),
            ),
            experts=Experts(
                layers=range(cfg.num_hidden_layers), n=E, hidden=H, intermediate=I, top_k=cfg.num_experts_per_tok,
                router=Tensor(L + "mlp.gate.weight", (E, H)),  # float32
                gate=Tensor(expert + "gate_proj.weight", (I, H)), up=Tensor(expert + "up_proj.weight", (I, H)),
                down=Tensor(expert + "down_proj.weight", (H, I)),
                gate_up=Tensor(L + "mlp.experts.gate_up_proj", (E, 2 * I, H)),
                down_fused=Tensor(L + "mlp.experts.down_proj", (E, H, I)),
            ),
            ignore=(r"^model\.visual\.", r"^mtp\."),  # the vision tower and the MTP head: not the text model
        )

    @classmethod
    def state_floats_per_token(cls, cfg: Qwen36Config) -> list[int]:
        """Per layer, the state floats each token adds: K and V for gated attention, 0 for DeltaNet
        layers (their state is fixed-size: see `fixed_state_floats`)."""
        kv_floats = 2 * cfg.num_key_value_heads * cfg.head_dim
        return [kv_floats if kind == FULL else 0 for kind in cfg.layer_types]

    @classmethod
    def kv_cache_floats_per_token(cls, cfg: Qwen36Config) -> list[int]:
        """All of it: the gated-attention layers' keys and values are `KVCache`s."""
        return cls.state_floats_per_token(cfg)

    @classmethod
    def fixed_state_floats(cls, cfg: Qwen36Config) -> int:
        """State floats that do not grow with the context: conv + recurrent state of every DeltaNet layer."""
        return cfg.layer_types.count(LINEAR) * cfg.deltanet.state_floats

    def __init__(self, cfg: Qwen36Config, weights, store):
        super().__init__(cfg, weights, store)
        table = self.tensors(cfg)
        top = table.take(weights)
        self.embed_tokens = top["embed"]  # (V, H)
        self.layers: list[MoEDecoderLayer] = []
        self.layer_routers: list[SoftmaxTopK] = []
        one = np.float32(1)  # the zero-centred norms' weights are offsets from 1: rms_norm takes 1 + w
        for i, kind in enumerate(cfg.layer_types):
            w = table.take(weights, i)
            shared = SharedExpert(w["shared_gate"], w["shared_up"], w["shared_down"],  # (S, H), (S, H), (H, S)
                                  w["shared_sigmoid"])  # (1, H) float32
            if kind == LINEAR:
                layer = MoEDecoderLayer(
                    mixer=GatedDeltaNet(
                        dims=cfg.deltanet,
                        in_proj_qkv=w["in_proj_qkv"],  # (2 Hk dk + Hv dv, H)
                        in_proj_z=w["in_proj_z"],  # (Hv dv, H)
                        in_proj_b=w["in_proj_b"],  # (Hv, H) float32
                        in_proj_a=w["in_proj_a"],  # (Hv, H) float32
                        conv_weight=np.ascontiguousarray(w["conv1d"][:, 0, :]),  # (channels, K)
                        A_log=w["A_log"],  # (Hv,)
                        dt_bias=w["dt_bias"],  # (Hv,)
                        norm=w["dn_norm"],  # (dv,) plain
                        out_proj=w["out_proj"],  # (H, Hv dv)
                        eps=cfg.rms_norm_eps,
                    ),
                    input_norm=one + w["input_norm"],  # (H,)
                    post_norm=one + w["post_norm"], eps=cfg.rms_norm_eps, shared=shared)
            else:
                D = cfg.head_dim
                layer = MoEDecoderLayer(
                    mixer=AttnBlock(  # gated attention: zRMSNorm → q | gate, k, v → per-head zRMSNorm → partial
                        one + w["input_norm"],  # (H,)   RoPE → GQA over the cache → · sigmoid(gate) → o_proj, + h
                        w["q_proj"],  # (heads * 2D, H): per head [q | gate]
                        w["k_proj"], w["v_proj"],  # (kv_heads * D, H) each
                        w["o_proj"],  # (H, heads * D)
                        heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=D,
                        eps=cfg.rms_norm_eps, scale=D ** -0.5,
                        qk_norm="head", q_norm=one + w["q_norm"], k_norm=one + w["k_norm"],  # (D,) each
                        **({f"{n}_bias": w[f"{n}_bias"] for n in "qkvo"} if cfg.attention_bias else {}),
                        gated=True, rotary_dim=cfg.rotary_dim),
                    post_norm=one + w["post_norm"], eps=cfg.rms_norm_eps, shared=shared)
            self.layers.append(layer)
            self.layer_routers.append(SoftmaxTopK(
                w["router"], cfg.num_experts_per_tok, renormalize=True,  # (E, H) float32, on zRMSNorm(h, post_norm)
                input=partial(rms_norm_zero_centred, weight=w["post_norm"], eps=cfg.rms_norm_eps)))
        self.norm = top["norm"]  # (H,)
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else top["lm_head"]  # (V, H)
        self.rope = Rope(cfg.rotary_dim, cfg.rope_theta)

    def routers(self) -> dict:
        """Every layer: softmax over all experts, top-k, always renormalised."""
        return dict(enumerate(self.layer_routers))

    def new_state(self, kv_cache: str = "f32") -> kv.SequenceState:
        """Per layer "layer.{i}": a Gated DeltaNet layer's conv + recurrent state (fixed size), a
        gated attention layer's KV cache."""
        cfg = self.cfg
        return kv.SequenceState({
            f"layer.{i}": DeltaNetState(cfg.deltanet) if kind == LINEAR
            else KVCache(cfg.num_key_value_heads, cfg.head_dim, kv_cache)
            for i, kind in enumerate(cfg.layer_types)})

    def forward(self, ids: np.ndarray, state: kv.SequenceState, last_only: bool = False) -> np.ndarray:
        cfg = self.cfg
        T = len(ids)
        cos, sin = self.rope.cos_sin(np.arange(state.length, state.length + T))  # (T, rotary_dim)
        h = embed(ids, self.embed_tokens)  # (T, H)
        for i, L in enumerate(self.layers):
            # token mixer (Gated DeltaNet or gated attention), + h; then the routed experts and the
            # gated shared expert on zRMSNorm(h), + h: one C call where the layer can take it
            h = self.decoder_layer(i, L, h, state[f"layer.{i}"], ids, cos, sin)  # (T, H)
            record(i, l_out=h)  # the residual stream after layer i (colibri_core.probe)
        state.advance(T)
        if last_only:
            h = h[-1:]
        return linear(rms_norm_zero_centred(h, self.norm, cfg.rms_norm_eps), self.lm_head)  # (T, V)
