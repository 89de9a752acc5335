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
(`mlp.*`, one stacked `conv1d`, the decay under `forget_gate.`, fused experts): the layout names the
first two as the tensors and the others as aliases.

Top to bottom: the two configs; the blocks both models build (each as its tensors' shapes and as the
block from the weights, the variant's parts passed in); `KimiLinear`; `KimiK3(KimiLinear)`, which
replaces the layer (its tensors and blocks), the MLP sub-layer and the layer graph.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
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
from colibri_core.layout import ContainerLayout, ExpertNames
from colibri_core.model import MoEModel, embed, linear
from colibri_core.probe import record

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
# Shapes by name within a layer; builders take `w`, the layer's tensors by that name. What differs
# between the models (an output gate, A_log's shape, the latent MoE's tensors) is passed in.
def _kda_shapes(cfg: KimiConfig, A_log: tuple[int, ...], gate: dict) -> dict[str, tuple[int, ...]]:
    """A KDA layer's tensors; `gate`: its output gate's, by name within `self_attn.`."""
    H, Hh, dk, K = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    n, a = Hh * dk, "self_attn."
    return {a + "q_proj.weight": (n, H), a + "k_proj.weight": (n, H), a + "v_proj.weight": (n, H),
            a + "q_conv1d.weight": (n, 1, K), a + "k_conv1d.weight": (n, 1, K), a + "v_conv1d.weight": (n, 1, K),
            a + "f_a_proj.weight": (dk, H), a + "f_b_proj.weight": (n, dk), a + "A_log": A_log,
            a + "dt_bias": (n,), a + "b_proj.weight": (Hh, H), **{a + k: s for k, s in gate.items()},
            a + "o_norm.weight": (dk,), a + "o_proj.weight": (H, n)}


def _kda(cfg: KimiConfig, w, **variant) -> KimiDeltaAttention:
    """A KDA layer; `variant`: its output gate's matrices and the decay's lower bound, if any."""
    n = cfg.linear_num_heads * cfg.linear_head_dim
    conv = np.concatenate([w(f"self_attn.{c}_conv1d.weight")[:, 0, :] for c in "qkv"])  # (3n, K)
    return KimiDeltaAttention(
        dims=cfg.kda, q_proj=w("self_attn.q_proj.weight"), k_proj=w("self_attn.k_proj.weight"),
        v_proj=w("self_attn.v_proj.weight"), conv_weight=np.ascontiguousarray(conv, np.float32),
        f_a=w("self_attn.f_a_proj.weight"), f_b=w("self_attn.f_b_proj.weight"),  # (dk, H), (n, dk) float32
        A_log=np.ascontiguousarray(w("self_attn.A_log").reshape(-1)[: cfg.linear_num_heads]),  # K3 pads it
        dt_bias=w("self_attn.dt_bias").reshape(n), b_proj=w("self_attn.b_proj.weight"),
        o_norm=w("self_attn.o_norm.weight"), o_proj=w("self_attn.o_proj.weight"), eps=cfg.rms_norm_eps, **variant)


def _kda_aliases(layer: str, name: str, n: int) -> list[tuple[str, str, int | None, int | None]]:
    """transformers' fused names of KDA tensor `name` (in layer prefix `layer`): the decay's under
    `forget_gate.`, the q/k/v convs as rows of one stacked `conv1d` (n rows each)."""
    if name in ("self_attn.f_a_proj.weight", "self_attn.f_b_proj.weight", "self_attn.A_log", "self_attn.dt_bias"):
        return [(layer + name, layer + "self_attn.forget_gate." + name[len("self_attn."):], None, None)]
    if name.endswith("_conv1d.weight"):
        j = "qkv".index(name[len("self_attn.")])
        return [(layer + name, layer + "self_attn.conv1d.weight", j * n, (j + 1) * n)]
    return []


def _mla_shapes(cfg: KimiConfig, gate: dict) -> dict[str, tuple[int, ...]]:
    """An MLA layer's tensors; `gate`: its output gate's, by name within `self_attn.`."""
    d, H, a = cfg.mla, cfg.hidden_size, "self_attn."
    qk = d.qk_nope_head_dim + d.qk_rope_head_dim
    if d.q_lora_rank:
        s = {a + "q_a_proj.weight": (d.q_lora_rank, H), a + "q_a_layernorm.weight": (d.q_lora_rank,),
             a + "q_b_proj.weight": (d.heads * qk, d.q_lora_rank)}
    else:
        s = {a + "q_proj.weight": (d.heads * qk, H)}
    return {**s, a + "kv_a_proj_with_mqa.weight": (d.kv_lora_rank + d.qk_rope_head_dim, H),
            a + "kv_a_layernorm.weight": (d.kv_lora_rank,),
            a + "kv_b_proj.weight": (d.heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank),
            **{a + k: shape for k, shape in gate.items()}, a + "o_proj.weight": (H, d.heads * d.v_head_dim)}


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
    q_lora = cfg.q_lora_rank > 0
    mla = MLA(cfg.mla,
              w("self_attn.q_a_proj.weight") if q_lora else None,  # (q_lora, H)
              w("self_attn.q_a_layernorm.weight") if q_lora else None,  # (q_lora,)
              w("self_attn.q_b_proj.weight") if q_lora else None,  # (heads (nope + r), q_lora)
              w("self_attn.kv_a_proj_with_mqa.weight"),  # (c + r, H)
              w("self_attn.kv_a_layernorm.weight"),  # (c,)
              w("self_attn.kv_b_proj.weight"),  # (heads (nope + v), c)
              w("self_attn.o_proj.weight"))  # (H, heads v)
    return block(mla, None if q_lora else w("self_attn.q_proj.weight"), **gate)


def _unrotated(x: np.ndarray) -> np.ndarray:
    """x (T, heads, r) in the layout MLA's rope path gives its keys (de-interleaved pairs; cos 1,
    sin 0 rotate nothing), so queries and keys meet in the same order."""
    return np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def _glu_shapes(prefix: str, width: int, H: int) -> dict[str, tuple[int, ...]]:
    """A GLU MLP's gate (width, H), up (width, H) and down (H, width) under `prefix`."""
    return {prefix + "gate_proj.weight": (width, H), prefix + "up_proj.weight": (width, H),
            prefix + "down_proj.weight": (H, width)}


def _glu(w, prefix: str) -> tuple:
    """A GLU MLP's (gate, up, down) under `prefix`."""
    return tuple(w(f"{prefix}{p}_proj.weight") for p in ("gate", "up", "down"))


def _moe_shapes(cfg: KimiConfig, latent: dict) -> dict[str, tuple[int, ...]]:
    """An MoE layer's resident tensors (router, shared experts); `latent`: the latent MoE's, by name
    within `block_sparse_moe.`."""
    m, H = "block_sparse_moe.", cfg.hidden_size
    return {m + "gate.weight": (cfg.num_experts, H), m + "gate.e_score_correction_bias": (cfg.num_experts,),
            **{m + k: s for k, s in latent.items()},
            **_glu_shapes(m + "shared_experts.", cfg.n_shared_experts * cfg.moe_intermediate_size, H)}


def _router(cfg: KimiConfig, w, post_norm: np.ndarray) -> SigmoidGroupTopK:
    """An MoE layer's router, on the post-attention RMSNorm of the sub-layer's input."""
    m = "block_sparse_moe."
    return SigmoidGroupTopK(w(m + "gate.weight"), w(m + "gate.e_score_correction_bias"),  # (E, H) float32, (E,)
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
    def layout(cls, cfg: KimiConfig) -> ContainerLayout:
        experts = cls.PREFIX + "layers.{layer}.block_sparse_moe.experts"
        return ContainerLayout(
            resident=tuple(cls.resident_shapes(cfg)),
            # routers stay float32; so do the small β and decay projections (the decay is exponentiated:
            # an error in it compounds over the whole context) and the attention residuals' projections
            keep_f32=(r"\.gate\.weight$", r"\.self_attn\.(b_proj|f_a_proj|f_b_proj)\.weight$", r"_res_proj\.weight$"),
            moe_layers=cfg.moe_layers, n_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
            hidden=cfg.hidden_size, intermediate=cfg.moe_intermediate_size,
            experts=ExpertNames(
                per_expert={"gate": experts + ".{expert}.w1.weight", "up": experts + ".{expert}.w3.weight",
                            "down": experts + ".{expert}.w2.weight"},
                fused_gate_up=cls.PREFIX + "layers.{layer}.mlp.experts.gate_up_proj",  # transformers' fused save
                fused_down=cls.PREFIX + "layers.{layer}.mlp.experts.down_proj",
            ),
            aliases=cls.aliases(cfg),
            expert_activation="swiglu",
        )

    @classmethod
    def resident_shapes(cls, cfg: KimiConfig) -> dict[str, tuple[int, ...]]:
        """Every resident (non-routed-expert) tensor of the checkpoint with its shape, in load order."""
        H, p = cfg.hidden_size, cls.PREFIX
        shapes = {f"{p}embed_tokens.weight": (cfg.vocab_size, H)}
        for i in range(cfg.num_hidden_layers):
            shapes.update({f"{p}layers.{i}.{name}": shape for name, shape in cls._layer_shapes(cfg, i).items()})
        return {**shapes, **cls._head_shapes(cfg)}

    @classmethod
    def _head_shapes(cls, cfg: KimiConfig) -> dict[str, tuple[int, ...]]:
        """The tensors after the layers: the final norm, lm_head."""
        return {f"{cls.PREFIX}norm.weight": (cfg.hidden_size,),
                f"{cls.HEAD_PREFIX}lm_head.weight": (cfg.vocab_size, cfg.hidden_size)}

    @classmethod
    def _layer_shapes(cls, cfg: KimiConfig, i: int) -> dict[str, tuple[int, ...]]:
        """Layer i's resident tensors (name after the layer prefix → shape)."""
        H, n, dk = cfg.hidden_size, cfg.linear_num_heads * cfg.linear_head_dim, cfg.linear_head_dim
        if cfg.layer_types[i] == KDA:  # the low-rank output gate
            mixer = _kda_shapes(cfg, A_log=(1, 1, cfg.linear_num_heads, 1),
                                gate={"g_a_proj.weight": (dk, H), "g_b_proj.weight": (n, dk)})
        else:
            mixer = _mla_shapes(cfg, gate={})
        # the dense layer's MLP as transformers saves it (the released `mlp.*`: an alias)
        ffn = _moe_shapes(cfg, latent={}) if i in cfg.moe_layers else \
            _glu_shapes("block_sparse_moe.", cfg.intermediate_size, H)
        return {"input_layernorm.weight": (H,), **mixer, "post_attention_layernorm.weight": (H,), **ffn}

    @classmethod
    def aliases(cls, cfg: KimiConfig) -> tuple[tuple[str, str, int | None, int | None], ...]:
        """Other names of the resident tensors, from `_other_names`."""
        return tuple(alias for i in range(cfg.num_hidden_layers) for name in cls._layer_shapes(cfg, i)
                     for alias in cls._other_names(cfg, f"{cls.PREFIX}layers.{i}.", name))

    @classmethod
    def _other_names(cls, cfg: KimiConfig, layer: str, name: str) -> list:
        """The released checkpoints' `mlp.*` dense layer and transformers' fused save (`mlp.*`, the
        q/k/v convs stacked in one `conv1d`, the decay's tensors under `forget_gate.`)."""
        if name.startswith("block_sparse_moe."):
            return [(layer + name, layer + "mlp." + name[len("block_sparse_moe."):], None, None)]
        return _kda_aliases(layer, name, cfg.linear_num_heads * cfg.linear_head_dim)

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
        p = self.PREFIX
        self.embed_tokens = weights(f"{p}embed_tokens.weight")  # (V, H)
        self.layers = [self._layer(weights, i) for i in range(cfg.num_hidden_layers)]
        self.norm = weights(f"{p}norm.weight")  # (H,)
        self.lm_head = weights(f"{self.HEAD_PREFIX}lm_head.weight")  # (V, H)

    def _layer(self, weights, i: int) -> Layer:
        cfg = self.cfg
        w = lambda name: weights(f"{self.PREFIX}layers.{i}.{name}")  # noqa: E731
        if cfg.layer_types[i] == KDA:
            mixer = _kda(cfg, w, g_a=w("self_attn.g_a_proj.weight"), g_b=w("self_attn.g_b_proj.weight"))
        else:
            mixer = _nope_mla(cfg, w)
        norms = w("input_layernorm.weight"), w("post_attention_layernorm.weight")
        if i not in cfg.moe_layers:
            return Layer(mixer, *norms, mlp=_glu(w, "block_sparse_moe."))
        return Layer(mixer, *norms, router=_router(cfg, w, norms[1]),
                     shared=SharedExpert(*_glu(w, "block_sparse_moe.shared_experts."), glu="swiglu"))

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
    def layout(cls, cfg: K3Config) -> ContainerLayout:
        """Kimi-Linear's, with the experts on the latent (Z wide) and SiTU; the official release's
        experts are MXFP4 (`w{1,2,3}.weight_packed` U8 + `weight_scale` U8: E2M1 + UE8M0 per 32
        columns), run as they are."""
        layout = super().layout(cfg)
        experts = cls.PREFIX + "layers.{layer}.block_sparse_moe.experts.{expert}"
        mxfp4 = {"gate": experts + ".w1.weight_packed", "up": experts + ".w3.weight_packed",
                 "down": experts + ".w2.weight_packed"}
        return replace(layout, hidden=cfg.moe_latent_size, expert_activation="situ", native_expert_kind="fp4",
                       experts=replace(layout.experts, other_names=(mxfp4,)))

    @classmethod
    def _head_shapes(cls, cfg: K3Config) -> dict[str, tuple[int, ...]]:
        """The output's attention residual, then Kimi-Linear's final norm and lm_head."""
        H, p = cfg.hidden_size, cls.PREFIX
        return {f"{p}output_attn_res_norm.weight": (H,), f"{p}output_attn_res_proj.weight": (1, H),
                **super()._head_shapes(cfg)}

    @classmethod
    def _layer_shapes(cls, cfg: K3Config, i: int) -> dict[str, tuple[int, ...]]:
        H, n = cfg.hidden_size, cfg.linear_num_heads * cfg.linear_head_dim
        if cfg.layer_types[i] == KDA:  # A_log per head (the release pads it), a full-rank output gate
            mixer = _kda_shapes(cfg, A_log=(cfg.linear_num_heads,), gate={"g_proj.weight": (n, H)})
        else:  # the sigmoid output gate
            mixer = _mla_shapes(cfg, gate={"g_proj.weight": (cfg.num_attention_heads * cfg.v_head_dim, H)})
        res = {"self_attention_res_norm.weight": (H,), "self_attention_res_proj.weight": (1, H),
               "mlp_res_norm.weight": (H,), "mlp_res_proj.weight": (1, H)}
        Z = cfg.moe_latent_size
        ffn = _moe_shapes(cfg, latent={"routed_expert_down_proj.weight": (Z, H), "routed_expert_norm.weight": (Z,),
                                       "routed_expert_up_proj.weight": (H, Z)}) if i in cfg.moe_layers else \
            _glu_shapes("mlp.", cfg.intermediate_size, H)
        return {"input_layernorm.weight": (H,), **mixer, **res, "post_attention_layernorm.weight": (H,), **ffn}

    @classmethod
    def _other_names(cls, cfg: K3Config, layer: str, name: str) -> list:
        """transformers' fused KDA names (the q/k/v convs stacked in one `conv1d`, the decay's tensors
        under `forget_gate.`), as its other KDA models save them."""
        return _kda_aliases(layer, name, cfg.linear_num_heads * cfg.linear_head_dim)

    # ---- with the weights ------------------------------------------------------------------------
    def __init__(self, cfg: K3Config, weights, store):
        super().__init__(cfg, weights, store)
        p = self.PREFIX
        self.output_res = (weights(f"{p}output_attn_res_norm.weight"), weights(f"{p}output_attn_res_proj.weight"))

    def _layer(self, weights, i: int) -> K3Layer:
        cfg = self.cfg
        w = lambda name: weights(f"{self.PREFIX}layers.{i}.{name}")  # noqa: E731
        if cfg.layer_types[i] == KDA:
            mixer = _kda(cfg, w, g_proj=w("self_attn.g_proj.weight"), gate_lower_bound=cfg.kda_gate_lower_bound)
        else:
            mixer = _nope_mla(cfg, w, GatedNoPEMLA, g_proj=w("self_attn.g_proj.weight"))
        norms = w("input_layernorm.weight"), w("post_attention_layernorm.weight")
        res = dict(attn_res=(w("self_attention_res_norm.weight"), w("self_attention_res_proj.weight")),
                   mlp_res=(w("mlp_res_norm.weight"), w("mlp_res_proj.weight")))
        if i not in cfg.moe_layers:
            return K3Layer(mixer, *norms, mlp=_glu(w, "mlp."), **res)
        m = "block_sparse_moe."
        return K3Layer(mixer, *norms, router=_router(cfg, w, norms[1]),
                       shared=SharedExpert(*_glu(w, m + "shared_experts."), glu="situ"),
                       latent=(w(m + "routed_expert_down_proj.weight"), w(m + "routed_expert_norm.weight"),
                               w(m + "routed_expert_up_proj.weight")), **res)

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
