// layers.c — the small per-token layers in C, so a decode step does not pay NumPy's per-call
// overhead many times per layer: RMSNorm, rotate-half RoPE and causal GQA attention over a KV cache
// (float32, or float16: each element widened exactly as it is read, so attention over a float16
// cache gives the bits of the float32 code over the same values). Each has a NumPy reference in
// colibri_core/kernels/reference.py; results agree within float32 rounding (RoPE exactly), and none
// depends on the thread count (each output row is one task) or on the SIMD path (attention's AVX2
// loops keep the portable lane order).
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

// ----------------------------------------------------------------------------
// coli_expf (kernels_impl.h says why): the scalar steps here, exp8_avx2 below the same in 8 lanes.

#define EXP_HI 88.72283935546875f  // above: +inf (e^x > FLT_MAX)
#define EXP_LO -104.0f             // below: 0 (e^x < half the smallest subnormal)
#define EXP_LOG2E 1.44269504088896341f
#define EXP_ROUND 12582912.0f      // 1.5 · 2^23: (t + it) − it rounds t to an integer, ties to even
#define EXP_LN2_HI 0.693359375f    // ln 2 = EXP_LN2_HI + EXP_LN2_LO; n · EXP_LN2_HI is exact
#define EXP_LN2_LO -2.12194440e-4f
static const float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                  4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

float coli_expf(float x) {
    if (x != x) return x;
    if (x > EXP_HI) return INFINITY;
    if (x < EXP_LO) return 0.0f;
    float n = (x * EXP_LOG2E + EXP_ROUND) - EXP_ROUND;  // -150 .. 128
    float r = (x - n * EXP_LN2_HI) - n * EXP_LN2_LO;    // |r| <= ln2 / 2
    float p = EXP_POLY[0];
    for (int i = 1; i < 6; i++) p = p * r + EXP_POLY[i];
    float y = (p * (r * r) + r) + 1.0f;                 // e^r
    int k = (int)n, k1 = k >> 1;  // 2^k = 2^k1 · 2^(k − k1), both normal (e8m0_pow2(e + 127, 0) = 2^e)
    return (y * e8m0_pow2((uint8_t)(k1 + 127), 0)) * e8m0_pow2((uint8_t)(k - k1 + 127), 0);
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

// rope_rotate_half on the leading `rot` dims of each head of `dim` (cos, sin: [T, rot]); the other
// dims copied: a partial RoPE, each element the bits of rotating those dims alone.
static void rope_leading(float *out, const float *x, const float *cos, const float *sin, int T, int heads, int dim,
                         int rot) {
    int half = rot / 2;
    for (size_t t = 0; t < (size_t)T; t++) {
        const float *c = cos + t * (size_t)rot, *s = sin + t * (size_t)rot;
        for (size_t h = 0; h < (size_t)heads; h++) {
            const float *xh = x + (t * (size_t)heads + h) * (size_t)dim;
            float *oh = out + (t * (size_t)heads + h) * (size_t)dim;
            for (int i = 0; i < half; i++) oh[i] = xh[i] * c[i] + (-xh[i + half]) * s[i];
            for (int i = half; i < rot; i++) oh[i] = xh[i] * c[i] + xh[i - half] * s[i];
            for (int i = rot; i < dim; i++) oh[i] = xh[i];
        }
    }
}

int rope_rotate_half(float *out, const float *x, const float *cos, const float *sin, int T, int heads, int dim) {
    if (T < 0 || heads < 0 || dim < 0 || dim % 2) return COLI_EINVAL;
    rope_leading(out, x, cos, sin, T, heads, dim, dim);
    return COLI_OK;
}

// Attention reads the cache token by token: a task takes a block of heads and, for each cached
// token, that block's slice of the token's keys (then values), which lie side by side — a stream,
// where one head at a time would jump a whole cached row per token. Per (head, token) the score is
// dot16 (one fixed order), and each output element sums p[s] * v[s] over s in order from 0.0f, so
// the block size and the thread count never change a bit.
typedef struct {
    float *out;
    const float *q;
    const void *k, *v;  // [S, Hkv, D]: float32, or float16 (kv16)
    int T, H, D, S, Hkv, start;
    float scale;
    int window;           // a token sees the last `window` rows up to its own (0: every row before it)
    const float *sinks;   // [H] each head's sink logit in its softmax's denominator (NULL: none)
    int heads;  // heads per task (a block)
    int avx2;   // the SIMD path in use has AVX2 and F16C (any path but the portable one)
    int avx512; // the SIMD path in use is the AVX-512 one
    int kv16;   // the cache holds float16 (KV_F16): rows are widened to float32 (exactly) as they are read
} AttnJob;

static void f16_rows_to_f32(float *out, const uint16_t *h, size_t n, int simd);

// Element `at` of the cache `base` (float32 or float16).
static inline const void *kv_at(const AttnJob *j, const void *base, size_t at) {
    return (const char *)base + at * (j->kv16 ? 2 : 4);
}

// n elements of the cache `base` from element `at` as float32: a pointer into it, or (float16) `buf`
// filled with them widened (exact, so every later operation is the float32 cache's).
static const float *kv_floats(const AttnJob *j, const void *base, size_t at, size_t n, float *buf) {
    if (!j->kv16) return (const float *)base + at;
    f16_rows_to_f32(buf, (const uint16_t *)base + at, n, j->avx2);
    return buf;
}

// Ask for the cache's n elements from element `at` ahead of their use, into L2: asked into L1, the
// requests held L1's few miss buffers, and the loads behind them waited (decode attention from
// memory, the two builds in fresh processes alternated: 0.62-0.67x the time at 2000 cached tokens
// for OLMoE's heads, 0.68-0.85x at 100, 0.75-0.83x for Qwen3's 32 over 4; BENCHMARKS.md). The
// matrix kernels' row streams are not helped so (asked into L2 there: 1.0-1.1x the time).
static inline void prefetch_kv(const AttnJob *j, const void *base, size_t at, size_t n) {
    const char *p = kv_at(j, base, at);
    for (size_t i = 0; i < n * (j->kv16 ? 2 : 4); i += 64) __builtin_prefetch(p + i, 0, 1);
}

#if COLI_X86
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,f16c")))

// dot16's tree over 16 lanes held in two registers: lane l + l+8, then l+4, l+2, l+1.
AVX2 static inline float tree16_avx2(__m256 A, __m256 B) {
    __m256 s8 = _mm256_add_ps(A, B);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// dot16 with the 16 lanes in two 8-float registers: the same operations, the same bits.
AVX2 static float dot16_avx2(const float *a, const float *b, int n) {
    __m256 A = _mm256_setzero_ps(), B = _mm256_setzero_ps();
    int j0 = 0;
    for (; j0 + 16 <= n; j0 += 16) {
        A = _mm256_add_ps(A, _mm256_mul_ps(_mm256_loadu_ps(a + j0), _mm256_loadu_ps(b + j0)));
        B = _mm256_add_ps(B, _mm256_mul_ps(_mm256_loadu_ps(a + j0 + 8), _mm256_loadu_ps(b + j0 + 8)));
    }
    if (j0 == n) return tree16_avx2(A, B);  // no tail: the tree in registers
    float L[16];
    _mm256_storeu_ps(L, A);
    _mm256_storeu_ps(L + 8, B);
    for (int l = 0; j0 + l < n; l++) L[l] += a[j0 + l] * b[j0 + l];
    for (int l = 0; l < 8; l++) L[l] += L[l + 8];
    for (int l = 0; l < 4; l++) L[l] += L[l + 4];
    for (int l = 0; l < 2; l++) L[l] += L[l + 2];
    return L[0] + L[1];
}

// 8 cached elements from element i of row p as float32: loaded, or float16 widened (exactly).
AVX2 static inline __m256 kv8(const void *p, size_t i, int f16) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
               : _mm256_loadu_ps((const float *)p + i);
}

// dot16_avx2 of 4 heads' queries (q: 4 rows of D floats) with their keys k[0..3] (float32, or
// float16 when f16), D a multiple of 16: each head's operations as there, the 4 heads' chains side
// by side (one head's chain alone waits on the adder's latency).
AVX2 static void dot16x4_avx2(const float *q, const void *const *k, int D, float *out, int f16) {
    __m256 A[4], B[4];
#pragma GCC unroll 4
    for (int m = 0; m < 4; m++) A[m] = B[m] = _mm256_setzero_ps();
    int j0 = 0;
    do {  // D >= 16: a loop that runs at least once keeps A and B in registers (no stack copy)
#pragma GCC unroll 4
        for (int m = 0; m < 4; m++) {
            const float *a = q + (size_t)m * D + j0;
            A[m] = _mm256_add_ps(A[m], _mm256_mul_ps(_mm256_loadu_ps(a), kv8(k[m], (size_t)j0, f16)));
            B[m] = _mm256_add_ps(B[m], _mm256_mul_ps(_mm256_loadu_ps(a + 8), kv8(k[m], (size_t)j0 + 8, f16)));
        }
        j0 += 16;
    } while (j0 < D);
    for (int m = 0; m < 4; m++) out[m] = tree16_avx2(A[m], B[m]);
}

// dot16x4_avx2 for 4 queries against one key (4 heads of one kv head, GQA, q_stride D; or one
// head of 4 new tokens, q_stride H·D): each key vector loaded once for the 4 of them.
AVX2 static void dot16x4_shared_avx2(const float *q, size_t q_stride, const void *k, int D, float *out, int f16) {
    __m256 A[4], B[4];
#pragma GCC unroll 4
    for (int m = 0; m < 4; m++) A[m] = B[m] = _mm256_setzero_ps();
    int j0 = 0;
    do {  // D >= 16, as in dot16x4_avx2
        __m256 k0 = kv8(k, (size_t)j0, f16), k1 = kv8(k, (size_t)j0 + 8, f16);
#pragma GCC unroll 4
        for (int m = 0; m < 4; m++) {
            const float *a = q + (size_t)m * q_stride + j0;
            A[m] = _mm256_add_ps(A[m], _mm256_mul_ps(_mm256_loadu_ps(a), k0));
            B[m] = _mm256_add_ps(B[m], _mm256_mul_ps(_mm256_loadu_ps(a + 8), k1));
        }
        j0 += 16;
    } while (j0 < D);
    for (int m = 0; m < 4; m++) out[m] = tree16_avx2(A[m], B[m]);
}

// out[0..64) += p[s] * v_s[0..64) for s = s0 .. s1-1 in turn (v_s: element s * row of v, float32 or
// float16), in registers: per element the additions of axpy_avx2, token after token, without a
// store and a load between.
AVX2 static void axpy64_tokens_avx2(float *out, const float *p, const void *v, size_t row, int s0, int s1, int f16) {
    __m256 acc[8];
    for (int c = 0; c < 8; c++) acc[c] = _mm256_loadu_ps(out + 8 * c);
    for (int s = s0; s < s1; s++) {
        __m256 ps = _mm256_set1_ps(p[s]);
        for (int c = 0; c < 8; c++) acc[c] = _mm256_add_ps(acc[c], _mm256_mul_ps(ps, kv8(v, (size_t)s * row + 8 * c, f16)));
    }
    for (int c = 0; c < 8; c++) _mm256_storeu_ps(out + 8 * c, acc[c]);
}

// out[d] += p * v[d], 8 columns per register: the same per-element operations.
AVX2 static void axpy_avx2(float *out, float p, const float *v, int D) {
    __m256 ps = _mm256_set1_ps(p);
    int d = 0;
    for (; d + 8 <= D; d += 8) {
        _mm256_storeu_ps(out + d, _mm256_add_ps(_mm256_loadu_ps(out + d), _mm256_mul_ps(ps, _mm256_loadu_ps(v + d))));
    }
    for (; d < D; d++) out[d] += p * v[d];
}

// coli_expf in 8 lanes: the same operations on x clamped to [EXP_LO, EXP_HI] (in range, x itself),
// then the scalar version's results outside it.
AVX2 static inline __m256 exp8_avx2(__m256 x) {
    const __m256 hi = _mm256_set1_ps(EXP_HI), lo = _mm256_set1_ps(EXP_LO), round = _mm256_set1_ps(EXP_ROUND);
    __m256 xc = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(xc, _mm256_set1_ps(EXP_LOG2E)), round), round);
    __m256 r = _mm256_sub_ps(_mm256_sub_ps(xc, _mm256_mul_ps(n, _mm256_set1_ps(EXP_LN2_HI))),
                             _mm256_mul_ps(n, _mm256_set1_ps(EXP_LN2_LO)));
    __m256 p = _mm256_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 6; i++) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(EXP_POLY[i]));
    __m256 y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
    const __m256i bias = _mm256_set1_epi32(127);
    __m256i k = _mm256_cvtps_epi32(n), k1 = _mm256_srai_epi32(k, 1), k2 = _mm256_sub_epi32(k, k1);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, bias), 23));
    __m256 e = _mm256_mul_ps(_mm256_mul_ps(y, s1), s2);
    e = _mm256_blendv_ps(e, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
    e = _mm256_blendv_ps(e, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
    return _mm256_blendv_ps(e, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

AVX2 static int exp_shifted_avx2(float *p, int n, float m) {
    __m256 mv = _mm256_set1_ps(m);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(p + i, exp8_avx2(_mm256_sub_ps(_mm256_loadu_ps(p + i), mv)));
    return i;
}

// swiglu_rows in 8 lanes: a compare and a blend where the scalar code compares and assigns, so NaN
// stays NaN as there.
AVX2 static int swiglu_rows_avx2(float *h, const float *g, const float *u, int n, float limit) {
    const __m256 L = _mm256_set1_ps(limit), nL = _mm256_set1_ps(-limit), one = _mm256_set1_ps(1.0f);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i), uv = _mm256_loadu_ps(u + i);
        gv = _mm256_blendv_ps(gv, L, _mm256_cmp_ps(gv, L, _CMP_GT_OQ));
        uv = _mm256_blendv_ps(uv, L, _mm256_cmp_ps(uv, L, _CMP_GT_OQ));
        uv = _mm256_blendv_ps(uv, nL, _mm256_cmp_ps(uv, nL, _CMP_LT_OQ));
        __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, exp8_avx2(_mm256_xor_ps(gv, sign))));
        _mm256_storeu_ps(h + i, _mm256_mul_ps(silu, uv));
    }
    return i;
}
#endif

#if COLI_X86
AVX2 static size_t f16_to_f32_avx2(float *out, const uint16_t *h, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    return i;
}

AVX2 static size_t f32_to_f16_avx2(uint16_t *out, const float *x, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    return i;
}
#endif

// float16 -> float32, exactly (F16C's vcvtph2ps, or f16_to_f32).
static void f16_rows_to_f32(float *out, const uint16_t *h, size_t n, int simd) {
    size_t i = 0;
#if COLI_X86
    if (simd) i = f16_to_f32_avx2(out, h, n);
#else
    (void)simd;
#endif
    for (; i < n; i++) out[i] = f16_to_f32(h[i]);
}

// float32 -> float16, rounded to nearest, ties to even (as vcvtps2ph with imm 0, and NumPy's astype):
// beyond 65504 rounds to infinity, below 2^-14 to a subnormal or zero; a NaN stays a NaN, quiet.
static uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u | (uint16_t)((a >> 13) & 0x3ffu);  // NaN
    if (a >= 0x477ff000u) return sign | 0x7c00u;  // inf, or rounds to it (>= 65520)
    if (a >= 0x38800000u) return sign | (uint16_t)((a + 0xfffu + ((a >> 13) & 1u) - 0x38000000u) >> 13);
    int e = (int)(a >> 23);  // a subnormal float16 (or zero): round(f * 2^24)
    if (e < 102) return sign;  // below 2^-25: rounds to zero
    uint32_t m = (a & 0x7fffffu) | 0x800000u, shift = (uint32_t)(126 - e), q = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return sign | (uint16_t)q;
}

int f16_from_f32(uint16_t *out, const float *x, size_t n) {
    size_t i = 0;
#if COLI_X86
    if (path_current() != &PATH_PORTABLE) i = f32_to_f16_avx2(out, x, n);
#endif
    for (; i < n; i++) out[i] = f32_to_f16(x[i]);
    return COLI_OK;
}

void exp_shifted(float *p, int n, float m, int simd) {
    int i = 0;
#if COLI_X86
    if (simd) i = exp_shifted_avx2(p, n, m);
#else
    (void)simd;
#endif
    for (; i < n; i++) p[i] = coli_expf(p[i] - m);
}

int exp_f32(float *out, const float *x, int n) {
    if (n < 0) return COLI_EINVAL;
    memcpy(out, x, (size_t)n * sizeof(float));
    exp_shifted(out, n, 0.0f, path_current() != &PATH_PORTABLE);  // x − 0 = x, −0 included
    return COLI_OK;
}

int sigmoid_f32(float *out, const float *x, int n) {
    if (n < 0) return COLI_EINVAL;
    for (int i = 0; i < n; i++) out[i] = 1.0f / (1.0f + coli_expf(-x[i]));
    return COLI_OK;
}

void swiglu_rows(float *h, const float *g, const float *u, int n, float limit, int simd) {
    int i = 0;
#if COLI_X86
    if (simd) i = swiglu_rows_avx2(h, g, u, n, limit);
#else
    (void)simd;
#endif
    for (; i < n; i++) {
        float gi = g[i], ui = u[i];
        if (gi > limit) gi = limit;
        if (ui > limit) ui = limit;
        if (ui < -limit) ui = -limit;
        h[i] = gi / (1.0f + coli_expf(-gi)) * ui;
    }
}

// Cached rows are asked for AHEAD tokens before their use (the cache is read row by row); decode
// takes the values VBLOCK tokens at a time.
enum { AHEAD = 4, VBLOCK = 16 };

static void axpy(float *out, float p, const float *v, int D) {
    for (int d = 0; d < D; d++) out[d] += p * v[d];
}

// The first cached row token row `r` (its own) sees: r − window + 1 with a window, else 0.
static inline int first_seen(const AttnJob *j, int r) {
    return j->window > 0 && r - j->window + 1 > 0 ? r - j->window + 1 : 0;
}

// Head h's sink (NULL: none).
static inline const float *sink_of(const AttnJob *j, int h) {
    return j->sinks == NULL ? NULL : j->sinks + h;
}

// p[i][0..len[i]) = softmax(p[i]), in place, for each of n rows; with a sink logit sink[i] (NULL:
// none) joining row i's softmax, taking its share of the mass without a value (GPT-OSS): the maximum
// over the scores and the sink, e^(sink − m) added to the denominator after the scores' sum. Each
// row's steps are those of one row alone, in its order; the rows' maxima and sums — in one row a
// chain of compares or adds, each waiting for the last — run as n chains side by side over the
// columns the rows share, then each row's own tail. (144 new tokens after 3,072 cached, OLMoE's 16
// heads, Intel AVX-512: the softmax's share of the attention's samples (perf) 9.6 -> 5.2 %.)
enum { SOFTMAX_ROWS = 16 };
static void softmax_rows(float *const *p, const int *len, int n, int avx2, const float *const *sink) {
    for (int i0 = 0; i0 < n; i0 += SOFTMAX_ROWS) {
        int nr = n - i0 < SOFTMAX_ROWS ? n - i0 : SOFTMAX_ROWS, common = len[i0];
        float m[SOFTMAX_ROWS], sum[SOFTMAX_ROWS];
        float *const *r = p + i0;
        for (int i = 0; i < nr; i++) m[i] = -INFINITY, sum[i] = 0.0f, common = len[i0 + i] < common ? len[i0 + i] : common;
        for (int s = 0; s < common; s++)
            for (int i = 0; i < nr; i++) m[i] = r[i][s] > m[i] ? r[i][s] : m[i];
        for (int i = 0; i < nr; i++) {
            for (int s = common; s < len[i0 + i]; s++) m[i] = r[i][s] > m[i] ? r[i][s] : m[i];
            if (sink[i0 + i] != NULL && *sink[i0 + i] > m[i]) m[i] = *sink[i0 + i];
            exp_shifted(r[i], len[i0 + i], m[i], avx2);
        }
        for (int s = 0; s < common; s++)
            for (int i = 0; i < nr; i++) sum[i] += r[i][s];
        for (int i = 0; i < nr; i++) {
            for (int s = common; s < len[i0 + i]; s++) sum[i] += r[i][s];
            if (sink[i0 + i] != NULL) sum[i] += coli_expf(*sink[i0 + i] - m[i]);
            for (int s = 0; s < len[i0 + i]; s++) r[i][s] = r[i][s] / sum[i];
        }
    }
}

// Softmax over the len scores of each of heads h0 .. h0+nh-1 (rows of p, in place), then their
// outputs out [nh, D] = Σ_s p_s v_s in token order.
static void attn_values(const AttnJob *j, float *p, int len, int h0, int nh, float *out, float *conv) {
    int group = j->H / j->Hkv, D = j->D;
    size_t row = (size_t)j->Hkv * (size_t)D;  // elements per cached token
    int kv0 = h0 / group;
    size_t span = (size_t)((h0 + nh - 1) / group - kv0 + 1) * (size_t)D;  // elements of a token these heads read
    for (int i0 = 0; i0 < nh; i0 += SOFTMAX_ROWS) {  // per head
        float *rows[SOFTMAX_ROWS];
        int lens[SOFTMAX_ROWS], nr = nh - i0 < SOFTMAX_ROWS ? nh - i0 : SOFTMAX_ROWS;
        const float *sinks[SOFTMAX_ROWS];
        for (int i = 0; i < nr; i++) rows[i] = p + (size_t)(i0 + i) * len, lens[i] = len, sinks[i] = sink_of(j, h0 + i0 + i);
        softmax_rows(rows, lens, nr, j->avx2, sinks);
    }
    for (size_t i = 0; i < (size_t)nh * (size_t)D; i++) out[i] = 0.0f;
#if COLI_X86
    // Blocks of tokens, each head's output held in registers over a block (not stored and loaded
    // back per token), with the scores 4 heads at a time above: decode attention alternated call by
    // call with the previous loops (BENCHMARKS.md) 12.5 -> 13.7 GB/s at 100 cached tokens and 14.5
    // -> 16.1 at 2000 for OLMoE's 16 heads, 6.9 -> 8.1 at 8000 for Qwen3's 32 over 4 kv heads.
    if (j->avx2 && D % 64 == 0) {
        for (int s0 = 0; s0 < len; s0 += VBLOCK) {
            int s1 = s0 + VBLOCK < len ? s0 + VBLOCK : len;
            for (int s = s1; s < s1 + VBLOCK && s < len; s++) prefetch_kv(j, j->v, (size_t)s * row + (size_t)kv0 * D, span);
            for (int i = 0; i < nh; i++) {
                size_t at = (size_t)s0 * row + (size_t)((h0 + i) / group) * D;  // token s0, head i's kv head
                for (int d0 = 0; d0 < D; d0 += 64)
                    axpy64_tokens_avx2(out + (size_t)i * D + d0, p + (size_t)i * len + s0, kv_at(j, j->v, at + d0), row, 0,
                                       s1 - s0, j->kv16);
            }
        }
        return;
    }
#endif
    for (int s = 0; s < len; s++) {
        const float *vs = kv_floats(j, j->v, (size_t)s * row + (size_t)kv0 * D, span, conv);  // heads kv0 ..
        if (s + AHEAD < len) prefetch_kv(j, j->v, (size_t)(s + AHEAD) * row + (size_t)kv0 * D, span);
        for (int i = 0; i < nh; i++) {
            const float *vh = vs + (size_t)((h0 + i) / group - kv0) * D;
#if COLI_X86
            if (j->avx2) {
                axpy_avx2(out + (size_t)i * D, p[(size_t)i * len + s], vh, D);
                continue;
            }
#endif
            axpy(out + (size_t)i * D, p[(size_t)i * len + s], vh, D);
        }
    }
}

// One task per (new token, block of heads): its scores, then attn_values. A window starts the cache
// at the token's first row seen (the job's k, v moved there), so the loops below run as without one.
static void attn_task(void *ctx, int task) {
    AttnJob seen = *(const AttnJob *)ctx;
    const AttnJob *j = &seen;
    int blocks = (j->H + j->heads - 1) / j->heads;
    int t = task / blocks, h0 = (task % blocks) * j->heads;
    int nh = j->H - h0 < j->heads ? j->H - h0 : j->heads, group = j->H / j->Hkv, D = j->D;
    int lo = first_seen(j, j->start + t);  // causal: keys lo .. start + t
    int len = j->start + t + 1 - lo;
    seen.k = kv_at(j, j->k, (size_t)lo * j->Hkv * D);
    seen.v = kv_at(j, j->v, (size_t)lo * j->Hkv * D);
    const float *q = j->q + ((size_t)t * j->H + h0) * (size_t)D;  // [nh, D]
    float *out = j->out + ((size_t)t * j->H + h0) * (size_t)D;      // [nh, D]
    float stack[2048];
    size_t need = (size_t)nh * (size_t)len;
    float *p = need <= 2048 ? stack : malloc(need * sizeof(float));  // [nh, len] scores
    if (p == NULL) {  // no memory for the scores: the rows are NaN rather than wrong
        for (size_t i = 0; i < (size_t)nh * (size_t)D; i++) out[i] = NAN;
        return;
    }
    size_t row = (size_t)j->Hkv * (size_t)D;  // elements per cached token
    int kv0 = h0 / group;
    size_t span = (size_t)((h0 + nh - 1) / group - kv0 + 1) * (size_t)D;  // elements of a token this block reads
    float *conv = NULL;  // a float16 cache's span of a token widened, where the loops below read floats
    if (j->kv16 && (conv = malloc(span * sizeof(float))) == NULL) {
        for (size_t i = 0; i < (size_t)nh * (size_t)D; i++) out[i] = NAN;
        if (p != stack) free(p);
        return;
    }
    for (int s = 0; s < len; s++) {
        size_t at = (size_t)s * row + (size_t)kv0 * D;  // token s, kv head kv0
        if (s + AHEAD < len) prefetch_kv(j, j->k, at + AHEAD * row, span);
        int i = 0;
#if COLI_X86
        if (j->avx2 && D % 16 == 0) {
            for (; i + 4 <= nh; i += 4) {  // 4 heads at a time, straight from the cache
                const void *kh[4];
                float dots[4];
                for (int m = 0; m < 4; m++) kh[m] = kv_at(j, j->k, at + (size_t)((h0 + i + m) / group - kv0) * D);
                if (kh[0] == kh[3]) dot16x4_shared_avx2(q + (size_t)i * D, (size_t)D, kh[0], D, dots, j->kv16);
                else dot16x4_avx2(q + (size_t)i * D, kh, D, dots, j->kv16);
                for (int m = 0; m < 4; m++) p[(size_t)(i + m) * len + s] = dots[m] * j->scale;
            }
        }
#endif
        const float *ks = i < nh ? kv_floats(j, j->k, at, span, conv) : NULL;  // the other heads: as floats
        for (; i < nh; i++) {
            const float *kh = ks + (size_t)((h0 + i) / group - kv0) * D;
#if COLI_X86
            float dot = j->avx2 ? dot16_avx2(q + (size_t)i * D, kh, D) : dot16(q + (size_t)i * D, kh, D);
#else
            float dot = dot16(q + (size_t)i * D, kh, D);
#endif
            p[(size_t)i * len + s] = dot * j->scale;
        }
    }
    attn_values(j, p, len, h0, nh, out, conv);
    free(conv);
    if (p != stack) free(p);
}

#if COLI_X86
// out_i[0..16) += p_i[s] * v_s[0..16) for s = s0 .. s1-1 in turn, for 4 queries i at once (each v
// loaded once for the 4): per element the additions of axpy64_tokens_avx2, token after token.
AVX2 static void axpy16x4_tokens_avx2(float *const *out, const float *const *p, const float *v, size_t row, int s0,
                                      int s1) {
    __m256 acc[4][2];
    for (int i = 0; i < 4; i++) acc[i][0] = _mm256_loadu_ps(out[i]), acc[i][1] = _mm256_loadu_ps(out[i] + 8);
    for (int s = s0; s < s1; s++) {
        const float *vs = v + (size_t)s * row;
        __m256 v0 = _mm256_loadu_ps(vs), v1 = _mm256_loadu_ps(vs + 8);
        for (int i = 0; i < 4; i++) {
            __m256 ps = _mm256_set1_ps(p[i][s]);
            acc[i][0] = _mm256_add_ps(acc[i][0], _mm256_mul_ps(ps, v0));
            acc[i][1] = _mm256_add_ps(acc[i][1], _mm256_mul_ps(ps, v1));
        }
    }
    for (int i = 0; i < 4; i++) _mm256_storeu_ps(out[i], acc[i][0]), _mm256_storeu_ps(out[i] + 8, acc[i][1]);
}

// One query of axpy16x4_tokens_avx2.
AVX2 static void axpy16_tokens_avx2(float *out, const float *p, const float *v, size_t row, int s0, int s1) {
    __m256 a0 = _mm256_loadu_ps(out), a1 = _mm256_loadu_ps(out + 8);
    for (int s = s0; s < s1; s++) {
        __m256 ps = _mm256_set1_ps(p[s]);
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(ps, _mm256_loadu_ps(v + (size_t)s * row)));
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(ps, _mm256_loadu_ps(v + (size_t)s * row + 8)));
    }
    _mm256_storeu_ps(out, a0), _mm256_storeu_ps(out + 8, a1);
}

// The block attention's loops in 512-bit registers (the AVX-512 path): a register's 16 lanes are the
// two 8-lane registers of the AVX2 loops above side by side, with the same multiplies and adds
// per lane (-ffp-contract=off: no fused multiply-add), so the same bits in half the instructions.
#define AVX512 __attribute__((target("avx2,f16c,avx512f")))

// tree16_avx2 of the two halves of each of 8 registers at once, each add taking the lanes of 2, 4 or
// 8 of them (the same lane pairs in the same order, so the same sums): out[m] = tree(A[m]) · scale.
AVX512 static inline void tree16x8_512(const __m512 *A, float scale, float *out) {
    __m512 R[4], Q[2];  // R[i]: the 8-lane sums (l + l+8) of A[2i] and A[2i+1], side by side
    for (int i = 0; i < 4; i++)
        R[i] = _mm512_add_ps(_mm512_shuffle_f32x4(A[2 * i], A[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(A[2 * i], A[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++)  // Q[i]: the 4-lane sums (l + l+4) of A[4i] .. A[4i+3], a 128-bit block each
        Q[i] = _mm512_add_ps(_mm512_shuffle_f32x4(R[2 * i], R[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(R[2 * i], R[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    // block b: the 2-lane sums (l + l+2) of A[b], then of A[4 + b]
    __m512 P = _mm512_add_ps(_mm512_shuffle_ps(Q[0], Q[1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(Q[0], Q[1], _MM_SHUFFLE(3, 2, 3, 2)));
    // block b, lanes 0 and 1: the whole sums (l + l+1) of A[b] and A[4 + b]
    __m512 S = _mm512_mul_ps(_mm512_add_ps(_mm512_shuffle_ps(P, P, _MM_SHUFFLE(2, 0, 2, 0)),
                                           _mm512_shuffle_ps(P, P, _MM_SHUFFLE(3, 1, 3, 1))), _mm512_set1_ps(scale));
    float L[16];
    _mm512_storeu_ps(L, S);
    for (int b = 0; b < 4; b++) out[b] = L[4 * b], out[4 + b] = L[4 * b + 1];
}

// dot16x4_shared_avx2 for 8 queries (rows of q, D apart) against one float32 key, each key vector
// loaded once for the 8, times scale: out[m] = (q_m · k) · scale.
AVX512 static inline void dot16x8_shared_512(const float *q, const float *k, int D, float scale, float *out) {
    __m512 A[8];
#pragma GCC unroll 8
    for (int m = 0; m < 8; m++) A[m] = _mm512_setzero_ps();
    int j0 = 0;
    do {  // D >= 16 (a multiple of 16: the block path's condition), as in dot16x4_avx2
        __m512 kv = _mm512_loadu_ps(k + j0);
#pragma GCC unroll 8
        for (int m = 0; m < 8; m++) A[m] = _mm512_add_ps(A[m], _mm512_mul_ps(_mm512_loadu_ps(q + (size_t)m * D + j0), kv));
        j0 += 16;
    } while (j0 < D);
    tree16x8_512(A, scale, out);
}

// dot16x8_shared_512 for keys a .. b-1 of a tile (key i at tile + i * D): rows[m][i] = query m's score.
// One call a tile, not a key, so the scores go from the tree's register to their rows directly.
AVX512 static void scores8_512(const float *q, const float *tile, int D, float scale, float *const *rows, int a,
                               int b) {
    for (int i = a; i < b; i++) {
        float dots[8];
        dot16x8_shared_512(q, tile + (size_t)i * D, D, scale, dots);
        for (int m = 0; m < 8; m++) rows[m][i] = dots[m];
    }
}

// axpy16x4_tokens_avx2 over 32 columns (out_i[0..32), v rows of float32).
AVX512 static void axpy32x4_tokens_512(float *const *out, const float *const *p, const float *v, size_t row, int s0,
                                       int s1) {
    __m512 acc[4][2];
    for (int i = 0; i < 4; i++) acc[i][0] = _mm512_loadu_ps(out[i]), acc[i][1] = _mm512_loadu_ps(out[i] + 16);
    for (int s = s0; s < s1; s++) {
        const float *vs = v + (size_t)s * row;
        __m512 v0 = _mm512_loadu_ps(vs), v1 = _mm512_loadu_ps(vs + 16);
        for (int i = 0; i < 4; i++) {
            __m512 ps = _mm512_set1_ps(p[i][s]);
            acc[i][0] = _mm512_add_ps(acc[i][0], _mm512_mul_ps(ps, v0));
            acc[i][1] = _mm512_add_ps(acc[i][1], _mm512_mul_ps(ps, v1));
        }
    }
    for (int i = 0; i < 4; i++) _mm512_storeu_ps(out[i], acc[i][0]), _mm512_storeu_ps(out[i] + 16, acc[i][1]);
}

// One query of axpy32x4_tokens_512.
AVX512 static void axpy32_tokens_512(float *out, const float *p, const float *v, size_t row, int s0, int s1) {
    __m512 a0 = _mm512_loadu_ps(out), a1 = _mm512_loadu_ps(out + 16);
    for (int s = s0; s < s1; s++) {
        __m512 ps = _mm512_set1_ps(p[s]);
        a0 = _mm512_add_ps(a0, _mm512_mul_ps(ps, _mm512_loadu_ps(v + (size_t)s * row)));
        a1 = _mm512_add_ps(a1, _mm512_mul_ps(ps, _mm512_loadu_ps(v + (size_t)s * row + 16)));
    }
    _mm512_storeu_ps(out, a0), _mm512_storeu_ps(out + 16, a1);
}

// Cached rows s0 .. s1-1 of kv head `kvh` (`row` elements apart) side by side into tile, as float32.
static void copy_tile(const AttnJob *j, float *tile, const void *base, int kvh, size_t row, int s0, int s1) {
    int D = j->D;
    for (int s = s0; s < s1; s++) {
        float *dst = tile + (size_t)(s - s0) * D;
        const float *src = kv_floats(j, base, (size_t)s * row + (size_t)kvh * D, (size_t)D, dst);
        if (src != dst) memcpy(dst, src, (size_t)D * sizeof(float));
    }
}

// Several new tokens (prefill, verification): a task per (block of QBLOCK new tokens, head), a
// head's blocks one after the other (its keys and values stay in L2/L3 between them). Per tile of
// KTILE cached tokens, the head's keys are copied side by side (as cached, a head's rows lie a
// whole token's row apart: 32 of them fall in one set of L1) and scored against 4 new tokens at a
// time (dot16x4_shared_avx2), each key loaded from memory once for the block; each token's softmax
// is softmax_rows', as in decode; then per tile the values, copied alike, go into 4 tokens' outputs
// at a time, 16 columns per register pair (each value loaded once for the 4). The same operations
// per score, softmax and output element, in the same order, so the same bits as one task per token.
// Alternated call by call with 4 tokens per task and no copies (BENCHMARKS.md): OLMoE's 16 heads, a
// 2048-token prompt 720 -> 287 ms per layer, 8 tokens verified after 2000 7.3 -> 4.6 ms; Qwen3's 32
// heads over 4 kv heads 678 -> 525 ms. With a window the block reads the rows from its first
// token's first row seen (base); a token's scores before its own first row are 0 after its softmax,
// so the shared value loops add 0 · v to its +0 outputs there: the bits of starting at its first row.
// On the AVX-512 path 8 tokens are scored at a time and the values go 32 columns a call (the 512-bit
// loops above; Intel host, OLMoE's 16 heads over a float16 cache, alternated twice): 144 new tokens
// after 3,072 cached ones 72-73 -> 62-64 ms, a 2048-token prompt 324-330 -> 291 ms. Not 2x: the
// multiplies and adds stay separate (the reduction contract), and such a core runs 512-bit float
// operations on fewer ports than 256-bit ones (not measured apart here). The 8 scores' trees side by
// side (tree16x8_512), the block's queries copied side by side (a token's lie H·D floats apart: the
// same L1 sets): 68-72 -> 62-68 ms (best of 25, four alternations; a busy host). A head's keys and
// values are read again for each block (from L3: with the scores they pass L2), so on that path a
// block is 32 tokens: their reads' share of the samples (perf) 18 -> 14 %, best of 25 70.1 -> 66.8
// ms (five alternations, a busier host). Tried and dropped: the next tile asked for ahead, the
// widening in 512-bit registers (neither changed the reads' share: reading, not widening, costs it).
// A tile's 8-token scores in one call (scores8_512), the 8 sums in registers (for a loop that might
// not run, the compiler had kept them on the stack, zeroed by `rep stos` on every key: 10 % of the
// samples): 128 new tokens after 3,203 cached, 2 threads, two builds alternated call by call,
// 43.9 -> 37.8 ms (median of 25), a 2048-token prompt 243 -> 213 ms; the AVX2 loops alike, 1-2 %.
// Two keys a call (each query vector loaded once for both) gave nothing more.
enum { QBLOCK = 32, KTILE = 32 };

// New tokens a block: QBLOCK on the AVX-512 path, else half as many.
static inline int qblock(const AttnJob *j) {
    return j->avx512 ? QBLOCK : QBLOCK / 2;
}

static void attn_task_block(void *ctx, int task) {
    const AttnJob *j = ctx;
    int nb = qblock(j), nqb = (j->T + nb - 1) / nb;  // head-major: a head's blocks of tokens run one after the other
    int t0 = (task % nqb) * nb, h0 = (task / nqb) * j->heads;
    int nt = j->T - t0 < nb ? j->T - t0 : nb, nh = j->H - h0 < j->heads ? j->H - h0 : j->heads;
    int group = j->H / j->Hkv, D = j->D, len[QBLOCK], lo[QBLOCK] = {0};  // token t0 + m sees keys lo[m] .. len[m] - 1
    size_t row = (size_t)j->Hkv * (size_t)D, qs = (size_t)j->H * (size_t)D;
    for (int m = 0; m < nt; m++) len[m] = j->start + t0 + m + 1, lo[m] = first_seen(j, len[m] - 1);
    int lmax = j->start + t0 + nt, base = lo[0], width = lmax - base;  // the rows the block reads: base .. lmax - 1
    float *buf = malloc(((size_t)nt * (size_t)width + (size_t)(KTILE + QBLOCK) * D) * sizeof(float)), *p[QBLOCK];
    if (buf == NULL) {  // no memory for the scores: the rows are NaN rather than wrong
        for (int m = 0; m < nt; m++)
            for (size_t i = 0; i < (size_t)nh * (size_t)D; i++) j->out[((size_t)(t0 + m) * j->H + h0) * D + i] = NAN;
        return;
    }
    for (int m = 0; m < nt; m++) p[m] = buf + (size_t)m * (size_t)width;  // p[m][s - base]: token t0 + m, key s
    float *tile = buf + (size_t)nt * (size_t)width;  // KTILE keys or values of one head, side by side
    float *qb = tile + (size_t)KTILE * D;  // the block's queries of one head, side by side (AVX-512 path)
    for (int h = h0; h < h0 + nh; h++) {
        const float *q = j->q + ((size_t)t0 * j->H + h) * (size_t)D;  // token t0 + m: q + m * qs
        for (int m = 0; j->avx512 && m < nt; m++) memcpy(qb + (size_t)m * D, q + (size_t)m * qs, (size_t)D * sizeof(float));
        for (int s0 = base; s0 < lmax; s0 += KTILE) {
            int s1 = s0 + KTILE < lmax ? s0 + KTILE : lmax;
            copy_tile(j, tile, j->k, h / group, row, s0, s1);
            int step = j->avx512 ? 8 : 4;  // new tokens scored together
            for (int m0 = 0; m0 < nt; m0 += step) {
                // keys a .. b-1 of the tile: the ones all `step` tokens see, scored together
                int whole = m0 + step <= nt, last = whole ? lo[m0 + step - 1] : s0;
                int a = last > s0 ? last : s0, b = whole ? (len[m0] < s1 ? len[m0] : s1) : s0;
                if (step == 8 && b > a) {
                    float *rows8[8];
                    for (int m = 0; m < 8; m++) rows8[m] = p[m0 + m] + (s0 - base);
                    scores8_512(qb + (size_t)m0 * D, tile, D, j->scale, rows8, a - s0, b - s0);
                }
                for (int s = s0; s < s1; s++) {
                    const float *ks = tile + (size_t)(s - s0) * D;
                    if (s >= a && s < b) {
                        if (step == 8) continue;  // scored above
                        float dots[4];
                        dot16x4_shared_avx2(q + (size_t)m0 * qs, qs, ks, D, dots, 0);
                        for (int m = 0; m < 4; m++) p[m0 + m][s - base] = dots[m] * j->scale;
                        continue;
                    }
                    for (int m = m0; m < nt && m < m0 + step; m++) {
                        if (s < len[m] && s >= lo[m]) p[m][s - base] = dot16_avx2(q + (size_t)m * qs, ks, D) * j->scale;
                    }
                }
            }
        }
        float *rows[QBLOCK];
        int seen[QBLOCK];
        const float *sinks[QBLOCK];
        for (int m = 0; m < nt; m++) rows[m] = p[m] + (lo[m] - base), seen[m] = len[m] - lo[m], sinks[m] = sink_of(j, h);
        softmax_rows(rows, seen, nt, j->avx2, sinks);
        for (int m = 0; m < nt; m++)
            for (int s = base; s < lo[m]; s++) p[m][s - base] = 0.0f;
        float *out[QBLOCK];
        for (int m = 0; m < nt; m++) {
            out[m] = j->out + ((size_t)(t0 + m) * j->H + h) * (size_t)D;
            memset(out[m], 0, (size_t)D * sizeof(float));
        }
        for (int s0 = base; s0 < lmax; s0 += KTILE) {  // a tile of values, in L1 for every token and column
            int s1 = s0 + KTILE < lmax ? s0 + KTILE : lmax;
            copy_tile(j, tile, j->v, h / group, row, s0, s1);
            int cols = j->avx512 && D % 32 == 0 ? 32 : 16;  // columns a call
            for (int m0 = 0; m0 < nt; m0 += 4) {  // token s of the tile: p[m][s - base], tile + (s - s0) * D
                for (int d0 = 0; d0 < D; d0 += cols) {
                    if (m0 + 4 <= nt) {  // the 4 tokens' common keys together, then each one's own in order
                        float *o4[4] = {out[m0] + d0, out[m0 + 1] + d0, out[m0 + 2] + d0, out[m0 + 3] + d0};
                        const float *p4[4] = {p[m0] + (s0 - base), p[m0 + 1] + (s0 - base), p[m0 + 2] + (s0 - base),
                                              p[m0 + 3] + (s0 - base)};
                        int common = (len[m0] < s1 ? len[m0] : s1) - s0;
                        if (cols == 32) axpy32x4_tokens_512(o4, p4, tile + d0, (size_t)D, 0, common);
                        else axpy16x4_tokens_avx2(o4, p4, tile + d0, (size_t)D, 0, common);
                        for (int m = m0 + 1; m < m0 + 4; m++) {
                            int a = common > 0 ? common : 0, b = (len[m] < s1 ? len[m] : s1) - s0;
                            if (cols == 32) axpy32_tokens_512(out[m] + d0, p[m] + (s0 - base), tile + d0, (size_t)D, a, b);
                            else axpy16_tokens_avx2(out[m] + d0, p[m] + (s0 - base), tile + d0, (size_t)D, a, b);
                        }
                        continue;
                    }
                    for (int m = m0; m < nt; m++) {
                        int b = (len[m] < s1 ? len[m] : s1) - s0;
                        if (cols == 32) axpy32_tokens_512(out[m] + d0, p[m] + (s0 - base), tile + d0, (size_t)D, 0, b);
                        else axpy16_tokens_avx2(out[m] + d0, p[m] + (s0 - base), tile + d0, (size_t)D, 0, b);
                    }
                }
            }
        }
    }
    free(buf);
}
#endif

int attention(float *out, const float *q, int T, int H, int D, const void *k, const void *v, int S, int Hkv,
              int start, float scale, int window, const float *sinks, int kv) {
    if (T < 0 || H < 1 || D < 1 || Hkv < 1 || H % Hkv || start < 0 || start + T > S || window < 0 ||
        (kv != KV_F32 && kv != KV_F16)) {
        return COLI_EINVAL;
    }
    int threads = threads_get(), blocks = threads < H ? threads : H;  // one block of heads per thread
    AttnJob j = {out, q, k, v, T, H, D, S, Hkv, start, scale, window, sinks, (H + blocks - 1) / blocks,
                 path_current() != &PATH_PORTABLE, 0, kv == KV_F16};
#if COLI_X86
    j.avx512 = path_current() == &PATH_AVX512 || path_current() == &PATH_AMX;
#endif
    int tasks = T * ((H + j.heads - 1) / j.heads);
    void (*task)(void *, int) = attn_task;
#if COLI_X86
    if (T > 1 && j.avx2 && D % 16 == 0) {
        int nqb = (T + qblock(&j) - 1) / qblock(&j);
        j.heads = 1 + (H * nqb - 1) / 65535;  // one head a task (a pool run takes up to 65535)
        task = attn_task_block;
        tasks = nqb * ((H + j.heads - 1) / j.heads);
    }
#endif
    double seen = window > 0 && window < start + T ? window : start + T;  // keys a token reads, at most
    if ((double)T * H * seen * D < POOL_MIN_WORK || threads <= 1) {
        for (int i = 0; i < tasks; i++) task(&j, i);
    } else {
        pool_run(task, &j, tasks);
    }
    return COLI_OK;
}

// ----------------------------------------------------------------------------
// The pre-norm attention sub-block of a decoder layer, in one call (a decode step would otherwise
// cross from Python to C six times per layer). Each step is the function above that the layer-
// by-layer path calls, in the same order, so the results are the same bits.

// x[t] += bias for each of the n rows of x [n, width] (bias NULL: nothing).
static void add_bias(float *x, const float *bias, int n, int width) {
    if (bias == NULL) return;
    for (size_t t = 0; t < (size_t)n; t++)
        for (int i = 0; i < width; i++) x[t * width + i] += bias[i];
}

int attn_block(float *out, const float *h, int n_seq, const int *seq_T, const AttnBlock *b, const float *cos,
               const float *sin, void *const *k_cache, void *const *v_cache, const int *start, int act, int kv) {
    int H = b->heads, Hkv = b->kv_heads, D = b->head_dim, hidden = b->wq->cols;
    int nq = H * D, nkv = Hkv * D, nqg = b->gated ? 2 * nq : nq, rot = b->rotary_dim ? b->rotary_dim : D;
    if (n_seq < 1 || H < 1 || Hkv < 1 || D < 1 || rot < 0 || rot > D || rot % 2 || H % Hkv ||
        (kv != KV_F32 && kv != KV_F16) || b->wq->rows != nqg ||
        b->wk->rows != nkv || b->wv->rows != nkv || b->wk->cols != hidden || b->wv->cols != hidden ||
        b->wo->rows != hidden || b->wo->cols != nq || b->qk_norm < 0 ||
        b->qk_norm > QK_NORM_HEAD || b->window < 0 || (b->gated && b->qk_norm == QK_NORM_WHOLE)) {
        return COLI_EINVAL;
    }
    int T = seq_rows(n_seq, seq_T);  // every sequence's rows, stacked
    if (T < 0) return COLI_EINVAL;
    for (int i = 0; i < n_seq; i++) {
        if (start[i] < 0) return COLI_EINVAL;
    }
    if (T == 0) return COLI_OK;
    size_t t = (size_t)T;
    float *x = malloc(t * ((size_t)hidden * 2 + (size_t)nq * 3 + (size_t)nkv * 3 + (b->gated ? (size_t)nq * 3 : 0)) * sizeof(float));
    if (x == NULL) return COLI_ENOMEM;
    float *q = x + t * hidden, *k = q + t * nq, *v = k + t * nkv, *qr = v + t * nkv, *attn = qr + t * nq;
    float *o = attn + t * nq, *kr = o + t * hidden;  // kr: the rotated keys, before a float16 cache rounds them
    float *qg = b->gated ? kr + t * nkv : q, *gate = qg + t * nqg;  // gated: per head [q | gate], then the gates
    int status = rms_norm(x, h, b->norm, T, hidden, b->eps);
    float *qkv[3] = {qg, k, v};
    const QMatrix *w[3] = {b->wq, b->wk, b->wv};
    if (status == COLI_OK) status = matmul_multi(qkv, w, 3, x, T, act);
    const float *bias[3] = {b->bq, b->bk, b->bv};
    int width[3] = {nqg, nkv, nkv};
    for (int i = 0; i < 3 && status == COLI_OK; i++) add_bias(qkv[i], bias[i], T, width[i]);
    if (status == COLI_OK && b->gated) {  // [T, H, 2D] → q [T, H, D] and the gates [T, H, D]
        for (size_t r = 0; r < t * (size_t)H; r++) {
            memcpy(q + r * D, qg + r * 2 * D, (size_t)D * sizeof(float));
            memcpy(gate + r * D, qg + r * 2 * D + D, (size_t)D * sizeof(float));
        }
    }
    if (status == COLI_OK && b->qk_norm) {  // in place: rms_norm reads a row whole before writing it
        int whole = b->qk_norm == QK_NORM_WHOLE;
        rms_norm(q, q, b->q_norm, whole ? T : T * H, whole ? nq : D, b->eps);
        rms_norm(k, k, b->k_norm, whole ? T : T * Hkv, whole ? nkv : D, b->eps);
    }
    if (status == COLI_OK && b->clip < INFINITY) {
        for (float *p = q; p < qr; p++) *p = *p < -b->clip ? -b->clip : *p > b->clip ? b->clip : *p;
    }
    if (status == COLI_OK) {
        rope_leading(qr, q, cos, sin, T, H, D, rot);
        rope_leading(kr, k, cos, sin, T, Hkv, D, rot);
    }
    for (size_t i = 0, row = 0; i < (size_t)n_seq && status == COLI_OK; row += (size_t)seq_T[i], i++) {
        size_t n = (size_t)seq_T[i] * nkv, at = (size_t)start[i] * nkv;  // this call's rows of sequence i's cache
        if (n == 0) continue;
        if (kv == KV_F16) {
            f16_from_f32((uint16_t *)k_cache[i] + at, kr + row * nkv, n);
            f16_from_f32((uint16_t *)v_cache[i] + at, v + row * nkv, n);
        } else {
            memcpy((float *)k_cache[i] + at, kr + row * nkv, n * sizeof(float));
            memcpy((float *)v_cache[i] + at, v + row * nkv, n * sizeof(float));
        }
        status = attention(attn + row * nq, qr + row * nq, seq_T[i], H, D, k_cache[i], v_cache[i], start[i] + seq_T[i],
                           Hkv, start[i], b->scale, b->window, b->sinks, kv);
    }
    if (status == COLI_OK && b->gated) {  // attention · sigmoid(gate)
        sigmoid_f32(gate, gate, T * nq);
        for (size_t i = 0; i < t * (size_t)nq; i++) attn[i] = attn[i] * gate[i];
    }
    if (status == COLI_OK) status = matmul_multi(&o, &b->wo, 1, attn, T, act);
    if (status == COLI_OK) add_bias(o, b->bo, T, hidden);
    if (status == COLI_OK) {
        for (size_t i = 0; i < t * (size_t)hidden; i++) out[i] = h[i] + o[i];
    }
    free(x);
    return status;
}
