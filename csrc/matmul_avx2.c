// matmul_avx2.c — the AVX2 (+F16C) row dot products, in the fixed order of matmul.c.
//
// Compiled with function-level target attributes (no -mavx2 for the whole build), so the library
// runs on any x86-64 and this file's code runs only after matmul.c saw AVX2 and F16C in cpuid.
// ACT_F32: two 8-float accumulators are lanes 0-7 and 8-15 of matmul.c's 16 lanes.
// ACT_Q8: integer dot products per group/block with maddubs (u8 x s8) and madd; the int4 nibbles
// are used unsigned (q + 8) and 8 * Σxq is subtracted after — exact in int32 either way. Also the
// AVX-512 path's int4 x int8 kernels (dot_int4_q8_vnni, rows_int4_q8_vnni) and the AMX path's
// (rows_q8_tiles, int4 and int8), which share this file's chunk layout.
#include "impl/kernels_impl.h"

#if COLI_X86
#include <immintrin.h>
#include <pthread.h>
#include <stdlib.h>
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

AVX2 float dot_int8_f32_avx2(const QMatrix *w, int r, const Acts *a, int t) {
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

// int8 weights, rows interleaved (matmul_avx512.c's rows_int8_f32_avx512 says why): four rows at
// once, each with its two accumulators in the dot's order, so the same bits as dot_int8_f32_avx2.
AVX2 static void rows_int8_f32_avx2(const QMatrix *w, int r0, int r1, const Acts *a, const int32_t *tok, int n,
                                    float *const *yrow) {
    int cols = w->cols, full = cols / 16 * 16;
    const float *scale = (const float *)w->scales;
    int r = r0;
    for (; r + 4 <= r1; r += 4) {
        const int8_t *wr = (const int8_t *)w->data + (size_t)r * (size_t)cols;  // row r + k at wr + k * cols
        for (int i = 0; i < n; i++) {
            const float *x = a->xf + (size_t)(tok != NULL ? tok[i] : i) * a->stride;  // zero padded to 16
            __m256 A[4], B[4];
            for (int k = 0; k < 4; k++) A[k] = B[k] = _mm256_setzero_ps();
            for (int j = 0; j < full; j += 16) {
                __m256 xa = _mm256_loadu_ps(x + j), xb = _mm256_loadu_ps(x + j + 8);
                for (int k = 0; k < 4; k++) {
                    const int8_t *p = wr + (size_t)k * cols + j;
                    A[k] = _mm256_add_ps(A[k], _mm256_mul_ps(cvt8_i8(p), xa));
                    B[k] = _mm256_add_ps(B[k], _mm256_mul_ps(cvt8_i8(p + 8), xb));
                }
            }
            if (full < cols) {  // the dot's zeroed tail
                __m256 xa = _mm256_loadu_ps(x + full), xb = _mm256_loadu_ps(x + full + 8);
                for (int k = 0; k < 4; k++) {
                    int8_t tail[16] = {0};
                    memcpy(tail, wr + (size_t)k * cols + full, (size_t)(cols - full));
                    A[k] = _mm256_add_ps(A[k], _mm256_mul_ps(cvt8_i8(tail), xa));
                    B[k] = _mm256_add_ps(B[k], _mm256_mul_ps(cvt8_i8(tail + 8), xb));
                }
            }
            for (int k = 0; k < 4; k++) yrow[i][r + k] = tree16_avx2(A[k], B[k]) * scale[r + k];
        }
    }
    for (; r < r1; r++) {
        for (int i = 0; i < n; i++) yrow[i][r] = dot_int8_f32_avx2(w, r, a, tok != NULL ? tok[i] : i);
    }
}

// 8 weight bytes -> 8 int32 lanes (zero-extended, straight from memory: one shuffle, no extracts)
AVX2 static inline __m256i widen8_u8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

// A group's 64 int4 weights as the floats q = nibble - 8, in the order the ACT_F32 dot reads them:
// q[0..3] the 32 even columns, q[4..7] the 32 odd ones. Each 8 bytes widened once (straight from
// memory) serve both nibbles: lo = b & 15, hi = b >> 4.
AVX2 static inline void int4_group_floats(const uint8_t *bp, __m256 q[8]) {
    const __m256i low4 = _mm256_set1_epi32(0x0f), eight = _mm256_set1_epi32(8);
    for (int i = 0; i < 4; i++) {
        __m256i b = widen8_u8(bp + 8 * i);
        q[i] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b, low4), eight));
        q[4 + i] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 4), eight));
    }
}

// matmul.c's ACT_F32 int4 steps for one group: lane l: A[l] = lo[l]*xe[l] + lo[l+16]*xe[l+16] +
// hi[l]*xo[l] + hi[l+16]*xo[l+16] (SA: l < 8, SB: l >= 8), then S += A * scale.
AVX2 static inline void int4_group_dot(const __m256 q[8], const float *xe, __m256 sc, __m256 *SA, __m256 *SB) {
    const float *xo = xe + 32;
    __m256 A = _mm256_mul_ps(q[0], _mm256_loadu_ps(xe));
    __m256 B = _mm256_mul_ps(q[1], _mm256_loadu_ps(xe + 8));
    A = _mm256_add_ps(A, _mm256_mul_ps(q[2], _mm256_loadu_ps(xe + 16)));
    B = _mm256_add_ps(B, _mm256_mul_ps(q[3], _mm256_loadu_ps(xe + 24)));
    A = _mm256_add_ps(A, _mm256_mul_ps(q[4], _mm256_loadu_ps(xo)));
    B = _mm256_add_ps(B, _mm256_mul_ps(q[5], _mm256_loadu_ps(xo + 8)));
    A = _mm256_add_ps(A, _mm256_mul_ps(q[6], _mm256_loadu_ps(xo + 16)));
    B = _mm256_add_ps(B, _mm256_mul_ps(q[7], _mm256_loadu_ps(xo + 24)));
    *SA = _mm256_add_ps(*SA, _mm256_mul_ps(A, sc));
    *SB = _mm256_add_ps(*SB, _mm256_mul_ps(B, sc));
}

// The float32 scales of the chunk's 8 groups (0 past the row's last group).
AVX2 static inline __m256 chunk_scales(const uint16_t *scales, int g0, int ngroups) {
    if (g0 + 8 <= ngroups) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + g0)));
    if (g0 + 4 == ngroups) return _mm256_cvtph_ps(_mm_loadl_epi64((const __m128i *)(scales + g0)));  // 4 of them
    uint16_t stmp[8] = {0};
    memcpy(stmp, scales + g0, (size_t)(ngroups - g0) * sizeof(uint16_t));
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)stmp));
}

AVX2 static float dot_int4_f32_avx2(const QMatrix *w, int r, const Acts *a, int t) {
    int cols = w->cols, ngroups = (cols + INT4_GROUP - 1) / INT4_GROUP;
    size_t row_bytes = ((size_t)cols + 1) / 2;
    const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * row_bytes;
    const uint16_t *sr = (const uint16_t *)w->scales + (size_t)r * (size_t)ngroups;
    const float *x = a->xf + (size_t)t * a->stride;  // per group: 32 even, then 32 odd columns
    __m256 SA = _mm256_setzero_ps(), SB = _mm256_setzero_ps(), q[8];
    uint8_t tmp[32];
    float sc[8];  // the scales of groups g0 .. g0 + 7 as floats, each read back as a broadcast (a load alone)
    for (int g0 = 0; g0 < ngroups; g0 += 8) {
        int ng = ngroups - g0 < 8 ? ngroups - g0 : 8;
        _mm256_storeu_ps(sc, chunk_scales(sr, g0, ngroups));
        for (int g = g0; g < g0 + ng; g++) {
            // a row is read once: ask 4 KB ahead (this loop's work per byte leaves the core too few
            // loads in flight to cover the memory's latency; OLMoE-size exact decode 0.87x the time)
            if (g & 1) _mm_prefetch((const char *)wr + (size_t)g * 32 + 4096, _MM_HINT_T0);
            int4_group_floats(int4_group_bytes(wr, g, row_bytes, tmp), q);
            int4_group_dot(q, x + (size_t)g * 64, _mm256_broadcast_ss(&sc[g - g0]), &SA, &SB);
        }
    }
    return tree16_avx2(SA, SB);
}

// Several tokens (prefill, drafts verified together): dot_int4_f32_avx2 for INT4_ROWS_TOKENS tokens
// at a time, each group's weights converted to floats once for all of them instead of once a token:
// the same products and sums per token, so the same bits. Token blocks outermost: a block's
// activations stay in L2 while the task's rows stream past. One thread, 64 tokens, 2048 and 16384
// columns: 1.6-1.7x the multiply-adds a second of a dot per token (3 and 6 tokens a block: no faster).
enum { INT4_ROWS_TOKENS = 4 };
// One block of nt tokens; nt is a constant in each copy (the switch below), so the accumulators
// stay in registers.
AVX2 static inline __attribute__((always_inline)) void int4_rows_block(const QMatrix *w, int r0, int r1,
                                                                       const float *const *xs, int nt,
                                                                       float *const *yrow) {
    int ngroups = (w->cols + INT4_GROUP - 1) / INT4_GROUP;
    size_t row_bytes = ((size_t)w->cols + 1) / 2;
    uint8_t tmp[32];
    for (int r = r0; r < r1; r++) {
        const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * row_bytes;
        const uint16_t *sr = (const uint16_t *)w->scales + (size_t)r * (size_t)ngroups;
        __m256 S[INT4_ROWS_TOKENS][2], q[8];  // S: token i's lanes 0-7 and 8-15
        for (int i = 0; i < nt; i++) S[i][0] = S[i][1] = _mm256_setzero_ps();
        for (int g = 0; g < ngroups; g++) {
            int4_group_floats(int4_group_bytes(wr, g, row_bytes, tmp), q);
            __m256 sc = _mm256_set1_ps(half_to_float(sr[g]));
            for (int i = 0; i < nt; i++) int4_group_dot(q, xs[i] + (size_t)g * 64, sc, &S[i][0], &S[i][1]);
        }
        for (int i = 0; i < nt; i++) yrow[i][r] = tree16_avx2(S[i][0], S[i][1]);
    }
}

AVX2 static void rows_int4_f32_avx2(const QMatrix *w, int r0, int r1, const Acts *a, const int32_t *tok, int n,
                                    float *const *yrow) {
    for (int i0 = 0; i0 < n; i0 += INT4_ROWS_TOKENS) {
        int nt = n - i0 < INT4_ROWS_TOKENS ? n - i0 : INT4_ROWS_TOKENS;
        const float *xs[INT4_ROWS_TOKENS];
        for (int i = 0; i < nt; i++) xs[i] = a->xf + (size_t)(tok != NULL ? tok[i0 + i] : i0 + i) * a->stride;
        switch (nt) {
        case 1: int4_rows_block(w, r0, r1, xs, 1, yrow + i0); break;
        case 2: int4_rows_block(w, r0, r1, xs, 2, yrow + i0); break;
        case 3: int4_rows_block(w, r0, r1, xs, 3, yrow + i0); break;
        default: int4_rows_block(w, r0, r1, xs, 4, yrow + i0); break;
        }
    }
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

// int4 weights x int8 activations, one chunk of 8 groups (512 columns) at a time. Per group g:
// isum[g] = Σ (q + 8)·xq − 8·Σ xq (the nibbles used unsigned; exact in int32), then per chunk
// term = float(isum) · (float32(scale) · xs) for the 8 groups as the 8 lanes, L += term.

// Σ (q + 8)·xq over the 8 groups of a chunk (lane i = group i). `lohi`: per group the 32 low
// nibbles (even columns) then the 32 high ones (odd columns), unpacked; xq: the chunk's 512 values.
// Pair sums <= 2 * 15 * 127, their sum over lo and hi <= 7620: fits int16.
AVX2 static inline __m256i chunk_isum(const uint8_t *lohi, const int8_t *xq) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[8];
    for (int i = 0; i < 8; i++) {
        __m256i lo = _mm256_load_si256((const __m256i *)(lohi + 64 * i));
        __m256i hi = _mm256_load_si256((const __m256i *)(lohi + 64 * i + 32));
        __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(xq + 64 * i))),
                                     _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 64 * i + 32))));
        acc[i] = _mm256_madd_epi16(p, ones);
    }
    return hsum8_epi32(acc);
}

// Unpack the chunk of 8 groups starting at group g0 of a row into `lohi` (512 bytes, 32-aligned).
// Bytes past `row_bytes` in the last group read as q = 0 (nibble 8); groups past `ngroups` as zeros
// (their activations are zero padding, so either adds 0).
AVX2 static inline void chunk_unpack(uint8_t *lohi, const uint8_t *wr, size_t row_bytes, int g0, int ngroups) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    uint8_t tmp[32];
    for (int i = 0; i < 8; i++) {
        if (g0 + i >= ngroups) {  // past the row: its activations are zeros, any weight adds 0
            _mm256_store_si256((__m256i *)(lohi + 64 * i), _mm256_setzero_si256());
            _mm256_store_si256((__m256i *)(lohi + 64 * i + 32), _mm256_setzero_si256());
            continue;
        }
        __m256i b = _mm256_loadu_si256((const __m256i *)int4_group_bytes(wr, g0 + i, row_bytes, tmp));
        _mm256_store_si256((__m256i *)(lohi + 64 * i), _mm256_and_si256(b, low4));
        _mm256_store_si256((__m256i *)(lohi + 64 * i + 32), _mm256_and_si256(_mm256_srli_epi16(b, 4), low4));
    }
}

// The chunk's term for one token: float(isum − 8 Σ xq) · (scale · xs), lanes = groups.
AVX2 static inline __m256 chunk_term(__m256i isum, __m256 ws, const int32_t *xsum, const float *xs) {
    isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)xsum), 3));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(ws, _mm256_loadu_ps(xs)));
}

// An 8 x 8 matrix of 32-bit words, rows r[0..7] -> columns: r[w] lane b = old r[b] lane w.
AVX2 static inline void transpose8_epi32(__m256i *r) {
    __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    __m256i t4 = _mm256_unpacklo_epi32(r[4], r[5]), t5 = _mm256_unpackhi_epi32(r[4], r[5]);
    __m256i t6 = _mm256_unpacklo_epi32(r[6], r[7]), t7 = _mm256_unpackhi_epi32(r[6], r[7]);
    __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
    __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
    __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
    __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
    r[0] = _mm256_permute2x128_si256(u0, u4, 0x20);
    r[1] = _mm256_permute2x128_si256(u1, u5, 0x20);
    r[2] = _mm256_permute2x128_si256(u2, u6, 0x20);
    r[3] = _mm256_permute2x128_si256(u3, u7, 0x20);
    r[4] = _mm256_permute2x128_si256(u0, u4, 0x31);
    r[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
    r[6] = _mm256_permute2x128_si256(u2, u6, 0x31);
    r[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

// The chunk of 8 groups at g0 of row wr, transposed for the several-token rows: wt[w] lane b = word
// w of group b (words 0-7: the low nibbles, 8-15: the high ones). The raw 32-bit words are
// transposed once, then split into nibbles (half the shuffles of splitting first). Groups past the
// row are zeros and bytes past its end 0x88: their activations are zeros, so either adds 0.
AVX2 static inline void chunk_transposed(__m256i *wt, const uint8_t *wr, size_t row_bytes, int g0, int ngroups) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    uint8_t tmp[32];
    __m256i raw[8];
    for (int b = 0; b < 8; b++) {
        raw[b] = g0 + b < ngroups ? _mm256_loadu_si256((const __m256i *)int4_group_bytes(wr, g0 + b, row_bytes, tmp))
                                  : _mm256_setzero_si256();
    }
    transpose8_epi32(raw);  // raw[w] lane b = word w of group b
    for (int v = 0; v < 8; v++) {
        _mm256_store_si256(wt + v, _mm256_and_si256(raw[v], low4));
        _mm256_store_si256(wt + 8 + v, _mm256_and_si256(_mm256_srli_epi16(raw[v], 4), low4));
    }
}

// m tokens t[0..m) (m a constant where inlined: 1, 2 or 4) of one chunk of two rows (wt, wu: their
// transposed chunks; ws, wz: their scales): L[j] and K[j] += each row's terms. Per row and token,
// Σ (q + 8)·xq per group from the weights and activations x[j] (Acts.xt): lane b of every vector
// belongs to group b, so the sums build up lane by lane and need no horizontal step; then
// chunk_term, as the dot. Each weight vector is loaded once for the m tokens, and each load of a
// token's activations feeds both rows' maddubs (one row at a time took 1.34x the time at 32
// tokens, in cache on Zen 3). A maddubs lane is at most 2 * 15 * 127 = 3810 in magnitude, so the
// eight of a half chunk add up in int16 (<= 30480) before one madd widens them: 16 maddubs, 16 adds
// and 2 madds a row and token, where widening every pair took 40 instructions.
AVX2 static inline __attribute__((always_inline)) void chunk_tokens_avx2(const __m256i *wt, const __m256i *wu,
                                                                          const Acts *a, const size_t *t, int m,
                                                                          int g0, __m256 ws, __m256 wz, __m256 *L,
                                                                          __m256 *K) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i *x[4];
    __m256i s[4], u[4], p[4], q[4];
    for (int j = 0; j < m; j++) x[j] = (const __m256i *)(a->xt + t[j] * a->stride + (size_t)g0 * 64);
    // One half chunk at a time, its loops kept rolled: unrolled, GCC scheduled the loads and maddubs
    // of several vectors ahead and spilled the accumulators (4 KB of stack traffic a chunk); rolled,
    // 8 tokens an expert from memory ran 1.33x faster (Zen 3).
#pragma GCC unroll 1
    for (int h = 0; h < 2; h++) {
        __m256i wv = _mm256_load_si256(wt + 8 * h), uv = _mm256_load_si256(wu + 8 * h);
#pragma GCC unroll 4
        for (int j = 0; j < m; j++) {
            __m256i xv = _mm256_loadu_si256(x[j] + 8 * h);
            p[j] = _mm256_maddubs_epi16(wv, xv);
            q[j] = _mm256_maddubs_epi16(uv, xv);
        }
#pragma GCC unroll 1
        for (int v = 1; v < 8; v++) {
            wv = _mm256_load_si256(wt + 8 * h + v);
            uv = _mm256_load_si256(wu + 8 * h + v);
#pragma GCC unroll 4
            for (int j = 0; j < m; j++) {
                __m256i xv = _mm256_loadu_si256(x[j] + 8 * h + v);
                p[j] = _mm256_add_epi16(p[j], _mm256_maddubs_epi16(wv, xv));
                q[j] = _mm256_add_epi16(q[j], _mm256_maddubs_epi16(uv, xv));
            }
        }
#pragma GCC unroll 4
        for (int j = 0; j < m; j++) {
            __m256i d = _mm256_madd_epi16(p[j], ones), e = _mm256_madd_epi16(q[j], ones);
            s[j] = h == 0 ? d : _mm256_add_epi32(s[j], d);
            u[j] = h == 0 ? e : _mm256_add_epi32(u[j], e);
        }
    }
    for (int j = 0; j < m; j++) {
        size_t at = t[j] * (size_t)a->nb8 + (size_t)g0;
        L[j] = _mm256_add_ps(L[j], chunk_term(s[j], ws, a->xsum + at, a->xs + at));
        K[j] = _mm256_add_ps(K[j], chunk_term(u[j], wz, a->xsum + at, a->xs + at));
    }
}

// Rows r0 .. r1-1 for tokens tok[0..n) (NULL: 0..n), n > 1: the rows stream past (asking 4 KB ahead,
// as the one-token dot) in blocks of 16, each block taking the tokens 32 at a time, so that a block's
// weights stay in L1/L2 across those passes and each pass's activations (64 KB for 32 tokens of 2048
// columns) are read from L2 once per 16 rows, not once per row (256 tokens of a 2048 x 2048 matrix,
// one thread: 1.2x faster); within a block two rows at a time, each chunk of a row transposed once
// into wt (L1) for the pass's tokens, 4 at a time — the same integer sums, hence the same operations
// per (row, token) as the one-token dot, whatever n. An odd last row runs as both rows of its pass,
// the second copy's sums dropped. The AVX2 path gives it 4 tokens or more (PATH_AVX2.q8_rows_from).
AVX2 void rows_int4_q8_avx2(const QMatrix *w, int r0, int r1, const Acts *a, const int32_t *tok, int n,
                            float *const *yrow) {
    int ngroups = (w->cols + INT4_GROUP - 1) / INT4_GROUP;
    size_t row_bytes = ((size_t)w->cols + 1) / 2;
    __m256i wt[2][16];
    enum { BLOCK = 32, ROW_BLOCK = 16 };  // tokens per pass over a row; rows that take each block in turn
    __m256 L[2][BLOCK];
    size_t t[BLOCK];
    for (int rb = r0; rb < r1; rb += ROW_BLOCK) {
        int re = r1 - rb < ROW_BLOCK ? r1 : rb + ROW_BLOCK;
        for (int i0 = 0; i0 < n; i0 += BLOCK) {
            int nt = n - i0 < BLOCK ? n - i0 : BLOCK;
            for (int i = 0; i < nt; i++) t[i] = (size_t)(tok != NULL ? tok[i0 + i] : i0 + i);
            for (int r = rb; r < re; r += 2) {
                int pair = r + 1 < re;  // 0: the last row alone (wt[pair] is its own chunk again)
                const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * row_bytes;
                const uint16_t *sr = (const uint16_t *)w->scales + (size_t)r * (size_t)ngroups;
                for (int i = 0; i < nt; i++) L[0][i] = L[1][i] = _mm256_setzero_ps();
                for (int g0 = 0; g0 < a->nb8; g0 += 8) {
                    for (int k = 0; k <= pair; k++) {
                        const uint8_t *wk = wr + (size_t)k * row_bytes;
                        for (int c = 0; c < 256; c += 64) _mm_prefetch((const char *)wk + (size_t)g0 * 32 + 4096 + c, _MM_HINT_T0);
                        chunk_transposed(wt[k], wk, row_bytes, g0, ngroups);
                    }
                    __m256 ws = chunk_scales(sr, g0, ngroups), wz = pair ? chunk_scales(sr + ngroups, g0, ngroups) : ws;
                    int i = 0;
                    for (; i + 4 <= nt; i += 4) chunk_tokens_avx2(wt[0], wt[pair], a, t + i, 4, g0, ws, wz, L[0] + i, L[1] + i);
                    if (nt - i >= 2) {
                        chunk_tokens_avx2(wt[0], wt[pair], a, t + i, 2, g0, ws, wz, L[0] + i, L[1] + i);
                        i += 2;
                    }
                    if (i < nt) chunk_tokens_avx2(wt[0], wt[pair], a, t + i, 1, g0, ws, wz, L[0] + i, L[1] + i);
                }
                for (int i = 0; i < nt; i++) {
                    yrow[i0 + i][r] = tree8_avx2(L[0][i]);
                    if (pair) yrow[i0 + i][r + 1] = tree8_avx2(L[1][i]);
                }
            }
        }
    }
}

// tmp[0..512) = the `left` (< 512) bytes at wp, then zeros (out of line: the hot loop stays small).
static __attribute__((noinline)) void int8_copy_zeros(int8_t *tmp, const int8_t *wp, long left) {
    memset(tmp, 0, 512);
    memcpy(tmp, wp, (size_t)left);
}

// Several tokens, int8 weights x int8 activations: each chunk of 8 blocks (512 weights) of a row is
// transposed once (two 8 x 8 transpositions of words) so that lane b of every vector belongs to
// block b, the layout of Acts.xt: wt[v] lane b = word v of block b, wa[v] its |w|. Each token's 8
// block sums then build up lane by lane with no horizontal step, as dot_int8_q8_avx2's: |w| (u8) x
// sign(q, w) (s8), each maddubs widened by one madd (pair sums <= 2 * 128 * 127 fit int16, two do
// not) — exact in int32 — then that dot's float steps, so the same bits. (Splitting q in nibbles
// so that several pair sums add up in int16 before a madd, with w + 128 unsigned: fewer multiplies
// but more instructions, 1.6x the time on Zen 3.)
AVX2 static inline void int8_chunk_transposed_avx2(__m256i *wt, __m256i *wa, const int8_t *wp, long left) {
    __m256i lo[8], hi[8];  // block b: words 0-7, 8-15; zeros past the row (their activations are zeros)
    if (left >= 512) {
        for (int b = 0; b < 8; b++) {
            lo[b] = _mm256_loadu_si256((const __m256i *)(wp + 64 * b));
            hi[b] = _mm256_loadu_si256((const __m256i *)(wp + 64 * b + 32));
        }
    } else {  // the row's last chunk
        _Alignas(32) int8_t tmp[512];
        int8_copy_zeros(tmp, wp, left);
        for (int b = 0; b < 8; b++) {
            lo[b] = _mm256_load_si256((const __m256i *)(tmp + 64 * b));
            hi[b] = _mm256_load_si256((const __m256i *)(tmp + 64 * b + 32));
        }
    }
    transpose8_epi32(lo);
    transpose8_epi32(hi);
    for (int v = 0; v < 8; v++) {
        _mm256_store_si256(wt + v, lo[v]);
        _mm256_store_si256(wt + 8 + v, hi[v]);
        _mm256_store_si256(wa + v, _mm256_abs_epi8(lo[v]));
        _mm256_store_si256(wa + 8 + v, _mm256_abs_epi8(hi[v]));
    }
}

// m tokens t[0..m) (m a constant where inlined: 1, 2 or 4) of the chunk at block b0: L[j] += terms.
AVX2 static inline __attribute__((always_inline)) void int8_chunk_tokens_avx2(const __m256i *wt, const __m256i *wa,
                                                                               const Acts *a, const size_t *t, int m,
                                                                               int b0, __m256 *L) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i *x[4];
    __m256i s[4];
    for (int j = 0; j < m; j++) {
        x[j] = (const __m256i *)(a->xt + t[j] * a->stride + (size_t)b0 * 64);
        s[j] = _mm256_setzero_si256();
    }
#pragma GCC unroll 2
    for (int v = 0; v < 16; v++) {
        __m256i w = _mm256_load_si256(wt + v), u = _mm256_load_si256(wa + v);
#pragma GCC unroll 4
        for (int j = 0; j < m; j++) {
            __m256i p = _mm256_maddubs_epi16(u, _mm256_sign_epi8(_mm256_load_si256(x[j] + v), w));
            s[j] = _mm256_add_epi32(s[j], _mm256_madd_epi16(p, ones));
        }
    }
    for (int j = 0; j < m; j++) {
        size_t at = t[j] * (size_t)a->nb8 + (size_t)b0;
        L[j] = _mm256_add_ps(L[j], _mm256_mul_ps(_mm256_cvtepi32_ps(s[j]), _mm256_loadu_ps(a->xs + at)));
    }
}

// Rows r0 .. r1-1 for tokens tok[0..n), n > 1: the rows stream past once (asking 4 KB ahead), each
// chunk transposed once into wt / wa (L1) for a block of up to 32 tokens, 4 at a time.
AVX2 static void rows_int8_q8_avx2(const QMatrix *w, int r0, int r1, const Acts *a, const int32_t *tok, int n,
                                   float *const *yrow) {
    int cols = w->cols;
    const float *scale = (const float *)w->scales;
    enum { BLOCK = 32 };  // tokens per pass over a row
    __m256 L[BLOCK];
    size_t t[BLOCK];
    __m256i wt[16], wa[16];
    for (int r = r0; r < r1; r++) {
        const int8_t *wr = (const int8_t *)w->data + (size_t)r * (size_t)cols;
        for (int i0 = 0; i0 < n; i0 += BLOCK) {
            int nt = n - i0 < BLOCK ? n - i0 : BLOCK;
            for (int i = 0; i < nt; i++) {
                t[i] = (size_t)(tok != NULL ? tok[i0 + i] : i0 + i);
                L[i] = _mm256_setzero_ps();
            }
            for (int b0 = 0; b0 < a->nb8; b0 += 8) {
                const int8_t *wp = wr + (size_t)b0 * 64;
                for (int c = 0; c < 512; c += 64) _mm_prefetch((const char *)wp + 4096 + c, _MM_HINT_T0);
                int8_chunk_transposed_avx2(wt, wa, wp, (long)cols - (long)b0 * 64);
                int i = 0;
                for (; i + 4 <= nt; i += 4) int8_chunk_tokens_avx2(wt, wa, a, t + i, 4, b0, L + i);
                if (nt - i >= 2) {
                    int8_chunk_tokens_avx2(wt, wa, a, t + i, 2, b0, L + i);
                    i += 2;
                }
                if (i < nt) int8_chunk_tokens_avx2(wt, wa, a, t + i, 1, b0, L + i);
            }
            for (int i = 0; i < nt; i++) yrow[i0 + i][r] = tree8_avx2(L[i]) * scale[r];
        }
    }
}

// The AVX-512 path's int4 x int8 kernels: vpdpbusd (AVX-512 VNNI: u8 x s8, four products into
// each int32 lane, no saturation) for maddubs + madd + add — the same integer sums, so the same bits.
#define VNNI __attribute__((target("avx2,f16c,avx512f,avx512vl,avx512vnni")))

// Below VNNI_MIN_TOKENS the several-token rows are bound by reading the weights (an MoE expert's
// few tokens: batched requests, drafts verified together, a short prompt), so they stream past
// once, row after row (rows_int4_q8_stream512); from it on, by their arithmetic, so rows_int4_q8_vnni
// takes them in blocks of 8 rows x 16 tokens that keep a chunk of the block's activations in L1.
// 8 OLMoE-size experts from memory (tools/bench_expert_tokens.py, Intel AVX-512 host): streaming
// 8 / 16 tokens 2.6 / 5.0 ms against the blocks' 3.9 / 5.7; 32 tokens 10.6 / 12.4 against 10.0 /
// 13.1; 40 / 56 tokens 18.0 / 26.3 against 12.3 / 18.0.
enum { VNNI_MIN_TOKENS = 32 };

#define VNNI512 __attribute__((target("avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

// The chunk at wp (`left` bytes of the row from there: zeros past them, never read) transposed as
// chunk_transposed's wt, two words per 512-bit vector, the layout of a 64-byte load of Acts.xt:
// wz[k] lanes 0-7 = low-nibble word 2k of groups 0-7, lanes 8-15 = word 2k+1; wz[4 + k] the same
// words' high nibbles. Two two-source permutes and a blend per vector, from the chunk's 4 raw
// vectors (groups 2j, 2j+1 in raw[j]).
VNNI512 static inline void chunk_transposed512(__m512i *wz, const uint8_t *wp, size_t left) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    __m512i raw[4];
    for (int j = 0; j < 4; j++) {
        size_t at = 64 * (size_t)j;
        __mmask64 m = at >= left ? 0 : left - at >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (left - at)) - 1);
        raw[j] = _mm512_maskz_loadu_epi8(m, wp + at);
    }
    // lane l: group l & 7 (its pair of raw vectors: l & 7 < 4 the first two), word 2k + (l >> 3)
    const __m512i idx = _mm512_setr_epi32(0, 8, 16, 24, 0, 8, 16, 24, 1, 9, 17, 25, 1, 9, 17, 25);
    for (int k = 0; k < 4; k++) {
        __m512i ik = _mm512_add_epi32(idx, _mm512_set1_epi32(2 * k));
        __m512i lo4 = _mm512_permutex2var_epi32(raw[0], ik, raw[1]), hi4 = _mm512_permutex2var_epi32(raw[2], ik, raw[3]);
        __m512i v = _mm512_mask_blend_epi32((__mmask16)0xf0f0, lo4, hi4);
        wz[k] = _mm512_and_si512(v, low4);
        wz[4 + k] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
}

// m tokens t[0..m) (m a constant where inlined: 1, 2, 4 or 8) of a chunk: the group sums by vpdpbusd
// in two chains a token, lanes i and i + 8 (two words of group i) added after — exact — then
// L[j] += the term, as the one-token dot.
VNNI512 static inline __attribute__((always_inline)) void chunk_tokens512(const __m512i *wz, const Acts *a,
                                                                          const size_t *t, int m, int g0, __m256 ws,
                                                                          __m256 *L) {
    const __m512i *x[8];
    __m512i s0[8], s1[8];
    for (int j = 0; j < m; j++) {
        x[j] = (const __m512i *)(a->xt + t[j] * a->stride + (size_t)g0 * 64);
        s0[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wz[0], _mm512_loadu_si512(x[j]));
        s1[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wz[1], _mm512_loadu_si512(x[j] + 1));
    }
    for (int k = 2; k < 8; k += 2) {
        for (int j = 0; j < m; j++) {
            s0[j] = _mm512_dpbusd_epi32(s0[j], wz[k], _mm512_loadu_si512(x[j] + k));
            s1[j] = _mm512_dpbusd_epi32(s1[j], wz[k + 1], _mm512_loadu_si512(x[j] + k + 1));
        }
    }
    for (int j = 0; j < m; j++) {
        __m512i s = _mm512_add_epi32(s0[j], s1[j]);
        __m256i isum = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
        size_t at = t[j] * (size_t)a->nb8 + (size_t)g0;
        L[j] = _mm256_add_ps(L[j], chunk_term(isum, ws, a->xsum + at, a->xs + at));
    }
}

// The m tokens t[0..m) of the transposed chunk wz at group g0, 8 at a time: L[j] += terms.
// (Inlined: as a call it took 1.2-1.3x the time at 2-64 tokens.)
VNNI512 static inline __attribute__((always_inline)) void chunk_block512(const __m512i *wz, const Acts *a,
                                                                         const size_t *t, int m, int g0,
                                                                         __m256 ws, __m256 *L) {
    int i = 0;
    for (; i + 8 <= m; i += 8) chunk_tokens512(wz, a, t + i, 8, g0, ws, L + i);
    if (m - i >= 4) {
        chunk_tokens512(wz, a, t + i, 4, g0, ws, L + i);
        i += 4;
    }
    if (m - i >= 2) {
        chunk_tokens512(wz, a, t + i, 2, g0, ws, L + i);
        i += 2;
    }
    if (i < m) chunk_tokens512(wz, a, t + i, 1, g0, ws, L + i);
}

// rows_int4_q8_avx2 with 512-bit VNNI: the rows stream past once (4 KB asked ahead), each chunk
// transposed once per block of up to 16 tokens, 8 tokens at a time — the same integer sums and float
// steps as the one-token dot, so the same bits.
VNNI512 static void rows_int4_q8_stream512(const QMatrix *w, int r0, int r1, const Acts *a, const int32_t *tok, int n,
                                           float *const *yrow) {
    int ngroups = (w->cols + INT4_GROUP - 1) / INT4_GROUP;
    size_t row_bytes = ((size_t)w->cols + 1) / 2;
    enum { BLOCK = 16 };  // tokens per pass over a row
    __m256 L[BLOCK];
    size_t t[BLOCK];
    __m512i wz[8];
    for (int r = r0; r < r1; r++) {
        const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * row_bytes;
        const uint16_t *sr = (const uint16_t *)w->scales + (size_t)r * (size_t)ngroups;
        for (int i0 = 0; i0 < n; i0 += BLOCK) {
            int nt = n - i0 < BLOCK ? n - i0 : BLOCK;
            for (int i = 0; i < nt; i++) {
                t[i] = (size_t)(tok != NULL ? tok[i0 + i] : i0 + i);
                L[i] = _mm256_setzero_ps();
            }
            for (int g0 = 0; g0 < a->nb8; g0 += 8) {
                const uint8_t *wp = wr + (size_t)g0 * 32;
                for (int c = 0; c < 256; c += 64) _mm_prefetch((const char *)wp + 4096 + c, _MM_HINT_T0);
                chunk_transposed512(wz, wp, row_bytes - (size_t)g0 * 32);  // g0 < ngroups: nb8 rounds them up
                __m256 ws = chunk_scales(sr, g0, ngroups);
                chunk_block512(wz, a, t, nt, g0, ws, L);
            }
            for (int i = 0; i < nt; i++) yrow[i0 + i][r] = tree8_avx2(L[i]);
        }
    }
}

// rows_int4_q8_stream512 in blocks of RB rows x BLOCK tokens, chunk by chunk: each chunk of a
// row transposed once in 512-bit registers for the block's tokens, 8 at a time, while that chunk of
// their activations (8 KB) stays in L1 for the 8 rows — the same integer sums and float steps, so
// the same bits. (Before, the blocks ran 256-bit vpdpbusd on chunk_transposed's layout, 4 tokens at
// a time: OLMoE-size prefill of 256 tokens 88-95 -> 102-110 tok/s, 8 experts x 128 tokens 86 -> 41 ms.)
VNNI512 void rows_int4_q8_vnni(const QMatrix *w, int r0, int r1, const Acts *a, const int32_t *tok, int n,
                               float *const *yrow) {
    if (n < VNNI_MIN_TOKENS) {
        rows_int4_q8_stream512(w, r0, r1, a, tok, n, yrow);
        return;
    }
    int ngroups = (w->cols + INT4_GROUP - 1) / INT4_GROUP;
    size_t row_bytes = ((size_t)w->cols + 1) / 2;
    __m512i wz[8];
    enum { BLOCK = 16, RB = 8 };  // tokens, rows per pass: a chunk of the block's activations stays in L1
    __m256 L[RB][BLOCK];
    size_t t[BLOCK];
    for (int i0 = 0; i0 < n; i0 += BLOCK) {
        int nt = n - i0 < BLOCK ? n - i0 : BLOCK;
        for (int i = 0; i < nt; i++) t[i] = (size_t)(tok != NULL ? tok[i0 + i] : i0 + i);
        for (int rb = r0; rb < r1; rb += RB) {
            int nr = r1 - rb < RB ? r1 - rb : RB;
            for (int r = 0; r < nr; r++) for (int i = 0; i < nt; i++) L[r][i] = _mm256_setzero_ps();
            for (int g0 = 0; g0 < a->nb8; g0 += 8) {
                for (int r = 0; r < nr; r++) {
                    const uint8_t *wr = (const uint8_t *)w->data + (size_t)(rb + r) * row_bytes;
                    const uint16_t *sr = (const uint16_t *)w->scales + (size_t)(rb + r) * (size_t)ngroups;
                    chunk_transposed512(wz, wr + (size_t)g0 * 32, row_bytes - (size_t)g0 * 32);
                    __m256 ws = chunk_scales(sr, g0, ngroups);
                    chunk_block512(wz, a, t, nt, g0, ws, L[r]);
                }
            }
            for (int r = 0; r < nr; r++) for (int i = 0; i < nt; i++) yrow[i0 + i][rb + r] = tree8_avx2(L[r][i]);
        }
    }
}

// Σ (q + 8)·xq of one whole group straight from the weights: 8 int32 lanes of partial sums.
AVX2 static inline __m256i group_isum_direct(const uint8_t *wp, const int8_t *x) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256i b = _mm256_loadu_si256((const __m256i *)wp);
    __m256i lo = _mm256_and_si256(b, low4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
    __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)x)),
                                 _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 32))));
    return _mm256_madd_epi16(p, ones);
}

// Σ (q + 8)·xq of `n` (<= 8) whole groups of a chunk straight from the weights (lane i = group i;
// lanes n..7 zero, as chunk_isum gives for groups past the row), asking for the bytes 4 KB ahead
// first: a row is read once, so the memory keeps several requests in flight (+20 % GB/s on one
// thread here).
AVX2 static inline __m256i chunk_isum_direct(const uint8_t *wp, const int8_t *xq, int n) {
    for (int c = 0; c < 32 * n; c += 64) _mm_prefetch((const char *)wp + 4096 + c, _MM_HINT_T0);
    __m256i acc[8];
    for (int i = 0; i < 8; i++)
        acc[i] = i < n ? group_isum_direct(wp + (size_t)i * 32, xq + (size_t)i * 64) : _mm256_setzero_si256();
    return hsum8_epi32(acc);
}

// chunk_isum_direct for n <= 4 groups: lanes 0..n-1 their sums, the rest zero (the same integers)
// with half the horizontal work. Qwen3-30B-A3B's expert down rows (768 columns) end in such a
// half chunk: 16 matrices of 2048 x 768 in one call, this and the 8-group version alternated call by
// call, 19.9 -> 22.7 GB/s. (One function for both, choosing its width at run time, was 6-8 % slower
// on these rows.)
AVX2 static inline __m256i chunk_isum_direct4(const uint8_t *wp, const int8_t *xq, int n) {
    for (int c = 0; c < 32 * n; c += 64) _mm_prefetch((const char *)wp + 4096 + c, _MM_HINT_T0);
    __m256i acc[4];
    for (int i = 0; i < 4; i++)
        acc[i] = i < n ? group_isum_direct(wp + (size_t)i * 32, xq + (size_t)i * 64) : _mm256_setzero_si256();
    __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[0], acc[1]), _mm256_hadd_epi32(acc[2], acc[3]));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    return _mm256_inserti128_si256(_mm256_setzero_si256(), s, 0);
}

// Σ (q + 8)·xq of a chunk's 8 whole groups (chunk_isum_direct's lanes).
typedef __m256i (*chunk_isum_fn)(const uint8_t *wp, const int8_t *xq);

AVX2 static inline __m256i chunk_isum_direct8(const uint8_t *wp, const int8_t *xq) { return chunk_isum_direct(wp, xq, 8); }

// One token: chunks straight from the weights (no unpacked copy), the row's last partial chunk too
// when its groups are whole (cols a multiple of 64: Qwen3-30B-A3B's expert down rows of 768 are
// 1.5 chunks); only a row ending inside a group goes through the copy. `whole` sums the chunks of
// 8 whole groups (inlined: each caller passes its own).
AVX2 static inline __attribute__((always_inline)) float dot_int4_q8_chunks(const QMatrix *w, int r, const Acts *a,
                                                                            int t, chunk_isum_fn whole) {
    int ngroups = (w->cols + INT4_GROUP - 1) / INT4_GROUP;
    size_t row_bytes = ((size_t)w->cols + 1) / 2;
    const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * row_bytes;
    const uint16_t *sr = (const uint16_t *)w->scales + (size_t)r * (size_t)ngroups;
    const int8_t *xq = a->xq + (size_t)t * a->stride;
    const float *xs = a->xs + (size_t)t * (size_t)a->nb8;
    const int32_t *xsum = a->xsum + (size_t)t * (size_t)a->nb8;
    int short_end = row_bytes != (size_t)ngroups * 32;  // the last group ends inside its 32 bytes
    __m256 L = _mm256_setzero_ps();
    for (int g0 = 0; g0 < a->nb8; g0 += 8) {
        __m256i isum;
        if (!short_end || g0 + 8 < ngroups) {  // every group of the chunk whole
            int n = ngroups - g0 < 8 ? ngroups - g0 : 8;
            isum = n == 8  ? whole(wr + (size_t)g0 * 32, xq + (size_t)g0 * 64)
                 : n <= 4 ? chunk_isum_direct4(wr + (size_t)g0 * 32, xq + (size_t)g0 * 64, n)
                           : chunk_isum_direct(wr + (size_t)g0 * 32, xq + (size_t)g0 * 64, n);
        } else {
            _Alignas(32) uint8_t lohi[512];
            chunk_unpack(lohi, wr, row_bytes, g0, ngroups);
            isum = chunk_isum(lohi, xq + (size_t)g0 * 64);
        }
        L = _mm256_add_ps(L, chunk_term(isum, chunk_scales(sr, g0, ngroups), xsum + g0, xs + g0));
    }
    return tree8_avx2(L);
}

AVX2 float dot_int4_q8_avx2(const QMatrix *w, int r, const Acts *a, int t) {
    return dot_int4_q8_chunks(w, r, a, t, chunk_isum_direct8);
}

// chunk_isum_direct for a chunk's 8 whole groups with VNNI (256-bit): vpdpbusd, four u8 x s8
// products into each int32 lane, for maddubs + madd + add — the same integers, one vector
// instruction fewer per group. The low and high nibbles' sums are two independent vpdpbusd, added
// after: chained (the second accumulating into the first) this path's one-token decode took 1.08x
// the AVX2 path's time on an Intel AVX-512 host (2026-12-03), split 0.93x, from memory.
VNNI static inline __m256i chunk_isum_vnni(const uint8_t *wp, const int8_t *xq) {
    for (int c = 0; c < 256; c += 64) _mm_prefetch((const char *)wp + 4096 + c, _MM_HINT_T0);
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    __m256i acc[8];
    for (int i = 0; i < 8; i++) {
        __m256i b = _mm256_loadu_si256((const __m256i *)(wp + 32 * i));
        __m256i lo = _mm256_and_si256(b, low4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
        const __m256i *x = (const __m256i *)(xq + 64 * i);
        acc[i] = _mm256_add_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, _mm256_loadu_si256(x)),
                                  _mm256_dpbusd_epi32(_mm256_setzero_si256(), hi, _mm256_loadu_si256(x + 1)));
    }
    return hsum8_epi32(acc);
}

// The AVX-512 path's one-token dot: dot_int4_q8_avx2 with the whole chunks' sums from
// chunk_isum_vnni — the same integers and float steps, so the same bits.
VNNI float dot_int4_q8_vnni(const QMatrix *w, int r, const Acts *a, int t) {
    return dot_int4_q8_chunks(w, r, a, t, chunk_isum_vnni);
}

// ----------------------------------------------------------------------------
// The AMX path's several-token rows with int8 activations: the block sums on the tile unit (AMX-INT8).
// tdpbusd (tdpbssd) multiplies a tile of 16 rows x 64 u8 (s8) by one of 16 four-byte words x 16
// tokens (s8), four products into each int32: with a 64-column block of 16 weight rows as A (int4:
// its nibbles, unpacked) and the tokens' 64 activations of that block as B, it gives Σ (q + 8)·xq
// (int8: Σ w·xq) of 16 rows x 16 tokens at once, the same integers as vpdpbusd's. The float steps
// then run per (row, block) with the tokens as the lanes (the one-token dot's operations per lane;
// L[r][g % 8] is lane g % 8 of that row's L), and tree8_avx2 sums each row and token's 8 lanes, so
// the same bits as the one-token dot.
#define AMX __attribute__((target("avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];  // bytes per row of tile i
    uint8_t rows[16];    // rows of tile i
} TileConfig;

// 16 rows of 16 int32 -> columns: r[w] lane n = old r[n] lane w.
AMX static inline void transpose16_epi32(__m512i *r) {
    __m512i a[16], b[16];
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {  // b[4i + j], 128-bit lane L: word 4L + j of rows 4i .. 4i+3
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        __m512i c0 = _mm512_shuffle_i32x4(b[j], b[4 + j], _MM_SHUFFLE(2, 0, 2, 0));
        __m512i c1 = _mm512_shuffle_i32x4(b[j], b[4 + j], _MM_SHUFFLE(3, 1, 3, 1));
        __m512i d0 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], _MM_SHUFFLE(2, 0, 2, 0));
        __m512i d1 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], _MM_SHUFFLE(3, 1, 3, 1));
        r[j] = _mm512_shuffle_i32x4(c0, d0, _MM_SHUFFLE(2, 0, 2, 0));
        r[8 + j] = _mm512_shuffle_i32x4(c0, d0, _MM_SHUFFLE(3, 1, 3, 1));
        r[4 + j] = _mm512_shuffle_i32x4(c1, d1, _MM_SHUFFLE(2, 0, 2, 0));
        r[12 + j] = _mm512_shuffle_i32x4(c1, d1, _MM_SHUFFLE(3, 1, 3, 1));
    }
}

enum { AMX_ROWS = 16, AMX_TOKENS = 16 };  // a tile's rows of weights, tokens

// What the tiles read for one block of up to 16 tokens t[0..nt) (zeros for the others): per block
// of 64 columns g < nb8, B[g] the tokens' activations as tdpbusd's B (word k of token n at [k][n]),
// x8[g] their 8·Σxq, xs[g] their scales, with the tokens as the lanes.
typedef struct {
    int32_t (*B)[16][16];
    int32_t (*x8)[16];
    float (*xs)[16];
} AmxTokens;

AMX static void amx_tokens(AmxTokens *k, const Acts *a, const size_t *t, int nt) {
    for (int g = 0; g < a->nb8; g++) {
        __m512i r[16];
        for (int n = 0; n < 16; n++) {
            r[n] = n < nt ? _mm512_loadu_si512(a->xq + t[n] * a->stride + (size_t)g * 64) : _mm512_setzero_si512();
            size_t at = n < nt ? t[n] * (size_t)a->nb8 + (size_t)g : 0;
            k->x8[g][n] = n < nt ? a->xsum[at] * 8 : 0;
            k->xs[g][n] = n < nt ? a->xs[at] : 0.0f;
        }
        transpose16_epi32(r);
        for (int w = 0; w < 16; w++) _mm512_store_si512(k->B[g][w], r[w]);
    }
}

// Group g of int4 rows rb .. rb+nr-1 (nr <= 16) as an A tile, 16 rows of 64 bytes: per row the
// group's 32 low nibbles, then its 32 high ones; zeros past the row (its activations are zeros there).
AMX static inline void amx_int4_group(uint8_t *tile, const QMatrix *w, int rb, int nr, int g, size_t row_bytes) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    size_t at = (size_t)g * 32;
    __mmask32 m = at >= row_bytes ? 0 : row_bytes - at >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << (row_bytes - at)) - 1);
    const uint8_t *wr = (const uint8_t *)w->data + (size_t)rb * row_bytes + at;
    for (int r = 0; r < nr; r++, wr += row_bytes) {
        __m256i v = _mm256_maskz_loadu_epi8(m, wr);
        _mm256_store_si256((__m256i *)(tile + 64 * r), _mm256_and_si256(v, low4));
        _mm256_store_si256((__m256i *)(tile + 64 * r + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
    }
}

// What rows rb .. rb+nr-1 (nr <= 16) need besides their A tiles. int4: their float32 scales at
// ws + r·nb8 (chunk_scales': 0 past the last group). int8, where the tiles cannot read the weights in
// place (`copy`): the rows copied to A, row r's block g at A + r·ulen + 64g, zeros past the row.
AMX static void amx_rows(uint8_t *A, float *ws, const QMatrix *w, int rb, int nr, const Acts *a, int copy) {
    size_t ulen = (size_t)a->nb8 * 64;
    if (w->kind == QKIND_INT8) {
        for (int r = 0; r < nr && copy; r++) {
            memcpy(A + (size_t)r * ulen, (const int8_t *)w->data + (size_t)(rb + r) * (size_t)w->cols, (size_t)w->cols);
            memset(A + (size_t)r * ulen + w->cols, 0, ulen - (size_t)w->cols);
        }
        return;
    }
    int ngroups = (w->cols + INT4_GROUP - 1) / INT4_GROUP;
    for (int r = 0; r < nr; r++) {
        const uint16_t *sr = (const uint16_t *)w->scales + (size_t)(rb + r) * (size_t)ngroups;
        for (int g0 = 0; g0 < a->nb8; g0 += 8) _mm256_storeu_ps(ws + (size_t)r * a->nb8 + g0, chunk_scales(sr, g0, ngroups));
    }
}

// AMX_BLOCKS: token blocks a pass over the rows takes. int4 groups are unpacked into a ring of
// AMX_RING A tiles, each AMX_AHEAD groups before its product: a row block unpacked whole (32 KB at
// 2048 columns) left the tiles and B's 1 KB a group to contend for L1 (16 tokens, one core, weights
// in L2: 82 -> 60 ns a block of 16 rows and a group, alternated in one process); int8 rows are read
// by the tiles in place where whole (16 rows, every column of the blocks), not copied (102 -> 64).
enum { AMX_BLOCKS = 4, AMX_RING = 8, AMX_AHEAD = 4 };

// A thread's scratch, kept from call to call (grown when a call needs more) and freed when the
// thread ends: a fresh allocation each call faulted its pages in again, and the page faults
// serialised the threads. The first 64 bytes hold its size.
static pthread_key_t amx_key;
static pthread_once_t amx_key_once = PTHREAD_ONCE_INIT;

static void amx_key_make(void) { pthread_key_create(&amx_key, free); }

static uint8_t *amx_scratch(size_t bytes) {
    pthread_once(&amx_key_once, amx_key_make);
    size_t *have = pthread_getspecific(amx_key);
    if (have != NULL && *have >= bytes) return (uint8_t *)have + 64;
    free(have);
    have = aligned_alloc(64, 64 + (bytes + 63) / 64 * 64);
    if (have != NULL) *have = bytes;
    pthread_setspecific(amx_key, have);
    return have != NULL ? (uint8_t *)have + 64 : NULL;
}

AMX void rows_q8_tiles(const QMatrix *w, int r0, int r1, const Acts *a, const int32_t *tok, int n,
                       float *const *yrow) {
    int nb8 = a->nb8, int8 = w->kind == QKIND_INT8;
    size_t ulen = (size_t)nb8 * 64, row_bytes = int8 ? (size_t)w->cols : ((size_t)w->cols + 1) / 2;
    // AMX_BLOCKS token blocks (B: 1 KB a group, x8, xs), then one row block's A, scales, lanes L, two groups' sums
    size_t tok_bytes = (size_t)nb8 * (sizeof(int32_t[16][16]) + sizeof(int32_t[16]) + sizeof(float[16]));
    size_t bytes = AMX_BLOCKS * tok_bytes + AMX_ROWS * ulen + AMX_ROWS * (size_t)nb8 * sizeof(float) +
                   sizeof(float[AMX_ROWS][8][AMX_TOKENS]) + sizeof(int32_t[2][AMX_ROWS][AMX_TOKENS]);
    uint8_t *at = amx_scratch(bytes);
    if (at == NULL) {  // no memory: the rows are NaN rather than wrong
        for (int i = 0; i < n; i++) for (int r = r0; r < r1; r++) yrow[i][r] = NAN;
        return;
    }
    AmxTokens blocks[AMX_BLOCKS];
    for (int b = 0; b < AMX_BLOCKS; b++) {
        blocks[b].B = (int32_t (*)[16][16])at, at += (size_t)nb8 * sizeof(int32_t[16][16]);
        blocks[b].x8 = (int32_t (*)[16])at, at += (size_t)nb8 * sizeof(int32_t[16]);
        blocks[b].xs = (float (*)[16])at, at += (size_t)nb8 * sizeof(float[16]);
    }
    uint8_t *A = at;
    float *ws = (float *)(A + AMX_ROWS * ulen);
    float (*L)[8][AMX_TOKENS] = (float (*)[8][AMX_TOKENS])(ws + AMX_ROWS * (size_t)nb8);
    int32_t (*C)[AMX_ROWS][AMX_TOKENS] = (int32_t (*)[AMX_ROWS][AMX_TOKENS])(L + AMX_ROWS);  // two groups' sums

    TileConfig cfg;  // tiles 0-2: an even group's sums (16 rows x 16 tokens), A, B; 3-5: an odd group's
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 6; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64;
    _tile_loadconfig(&cfg);
    // A group's sums: on the tile unit, then into C[g & 1] (tile numbers are immediates: a copy for each
    // parity of g). A tile store waits for its product, so each is issued a group before it is stored.
#define AMX_PRODUCT(c, at, bt, g)                               \
    do {                                                        \
        _tile_zero(c);                                          \
        _tile_loadd(at, a_base + (size_t)((g) % a_mod) * a_step, a_stride); \
        _tile_loadd(bt, k->B[g], 64);                           \
        if (int8) _tile_dpbssd(c, at, bt);                      \
        else _tile_dpbusd(c, at, bt);                           \
    } while (0)
#define AMX_STORE(c, g) _tile_stored(c, C[(g) & 1], sizeof(C[0][0]))
    for (int i0 = 0; i0 < n; i0 += AMX_BLOCKS * AMX_TOKENS) {  // a pass: up to AMX_BLOCKS blocks of 16 tokens
        int nblocks = 0;
        for (int i = i0; i < n && nblocks < AMX_BLOCKS; i += AMX_TOKENS, nblocks++) {
            size_t t[AMX_TOKENS];
            int nt = n - i < AMX_TOKENS ? n - i : AMX_TOKENS;
            for (int m = 0; m < nt; m++) t[m] = (size_t)(tok != NULL ? tok[i + m] : i + m);
            amx_tokens(&blocks[nblocks], a, t, nt);
        }
        for (int rb = r0; rb < r1; rb += AMX_ROWS) {
            int nr = r1 - rb < AMX_ROWS ? r1 - rb : AMX_ROWS;  // A's rows past nr: their sums are not used
            // group g's A tile at a_base + (g % a_mod)·a_step, its rows a_stride bytes apart: int4, a
            // slot of the ring (with several token blocks, a slot per group: unpacked in the first
            // block's pass, read again by the others); int8, the weights in place, or else their copy in A
            int in_place = int8 && nr == AMX_ROWS && ulen == row_bytes;
            const uint8_t *a_base = in_place ? (const uint8_t *)w->data + (size_t)rb * row_bytes : A;
            int a_mod = int8 || nblocks > 1 ? nb8 : AMX_RING;
            size_t a_step = int8 ? 64 : sizeof(uint8_t[AMX_ROWS][64]), a_stride = in_place ? row_bytes : int8 ? ulen : 64;
            amx_rows(A, ws, w, rb, nr, a, !in_place);
            // the next block's weights are asked for while this one computes, a share each group
            int next_rows = r1 - rb - AMX_ROWS < AMX_ROWS ? r1 - rb - AMX_ROWS : AMX_ROWS;
            size_t next_bytes = next_rows > 0 ? (size_t)next_rows * row_bytes : 0;
            size_t per_group = (next_bytes / (size_t)nb8 + 64) & ~(size_t)63;
            const char *next = (const char *)w->data + (size_t)(rb + AMX_ROWS) * row_bytes;
            for (int b = 0; b < nblocks; b++) {
                int i = i0 + b * AMX_TOKENS, nt = n - i < AMX_TOKENS ? n - i : AMX_TOKENS;
                const AmxTokens *k = &blocks[b];
                int unpack = !int8 && b == 0;  // int4: the first block's pass unpacks the groups, AMX_AHEAD ahead
                for (int r = 0; r < nr; r++) for (int l = 0; l < 8; l++) _mm512_store_ps(L[r][l], _mm512_setzero_ps());
                for (int g = 0; unpack && g < AMX_AHEAD; g++) amx_int4_group(A + (size_t)g * a_step, w, rb, nr, g, row_bytes);
                AMX_PRODUCT(0, 1, 2, 0);  // nb8 is a multiple of 8
                AMX_STORE(0, 0);
                AMX_PRODUCT(3, 4, 5, 1);
                for (int g = 0; g < nb8; g++) {  // the tile unit works two groups ahead of the float steps
                    if (unpack && g + AMX_AHEAD < nb8)
                        amx_int4_group(A + (size_t)((g + AMX_AHEAD) % a_mod) * a_step, w, rb, nr, g + AMX_AHEAD, row_bytes);
                    if ((g & 1) == 0) {
                        if (g + 1 < nb8) AMX_STORE(3, g + 1);
                        if (g + 2 < nb8) AMX_PRODUCT(0, 1, 2, g + 2);
                    } else {
                        if (g + 1 < nb8) AMX_STORE(0, g + 1);
                        if (g + 2 < nb8) AMX_PRODUCT(3, 4, 5, g + 2);
                    }
                    for (size_t c = (size_t)g * per_group; b == 0 && c < (size_t)(g + 1) * per_group && c < next_bytes; c += 64)
                        _mm_prefetch(next + c, _MM_HINT_T0);
                    __m512i x8 = _mm512_load_si512(k->x8[g]);
                    __m512 xs = _mm512_load_ps(k->xs[g]);
                    for (int r = 0; r < nr; r++) {
                        // int8, dot_int8_q8's steps: float(isum) · xs; int4, chunk_term's: float(isum − 8 Σxq) · (scale · xs)
                        __m512i isum = _mm512_load_si512(C[g & 1][r]);
                        __m512 term = int8 ? _mm512_mul_ps(_mm512_cvtepi32_ps(isum), xs)
                                           : _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(isum, x8)),
                                                           _mm512_mul_ps(_mm512_set1_ps(ws[(size_t)r * nb8 + g]), xs));
                        _mm512_store_ps(L[r][g & 7], _mm512_add_ps(_mm512_load_ps(L[r][g & 7]), term));
                    }
                }
                __m512i y[AMX_ROWS];  // y[r] lane m: row rb + r, token i + m; then transposed
                for (int r = 0; r < AMX_ROWS; r++) {  // tree8_avx2 of each token's 8 lanes, the tokens as the lanes
                    if (r >= nr) {
                        y[r] = _mm512_setzero_si512();
                        continue;
                    }
                    __m512 s4[4], s2[2];
                    for (int l = 0; l < 4; l++) s4[l] = _mm512_add_ps(_mm512_load_ps(L[r][l]), _mm512_load_ps(L[r][l + 4]));
                    for (int l = 0; l < 2; l++) s2[l] = _mm512_add_ps(s4[l], s4[l + 2]);
                    __m512 sum = _mm512_add_ps(s2[0], s2[1]);
                    if (int8) sum = _mm512_mul_ps(sum, _mm512_set1_ps(((const float *)w->scales)[rb + r]));  // the row's scale
                    y[r] = _mm512_castps_si512(sum);
                }
                transpose16_epi32(y);  // y[m] lane r
                for (int m = 0; m < nt; m++) _mm512_mask_storeu_epi32(yrow[i + m] + rb, (__mmask16)((1u << nr) - 1), y[m]);
            }
        }
    }
#undef AMX_PRODUCT
#undef AMX_STORE
    _tile_release();
}

// ----------------------------------------------------------------------------
// fp8 and fp4 weights (ACT_F32); the AVX-512 path uses these too.

// 32 e4m3 bytes -> the floats of columns 0-7, 8-15, 16-23 and 24-31 (f[0..3]), exactly: each byte
// becomes a float16 holding e4m3 · 2^-8 (its sign bit, then its 7 magnitude bits as the half's
// exponent and mantissa, so subnormals stay subnormals), F16C converts, · 256. With `nan`, the
// magnitude 0x7f (NaN) becomes a half NaN first (without, it would read 480).
AVX2 static inline void e4m3x32(__m256i q, int nan, __m256 *f) {
    const __m256i zero = _mm256_setzero_si256(), keep = _mm256_set1_epi16((short)0xbfff);
    __m256i h0 = _mm256_and_si256(_mm256_srai_epi16(_mm256_unpacklo_epi8(zero, q), 1), keep);  // bytes 0-7 | 16-23
    __m256i h1 = _mm256_and_si256(_mm256_srai_epi16(_mm256_unpackhi_epi8(zero, q), 1), keep);  // bytes 8-15 | 24-31
    if (nan) {
        const __m256i mag = _mm256_set1_epi16(0x7fff), max = _mm256_set1_epi16(0x3f80), inf = _mm256_set1_epi16(0x7c00);
        h0 = _mm256_or_si256(h0, _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(h0, mag), max), inf));
        h1 = _mm256_or_si256(h1, _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(h1, mag), max), inf));
    }
    const __m256 k256 = _mm256_set1_ps(256.0f);
    f[0] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h0)), k256);
    f[1] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h1)), k256);
    f[2] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h0, 1)), k256);
    f[3] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h1, 1)), k256);
}

// Whether any of a block's 128 e4m3 bytes (4 vectors) is NaN (magnitude 0x7f).
AVX2 static inline int e4m3_any_nan(const __m256i *q) {
    const __m256i k = _mm256_set1_epi8(0x7f);
    __m256i m = _mm256_cmpeq_epi8(_mm256_and_si256(q[0], k), k);
    for (int i = 1; i < 4; i++) m = _mm256_or_si256(m, _mm256_cmpeq_epi8(_mm256_and_si256(q[i], k), k));
    return !_mm256_testz_si256(m, m);
}

// A block's 128 e4m3 bytes -> 128 floats in column order (32-aligned).
AVX2 static inline void e4m3_block(const uint8_t *bp, float *wf) {
    __m256i q[4];
    for (int p = 0; p < 4; p++) q[p] = _mm256_loadu_si256((const __m256i *)(bp + 32 * p));
    int nan = e4m3_any_nan(q);
    for (int p = 0; p < 4; p++) {
        __m256 f[4];
        e4m3x32(q[p], nan, f);
        for (int i = 0; i < 4; i++) _mm256_store_ps(wf + 32 * p + 8 * i, f[i]);
    }
}

AVX2 float dot_fp8_f32_avx2(const QMatrix *w, int r, const Acts *a, int t) {
    int cols = w->cols, nblocks = (cols + FP8_BLOCK - 1) / FP8_BLOCK;
    const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * (size_t)cols;
    const uint8_t *sr = (const uint8_t *)w->scales + (size_t)(r / FP8_BLOCK) * (size_t)nblocks;
    const float *x = a->xf + (size_t)t * a->stride;  // zero padded to whole blocks
    __m256 SA = _mm256_setzero_ps(), SB = _mm256_setzero_ps();
    uint8_t tmp[FP8_BLOCK];
    for (int b = 0; b < nblocks; b++) {
        const uint8_t *bp = wr + (size_t)b * FP8_BLOCK;
        if (b * FP8_BLOCK + FP8_BLOCK > cols) {  // the row's last, short block: zeros past cols
            memset(tmp, 0, sizeof tmp);
            memcpy(tmp, bp, (size_t)(cols - b * FP8_BLOCK));
            bp = tmp;
        } else {
            _mm_prefetch((const char *)bp + 2048, _MM_HINT_T0);  // a row is read once: ask ahead
            _mm_prefetch((const char *)bp + 2048 + 64, _MM_HINT_T0);
        }
        const float *xb = x + (size_t)b * FP8_BLOCK;
        __m256i q[4];
        for (int p = 0; p < 4; p++) q[p] = _mm256_loadu_si256((const __m256i *)(bp + 32 * p));
        int nan = e4m3_any_nan(q);
        __m256 f[4];
        e4m3x32(q[0], nan, f);  // columns 0-31: steps 0 and 1 of lanes A (0-7) and B (8-15)
        __m256 A = _mm256_mul_ps(f[0], _mm256_loadu_ps(xb)), B = _mm256_mul_ps(f[1], _mm256_loadu_ps(xb + 8));
        A = _mm256_add_ps(A, _mm256_mul_ps(f[2], _mm256_loadu_ps(xb + 16)));
        B = _mm256_add_ps(B, _mm256_mul_ps(f[3], _mm256_loadu_ps(xb + 24)));
        for (int p = 1; p < 4; p++) {
            e4m3x32(q[p], nan, f);
            const float *xp = xb + 32 * p;
            A = _mm256_add_ps(A, _mm256_mul_ps(f[0], _mm256_loadu_ps(xp)));
            B = _mm256_add_ps(B, _mm256_mul_ps(f[1], _mm256_loadu_ps(xp + 8)));
            A = _mm256_add_ps(A, _mm256_mul_ps(f[2], _mm256_loadu_ps(xp + 16)));
            B = _mm256_add_ps(B, _mm256_mul_ps(f[3], _mm256_loadu_ps(xp + 24)));
        }
        __m256 sc = _mm256_set1_ps(fp8_scale(sr[b]));
        SA = _mm256_add_ps(SA, _mm256_mul_ps(A, sc));
        SB = _mm256_add_ps(SB, _mm256_mul_ps(B, sc));
    }
    return tree16_avx2(SA, SB);
}

// A group's 32 fp4 weights (16 bytes: even column low nibble) as the floats 2·e2m1 (FP4_TWICE):
// f[0], f[1] the even columns 0-7, 8-15; f[2], f[3] the odd ones. Those values in float16 all have
// a zero low byte, so one pshufb of a table of their high bytes, a byte interleave with zeros and
// F16C's exact conversion make them (+0 for nibble 8, as FP4_TWICE's 0): no lane-crossing sign
// extension (`vpmovsxbd` from a register held both of Zen 3's shuffle pipes), 1.11-1.15x the dot
// in cache and from memory, one thread.
AVX2 static inline void fp4_group_floats(const uint8_t *bp, __m256 f[4]) {
    const __m128i low4 = _mm_set1_epi8(0x0f), zero = _mm_setzero_si128(),
                  half_hi = _mm_setr_epi8(0x00, 0x3c, 0x40, 0x42, 0x44, 0x46, 0x48, 0x4a, 0x00, (char)0xbc, (char)0xc0,
                                          (char)0xc2, (char)0xc4, (char)0xc6, (char)0xc8, (char)0xca);
    __m128i b = _mm_loadu_si128((const __m128i *)bp);
    __m128i lo = _mm_shuffle_epi8(half_hi, _mm_and_si128(b, low4));                      // even columns
    __m128i hi = _mm_shuffle_epi8(half_hi, _mm_and_si128(_mm_srli_epi16(b, 4), low4));  // odd columns
    f[0] = _mm256_cvtph_ps(_mm_unpacklo_epi8(zero, lo));
    f[1] = _mm256_cvtph_ps(_mm_unpackhi_epi8(zero, lo));
    f[2] = _mm256_cvtph_ps(_mm_unpacklo_epi8(zero, hi));
    f[3] = _mm256_cvtph_ps(_mm_unpackhi_epi8(zero, hi));
}

AVX2 float dot_fp4_f32_avx2(const QMatrix *w, int r, const Acts *a, int t) {
    int cols = w->cols, ngroups = (cols + FP4_GROUP - 1) / FP4_GROUP;
    size_t row_bytes = ((size_t)cols + 1) / 2;
    const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * row_bytes;
    const uint8_t *sr = (const uint8_t *)w->scales + (size_t)r * (size_t)ngroups;
    const float *x = a->xf + (size_t)t * a->stride;  // per group: 16 even, then 16 odd columns
    __m256 SA = _mm256_setzero_ps(), SB = _mm256_setzero_ps(), f[4];
    uint8_t tmp[16];
    for (int g = 0; g < ngroups; g++) {
        const uint8_t *bp = wr + (size_t)g * 16;
        if ((size_t)g * 16 + 16 > row_bytes) {  // the row's last, short group: +0 past it
            memset(tmp, 0, sizeof tmp);
            memcpy(tmp, bp, row_bytes - (size_t)g * 16);
            bp = tmp;
        } else if (g % 4 == 0) {
            _mm_prefetch((const char *)bp + 2048, _MM_HINT_T0);
        }
        fp4_group_floats(bp, f);
        const float *xe = x + (size_t)g * 32, *xo = xe + 16;
        __m256 A = _mm256_mul_ps(f[0], _mm256_loadu_ps(xe));
        __m256 B = _mm256_mul_ps(f[1], _mm256_loadu_ps(xe + 8));
        A = _mm256_add_ps(A, _mm256_mul_ps(f[2], _mm256_loadu_ps(xo)));
        B = _mm256_add_ps(B, _mm256_mul_ps(f[3], _mm256_loadu_ps(xo + 8)));
        __m256 hs = _mm256_set1_ps(fp4_half_scale(sr[g]));
        SA = _mm256_add_ps(SA, _mm256_mul_ps(A, hs));
        SB = _mm256_add_ps(SB, _mm256_mul_ps(B, hs));
    }
    return tree16_avx2(SA, SB);
}

// The half scales 2^(s - 128) of 8 fp4 groups, lanes = groups (the common case by shifting the
// exponent byte into place; a 0, 1 or 255 byte among them through fp4_half_scale).
AVX2 static inline __m256 fp4_half_scales8(const uint8_t *s) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)s));
    __m256i odd = _mm256_or_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(2), v), _mm256_cmpeq_epi32(v, _mm256_set1_epi32(255)));
    if (!_mm256_testz_si256(odd, odd)) {
        float f[8];
        for (int i = 0; i < 8; i++) f[i] = fp4_half_scale(s[i]);
        return _mm256_loadu_ps(f);
    }
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(v, _mm256_set1_epi32(1)), 23));
}

// fp4 weights x int8 activations, a chunk of 8 groups (256 columns, 128 weight bytes) at a time.
// The values 2·e2m1 + 12 (pshufb; 0..24, unsigned) against xq with maddubs — pair sums
// <= 2 * 24 * 127, two of them <= 12192: fit int16 — then 12 Σxq of the group subtracted (exact in
// int32): two groups per 32-byte load, [lo g | lo g+1] against the activations' [even g | even
// g+1] and the high nibbles against [odd g | odd g+1] (acts_prepare's ORDER_FP4).
static const uint8_t FP4_TWICE_PLUS12[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// The 8 group sums Σ v·xq of a chunk, lane i = group i. wb: the chunk's 128 weight bytes; xp: its
// 256 activations; xsum32: its 8 groups' Σ xq.
AVX2 static inline __m256i fp4_chunk_isum(const uint8_t *wb, const int8_t *xp, const int32_t *xsum32) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)FP4_TWICE_PLUS12));
    __m256i v[4];
    for (int p = 0; p < 4; p++) {  // groups 2p, 2p + 1
        __m256i b = _mm256_loadu_si256((const __m256i *)(wb + 32 * p));
        __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(b, low4));
        __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(b, 4), low4));
        __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(xp + 64 * p))),
                                     _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xp + 64 * p + 32))));
        v[p] = _mm256_madd_epi16(s, ones);  // [group 2p: 4 partial sums | group 2p + 1: 4]
    }
    __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));  // [0 2 4 6 | 1 3 5 7]
    h = _mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    __m256i xsum = _mm256_loadu_si256((const __m256i *)xsum32);
    return _mm256_sub_epi32(h, _mm256_add_epi32(_mm256_slli_epi32(xsum, 3), _mm256_slli_epi32(xsum, 2)));  // - 12 Σxq
}

// The chunk's term for one token, lanes = groups: float(isum) · (hs · xs[g / 2]).
AVX2 float dot_fp4_q8_avx2(const QMatrix *w, int r, const Acts *a, int t) {
    int cols = w->cols, ngroups = (cols + FP4_GROUP - 1) / FP4_GROUP;
    size_t row_bytes = ((size_t)cols + 1) / 2;
    const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * row_bytes;
    const uint8_t *sr = (const uint8_t *)w->scales + (size_t)r * (size_t)ngroups;
    const int8_t *xq = a->xq + (size_t)t * a->stride;  // per block: even g, even g+1, odd g, odd g+1
    const float *xs = a->xs + (size_t)t * (size_t)a->nb8;
    const int32_t *xsum32 = a->xsum32 + (size_t)t * 2 * (size_t)a->nb8;
    const __m256i pairs = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);  // group g reads xs[g / 2]
    __m256 L = _mm256_setzero_ps();
    int g0 = 0;
    for (; g0 + 8 <= ngroups && (size_t)(g0 + 8) * 16 <= row_bytes; g0 += 8) {  // whole chunks
        const uint8_t *bp = wr + (size_t)g0 * 16;
        _mm_prefetch((const char *)bp + 2048, _MM_HINT_T0);
        _mm_prefetch((const char *)bp + 2048 + 64, _MM_HINT_T0);
        __m256i isum = fp4_chunk_isum(bp, xq + (size_t)g0 * 32, xsum32 + g0);
        __m256 xs2 = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(xs + g0 / 2)), pairs);
        __m256 c = _mm256_mul_ps(fp4_half_scales8(sr + g0), xs2);
        L = _mm256_add_ps(L, _mm256_mul_ps(_mm256_cvtepi32_ps(isum), c));
    }
    if (g0 < ngroups) {  // the last, partial chunk: zero bytes past the row (q = 0), +0 past the groups
        uint8_t wb[128] = {0};
        memcpy(wb, wr + (size_t)g0 * 16, row_bytes - (size_t)g0 * 16);
        float c[8];
        for (int i = 0; i < 8; i++) c[i] = g0 + i < ngroups ? fp4_half_scale(sr[g0 + i]) * xs[(g0 + i) / 2] : 0.0f;
        __m256i isum = fp4_chunk_isum(wb, xq + (size_t)g0 * 32, xsum32 + g0);
        L = _mm256_add_ps(L, _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_loadu_ps(c)));
    }
    return tree8_avx2(L);
}

// Several tokens per row pass (ACT_F32): each block / chunk of the row is widened to floats once
// into L1, then every token's lanes run from there — the same float operations per (row, token)
// as the one-token dot products above, whatever n.
enum { ROWS_TOKENS = 16 };  // tokens per pass over the row

AVX2 static void row_fp8_f32_avx2(const QMatrix *w, int r, const Acts *a, const int32_t *tok, int n,
                                  float *const *yrow) {
    int cols = w->cols, nblocks = (cols + FP8_BLOCK - 1) / FP8_BLOCK;
    const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * (size_t)cols;
    const uint8_t *sr = (const uint8_t *)w->scales + (size_t)(r / FP8_BLOCK) * (size_t)nblocks;
    _Alignas(32) float wf[FP8_BLOCK];
    uint8_t tmp[FP8_BLOCK];
    __m256 SA[ROWS_TOKENS], SB[ROWS_TOKENS];
    for (int i0 = 0; i0 < n; i0 += ROWS_TOKENS) {
        int nt = n - i0 < ROWS_TOKENS ? n - i0 : ROWS_TOKENS;
        for (int k = 0; k < nt; k++) SA[k] = SB[k] = _mm256_setzero_ps();
        for (int b = 0; b < nblocks; b++) {
            const uint8_t *bp = wr + (size_t)b * FP8_BLOCK;
            if (b * FP8_BLOCK + FP8_BLOCK > cols) {
                memset(tmp, 0, sizeof tmp);
                memcpy(tmp, bp, (size_t)(cols - b * FP8_BLOCK));
                bp = tmp;
            }
            e4m3_block(bp, wf);
            __m256 sc = _mm256_set1_ps(fp8_scale(sr[b]));
            for (int k = 0; k < nt; k++) {
                size_t t = (size_t)(tok != NULL ? tok[i0 + k] : i0 + k);
                const float *xb = a->xf + t * a->stride + (size_t)b * FP8_BLOCK;
                __m256 A = _mm256_mul_ps(_mm256_load_ps(wf), _mm256_loadu_ps(xb));
                __m256 B = _mm256_mul_ps(_mm256_load_ps(wf + 8), _mm256_loadu_ps(xb + 8));
                for (int i = 1; i < 8; i++) {
                    A = _mm256_add_ps(A, _mm256_mul_ps(_mm256_load_ps(wf + 16 * i), _mm256_loadu_ps(xb + 16 * i)));
                    B = _mm256_add_ps(B, _mm256_mul_ps(_mm256_load_ps(wf + 16 * i + 8), _mm256_loadu_ps(xb + 16 * i + 8)));
                }
                SA[k] = _mm256_add_ps(SA[k], _mm256_mul_ps(A, sc));
                SB[k] = _mm256_add_ps(SB[k], _mm256_mul_ps(B, sc));
            }
        }
        for (int k = 0; k < nt; k++) yrow[i0 + k][r] = tree16_avx2(SA[k], SB[k]);
    }
}

AVX2 void rows_fp8_f32_avx2(const QMatrix *w, int r0, int r1, const Acts *a, const int32_t *tok, int n,
                            float *const *yrow) {
    for (int r = r0; r < r1; r++) row_fp8_f32_avx2(w, r, a, tok, n, yrow);
}

AVX2 static void row_fp4_f32_avx2(const QMatrix *w, int r, const Acts *a, const int32_t *tok, int n,
                                  float *const *yrow) {
    int cols = w->cols, ngroups = (cols + FP4_GROUP - 1) / FP4_GROUP;
    size_t row_bytes = ((size_t)cols + 1) / 2;
    const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * row_bytes;
    const uint8_t *sr = (const uint8_t *)w->scales + (size_t)r * (size_t)ngroups;
    enum { CHUNK = 8 };  // groups widened at once: 8 x 32 floats
    _Alignas(32) float wf[CHUNK * 32];  // per group: even columns 0-15, odd columns 0-15
    float hs[CHUNK];
    uint8_t tmp[16];
    __m256 SA[ROWS_TOKENS], SB[ROWS_TOKENS];
    for (int i0 = 0; i0 < n; i0 += ROWS_TOKENS) {
        int nt = n - i0 < ROWS_TOKENS ? n - i0 : ROWS_TOKENS;
        for (int k = 0; k < nt; k++) SA[k] = SB[k] = _mm256_setzero_ps();
        for (int g0 = 0; g0 < ngroups; g0 += CHUNK) {
            int ng = ngroups - g0 < CHUNK ? ngroups - g0 : CHUNK;
            for (int i = 0; i < ng; i++) {
                int g = g0 + i;
                const uint8_t *bp = wr + (size_t)g * 16;
                if ((size_t)g * 16 + 16 > row_bytes) {
                    memset(tmp, 0, sizeof tmp);
                    memcpy(tmp, bp, row_bytes - (size_t)g * 16);
                    bp = tmp;
                }
                __m256 f[4];
                fp4_group_floats(bp, f);
                for (int j = 0; j < 4; j++) _mm256_store_ps(wf + 32 * i + 8 * j, f[j]);
                hs[i] = fp4_half_scale(sr[g]);
            }
            for (int k = 0; k < nt; k++) {
                size_t t = (size_t)(tok != NULL ? tok[i0 + k] : i0 + k);
                const float *x = a->xf + t * a->stride + (size_t)g0 * 32;  // per group: 16 even, 16 odd
                __m256 sa = SA[k], sb = SB[k];
                for (int i = 0; i < ng; i++) {
                    const float *v = wf + 32 * i, *xe = x + 32 * i, *xo = xe + 16;
                    __m256 A = _mm256_mul_ps(_mm256_load_ps(v), _mm256_loadu_ps(xe));
                    __m256 B = _mm256_mul_ps(_mm256_load_ps(v + 8), _mm256_loadu_ps(xe + 8));
                    A = _mm256_add_ps(A, _mm256_mul_ps(_mm256_load_ps(v + 16), _mm256_loadu_ps(xo)));
                    B = _mm256_add_ps(B, _mm256_mul_ps(_mm256_load_ps(v + 24), _mm256_loadu_ps(xo + 8)));
                    __m256 h = _mm256_set1_ps(hs[i]);
                    sa = _mm256_add_ps(sa, _mm256_mul_ps(A, h));
                    sb = _mm256_add_ps(sb, _mm256_mul_ps(B, h));
                }
                SA[k] = sa;
                SB[k] = sb;
            }
        }
        for (int k = 0; k < nt; k++) yrow[i0 + k][r] = tree16_avx2(SA[k], SB[k]);
    }
}

AVX2 void rows_fp4_f32_avx2(const QMatrix *w, int r0, int r1, const Acts *a, const int32_t *tok, int n,
                            float *const *yrow) {
    for (int r = r0; r < r1; r++) row_fp4_f32_avx2(w, r, a, tok, n, yrow);
}

// ----------------------------------------------------------------------------
// Activations: quantize_block (matmul.c) for a whole block, 8 lanes at a time. The same float
// operations (absmax, 127 / absmax, x · inv rounded to nearest even, clamped), so the same bits; the
// integer sum is exact in any order.

AVX2 void quantize64_avx2(const float *x, int int4_order, int8_t *q, float *scale, int32_t *sum) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), fmax = _mm256_set1_ps(3.402823466e38f);
    __m256 v[8], amax = _mm256_setzero_ps(), finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int i = 0; i < 8; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        __m256 m = _mm256_and_ps(v[i], abs_mask);
        finite = _mm256_and_ps(finite, _mm256_cmp_ps(m, fmax, _CMP_LE_OQ));  // false for inf and NaN
        amax = _mm256_max_ps(amax, m);
    }
    if (_mm256_movemask_ps(finite) != 0xff) {
        memset(q, 0, 64);
        *scale = NAN;
        *sum = 0;
        return;
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float am = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    __m256 inv = _mm256_set1_ps(am > 0.0f ? 127.0f / am : 0.0f);
    const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    __m256i iv[8], s = _mm256_setzero_si256();
    for (int i = 0; i < 8; i++) {
        __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm256_and_ps(r, _mm256_cmp_ps(r, r, _CMP_ORD_Q));  // NaN (0 · inf) -> 0, as quantize_block
        iv[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
        s = _mm256_add_epi32(s, iv[i]);
    }
    // int32 -> int8 in column order: the packs interleave 128-bit lanes, the permute undoes it
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i b0 = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3])), order);  // cols 0-31
    __m256i b1 = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(iv[4], iv[5]), _mm256_packs_epi32(iv[6], iv[7])), order);  // cols 32-63
    if (int4_order) {  // per 16 columns, the 8 even then the 8 odd; then gather evens and odds
        const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                               0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
        b0 = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(b0, split), 0xd8);  // even 0-30 | odd 1-31
        b1 = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(b1, split), 0xd8);  // even 32-62 | odd 33-63
        __m256i even = _mm256_permute2x128_si256(b0, b1, 0x20), odd = _mm256_permute2x128_si256(b0, b1, 0x31);
        b0 = even;
        b1 = odd;
    }
    _mm256_storeu_si256((__m256i *)q, b0);
    _mm256_storeu_si256((__m256i *)(q + 32), b1);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    *scale = am / 127.0f;
    *sum = _mm_cvtsi128_si32(s4);
}

// ----------------------------------------------------------------------------
// matmul_t of int4 weights (MLA's key absorption)

// Rows in order, as matmul.c's product_t; each group's 64 weights dequantised once (float(q - 8) *
// scale, 8 lanes at a time) in the order the dot products read them — the 32 even columns, then
// the 32 odd ones, widened straight from memory — and added to every token's sums kept in that
// order in `scratch` [n, groups * 64], put back in column order at the end. The same operations on
// every element as the portable loop, so the same bits.
AVX2 void product_t_int4_avx2(float *y, const QMatrix *w, const float *x, int n, float *scratch) {
    int rows = w->rows, cols = w->cols, ngroups = (cols + INT4_GROUP - 1) / INT4_GROUP;
    size_t row_bytes = ((size_t)cols + 1) / 2, width = (size_t)ngroups * 64;
    memset(scratch, 0, (size_t)n * width * sizeof(float));
    uint8_t tmp[32];
    for (int r = 0; r < rows; r++) {
        const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * row_bytes;
        const uint16_t *sr = (const uint16_t *)w->scales + (size_t)r * (size_t)ngroups;
        for (int g = 0; g < ngroups; g++) {
            __m256 sc = _mm256_set1_ps(half_to_float(sr[g])), v[8];  // v: columns 0, 2, …, 62, then 1, 3, …, 63
            int4_group_floats(int4_group_bytes(wr, g, row_bytes, tmp), v);  // q = 0 past the row (dropped below)
            for (int i = 0; i < 8; i++) v[i] = _mm256_mul_ps(v[i], sc);
            for (int t = 0; t < n; t++) {
                __m256 xr = _mm256_set1_ps(x[(size_t)t * (size_t)rows + (size_t)r]);
                float *acc = scratch + (size_t)t * width + (size_t)g * 64;
                for (int i = 0; i < 8; i++) {
                    _mm256_storeu_ps(acc + 8 * i, _mm256_add_ps(_mm256_loadu_ps(acc + 8 * i), _mm256_mul_ps(xr, v[i])));
                }
            }
        }
    }
    for (int t = 0; t < n; t++) {  // back in column order
        const float *acc = scratch + (size_t)t * width;
        float *yt = y + (size_t)t * (size_t)cols;
        for (int j = 0; j < cols; j++) yt[j] = acc[(size_t)(j / 64) * 64 + (j % 2) * 32 + (j % 64) / 2];
    }
}

const Path PATH_AVX2 = {"avx2", dot_f32_avx2, dot_int8_f32_avx2, dot_int8_q8_avx2, dot_int4_f32_avx2,
                        dot_int4_q8_avx2, rows_int4_q8_avx2, dot_fp8_f32_avx2, dot_fp4_f32_avx2,
                        dot_fp4_q8_avx2, rows_fp8_f32_avx2, rows_fp4_f32_avx2, quantize64_avx2,
                        product_t_int4_avx2, rows_int4_f32_avx2, rows_int8_f32_avx2,
                        rows_int8_q8_avx2,
                        // Below 4 tokens the int4 and int8 rows' transposition costs about what it
                        // saves, and the dot row by row (the row in L1 after its first token) is
                        // faster: Zen 3, 8 OLMoE-size experts from memory, int4 2 tokens 1.97-2.02 ->
                        // 1.58-1.61 ms, 3 tokens 1.03-1.05x; int8 in cache (1024 x 2048) 2 tokens 209
                        // -> 151 µs; at 4 tokens the rows are as fast or faster (int8 285 -> 257 µs).
                        4};

#endif  // COLI_X86
