"""Multi-head latent attention (DeepSeek-V2/V3, GLM-5) over a compressed cache.

Per token and layer the cache holds only the normalised KV latent (``kv_lora_rank``, 512 for
GLM-5) and the shared rotated rope key (``qk_rope_head_dim``, 64): 576 floats instead of
heads × (k + v) widths. ``kv_b_proj`` is never applied to the cache; it is absorbed instead:

    score(t, s) = q_nope_h · (W_k,h c_s) + q_rope_h · k_rope_s = (W_k,hᵀ q_nope_h) · c_s + …
    out_h(t)    = Σ_s p(t, s) W_v,h c_s                      = W_v,h (Σ_s p(t, s) c_s)

so attention runs in the latent space for prefill and decode alike, and `kv_b_proj` stays as
stored (quantised): its key rows multiply each query (`kernels.matmul_t_each`, x @ W) and its value
rows one latent per (token, head) (`kernels.matmul_each`): every head in one C call each, and the
scores and weighted latents of every (head, query) pair as one 2-D product, so the cache is read
once, not once a head (a GLM-5.2-size decode step's attention 0.84x the time at 256 cached tokens,
0.74x at 2048: BENCHMARKS.md). Reference:
transformers/models/glm_moe_dsa/modeling_glm_moe_dsa.py (GlmMoeDsaAttention, its expanded form).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kv.cache import Rows
from .. import kernels
from ..kernels.deltanet import BLOCK, query_blocks  # aligned query blocks: the bits of any cut of the forward
from ..quant import QTensor
from .linear import linear
from .norm import rms_norm
from .rope import apply_interleaved

__all__ = ["MLA", "MLACache", "MLADims"]

QUERY_BLOCK = BLOCK  # the most queries attended at once (bounds the (heads, block, S) scores of a long prefill)

@dataclass(frozen=True)
class MLADims:
    heads: int  # attention heads (H)
    q_lora_rank: int  # query latent width
    kv_lora_rank: int  # KV latent width (c): cached
    qk_nope_head_dim: int  # per-head query/key width without RoPE
    qk_rope_head_dim: int  # shared rope key width (r): cached
    v_head_dim: int  # per-head value width
    scale: float  # softmax scale (qk_head_dim ** -0.5, × mscale² with yarn)
    norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm eps (hard-coded 1e-6 in transformers)


class MLACache:
    """One layer's compressed cache: latent (S, c) and rotated rope key (S, r). A per-token part of
    a `kv.SequenceState`: arrays "PART.latent", "PART.k_rope"."""

    per_token = True

    def __init__(self, dims: MLADims):
        self.dims = dims
        self.latent = Rows(dims.kv_lora_rank)
        self.k_rope = Rows(dims.qk_rope_head_dim)

    @property
    def length(self) -> int:
        return self.latent.length

    def arrays(self) -> dict[str, np.ndarray]:
        return {"latent": self.latent.view(), "k_rope": self.k_rope.view()}

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        self.latent.append(arrays["latent"])
        self.k_rope.append(arrays["k_rope"])

    def fill(self, T: int) -> dict[str, np.ndarray]:
        return {"latent": self.latent.fill(T)[""], "k_rope": self.k_rope.fill(T)[""]}

    def empty(self) -> MLACache:
        return MLACache(self.dims)

    def truncate(self, length: int) -> None:
        self.latent.truncate(length)
        self.k_rope.truncate(length)


def _row_block(w, start: int, stop: int):
    """Rows start..stop of a weight matrix (a QTensor view, no copy)."""
    if not isinstance(w, QTensor):
        return w[start:stop]
    return QTensor(w.kind, stop - start, w.cols, w.data[start:stop],
                   None if w.scales is None else w.scales[start:stop], w.act)


class MLA:
    """One MLA layer's weights and its attention over an `MLACache`.

    q_a (q_lora, H_model), q_a_norm (q_lora,), q_b (heads·(nope+rope), q_lora),
    kv_a (c + r, H_model), kv_a_norm (c,), kv_b (heads·(nope+v), c), o_proj (H_model, heads·v).
    """

    def __init__(self, dims: MLADims, q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b, o_proj):
        self.d = dims
        self.q_a, self.q_a_norm, self.q_b = q_a, q_a_norm, q_b
        self.kv_a, self.kv_a_norm, self.kv_b, self.o_proj = kv_a, kv_a_norm, kv_b, o_proj
        per_head = dims.qk_nope_head_dim + dims.v_head_dim
        # views of kv_b's rows per head h (no copies): keys (nope, c) and values (v, c)
        self.w_k = [_row_block(kv_b, h * per_head, h * per_head + dims.qk_nope_head_dim) for h in range(dims.heads)]
        self.w_v = [_row_block(kv_b, h * per_head + dims.qk_nope_head_dim, (h + 1) * per_head)
                    for h in range(dims.heads)]

    def query(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray):
        """x (T, H_model) → q_resid (T, q_lora), q_nope (T, heads, nope), q_rope (T, heads, r) rotated."""
        d = self.d
        q_resid = rms_norm(linear(x, self.q_a), self.q_a_norm, d.norm_eps)  # (T, q_lora)
        q = linear(q_resid, self.q_b).reshape(len(x), d.heads, d.qk_nope_head_dim + d.qk_rope_head_dim)
        q_rope = apply_interleaved(q[..., d.qk_nope_head_dim:], cos, sin)  # (T, heads, r)
        return q_resid, q[..., : d.qk_nope_head_dim], q_rope

    def compress(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, cache: MLACache) -> None:
        """Append the T new tokens' latent (T, c) and rotated rope key (T, r) to `cache`."""
        d = self.d
        ckv = linear(x, self.kv_a)  # (T, c + r)
        cache.latent.append(rms_norm(ckv[:, : d.kv_lora_rank], self.kv_a_norm, d.norm_eps))
        cache.k_rope.append(apply_interleaved(ckv[:, None, d.kv_lora_rank:], cos, sin)[:, 0])

    def attend(self, q_nope: np.ndarray, q_rope: np.ndarray, cache: MLACache, keep: np.ndarray | None = None,
               gate: np.ndarray | None = None):
        """Causal attention of the last T cached tokens' queries over the whole cache → (T, H_model).

        q_nope (T, heads, nope), q_rope (T, heads, r); `keep` (T, S) bool: the keys each query may
        see (a sparse selection, e.g. DSA's); None: every key (dense attention). Future keys are
        always masked. With `keep` all True the result is bit-identical to `keep=None`. `gate` (T,
        heads·v): the heads' outputs are multiplied by it before o_proj (Kimi K3's sigmoid output gate).
        """
        d = self.d
        T = q_nope.shape[0]
        latent, k_rope = cache.latent.view(), cache.k_rope.view()  # (S, c), (S, r)
        start = latent.shape[0] - T  # the first query's position
        out = np.empty((T, d.heads, d.v_head_dim), np.float32)  # (T, heads, v)
        # aligned blocks (bounded scratch (heads, block, keys)), each over exactly the keys up to its
        # end, a few queries each alone: a query's bits never depend on where the forward began or ends
        for a, b in query_blocks(start, T):
            end = start + b
            out[a:b] = self._attend_block(q_nope[a:b], q_rope[a:b], latent[:end], k_rope[:end], start + a,
                                          None if keep is None else keep[a:b, :end])
        out = out.reshape(T, d.heads * d.v_head_dim)
        return linear(out if gate is None else out * gate, self.o_proj)

    def _attend_block(self, q_nope, q_rope, latent, k_rope, start: int, keep) -> np.ndarray:
        """Queries at positions start … start + n over keys (S, ·) → per-head values (n, heads, v)."""
        d = self.d
        n, S = q_nope.shape[0], latent.shape[0]
        quantised = isinstance(self.kv_b, QTensor)
        q_heads = [q_nope[:, h] for h in range(d.heads)]  # (n, nope) each
        # (heads, n, c): W_k,hᵀ absorbed into q
        q_lat = np.stack(kernels.matmul_t_each(self.w_k, q_heads) if quantised else
                         [q @ w for q, w in zip(q_heads, self.w_k)])
        rows = d.heads * n  # every (head, query) pair one row of a 2-D product: the cache read once, not once a head
        scores = (q_lat.reshape(rows, d.kv_lora_rank) @ latent.T
                  + q_rope.transpose(1, 0, 2).reshape(rows, d.qk_rope_head_dim) @ k_rope.T).reshape(d.heads, n, S)
        scores *= np.float32(d.scale)
        masked = np.arange(S)[None, :] > (start + np.arange(n))[:, None]  # (n, S): key after query
        if keep is not None:
            masked = masked | ~keep
        scores[:, masked] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        o_lat = (probs.reshape(rows, S) @ latent).reshape(d.heads, n, d.kv_lora_rank)  # (heads, n, c)
        # W_v,h applied once per (t, h) → (n, heads, v)
        heads = kernels.matmul_each(self.w_v, list(o_lat)) if quantised else [linear(o, w) for o, w in zip(o_lat, self.w_v)]
        return np.stack(heads, axis=1)
