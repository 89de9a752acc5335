"""Kimi-Linear (`KimiLinearForCausalLM`) and Kimi K3 (`KimiK3ForCausalLM`): two models over shared blocks.

Reference: transformers/models/kimi_linear/modeling_kimi_linear.py (the oracle of Kimi-Linear's
conformance suite). A hybrid: `layer_types` (or `linear_attn_config.kda_layers` /
`full_attn_layers`, 1-indexed) says which token mixer each layer has:

    x = RMSNorm(h);  h += KDA(x)        Kimi Delta Attention: per-channel decay, fixed-size state
                  or h += MLA(x)        multi-head latent attention without RoPE (NoPE): the
                                        "rope" key part is shared and never rotated
    x = RMSNorm(h);  h += MLP(x)        the first `first_k_dense_replace` layers: a dense SwiGLU
                  or h += MoE(x) + shared(x)
                                        sigmoid scores + correction bias, group-limited top-k,
                                        renormalised × routed_scaling_factor; shared SwiGLU experts

Final RMSNorm, lm_head.

Kimi K3 keeps that skeleton and changes five things (the project's architecture notes, "Kimi K3"; no transformers
class implements K3, see the plugin's README for what each part is verified against):
  - attention residuals: each sub-layer reads a softmax mix of the stored block outputs and the
    running prefix instead of the plain residual stream (`colibri_core.layers.attn_res`);
  - MLA with q_lora and a sigmoid output gate `o_proj(attn ⊙ σ(g_proj x))`;
  - KDA with the lower-bounded decay g = −5 σ(·) and a full-rank output gate `g_proj`;
  - a latent MoE: experts run on z = routed_expert_down_proj x, their weighted sum is RMS-normalised
    and up-projected (routed_expert_up_proj);
  - SiTU-GLU `4 tanh(g/4) σ(g) · 25 tanh(u/25)` in every MLP (experts, shared, dense).
Its checkpoint nests the text model under ``language_model.`` and its config under ``text_config``.

Checkpoints of Kimi-Linear come in three spellings, all read: the released one
(`block_sparse_moe.*` MoE, `mlp.*` dense layer, separate q/k/v convs), transformers' own
`save_pretrained` (the dense layer also under `block_sparse_moe.`) and transformers' fused form
(`mlp.*`, one stacked `conv1d`, the decay under `forget_gate.`, fused experts): the tensor table names
the first two as the tensors and the others as aliases.

Top to bottom: the two configs; the blocks both models build (each as its tensors, declared once, and
as the block from a layer's tensors by key, the variant's parts passed in); `KimiLinear`; `KimiK3(KimiLinear)`, which
replaces the layer (its tensors and blocks), the MLP sub-layer and the layer graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import numpy as np

from colibri_core import kv
from colibri_core.errors import ColibriError
from colibri_core.layers.attn_res import attn_res_mix
from colibri_core.layers.gated_attention import sigmoid
from colibri_core.layers.kda import KDADims, KDAState, KimiDeltaAttention
from colibri_core.layers.mla import MLA, MLACache, MLADims
from colibri_core.layers.mlp import swiglu_mlp
from colibri_core.layers.norm import rms_norm
from colibri_core.layers.router import SigmoidGroupTopK
from colibri_core.layers.shared_expert import SharedExpert
from colibri_core.layers.situ import situ_mlp
from colibri_core.model import MoEModel, embed, linear
from colibri_core.probe import record
from colibri_core.tensors import Dim, Experts, Tensor, TensorTable

KDA, MLA_KIND = "linear_attention", "full_attention"
LATENT_NORM_EPS = 1e-5  # K3's routed_expert_norm
MLA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm (transformers' default, K3's published value)


# ---- config ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KimiConfig:
    """Kimi-Linear's config; K3's adds to it (`K3Config`)."""

    NAME: ClassVar[str] = "Kimi-Linear"
    HIDDEN_ACT: ClassVar[str] = "silu"  # every MLP's GLU: SwiGLU

    vocab_size: int
    hidden_size: int  # H
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # per layer: "linear_attention" (KDA) or "full_attention" (MLA)
    moe_layers: tuple[int, ...]  # layers with routed experts; the others have a dense MLP
    # MLA (NoPE)
    num_attention_heads: int
    q_lora_rank: int  # 0: a plain q_proj
    kv_lora_rank: int  # c
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # r: the shared key part (never rotated)
    v_head_dim: int
    # KDA
    linear_num_heads: int  # Hh
    linear_head_dim: int  # dk = dv
    linear_conv_kernel_dim: int  # K
    # MLP / MoE
    intermediate_size: int  # the dense layers' width
    moe_intermediate_size: int  # I: one routed expert's width
    n_shared_experts: int  # shared expert width = n_shared_experts · I
    num_experts: int  # E
    num_experts_per_tok: int  # k
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float

    @classmethod
    def from_hf(cls, config: dict) -> KimiConfig:
        """config.json (the text model's part under `text_config` where it has one) → the config."""
        c = config["text_config"] if isinstance(config.get("text_config"), dict) else config
        act = c.get("hidden_act", cls.HIDDEN_ACT)
        if act != cls.HIDDEN_ACT:
            raise ColibriError(f"{cls.NAME} with hidden_act {act!r} is not supported (only {cls.HIDDEN_ACT!r})")
        return cls(**cls._fields(c))

    @classmethod
    def _fields(cls, c: dict) -> dict:
        """The fields, from the text config `c`."""
        for key, supported in (("mla_use_nope", True), ("moe_router_activation_func", "sigmoid"),
                               ("moe_layer_freq", 1), ("attention_bias", False), ("tie_word_embeddings", False)):
            if c.get(key, supported) != supported:
                raise ColibriError(f"{cls.NAME} with {key} {c[key]!r} is not supported (only {supported!r})")
        layers = c["num_hidden_layers"]
        lin = c.get("linear_attn_config") or {}
        types = c.get("layer_types")
        if types is None:  # as transformers: the checkpoint's 1-indexed lists, else every 4th (i > 0) is MLA
            if "full_attn_layers" in lin and "kda_layers" in lin:
                types = [None] * layers
                for i in lin["full_attn_layers"]:
                    types[i - 1] = MLA_KIND
                for i in lin["kda_layers"]:
                    types[i - 1] = KDA
            else:
                types = [MLA_KIND if i and i % 4 == 0 else KDA for i in range(layers)]
        if len(types) != layers or set(types) - {KDA, MLA_KIND}:
            raise ColibriError(f"config.json layer_types (or linear_attn_config) must give each of the {layers} "
                               f"layers one type, {KDA!r} or {MLA_KIND!r}")
        mlp = c.get("mlp_layer_types")
        if mlp is None:
            dense = c.get("first_k_dense_replace", 1)
            mlp = ["dense" if i < dense else "sparse" for i in range(layers)]
        if len(mlp) != layers or set(mlp) - {"dense", "sparse"}:
            raise ColibriError(f"config.json mlp_layer_types must list {layers} entries, each 'dense' or 'sparse'")
        get = lambda *keys, default=None: next((c[k] for k in keys if c.get(k) is not None), default)  # noqa: E731
        experts = get("num_experts", "num_local_experts")
        groups = get("num_expert_group", "n_group", default=1)
        if experts % groups:
            raise ColibriError(f"num_experts ({experts}) must be a multiple of the expert groups ({groups})")
        return dict(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_hidden_layers=layers,
            layer_types=tuple(types), moe_layers=tuple(i for i, t in enumerate(mlp) if t == "sparse"),
            num_attention_heads=c["num_attention_heads"], q_lora_rank=c.get("q_lora_rank") or 0,
            kv_lora_rank=c["kv_lora_rank"], qk_nope_head_dim=c["qk_nope_head_dim"],
            qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c.get("v_head_dim") or c["qk_nope_head_dim"],
            linear_num_heads=lin.get("num_heads", c.get("linear_num_heads", 32)),
            linear_head_dim=lin.get("head_dim", c.get("linear_head_dim", 128)),
            linear_conv_kernel_dim=lin.get("short_conv_kernel_size", c.get("linear_conv_kernel_dim", 4)),
            intermediate_size=c["intermediate_size"], moe_intermediate_size=c["moe_intermediate_size"],
            n_shared_experts=get("num_shared_experts", "n_shared_experts", default=1),
            num_experts=experts, num_experts_per_tok=get("num_experts_per_token", "num_experts_per_tok"),
            n_group=groups, topk_group=get("topk_group", default=1),
            norm_topk_prob=bool(get("moe_renormalize", "norm_topk_prob", default=True)),
            routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
            rms_norm_eps=c.get("rms_norm_eps", 1e-5),
        )

    @property
    def kda(self) -> KDADims:
        return KDADims(self.linear_num_heads, self.linear_head_dim, self.linear_conv_kernel_dim)

    @property
    def mla(self) -> MLADims:
        return MLADims(heads=self.num_attention_heads, q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                       qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                       v_head_dim=self.v_head_dim, scale=(self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5,
                       norm_eps=MLA_NORM_EPS)


@dataclass(frozen=True)
class K3Config(KimiConfig):
    """Kimi K3's: Kimi-Linear's, plus the attention residuals' blocks, the latent MoE's width and the
    KDA decay's lower bound."""

    NAME: ClassVar[str] = "Kimi K3"
    HIDDEN_ACT: ClassVar[str] = "situ"  # every MLP's GLU: SiTU-GLU

    attn_res_block_size: int  # layers per attention-residual block
    moe_latent_size: int  # Z: the latent MoE's width (the routed experts' input and output)
    kda_gate_lower_bound: float  # −5: g = lb · σ(…)

    @classmethod
    def _fields(cls, c: dict) -> dict:
        lin = c.get("linear_attn_config") or {}
        return {**super()._fields(c), "attn_res_block_size": c["attn_res_block_size"],
                "moe_latent_size": c["moe_latent_size"],
                "kda_gate_lower_bound": float(lin.get("gate_lower_bound", c.get("linear_lower_bound", -5.0)))}


# ---- the blocks both models build --------------------------------------------------------------
# Each block's tensors (key → Tensor, on the layers given, names under the layer prefix `L`);
# builders take `w`, a layer's tensors by key. What differs between the models (an output gate,
# A_log's shape, the latent MoE's tensors) is passed in.
def _kda_tensors(cfg: KimiConfig, L: str, layers, A_log: tuple[int, ...], gate: dict) -> dict[str, Tensor]:
    """A KDA layer's tensors, transformers' fused names as aliases (the decay's under `forget_gate.`,
    the q/k/v convs as rows of one stacked `conv1d`); `gate`: its output gate's, by key. β and the
    decay's projections stay float32 (the decay is exponentiated: an error compounds over the context)."""
    H, Hh, dk, K = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    n, a, t = Hh * dk, L + "self_attn.", partial(Tensor, layers=layers)
    conv = {f"{c}_conv": t(a + f"{c}_conv1d.weight", (n, 1, K), aliases=((a + "conv1d.weight", j * n, (j + 1) * n),))
            for j, c in enumerate("qkv")}
    decay = {key: t(a + name, shape, f32=key.startswith("f_"), aliases=(a + "forget_gate." + name,))
             for key, name, shape in (("f_a", "f_a_proj.weight", (dk, H)), ("f_b", "f_b_proj.weight", (n, dk)),
                                      ("A_log", "A_log", A_log), ("dt_bias", "dt_bias", (n,)))}
    return {"q_proj": t(a + "q_proj.weight", (n, H)), "k_proj": t(a + "k_proj.weight", (n, H)),
            "v_proj": t(a + "v_proj.weight", (n, H)), **conv, **decay,
            "b_proj": t(a + "b_proj.weight", (Hh, H), f32=True), **gate,
            "o_norm": t(a + "o_norm.weight", (dk,)), "kda_o_proj": t(a + "o_proj.weight", (H, n))}


def _kda(cfg: KimiConfig, w, **variant) -> KimiDeltaAttention:
    """A KDA layer; `variant`: its output gate's matrices and the decay's lower bound, if any."""
    n = cfg.linear_num_heads * cfg.linear_head_dim
    conv = np.concatenate([w[f"{c}_conv"][:, 0, :] for c in "qkv"])  # (3n, K)
    return KimiDeltaAttention(
        dims=cfg.kda, q_proj=w["q_proj"], k_proj=w["k_proj"], v_proj=w["v_proj"],
        conv_weight=np.ascontiguousarray(conv, np.float32),
        f_a=w["f_a"], f_b=w["f_b"],  # (dk, H), (n, dk) float32
        A_log=np.ascontiguousarray(w["A_log"].reshape(-1)[: cfg.linear_num_heads]),  # K3 pads it
        dt_bias=w["dt_bias"].reshape(n), b_proj=w["b_proj"],
        o_norm=w["o_norm"], o_proj=w["kda_o_proj"], eps=cfg.rms_norm_eps, **variant)


def _mla_tensors(cfg: KimiConfig, L: str, layers, gate: dict) -> dict[str, Tensor]:
    """An MLA layer's tensors; `gate`: its output gate's, by key."""
    d, H, a, t = cfg.mla, cfg.hidden_size, L + "self_attn.", partial(Tensor, layers=layers)
    qk = d.qk_nope_head_dim + d.qk_rope_head_dim
    if d.q_lora_rank:
        q = {"q_a": t(a + "q_a_proj.weight", (d.q_lora_rank, H)), "q_a_norm": t(a + "q_a_layernorm.weight", (d.q_lora_rank,)),
             "q_b": t(a + "q_b_proj.weight", (d.heads * qk, d.q_lora_rank))}
    else:
        q = {"mla_q_proj": t(a + "q_proj.weight", (d.heads * qk, H))}
    return {**q, "kv_a": t(a + "kv_a_proj_with_mqa.weight", (d.kv_lora_rank + d.qk_rope_head_dim, H)),
            "kv_a_norm": t(a + "kv_a_layernorm.weight", (d.kv_lora_rank,)),
            "kv_b": t(a + "kv_b_proj.weight", (d.heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank)),
            **gate, "mla_o_proj": t(a + "o_proj.weight", (H, d.heads * d.v_head_dim))}


@dataclass
class NoPEMLA:
    """MLA without RoPE: the core's MLA with the shared key part never rotated; its q_lora query, or
    a plain `q_proj`. No output gate."""

    mla: MLA
    q_proj: Any = None  # (heads (nope + r), H): a plain query; None: the MLA's q_lora query

    def __call__(self, x: np.ndarray, cache: MLACache) -> np.ndarray:
        """x (T, H) normalised → (T, H); the T tokens' latents join `cache`."""
        mla, d, T = self.mla, self.mla.d, len(x)
        cos, sin = np.ones((T, d.qk_rope_head_dim), np.float32), np.zeros((T, d.qk_rope_head_dim), np.float32)
        if self.q_proj is None:
            _, q_nope, q_rope = mla.query(x, cos, sin)
        else:
            q = linear(x, self.q_proj).reshape(T, d.heads, d.qk_nope_head_dim + d.qk_rope_head_dim)
            q_nope, q_rope = q[..., : d.qk_nope_head_dim], _unrotated(q[..., d.qk_nope_head_dim:])
        mla.compress(x, cos, sin, cache)
        return mla.attend(q_nope, q_rope, cache, gate=self.gate(x))

    def gate(self, x: np.ndarray) -> np.ndarray | None:
        """The heads' output gate (T, heads v) on x (T, H): none."""
        return None


@dataclass(kw_only=True)
class GatedNoPEMLA(NoPEMLA):
    """K3's MLA: the heads' outputs gated by σ(g_proj x) before o_proj."""

    g_proj: Any  # (heads v, H)

    def gate(self, x: np.ndarray) -> np.ndarray:
        return sigmoid(linear(x, self.g_proj))  # (T, heads v)


def _nope_mla(cfg: KimiConfig, w, block: type[NoPEMLA] = NoPEMLA, **gate) -> NoPEMLA:
    """An MLA layer as `block`, given its output gate's matrices (`gate`) where it has one."""
    mla = MLA(cfg.mla, w.get("q_a"), w.get("q_a_norm"), w.get("q_b"),  # (q_lora, H), (q_lora,), (heads (nope + r), q_lora)
              w["kv_a"], w["kv_a_norm"], w["kv_b"],  # (c + r, H), (c,), (heads (nope + v), c)
              w["mla_o_proj"])  # (H, heads v)
    return block(mla, w.get("mla_q_proj"), **gate)  # a plain query where there is no q_lora


def _unrotated(x: np.ndarray) -> np.ndarray:
    """x (T, heads, r) in the layout MLA's rope path gives its keys (de-interleaved pairs; cos 1,
    sin 0 rotate nothing), so queries and keys meet in the same order."""
    return np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def _glu_tensors(key: str, prefix: str, width: int, H: int, layers, aliases: tuple[str, ...] = ()) -> dict[str, Tensor]:
    """A GLU MLP's gate (width, H), up (width, H) and down (H, width) under `prefix` (and the other
    prefixes `aliases`), keyed `key` + "_gate" / "_up" / "_down"."""
    return {f"{key}_{p}": Tensor(prefix + f"{p}_proj.weight", shape, layers=layers,
                                 aliases=tuple(a + f"{p}_proj.weight" for a in aliases))
            for p, shape in (("gate", (width, H)), ("up", (width, H)), ("down", (H, width)))}


def _glu(w, key: str) -> tuple:
    """A GLU MLP's (gate, up, down) keyed `key`."""
    return w[f"{key}_gate"], w[f"{key}_up"], w[f"{key}_down"]


def _router(cfg: KimiConfig, w, post_norm: np.ndarray) -> SigmoidGroupTopK:
    """An MoE layer's router, on the post-attention RMSNorm of the sub-layer's input."""
    return SigmoidGroupTopK(w["router"], w["score_bias"],  # (E, H) float32, (E,)
                            cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob,
                            cfg.routed_scaling_factor, input=partial(rms_norm, weight=post_norm, eps=cfg.rms_norm_eps))


# ---- Kimi-Linear -------------------------------------------------------------------------------
@dataclass
class Layer:
    """One decoder layer's blocks and norms."""

    mixer: KimiDeltaAttention | NoPEMLA  # normalised (T, H) and its state part → (T, H)
    input_norm: np.ndarray  # (H,)
    post_norm: np.ndarray  # (H,)
    mlp: tuple | None = None  # dense: gate (F, H), up (F, H), down (H, F)
    router: SigmoidGroupTopK | None = None  # MoE: (E, H) float32 + bias (E,)
    shared: SharedExpert | None = None  # MoE: the shared experts, (S, H), (S, H), (H, S)


class KimiLinear(MoEModel):
    """Kimi-Linear: KDA and NoPE MLA token mixers, SwiGLU MLPs, a plain residual stream."""

    Config = KimiConfig
    PREFIX, HEAD_PREFIX = "model.", ""  # of the decoder's tensors, of lm_head

    @classmethod
    def parse_config(cls, config: dict) -> KimiConfig:
        try:
            return cls.Config.from_hf(config)
        except KeyError as e:
            raise ColibriError(f"config.json lacks {e.args[0]!r}, which a {cls.Config.NAME} model needs") from None
        except (TypeError, ValueError, ZeroDivisionError, IndexError) as e:
            raise ColibriError(f"config.json is not a valid {cls.Config.NAME} config: {e}") from None

    @classmethod
    def tensors(cls, cfg: KimiConfig) -> TensorTable:
        """The embedding, every layer's tensors (`_layer_tensors`), the head's (`_head_tensors`) and the
        routed experts (`_experts`)."""
        return TensorTable(resident={"embed": Tensor(cls.PREFIX + "embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size)),
                                     **cls._layer_tensors(cfg), **cls._head_tensors(cfg)},
                           experts=cls._experts(cfg, Dim("H", cfg.hidden_size)))

    @classmethod
    def _experts(cls, cfg: KimiConfig, hidden: Dim, **kind) -> Experts:
        """The routed experts on `hidden` wide inputs (`kind`: their activation, native form)."""
        E, I = Dim("E", cfg.num_experts), Dim("I", cfg.moe_intermediate_size)
        L = cls.PREFIX + "layers.{layer}."
        expert = L + "block_sparse_moe.experts.{expert}."
        return Experts(
            layers=cfg.moe_layers, n=E, hidden=hidden, intermediate=I, top_k=cfg.num_experts_per_tok,
            router=Tensor(L + "block_sparse_moe.gate.weight", (E, Dim("H", cfg.hidden_size)), aliases=cls._mlp_alias(L, "gate.weight")),
            gate=Tensor(expert + "w1.weight", (I, hidden), aliases=cls._native(expert + "w1")),
            up=Tensor(expert + "w3.weight", (I, hidden), aliases=cls._native(expert + "w3")),
            down=Tensor(expert + "w2.weight", (hidden, I), aliases=cls._native(expert + "w2")),
            gate_up=Tensor(L + "mlp.experts.gate_up_proj", (E, 2 * I, hidden)),  # transformers' fused save
            down_fused=Tensor(L + "mlp.experts.down_proj", (E, hidden, I)), **kind)

    @classmethod
    def _native(cls, name: str) -> tuple[str, ...]:
        """The official release's other name of expert matrix `name`: none."""
        return ()

    @classmethod
    def _mlp_alias(cls, L: str, name: str) -> tuple[str, ...]:
        """The other name of MoE tensor `block_sparse_moe.{name}`: transformers' fused save's `mlp.{name}`."""
        return (L + "mlp." + name,)

    @classmethod
    def _head_tensors(cls, cfg: KimiConfig) -> dict[str, Tensor]:
        """The tensors after the layers: the final norm, lm_head."""
        return {"norm": Tensor(cls.PREFIX + "norm.weight", (cfg.hidden_size,)),
                "lm_head": Tensor(cls.HEAD_PREFIX + "lm_head.weight", (cfg.vocab_size, cfg.hidden_size))}

    @classmethod
    def _layer_tensors(cls, cfg: KimiConfig) -> dict[str, Tensor]:
        """Every layer's resident tensors: the norms around the model's token mixers and MLPs."""
        L, every, kda, mla, moe, dense = cls._layer_sets(cfg)
        H = cfg.hidden_size
        return {"input_norm": Tensor(L + "input_layernorm.weight", (H,), layers=every), **cls._mixer_tensors(cfg, L, kda, mla),
                "post_norm": Tensor(L + "post_attention_layernorm.weight", (H,), layers=every),
                **cls._mlp_tensors(cfg, L, moe, dense)}

    @classmethod
    def _mixer_tensors(cls, cfg: KimiConfig, L: str, kda, mla) -> dict[str, Tensor]:
        """KDA with a low-rank output gate, or NoPE MLA."""
        H, n, dk = cfg.hidden_size, cfg.linear_num_heads * cfg.linear_head_dim, cfg.linear_head_dim
        gate = {"g_a": Tensor(L + "self_attn.g_a_proj.weight", (dk, H), layers=kda),
                "g_b": Tensor(L + "self_attn.g_b_proj.weight", (n, dk), layers=kda)}
        return {**_kda_tensors(cfg, L, kda, A_log=(1, 1, cfg.linear_num_heads, 1), gate=gate), **_mla_tensors(cfg, L, mla, {})}

    @classmethod
    def _mlp_tensors(cls, cfg: KimiConfig, L: str, moe, dense) -> dict[str, Tensor]:
        """The MoE layers' (beside the experts), and the dense layer's MLP as transformers saves it
        (the released `mlp.*`: an alias)."""
        return {**cls._moe_tensors(cfg, L, moe, {}),
                **_glu_tensors("mlp", L + "block_sparse_moe.", cfg.intermediate_size, cfg.hidden_size, dense, aliases=(L + "mlp.",))}

    @classmethod
    def _layer_sets(cls, cfg: KimiConfig) -> tuple:
        """The layer prefix, then the layers: all, KDA, MLA, with routed experts, dense."""
        every = range(cfg.num_hidden_layers)
        return (cls.PREFIX + "layers.{layer}.", every, [i for i in every if cfg.layer_types[i] == KDA],
                [i for i in every if cfg.layer_types[i] == MLA_KIND], cfg.moe_layers, [i for i in every if i not in cfg.moe_layers])

    @classmethod
    def _moe_tensors(cls, cfg: KimiConfig, L: str, layers, latent: dict) -> dict[str, Tensor]:
        """An MoE layer's resident tensors beside the router (correction bias, shared experts);
        `latent`: the latent MoE's, by key."""
        m = L + "block_sparse_moe."
        return {"score_bias": Tensor(m + "gate.e_score_correction_bias", (cfg.num_experts,), layers=layers,
                                     aliases=cls._mlp_alias(L, "gate.e_score_correction_bias")), **latent,
                **_glu_tensors("shared", m + "shared_experts.", cfg.n_shared_experts * cfg.moe_intermediate_size,
                               cfg.hidden_size, layers, aliases=cls._mlp_alias(L, "shared_experts."))}

    @classmethod
    def state_floats_per_token(cls, cfg: KimiConfig) -> list[int]:
        """Per layer, the state floats each token adds: the MLA latent + shared key part (576 for
        Kimi-Linear and K3), 0 for KDA layers (fixed-size: see `fixed_state_floats`)."""
        return [cfg.kv_lora_rank + cfg.qk_rope_head_dim if t == MLA_KIND else 0 for t in cfg.layer_types]

    @classmethod
    def fixed_state_floats(cls, cfg: KimiConfig) -> int:
        """State floats that do not grow with the context: every KDA layer's conv window + recurrent state."""
        return cfg.layer_types.count(KDA) * cfg.kda.state_floats

    # ---- with the weights ------------------------------------------------------------------------
    def __init__(self, cfg: KimiConfig, weights, store):
        super().__init__(cfg, weights, store)
        top = self.tensors(cfg).take(weights)
        self.embed_tokens = top["embed"]  # (V, H)
        self.layers = [self._layer(weights, i) for i in range(cfg.num_hidden_layers)]
        self.norm = top["norm"]  # (H,)
        self.lm_head = top["lm_head"]  # (V, H)

    def _layer(self, weights, i: int) -> Layer:
        """Layer i from its tensors, by key."""
        cfg = self.cfg
        w = self.tensors(cfg).take(weights, i)
        if cfg.layer_types[i] == KDA:
            mixer = _kda(cfg, w, g_a=w["g_a"], g_b=w["g_b"])
        else:
            mixer = _nope_mla(cfg, w)
        norms = w["input_norm"], w["post_norm"]
        if i not in cfg.moe_layers:
            return Layer(mixer, *norms, mlp=_glu(w, "mlp"))
        return Layer(mixer, *norms, router=_router(cfg, w, norms[1]), shared=SharedExpert(*_glu(w, "shared"), glu="swiglu"))

    def routers(self) -> dict:
        """Every sparse layer: sigmoid scores + correction bias, group-limited top-k, renormalised ×
        routed_scaling_factor, on the post-attention RMSNorm of the MoE sub-layer's input."""
        return {i: L.router for i, L in enumerate(self.layers) if L.router is not None}

    def new_state(self, kv_cache: str = "f32") -> kv.SequenceState:
        """Per layer "layer.{i}": a KDA layer's conv window + recurrent state (fixed size), an MLA
        layer's compressed cache (the latent + the shared key part, per token; no KV cache, so
        `kv_cache` does not apply)."""
        cfg = self.cfg
        return kv.SequenceState({f"layer.{i}": KDAState(cfg.kda) if t == KDA else MLACache(cfg.mla)
                                 for i, t in enumerate(cfg.layer_types)})

    # ---- the layer graph ---------------------------------------------------------------------
    def forward(self, ids: np.ndarray, state: kv.SequenceState, last_only: bool = False) -> np.ndarray:
        h = self._decoder(embed(ids, self.embed_tokens), ids, state)  # (T, H): the final norm's input
        state.advance(len(ids))
        if last_only:
            h = h[-1:]
        return linear(rms_norm(h, self.norm, self.cfg.rms_norm_eps), self.lm_head)  # (T, V)

    def _decoder(self, h: np.ndarray, ids: np.ndarray, state: kv.SequenceState) -> np.ndarray:
        """Every layer on the residual stream h (T, H) → the final norm's input (T, H)."""
        eps = self.cfg.rms_norm_eps
        for i, L in enumerate(self.layers):
            h = h + L.mixer(rms_norm(h, L.input_norm, eps), state[f"layer.{i}"])
            h = h + self._ffn(i, L, rms_norm(h, L.post_norm, eps), h, ids)
            record(i, l_out=h)  # the residual stream after layer i (colibri_core.probe)
        return h

    def _ffn(self, i: int, L: Layer, x: np.ndarray, residual: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The MLP sub-layer of layer i on normalised x (T, H): a dense SwiGLU, or the routed experts +
        the shared ones."""
        if L.router is None:
            return swiglu_mlp(x, *L.mlp)
        return self.moe(i, x, residual, ids, shared=L.shared)


# ---- Kimi K3 -----------------------------------------------------------------------------------
@dataclass(kw_only=True)
class K3Layer(Layer):
    """Kimi-Linear's, plus the sub-layers' attention residuals and the latent MoE's tensors."""

    attn_res: tuple  # self_attention_res_norm (H,), self_attention_res_proj (1, H)
    mlp_res: tuple  # mlp_res_norm (H,), mlp_res_proj (1, H)
    latent: tuple | None = None  # MoE: routed_expert_down_proj (Z, H), routed_expert_norm (Z,), up_proj (H, Z)


class KimiK3(KimiLinear):
    """Kimi K3: Kimi-Linear's blocks with K3's gates and decay, SiTU-GLU MLPs, a latent MoE, and
    attention residuals instead of the residual stream. Its checkpoint as released: the text model
    under `language_model.`, the dense layer under `mlp.`."""

    Config = K3Config
    PREFIX, HEAD_PREFIX = "language_model.model.", "language_model."

    @classmethod
    def tensors(cls, cfg: K3Config) -> TensorTable:
        """Kimi-Linear's, with the experts on the latent (Z wide) and SiTU; the official release's
        experts are MXFP4 (`w{1,2,3}.weight_packed` U8 + `weight_scale` U8: E2M1 + UE8M0 per 32
        columns), run as they are."""
        table = super().tensors(cfg)
        return TensorTable(resident=table.resident, experts=cls._experts(cfg, Dim("Z", cfg.moe_latent_size),
                                                                           activation="situ", native="fp4"))

    @classmethod
    def _native(cls, name: str) -> tuple[str, ...]:
        return (name + ".weight_packed",)

    @classmethod
    def _mlp_alias(cls, L: str, name: str) -> tuple[str, ...]:
        return ()  # K3's MoE tensors have one name

    @classmethod
    def _head_tensors(cls, cfg: K3Config) -> dict[str, Tensor]:
        """The output's attention residual, then Kimi-Linear's final norm and lm_head."""
        H, p = cfg.hidden_size, cls.PREFIX
        return {"output_res_norm": Tensor(p + "output_attn_res_norm.weight", (H,)),
                "output_res_proj": Tensor(p + "output_attn_res_proj.weight", (1, H), f32=True), **super()._head_tensors(cfg)}

    @classmethod
    def _mixer_tensors(cls, cfg: K3Config, L: str, kda, mla) -> dict[str, Tensor]:
        """KDA with A_log per head (the release pads it) and a full-rank output gate, or MLA with a
        sigmoid output gate; then the attention residuals."""
        H, n, every = cfg.hidden_size, cfg.linear_num_heads * cfg.linear_head_dim, range(cfg.num_hidden_layers)
        g_proj = Tensor(L + "self_attn.g_proj.weight", lambda i: (n, H) if i in kda else
                        (cfg.num_attention_heads * cfg.v_head_dim, H), layers=every)
        res = {key: Tensor(L + name, shape, layers=every, f32=shape == (1, H)) for key, name, shape in (
            ("attn_res_norm", "self_attention_res_norm.weight", (H,)), ("attn_res_proj", "self_attention_res_proj.weight", (1, H)),
            ("mlp_res_norm", "mlp_res_norm.weight", (H,)), ("mlp_res_proj", "mlp_res_proj.weight", (1, H)))}
        return {**_kda_tensors(cfg, L, kda, A_log=(cfg.linear_num_heads,), gate={}), **_mla_tensors(cfg, L, mla, {}),
                "g_proj": g_proj, **res}

    @classmethod
    def _mlp_tensors(cls, cfg: K3Config, L: str, moe, dense) -> dict[str, Tensor]:
        """The latent MoE's down / norm / up beside the router, and the dense layer under `mlp.`."""
        H, Z, m = cfg.hidden_size, cfg.moe_latent_size, L + "block_sparse_moe."
        latent = {"latent_down": Tensor(m + "routed_expert_down_proj.weight", (Z, H), layers=moe),
                  "latent_norm": Tensor(m + "routed_expert_norm.weight", (Z,), layers=moe),
                  "latent_up": Tensor(m + "routed_expert_up_proj.weight", (H, Z), layers=moe)}
        return {**cls._moe_tensors(cfg, L, moe, latent), **_glu_tensors("mlp", L + "mlp.", cfg.intermediate_size, H, dense)}

    # ---- with the weights ------------------------------------------------------------------------
    def __init__(self, cfg: K3Config, weights, store):
        super().__init__(cfg, weights, store)
        top = self.tensors(cfg).take(weights)
        self.output_res = (top["output_res_norm"], top["output_res_proj"])  # (H,), (1, H) float32

    def _layer(self, weights, i: int) -> K3Layer:
        cfg = self.cfg
        w = self.tensors(cfg).take(weights, i)
        if cfg.layer_types[i] == KDA:
            mixer = _kda(cfg, w, g_proj=w["g_proj"], gate_lower_bound=cfg.kda_gate_lower_bound)
        else:
            mixer = _nope_mla(cfg, w, GatedNoPEMLA, g_proj=w["g_proj"])
        norms = w["input_norm"], w["post_norm"]
        res = dict(attn_res=(w["attn_res_norm"], w["attn_res_proj"]), mlp_res=(w["mlp_res_norm"], w["mlp_res_proj"]))
        if i not in cfg.moe_layers:
            return K3Layer(mixer, *norms, mlp=_glu(w, "mlp"), **res)
        return K3Layer(mixer, *norms, router=_router(cfg, w, norms[1]), shared=SharedExpert(*_glu(w, "shared"), glu="situ"),
                       latent=(w["latent_down"], w["latent_norm"], w["latent_up"]), **res)

    # ---- the layer graph ---------------------------------------------------------------------
    def _decoder(self, h: np.ndarray, ids: np.ndarray, state: kv.SequenceState) -> np.ndarray:
        """Attention residuals: each sub-layer reads attn_res_mix(blocks, prefix); its output adds to
        the prefix; every attn_res_block_size layers (layer 0: the embedding h) the prefix is stored
        as a block and restarts from the next attention output. Returns the final norm's input."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        blocks, prefix = [], h
        for i, L in enumerate(self.layers):
            if i % cfg.attn_res_block_size == 0:
                blocks.append(prefix)
                prefix = None
            x_in = attn_res_mix(blocks, prefix, *L.attn_res, eps)
            a = L.mixer(rms_norm(x_in, L.input_norm, eps), state[f"layer.{i}"])
            prefix = a if prefix is None else prefix + a
            x_in = attn_res_mix(blocks, prefix, *L.mlp_res, eps)
            prefix = prefix + self._ffn(i, L, rms_norm(x_in, L.post_norm, eps), x_in, ids)
            record(i, l_out=prefix)
        return attn_res_mix(blocks, prefix, *self.output_res, eps)

    def _ffn(self, i: int, L: K3Layer, x: np.ndarray, residual: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The MLP sub-layer of layer i on normalised x (T, H): a dense SiTU-GLU, or the latent MoE —
        experts on z = down x, their sum normalised and projected up — + the shared experts."""
        if L.router is None:
            return situ_mlp(x, *L.mlp)
        down, norm, up = L.latent
        u = self.moe(i, x, residual, ids, expert_input=linear(x, down))  # (T, Z)
        return linear(rms_norm(u, norm, LATENT_NORM_EPS), up) + L.shared(x)
