// deltanet.c — Gated DeltaNet: the causal conv1d with its rolling state and the gated delta rule
// (recurrent and chunked forms), and Kimi Delta Attention's per-channel-decay rule (recurrent form).
// The math is in deltanet.h; the float64 NumPy references are colibri_core/kernels/reference_deltanet.py
// and reference_kda.py.
//
// Loop orders are chosen so the innermost loop runs over a contiguous dv (or channel) axis; every
// sum over an axis is taken sequentially in index order, so each result depends only on the
// inputs. Built with -ffp-contract=off like the rest of csrc/. The conv (by channel ranges) and the
// recurrent rules (by value heads) run on the kernel threads; each result is one thread's, computed
// in the same order, so the thread count never changes a bit.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "deltanet.h"
#include "impl/kernels_impl.h"

#define L2NORM_EPS 1e-6f

// ----------------------------------------------------------------------------
// causal_conv1d

typedef struct {
    float *out;
    const float *state, *x, *weight;
    int n, channels, kernel, silu, per;  // per: channels per task
} ConvJob;

static void conv_task(void *ctx, int task) {
    const ConvJob *j = ctx;
    const int hist = j->kernel - 1;  // rows of state
    int c0 = task * j->per, c1 = c0 + j->per < j->channels ? c0 + j->per : j->channels;
    // xin = [state ; x]: (hist + n) rows of `channels`; row r is state[r] for r < hist, else x[r - hist]
    for (int t = 0; t < j->n; t++) {
        float *o = j->out + (size_t)t * j->channels;
        for (int c = c0; c < c1; c++) {
            const float *w = j->weight + (size_t)c * j->kernel;
            float acc = 0.0f;
            for (int i = 0; i < j->kernel; i++) {
                int r = t + i;  // row of xin
                float xv = r < hist ? j->state[(size_t)r * j->channels + c] : j->x[(size_t)(r - hist) * j->channels + c];
                acc += w[i] * xv;
            }
            o[c] = j->silu ? acc / (1.0f + expf(-acc)) : acc;
        }
    }
}

int causal_conv1d(float *out, float *state, const float *x, const float *weight, int n, int channels,
                  int kernel, int silu) {
    if (n < 0 || channels < 0 || kernel < 1) {
        return COLI_EINVAL;
    }
    if (n == 0 || channels == 0) {
        return COLI_OK;
    }
    const int hist = kernel - 1;  // rows of state
    // Channel ranges in parallel: each output element is one thread's, the same operations.
    int tasks = (double)n * channels * (kernel + 8) < POOL_MIN_WORK ? 1 : 4 * threads_get();  // +8: the SiLU's expf
    ConvJob j = {out, state, x, weight, n, channels, kernel, silu, (channels + tasks - 1) / tasks};
    int ntasks = (channels + j.per - 1) / j.per;
    if (ntasks == 1) {
        conv_task(&j, 0);
    } else {
        pool_run(conv_task, &j, ntasks);
    }
    // New state: the last `hist` rows of xin, i.e. rows n .. n + hist - 1.
    if (hist > 0) {
        if (n >= hist) {
            memcpy(state, x + (size_t)(n - hist) * channels, (size_t)hist * channels * sizeof(float));
        } else {
            memmove(state, state + (size_t)n * channels, (size_t)(hist - n) * channels * sizeof(float));
            memcpy(state + (size_t)(hist - n) * channels, x, (size_t)n * channels * sizeof(float));
        }
    }
    return COLI_OK;
}

// ----------------------------------------------------------------------------
// Shared helpers

// dst = src / sqrt(Σ src² + eps) · scale, over d elements (sum in index order).
static void l2normalise(float *dst, const float *src, int d, float scale) {
    float ss = 0.0f;
    for (int i = 0; i < d; i++) {
        ss += src[i] * src[i];
    }
    float inv = 1.0f / sqrtf(ss + L2NORM_EPS);
    for (int i = 0; i < d; i++) {
        dst[i] = src[i] * inv * scale;
    }
}

static float dot(const float *a, const float *b, int d) {
    float s = 0.0f;
    for (int i = 0; i < d; i++) {
        s += a[i] * b[i];
    }
    return s;
}

static int check_sizes(int n, int hk, int hv, int dk, int dv) {
    if (n < 0 || hk < 1 || hv < 1 || dk < 1 || dv < 1 || hv % hk != 0) {
        return COLI_EINVAL;
    }
    return COLI_OK;
}

// qn, kn: f32 [n, hk, dk] = normalised q (times dk^-1/2) and k; malloc'd here, freed by the caller.
static int normalise_qk(float **qn, float **kn, const float *q, const float *k, int n, int hk, int dk) {
    size_t count = (size_t)n * hk * dk;
    *qn = malloc(count * sizeof(float));
    *kn = malloc(count * sizeof(float));
    if (*qn == NULL || *kn == NULL) {
        free(*qn);
        free(*kn);
        return COLI_ENOMEM;
    }
    float scale = 1.0f / sqrtf((float)dk);
    for (size_t r = 0; r < (size_t)n * hk; r++) {
        l2normalise(*qn + r * dk, q + r * dk, dk, scale);
        l2normalise(*kn + r * dk, k + r * dk, dk, 1.0f);
    }
    return COLI_OK;
}

// ----------------------------------------------------------------------------
// Recurrent form

// One token of the rule on one head's state S [dk, dv]: S[i, :] ← decay[i] · S[i, :] and kv = Sᵀ k̂
// (pass 1), δ = b · (v − kv), then S ← S + k̂ ⊗ δ and o = Sᵀ q̂ (pass 2). delta: [dv] scratch.
static void delta_step(float *S, const float *decay, const float *kt, const float *qt, const float *vt, float b,
                       float *delta, float *ot, int dk, int dv) {
    for (int j = 0; j < dv; j++) {
        delta[j] = 0.0f;
    }
    for (int i = 0; i < dk; i++) {
        float *row = S + (size_t)i * dv;
        float di = decay[i], ki = kt[i];
        for (int j = 0; j < dv; j++) {
            row[j] *= di;
            delta[j] += row[j] * ki;
        }
    }
    for (int j = 0; j < dv; j++) {
        delta[j] = (vt[j] - delta[j]) * b;
        ot[j] = 0.0f;
    }
    for (int i = 0; i < dk; i++) {
        float *row = S + (size_t)i * dv;
        float ki = kt[i], qi = qt[i];
        for (int j = 0; j < dv; j++) {
            row[j] += ki * delta[j];
            ot[j] += row[j] * qi;
        }
    }
}

typedef struct {
    float *out, *state, *scratch;  // scratch: [hv, dv + dk], a row per head (delta, then the decays)
    const float *qn, *kn, *v, *g, *beta;
    int n, hk, hv, dk, dv;
    int per_channel;  // g is [n, hv, dk] (Kimi Delta Attention) instead of [n, hv] (Gated DeltaNet)
} RecurrentJob;

static void recurrent_head(void *ctx, int h) {
    const RecurrentJob *jb = ctx;
    const int hk = jb->hk, hv = jb->hv, dk = jb->dk, dv = jb->dv, group = hv / hk;
    float *S = jb->state + (size_t)h * dk * dv;  // [dk, dv]: stays in cache across the tokens
    float *delta = jb->scratch + (size_t)h * (dv + dk), *decay = delta + dv;
    for (int t = 0; t < jb->n; t++) {
        const size_t th = (size_t)t * hv + h, tk = (size_t)t * hk + h / group;
        if (jb->per_channel) {
            for (int i = 0; i < dk; i++) decay[i] = expf(jb->g[th * dk + i]);
        } else {
            float e = expf(jb->g[th]);
            for (int i = 0; i < dk; i++) decay[i] = e;
        }
        delta_step(S, decay, jb->kn + tk * dk, jb->qn + tk * dk, jb->v + th * dv, jb->beta[th], delta,
                   jb->out + th * dv, dk, dv);
    }
}

// Both recurrent forms, heads in parallel: each head's state and outputs are one thread's, in the
// same order.
static int recurrent(float *out, float *state, const float *q, const float *k, const float *v, const float *g,
                     const float *beta, int n, int hk, int hv, int dk, int dv, int per_channel) {
    int status = check_sizes(n, hk, hv, dk, dv);
    if (status != COLI_OK || n == 0) {
        return status;
    }
    float *qn, *kn;
    if ((status = normalise_qk(&qn, &kn, q, k, n, hk, dk)) != COLI_OK) {
        return status;
    }
    float *scratch = malloc((size_t)hv * (dv + dk) * sizeof(float));
    if (scratch == NULL) {
        free(qn);
        free(kn);
        return COLI_ENOMEM;
    }
    RecurrentJob jb = {out, state, scratch, qn, kn, v, g, beta, n, hk, hv, dk, dv, per_channel};
    if (4.0 * n * hv * dk * dv < POOL_MIN_WORK) {
        for (int h = 0; h < hv; h++) recurrent_head(&jb, h);
    } else {
        pool_run(recurrent_head, &jb, hv);
    }
    free(scratch);
    free(qn);
    free(kn);
    return COLI_OK;
}

int gated_delta_rule_recurrent(float *out, float *state, const float *q, const float *k, const float *v,
                               const float *g, const float *beta, int n, int hk, int hv, int dk, int dv) {
    return recurrent(out, state, q, k, v, g, beta, n, hk, hv, dk, dv, 0);
}

// ----------------------------------------------------------------------------
// Chunked form

int gated_delta_rule_chunked(float *out, float *state, const float *q, const float *k, const float *v,
                             const float *g, const float *beta, int n, int hk, int hv, int dk, int dv,
                             int chunk) {
    int status = check_sizes(n, hk, hv, dk, dv);
    if (status != COLI_OK || chunk < 1) {
        return status != COLI_OK ? status : COLI_EINVAL;
    }
    if (n == 0) {
        return COLI_OK;
    }
    if (chunk > n) {
        chunk = n;
    }
    float *qn, *kn;
    if ((status = normalise_qk(&qn, &kn, q, k, n, hk, dk)) != COLI_OK) {
        return status;
    }
    const size_t C = (size_t)chunk;
    float *gamma = malloc(C * sizeof(float));          // [C]   cumulative log decay in the chunk
    float *A = malloc(C * C * sizeof(float));          // [C, C] β_i (k̂_i·k̂_j) exp(γ_i − γ_j), j < i
    float *u = malloc(C * (size_t)dv * sizeof(float));  // [C, dv] the deltas of the chunk
    float *qs = malloc(C * C * sizeof(float));         // [C, C] (q̂_i·k̂_j) exp(γ_i − γ_j), j <= i
    if (!gamma || !A || !u || !qs) {
        free(gamma), free(A), free(u), free(qs), free(qn), free(kn);
        return COLI_ENOMEM;
    }
    const int group = hv / hk;
    for (int h = 0; h < hv; h++) {
        float *S = state + (size_t)h * dk * dv;  // [dk, dv]
        const int kh = h / group;
        for (int t0 = 0; t0 < n; t0 += chunk) {
            const int L = n - t0 < chunk ? n - t0 : chunk;
#define KN(i) (kn + ((size_t)(t0 + (i)) * hk + kh) * dk)  // k̂ of chunk row i: [dk]
#define QN(i) (qn + ((size_t)(t0 + (i)) * hk + kh) * dk)  // q̂ of chunk row i: [dk]
            float acc = 0.0f;
            for (int i = 0; i < L; i++) {
                acc += g[(size_t)(t0 + i) * hv + h];
                gamma[i] = acc;
            }
            for (int i = 0; i < L; i++) {
                float b = beta[(size_t)(t0 + i) * hv + h];
                for (int j = 0; j < i; j++) {
                    A[(size_t)i * C + j] = b * dot(KN(i), KN(j), dk) * expf(gamma[i] - gamma[j]);
                }
                for (int j = 0; j <= i; j++) {
                    qs[(size_t)i * C + j] = dot(QN(i), KN(j), dk) * expf(gamma[i] - gamma[j]);
                }
            }
            // u_i = β_i v_i − β_i exp(γ_i) (S0ᵀ k̂_i) − Σ_{j<i} A[i, j] u_j, row by row.
            // o_i = exp(γ_i) (S0ᵀ q̂_i) + Σ_{j<=i} qs[i, j] u_j (u_i is final when row i is done).
            for (int i = 0; i < L; i++) {
                const size_t t = (size_t)(t0 + i);
                float *ui = u + (size_t)i * dv;
                float *oi = out + (t * hv + h) * dv;
                const float *vi = v + (t * hv + h) * dv;
                const float *ki = KN(i), *qi = QN(i);
                float b = beta[t * hv + h], e = expf(gamma[i]);
                for (int j = 0; j < dv; j++) {
                    ui[j] = 0.0f;
                    oi[j] = 0.0f;
                }
                for (int a = 0; a < dk; a++) {  // ui = S0ᵀ k̂_i, oi = S0ᵀ q̂_i
                    const float *row = S + (size_t)a * dv;
                    float ka = ki[a], qa = qi[a];
                    for (int j = 0; j < dv; j++) {
                        ui[j] += row[j] * ka;
                        oi[j] += row[j] * qa;
                    }
                }
                for (int j = 0; j < dv; j++) {
                    ui[j] = b * vi[j] - b * e * ui[j];
                    oi[j] *= e;
                }
                for (int s = 0; s < i; s++) {
                    const float *us = u + (size_t)s * dv;
                    float a_is = A[(size_t)i * C + s];
                    for (int j = 0; j < dv; j++) {
                        ui[j] -= a_is * us[j];
                    }
                }
                for (int s = 0; s <= i; s++) {
                    const float *us = u + (size_t)s * dv;
                    float q_is = qs[(size_t)i * C + s];
                    for (int j = 0; j < dv; j++) {
                        oi[j] += q_is * us[j];
                    }
                }
            }
            // S ← exp(γ_L) S0 + Σ_j exp(γ_L − γ_j) k̂_j ⊗ u_j
            float eL = expf(gamma[L - 1]);
            for (int j = 0; j < L; j++) {
                gamma[j] = expf(gamma[L - 1] - gamma[j]);  // gamma now holds the per-row decay to the end
            }
            for (int a = 0; a < dk; a++) {
                float *row = S + (size_t)a * dv;
                for (int c = 0; c < dv; c++) {
                    row[c] *= eL;
                }
                for (int j = 0; j < L; j++) {
                    float w = KN(j)[a] * gamma[j];
                    const float *uj = u + (size_t)j * dv;
                    for (int c = 0; c < dv; c++) {
                        row[c] += w * uj[c];
                    }
                }
            }
#undef KN
#undef QN
        }
    }
    free(gamma), free(A), free(u), free(qs), free(qn), free(kn);
    return COLI_OK;
}

// ----------------------------------------------------------------------------
// Kimi Delta Attention: the recurrent form with a per-channel decay

int kda_recurrent(float *out, float *state, const float *q, const float *k, const float *v, const float *g,
                  const float *beta, int n, int heads, int d) {
    return recurrent(out, state, q, k, v, g, beta, n, heads, heads, d, d, 1);
}

// ----------------------------------------------------------------------------
// The whole token mixer (deltanet.h says what each step is)

int deltanet_block(float *out, const float *x, int n_seq, const int *seq_T, const DeltaNetBlock *b,
                   float *const *conv_state, float *const *state, int act) {
    if (n_seq < 1 || b == NULL || b->hk < 1 || b->hv < 1 || b->hv % b->hk || b->exact_batch < 0 || b->chunk < 1) {
        return COLI_EINVAL;
    }
    const int hk = b->hk, hv = b->hv, dk = b->dk, dv = b->dv;
    const int nk = hk * dk, nv = hv * dv, channels = 2 * nk + nv, hidden = b->in_qkv->cols;
    const QMatrix *ws[4] = {b->in_qkv, b->in_z, b->in_b, b->in_a};
    const int rows[4] = {channels, nv, hv, hv};
    for (int i = 0; i < 4; i++) {
        if (ws[i]->rows != rows[i] || ws[i]->cols != hidden) return COLI_EINVAL;
    }
    if (b->out_proj->rows != hidden || b->out_proj->cols != nv) return COLI_EINVAL;
    const int T = seq_rows(n_seq, seq_T);  // every sequence's rows, stacked
    if (T < 0) return COLI_EINVAL;
    if (T == 0) return COLI_OK;
    const size_t t = (size_t)T;
    // scratch: mixed, qkv [T, channels]; z, o [T, nv]; b, a, beta, g [T, hv]; q, k [T, nk]; v [T, nv]
    float *mixed = malloc(t * (2 * (size_t)channels + 3 * (size_t)nv + 4 * (size_t)hv + 2 * (size_t)nk) * sizeof(float));
    if (mixed == NULL) return COLI_ENOMEM;
    float *qkv = mixed + t * channels, *z = qkv + t * channels, *o = z + t * nv, *bb = o + t * nv, *aa = bb + t * hv;
    float *beta = aa + t * hv, *g = beta + t * hv, *q = g + t * hv, *k = q + t * nk, *v = k + t * nk;
    float *ys[4] = {mixed, z, bb, aa};
    int status = matmul_multi(ys, ws, 4, x, T, act);
    for (size_t s = 0, r = 0; s < (size_t)n_seq && status == COLI_OK; r += (size_t)seq_T[s], s++) {
        status = causal_conv1d(qkv + r * channels, conv_state[s], mixed + r * channels, b->conv, seq_T[s], channels,
                               b->conv_kernel, 1);
    }
    if (status == COLI_OK) {
        for (size_t i = 0; i < t; i++) {  // the rule's q, k, v: slices of each token's [q | k | v]
            const float *row = qkv + i * channels;
            memcpy(q + i * nk, row, (size_t)nk * sizeof(float));
            memcpy(k + i * nk, row + nk, (size_t)nk * sizeof(float));
            memcpy(v + i * nv, row + 2 * nk, (size_t)nv * sizeof(float));
            for (int h = 0; h < hv; h++) {
                size_t j = i * hv + h;
                float y = aa[j] + b->dt_bias[h];
                beta[j] = 1.0f / (1.0f + coli_expf(-bb[j]));
                g[j] = b->neg_a[h] * (y > 20.0f ? y : log1pf(coli_expf(y)));
            }
        }
    }
    for (size_t s = 0, r = 0; s < (size_t)n_seq && status == COLI_OK; r += (size_t)seq_T[s], s++) {
        // each sequence's rule over its own rows: chunked, the chunks from its first token (absolute
        // where the forward starts at a multiple of `chunk`), a last chunk of at most exact_batch
        // tokens recurrent: a forward cut at multiples of `chunk` gets the bits of one forward (the
        // prefix cache restores a state at such a cut)
        const int n = seq_T[s], tail = n % b->chunk, head = n <= b->exact_batch ? 0 : (tail <= b->exact_batch ? n - tail : n);
        float *os = o + r * nv, *qs = q + r * nk, *ks = k + r * nk, *vs = v + r * nv, *gs = g + r * hv, *bs = beta + r * hv;
        if (head > 0) status = gated_delta_rule_chunked(os, state[s], qs, ks, vs, gs, bs, head, hk, hv, dk, dv, b->chunk);
        if (status == COLI_OK && head < n) {
            const size_t h0 = (size_t)head;
            status = gated_delta_rule_recurrent(os + h0 * nv, state[s], qs + h0 * nk, ks + h0 * nk, vs + h0 * nv,
                                                gs + h0 * hv, bs + h0 * hv, n - head, hk, hv, dk, dv);
        }
    }
    if (status == COLI_OK) status = rms_norm(o, o, b->norm, T * hv, dv, b->eps);
    if (status == COLI_OK) {
        for (size_t i = 0; i < t * nv; i++) o[i] *= z[i] / (1.0f + coli_expf(-z[i]));
        status = matmul(out, b->out_proj, o, T, act);
    }
    free(mixed);
    return status;
}
