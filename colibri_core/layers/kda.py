"""Kimi Delta Attention (KDA): the gated delta rule with a per-channel decay, as in Kimi-Linear and
Kimi K3. Reference: transformers/models/kimi_linear/modeling_kimi_linear.py
(`KimiLinearDeltaAttention`, its pure-torch `recurrent_`/`chunk_kimi_delta_attention`); the float64
definition is colibri_core/kernels/reference_kda.py.

    q, k, v = SiLU(causal_conv1d(W_{q,k,v} x))          (T, Hh, dk) each, one depthwise conv per channel
    β = sigmoid(b_proj x)                                 (T, Hh)
    decay, per channel (log space, ≤ 0):
      Kimi-Linear  g = −exp(A_log[h]) · softplus(f_b(f_a x) + dt_bias)
      Kimi K3      g = lb · sigmoid(exp(A_log[h]) · (f_b(f_a x) + dt_bias)),  lb = −5 (gate_lower_bound)
    per step       S ← diag(exp(g_t)) S;  S += k̂ ⊗ β (v − k̂ᵀ S);  o = q̂ᵀ S
                   q̂ = l2norm(q) · dk^-½, k̂ = l2norm(k), l2norm(x) = x / √(Σx² + 1e-6)
    out = o_proj( RMSNorm(o, o_norm) · sigmoid(gate) ),  gate = g_b(g_a x) (Kimi-Linear, low rank)
                                                          or g_proj x (K3, full rank)

The state is fixed-size: the last K−1 conv inputs and, per head, a [dk, dv] matrix (float32).
`kda_rule` runs the recurrence token by token in C (`kda_recurrent`, csrc/deltanet.c) for a prompt and
for decode alike: on a CPU it is the fast form (96 heads × 128, 128 tokens: 0.2 s, against 13.5 s
for the chunked UT form of the reference implementations in float64 NumPy, kept as form="chunked"),
the most accurate in float32, and a prompt leaves exactly the state decoding it token by token
leaves. The two forms agree to float32 rounding.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ..kernels import deltanet as conv_kernels
from ..kernels import kda as kda_kernels
from .gated_attention import sigmoid
from .linear import linear
from .norm import rms_norm

__all__ = ["KDADims", "KDAState", "KimiDeltaAttention", "kda_rule"]

CHUNK = 64  # tokens per chunk in the chunked form (as the reference implementations)
L2NORM_EPS = np.float32(1e-6)


@dataclass(frozen=True)
class KDADims:
    heads: int  # Hh (q, k and v have as many heads)
    head_dim: int  # dk = dv
    conv_kernel: int  # K

    @property
    def channels(self) -> int:
        """Width of the packed [q | k | v] the conv runs over."""
        return 3 * self.heads * self.head_dim

    @property
    def state_floats(self) -> int:
        """Floats of one layer's state: conv (K−1, channels) + recurrent (Hh, dk, dv)."""
        return (self.conv_kernel - 1) * self.channels + self.heads * self.head_dim * self.head_dim


@dataclass
class KDAState:
    """One KDA layer's state, float32, updated in place. A fixed-size part of a `kv.SequenceState`:
    arrays "PART.conv", "PART.recurrent" (copies)."""

    per_token: ClassVar[bool] = False
    varying: ClassVar[dict] = {}  # both arrays keep their shape
    dims: KDADims
    conv: np.ndarray = field(init=False)  # (K−1, channels): the last K−1 conv inputs, oldest first
    recurrent: np.ndarray = field(init=False)  # (Hh, dk, dv)

    def __post_init__(self):
        d = self.dims
        self.conv = np.zeros((d.conv_kernel - 1, d.channels), np.float32)
        self.recurrent = np.zeros((d.heads, d.head_dim, d.head_dim), np.float32)

    def arrays(self) -> dict[str, np.ndarray]:
        return {"conv": self.conv.copy(), "recurrent": self.recurrent.copy()}

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        self.conv[...] = arrays["conv"]
        self.recurrent[...] = arrays["recurrent"]

    def empty(self) -> KDAState:
        return KDAState(self.dims)


def _l2norm(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).sum(axis=-1, keepdims=True) + L2NORM_EPS)


def kda_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray,
             form: str = "auto", chunk: int = CHUNK) -> np.ndarray:
    """The KDA recurrence. q, k, v float32 (n, Hh, d) (q and k normalised inside); g (n, Hh, d) the
    per-channel log decay (≤ 0); beta (n, Hh); `state` float32 (Hh, d, d), updated in place.

    `form`: "recurrent" (token by token, in C; "auto" is this), or "chunked" (chunks of `chunk`
    tokens, float64 NumPy). Returns float32 (n, Hh, d)."""
    n, heads, d = q.shape
    if k.shape != q.shape or v.shape != q.shape or g.shape != q.shape or beta.shape != (n, heads):
        raise ValueError(f"kda_rule: q, k, v, g must be (n, Hh, d) and beta (n, Hh); got q {list(q.shape)}, "
                         f"k {list(k.shape)}, v {list(v.shape)}, g {list(g.shape)}, beta {list(beta.shape)}")
    if state.shape != (heads, d, d) or state.dtype != np.float32:
        raise ValueError(f"kda_rule: state must be float32 ({heads}, {d}, {d}), got {state.dtype} {list(state.shape)}")
    if form in ("auto", "recurrent"):  # C, token by token: the same bits whether tokens come one by one or together
        return kda_kernels.recurrent(q, k, v, g, beta, state)
    f32 = np.float32
    q = (_l2norm(q.astype(f32)) * f32(d ** -0.5)).transpose(1, 0, 2)  # (Hh, n, d)
    k = _l2norm(k.astype(f32)).transpose(1, 0, 2)
    v = v.astype(f32).transpose(1, 0, 2)
    g = g.astype(f32).transpose(1, 0, 2)
    beta = beta.astype(f32).T  # (Hh, n)
    out = np.empty((heads, n, d), f32)
    if form == "chunked":
        if chunk < 1:
            raise ValueError(f"kda_rule: chunk must be at least 1, got {chunk}")
        for t0 in range(0, n, chunk):
            t1 = min(n, t0 + chunk)
            out[:, t0:t1] = _chunk(q[:, t0:t1], k[:, t0:t1], v[:, t0:t1], g[:, t0:t1], beta[:, t0:t1], state)
    else:
        raise ValueError(f"kda_rule: form must be 'auto', 'recurrent' or 'chunked', got {form!r}")
    return np.ascontiguousarray(out.transpose(1, 0, 2))


def _chunk(q, k, v, g, beta, S) -> np.ndarray:
    """One chunk of L tokens, every head: q, k, v, g (Hh, L, d) (q, k normalised), beta (Hh, L),
    S (Hh, d, d) updated in place. With γ = cumsum(g) (per channel) and S0 the state at the start:
        A[i, j] = β_i Σ_c k̂_i,c k̂_j,c exp(γ_i,c − γ_j,c)  (j < i)
        u = (I + A)⁻¹ (β v − β (k̂ ⊙ exp γ) S0)             (forward substitution)
        o_i = (q̂_i ⊙ exp γ_i) S0 + Σ_{j≤i} (Σ_c q̂_i,c k̂_j,c exp(γ_i,c − γ_j,c)) u_j
        S  = diag(exp γ_L) S0 + Σ_j (k̂_j ⊙ exp(γ_L − γ_j)) ⊗ u_j
    Every exponent is ≤ 0 (γ decreases), so nothing overflows. The chunk is computed in float64
    (the forward substitution amplifies float32 rounding ~10× over 64 rows; the recurrent form does
    not), the state kept float32."""
    heads, L, d = q.shape
    q, k, v, g, beta = (a.astype(np.float64) for a in (q, k, v, g, beta))
    gamma = np.cumsum(g, axis=1)  # (Hh, L, d)
    lower = np.tril(np.ones((L, L), bool), -1)
    out = np.empty((heads, L, d), np.float32)
    for h in range(heads):  # bounded scratch: (L, L, d) per head
        gh = gamma[h]
        diff = gh[:, None, :] - gh[None, :, :]  # (L, L, d): γ_i − γ_j
        decay = np.exp(np.where((lower | np.eye(L, dtype=bool))[:, :, None], diff, -np.inf))
        kk = np.einsum("ic,jc,ijc->ij", k[h], k[h], decay)  # (L, L)
        qk = np.einsum("ic,jc,ijc->ij", q[h], k[h], decay)  # (L, L), j ≤ i
        A = np.where(lower, kk * beta[h][:, None], 0.0)
        e = np.exp(gh)  # (L, d)
        S0 = S[h].astype(np.float64)
        rhs = beta[h][:, None] * (v[h] - (k[h] * e) @ S0)  # (L, dv)
        u = np.empty((L, d))
        for i in range(L):
            u[i] = rhs[i] - A[i, :i] @ u[:i]
        out[h] = (q[h] * e) @ S0 + qk @ u
        last = np.exp(gh[-1])  # (d,)
        S[h] = last[:, None] * S0 + (k[h] * np.exp(gh[-1][None, :] - gh)).T @ u
    return out


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + exp(x)) in float32 and x itself above 20, as transformers' KDA forget gate."""
    x = x.astype(np.float32, copy=False)
    return np.where(x > 20, x, np.log(np.float32(1) + np.exp(np.minimum(x, np.float32(20))))).astype(np.float32)


@dataclass
class KimiDeltaAttention:
    """One KDA layer's weights (matrices are QTensors or float32 arrays).

    The output gate is low rank (`g_a`, `g_b`: Kimi-Linear) or full rank (`g_proj`: K3); the decay is
    Kimi-Linear's softplus form, or K3's sigmoid form when `gate_lower_bound` is set."""

    dims: KDADims
    q_proj: Any  # (Hh dk, H)
    k_proj: Any  # (Hh dk, H)
    v_proj: Any  # (Hh dv, H)
    conv_weight: np.ndarray  # (3 Hh dk, K) float32: the q, k and v convs stacked
    f_a: Any  # (dk, H)
    f_b: Any  # (Hh dk, dk)
    A_log: np.ndarray  # (Hh,) float32
    dt_bias: np.ndarray  # (Hh dk,) float32
    b_proj: Any  # (Hh, H)
    o_norm: np.ndarray  # (dv,)
    o_proj: Any  # (H, Hh dv)
    eps: float  # o_norm's eps
    g_a: Any = None  # (dk, H): low-rank output gate (Kimi-Linear)
    g_b: Any = None  # (Hh dv, dk)
    g_proj: Any = None  # (Hh dv, H): full-rank output gate (K3)
    gate_lower_bound: float | None = None  # K3: −5

    def decay(self, x: np.ndarray) -> np.ndarray:
        """x (T, H) → the per-channel log decay g (T, Hh, dk), float32."""
        d = self.dims
        f = linear(linear(x, self.f_a), self.f_b) + self.dt_bias  # (T, Hh dk)
        f = f.reshape(len(x), d.heads, d.head_dim)
        rate = np.exp(self.A_log.astype(np.float32))[None, :, None]  # (1, Hh, 1)
        if self.gate_lower_bound is None:
            return (-rate * softplus(f)).astype(np.float32)
        return (np.float32(self.gate_lower_bound) * sigmoid(rate * f)).astype(np.float32)

    def __call__(self, x: np.ndarray, state: KDAState) -> np.ndarray:
        """x (T, H) normalised hidden states → (T, H); `state` advances by T tokens."""
        d, T = self.dims, x.shape[0]
        qkv = np.concatenate([linear(x, self.q_proj), linear(x, self.k_proj), linear(x, self.v_proj)], axis=1)
        qkv = conv_kernels.causal_conv1d(np.ascontiguousarray(qkv, np.float32), self.conv_weight, state.conv)
        n = d.heads * d.head_dim
        q, k, v = (qkv[:, i * n:(i + 1) * n].reshape(T, d.heads, d.head_dim) for i in range(3))
        beta = sigmoid(linear(x, self.b_proj))  # (T, Hh)
        o = kda_rule(q, k, v, self.decay(x), beta, state.recurrent)  # (T, Hh, dv)
        gate = linear(x, self.g_proj) if self.g_proj is not None else linear(linear(x, self.g_a), self.g_b)
        o = rms_norm(o, self.o_norm, self.eps) * sigmoid(gate.reshape(T, d.heads, d.head_dim))
        return linear(np.ascontiguousarray(o.reshape(T, n)), self.o_proj)
