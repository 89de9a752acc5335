// layers.c — the small per-token layers in C, so a decode step does not pay NumPy's per-call
// overhead many times per layer: RMSNorm, rotate-half RoPE and causal GQA attention over a KV cache.
// Each has a NumPy reference in colibri_core/kernels/reference.py; results agree within float32
// rounding (RoPE exactly), and none depends on the thread count (each output row is one task) or on
// the SIMD path (attention's AVX2 loops keep the portable lane order).
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "impl/kernels_impl.h"

// Σ a[j] b[j] over 16 interleaved lanes and the fixed tree of matmul.c.
static float dot16(const float *a, const float *b, int n) {
    float L[16] = {0};
    int j0 = 0;
    for (; j0 + 16 <= n; j0 += 16) {
        for (int l = 0; l < 16; l++) L[l] += a[j0 + l] * b[j0 + l];
    }
    for (int l = 0; j0 + l < n; l++) L[l] += a[j0 + l] * b[j0 + l];
    for (int l = 0; l < 8; l++) L[l] += L[l + 8];
    for (int l = 0; l < 4; l++) L[l] += L[l + 4];
    for (int l = 0; l < 2; l++) L[l] += L[l + 2];
    return L[0] + L[1];
}

int rms_norm(float *out, const float *x, const float *weight, int n, int dim, float eps) {
    if (n < 0 || dim < 1) return COLI_EINVAL;
    for (size_t t = 0; t < (size_t)n; t++) {
        const float *xt = x + t * (size_t)dim;
        float *ot = out + t * (size_t)dim;
        float inv = 1.0f / sqrtf(dot16(xt, xt, dim) / (float)dim + eps);
        for (int j = 0; j < dim; j++) ot[j] = (xt[j] * inv) * weight[j];
    }
    return COLI_OK;
}

int softmax_topk(float *weights, int64_t *ids, const float *logits, int T, int E, int k, int renormalize) {
    if (T < 0 || E < 1 || k < 1 || k > E) return COLI_EINVAL;
    float *p = malloc((size_t)E * sizeof(float));
    char *taken = malloc((size_t)E);
    if (p == NULL || taken == NULL) {
        free(p);
        free(taken);
        return COLI_ENOMEM;
    }
    for (size_t t = 0; t < (size_t)T; t++) {
        const float *l = logits + t * (size_t)E;
        float m = l[0], sum = 0.0f;
        for (int e = 1; e < E; e++) m = l[e] > m ? l[e] : m;
        for (int e = 0; e < E; e++) sum += p[e] = expf(l[e] - m);
        for (int e = 0; e < E; e++) p[e] /= sum;
        memset(taken, 0, (size_t)E);
        float *w = weights + t * (size_t)k;
        int64_t *id = ids + t * (size_t)k;
        for (int r = 0; r < k; r++) {  // the largest not yet taken; ties to the lower index, NaN last
            int best = -1;
            for (int e = 0; e < E; e++) {
                if (!taken[e] && (best < 0 || p[e] > p[best] || (p[best] != p[best] && p[e] == p[e]))) best = e;
            }
            taken[best] = 1;
            id[r] = best;
            w[r] = p[best];
        }
        if (renormalize) {
            float total = 0.0f;
            for (int r = 0; r < k; r++) total += w[r];
            for (int r = 0; r < k; r++) w[r] /= total;
        }
    }
    free(p);
    free(taken);
    return COLI_OK;
}

int rope_rotate_half(float *out, const float *x, const float *cos, const float *sin, int T, int heads, int dim) {
    if (T < 0 || heads < 0 || dim < 0 || dim % 2) return COLI_EINVAL;
    int half = dim / 2;
    for (size_t t = 0; t < (size_t)T; t++) {
        const float *c = cos + t * (size_t)dim, *s = sin + t * (size_t)dim;
        for (size_t h = 0; h < (size_t)heads; h++) {
            const float *xh = x + (t * (size_t)heads + h) * (size_t)dim;
            float *oh = out + (t * (size_t)heads + h) * (size_t)dim;
            for (int i = 0; i < half; i++) oh[i] = xh[i] * c[i] + (-xh[i + half]) * s[i];
            for (int i = half; i < dim; i++) oh[i] = xh[i] * c[i] + xh[i - half] * s[i];
        }
    }
    return COLI_OK;
}

typedef struct {
    float *out;
    const float *q, *k, *v;
    int T, H, D, S, Hkv, start;
    float scale;
    int avx2;  // the SIMD path in use has AVX2 (any path but the portable one)
} AttnJob;

#if COLI_X86
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2")))

// dot16 with the 16 lanes in two 8-float registers: the same operations, the same bits.
AVX2 static float dot16_avx2(const float *a, const float *b, int n) {
    __m256 A = _mm256_setzero_ps(), B = _mm256_setzero_ps();
    int j0 = 0;
    for (; j0 + 16 <= n; j0 += 16) {
        A = _mm256_add_ps(A, _mm256_mul_ps(_mm256_loadu_ps(a + j0), _mm256_loadu_ps(b + j0)));
        B = _mm256_add_ps(B, _mm256_mul_ps(_mm256_loadu_ps(a + j0 + 8), _mm256_loadu_ps(b + j0 + 8)));
    }
    float L[16];
    _mm256_storeu_ps(L, A);
    _mm256_storeu_ps(L + 8, B);
    for (int l = 0; j0 + l < n; l++) L[l] += a[j0 + l] * b[j0 + l];
    for (int l = 0; l < 8; l++) L[l] += L[l + 8];
    for (int l = 0; l < 4; l++) L[l] += L[l + 4];
    for (int l = 0; l < 2; l++) L[l] += L[l + 2];
    return L[0] + L[1];
}

// out[d] += p[s] * v_s[d] for s in order, 8 columns per register: the same per-element operations.
AVX2 static void weighted_sum_avx2(float *out, const float *p, const float *v, size_t row, int len, int D) {
    int d0 = 0;
    for (; d0 + 32 <= D; d0 += 32) {
        __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
        for (int s = 0; s < len; s++) {
            const float *vs = v + (size_t)s * row + d0;
            __m256 ps = _mm256_set1_ps(p[s]);
            o0 = _mm256_add_ps(o0, _mm256_mul_ps(ps, _mm256_loadu_ps(vs)));
            o1 = _mm256_add_ps(o1, _mm256_mul_ps(ps, _mm256_loadu_ps(vs + 8)));
            o2 = _mm256_add_ps(o2, _mm256_mul_ps(ps, _mm256_loadu_ps(vs + 16)));
            o3 = _mm256_add_ps(o3, _mm256_mul_ps(ps, _mm256_loadu_ps(vs + 24)));
        }
        _mm256_storeu_ps(out + d0, o0);
        _mm256_storeu_ps(out + d0 + 8, o1);
        _mm256_storeu_ps(out + d0 + 16, o2);
        _mm256_storeu_ps(out + d0 + 24, o3);
    }
    for (int d = d0; d < D; d++) out[d] = 0.0f;
    for (int s = 0; s < len; s++) {
        for (int d = d0; d < D; d++) out[d] += p[s] * v[(size_t)s * row + d];
    }
}
#endif

static void weighted_sum(float *out, const float *p, const float *v, size_t row, int len, int D) {
    for (int d = 0; d < D; d++) out[d] = 0.0f;
    for (int s = 0; s < len; s++) {
        const float *vs = v + (size_t)s * row;
        for (int d = 0; d < D; d++) out[d] += p[s] * vs[d];
    }
}

static void attn_task(void *ctx, int task) {
    const AttnJob *j = ctx;
    int t = task / j->H, h = task % j->H, kvh = h / (j->H / j->Hkv);
    int len = j->start + t + 1;  // causal: keys 0 .. start + t
    const float *q = j->q + ((size_t)t * j->H + h) * (size_t)j->D;
    float *out = j->out + ((size_t)t * j->H + h) * (size_t)j->D;
    float stack[1024];
    float *p = len <= 1024 ? stack : malloc((size_t)len * sizeof(float));
    if (p == NULL) {  // no memory for the scores: the row is NaN rather than wrong
        for (int d = 0; d < j->D; d++) out[d] = NAN;
        return;
    }
    size_t row = (size_t)j->Hkv * (size_t)j->D;  // floats per cached token
    const float *k = j->k + (size_t)kvh * j->D, *v = j->v + (size_t)kvh * j->D;
    float m = -INFINITY;
    for (int s = 0; s < len; s++) {
#if COLI_X86
        p[s] = (j->avx2 ? dot16_avx2(q, k + (size_t)s * row, j->D) : dot16(q, k + (size_t)s * row, j->D)) * j->scale;
#else
        p[s] = dot16(q, k + (size_t)s * row, j->D) * j->scale;
#endif
        if (p[s] > m) m = p[s];
    }
    float sum = 0.0f;
    for (int s = 0; s < len; s++) {
        p[s] = expf(p[s] - m);
        sum += p[s];
    }
    for (int s = 0; s < len; s++) p[s] = p[s] / sum;
#if COLI_X86
    if (j->avx2) {
        weighted_sum_avx2(out, p, v, row, len, j->D);
    } else {
        weighted_sum(out, p, v, row, len, j->D);
    }
#else
    weighted_sum(out, p, v, row, len, j->D);
#endif
    if (p != stack) free(p);
}

int attention(float *out, const float *q, int T, int H, int D, const float *k, const float *v, int S, int Hkv,
              int start, float scale) {
    if (T < 0 || H < 1 || D < 1 || Hkv < 1 || H % Hkv || start < 0 || start + T > S) return COLI_EINVAL;
    AttnJob j = {out, q, k, v, T, H, D, S, Hkv, start, scale, path_current() != &PATH_PORTABLE};
    int tasks = T * H;
    if ((double)tasks * (start + T) * D < 65536.0 || threads_get() <= 1) {
        for (int i = 0; i < tasks; i++) attn_task(&j, i);
    } else {
        pool_run(attn_task, &j, tasks);
    }
    return COLI_OK;
}
