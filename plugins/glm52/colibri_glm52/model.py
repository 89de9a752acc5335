"""GLM-5.2 (zai-org GLM-5 family, `GlmMoeDsaForCausalLM`): the whole architecture, top to bottom.

Reference: transformers/models/glm_moe_dsa/modeling_glm_moe_dsa.py (the oracle the conformance
suite uses); the MTP layer, which transformers drops, follows the published DeepSeek-V3 MTP module
as vLLM / SGLang run it (see `Glm52.mtp_forward`).

Every layer: RMSNorm → MLA attention (compressed 576-float cache, `colibri_core.layers.mla`)
restricted to the keys the DSA lightning indexer selects (`colibri_core.layers.dsa`; "shared"
layers reuse the previous layer's selection) → residual → RMSNorm → a dense SiLU-GLU MLP (the
first `first_k_dense_replace` layers) or the MoE block (sigmoid routing with correction bias,
group-limited, renormalised × routed_scaling_factor; plus one always-on shared expert) → residual.
Final RMSNorm, untied lm_head. Optional: one MTP layer (index num_hidden_layers) whose routed
experts are stored at least int8.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial

import numpy as np

from colibri_core import kv
from colibri_core.errors import ColibriError
from colibri_core.kv.cache import Rows
from colibri_core.layers.dsa import Indexer
from colibri_core.layers.mla import MLA, MLACache, MLADims
from colibri_core.layers.mlp import swiglu_mlp
from colibri_core.layers.norm import rms_norm
from colibri_core.layers.rope import Rope
from colibri_core.layers.router import SigmoidGroupTopK
from colibri_core.layers.shared_expert import SharedExpert
from colibri_core.model import MoEModel, embed, linear
from colibri_core.probe import record
from colibri_core.tensors import Dim, Experts, Tensor, TensorTable


@dataclass(frozen=True)
class Glm52Config:
    vocab_size: int
    hidden_size: int  # H
    intermediate_size: int  # dense-layer MLP width
    moe_intermediate_size: int  # I: width of one routed expert
    num_hidden_layers: int  # main layers (the MTP layer is extra)
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int  # c: cached latent width (512)
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # r: cached rope key width (64)
    v_head_dim: int
    n_routed_experts: int  # E
    n_shared_experts: int  # the shared expert is n_shared_experts × moe_intermediate_size wide
    num_experts_per_tok: int  # top-k
    n_group: int  # expert groups for group-limited routing
    topk_group: int  # groups that compete per token
    norm_topk_prob: bool  # renormalise the chosen weights
    routed_scaling_factor: float
    rms_norm_eps: float
    rope_theta: float
    index_n_heads: int  # DSA indexer heads
    index_head_dim: int  # DSA indexer width D
    index_topk: int  # keys each query keeps
    indexer_types: tuple[str, ...]  # per layer: "full" (own indexer) or "shared" (reuse the previous)
    mlp_layer_types: tuple[str, ...]  # per layer: "dense" or "sparse"
    num_nextn_predict_layers: int  # MTP layers (0 or 1)
    mtp_shares_index: bool = False  # index_share_for_mtp_iteration: the MTP layer has no indexer of its own

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Layers with routed experts: the sparse main layers, then the MTP layer (if any)."""
        main = [i for i, t in enumerate(self.mlp_layer_types) if t == "sparse"]
        return tuple(main + list(range(self.num_hidden_layers, self.num_hidden_layers + self.num_nextn_predict_layers)))

    @classmethod
    def from_hf(cls, c: dict) -> Glm52Config:
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ColibriError(f"GLM-5.2 with rope_type {rope.get('rope_type')!r} is not supported (only default RoPE)")
        if c.get("attention_bias"):
            raise ColibriError("GLM-5.2 with attention_bias is not supported")
        if c.get("hidden_act", "silu") != "silu":
            raise ColibriError(f"GLM-5.2 with hidden_act {c['hidden_act']!r} is not supported (only silu)")
        if c.get("tie_word_embeddings"):
            raise ColibriError("GLM-5.2 with tied embeddings is not supported")
        layers = c["num_hidden_layers"]
        indexer_types = c.get("indexer_types")
        if indexer_types is None:  # as GlmMoeDsaConfig.__post_init__ derives it
            pattern = c.get("index_topk_pattern")
            if pattern is not None:
                indexer_types = [{"F": "full", "S": "shared"}[ch] for ch in pattern] if isinstance(pattern, str) else list(pattern)
            else:
                freq, offset = max(c.get("index_topk_freq", 1), 1), c.get("index_skip_topk_offset", 2)
                indexer_types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
        mlp_types = c.get("mlp_layer_types")
        if mlp_types is None:
            dense = min(c.get("first_k_dense_replace", 3), layers)
            mlp_types = ["dense"] * dense + ["sparse"] * (layers - dense)
        if len(indexer_types) < layers or len(mlp_types) < layers or indexer_types[0] != "full":
            raise ColibriError("GLM-5.2 config: indexer_types / mlp_layer_types must cover every layer, "
                               "and layer 0 must run its own indexer")
        experts = c.get("n_routed_experts", c.get("num_experts"))
        n_group = c.get("n_group", 1)
        if experts % n_group:
            raise ColibriError(f"GLM-5.2 config: {experts} experts do not split into {n_group} groups")
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
            moe_intermediate_size=c["moe_intermediate_size"], num_hidden_layers=layers,
            num_attention_heads=c["num_attention_heads"], q_lora_rank=c["q_lora_rank"], kv_lora_rank=c["kv_lora_rank"],
            qk_nope_head_dim=c["qk_nope_head_dim"], qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"],
            n_routed_experts=experts, n_shared_experts=c.get("n_shared_experts", 1),
            num_experts_per_tok=c["num_experts_per_tok"], n_group=n_group, topk_group=c.get("topk_group", 1),
            norm_topk_prob=bool(c.get("norm_topk_prob", True)),
            routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)), rms_norm_eps=c.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            index_n_heads=c.get("index_n_heads", 32), index_head_dim=c.get("index_head_dim", 128),
            index_topk=c.get("index_topk", 2048), indexer_types=tuple(indexer_types[:layers]),
            mlp_layer_types=tuple(mlp_types[:layers]), num_nextn_predict_layers=c.get("num_nextn_predict_layers", 0),
            mtp_shares_index=bool(c.get("index_share_for_mtp_iteration", False)),
        )


LAYER = "model.layers.{layer}."
# Published checkpoints repeat the main embedding and lm_head inside the MTP layer; the MTP forward
# uses the main ones, so these copies are skipped.
MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")
MTP_EXPERT_MIN_KIND = "int8"  # int4 MTP experts collapse draft acceptance


class Glm52(MoEModel):
    @classmethod
    def parse_config(cls, config: dict) -> Glm52Config:
        return Glm52Config.from_hf(config)

    @classmethod
    def tensors(cls, cfg: Glm52Config) -> TensorTable:
        """Every tensor, once, on the layers that hold it: the main layers, then the MTP layer(s)."""
        H, E, I = Dim("H", cfg.hidden_size), Dim("E", cfg.n_routed_experts), Dim("I", cfg.moe_intermediate_size)
        V, c, r, heads, q_lora = cfg.vocab_size, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_attention_heads, cfg.q_lora_rank
        S, F, n_index, d_index = I * cfg.n_shared_experts, cfg.intermediate_size, cfg.index_n_heads, cfg.index_head_dim
        main, mtp = range(cfg.num_hidden_layers), range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
        on = lambda layers: partial(Tensor, layers=tuple(layers))  # noqa: E731
        every, sparse, mtp_ = on([*main, *mtp]), on(cfg.moe_layers), on(mtp)
        dense = on(i for i in main if cfg.mlp_layer_types[i] != "sparse")
        indexed = on([*(i for i in main if cfg.indexer_types[i] == "full"), *(() if cfg.mtp_shares_index else mtp)])
        expert = LAYER + "mlp.experts.{expert}."
        return TensorTable(
            resident=dict(
                embed=Tensor("model.embed_tokens.weight", (V, H)),
                input_norm=every(LAYER + "input_layernorm.weight", (H,)),
                post_norm=every(LAYER + "post_attention_layernorm.weight", (H,)),
                # MLA, in MLA's argument order
                q_a=every(LAYER + "self_attn.q_a_proj.weight", (q_lora, H)),
                q_a_norm=every(LAYER + "self_attn.q_a_layernorm.weight", (q_lora,)),
                q_b=every(LAYER + "self_attn.q_b_proj.weight", (heads * cfg.qk_head_dim, q_lora)),
                kv_a=every(LAYER + "self_attn.kv_a_proj_with_mqa.weight", (c + r, H)),
                kv_a_norm=every(LAYER + "self_attn.kv_a_layernorm.weight", (c,)),
                kv_b=every(LAYER + "self_attn.kv_b_proj.weight", (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), c)),
                o=every(LAYER + "self_attn.o_proj.weight", (H, heads * cfg.v_head_dim)),
                # the DSA indexer, in Indexer's argument order (HF keeps weights_proj float32)
                index_wq_b=indexed(LAYER + "self_attn.indexer.wq_b.weight", (n_index * d_index, q_lora)),
                index_wk=indexed(LAYER + "self_attn.indexer.wk.weight", (d_index, H)),
                index_k_norm=indexed(LAYER + "self_attn.indexer.k_norm.weight", (d_index,)),
                index_k_norm_bias=indexed(LAYER + "self_attn.indexer.k_norm.bias", (d_index,)),
                index_weights=indexed(LAYER + "self_attn.indexer.weights_proj.weight", (n_index, H), f32=True),
                mlp_gate=dense(LAYER + "mlp.gate_proj.weight", (F, H)), mlp_up=dense(LAYER + "mlp.up_proj.weight", (F, H)),
                mlp_down=dense(LAYER + "mlp.down_proj.weight", (H, F)),
                score_bias=sparse(LAYER + "mlp.gate.e_score_correction_bias", (E,)),
                shared_gate=sparse(LAYER + "mlp.shared_experts.gate_proj.weight", (S, H)),
                shared_up=sparse(LAYER + "mlp.shared_experts.up_proj.weight", (S, H)),
                shared_down=sparse(LAYER + "mlp.shared_experts.down_proj.weight", (H, S)),
                enorm=mtp_(LAYER + "enorm.weight", (H,)), hnorm=mtp_(LAYER + "hnorm.weight", (H,)),
                eh_proj=mtp_(LAYER + "eh_proj.weight", (H, 2 * H)),
                head_norm=mtp_(LAYER + "shared_head.norm.weight", (H,)),
                norm=Tensor("model.norm.weight", (H,)),
                lm_head=Tensor("lm_head.weight", (V, H)),
            ),
            experts=Experts(
                layers=cfg.moe_layers, n=E, hidden=H, intermediate=I, top_k=cfg.num_experts_per_tok,
                router=Tensor(LAYER + "mlp.gate.weight", (E, H)),  # float32
                gate=Tensor(expert + "gate_proj.weight", (I, H)), up=Tensor(expert + "up_proj.weight", (I, H)),
                down=Tensor(expert + "down_proj.weight", (H, I)),
                gate_up=Tensor(LAYER + "mlp.experts.gate_up_proj", (E, 2 * I, H)),
                down_fused=Tensor(LAYER + "mlp.experts.down_proj", (E, H, I)),
                min_kind=tuple((i, MTP_EXPERT_MIN_KIND) for i in mtp),
            ),
            ignore=tuple("^" + re.escape(LAYER.format(layer=i) + name) + "$" for i in mtp for name in MTP_COPIES),
        )

    @classmethod
    def state_floats_per_token(cls, cfg: Glm52Config) -> list[int]:
        """Cached floats per token for each main layer: the MLA latent + rope key (576 for GLM-5.2).
        The DSA indexer keys are counted apart (`kept_apart_floats_per_token`)."""
        return [cfg.kv_lora_rank + cfg.qk_rope_head_dim] * cfg.num_hidden_layers

    @classmethod
    def kept_apart_floats_per_token(cls, cfg: Glm52Config) -> dict[str, list[int]]:
        """The DSA indexer keys, per main layer: index_head_dim floats per token where the layer runs
        its own indexer, 0 on IndexShare layers."""
        return {"indexer_keys": [cfg.index_head_dim if t == "full" else 0 for t in cfg.indexer_types]}

    def __init__(self, cfg: Glm52Config, weights, store):
        super().__init__(cfg, weights, store)
        self.dims = MLADims(
            heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim, scale=cfg.qk_head_dim ** -0.5)
        top = self.tensors(cfg).take(weights)
        self.embed_tokens = top["embed"]  # (V, H)
        self.layers = [self._layer(weights, i) for i in range(cfg.num_hidden_layers)]
        self.mtp = [self._layer(weights, i) for i in range(cfg.num_hidden_layers,
                                                           cfg.num_hidden_layers + cfg.num_nextn_predict_layers)]
        self.norm = top["norm"]  # (H,)
        self.lm_head = top["lm_head"]  # (V, H)
        self.rope = Rope(cfg.qk_rope_head_dim, cfg.rope_theta)  # interleaved pairs on the rope dims
        self.dense_attention = False  # True: ignore the indexer (tests: DSA with every key == dense)

    def _layer(self, weights, i: int) -> dict:
        cfg = self.cfg
        w = self.tensors(cfg).take(weights, i)
        L = dict(
            input_norm=w["input_norm"],  # (H,)
            post_norm=w["post_norm"],  # (H,)
            attn=MLA(self.dims, w["q_a"], w["q_a_norm"], w["q_b"], w["kv_a"], w["kv_a_norm"], w["kv_b"], w["o"]),
            indexer=None,  # IndexShare: reuse the previous layer's selection
            layer=i,
        )
        if "index_wq_b" in w:
            L["indexer"] = Indexer(w["index_wq_b"], w["index_wk"], w["index_k_norm"], w["index_k_norm_bias"],
                                   w["index_weights"], n_heads=cfg.index_n_heads, head_dim=cfg.index_head_dim,
                                   rope_dim=cfg.qk_rope_head_dim, topk=cfg.index_topk)
        if "router" in w:
            L["router"] = SigmoidGroupTopK(
                w["router"], w["score_bias"],  # (E, H) float32, (E,)
                cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor,
                input=partial(rms_norm, weight=L["post_norm"], eps=cfg.rms_norm_eps))
            L["shared"] = SharedExpert(w["shared_gate"], w["shared_up"], w["shared_down"])
        else:
            L["mlp"] = (w["mlp_gate"], w["mlp_up"], w["mlp_down"])
        if "enorm" in w:
            L["enorm"], L["hnorm"] = w["enorm"], w["hnorm"]  # (H,)
            L["eh_proj"] = w["eh_proj"]  # (H, 2H)
            L["head_norm"] = w["head_norm"]  # (H,)
        return L

    @property
    def has_mtp(self) -> bool:
        """A checkpoint with num_nextn_predict_layers > 0 drafts with its MTP head."""
        return bool(self.mtp)

    def routers(self) -> dict:
        """Every sparse layer, then the MTP layer: sigmoid scores + correction bias, group-limited,
        renormalised × routed_scaling_factor, on the post-attention RMSNorm of the residual."""
        return {L["layer"]: L["router"] for L in (*self.layers, *self.mtp) if "router" in L}

    def lookahead(self) -> dict[int, int]:
        """Each sparse main layer predicts the next; the last one predicts nothing (the MTP layer runs
        only when a draft is asked for, so guessing its experts would read them for nothing)."""
        sparse = [L["layer"] for L in self.layers if "router" in L]
        return dict(zip(sparse, sparse[1:]))

    def new_state(self, kv_cache: str = "f32") -> kv.SequenceState:
        """The main layers' state (no KV cache: `kv_cache` does not apply to MLA latents)."""
        return self._state(self.layers)

    def new_mtp_state(self) -> kv.SequenceState:
        """State of the MTP layer (its own MLA cache and indexer keys)."""
        if not self.mtp:
            raise ColibriError("this GLM model has no MTP layer (num_nextn_predict_layers is 0)")
        return self._state(self.mtp)

    def _state(self, layers: list[dict]) -> kv.SequenceState:
        """Per layer, its MLA cache "layer.{i}" (latent + rope key, 576 floats per token for GLM-5.2)
        and, where it runs its own indexer, the indexer keys "layer.{i}.index_k" (index_head_dim)."""
        parts = {}
        for L in layers:
            parts[f"layer.{L['layer']}"] = MLACache(self.dims)
            if L["indexer"] is not None:
                parts[f"layer.{L['layer']}.index_k"] = Rows(self.cfg.index_head_dim)
        return kv.SequenceState(parts)

    # ---- the layer graph ---------------------------------------------------------------------
    def _decoder_layer(self, L: dict, h: np.ndarray, ids: np.ndarray, state: kv.SequenceState, cos, sin, prev_keep):
        """One decoder layer on h (T, H) of tokens `ids` (T,); returns (h, this layer's key selection)."""
        cfg, i = self.cfg, L["layer"]
        # ---- attention: MLA over the compressed cache, keys chosen by the DSA indexer
        x = rms_norm(h, L["input_norm"], cfg.rms_norm_eps)
        attn, cache = L["attn"], state[f"layer.{i}"]
        q_resid, q_nope, q_rope = attn.query(x, cos, sin)
        attn.compress(x, cos, sin, cache)
        keep = prev_keep if L["indexer"] is None else L["indexer"].select(x, q_resid, cos, sin,
                                                                          state[f"layer.{i}.index_k"])
        h = h + attn.attend(q_nope, q_rope, cache, None if self.dense_attention else keep)
        # ---- MLP: dense, or routed experts + the shared expert
        x = rms_norm(h, L["post_norm"], cfg.rms_norm_eps)
        if "mlp" in L:
            return h + swiglu_mlp(x, *L["mlp"]), keep
        return h + self.moe(i, x, h, ids, shared=L["shared"]), keep

    def hidden(self, ids: np.ndarray, state: kv.SequenceState) -> np.ndarray:
        """The final-normalised hidden states (T, H) of new tokens `ids` (T,): what lm_head reads."""
        T = len(ids)
        cos, sin = self.rope.cos_sin(np.arange(state.length, state.length + T))  # (T, r)
        h = embed(ids, self.embed_tokens)  # (T, H)
        keep = None
        for L in self.layers:
            h, keep = self._decoder_layer(L, h, ids, state, cos, sin, keep)
            record(L["layer"], l_out=h)  # the residual stream after this layer (colibri_core.probe)
        state.advance(T)
        return rms_norm(h, self.norm, self.cfg.rms_norm_eps)

    def forward(self, ids: np.ndarray, state: kv.SequenceState, last_only: bool = False) -> np.ndarray:
        h = self.hidden(ids, state)
        self.last_hidden = h  # (T, H): the MTP head's input (colibri_core.drafting reads it after a forward)
        if last_only:
            h = h[-1:]
        return linear(h, self.lm_head)  # (T, V)

    def mtp_forward(self, hidden: np.ndarray, next_ids: np.ndarray, state: kv.SequenceState,
                    keep: np.ndarray | None = None) -> np.ndarray:
        """The MTP head: logits (T, V) for token t+2 from the main model's hidden state at t.

        hidden (T, H): `hidden()` of the main model at positions state.length … + T (final-normalised,
        what lm_head reads, as vLLM and SGLang feed their MTP heads); next_ids (T,): token t+1 of
        each position. As published (DeepSeek-V3 §2.2, GLM-4.5/5):
        h' = eh_proj([enorm(embed(t+1)) ; hnorm(hidden_t)]), one decoder layer (MLA + DSA + MoE,
        its own cache), then shared_head.norm and the main lm_head. A checkpoint whose MTP layer has
        no indexer (config ``index_share_for_mtp_iteration``) attends to the keys `keep` (T, S)
        selects, e.g. the main model's selection at the same positions; None: every key.
        """
        L = self.mtp[0]
        T = len(next_ids)
        cos, sin = self.rope.cos_sin(np.arange(state.length, state.length + T))
        eps = self.cfg.rms_norm_eps
        e = rms_norm(embed(next_ids, self.embed_tokens), L["enorm"], eps)  # (T, H)
        x = linear(np.concatenate([e, rms_norm(hidden, L["hnorm"], eps)], axis=-1), L["eh_proj"])  # (T, H)
        x, _ = self._decoder_layer(L, x, next_ids, state, cos, sin, keep)
        state.advance(T)
        x = rms_norm(x, L["head_norm"], eps)  # (T, H)
        self.last_mtp_hidden = x  # a chained draft's stand-in for the model's hidden state at t + 1
        return linear(x, self.lm_head)
