// matmul_avx512.c — the AVX-512 (F, BW, VL, VNNI) row dot products, in the fixed order of matmul.c.
//
// Function-level target attributes, chosen at run time (matmul.c checks cpuid). ACT_F32: one
// 16-float accumulator is matmul.c's 16 lanes. ACT_Q8 (int8 weights): vpdpbusd (u8 x s8, 4-way sums
// into int32, no saturation) per 64 bytes, the weights as w + 128 (w ^ 0x80) minus 128 Σxq — exact in
// int32, then the float part exactly as the other paths. int4 weights with int8 activations take
// matmul_avx2.c's VNNI one-token dot and several-token rows (kernels_impl.h says why).
#include "impl/kernels_impl.h"

#if COLI_X86
#include <string.h>
#ifdef COLIBRI_SIMDE  // tools/avx512_check/run.sh: the same code over SIMDe's portable intrinsics
#include "simde_shims.h"
#define AVX512
#else
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c")))
#endif

AVX512 static inline float tree8_512(__m256 v) {
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    return _mm_cvtss_f32(s1);
}

AVX512 static inline float tree16_512(__m512 v) {
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));  // l + l+8
    return tree8_512(s8);
}

AVX512 static inline __m256i hsum8_512(const __m256i *v) {
    __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
    __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
    __m256i h0123 = _mm256_hadd_epi32(h01, h23), h4567 = _mm256_hadd_epi32(h45, h67);
    __m256i lo = _mm256_permute2x128_si256(h0123, h4567, 0x20);
    __m256i hi = _mm256_permute2x128_si256(h0123, h4567, 0x31);
    return _mm256_add_epi32(lo, hi);
}

// 16 int32 lanes -> 8 (lane i + lane i+8), exact
AVX512 static inline __m256i fold16(__m512i v) {
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

static inline __mmask64 bytes_mask(size_t n) { return n >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << n) - 1); }
static inline __mmask16 lanes_mask(int n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }

// ----------------------------------------------------------------------------
// ACT_F32

AVX512 static float dot_f32_avx512(const QMatrix *w, int r, const Acts *a, int t) {
    int cols = w->cols;
    const float *wr = (const float *)w->data + (size_t)r * (size_t)cols;
    const float *x = a->xf + (size_t)t * a->stride;  // zero padded to a multiple of 16
    __m512 A = _mm512_setzero_ps();
    for (int j = 0; j < cols; j += 16) {
        __m512 wv = _mm512_maskz_loadu_ps(lanes_mask(cols - j), wr + j);
        A = _mm512_add_ps(A, _mm512_mul_ps(wv, _mm512_loadu_ps(x + j)));
    }
    return tree16_512(A);
}

// int8 weights: matmul.c's one accumulator per row is one chain of dependent adds, 16 weights per
// add's latency, which bounds a single row's dot below the read bandwidth (Sapphire Rapids at 2 GHz:
// 5 GB/s a core). INT8_ROWS_512 rows at once, each its own accumulator in the same order, overlap
// their chains; several tokens reuse the rows from L1. The same bits as dot_int8_f32_avx2.
enum { INT8_ROWS_512 = 4 };
// 16 int8 weights as floats; lanes of m clear (past the row's end): 0. Whole 16s load unmasked: the
// mask made anew each 16 columns cost the exact rows kernel 1.2x (tools/exact_ceiling, Zen 4:
// 19.2 -> 23.1 GB/s against the arithmetic's 28.9).
AVX512 static inline __m512 int8_floats_512(const int8_t *p, __mmask16 m) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}
AVX512 static inline __m512 int8_floats16_512(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

AVX512 static void rows_int8_f32_avx512(const QMatrix *w, int r0, int r1, const Acts *a, const int32_t *tok, int n,
                                        float *const *yrow) {
    int cols = w->cols, full = cols / 16 * 16;
    const float *scale = (const float *)w->scales;
    int r = r0;
    for (; r + INT8_ROWS_512 <= r1; r += INT8_ROWS_512) {
        const int8_t *w0 = (const int8_t *)w->data + (size_t)r * (size_t)cols, *w1 = w0 + cols, *w2 = w1 + cols,
                     *w3 = w2 + cols;
        for (int i = 0; i < n; i++) {
            const float *x = a->xf + (size_t)(tok != NULL ? tok[i] : i) * a->stride;  // zero padded to 16
            __m512 L0 = _mm512_setzero_ps(), L1 = L0, L2 = L0, L3 = L0;
            for (int j = 0; j < full; j += 16) {
                __m512 xv = _mm512_loadu_ps(x + j);
                L0 = _mm512_add_ps(L0, _mm512_mul_ps(int8_floats16_512(w0 + j), xv));
                L1 = _mm512_add_ps(L1, _mm512_mul_ps(int8_floats16_512(w1 + j), xv));
                L2 = _mm512_add_ps(L2, _mm512_mul_ps(int8_floats16_512(w2 + j), xv));
                L3 = _mm512_add_ps(L3, _mm512_mul_ps(int8_floats16_512(w3 + j), xv));
            }
            if (full < cols) {  // the row's last columns, zeros past them
                __mmask16 m = lanes_mask(cols - full);
                __m512 xv = _mm512_loadu_ps(x + full);
                L0 = _mm512_add_ps(L0, _mm512_mul_ps(int8_floats_512(w0 + full, m), xv));
                L1 = _mm512_add_ps(L1, _mm512_mul_ps(int8_floats_512(w1 + full, m), xv));
                L2 = _mm512_add_ps(L2, _mm512_mul_ps(int8_floats_512(w2 + full, m), xv));
                L3 = _mm512_add_ps(L3, _mm512_mul_ps(int8_floats_512(w3 + full, m), xv));
            }
            yrow[i][r] = tree16_512(L0) * scale[r];
            yrow[i][r + 1] = tree16_512(L1) * scale[r + 1];
            yrow[i][r + 2] = tree16_512(L2) * scale[r + 2];
            yrow[i][r + 3] = tree16_512(L3) * scale[r + 3];
        }
    }
    for (; r < r1; r++) {
        for (int i = 0; i < n; i++) yrow[i][r] = dot_int8_f32_avx2(w, r, a, tok != NULL ? tok[i] : i);
    }
}

// Each weight's float value (q - 8) straight from its nibble with one permute of a 16-entry table:
// zero-extended bytes index it by their low 4 bits (the low nibble), shifted right by 4 by the high
// one. Conversions were half the instructions of this compute-bound loop: OLMoE-size decode in the
// exact mode, alternated per token in one process, 55.3 -> 42.6 ms (BENCHMARKS.md); the same
// products, sums and order, so the same bits. q[0], q[1]: the low nibbles of bytes 0-15, 16-31 (the
// even columns); q[2], q[3]: their high nibbles (the odd columns); q = 0 past the row's end.
AVX512 static inline void int4_group_floats_512(const uint8_t *wr, int g, size_t row_bytes, __m512 q[4]) {
    const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    size_t left = row_bytes - (size_t)g * 32;
    __m128i b0, b1;  // bytes 0-15, 16-31 of the group
    if (left >= 32) {
        b0 = _mm_loadu_si128((const __m128i *)(wr + (size_t)g * 32));
        b1 = _mm_loadu_si128((const __m128i *)(wr + (size_t)g * 32 + 16));
    } else {
        const __m256i pad = _mm256_set1_epi8((char)0x88);  // past the row: q = 0
        __m256i b = _mm256_mask_loadu_epi8(pad, (__mmask32)bytes_mask(left), wr + (size_t)g * 32);
        b0 = _mm256_castsi256_si128(b);
        b1 = _mm256_extracti128_si256(b, 1);
    }
    __m512i d0 = _mm512_cvtepu8_epi32(b0), d1 = _mm512_cvtepu8_epi32(b1);
    q[0] = _mm512_permutexvar_ps(d0, table);
    q[1] = _mm512_permutexvar_ps(d1, table);
    q[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(d0, 4), table);
    q[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(d1, 4), table);
}

// matmul.c's ACT_F32 int4 steps for one group, lane l: A[l] = lo[l]*xe[l] + lo[l+16]*xe[l+16] +
// hi[l]*xo[l] + hi[l+16]*xo[l+16], then S += A * scale.
AVX512 static inline __m512 int4_group_dot_512(const __m512 q[4], const float *xe, __m512 sc, __m512 S) {
    const float *xo = xe + 32;
    __m512 A = _mm512_mul_ps(q[0], _mm512_loadu_ps(xe));
    A = _mm512_add_ps(A, _mm512_mul_ps(q[1], _mm512_loadu_ps(xe + 16)));
    A = _mm512_add_ps(A, _mm512_mul_ps(q[2], _mm512_loadu_ps(xo)));
    A = _mm512_add_ps(A, _mm512_mul_ps(q[3], _mm512_loadu_ps(xo + 16)));
    return _mm512_add_ps(S, _mm512_mul_ps(A, sc));
}

// A float16 scale as 16 float lanes.
AVX512 static inline __m512 broadcast_half_512(uint16_t h) { return _mm512_set1_ps(_mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)))); }

// The row's float16 scales are widened 16 at a time and each group's broadcast from memory (a load
// alone), where a group's own widening and broadcast took two of its 19 vector instructions, on the
// ports its shuffles and products need (tools/exact_ceiling, the Intel host, the two builds
// alternated three times: 7.1-7.7 -> 9.3-9.5 GB/s, 11.4-12.6 -> 9.2-9.6 cycles per 64 weights,
// 53-57 -> 69-71 % of the contract's arithmetic alone). The same scales, so the same bits.
AVX512 static float dot_int4_f32_avx512(const QMatrix *w, int r, const Acts *a, int t) {
    int cols = w->cols, ngroups = (cols + INT4_GROUP - 1) / INT4_GROUP;
    size_t row_bytes = ((size_t)cols + 1) / 2;
    const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * row_bytes;
    const uint16_t *sr = (const uint16_t *)w->scales + (size_t)r * (size_t)ngroups;
    const float *x = a->xf + (size_t)t * a->stride;  // per group: 32 even, then 32 odd columns
    __m512 S = _mm512_setzero_ps(), q[4];
    float sc[16];  // the scales of groups g0 .. g0 + 15 as floats, each read back as a broadcast (a load alone)
    for (int g0 = 0; g0 < ngroups; g0 += 16) {
        int ng = ngroups - g0 < 16 ? ngroups - g0 : 16;
        _mm512_storeu_ps(sc, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << ng) - 1), sr + g0)));
        for (int g = g0; g < g0 + ng; g++) {
            if (g & 1) _mm_prefetch((const char *)wr + (size_t)g * 32 + 4096, _MM_HINT_T0);  // as dot_int4_f32_avx2
            int4_group_floats_512(wr, g, row_bytes, q);
            S = int4_group_dot_512(q, x + (size_t)g * 64, _mm512_set1_ps(sc[g - g0]), S);
        }
    }
    return tree16_512(S);
}

// Several tokens (prefill, drafts verified together, an expert's tokens): dot_int4_f32_avx512 for
// up to INT4_ROWS_TOKENS_512 tokens at a time, each group's weights converted to floats once for all
// of them instead of once a token: the same products and sums per token, so the same bits. Token
// blocks outermost, as rows_int4_f32_avx2. The block's token count is a constant in each copy of
// int4_rows_block_512 (the switch below), so its accumulators stay in registers.
enum { INT4_ROWS_TOKENS_512 = 8 };
AVX512 static inline __attribute__((always_inline)) void int4_rows_block_512(const QMatrix *w, int r0, int r1,
                                                                             const float *const *xs, int nt,
                                                                             float *const *yrow) {
    int ngroups = (w->cols + INT4_GROUP - 1) / INT4_GROUP;
    size_t row_bytes = ((size_t)w->cols + 1) / 2;
    for (int r = r0; r < r1; r++) {
        const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * row_bytes;
        const uint16_t *sr = (const uint16_t *)w->scales + (size_t)r * (size_t)ngroups;
        __m512 S[INT4_ROWS_TOKENS_512], q[4];
        for (int i = 0; i < nt; i++) S[i] = _mm512_setzero_ps();
        for (int g = 0; g < ngroups; g++) {
            int4_group_floats_512(wr, g, row_bytes, q);
            __m512 sc = broadcast_half_512(sr[g]);
            for (int i = 0; i < nt; i++) S[i] = int4_group_dot_512(q, xs[i] + (size_t)g * 64, sc, S[i]);
        }
        for (int i = 0; i < nt; i++) yrow[i][r] = tree16_512(S[i]);
    }
}

AVX512 static void rows_int4_f32_avx512(const QMatrix *w, int r0, int r1, const Acts *a, const int32_t *tok, int n,
                                        float *const *yrow) {
    for (int i0 = 0; i0 < n; i0 += INT4_ROWS_TOKENS_512) {
        int nt = n - i0 < INT4_ROWS_TOKENS_512 ? n - i0 : INT4_ROWS_TOKENS_512;
        const float *xs[INT4_ROWS_TOKENS_512];
        for (int i = 0; i < nt; i++) xs[i] = a->xf + (size_t)(tok != NULL ? tok[i0 + i] : i0 + i) * a->stride;
        switch (nt) {
        case 1: int4_rows_block_512(w, r0, r1, xs, 1, yrow + i0); break;
        case 2: int4_rows_block_512(w, r0, r1, xs, 2, yrow + i0); break;
        case 3: int4_rows_block_512(w, r0, r1, xs, 3, yrow + i0); break;
        case 4: int4_rows_block_512(w, r0, r1, xs, 4, yrow + i0); break;
        case 5: int4_rows_block_512(w, r0, r1, xs, 5, yrow + i0); break;
        case 6: int4_rows_block_512(w, r0, r1, xs, 6, yrow + i0); break;
        case 7: int4_rows_block_512(w, r0, r1, xs, 7, yrow + i0); break;
        default: int4_rows_block_512(w, r0, r1, xs, 8, yrow + i0); break;
        }
    }
}

// fp4 (e2m1) weights the same way: 2 · value (FP4_TWICE) as a float by one permute per 16 columns.
// 4096 x 4096 matvec, the path alternated call by call: 13.4 GB/s against AVX2's 10.3 (int4: 18.4
// against 13.7).
AVX512 static float dot_fp4_f32_avx512(const QMatrix *w, int r, const Acts *a, int t) {
    int cols = w->cols, ngroups = (cols + FP4_GROUP - 1) / FP4_GROUP;
    size_t row_bytes = ((size_t)cols + 1) / 2;
    const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * row_bytes;
    const uint8_t *sr = (const uint8_t *)w->scales + (size_t)r * (size_t)ngroups;
    const float *x = a->xf + (size_t)t * a->stride;  // per group: 16 even, then 16 odd columns
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);  // FP4_TWICE
    __m512 S = _mm512_setzero_ps();
    for (int g = 0; g < ngroups; g++) {
        size_t left = row_bytes - (size_t)g * 16;  // past the row: byte 0, +0 against x = 0
        if (g % 4 == 0) _mm_prefetch((const char *)wr + (size_t)g * 16 + 2048, _MM_HINT_T0);  // as dot_fp4_f32_avx2
        __m128i b = left >= 16 ? _mm_loadu_si128((const __m128i *)(wr + (size_t)g * 16))
                               : _mm_maskz_loadu_epi8((__mmask16)bytes_mask(left), wr + (size_t)g * 16);
        __m512i d = _mm512_cvtepu8_epi32(b);
        const float *xe = x + (size_t)g * 32, *xo = xe + 16;
        __m512 A = _mm512_mul_ps(_mm512_permutexvar_ps(d, table), _mm512_loadu_ps(xe));
        A = _mm512_add_ps(A, _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), table), _mm512_loadu_ps(xo)));
        S = _mm512_add_ps(S, _mm512_mul_ps(A, _mm512_set1_ps(fp4_half_scale(sr[g]))));
    }
    return tree16_512(S);
}

// ----------------------------------------------------------------------------
// ACT_Q8

AVX512 static float dot_int8_q8_avx512(const QMatrix *w, int r, const Acts *a, int t) {
    int cols = w->cols, nblocks = (cols + Q8_BLOCK - 1) / Q8_BLOCK;
    const int8_t *wr = (const int8_t *)w->data + (size_t)r * (size_t)cols;
    const int8_t *xq = a->xq + (size_t)t * a->stride;
    const float *xs = a->xs + (size_t)t * (size_t)a->nb8;
    const int32_t *xsum = a->xsum + (size_t)t * (size_t)a->nb8;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m256 L = _mm256_setzero_ps();
    for (int b0 = 0; b0 < a->nb8; b0 += 8) {
        __m256i acc[8];
        for (int i = 0; i < 8; i++) {
            int b = b0 + i;
            if (b >= nblocks) {
                acc[i] = _mm256_setzero_si256();
                continue;
            }
            // masked-off bytes load as 0 and flip to 128, against xq = 0 past cols: no contribution
            __m512i wv = _mm512_maskz_loadu_epi8(bytes_mask((size_t)(cols - b * 64)), wr + (size_t)b * 64);
            __m512i xv = _mm512_loadu_si512(xq + (size_t)b * 64);
            acc[i] = fold16(_mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_xor_si512(wv, flip), xv));
        }
        // isum[b] = Σ (w + 128) xq - 128 Σ xq
        __m256i isum = _mm256_sub_epi32(hsum8_512(acc), _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(xsum + b0)), 7));
        L = _mm256_add_ps(L, _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_loadu_ps(xs + b0)));
    }
    return tree8_512(L) * ((const float *)w->scales)[r];
}

// Several tokens, int8 weights x int8 activations (rows_int4_q8_vnni's approach for int8): a chunk
// of 8 blocks (512 weights) of a row is transposed once in registers so that lane b of every vector
// belongs to block b — the layout of Acts.xt, 64 bytes a load: wz[k] lanes 0-7 = word 2k of blocks
// 0-7, lanes 8-15 = word 2k + 1 — then each token's 8 block sums are 8 vpdpbusd with no horizontal
// step: Σ (w + 128)·xq − 128 Σ xq, exact in int32, and the float steps of dot_int8_q8_avx512, so the
// same bits. The rows stream past once (4 KB asked ahead), tokens 4 at a time.
AVX512 static inline void int8_chunk_transposed(__m512i *wz, const int8_t *wp, long left) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i raw[8];  // block j as (w + 128), zeros past the row (never read)
    for (int j = 0; j < 8; j++)
        raw[j] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(left > 64 * j ? bytes_mask((size_t)(left - 64 * j)) : 0, wp + 64 * j), flip);
    // an 8 x 16 transposition of words in four rounds of 8 shuffles. Word w = 4q + c sits in 128-bit
    // quarter q. After the 32- and 64-bit unpacks, u[h][c] quarter q = word 4q + c of blocks 4h .. 4h+3.
    __m512i t[8], u[2][4], p[4][2];
    for (int j = 0; j < 4; j++) {
        t[2 * j] = _mm512_unpacklo_epi32(raw[2 * j], raw[2 * j + 1]);      // words 4q, 4q + 1
        t[2 * j + 1] = _mm512_unpackhi_epi32(raw[2 * j], raw[2 * j + 1]);  // words 4q + 2, 4q + 3
    }
    for (int h = 0; h < 2; h++) {
        u[h][0] = _mm512_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
        u[h][1] = _mm512_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
        u[h][2] = _mm512_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
        u[h][3] = _mm512_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
    }
    // p[c][0]: quarters 0, 1 of u[0][c], then of u[1][c]; p[c][1]: quarters 2, 3
    for (int c = 0; c < 4; c++) {
        p[c][0] = _mm512_shuffle_i64x2(u[0][c], u[1][c], _MM_SHUFFLE(1, 0, 1, 0));
        p[c][1] = _mm512_shuffle_i64x2(u[0][c], u[1][c], _MM_SHUFFLE(3, 2, 3, 2));
    }
    // wz[k], words 2k (= 4q + c) and 2k + 1: blocks 0-3, 4-7 of each, from p[c] and p[c + 1]
    for (int k = 0; k < 8; k++) {
        int c = (2 * k) & 3, q = k >> 1;
        __m512i a = p[c][q >> 1], b = p[c + 1][q >> 1];
        wz[k] = (q & 1) ? _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(3, 1, 3, 1)) : _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(2, 0, 2, 0));
    }
}

// m tokens t[0..m) (m a constant where inlined: 1, 2 or 4) of a chunk at block b0: L[j] += terms.
// The tokens' sums interleaved, two chains a token, as chunk_tokens512.
AVX512 static inline __attribute__((always_inline)) void int8_chunk_tokens(const __m512i *wz, const Acts *a,
                                                                           const size_t *t, int m, int b0, __m256 *L) {
    const __m512i *x[4];
    __m512i s0[4], s1[4];
    for (int j = 0; j < m; j++) {
        x[j] = (const __m512i *)(a->xt + t[j] * a->stride + (size_t)b0 * 64);
        s0[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wz[0], _mm512_load_si512(x[j]));
        s1[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wz[1], _mm512_load_si512(x[j] + 1));
    }
    for (int k = 2; k < 8; k += 2) {
        for (int j = 0; j < m; j++) {
            s0[j] = _mm512_dpbusd_epi32(s0[j], wz[k], _mm512_load_si512(x[j] + k));
            s1[j] = _mm512_dpbusd_epi32(s1[j], wz[k + 1], _mm512_load_si512(x[j] + k + 1));
        }
    }
    for (int j = 0; j < m; j++) {
        size_t at = t[j] * (size_t)a->nb8 + (size_t)b0;
        __m256i isum = _mm256_sub_epi32(fold16(_mm512_add_epi32(s0[j], s1[j])),
                                        _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(a->xsum + at)), 7));
        L[j] = _mm256_add_ps(L[j], _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_loadu_ps(a->xs + at)));
    }
}

// The m tokens t[0..m) of the chunk at block b0 of the transposed chunk wz, 4 at a time: L[j] += terms.
AVX512 static inline void int8_chunk_block(const __m512i *wz, const Acts *a, const size_t *t, int m, int b0, __m256 *L) {
    int i = 0;
    for (; i + 4 <= m; i += 4) int8_chunk_tokens(wz, a, t + i, 4, b0, L + i);
    if (m - i >= 2) {
        int8_chunk_tokens(wz, a, t + i, 2, b0, L + i);
        i += 2;
    }
    if (i < m) int8_chunk_tokens(wz, a, t + i, 1, b0, L + i);
}

AVX512 static void rows_int8_q8_stream512(const QMatrix *w, int r0, int r1, const Acts *a, const int32_t *tok, int n,
                                          float *const *yrow) {
    int cols = w->cols;
    const float *scale = (const float *)w->scales;
    enum { BLOCK = 16 };  // tokens per pass over a row
    __m256 L[BLOCK];
    size_t t[BLOCK];
    __m512i wz[8];
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
                int8_chunk_transposed(wz, wp, (long)cols - (long)b0 * 64);
                int8_chunk_block(wz, a, t, nt, b0, L);
            }
            for (int i = 0; i < nt; i++) yrow[i0 + i][r] = tree8_512(L[i]) * scale[r];
        }
    }
}

// From INT8_BLOCK_TOKENS tokens up the rows are bound by their arithmetic, not by reading them:
// rows_int4_q8_vnni's blocks of 8 rows x 16 tokens, chunk by chunk, so a chunk of the block's
// activations (8 KB) stays in L1 for the 8 rows (streamed row by row, each row read them from L2).
// 8 OLMoE-size int8 experts from memory (tools/bench_expert_tokens.py, Intel AVX-512 host, the two
// alternated twice): 64 / 128 / 256 tokens streamed 27.7 / 58.7-63.4 / 119-120 ms, in blocks
// 25.3-26.1 / 49.4-50.1 / 99-102 ms; at 32 tokens the blocks were slower (12.8-12.9 against 10.6-11.8).
enum { INT8_BLOCK_TOKENS = 64 };

AVX512 static void rows_int8_q8_avx512(const QMatrix *w, int r0, int r1, const Acts *a, const int32_t *tok, int n,
                                       float *const *yrow) {
    if (n < INT8_BLOCK_TOKENS) {
        rows_int8_q8_stream512(w, r0, r1, a, tok, n, yrow);
        return;
    }
    int cols = w->cols;
    const float *scale = (const float *)w->scales;
    enum { BLOCK = 16, RB = 8 };  // tokens, rows per pass
    __m256 L[RB][BLOCK];
    size_t t[BLOCK];
    __m512i wz[8];
    for (int i0 = 0; i0 < n; i0 += BLOCK) {
        int nt = n - i0 < BLOCK ? n - i0 : BLOCK;
        for (int i = 0; i < nt; i++) t[i] = (size_t)(tok != NULL ? tok[i0 + i] : i0 + i);
        for (int rb = r0; rb < r1; rb += RB) {
            int nr = r1 - rb < RB ? r1 - rb : RB;
            for (int r = 0; r < nr; r++) for (int i = 0; i < nt; i++) L[r][i] = _mm256_setzero_ps();
            for (int b0 = 0; b0 < a->nb8; b0 += 8) {
                for (int r = 0; r < nr; r++) {
                    const int8_t *wp = (const int8_t *)w->data + (size_t)(rb + r) * (size_t)cols + (size_t)b0 * 64;
                    int8_chunk_transposed(wz, wp, (long)cols - (long)b0 * 64);
                    int8_chunk_block(wz, a, t, nt, b0, L[r]);
                }
            }
            for (int r = 0; r < nr; r++)
                for (int i = 0; i < nt; i++) yrow[i0 + i][rb + r] = tree8_512(L[r][i]) * scale[rb + r];
        }
    }
}

const Path PATH_AVX512 = {"avx512", dot_f32_avx512, dot_int8_f32_avx2, dot_int8_q8_avx512,
                          dot_int4_f32_avx512, dot_int4_q8_vnni, rows_int4_q8_vnni, dot_fp8_f32_avx2, dot_fp4_f32_avx512,
                          dot_fp4_q8_avx2, rows_fp8_f32_avx2, rows_fp4_f32_avx2, quantize64_avx2,
                          product_t_int4_avx2, rows_int4_f32_avx512, rows_int8_f32_avx512,
                          rows_int8_q8_avx512};

#ifndef COLIBRI_SIMDE
// The AVX-512 path with the several-token rows with int8 activations on the tile unit (rows_q8_tiles)
// from AMX_MIN_INT4 / AMX_MIN_INT8 tokens up: the same bits. Below, a tile product and store per 16
// rows and block (whatever the token count, the float steps 16 tokens wide) cost more than vpdpbusd
// per token. 8 OLMoE-size experts from memory, int8 activations (tools/bench_expert_tokens.py, Intel
// host, the paths alternated call by call, read 17-19 GB/s), the tiles against the VNNI rows: int4
// 2 / 4 / 8 / 16 tokens 2.8 / 3.0 / 2.9 / 3.2 ms against 1.6 / 1.9 / 2.6 / 4.6; int8 3.4 / 3.6 / 3.8 /
// 4.2 against 2.9 / 3.3 / 4.4 / 7.5 (int8 rows are read by the tiles in place, int4 ones unpacked).
// OLMoE-size prefill of 2,048 tokens 67-75 -> 97-103 tok/s (tools/bench_prefill.py, alternated;
// BENCHMARKS.md).
enum { AMX_MIN_INT4 = 16, AMX_MIN_INT8 = 8 };

AVX512 static void rows_int4_q8_amx(const QMatrix *w, int r0, int r1, const Acts *a, const int32_t *tok, int n,
                                    float *const *yrow) {
    (n < AMX_MIN_INT4 ? rows_int4_q8_vnni : rows_q8_tiles)(w, r0, r1, a, tok, n, yrow);
}

AVX512 static void rows_int8_q8_amx(const QMatrix *w, int r0, int r1, const Acts *a, const int32_t *tok, int n,
                                    float *const *yrow) {
    (n < AMX_MIN_INT8 ? rows_int8_q8_avx512 : rows_q8_tiles)(w, r0, r1, a, tok, n, yrow);
}

const Path PATH_AMX = {"amx", dot_f32_avx512, dot_int8_f32_avx2, dot_int8_q8_avx512,
                       dot_int4_f32_avx512, dot_int4_q8_vnni, rows_int4_q8_amx, dot_fp8_f32_avx2, dot_fp4_f32_avx512,
                       dot_fp4_q8_avx2, rows_fp8_f32_avx2, rows_fp4_f32_avx2, quantize64_avx2,
                       product_t_int4_avx2, rows_int4_f32_avx512, rows_int8_f32_avx512,
                       rows_int8_q8_amx};
#endif

#endif  // COLI_X86
