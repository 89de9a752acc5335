"""Kimi K3 in float64 NumPy, written from the published description (the project's architecture notes, "Kimi K3")
and nothing of colibri's: the check of the parts no `transformers` class implements (attention
residuals, the latent MoE) and of the whole model. Plus a tiny random K3 checkpoint in the official
layout (`language_model.` prefix, `text_config`), with float or MXFP4 experts.

Whole sequences at once (no cache): position t's logits depend on tokens 0..t only, so the engine's
prefill-then-decode must reproduce every row.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

TINY_K3 = dict(  # every part: 4 KDA + 2 MLA layers, blocks of 2, a dense layer 0, a latent MoE
    vocab_size=256, hidden_size=64, num_hidden_layers=6, intermediate_size=96, moe_intermediate_size=32,
    num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
    num_experts=8, num_experts_per_token=3, num_shared_experts=2, num_expert_group=1, topk_group=1,
    moe_renormalize=True, routed_scaling_factor=1.0, first_k_dense_replace=1, moe_latent_size=32,
    attn_res_block_size=2, rms_norm_eps=1e-5, hidden_act="situ", tie_word_embeddings=False,
    linear_attn_config={"full_attn_layers": [4, 6], "kda_layers": [1, 2, 3, 5], "head_dim": 16, "num_heads": 2,
                        "short_conv_kernel_size": 4, "gate_lower_bound": -5.0},
)
# the residual projections' std: scores of std ~2.4 over the 64 normalised channels mix the blocks far from
# uniformly, yet not so sharply that float32 rounding flips a softmax (std 1 gives scores of std 8: float32 rounding then decides tokens)
RES_PROJ_STD = 0.3
A_LOG_PAD = 2  # the official checkpoint pads A_log beyond the heads (128 for 96): so does the tiny one
MXFP4_GROUP = 32
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def k3_config(**text) -> dict:
    """config.json of a K3 checkpoint: the text config nested under text_config."""
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
            "text_config": {**TINY_K3, **text, "model_type": "kimi_k3_text"}}


def layer_kinds(c: dict) -> list[str]:
    kinds = [None] * c["num_hidden_layers"]
    for i in c["linear_attn_config"]["full_attn_layers"]:
        kinds[i - 1] = "mla"
    for i in c["linear_attn_config"]["kda_layers"]:
        kinds[i - 1] = "kda"
    return kinds


def random_weights(c: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """A random K3 (float32 arrays by official checkpoint name); norms and the correction bias are
    perturbed from their constants, the residual projections (RES_PROJ_STD) make the mixing far from
    uniform, the experts' gates are large enough for SiTU's caps to bite."""
    rng = np.random.default_rng(seed)
    H, V, p = c["hidden_size"], c["vocab_size"], "language_model.model."
    lin = c["linear_attn_config"]
    Hh, dk, K = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
    n = Hh * dk
    heads, nope, r, vd = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    ql, kvl = c["q_lora_rank"], c["kv_lora_rank"]
    E, I, Z, S = c["num_experts"], c["moe_intermediate_size"], c["moe_latent_size"], c["num_shared_experts"] * c["moe_intermediate_size"]

    def m(*shape, std=None):
        return (rng.standard_normal(shape) * (std if std is not None else shape[-1] ** -0.5)).astype(np.float32)

    def norm(d):
        return (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)

    w = {p + "embed_tokens.weight": m(V, H, std=1.0)}
    for i, kind in enumerate(layer_kinds(c)):
        L = f"{p}layers.{i}."
        w[L + "input_layernorm.weight"] = norm(H)
        a = L + "self_attn."
        if kind == "kda":
            w.update({a + "q_proj.weight": m(n, H), a + "k_proj.weight": m(n, H), a + "v_proj.weight": m(n, H),
                      a + "q_conv1d.weight": m(n, 1, K, std=0.5), a + "k_conv1d.weight": m(n, 1, K, std=0.5),
                      a + "v_conv1d.weight": m(n, 1, K, std=0.5),
                      a + "f_a_proj.weight": m(dk, H), a + "f_b_proj.weight": m(n, dk),
                      a + "A_log": np.log(rng.uniform(1, 16, Hh + A_LOG_PAD)).astype(np.float32),
                      a + "dt_bias": m(n, std=0.5), a + "b_proj.weight": m(Hh, H), a + "g_proj.weight": m(n, H),
                      a + "o_norm.weight": norm(dk), a + "o_proj.weight": m(H, n)})
        else:
            w.update({a + "q_a_proj.weight": m(ql, H), a + "q_a_layernorm.weight": norm(ql),
                      a + "q_b_proj.weight": m(heads * (nope + r), ql), a + "kv_a_proj_with_mqa.weight": m(kvl + r, H),
                      a + "kv_a_layernorm.weight": norm(kvl), a + "kv_b_proj.weight": m(heads * (nope + vd), kvl),
                      a + "g_proj.weight": m(heads * vd, H), a + "o_proj.weight": m(H, heads * vd)})
        for sub in ("self_attention", "mlp"):
            w[L + f"{sub}_res_norm.weight"] = norm(H)
            w[L + f"{sub}_res_proj.weight"] = m(1, H, std=RES_PROJ_STD)
        w[L + "post_attention_layernorm.weight"] = norm(H)
        if i < c["first_k_dense_replace"]:
            F = c["intermediate_size"]
            w.update({L + "mlp.gate_proj.weight": m(F, H, std=0.4), L + "mlp.up_proj.weight": m(F, H, std=0.5),
                      L + "mlp.down_proj.weight": m(H, F)})
        else:
            b = L + "block_sparse_moe."
            w.update({b + "gate.weight": m(E, H), b + "gate.e_score_correction_bias": m(E, std=0.1),
                      b + "routed_expert_down_proj.weight": m(Z, H), b + "routed_expert_norm.weight": norm(Z),
                      b + "routed_expert_up_proj.weight": m(H, Z),
                      b + "shared_experts.gate_proj.weight": m(S, H, std=0.4),
                      b + "shared_experts.up_proj.weight": m(S, H, std=0.5), b + "shared_experts.down_proj.weight": m(H, S)})
            for e in range(E):
                w.update({b + f"experts.{e}.w1.weight": m(I, Z, std=0.5), b + f"experts.{e}.w3.weight": m(I, Z, std=1.2),
                          b + f"experts.{e}.w2.weight": m(Z, I)})
    w.update({p + "output_attn_res_norm.weight": norm(H), p + "output_attn_res_proj.weight": m(1, H, std=RES_PROJ_STD),
              p + "norm.weight": norm(H), "language_model.lm_head.weight": m(V, H)})
    return w


# ---- MXFP4 (the official experts' format) ---------------------------------------------------------
def mxfp4_encode(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(packed U8 [rows, cols/2], scales U8 [rows, cols/32], the float64 weights they stand for): each
    group of 32 columns scaled by a power of two so its largest magnitude fits E2M1's 6, each value
    rounded to the nearest E2M1 magnitude; the low nibble is the even column."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // MXFP4_GROUP, MXFP4_GROUP).astype(np.float64)
    exp = np.ceil(np.log2(np.maximum(np.abs(g).max(-1), 1e-30) / 6.0))  # 2^exp · 6 ≥ max
    scale = 2.0 ** exp
    mags = np.abs(E2M1[:8])
    codes = np.abs(np.abs(g / scale[..., None])[..., None] - mags).argmin(-1)  # nearest magnitude
    codes = (codes + 8 * (g < 0)).astype(np.uint8)
    codes = codes.reshape(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    scales = (exp + 127).astype(np.uint8)
    return packed, scales, mxfp4_decode(packed, scales)


def mxfp4_decode(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float64 weights of MXFP4 `packed` [rows, cols/2] and UE8M0 `scales` [rows, cols/32]."""
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    return E2M1[codes] * np.repeat(2.0 ** (scales.astype(np.float64) - 127), MXFP4_GROUP, axis=1)


def save_checkpoint(d: Path, c: dict, w: dict[str, np.ndarray], mxfp4: bool = False, shards: int = 1) -> dict:
    """Write a K3 checkpoint to d (config.json, model-0000k-of-0000N.safetensors + index). With `mxfp4`
    the routed experts are stored as the official checkpoint stores them (`w{1,2,3}.weight_packed`
    U8 + `weight_scale` U8), each expert's tensors together in one shard; returns the weights the files
    hold (the experts rounded to MXFP4)."""
    from safetensors.numpy import save_file

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(k3_config(**{k: v for k, v in c.items() if k not in TINY_K3 or TINY_K3[k] != v})))
    held, tensors = dict(w), {}
    for name, t in w.items():
        if mxfp4 and ".experts." in name:
            packed, scales, exact = mxfp4_encode(t)
            base = name[: -len(".weight")]
            tensors[base + ".weight_packed"], tensors[base + ".weight_scale"] = packed, scales
            held[name] = exact.astype(np.float32)
        else:
            tensors[name] = t
    # each expert's tensors together in one shard (safetensors orders a shard by dtype, then name: an
    # expert's six MXFP4 tensors are contiguous, experts in name order, 10 before 2), the rest spread
    expert_of = lambda n: int(n.split(".experts.")[1].split(".")[0]) if ".experts." in n else None  # noqa: E731
    names = list(tensors)
    parts = [[n for j, n in enumerate(names) if (expert_of(n) if expert_of(n) is not None else j) % shards == k]
             for k in range(shards)]
    index = {}
    for k, part in enumerate(parts):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(d / fname), metadata={"format": "pt"})
        index.update(dict.fromkeys(part, fname))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return held


# ---- the model ----------------------------------------------------------------------------------
def rms(v, w, eps):
    return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * w


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def situ_glu(g, u):
    """SiTU-GLU: 4·tanh(g/4)·σ(g) · 25·tanh(u/25)."""
    return 4 * np.tanh(g / 4) * sigmoid(g) * 25 * np.tanh(u / 25)


def l2norm(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


class Reference:
    """Kimi K3 in float64. `logits(ids)` → (T, V); `routing` records each MoE layer's (ids, scores)."""

    def __init__(self, c: dict, w: dict[str, np.ndarray]):
        self.c, self.w = c, {k: np.asarray(v, np.float64) for k, v in w.items()}
        self.kinds = layer_kinds(c)
        self.eps = c["rms_norm_eps"]
        self.routing: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def p(self, name, i=None):
        return self.w[("language_model.model." if i is None else f"language_model.model.layers.{i}.") + name]

    def mix(self, blocks, prefix, norm_w, proj_w):
        """Block attention residual: softmax over [blocks…, prefix] of scores from the normalised
        values, mixing the raw values."""
        values = blocks + ([] if prefix is None else [prefix])
        if len(values) == 1:
            return values[0]
        V = np.stack(values)  # (n, T, H)
        scores = (rms(V, norm_w, self.eps) * proj_w[0]).sum(-1)  # (n, T)
        p = np.exp(scores - scores.max(0))
        p /= p.sum(0)
        return (p[..., None] * V).sum(0)

    def kda(self, i, x):
        lin = self.c["linear_attn_config"]
        Hh, d, K = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
        T = len(x)
        outs = []
        for which in "qkv":
            y = x @ self.p(f"self_attn.{which}_proj.weight", i).T  # (T, n)
            wconv = self.p(f"self_attn.{which}_conv1d.weight", i)[:, 0, :]  # (n, K)
            pad = np.concatenate([np.zeros((K - 1, y.shape[1])), y])
            conv = sum(wconv[:, j] * pad[j:j + T] for j in range(K))
            outs.append((conv * sigmoid(conv)).reshape(T, Hh, d))
        q, k, v = outs
        q, k = l2norm(q) * d ** -0.5, l2norm(k)
        beta = sigmoid(x @ self.p("self_attn.b_proj.weight", i).T)  # (T, Hh)
        f = (x @ self.p("self_attn.f_a_proj.weight", i).T) @ self.p("self_attn.f_b_proj.weight", i).T
        f = (f + self.p("self_attn.dt_bias", i)).reshape(T, Hh, d)
        A = np.exp(self.p("self_attn.A_log", i)[:Hh])  # the checkpoint pads A_log: the first Hh are the heads'
        g = lin.get("gate_lower_bound", -5.0) * sigmoid(A[None, :, None] * f)
        S = np.zeros((Hh, d, d))
        o = np.empty((T, Hh, d))
        for t in range(T):
            S = S * np.exp(g[t])[:, :, None]
            delta = beta[t][:, None] * (v[t] - np.einsum("hij,hi->hj", S, k[t]))
            S = S + k[t][:, :, None] * delta[:, None, :]
            o[t] = np.einsum("hij,hi->hj", S, q[t])
        gate = sigmoid(x @ self.p("self_attn.g_proj.weight", i).T).reshape(T, Hh, d)
        o = rms(o, self.p("self_attn.o_norm.weight", i), 1e-5) * gate
        return o.reshape(T, Hh * d) @ self.p("self_attn.o_proj.weight", i).T

    def mla(self, i, x):
        c = self.c
        heads, nope, r, vd = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        T = len(x)
        q = rms(x @ self.p("self_attn.q_a_proj.weight", i).T, self.p("self_attn.q_a_layernorm.weight", i), 1e-6)
        q = (q @ self.p("self_attn.q_b_proj.weight", i).T).reshape(T, heads, nope + r)
        ckv = x @ self.p("self_attn.kv_a_proj_with_mqa.weight", i).T
        latent = rms(ckv[:, : c["kv_lora_rank"]], self.p("self_attn.kv_a_layernorm.weight", i), 1e-6)
        k_r = ckv[:, c["kv_lora_rank"]:]  # shared by the heads, never rotated
        kv = (latent @ self.p("self_attn.kv_b_proj.weight", i).T).reshape(T, heads, nope + vd)
        k = np.concatenate([kv[..., :nope], np.repeat(k_r[:, None], heads, axis=1)], axis=-1)
        scores = np.einsum("thd,shd->hts", q, k) * (nope + r) ** -0.5
        scores[:, np.triu(np.ones((T, T), bool), 1)] = -np.inf
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out = np.einsum("hts,shd->thd", p, kv[..., nope:]).reshape(T, heads * vd)
        out = out * sigmoid(x @ self.p("self_attn.g_proj.weight", i).T)
        return out @ self.p("self_attn.o_proj.weight", i).T

    def mlp(self, x, prefix):
        return situ_glu(x @ self.w[prefix + "gate_proj.weight"].T, x @ self.w[prefix + "up_proj.weight"].T) \
            @ self.w[prefix + "down_proj.weight"].T

    def moe(self, i, x):
        c, b = self.c, f"language_model.model.layers.{i}.block_sparse_moe."
        s = sigmoid(x @ self.w[b + "gate.weight"].T)  # (T, E)
        choice = s + self.w[b + "gate.e_score_correction_bias"]
        ids = np.argsort(-choice, axis=-1, kind="stable")[:, : c["num_experts_per_token"]]
        weights = np.take_along_axis(s, ids, -1)
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20) * c["routed_scaling_factor"]
        self.routing[i] = (ids, choice)
        z = x @ self.w[b + "routed_expert_down_proj.weight"].T  # (T, Z): the experts run on the latent
        u = np.zeros_like(z)
        for t in range(len(x)):
            for wt, e in zip(weights[t], ids[t]):
                e_ = f"{b}experts.{e}."
                h = situ_glu(self.w[e_ + "w1.weight"] @ z[t], self.w[e_ + "w3.weight"] @ z[t])
                u[t] += wt * (self.w[e_ + "w2.weight"] @ h)
        u = rms(u, self.w[b + "routed_expert_norm.weight"], 1e-5)
        return u @ self.w[b + "routed_expert_up_proj.weight"].T + self.mlp(x, b + "shared_experts.")

    def logits(self, ids) -> np.ndarray:
        c, eps = self.c, self.eps
        h = self.w["language_model.model.embed_tokens.weight"][np.asarray(ids)]
        blocks, prefix = [], h
        for i, kind in enumerate(self.kinds):
            if i % c["attn_res_block_size"] == 0:  # a new block: the prefix is stored, restarts empty
                blocks.append(prefix)
                prefix = None
            x = self.mix(blocks, prefix, self.p("self_attention_res_norm.weight", i), self.p("self_attention_res_proj.weight", i))
            x = rms(x, self.p("input_layernorm.weight", i), eps)
            a = self.kda(i, x) if kind == "kda" else self.mla(i, x)
            prefix = a if prefix is None else prefix + a
            x = self.mix(blocks, prefix, self.p("mlp_res_norm.weight", i), self.p("mlp_res_proj.weight", i))
            x = rms(x, self.p("post_attention_layernorm.weight", i), eps)
            prefix = prefix + (self.mlp(x, f"language_model.model.layers.{i}.mlp.") if i < c["first_k_dense_replace"]
                               else self.moe(i, x))
        h = self.mix(blocks, prefix, self.p("output_attn_res_norm.weight"), self.p("output_attn_res_proj.weight"))
        return rms(h, self.p("norm.weight"), eps) @ self.w["language_model.lm_head.weight"].T


# The flagship's shape, for planning (the project's architecture notes, "Kimi K3"): 93 layers = 69 KDA (96 heads of 128)
# + 24 MLA (96 heads, 128 + 64 query/key, 128 value, latent 512 + 64), hidden 7168, 896 experts top-16
# on a 3584-wide latent, expert width 3072, 2 shared. Not published and assumed here: the MLA layers'
# places (every 4th, and the last), q_lora_rank, the dense layer's width, the vocabulary.
K3_FLAGSHIP = dict(
    vocab_size=163840, hidden_size=7168, num_hidden_layers=93, intermediate_size=18432, moe_intermediate_size=3072,
    num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, num_experts=896, num_experts_per_token=16, num_shared_experts=2, moe_latent_size=3584,
    linear_attn_config={"full_attn_layers": [*range(4, 93, 4), 93], "kda_layers": [i for i in range(1, 94)
                                                                               if i % 4 and i != 93],
                        "head_dim": 128, "num_heads": 96, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0},
)
