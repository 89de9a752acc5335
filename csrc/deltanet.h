// deltanet.h — the Gated DeltaNet kernels (linear attention with a fixed-size recurrent state).
//
// Two parts of a Gated DeltaNet layer run here (the projections around them are matmuls):
//   1. causal_conv1d: the depthwise causal convolution over time applied to the packed [q | k | v]
//      projections, with its rolling state (the last kernel-1 inputs), then SiLU;
//   2. the gated delta rule itself, per value head h with state S [dk, dv] and, per token t,
//        q̂ = l2norm(q_t) · dk^-1/2,  k̂ = l2norm(k_t),  l2norm(x) = x / sqrt(Σx² + 1e-6)
//        S ← exp(g_t) · S                      (g_t ≤ 0: the per-head decay, in log space)
//        δ = β_t · (v_t − Sᵀ k̂)               (β_t in (0, 1): the per-head write strength)
//        S ← S + k̂ ⊗ δ
//        o_t = Sᵀ q̂
//      Each q/k head serves hv/hk consecutive value heads (value head h uses k head h / (hv/hk)).
//      `gated_delta_rule_recurrent` does exactly these steps token by token (decode);
//      `gated_delta_rule_chunked` computes the same function chunk by chunk (prefill): within a
//      chunk the deltas solve one unit lower-triangular system (the UT transform), so the state is
//      read and written once per chunk instead of once per token. The two agree to float32
//      rounding; both are tested against the float64 NumPy reference in
//      colibri_core/kernels/reference_deltanet.py.
//
// All tensors are float32, row-major, contiguous. Every kernel is single-threaded and reduces
// each output element in one fixed order, so results depend only on the inputs (and the form).
//
// This header is also cffi's cdef (colibri_core/kernels/_build.py drops the lines starting with
// '#'): keep it to plain declarations. Status codes (COLI_OK, ...) come from colibri.h.
#ifndef COLIBRI_DELTANET_H
#define COLIBRI_DELTANET_H

#include "colibri.h"

// out[t, c] = act( Σ_{j<kernel} weight[c, j] · xin[t + j, c] ), xin = [state ; x] (time-major),
// the sum taken in order j = 0 .. kernel-1; act = SiLU a / (1 + exp(-a)) when `silu`, else none.
// Afterwards `state` holds the last kernel-1 rows of xin (oldest first): the next call continues.
// out: f32 [n, channels] (written; may not alias x); state: f32 [kernel - 1, channels] (read,
// updated); x: f32 [n, channels]; weight: f32 [channels, kernel]. kernel >= 1.
// Returns COLI_OK, COLI_EINVAL (bad sizes) or COLI_ENOMEM.
int causal_conv1d(float *out, float *state, const float *x, const float *weight, int n, int channels,
                  int kernel, int silu);

// The gated delta rule, token by token (the definition above).
// out: f32 [n, hv, dv] (written); state: f32 [hv, dk, dv] (read, updated);
// q, k: f32 [n, hk, dk] (not yet normalised); v: f32 [n, hv, dv]; g, beta: f32 [n, hv].
// hv must be a multiple of hk. Returns COLI_OK, COLI_EINVAL or COLI_ENOMEM.
int gated_delta_rule_recurrent(float *out, float *state, const float *q, const float *k, const float *v,
                               const float *g, const float *beta, int n, int hk, int hv, int dk, int dv);

// The same function in chunks of `chunk` tokens (the last chunk may be shorter). Per chunk of L
// tokens and value head, with γ_i = Σ_{s<=i} g_s (cumulative log decay inside the chunk) and S0 the
// state at the chunk's start:
//   A[i, j] = β_i (k̂_i · k̂_j) exp(γ_i − γ_j) for j < i        (strictly lower triangular)
//   u = (I + A)⁻¹ (β v − β exp(γ) (k̂ S0))                       (forward substitution, row i in order)
//   o_i = exp(γ_i) q̂_iᵀ S0 + Σ_{j<=i} (q̂_i · k̂_j) exp(γ_i − γ_j) u_j
//   S  = exp(γ_L) S0 + Σ_j exp(γ_L − γ_j) k̂_j ⊗ u_j
// Arguments as gated_delta_rule_recurrent, plus chunk >= 1 (64 for prefill).
int gated_delta_rule_chunked(float *out, float *state, const float *q, const float *k, const float *v,
                             const float *g, const float *beta, int n, int hk, int hv, int dk, int dv,
                             int chunk);

// Kimi Delta Attention (Kimi-Linear, Kimi K3): the same rule with a per-channel decay, token by token.
// Per head h (q, k and v have as many heads) with state S [d, d] and per token t:
//   q̂ = l2norm(q_t) · d^-1/2,  k̂ = l2norm(k_t)
//   S[i, :] ← exp(g_t[i]) · S[i, :]      (g_t ≤ 0: the decay of key channel i, in log space)
//   δ = β_t · (v_t − Sᵀ k̂);  S ← S + k̂ ⊗ δ;  o_t = Sᵀ q̂
// out: f32 [n, heads, d] (written); state: f32 [heads, d, d] (read, updated); q, k, v, g: f32
// [n, heads, d] (q, k not yet normalised); beta: f32 [n, heads]. The float64 reference is
// colibri_core/kernels/reference_kda.py. Returns COLI_OK, COLI_EINVAL or COLI_ENOMEM.
int kda_recurrent(float *out, float *state, const float *q, const float *k, const float *v, const float *g,
                  const float *beta, int n, int heads, int d);

// A whole Gated DeltaNet token mixer (Qwen3-Next, Qwen3.5/3.6) in one call, for the new tokens of
// n_seq sequences (a batch's generations): sequence i's seq_T[i] rows follow those of the sequences
// before it in x and out (T = Σ seq_T rows), its states are conv_state[i] and state[i]:
//   mixed, z, b, a = x in_qkvᵀ, x in_zᵀ, x in_bᵀ, x in_aᵀ       (one matmul_multi on all rows, `act`)
//   [q | k | v] = causal_conv1d(mixed, conv, conv_state, SiLU)   (each sequence over its own rows)
//   β = 1 / (1 + exp(−b));  g = neg_a · softplus(a + dt_bias)     (softplus(y) = y above 20, else
//                                                                   log1p(exp(y)); exp: coli_expf)
//   o = the gated delta rule, each sequence's (recurrent for seq_T <= exact_batch, else chunked by
//       `chunk`, a last chunk of at most exact_batch tokens recurrent: the bits of a forward cut there)
//   o = rms_norm(o per value head, norm) · silu(z),  silu(z) = z / (1 + exp(−z))
//   out = o out_projᵀ                                            (matmul on all rows, arithmetic `act`)
// out: f32 [T, hidden] (written); x: f32 [T, hidden]; conv_state[i]: f32 [conv_kernel - 1, channels]
// and state[i]: f32 [hv, dk, dv] (read, updated), channels = 2 hk dk + hv dv. Each step is one
// token's own (the matmuls' and the recurrent rule's bits do not depend on the rows beside it, the
// rule's on T up to exact_batch): each sequence gets the bits of its own call.
// Returns COLI_OK, COLI_EINVAL (shapes) or COLI_ENOMEM.
typedef struct {
    const QMatrix *in_qkv, *in_z, *in_b, *in_a;  // [channels, hidden], [hv dv, hidden], [hv, hidden] (b, a)
    const float *conv;                            // [channels, conv_kernel]
    const float *neg_a, *dt_bias;                 // [hv]: −exp(A_log); the decay's bias
    const float *norm;                            // [dv]: the gated RMSNorm's weight
    const QMatrix *out_proj;                      // [hidden, hv dv]
    int hk, hv, dk, dv, conv_kernel;
    int exact_batch, chunk;                       // the rule's form: recurrent up to exact_batch tokens
    float eps;
} DeltaNetBlock;
int deltanet_block(float *out, const float *x, int n_seq, const int *seq_T, const DeltaNetBlock *b,
                   float *const *conv_state, float *const *state, int act);

#endif  // COLIBRI_DELTANET_H
