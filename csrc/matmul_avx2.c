// matmul_avx2.c — the AVX2 (+F16C) row dot products, in the fixed order of matmul.c.
//
// Compiled with function-level target attributes (no -mavx2 for the whole build), so the library
// runs on any x86-64 and this file's code runs only after matmul.c saw AVX2 and F16C in cpuid.
// ACT_F32: two 8-float accumulators are lanes 0-7 and 8-15 of matmul.c's 16 lanes.
// ACT_Q8: integer dot products per group/block with maddubs (u8 x s8) and madd; the int4 nibbles
// are used unsigned (q + 8) and 8 * Σxq is subtracted after — exact in int32 either way.
#include "impl/kernels_impl.h"

#if COLI_X86
#include <immintrin.h>
#include <string.h>

#define AVX2 __attribute__((target("avx2,f16c")))

// 16 lanes (a = lanes 0-7, b = lanes 8-15) -> matmul.c's tree16
AVX2 static inline float tree16_avx2(__m256 a, __m256 b) {
    __m256 s8 = _mm256_add_ps(a, b);                                                     // l + l+8
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));   // l + l+4
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                                  // l + l+2
    __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));                              // 0 + 1
    return _mm_cvtss_f32(s1);
}

AVX2 static inline float tree8_avx2(__m256 v) {
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    return _mm_cvtss_f32(s1);
}

// Eight int32 vectors -> one vector whose lane i is the sum of v[i]'s lanes (exact).
AVX2 static inline __m256i hsum8_epi32(const __m256i *v) {
    __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
    __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
    __m256i h0123 = _mm256_hadd_epi32(h01, h23), h4567 = _mm256_hadd_epi32(h45, h67);
    __m256i lo = _mm256_permute2x128_si256(h0123, h4567, 0x20);
    __m256i hi = _mm256_permute2x128_si256(h0123, h4567, 0x31);
    return _mm256_add_epi32(lo, hi);
}

AVX2 static inline float half_to_float(uint16_t h) { return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h))); }

// ----------------------------------------------------------------------------
// ACT_F32

AVX2 static float dot_f32_avx2(const QMatrix *w, int r, const Acts *a, int t) {
    int cols = w->cols;
    const float *wr = (const float *)w->data + (size_t)r * (size_t)cols;
    const float *x = a->xf + (size_t)t * a->stride;  // zero padded to a multiple of 16
    __m256 A = _mm256_setzero_ps(), B = _mm256_setzero_ps();
    int j = 0;
    for (; j + 16 <= cols; j += 16) {
        A = _mm256_add_ps(A, _mm256_mul_ps(_mm256_loadu_ps(wr + j), _mm256_loadu_ps(x + j)));
        B = _mm256_add_ps(B, _mm256_mul_ps(_mm256_loadu_ps(wr + j + 8), _mm256_loadu_ps(x + j + 8)));
    }
    if (j < cols) {
        float tail[16] = {0};
        memcpy(tail, wr + j, (size_t)(cols - j) * sizeof(float));
        A = _mm256_add_ps(A, _mm256_mul_ps(_mm256_loadu_ps(tail), _mm256_loadu_ps(x + j)));
        B = _mm256_add_ps(B, _mm256_mul_ps(_mm256_loadu_ps(tail + 8), _mm256_loadu_ps(x + j + 8)));
    }
    return tree16_avx2(A, B);
}

AVX2 static inline __m256 cvt8_i8(const int8_t *p) {
    __m128i b = _mm_loadl_epi64((const __m128i *)p);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

AVX2 static float dot_int8_f32_avx2(const QMatrix *w, int r, const Acts *a, int t) {
    int cols = w->cols;
    const int8_t *wr = (const int8_t *)w->data + (size_t)r * (size_t)cols;
    const float *x = a->xf + (size_t)t * a->stride;
    __m256 A = _mm256_setzero_ps(), B = _mm256_setzero_ps();
    int j = 0;
    for (; j + 16 <= cols; j += 16) {
        A = _mm256_add_ps(A, _mm256_mul_ps(cvt8_i8(wr + j), _mm256_loadu_ps(x + j)));
        B = _mm256_add_ps(B, _mm256_mul_ps(cvt8_i8(wr + j + 8), _mm256_loadu_ps(x + j + 8)));
    }
    if (j < cols) {
        int8_t tail[16] = {0};
        memcpy(tail, wr + j, (size_t)(cols - j));
        A = _mm256_add_ps(A, _mm256_mul_ps(cvt8_i8(tail), _mm256_loadu_ps(x + j)));
        B = _mm256_add_ps(B, _mm256_mul_ps(cvt8_i8(tail + 8), _mm256_loadu_ps(x + j + 8)));
    }
    return tree16_avx2(A, B) * ((const float *)w->scales)[r];
}

// 8 signed bytes (the low 8 of v) -> 8 floats
AVX2 static inline __m256 cvt8_lo(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

AVX2 static float dot_int4_f32_avx2(const QMatrix *w, int r, const Acts *a, int t) {
    int cols = w->cols, ngroups = (cols + INT4_GROUP - 1) / INT4_GROUP;
    size_t row_bytes = ((size_t)cols + 1) / 2;
    const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * row_bytes;
    const uint16_t *sr = (const uint16_t *)w->scales + (size_t)r * (size_t)ngroups;
    const float *x = a->xf + (size_t)t * a->stride;  // per group: 32 even, then 32 odd columns
    const __m256i low4 = _mm256_set1_epi8(0x0f), eight = _mm256_set1_epi8(8);
    __m256 SA = _mm256_setzero_ps(), SB = _mm256_setzero_ps();
    uint8_t tmp[32];
    for (int g = 0; g < ngroups; g++) {
        const uint8_t *bp = wr + (size_t)g * 32;
        if ((size_t)g * 32 + 32 > row_bytes) {
            memset(tmp, 0x88, 32);
            memcpy(tmp, bp, row_bytes - (size_t)g * 32);
            bp = tmp;
        }
        __m256i b = _mm256_loadu_si256((const __m256i *)bp);
        __m256i lo = _mm256_sub_epi8(_mm256_and_si256(b, low4), eight);                      // lo[0..31]
        __m256i hi = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(b, 4), low4), eight);  // hi[0..31]
        __m128i lo0 = _mm256_castsi256_si128(lo), lo1 = _mm256_extracti128_si256(lo, 1);
        __m128i hi0 = _mm256_castsi256_si128(hi), hi1 = _mm256_extracti128_si256(hi, 1);
        const float *xe = x + (size_t)g * 64, *xo = xe + 32;
        // lane l: lo[l], lo[l+16], hi[l], hi[l+16] (A: l < 8, B: l >= 8)
        __m256 A = _mm256_mul_ps(cvt8_lo(lo0), _mm256_loadu_ps(xe));
        __m256 B = _mm256_mul_ps(cvt8_lo(_mm_srli_si128(lo0, 8)), _mm256_loadu_ps(xe + 8));
        A = _mm256_add_ps(A, _mm256_mul_ps(cvt8_lo(lo1), _mm256_loadu_ps(xe + 16)));
        B = _mm256_add_ps(B, _mm256_mul_ps(cvt8_lo(_mm_srli_si128(lo1, 8)), _mm256_loadu_ps(xe + 24)));
        A = _mm256_add_ps(A, _mm256_mul_ps(cvt8_lo(hi0), _mm256_loadu_ps(xo)));
        B = _mm256_add_ps(B, _mm256_mul_ps(cvt8_lo(_mm_srli_si128(hi0, 8)), _mm256_loadu_ps(xo + 8)));
        A = _mm256_add_ps(A, _mm256_mul_ps(cvt8_lo(hi1), _mm256_loadu_ps(xo + 16)));
        B = _mm256_add_ps(B, _mm256_mul_ps(cvt8_lo(_mm_srli_si128(hi1, 8)), _mm256_loadu_ps(xo + 24)));
        __m256 sc = _mm256_set1_ps(half_to_float(sr[g]));
        SA = _mm256_add_ps(SA, _mm256_mul_ps(A, sc));
        SB = _mm256_add_ps(SB, _mm256_mul_ps(B, sc));
    }
    return tree16_avx2(SA, SB);
}

// ----------------------------------------------------------------------------
// ACT_Q8

AVX2 static float dot_int8_q8_avx2(const QMatrix *w, int r, const Acts *a, int t) {
    int cols = w->cols, nblocks = (cols + Q8_BLOCK - 1) / Q8_BLOCK;
    const int8_t *wr = (const int8_t *)w->data + (size_t)r * (size_t)cols;
    const int8_t *xq = a->xq + (size_t)t * a->stride;  // natural order, zero padded
    const float *xs = a->xs + (size_t)t * (size_t)a->nb8;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 L = _mm256_setzero_ps();
    int8_t tmp[64];
    for (int b0 = 0; b0 < a->nb8; b0 += 8) {
        __m256i acc[8];
        for (int i = 0; i < 8; i++) {
            int b = b0 + i;
            if (b >= nblocks) {
                acc[i] = _mm256_setzero_si256();
                continue;
            }
            const int8_t *wp = wr + (size_t)b * 64;
            if (b * 64 + 64 > cols) {
                memset(tmp, 0, 64);
                memcpy(tmp, wp, (size_t)(cols - b * 64));
                wp = tmp;
            }
            __m256i w0 = _mm256_loadu_si256((const __m256i *)wp);
            __m256i w1 = _mm256_loadu_si256((const __m256i *)(wp + 32));
            __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + (size_t)b * 64));
            __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + (size_t)b * 64 + 32));
            // |w| (u8) x sign(x, w) (s8): pair sums <= 2 * 128 * 127 fit int16
            __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w0), _mm256_sign_epi8(x0, w0)), ones);
            __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w1), _mm256_sign_epi8(x1, w1)), ones);
            acc[i] = _mm256_add_epi32(p0, p1);
        }
        __m256 isum = _mm256_cvtepi32_ps(hsum8_epi32(acc));
        L = _mm256_add_ps(L, _mm256_mul_ps(isum, _mm256_loadu_ps(xs + b0)));
    }
    return tree8_avx2(L) * ((const float *)w->scales)[r];
}

AVX2 static float dot_int4_q8_avx2(const QMatrix *w, int r, const Acts *a, int t) {
    int cols = w->cols, ngroups = (cols + INT4_GROUP - 1) / INT4_GROUP;
    size_t row_bytes = ((size_t)cols + 1) / 2;
    const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * row_bytes;
    const uint16_t *sr = (const uint16_t *)w->scales + (size_t)r * (size_t)ngroups;
    const int8_t *xq = a->xq + (size_t)t * a->stride;  // per block: 32 even, then 32 odd columns
    const float *xs = a->xs + (size_t)t * (size_t)a->nb8;
    const int32_t *xsum = a->xsum + (size_t)t * (size_t)a->nb8;
    const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 L = _mm256_setzero_ps();
    uint8_t tmp[32];
    uint16_t stmp[8];
    for (int g0 = 0; g0 < a->nb8; g0 += 8) {
        __m256i acc[8];
        for (int i = 0; i < 8; i++) {
            int g = g0 + i;
            if (g >= ngroups) {
                acc[i] = _mm256_setzero_si256();
                continue;
            }
            const uint8_t *bp = wr + (size_t)g * 32;
            if ((size_t)g * 32 + 32 > row_bytes) {
                memset(tmp, 0x88, 32);
                memcpy(tmp, bp, row_bytes - (size_t)g * 32);
                bp = tmp;
            }
            __m256i b = _mm256_loadu_si256((const __m256i *)bp);
            __m256i lo = _mm256_and_si256(b, low4);                         // q + 8 of the even columns
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);   // q + 8 of the odd columns
            __m256i xe = _mm256_loadu_si256((const __m256i *)(xq + (size_t)g * 64));
            __m256i xo = _mm256_loadu_si256((const __m256i *)(xq + (size_t)g * 64 + 32));
            // pair sums <= 2 * 15 * 127, their sum over lo and hi <= 7620: fits int16
            __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo));
            acc[i] = _mm256_madd_epi16(p, ones);
        }
        // isum[g] = Σ (q + 8) xq - 8 Σ xq
        __m256i isum = _mm256_sub_epi32(hsum8_epi32(acc), _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(xsum + g0)), 3));
        const uint16_t *sp = sr + g0;
        if (g0 + 8 > ngroups) {
            memset(stmp, 0, sizeof stmp);
            memcpy(stmp, sp, (size_t)(ngroups - g0) * sizeof(uint16_t));
            sp = stmp;
        }
        __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sp));
        __m256 c = _mm256_mul_ps(ws, _mm256_loadu_ps(xs + g0));
        L = _mm256_add_ps(L, _mm256_mul_ps(_mm256_cvtepi32_ps(isum), c));
    }
    return tree8_avx2(L);
}

// Row r for n tokens, 4 at a time: each group's nibbles are unpacked once for 4 tokens; every
// (row, token) goes through exactly the operations of dot_int4_q8_avx2.
AVX2 static void rows_int4_q8_avx2(const QMatrix *w, int r, const Acts *a, const int32_t *tok, int n,
                                   float *const *yrow) {
    int cols = w->cols, ngroups = (cols + INT4_GROUP - 1) / INT4_GROUP;
    size_t row_bytes = ((size_t)cols + 1) / 2;
    const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * row_bytes;
    const uint16_t *sr = (const uint16_t *)w->scales + (size_t)r * (size_t)ngroups;
    const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    uint8_t tmp[32];
    uint16_t stmp[8];
    for (int i0 = 0; i0 < n; i0 += 4) {
        int nt = n - i0 < 4 ? n - i0 : 4;
        const int8_t *xq[4];
        const float *xs[4];
        const int32_t *xsum[4];
        for (int u = 0; u < nt; u++) {
            size_t t = (size_t)(tok != NULL ? tok[i0 + u] : i0 + u);
            xq[u] = a->xq + t * a->stride;
            xs[u] = a->xs + t * (size_t)a->nb8;
            xsum[u] = a->xsum + t * (size_t)a->nb8;
        }
        __m256 L[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int g0 = 0; g0 < a->nb8; g0 += 8) {
            __m256i acc[4][8];
            for (int i = 0; i < 8; i++) {
                int g = g0 + i;
                if (g >= ngroups) {
                    for (int u = 0; u < 4; u++) acc[u][i] = _mm256_setzero_si256();
                    continue;
                }
                const uint8_t *bp = wr + (size_t)g * 32;
                if ((size_t)g * 32 + 32 > row_bytes) {
                    memset(tmp, 0x88, 32);
                    memcpy(tmp, bp, row_bytes - (size_t)g * 32);
                    bp = tmp;
                }
                __m256i b = _mm256_loadu_si256((const __m256i *)bp);
                __m256i lo = _mm256_and_si256(b, low4);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
                for (int u = 0; u < nt; u++) {
                    __m256i xe = _mm256_loadu_si256((const __m256i *)(xq[u] + (size_t)g * 64));
                    __m256i xo = _mm256_loadu_si256((const __m256i *)(xq[u] + (size_t)g * 64 + 32));
                    __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo));
                    acc[u][i] = _mm256_madd_epi16(p, ones);
                }
            }
            const uint16_t *sp = sr + g0;
            if (g0 + 8 > ngroups) {
                memset(stmp, 0, sizeof stmp);
                memcpy(stmp, sp, (size_t)(ngroups - g0) * sizeof(uint16_t));
                sp = stmp;
            }
            __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sp));
            for (int u = 0; u < nt; u++) {
                __m256i isum = _mm256_sub_epi32(hsum8_epi32(acc[u]),
                                                _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(xsum[u] + g0)), 3));
                __m256 c = _mm256_mul_ps(ws, _mm256_loadu_ps(xs[u] + g0));
                L[u] = _mm256_add_ps(L[u], _mm256_mul_ps(_mm256_cvtepi32_ps(isum), c));
            }
        }
        for (int u = 0; u < nt; u++) yrow[i0 + u][r] = tree8_avx2(L[u]);
    }
}

const Path PATH_AVX2 = {"avx2", dot_f32_avx2, dot_int8_f32_avx2, dot_int8_q8_avx2, dot_int4_f32_avx2,
                        dot_int4_q8_avx2, rows_int4_q8_avx2};

#endif  // COLI_X86
