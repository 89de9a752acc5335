"""Kimi-Linear (`KimiLinearForCausalLM`) and Kimi K3 on top of it: the whole model, top to bottom.

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
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from colibri_core import kv
from colibri_core.errors import ColibriError
from colibri_core.layers.attn_res import attn_res_mix
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


@dataclass(frozen=True)
class KimiConfig:
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
    # Kimi K3 (all off for Kimi-Linear)
    k3: bool = False
    attn_res_block_size: int = 0  # layers per attention-residual block
    moe_latent_size: int = 0  # the latent MoE's width (experts' hidden)
    kda_gate_lower_bound: float | None = None  # −5: g = lb · σ(…)
    prefix: str = "model."  # of the decoder ("language_model.model." in K3's checkpoint)
    head_prefix: str = ""  # of lm_head ("language_model." in K3's checkpoint)

    @classmethod
    def from_hf(cls, config: dict, k3: bool = False) -> KimiConfig:
        c = config["text_config"] if isinstance(config.get("text_config"), dict) else config
        act = c.get("hidden_act", "situ" if k3 else "silu")
        if act != ("situ" if k3 else "silu"):
            raise ColibriError(f"{'Kimi K3' if k3 else 'Kimi-Linear'} with hidden_act {act!r} is not supported "
                               f"(only {'situ' if k3 else 'silu'})")
        for key, supported in (("mla_use_nope", True), ("moe_router_activation_func", "sigmoid"),
                               ("moe_layer_freq", 1), ("attention_bias", False), ("tie_word_embeddings", False)):
            if c.get(key, supported) != supported:
                raise ColibriError(f"Kimi with {key} {c[key]!r} is not supported (only {supported!r})")
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
        lower = lin.get("gate_lower_bound", c.get("linear_lower_bound", -5.0 if k3 else None))
        return cls(
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
            k3=k3,
            attn_res_block_size=c["attn_res_block_size"] if k3 else 0,
            moe_latent_size=c["moe_latent_size"] if k3 else 0,
            kda_gate_lower_bound=None if lower is None else float(lower),
            prefix="language_model.model." if k3 else "model.",
            head_prefix="language_model." if k3 else "",
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

    @property
    def moe_container(self) -> str:
        """Where the dense-layer MLP, the router and the shared experts live: Kimi-Linear as
        transformers saves it (`block_sparse_moe`, also on the dense layer), K3 as released."""
        return "mlp" if self.k3 else "block_sparse_moe"


def _layer_shapes(cfg: KimiConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Layer i's resident tensors (name after the layer prefix → shape)."""
    H = cfg.hidden_size
    s = {"input_layernorm.weight": (H,)}
    if cfg.layer_types[i] == KDA:
        n, dk, K, Hh = cfg.linear_num_heads * cfg.linear_head_dim, cfg.linear_head_dim, cfg.linear_conv_kernel_dim, cfg.linear_num_heads
        a = "self_attn."
        s.update({a + "q_proj.weight": (n, H), a + "k_proj.weight": (n, H), a + "v_proj.weight": (n, H),
                  a + "q_conv1d.weight": (n, 1, K), a + "k_conv1d.weight": (n, 1, K), a + "v_conv1d.weight": (n, 1, K),
                  a + "f_a_proj.weight": (dk, H), a + "f_b_proj.weight": (n, dk),
                  a + "A_log": (Hh,) if cfg.k3 else (1, 1, Hh, 1), a + "dt_bias": (n,), a + "b_proj.weight": (Hh, H)})
        if cfg.k3:
            s[a + "g_proj.weight"] = (n, H)
        else:
            s.update({a + "g_a_proj.weight": (dk, H), a + "g_b_proj.weight": (n, dk)})
        s.update({a + "o_norm.weight": (dk,), a + "o_proj.weight": (H, n)})
    else:
        d = cfg.mla
        a, qk = "self_attn.", d.qk_nope_head_dim + d.qk_rope_head_dim
        if d.q_lora_rank:
            s.update({a + "q_a_proj.weight": (d.q_lora_rank, H), a + "q_a_layernorm.weight": (d.q_lora_rank,),
                      a + "q_b_proj.weight": (d.heads * qk, d.q_lora_rank)})
        else:
            s[a + "q_proj.weight"] = (d.heads * qk, H)
        s.update({a + "kv_a_proj_with_mqa.weight": (d.kv_lora_rank + d.qk_rope_head_dim, H),
                  a + "kv_a_layernorm.weight": (d.kv_lora_rank,),
                  a + "kv_b_proj.weight": (d.heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank)})
        if cfg.k3:
            s[a + "g_proj.weight"] = (d.heads * d.v_head_dim, H)
        s[a + "o_proj.weight"] = (H, d.heads * d.v_head_dim)
    if cfg.k3:
        s.update({"self_attention_res_norm.weight": (H,), "self_attention_res_proj.weight": (1, H),
                  "mlp_res_norm.weight": (H,), "mlp_res_proj.weight": (1, H)})
    s["post_attention_layernorm.weight"] = (H,)
    if i in cfg.moe_layers:
        m, S = "block_sparse_moe.", cfg.n_shared_experts * cfg.moe_intermediate_size
        s.update({m + "gate.weight": (cfg.num_experts, H), m + "gate.e_score_correction_bias": (cfg.num_experts,)})
        if cfg.k3:
            Z = cfg.moe_latent_size
            s.update({m + "routed_expert_down_proj.weight": (Z, H), m + "routed_expert_norm.weight": (Z,),
                      m + "routed_expert_up_proj.weight": (H, Z)})
        s.update({m + "shared_experts.gate_proj.weight": (S, H), m + "shared_experts.up_proj.weight": (S, H),
                  m + "shared_experts.down_proj.weight": (H, S)})
    else:
        m, F = cfg.moe_container + ".", cfg.intermediate_size
        s.update({m + "gate_proj.weight": (F, H), m + "up_proj.weight": (F, H), m + "down_proj.weight": (H, F)})
    return s


def resident_shapes(cfg: KimiConfig) -> dict[str, tuple[int, ...]]:
    """Every resident (non-routed-expert) tensor of the checkpoint with its shape, in load order."""
    H, p = cfg.hidden_size, cfg.prefix
    shapes = {f"{p}embed_tokens.weight": (cfg.vocab_size, H)}
    for i in range(cfg.num_hidden_layers):
        shapes.update({f"{p}layers.{i}.{name}": shape for name, shape in _layer_shapes(cfg, i).items()})
    if cfg.k3:
        shapes.update({f"{p}output_attn_res_norm.weight": (H,), f"{p}output_attn_res_proj.weight": (1, H)})
    shapes[f"{p}norm.weight"] = (H,)
    shapes[f"{cfg.head_prefix}lm_head.weight"] = (cfg.vocab_size, H)
    return shapes


def aliases(cfg: KimiConfig) -> tuple[tuple[str, str, int | None, int | None], ...]:
    """Other names of the resident tensors: the released checkpoints' `mlp.*` dense layer and
    transformers' fused save (`mlp.*`, the q/k/v convs stacked in one `conv1d`, the decay's tensors
    under `forget_gate.`)."""
    out = []
    n = cfg.linear_num_heads * cfg.linear_head_dim
    for i in range(cfg.num_hidden_layers):
        layer = f"{cfg.prefix}layers.{i}."
        for name in _layer_shapes(cfg, i):
            full = layer + name
            if name.startswith("block_sparse_moe.") and not cfg.k3:
                out.append((full, layer + "mlp." + name[len("block_sparse_moe."):], None, None))
            elif name in ("self_attn.f_a_proj.weight", "self_attn.f_b_proj.weight", "self_attn.A_log", "self_attn.dt_bias"):
                out.append((full, layer + "self_attn.forget_gate." + name[len("self_attn."):], None, None))
            elif name.endswith("_conv1d.weight"):
                j = "qkv".index(name[len("self_attn.")])
                out.append((full, layer + "self_attn.conv1d.weight", j * n, (j + 1) * n))
    return tuple(out)


@dataclass
class Layer:
    kind: str  # KDA | MLA_KIND
    mixer: KimiDeltaAttention | MLA
    input_norm: np.ndarray  # (H,)
    post_norm: np.ndarray  # (H,)
    q_proj: object = None  # MLA without q_lora: (heads (nope + r), H)
    g_proj: object = None  # K3 MLA's output gate (heads v, H)
    router: SigmoidGroupTopK | None = None  # (E, H) float32 + bias (E,); None on a dense layer
    mlp: tuple | None = None  # dense: gate (F, H), up (F, H), down (H, F)
    shared: SharedExpert | None = None  # MoE: the shared experts, (S, H), (S, H), (H, S)
    latent: tuple | None = None  # K3: routed_expert_down_proj (Z, H), routed_expert_norm (Z,), up_proj (H, Z)
    attn_res: tuple | None = None  # K3: self_attention_res_norm (H,), self_attention_res_proj (1, H)
    mlp_res: tuple | None = None  # K3: mlp_res_norm (H,), mlp_res_proj (1, H)


class KimiLinear(MoEModel):
    K3 = False

    @classmethod
    def parse_config(cls, config: dict) -> KimiConfig:
        name = "Kimi K3" if cls.K3 else "Kimi-Linear (kimi_linear)"
        try:
            return KimiConfig.from_hf(config, k3=cls.K3)
        except KeyError as e:
            raise ColibriError(f"config.json lacks {e.args[0]!r}, which a {name} model needs") from None
        except (TypeError, ValueError, ZeroDivisionError, IndexError) as e:
            raise ColibriError(f"config.json is not a valid {name} config: {e}") from None

    @classmethod
    def layout(cls, cfg: KimiConfig) -> ContainerLayout:
        experts = cfg.prefix + "layers.{layer}.block_sparse_moe.experts"
        return ContainerLayout(
            resident=tuple(resident_shapes(cfg)),
            # routers stay float32; so do the small β and decay projections (the decay is exponentiated:
            # an error in it compounds over the whole context) and the attention residuals' projections
            keep_f32=(r"\.gate\.weight$", r"\.self_attn\.(b_proj|f_a_proj|f_b_proj)\.weight$", r"_res_proj\.weight$"),
            moe_layers=cfg.moe_layers, n_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
            hidden=cfg.moe_latent_size if cfg.k3 else cfg.hidden_size, intermediate=cfg.moe_intermediate_size,
            experts=ExpertNames(
                per_expert={"gate": experts + ".{expert}.w1.weight", "up": experts + ".{expert}.w3.weight",
                            "down": experts + ".{expert}.w2.weight"},
                fused_gate_up=cfg.prefix + "layers.{layer}.mlp.experts.gate_up_proj",  # transformers' fused save
                fused_down=cfg.prefix + "layers.{layer}.mlp.experts.down_proj",
                # K3's official release: MXFP4 experts (w{1,2,3}.weight_packed U8 + weight_scale U8), run as they are
                other_names=({"gate": experts + ".{expert}.w1.weight_packed", "up": experts + ".{expert}.w3.weight_packed",
                              "down": experts + ".{expert}.w2.weight_packed"},) if cfg.k3 else (),
            ),
            aliases=aliases(cfg),
            expert_activation="situ" if cfg.k3 else "swiglu",
            native_expert_kind="fp4" if cfg.k3 else None,  # K3's release: MXFP4 = E2M1 + UE8M0 per 32 columns
        )

    @classmethod
    def resident_shapes(cls, cfg: KimiConfig) -> dict[str, tuple[int, ...]]:
        """Every resident tensor's shape, by checkpoint name (for `colibri plan`)."""
        return resident_shapes(cfg)

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
        p = cfg.prefix
        self.embed_tokens = weights(f"{p}embed_tokens.weight")  # (V, H)
        self.layers = [self._layer(weights, i) for i in range(cfg.num_hidden_layers)]
        self.output_res = None
        if cfg.k3:
            self.output_res = (weights(f"{p}output_attn_res_norm.weight"), weights(f"{p}output_attn_res_proj.weight"))
        self.norm = weights(f"{p}norm.weight")  # (H,)
        self.lm_head = weights(f"{cfg.head_prefix}lm_head.weight")  # (V, H)
        r = cfg.qk_rope_head_dim  # NoPE: the shared key part goes through MLA's rope path unrotated
        self._no_rotation = (np.ones((1, r), np.float32), np.zeros((1, r), np.float32))

    def _layer(self, weights, i: int) -> Layer:
        cfg = self.cfg
        w = lambda name: weights(f"{cfg.prefix}layers.{i}.{name}")  # noqa: E731
        kind = cfg.layer_types[i]
        extra = {}
        if kind == KDA:
            n = cfg.linear_num_heads * cfg.linear_head_dim
            gate = {"g_proj": w("self_attn.g_proj.weight")} if cfg.k3 else \
                {"g_a": w("self_attn.g_a_proj.weight"), "g_b": w("self_attn.g_b_proj.weight")}
            conv = np.concatenate([w(f"self_attn.{c}_conv1d.weight")[:, 0, :] for c in "qkv"])  # (3n, K)
            mixer = KimiDeltaAttention(
                dims=cfg.kda, q_proj=w("self_attn.q_proj.weight"), k_proj=w("self_attn.k_proj.weight"),
                v_proj=w("self_attn.v_proj.weight"), conv_weight=np.ascontiguousarray(conv, np.float32),
                f_a=w("self_attn.f_a_proj.weight"), f_b=w("self_attn.f_b_proj.weight"),  # (dk, H), (n, dk) float32
                A_log=np.ascontiguousarray(w("self_attn.A_log").reshape(-1)[: cfg.linear_num_heads]),  # K3 pads it
                dt_bias=w("self_attn.dt_bias").reshape(n), b_proj=w("self_attn.b_proj.weight"),
                o_norm=w("self_attn.o_norm.weight"), o_proj=w("self_attn.o_proj.weight"), eps=cfg.rms_norm_eps,
                gate_lower_bound=cfg.kda_gate_lower_bound, **gate)
        else:
            q_lora = cfg.q_lora_rank > 0
            mixer = MLA(cfg.mla,
                        w("self_attn.q_a_proj.weight") if q_lora else None,  # (q_lora, H)
                        w("self_attn.q_a_layernorm.weight") if q_lora else None,  # (q_lora,)
                        w("self_attn.q_b_proj.weight") if q_lora else None,  # (heads (nope + r), q_lora)
                        w("self_attn.kv_a_proj_with_mqa.weight"),  # (c + r, H)
                        w("self_attn.kv_a_layernorm.weight"),  # (c,)
                        w("self_attn.kv_b_proj.weight"),  # (heads (nope + v), c)
                        w("self_attn.o_proj.weight"))  # (H, heads v)
            extra["q_proj"] = None if q_lora else w("self_attn.q_proj.weight")
            extra["g_proj"] = w("self_attn.g_proj.weight") if cfg.k3 else None
        if cfg.k3:
            extra["attn_res"] = (w("self_attention_res_norm.weight"), w("self_attention_res_proj.weight"))
            extra["mlp_res"] = (w("mlp_res_norm.weight"), w("mlp_res_proj.weight"))
        post_norm = w("post_attention_layernorm.weight")
        if i in cfg.moe_layers:
            m = "block_sparse_moe."
            extra["router"] = SigmoidGroupTopK(
                w(m + "gate.weight"), w(m + "gate.e_score_correction_bias"),  # (E, H) float32, (E,)
                cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor,
                input=partial(rms_norm, weight=post_norm, eps=cfg.rms_norm_eps))
            if cfg.k3:
                extra["latent"] = (w(m + "routed_expert_down_proj.weight"), w(m + "routed_expert_norm.weight"),
                                   w(m + "routed_expert_up_proj.weight"))
            extra["shared"] = SharedExpert(*(w(f"{m}shared_experts.{p}_proj.weight") for p in ("gate", "up", "down")),
                                           glu="situ" if cfg.k3 else "swiglu")
        else:
            extra["mlp"] = tuple(w(f"{cfg.moe_container}.{p}_proj.weight") for p in ("gate", "up", "down"))
        return Layer(kind=kind, mixer=mixer, input_norm=w("input_layernorm.weight"), post_norm=post_norm, **extra)

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
    def _mix(self, x: np.ndarray, T: int, cos, sin, L: Layer, cache) -> np.ndarray:
        """The token mixer of layer L on normalised x (T, H) → (T, H)."""
        if L.kind == KDA:
            return L.mixer(x, cache)
        mla, d = L.mixer, self.cfg.mla
        if L.q_proj is None:
            _, q_nope, q_rope = mla.query(x, cos, sin)
        else:
            q = linear(x, L.q_proj).reshape(T, d.heads, d.qk_nope_head_dim + d.qk_rope_head_dim)
            q_nope, q_rope = q[..., : d.qk_nope_head_dim], _unrotated(q[..., d.qk_nope_head_dim:], cos, sin)
        mla.compress(x, cos, sin, cache)
        gate = None if L.g_proj is None else _sigmoid(linear(x, L.g_proj))  # K3: (T, heads v)
        return mla.attend(q_nope, q_rope, cache, gate=gate)

    def _ffn(self, i: int, L: Layer, x: np.ndarray, residual: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The MLP sub-layer of layer i on normalised x (T, H): dense, or routed experts + shared."""
        act = situ_mlp if self.cfg.k3 else swiglu_mlp
        if L.router is None:
            return act(x, *L.mlp)
        if L.latent is None:
            return self.moe(i, x, residual, ids, shared=L.shared)
        down, norm, up = L.latent  # K3: experts run on the latent z, their sum normalised and projected up
        u = self.moe(i, x, residual, ids, expert_input=linear(x, down))  # (T, Z)
        return linear(rms_norm(u, norm, LATENT_NORM_EPS), up) + L.shared(x)

    def forward(self, ids: np.ndarray, state: kv.SequenceState, last_only: bool = False) -> np.ndarray:
        cfg = self.cfg
        T = len(ids)
        cos, sin = (np.repeat(a, T, axis=0) for a in self._no_rotation)  # (T, r): NoPE
        h = embed(ids, self.embed_tokens)  # (T, H)
        if cfg.k3:
            h = self._forward_k3(h, ids, state, cos, sin)
        else:
            for i, L in enumerate(self.layers):
                h = h + self._mix(rms_norm(h, L.input_norm, cfg.rms_norm_eps), T, cos, sin, L, state[f"layer.{i}"])
                h = h + self._ffn(i, L, rms_norm(h, L.post_norm, cfg.rms_norm_eps), h, ids)
                record(i, l_out=h)  # the residual stream after layer i (colibri_core.probe)
        state.advance(T)
        if last_only:
            h = h[-1:]
        return linear(rms_norm(h, self.norm, cfg.rms_norm_eps), self.lm_head)  # (T, V)

    def _forward_k3(self, h: np.ndarray, ids: np.ndarray, state: kv.SequenceState, cos, sin) -> np.ndarray:
        """K3's attention residuals: each sub-layer reads attn_res_mix(blocks, prefix); its output
        adds to the prefix; every attn_res_block_size layers (layer 0: the embedding) the prefix is
        stored as a block and restarts from the next attention output. Returns the final norm's input."""
        cfg, eps, T = self.cfg, self.cfg.rms_norm_eps, len(ids)
        blocks, prefix = [], h
        for i, L in enumerate(self.layers):
            if i % cfg.attn_res_block_size == 0:
                blocks.append(prefix)
                prefix = None
            x_in = attn_res_mix(blocks, prefix, *L.attn_res, eps)
            a = self._mix(rms_norm(x_in, L.input_norm, eps), T, cos, sin, L, state[f"layer.{i}"])
            prefix = a if prefix is None else prefix + a
            x_in = attn_res_mix(blocks, prefix, *L.mlp_res, eps)
            prefix = prefix + self._ffn(i, L, rms_norm(x_in, L.post_norm, eps), x_in, ids)
            record(i, l_out=prefix)
        return attn_res_mix(blocks, prefix, *self.output_res, eps)


class KimiK3(KimiLinear):
    K3 = True


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.float32(1) / (np.float32(1) + np.exp(-x.astype(np.float32)))


def _unrotated(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x (T, heads, r) in the layout MLA's rope path gives its keys (de-interleaved pairs; cos 1,
    sin 0 rotate nothing), so queries and keys meet in the same order."""
    return np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
