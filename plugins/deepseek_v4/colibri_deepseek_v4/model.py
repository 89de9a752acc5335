"""DeepSeek V4 (Flash, Pro; `DeepseekV4ForCausalLM`): the whole architecture, top to bottom.

Reference: transformers/models/deepseek_v4/modeling_deepseek_v4.py (the oracle the conformance suite
uses). The residual stream is `hc_mult` (4) parallel streams h (T, n, H), mixed around each sub-block
by manifold-constrained hyper-connections (`colibri_core.layers.hyper`). Every layer:

    x = RMSNorm(collapse(h));  h = mix(h, Attention(x))     (attn_hc)
    x = RMSNorm(collapse(h));  h = mix(h, MoE(x) + SharedExpert(x))   (ffn_hc)

Attention is shared-KV multi-query: q = RMS(wq_b · RMSNorm(wq_a x)) per head (unweighted), one
K = V vector RMSNorm(wkv x) per token, RoPE on the trailing `qk_rope_head_dim` dims (interleaved
pairs), a learned sink per head, over a sliding window of `sliding_window` tokens; the output's
rope dims are rotated back, then the grouped low-rank projection wo_a (o_groups) → wo_b. By
`layer_types`, a layer also attends to compressed entries (`colibri_core.layers.compressor`):
  sliding_attention             the window only (main RoPE, θ = rope_theta)
  compressed_sparse_attention   CSA: an entry per `compress_rates[csa]` tokens with half-window
                                overlap; the lightning indexer keeps each query's `index_topk` best
  heavily_compressed_attention  HCA: an entry per `compress_rates[hca]` tokens, all visible
Compressed layers use the compress RoPE (θ = compress_rope_theta, YaRN when configured).

MoE in every layer: `mlp_layer_types` "hash_moe" layers take their experts from a table by token id
(tid2eid), "moe" layers top-k on sqrt(softplus(logits)) + bias; weights are the chosen scores
renormalised × routed_scaling_factor; experts and the shared expert are SwiGLU clamped at
swiglu_limit. Final: hc_head collapse, RMSNorm, head.

Tensor names: the container keeps the names `transformers`' save_pretrained writes
(`model.layers.N.attn.wq_a.weight`, experts `model.layers.N.ffn.experts.E.w1.weight`), and reads
the internal names of a fused save (`model.layers.N.self_attn.q_a_proj.weight`) and the official
checkpoint's (`layers.N.attn.wq_a.weight`, `embed.weight`) as aliases.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import re

import numpy as np

from colibri_core import kv
from colibri_core.errors import ColibriError
from colibri_core.layers.compressor import (
    CompressedIndexer,
    Compressor,
    visible_entries,
)
from colibri_core.layers.hyper import HyperConnection, HyperHead
from colibri_core.layers.norm import rms_norm
from colibri_core.layers.rope import Rope, rotate_tail_interleaved, yarn_inv_freq
from colibri_core.layers.router import HashRouter, SqrtSoftplusTopK
from colibri_core.layers.shared_expert import SharedExpert
from colibri_core.layers.sink_attention import (
    SlidingWindow,
    grouped_linear,
    sink_attention,
    split_rows,
)
from colibri_core.model import MoEModel, dense, embed, linear
from colibri_core.probe import record
from colibri_core.tensors import Dim, Experts, Tensor, TensorTable

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}  # the legacy `compress_ratios`


@dataclass(frozen=True)
class CompressRope:
    """The compressed layers' RoPE: θ = compress_rope_theta, YaRN when `factor` is set."""

    theta: float
    factor: float | None = None  # YaRN scaling factor (None: default RoPE)
    original_max_position: int = 0  # YaRN: the pretraining context
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class DeepseekV4Config:
    vocab_size: int
    hidden_size: int  # H
    moe_intermediate_size: int  # I: one routed expert's width, and the shared expert's (transformers
    # builds one shared expert of this width whatever n_shared_experts says)
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int  # D: query head and shared K = V width
    q_lora_rank: int
    qk_rope_head_dim: int  # r: the trailing rope dims of each head
    n_routed_experts: int  # E
    num_experts_per_tok: int  # k
    routed_scaling_factor: float
    rms_norm_eps: float
    rope_theta: float  # main RoPE (sliding layers)
    compress_rope: CompressRope  # compressed layers
    layer_types: tuple[str, ...]  # per layer: SLIDING | CSA | HCA
    compress_rates: tuple[int, int]  # (CSA, HCA) tokens per entry
    mlp_layer_types: tuple[str, ...]  # per layer: "hash_moe" | "moe"
    hc_mult: int  # residual streams
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_nextn_predict_layers: int  # MTP layers in the checkpoint (skipped: nothing runs them yet)

    def rate(self, i: int) -> int:
        """Tokens per compressed entry of layer i (0 for a sliding layer)."""
        return {SLIDING: 0, CSA: self.compress_rates[0], HCA: self.compress_rates[1]}[self.layer_types[i]]

    @classmethod
    def from_hf(cls, c: dict) -> DeepseekV4Config:
        n = c["num_hidden_layers"]
        if c.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
            raise ColibriError(f"DeepSeek V4 with scoring_func {c['scoring_func']!r} is not supported (only sqrtsoftplus)")
        if not c.get("norm_topk_prob", True) or c.get("tie_word_embeddings") or c.get("hidden_act", "silu") != "silu":
            raise ColibriError("DeepSeek V4 config: only norm_topk_prob, untied embeddings and silu are supported")
        if c.get("num_key_value_heads", 1) != 1:
            raise ColibriError("DeepSeek V4 config: num_key_value_heads must be 1 (shared K = V)")
        rates = {**{CSA: 4, HCA: 128}, **(c.get("compress_rates") or {})}
        rates[CSA] = c.get("compress_rate_csa", rates[CSA])
        rates[HCA] = c.get("compress_rate_hca", rates[HCA])
        types = c.get("layer_types")
        if types is None and c.get("compress_ratios") is not None:
            bad = [r for r in c["compress_ratios"] if r not in RATIO_TO_TYPE]
            if bad:
                raise ColibriError(f"DeepSeek V4 config: compress_ratios may only hold 0, 4 and 128, not {bad[0]}")
            types = [RATIO_TO_TYPE[r] for r in c["compress_ratios"]]
        if types is None:  # transformers' default: 2 HCA, then CSA / HCA alternating
            types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        mlp_types = c.get("mlp_layer_types")
        if mlp_types is None:
            hashed = c.get("num_hash_layers", 3)
            mlp_types = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
        if len(types) < n or len(mlp_types) < n or not set(types[:n]) <= {SLIDING, CSA, HCA} \
                or not set(mlp_types[:n]) <= {"hash_moe", "moe"}:
            raise ColibriError("DeepSeek V4 config: layer_types / mlp_layer_types must name a known kind for every layer")
        head_dim = c.get("head_dim", 512)
        partial_rotary = c.get("partial_rotary_factor")
        rope_dim = int(head_dim * partial_rotary) if partial_rotary else c.get("qk_rope_head_dim", 64)
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], moe_intermediate_size=c["moe_intermediate_size"],
            num_hidden_layers=n, num_attention_heads=c["num_attention_heads"], head_dim=head_dim,
            q_lora_rank=c["q_lora_rank"], qk_rope_head_dim=rope_dim, n_routed_experts=c["n_routed_experts"],
            num_experts_per_tok=c["num_experts_per_tok"],
            routed_scaling_factor=float(c.get("routed_scaling_factor", 1.5)), rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(_main_rope(c)), compress_rope=_compress_rope(c), layer_types=tuple(types[:n]),
            compress_rates=(rates[CSA], rates[HCA]), mlp_layer_types=tuple(mlp_types[:n]),
            hc_mult=c.get("hc_mult", 4), hc_sinkhorn_iters=c.get("hc_sinkhorn_iters", 20), hc_eps=c.get("hc_eps", 1e-6),
            swiglu_limit=float(c.get("swiglu_limit", 10.0)), sliding_window=c.get("sliding_window", 128),
            o_groups=c.get("o_groups", 8), o_lora_rank=c.get("o_lora_rank", 1024),
            index_n_heads=c.get("index_n_heads", 64), index_head_dim=c.get("index_head_dim", 128),
            index_topk=c.get("index_topk", 512), num_nextn_predict_layers=c.get("num_nextn_predict_layers", 0),
        )


def _rope_dicts(c: dict) -> tuple[dict, dict]:
    """(main, compress) RoPE parameters from `rope_parameters` (nested by "main" / "compress", or one
    flat dict that applies to the compressed layers) or the legacy `rope_scaling`."""
    rp = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return rp["main"], rp["compress"]
    flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    return {"rope_type": "default", "rope_theta": c.get("rope_theta", 10000.0)}, \
        {**flat, "rope_theta": c.get("compress_rope_theta", 160000.0)}


def _main_rope(c: dict) -> float:
    main, _ = _rope_dicts(c)
    if main.get("rope_type", main.get("type", "default")) != "default":
        raise ColibriError(f"DeepSeek V4: main rope_type {main.get('rope_type')!r} is not supported (only default)")
    return main.get("rope_theta", c.get("rope_theta", 10000.0))


def _compress_rope(c: dict) -> CompressRope:
    _, rp = _rope_dicts(c)
    kind = rp.get("rope_type", rp.get("type", "default"))
    theta = float(rp.get("rope_theta", c.get("compress_rope_theta", 160000.0)))
    if kind == "default":
        return CompressRope(theta)
    if kind != "yarn":
        raise ColibriError(f"DeepSeek V4: compress rope_type {kind!r} is not supported (default or yarn)")
    if rp.get("attention_factor", 1.0) != 1.0:
        raise ColibriError("DeepSeek V4: a YaRN attention_factor other than 1 is not supported (V4 forces 1)")
    if "original_max_position_embeddings" not in rp:
        raise ColibriError("DeepSeek V4: YaRN rope parameters lack original_max_position_embeddings")
    return CompressRope(theta, float(rp["factor"]), int(rp["original_max_position_embeddings"]),
                        float(rp.get("beta_fast") or 32), float(rp.get("beta_slow") or 1))


# ---- tensor names ----------------------------------------------------------------------------
# Each tensor has three names: the container's (`model.layers.N.attn.wq_a.weight`, as the converter
# writes it), transformers' internal one (a fused save_pretrained: `model.layers.N.self_attn.q_a_proj.weight`)
# and the official release's (`layers.N.attn.wq_a.weight`); `DeepseekV4.tensors` declares each once.
LAYER, OFFICIAL_LAYER = "model.layers.{layer}.", "layers.{layer}."
# the official checkpoint's names of the global tensors (its layer tensors: "layers.N." + the name)
OFFICIAL = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
            "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
            "model.hc_head.hc_scale": "hc_head_scale"}


# The official release: these matrices are float8 e4m3 with a UE8M0 scale per 128 × 128 block, the
# routed experts fp4 (E2M1, a UE8M0 scale per 32 columns); the rest bfloat16 / float32 (the
# compressors' and the indexer's key projections ship bf16, as transformers notes)
NATIVE_FP8 = r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123])\.weight$"


def official_name(name: str) -> str:
    """The official checkpoint's name of a container tensor (`model.layers.3.attn.wq_a.weight` →
    `layers.3.attn.wq_a.weight`, `model.embed_tokens.weight` → `embed.weight`)."""
    return OFFICIAL.get(name) or name.removeprefix("model.")


@dataclass
class Layer:
    """One decoder layer's resident weights and blocks."""

    index: int
    kind: str  # SLIDING | CSA | HCA
    attn_norm: np.ndarray  # (H,)
    ffn_norm: np.ndarray  # (H,)
    attn_hc: HyperConnection
    ffn_hc: HyperConnection
    wq_a: object  # (q_lora, H)
    q_norm: np.ndarray  # (q_lora,)
    wq_b: object  # (heads · D, q_lora)
    wkv: object  # (D, H)
    kv_norm: np.ndarray  # (D,)
    wo_a: list  # o_groups × (o_lora, heads · D / o_groups)
    wo_b: object  # (H, o_groups · o_lora)
    sinks: np.ndarray  # (heads,)
    compressor: Compressor | None
    indexer: CompressedIndexer | None
    router: object  # SqrtSoftplusTopK | HashRouter
    shared: SharedExpert  # gate, up (I_s, H), down (H, I_s), clamped at swiglu_limit


class DeepseekV4(MoEModel):
    @classmethod
    def parse_config(cls, config: dict) -> DeepseekV4Config:
        return DeepseekV4Config.from_hf(config)

    @classmethod
    def tensors(cls, cfg: DeepseekV4Config) -> TensorTable:
        """Every tensor once, by its container name and transformers' internal one (the official name
        follows from the container's); routers, the hyper-connections' mixing maps, the indexer's head
        weights, the compressors' position biases and the hash table stay f32 (HF keeps them f32 too)."""
        H, E, I = Dim("H", cfg.hidden_size), Dim("E", cfg.n_routed_experts), Dim("I", cfg.moe_intermediate_size)
        D, n, heads, d, q_lora = cfg.head_dim, cfg.hc_mult, cfg.num_attention_heads, cfg.index_head_dim, cfg.q_lora_rank
        every = range(cfg.num_hidden_layers)
        compressed = [i for i in every if cfg.layer_types[i] != SLIDING]
        csa = [i for i in every if cfg.layer_types[i] == CSA]
        hashed = [i for i in every if cfg.mlp_layer_types[i] == "hash_moe"]
        scored = [i for i in every if i not in hashed]
        wide = lambda i: 2 * D if cfg.layer_types[i] == CSA else D  # noqa: E731  CSA: overlapping windows, entries twice as wide

        def t(name: str, internal: str | None, shape, layers=every, f32: bool = False) -> Tensor:
            """Layer tensor `name` (transformers' internal name `internal`, where it differs)."""
            aliases = ((LAYER + internal,) if internal else ()) + (OFFICIAL_LAYER + name,)
            return Tensor(LAYER + name, shape, layers=layers, f32=f32, aliases=aliases,
                          native="fp8" if re.search(NATIVE_FP8, "." + name) else None)

        def top(name: str, internal: str | None, shape, f32: bool = False) -> Tensor:
            """A tensor of no layer."""
            return Tensor(name, shape, f32=f32, aliases=tuple(a for a in (internal, official_name(name)) if a and a != name))

        hc = {f"hc_{part}_{w}": t(f"hc_{part}_{w}", f"{part}_hc.{w}", shape, f32=w == "fn")
              for part in ("attn", "ffn") for w, shape in (("fn", ((2 + n) * n, n * H)), ("base", ((2 + n) * n,)), ("scale", (3,)))}
        expert = "ffn.experts.{expert}."
        return TensorTable(
            resident=dict(
                embed=top("model.embed_tokens.weight", None, (cfg.vocab_size, H)),
                attn_norm=t("attn_norm.weight", "input_layernorm.weight", (H,)),
                ffn_norm=t("ffn_norm.weight", "post_attention_layernorm.weight", (H,)),
                **hc,
                wq_a=t("attn.wq_a.weight", "self_attn.q_a_proj.weight", (q_lora, H)),
                q_norm=t("attn.q_norm.weight", "self_attn.q_a_norm.weight", (q_lora,)),
                wq_b=t("attn.wq_b.weight", "self_attn.q_b_proj.weight", (heads * D, q_lora)),
                wkv=t("attn.wkv.weight", "self_attn.kv_proj.weight", (D, H)),
                kv_norm=t("attn.norm.weight", "self_attn.kv_norm.weight", (D,)),
                wo_a=t("attn.wo_a.weight", "self_attn.o_a_proj.weight", (cfg.o_groups * cfg.o_lora_rank, heads * D // cfg.o_groups)),
                wo_b=t("attn.wo_b.weight", "self_attn.o_b_proj.weight", (H, cfg.o_groups * cfg.o_lora_rank)),
                sinks=t("attn.attn_sink", "self_attn.sinks", (heads,)),
                # the compressor, in Compressor's argument order
                c_wkv=t("attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight", lambda i: (wide(i), H), compressed),
                c_wgate=t("attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight", lambda i: (wide(i), H), compressed),
                c_ape=t("attn.compressor.ape", "self_attn.compressor.position_bias", lambda i: (cfg.rate(i), wide(i)), compressed, f32=True),
                c_norm=t("attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight", (D,), compressed),
                # the CSA indexer: its keys' compressor, then its query and head weights
                i_wkv=t("attn.indexer.compressor.wkv.weight", "self_attn.compressor.indexer.kv_proj.weight", (2 * d, H), csa),
                i_wgate=t("attn.indexer.compressor.wgate.weight", "self_attn.compressor.indexer.gate_proj.weight", (2 * d, H), csa),
                i_ape=t("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias",
                        lambda i: (cfg.rate(i), 2 * d), csa, f32=True),
                i_norm=t("attn.indexer.compressor.norm.weight", "self_attn.compressor.indexer.kv_norm.weight", (d,), csa),
                i_wq_b=t("attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight", (cfg.index_n_heads * d, q_lora), csa),
                i_weights=t("attn.indexer.weights_proj.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight",
                            (cfg.index_n_heads, H), csa, f32=True),
                gate_bias=t("ffn.gate.bias", "mlp.gate.e_score_correction_bias", (E,), scored),
                tid2eid=t("ffn.gate.tid2eid", "mlp.gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), hashed, f32=True),
                shared_gate=t("ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight", (I, H)),
                shared_up=t("ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight", (I, H)),
                shared_down=t("ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight", (H, I)),
                norm=top("model.norm.weight", None, (H,)),
                hc_head_fn=top("model.hc_head.hc_fn", None, (n, n * H), f32=True),
                hc_head_base=top("model.hc_head.hc_base", None, (n,)),
                hc_head_scale=top("model.hc_head.hc_scale", None, (1,)),
                head=top("head.weight", "lm_head.weight", (cfg.vocab_size, H)),
            ),
            experts=Experts(
                layers=every, n=E, hidden=H, intermediate=I, top_k=cfg.num_experts_per_tok,
                router=t("ffn.gate.weight", "mlp.gate.weight", (E, H), layers=None),
                gate=Tensor(LAYER + expert + "w1.weight", (I, H), aliases=(OFFICIAL_LAYER + expert + "w1.weight",)),
                up=Tensor(LAYER + expert + "w3.weight", (I, H), aliases=(OFFICIAL_LAYER + expert + "w3.weight",)),
                down=Tensor(LAYER + expert + "w2.weight", (H, I), aliases=(OFFICIAL_LAYER + expert + "w2.weight",)),
                gate_up=Tensor(LAYER + "mlp.experts.gate_up_proj", (E, 2 * I, H)),
                down_fused=Tensor(LAYER + "mlp.experts.down_proj", (E, H, I)),
                limit=cfg.swiglu_limit, native="fp4",
            ),
            ignore=(r"^mtp\.", r"^model\.mtp\."),  # the MTP head: nothing runs it yet
        )

    @classmethod
    def state_floats_per_token(cls, cfg: DeepseekV4Config) -> list[int]:
        """Per layer, the compressed entries' growth: head_dim / rate (CSA 512/4, HCA 512/128; 0 for a
        sliding layer, whose window does not grow). The indexer's entries are counted apart."""
        return [cfg.head_dim // cfg.rate(i) if cfg.rate(i) else 0 for i in range(cfg.num_hidden_layers)]

    @classmethod
    def kept_apart_floats_per_token(cls, cfg: DeepseekV4Config) -> dict[str, list[int]]:
        """The CSA indexer's compressed keys: index_head_dim / rate per CSA layer."""
        return {"indexer_keys": [cfg.index_head_dim // cfg.rate(i) if cfg.layer_types[i] == CSA else 0
                                 for i in range(cfg.num_hidden_layers)]}

    @classmethod
    def fixed_state_floats(cls, cfg: DeepseekV4Config) -> int:
        """What does not grow: every layer's window (window − 1 rows of head_dim) and, per compressor,
        at most rate − 1 buffered projections and the carried half-window (CSA)."""
        total = 0
        for i in range(cfg.num_hidden_layers):
            total += (cfg.sliding_window - 1) * cfg.head_dim
            rate = cfg.rate(i)
            if cfg.layer_types[i] == CSA:
                total += (rate - 1) * 4 * cfg.head_dim + rate * 2 * cfg.head_dim  # buffers (kv, gate) + carry
                total += (rate - 1) * 4 * cfg.index_head_dim + rate * 2 * cfg.index_head_dim
            elif cfg.layer_types[i] == HCA:
                total += (rate - 1) * 2 * cfg.head_dim
        return total

    def __init__(self, cfg: DeepseekV4Config, weights, store):
        super().__init__(cfg, weights, store)
        r = cfg.qk_rope_head_dim
        self.main_rope = Rope(r, cfg.rope_theta)
        cr = cfg.compress_rope
        self.compress_rope = Rope(r, cr.theta, None if cr.factor is None else yarn_inv_freq(
            r, cr.theta, cr.factor, cr.original_max_position, cr.beta_fast, cr.beta_slow))
        top = self.tensors(cfg).take(weights)
        self.embed_tokens = top["embed"]  # (V, H)
        self.layers = [self._layer(weights, i) for i in range(cfg.num_hidden_layers)]
        self.norm = top["norm"]  # (H,)
        self.hc_head = HyperHead(top["hc_head_fn"], top["hc_head_base"], top["hc_head_scale"], cfg.hc_eps, cfg.rms_norm_eps)
        self.head = top["head"]  # (V, H)

    def _layer(self, weights, i: int) -> Layer:
        """Layer i from its tensors, by key."""
        cfg = self.cfg
        w = self.tensors(cfg).take(weights, i)
        hc = partial(HyperConnection, n=cfg.hc_mult, iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
        kind, rate, eps = cfg.layer_types[i], cfg.rate(i), cfg.rms_norm_eps
        compressor = indexer = None
        if kind != SLIDING:
            compressor = Compressor(w["c_wkv"], w["c_wgate"], dense(w["c_ape"]), w["c_norm"], rate=rate, width=cfg.head_dim,
                                    overlap=kind == CSA, rope=self.compress_rope, eps=eps)
        if kind == CSA:
            keys = Compressor(w["i_wkv"], w["i_wgate"], dense(w["i_ape"]), w["i_norm"], rate=rate, width=cfg.index_head_dim,
                              overlap=True, rope=self.compress_rope, eps=eps)
            indexer = CompressedIndexer(keys, w["i_wq_b"], w["i_weights"], cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk)
        router_input = partial(rms_norm, weight=w["ffn_norm"], eps=eps)
        if cfg.mlp_layer_types[i] == "hash_moe":
            router = HashRouter(w["router"], dense(w["tid2eid"]), cfg.routed_scaling_factor, input=router_input)
        else:
            router = SqrtSoftplusTopK(w["router"], w["gate_bias"], cfg.num_experts_per_tok, cfg.routed_scaling_factor,
                                      input=router_input)
        return Layer(
            index=i, kind=kind, attn_norm=w["attn_norm"], ffn_norm=w["ffn_norm"],
            attn_hc=hc(w["hc_attn_fn"], w["hc_attn_base"], w["hc_attn_scale"]),
            ffn_hc=hc(w["hc_ffn_fn"], w["hc_ffn_base"], w["hc_ffn_scale"]),
            wq_a=w["wq_a"], q_norm=w["q_norm"], wq_b=w["wq_b"], wkv=w["wkv"], kv_norm=w["kv_norm"],
            wo_a=split_rows(w["wo_a"], cfg.o_groups), wo_b=w["wo_b"], sinks=w["sinks"], compressor=compressor,
            indexer=indexer, router=router,
            shared=SharedExpert(w["shared_gate"], w["shared_up"], w["shared_down"], limit=cfg.swiglu_limit))

    def routers(self) -> dict:
        """Every layer: hash layers by token id (their lookahead reads the table), the others
        sqrt-softplus top-k with bias, on the post-attention RMSNorm of the collapsed streams."""
        return {L.index: L.router for L in self.layers}

    def new_state(self, kv_cache: str = "f32") -> kv.SequenceState:
        """Per layer: the sliding window's last K = V rows ("layer.{i}"); on compressed layers the
        compressor's state ("layer.{i}.compressor": entries, the unfinished window, the carried
        half-window) and on CSA layers the indexer's ("layer.{i}.indexer"). Everything a session
        needs to continue mid-window bit-identically; all fixed-size (no KV cache: `kv_cache` does
        not apply)."""
        cfg, parts = self.cfg, {}
        for L in self.layers:
            parts[f"layer.{L.index}"] = SlidingWindow(cfg.sliding_window, cfg.head_dim)
            if L.compressor is not None:
                parts[f"layer.{L.index}.compressor"] = L.compressor.new_state()
            if L.indexer is not None:
                parts[f"layer.{L.index}.indexer"] = L.indexer.compressor.new_state()
        return kv.SequenceState(parts)

    # ---- the layer graph ---------------------------------------------------------------------
    def _attention(self, L: Layer, x: np.ndarray, state: kv.SequenceState, start: int) -> np.ndarray:
        """Layer L's attention on x (T, H) of the tokens at start … start + T − 1 → (T, H)."""
        cfg = self.cfg
        T, heads, D = len(x), cfg.num_attention_heads, cfg.head_dim
        positions = np.arange(start, start + T)
        cos, sin = (self.main_rope if L.kind == SLIDING else self.compress_rope).cos_sin(positions)  # (T, r)
        q_residual = rms_norm(linear(x, L.wq_a), L.q_norm, cfg.rms_norm_eps)  # (T, q_lora)
        q = linear(q_residual, L.wq_b).reshape(T, heads, D)
        q = q / np.sqrt(np.mean(q * q, axis=-1, keepdims=True) + np.float32(cfg.rms_norm_eps))  # unweighted, per head
        q = rotate_tail_interleaved(q, cos, sin)  # (T, heads, D)
        kv = rotate_tail_interleaved(rms_norm(linear(x, L.wkv), L.kv_norm, cfg.rms_norm_eps)[:, None, :], cos, sin)[:, 0]
        rows = state[f"layer.{L.index}"].extend(kv)  # (R, D)
        extra = mask = None
        if L.compressor is not None:
            extra = L.compressor(x, state[f"layer.{L.index}.compressor"])  # (E, D)
            if L.indexer is not None:
                mask = L.indexer.select(x, q_residual, positions, cos, sin, state[f"layer.{L.index}.indexer"])
            else:
                mask = visible_entries(positions, len(extra), L.compressor.rate)
        out = sink_attention(q, rows, start, cfg.sliding_window, extra, mask, L.sinks, D ** -0.5)  # (T, heads, D)
        out = rotate_tail_interleaved(out, cos, -sin)  # the values' rope rotated back at the query's position
        return linear(grouped_linear(out.reshape(T, cfg.o_groups, -1), L.wo_a), L.wo_b)  # (T, H)

    def forward(self, ids: np.ndarray, state: kv.SequenceState, last_only: bool = False) -> np.ndarray:
        cfg = self.cfg
        T, start, eps = len(ids), state.length, cfg.rms_norm_eps
        h = np.repeat(embed(ids, self.embed_tokens)[:, None, :], cfg.hc_mult, axis=1)  # (T, n, H): n streams
        for L in self.layers:
            # ---- attention, mixed into the streams by attn_hc
            pre, post, comb = L.attn_hc.weights(h)
            x = rms_norm(HyperConnection.collapse(h, pre), L.attn_norm, eps)  # (T, H)
            h = HyperConnection.expand(h, self._attention(L, x, state, start), post, comb)
            # ---- routed experts + the shared expert, mixed by ffn_hc
            pre, post, comb = L.ffn_hc.weights(h)
            collapsed = HyperConnection.collapse(h, pre)  # (T, H): the stream the router's input is normalised from
            x = rms_norm(collapsed, L.ffn_norm, eps)
            out = self.moe(L.index, x, collapsed, ids, shared=L.shared)
            h = HyperConnection.expand(h, out, post, comb)
            record(L.index, l_out=h.reshape(T * cfg.hc_mult, -1))  # the streams after layer i (colibri_core.probe)
        state.advance(T)
        if last_only:
            h = h[-1:]
        return linear(rms_norm(self.hc_head(h), self.norm, eps), self.head)  # (T, V)
