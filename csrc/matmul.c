// matmul.c — quantised matrix products: y = x @ dequant(w).T for f32, int8, int4, fp8 and fp4 weights.
//
// The weights are dequantised on the fly, never expanded in memory. Each output element is
// reduced by one thread in this fixed order (all float32, no FMA: built with -ffp-contract=off),
// identical in the portable, AVX2 and AVX-512 paths:
//
//   tree16(L) = ((L[l] + L[l+8]) for l < 8, then + the lane 4 above, then 2, then 1) — a fixed
//   pairwise tree over 16 lanes; tree8 the same from 8 lanes.
//
//   ACT_F32 (exact mode)
//     f32:  L[l] = 0; L[l] += w[j] * x[j] for j = l, l+16, l+32, … in order; y = tree16(L).
//     int8: the same with w[j] = float(q[j]); y = tree16(L) * scale.
//     int4: per group g of 64 columns in order, with lo[i] = q[64g + 2i], hi[i] = q[64g + 2i + 1]
//           (i < 32) and xe, xo the even and odd columns of the group:
//             A[l] = lo[l]*xe[l]; A[l] += lo[l+16]*xe[l+16]; A[l] += hi[l]*xo[l];
//             A[l] += hi[l+16]*xo[l+16];   S[l] += A[l] * float32(scale[g])   (S[l] = 0 first);
//           y = tree16(S).
//     fp8:  per block b of 128 columns in order, with v[j] = e4m3(q[j]) (exact in float32) and sc =
//           2^(s - 127) the scale of the 128x128 block holding row r and block b:
//             A[l] = v[128b + l] * x[128b + l]; A[l] += v[128b + l + 16i] * x[128b + l + 16i] for
//             i = 1, …, 7 in order;   S[l] += A[l] * sc   (S[l] = 0 first);   y = tree16(S).
//     fp4:  per group g of 32 columns in order, with v[j] = 2 * e2m1(q[j]) (an integer in [-12, 12],
//           FP4_TWICE) and hs = 2^(s - 128) (half the group's scale, so v * hs is the weight exactly):
//             A[l] = v[32g + 2l] * x[32g + 2l]; A[l] += v[32g + 2l + 1] * x[32g + 2l + 1];
//             S[l] += A[l] * hs   (S[l] = 0 first);   y = tree16(S).
//   ACT_Q8 (fast mode; x quantised per block of 64: xq, xs = absmax / 127, see acts_prepare)
//     int4: isum[g] = Σ q * xq over group g (exact, integer); term[g] = float(isum[g]) *
//           (float32(scale[g]) * xs[g]); L[l] = 0; L[l] += term[g] for g = l, l+8, … in order;
//           y = tree8(L).
//     int8: isum[b] = Σ q * xq over block b; term[b] = float(isum[b]) * xs[b]; y = tree8(L) * scale.
//     fp4:  isum[g] = Σ v * xq over group g of 32 columns
//           (v = 2 e2m1(q) as above; exact, integer); term[g] = float(isum[g]) * (hs[g] * xs[g / 2])
//           (two groups per activation block); L[l] = 0; L[l] += term[g] for g = l, l+8, … in order;
//           y = tree8(L).
//     f32 and fp8 weights always take ACT_F32 (an ACT_Q8 request computes the exact mode).
//   Columns past `cols` count as zeros: they add +0.0 (0 * 0) to their lane, and groups/blocks
//   past the last add a term of +0.0, exactly as the SIMD paths' zero padding does.
//
// Every lane sees the same float32 operations in the same order on every path, so the paths agree
// bit for bit (NaN payloads aside); the integer sums are exact whatever order a path adds them in.
// colibri_core/kernels/reference.py computes the same order in NumPy.
//
// Code paths: the dot products below are the portable reference; matmul_avx2.c and
// matmul_avx512.c hold the SIMD versions (function-level target attributes, chosen at run time
// from the CPU's features), and the AMX path is the AVX-512 one with the several-token int4 and int8
// rows on the tile unit. Everything else — activation layout, the split into row tasks — is shared, so the
// paths differ only in the dot products.
#define _GNU_SOURCE  // syscall: asking Linux for the tile unit (amx_usable)
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "impl/kernels_impl.h"

#if COLI_X86
#include <cpuid.h>
#endif
#if COLI_X86 && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

// ----------------------------------------------------------------------------
// float16 -> float32

float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu;
    uint32_t mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0 && mantissa == 0) {
        bits = sign;  // +-0
    } else if (exponent == 0) {
        // subnormal: mantissa * 2^-24; shift the leading 1 up to the implicit bit
        exponent = 127 - 15 + 1;
        while ((mantissa & 0x400u) == 0) {
            mantissa <<= 1;
            exponent--;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
    } else if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);  // inf, NaN (payload kept)
    } else {
        bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

// ----------------------------------------------------------------------------
// fp8 (e4m3fn), fp4 (e2m1) and their UE8M0 scales -> float32

float e4m3_to_f32(uint8_t q) {
    int e = (q >> 3) & 15, m = q & 7;
    float mag = (q & 0x7f) == 0x7f ? NAN : e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 + m), e - 10);
    return q & 0x80 ? -mag : mag;
}

static float e4m3_table[256];
static pthread_once_t e4m3_once = PTHREAD_ONCE_INIT;

static void e4m3_init(void) {
    for (int q = 0; q < 256; q++) e4m3_table[q] = e4m3_to_f32((uint8_t)q);
}

static const float *e4m3_values(void) {
    pthread_once(&e4m3_once, e4m3_init);
    return e4m3_table;
}

float e8m0_to_f32(uint8_t s) { return e8m0_pow2(s, 0); }

const int8_t FP4_TWICE[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static const float FP4_VALUES[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                     -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};  // e2m1

// ----------------------------------------------------------------------------
// Prepared activations

static size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

void acts_free(Acts *a) {
    free(a->xf);
    free(a->xq);
    free(a->xs);
    free(a->xsum);
    free(a->xt);
    free(a->xsum32);
    memset(a, 0, sizeof *a);
}

// Where column j of a block of 64 goes: in order (ORDER_NATURAL), the 32 even then the 32 odd
// columns (ORDER_INT4), or the even columns of its first half, of its second half, then the odd
// ones of each (ORDER_FP4: [even g | even g+1 | odd g | odd g+1] for its two fp4 groups).
enum { ORDER_NATURAL, ORDER_INT4, ORDER_FP4 };

static int block_pos(int j, int order) {
    return order == ORDER_INT4 ? (j & 1) * 32 + j / 2 : order == ORDER_FP4 ? (j & 1) * 32 + (j / 32) * 16 + (j % 32) / 2 : j;
}

// One block of up to 64 values quantised to int8: q[block_pos(j)] = rint(x[j] * (127 / absmax)).
// A block holding inf or NaN gets q = 0 and scale NaN, so every product it feeds is NaN.
static void quantize_block(const float *x, int len, int order, int8_t *q, float *scale, int32_t *sum) {
    float amax = 0.0f;
    int finite = 1;
    for (int j = 0; j < len; j++) {
        float v = fabsf(x[j]);
        if (!(v <= 3.402823466e38f)) finite = 0;
        else if (v > amax) amax = v;
    }
    memset(q, 0, Q8_BLOCK);
    if (!finite) {
        *scale = NAN;
        *sum = 0;
        return;
    }
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t s = 0;
    for (int j = 0; j < len; j++) {
        float r = nearbyintf(x[j] * inv);  // round half to even (the default rounding mode)
        // NaN: 0 · inf, a zero where absmax < 127 / FLT_MAX makes inv overflow; the product is 0
        int v = r > 127.0f ? 127 : r < -127.0f ? -127 : r == r ? (int)r : 0;
        q[block_pos(j, order)] = (int8_t)v;
        s += v;
    }
    *scale = amax / 127.0f;
    *sum = s;
}

// One chunk (8 blocks of 64 bytes) into Acts.xt's layout: dst[4 * (8w + b) + i] = chunk[64b + 4w + i].
static void acts_transpose(int8_t *dst, const int8_t *chunk) {
    for (int b = 0; b < 8; b++) {
        for (int w = 0; w < 16; w++) memcpy(dst + 4 * (8 * w + b), chunk + 64 * b + 4 * w, 4);
    }
}

int acts_prepare(Acts *a, const float *x, int n, int cols, int kind, int act) {
    memset(a, 0, sizeof *a);
    if (kind == QKIND_F32 || kind == QKIND_FP8) act = ACT_F32;
    a->act = act;
    a->kind = kind;
    a->cols = cols;
    a->n = n;
    size_t nt = (size_t)n;
    if (act == ACT_F32) {
        a->stride = kind == QKIND_INT4 ? round_up((size_t)cols, INT4_GROUP)
                    : kind == QKIND_FP8  ? round_up((size_t)cols, FP8_BLOCK)
                    : kind == QKIND_FP4  ? round_up((size_t)cols, FP4_GROUP)
                                         : round_up((size_t)cols, 16);
        a->xf = calloc(nt * a->stride + 1, sizeof(float));
        if (a->xf == NULL) return COLI_ENOMEM;
        for (size_t t = 0; t < nt; t++) {
            const float *src = x + t * (size_t)cols;
            float *dst = a->xf + t * a->stride;
            if (kind == QKIND_INT4) {
                for (int j = 0; j < cols; j++) dst[(j / 64) * 64 + (j & 1) * 32 + (j % 64) / 2] = src[j];
            } else if (kind == QKIND_FP4) {
                for (int j = 0; j < cols; j++) dst[(j / 32) * 32 + (j & 1) * 16 + (j % 32) / 2] = src[j];
            } else {
                memcpy(dst, src, (size_t)cols * sizeof(float));
            }
        }
        return COLI_OK;
    }
    int nblocks = (cols + Q8_BLOCK - 1) / Q8_BLOCK;
    a->nb8 = (int)round_up((size_t)nblocks, 8);
    a->stride = (size_t)a->nb8 * Q8_BLOCK;  // whole chunks of 8 blocks: SIMD paths may read a chunk
    a->xq = calloc(nt * a->stride + 1, 1);
    a->xs = calloc(nt * (size_t)a->nb8 + 1, sizeof(float));
    a->xsum = calloc(nt * (size_t)a->nb8 + 1, sizeof(int32_t));
    if (a->xq == NULL || a->xs == NULL || a->xsum == NULL) {
        acts_free(a);
        return COLI_ENOMEM;
    }
    quant_fn quantize64 = path_current()->quantize64;
    for (size_t t = 0; t < nt; t++) {
        const float *src = x + t * (size_t)cols;
        for (int b = 0; b < nblocks; b++) {
            int len = cols - b * Q8_BLOCK < Q8_BLOCK ? cols - b * Q8_BLOCK : Q8_BLOCK;
            size_t at = t * (size_t)a->nb8 + (size_t)b;
            int order = kind == QKIND_INT4 ? ORDER_INT4 : kind == QKIND_FP4 ? ORDER_FP4 : ORDER_NATURAL;
            int8_t *q = a->xq + t * a->stride + (size_t)b * Q8_BLOCK;
            if (quantize64 != NULL && len == Q8_BLOCK && order != ORDER_FP4) {
                quantize64(src + (size_t)b * Q8_BLOCK, order == ORDER_INT4, q, &a->xs[at], &a->xsum[at]);
            } else {
                quantize_block(src + (size_t)b * Q8_BLOCK, len, order, q, &a->xs[at], &a->xsum[at]);
            }
        }
    }
    if (kind == QKIND_FP4) {  // per group of 32: the sums the AVX2 kernel's unsigned weights need
        a->xsum32 = calloc(2 * nt * (size_t)a->nb8 + 1, sizeof(int32_t));
        if (a->xsum32 == NULL) {
            acts_free(a);
            return COLI_ENOMEM;
        }
        for (size_t blk = 0; blk < nt * (size_t)a->nb8; blk++) {
            const int8_t *q = a->xq + blk * Q8_BLOCK;  // [even g | even g+1 | odd g | odd g+1]
            for (int i = 0; i < 16; i++) {
                a->xsum32[2 * blk] += q[i] + q[32 + i];
                a->xsum32[2 * blk + 1] += q[16 + i] + q[48 + i];
            }
        }
    }
    if ((kind == QKIND_INT4 || kind == QKIND_INT8) && n > 1) {  // the layout of the several-token row kernels
        // 64-byte aligned: the AVX-512 rows load it a cache line at a time (split lines: 1.25x the time)
        a->xt = aligned_alloc(64, round_up(nt * a->stride + 1, 64));
        if (a->xt == NULL) {
            acts_free(a);
            return COLI_ENOMEM;
        }
        for (size_t c = 0; c < nt * a->stride; c += 8 * Q8_BLOCK) acts_transpose(a->xt + c, a->xq + c);
    }
    return COLI_OK;
}

// ----------------------------------------------------------------------------
// Row dot products, portable C: the reference order, written out lane by lane.

static float tree16(float *L) {
    for (int l = 0; l < 8; l++) L[l] = L[l] + L[l + 8];
    for (int l = 0; l < 4; l++) L[l] = L[l] + L[l + 4];
    for (int l = 0; l < 2; l++) L[l] = L[l] + L[l + 2];
    return L[0] + L[1];
}

static float tree8(float *L) {
    for (int l = 0; l < 4; l++) L[l] = L[l] + L[l + 4];
    for (int l = 0; l < 2; l++) L[l] = L[l] + L[l + 2];
    return L[0] + L[1];
}

static float dot_f32_portable(const QMatrix *w, int r, const Acts *a, int t) {
    int cols = w->cols;
    const float *wr = (const float *)w->data + (size_t)r * (size_t)cols;  // [cols]
    const float *x = a->xf + (size_t)t * a->stride;                      // [stride], zero padded
    float L[16] = {0};
    for (int j0 = 0; j0 < cols; j0 += 16) {
        for (int l = 0; l < 16; l++) {
            float wv = j0 + l < cols ? wr[j0 + l] : 0.0f;
            L[l] += wv * x[j0 + l];
        }
    }
    return tree16(L);
}

static float dot_int8_f32_portable(const QMatrix *w, int r, const Acts *a, int t) {
    int cols = w->cols;
    const int8_t *wr = (const int8_t *)w->data + (size_t)r * (size_t)cols;  // [cols]
    const float *x = a->xf + (size_t)t * a->stride;
    float L[16] = {0};
    for (int j0 = 0; j0 < cols; j0 += 16) {
        for (int l = 0; l < 16; l++) {
            float wv = j0 + l < cols ? (float)wr[j0 + l] : 0.0f;
            L[l] += wv * x[j0 + l];
        }
    }
    return tree16(L) * ((const float *)w->scales)[r];
}

static float dot_int8_q8_portable(const QMatrix *w, int r, const Acts *a, int t) {
    int cols = w->cols;
    const int8_t *wr = (const int8_t *)w->data + (size_t)r * (size_t)cols;  // [cols]
    const int8_t *xq = a->xq + (size_t)t * a->stride;
    const float *xs = a->xs + (size_t)t * (size_t)a->nb8;
    int nblocks = (cols + Q8_BLOCK - 1) / Q8_BLOCK;
    float L[8] = {0};
    for (int b = 0; b < a->nb8; b++) {
        float term = 0.0f;
        if (b < nblocks) {
            int32_t isum = 0;
            int end = cols - b * Q8_BLOCK < Q8_BLOCK ? cols : (b + 1) * Q8_BLOCK;
            for (int j = b * Q8_BLOCK; j < end; j++) isum += (int32_t)wr[j] * (int32_t)xq[j];
            term = (float)isum * xs[b];
        }
        L[b % 8] += term;
    }
    return tree8(L) * ((const float *)w->scales)[r];
}

static float dot_int4_f32_portable(const QMatrix *w, int r, const Acts *a, int t) {
    int cols = w->cols, ngroups = (cols + INT4_GROUP - 1) / INT4_GROUP;
    size_t row_bytes = ((size_t)cols + 1) / 2;
    const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * row_bytes;          // [row_bytes]
    const uint16_t *sr = (const uint16_t *)w->scales + (size_t)r * (size_t)ngroups;  // [ngroups]
    const float *x = a->xf + (size_t)t * a->stride;  // per group: 32 even, then 32 odd columns
    float S[16] = {0};
    uint8_t tmp[32];
    for (int g = 0; g < ngroups; g++) {
        const uint8_t *b = int4_group_bytes(wr, g, row_bytes, tmp);
        const float *xe = x + (size_t)g * 64, *xo = xe + 32;
        float sc = f16_to_f32(sr[g]);
        for (int l = 0; l < 16; l++) {
            float A = (float)((b[l] & 15) - 8) * xe[l];
            A += (float)((b[l + 16] & 15) - 8) * xe[l + 16];
            A += (float)((b[l] >> 4) - 8) * xo[l];
            A += (float)((b[l + 16] >> 4) - 8) * xo[l + 16];
            S[l] += A * sc;
        }
    }
    return tree16(S);
}

static float dot_int4_q8_portable(const QMatrix *w, int r, const Acts *a, int t) {
    int cols = w->cols, ngroups = (cols + INT4_GROUP - 1) / INT4_GROUP;
    size_t row_bytes = ((size_t)cols + 1) / 2;
    const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * row_bytes;
    const uint16_t *sr = (const uint16_t *)w->scales + (size_t)r * (size_t)ngroups;
    const int8_t *xq = a->xq + (size_t)t * a->stride;  // per block: 32 even, then 32 odd columns
    const float *xs = a->xs + (size_t)t * (size_t)a->nb8;
    float L[8] = {0};
    uint8_t tmp[32];
    for (int g = 0; g < a->nb8; g++) {
        float term = 0.0f;
        if (g < ngroups) {
            const uint8_t *b = int4_group_bytes(wr, g, row_bytes, tmp);
            const int8_t *xe = xq + (size_t)g * 64, *xo = xe + 32;
            int32_t isum = 0;
            for (int i = 0; i < 32; i++) isum += ((b[i] & 15) - 8) * xe[i] + ((b[i] >> 4) - 8) * xo[i];
            term = (float)isum * (f16_to_f32(sr[g]) * xs[g]);
        }
        L[g % 8] += term;
    }
    return tree8(L);
}

static float dot_fp8_f32_portable(const QMatrix *w, int r, const Acts *a, int t) {
    int cols = w->cols, nblocks = (cols + FP8_BLOCK - 1) / FP8_BLOCK;
    const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * (size_t)cols;                     // [cols]
    const uint8_t *sr = (const uint8_t *)w->scales + (size_t)(r / FP8_BLOCK) * (size_t)nblocks;  // [nblocks]
    const float *x = a->xf + (size_t)t * a->stride;  // zero padded to whole blocks
    const float *e4m3 = e4m3_values();
    float S[16] = {0};
    for (int b = 0; b < nblocks; b++) {
        float A[16];
        for (int i = 0; i < 8; i++) {
            for (int l = 0; l < 16; l++) {
                int j = b * FP8_BLOCK + 16 * i + l;
                float p = (j < cols ? e4m3[wr[j]] : 0.0f) * x[j];
                A[l] = i == 0 ? p : A[l] + p;
            }
        }
        float sc = fp8_scale(sr[b]);
        for (int l = 0; l < 16; l++) S[l] += A[l] * sc;
    }
    return tree16(S);
}

static float dot_fp4_f32_portable(const QMatrix *w, int r, const Acts *a, int t) {
    int cols = w->cols, ngroups = (cols + FP4_GROUP - 1) / FP4_GROUP;
    size_t row_bytes = ((size_t)cols + 1) / 2;
    const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * row_bytes;         // [row_bytes]
    const uint8_t *sr = (const uint8_t *)w->scales + (size_t)r * (size_t)ngroups;  // [ngroups]
    const float *x = a->xf + (size_t)t * a->stride;  // per group: 16 even, then 16 odd columns
    float S[16] = {0};
    for (int g = 0; g < ngroups; g++) {
        const float *xe = x + (size_t)g * 32, *xo = xe + 16;
        float hs = fp4_half_scale(sr[g]);
        for (int l = 0; l < 16; l++) {
            size_t at = (size_t)g * 16 + (size_t)l;
            uint8_t byte = at < row_bytes ? wr[at] : 0;  // past the row: +0 against x = 0
            float A = (float)FP4_TWICE[byte & 15] * xe[l];
            A += (float)FP4_TWICE[byte >> 4] * xo[l];
            S[l] += A * hs;
        }
    }
    return tree16(S);
}

static float dot_fp4_q8_portable(const QMatrix *w, int r, const Acts *a, int t) {
    int cols = w->cols, ngroups = (cols + FP4_GROUP - 1) / FP4_GROUP;
    size_t row_bytes = ((size_t)cols + 1) / 2;
    const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * row_bytes;
    const uint8_t *sr = (const uint8_t *)w->scales + (size_t)r * (size_t)ngroups;
    const int8_t *xq = a->xq + (size_t)t * a->stride;  // per block: even g, even g+1, odd g, odd g+1
    const float *xs = a->xs + (size_t)t * (size_t)a->nb8;  // per block of 64 = 2 groups
    float L[8] = {0};
    for (int g = 0; g < ngroups; g++) {
        const int8_t *xe = xq + (size_t)(g / 2) * 64 + (size_t)(g % 2) * 16, *xo = xe + 32;
        int32_t isum = 0;
        for (int l = 0; l < 16; l++) {
            size_t at = (size_t)g * 16 + (size_t)l;
            uint8_t byte = at < row_bytes ? wr[at] : 0;
            isum += FP4_TWICE[byte & 15] * xe[l] + FP4_TWICE[byte >> 4] * xo[l];
        }
        L[g % 8] += (float)isum * (fp4_half_scale(sr[g]) * xs[g / 2]);
    }
    return tree8(L);
}

const Path PATH_PORTABLE = {"portable", dot_f32_portable, dot_int8_f32_portable, dot_int8_q8_portable,
                            dot_int4_f32_portable, dot_int4_q8_portable, NULL, dot_fp8_f32_portable,
                            dot_fp4_f32_portable, dot_fp4_q8_portable, NULL, NULL, NULL, NULL, NULL, NULL};

// ----------------------------------------------------------------------------
// Code paths: chosen once from COLIBRI_SIMD / the CPU, changeable with simd_select.

static const Path *current;
static int init_status = COLI_OK;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

#if COLI_X86
// The tile unit (AMX-TILE and AMX-INT8 in cpuid, their state enabled in XCR0), and Linux's leave to
// use it: a process asks once for the 8 KB of tile state (arch_prctl ARCH_REQ_XCOMP_PERM), and a
// kernel that refuses leaves the path unsupported.
static int amx_usable(void) {
    static int usable = -1;  // asked once; two threads asking at once (simd_supported) get the same answer
    if (usable >= 0) return usable;
    unsigned a, b, c, d;
    usable = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 24 & 1) || !(d >> 25 & 1)) return usable;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c >> 27 & 1)) return usable;  // OSXSAVE: xgetbv works
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo >> 17 & 3) != 3) return usable;  // XTILECFG and XTILEDATA
#ifdef __linux__
    enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    usable = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#endif
    return usable;
}
#endif

static const Path *path_named(const char *name, int *status) {
    *status = COLI_OK;
    if (strcmp(name, "portable") == 0) return &PATH_PORTABLE;
#if COLI_X86
    if (strcmp(name, "avx2") == 0) {
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return &PATH_AVX2;
        *status = COLI_EUNSUPPORTED;
        return NULL;
    }
    if (strcmp(name, "avx512") == 0) {
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
            __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
            return &PATH_AVX512;
        }
        *status = COLI_EUNSUPPORTED;
        return NULL;
    }
    if (strcmp(name, "amx") == 0) {
        if (path_named("avx512", status) != NULL && amx_usable()) return &PATH_AMX;
        *status = COLI_EUNSUPPORTED;
        return NULL;
    }
#else
    if (strcmp(name, "avx2") == 0 || strcmp(name, "avx512") == 0 || strcmp(name, "amx") == 0) {
        *status = COLI_EUNSUPPORTED;
        return NULL;
    }
#endif
    if (strcmp(name, "auto") == 0) {
        const Path *p = path_named("amx", status);
        if (p == NULL) p = path_named("avx512", status);
        if (p == NULL) p = path_named("avx2", status);
        if (p == NULL) p = &PATH_PORTABLE;
        *status = COLI_OK;
        return p;
    }
    *status = COLI_EINVAL;
    return NULL;
}

static void init_path(void) {
    const char *env = getenv("COLIBRI_SIMD");
    int status;
    const Path *p = env != NULL && env[0] != '\0' ? path_named(env, &status) : NULL;
    if (env != NULL && env[0] != '\0' && p == NULL) init_status = status;
    current = p != NULL ? p : path_named("auto", &status);
}

const Path *path_current(void) {
    pthread_once(&init_once, init_path);
    return current;
}

int simd_init_status(void) {
    pthread_once(&init_once, init_path);
    return init_status;
}

const char *simd_name(void) { return path_current()->name; }

int simd_supported(const char *name) {
    int status;
    return path_named(name, &status) != NULL;
}

int simd_select(const char *name) {
    pthread_once(&init_once, init_path);
    int status;
    const Path *p = path_named(name, &status);
    if (p == NULL) return status;
    current = p;
    return COLI_OK;
}

dot_fn path_dot(const Path *p, int kind, int act) {
    switch (kind) {
    case QKIND_F32:
        return p->f32;
    case QKIND_INT8:
        return act == ACT_Q8 ? p->int8_q8 : p->int8_f32;
    case QKIND_INT4:
        return act == ACT_Q8 ? p->int4_q8 : p->int4_f32;
    case QKIND_FP8:
        return p->fp8_f32;  // ACT_F32 whatever `act` (acts_prepare lays x out so)
    case QKIND_FP4:
        return act == ACT_Q8 ? p->fp4_q8 : p->fp4_f32;
    default:
        return NULL;
    }
}

rows_fn path_rows(const Path *p, int kind, int act, int n) {
    int q8_rows = n >= (p->q8_rows_from > 2 ? p->q8_rows_from : 2);
    if (kind == QKIND_INT8) return act != ACT_Q8 ? p->int8_f32_rows : q8_rows ? p->int8_q8_rows : NULL;  // f32: any n
    if (n <= 1) return NULL;
    if (kind == QKIND_FP8) return p->fp8_f32_rows;
    if (kind == QKIND_FP4) return act == ACT_Q8 ? NULL : p->fp4_f32_rows;
    if (kind == QKIND_INT4) return act == ACT_Q8 ? (q8_rows ? p->int4_q8_rows : NULL) : p->int4_f32_rows;
    return NULL;
}

// ----------------------------------------------------------------------------
// Rows jobs and the matrix products

int qmatrix_check(const QMatrix *w) {
    if (w == NULL || w->rows < 0 || w->cols < 0 || w->data == NULL) return COLI_EINVAL;
    switch (w->kind) {
    case QKIND_F32:
        return COLI_OK;
    case QKIND_INT8:
    case QKIND_INT4:
    case QKIND_FP8:
    case QKIND_FP4:
        return w->scales != NULL ? COLI_OK : COLI_EINVAL;
    default:
        return COLI_EINVAL;
    }
}

void rows_run(const RowsJob *j, int r0, int r1) {
    // A rows kernel takes the whole range: several tokens reuse each weight from cache (in the
    // kernel's own order of rows and tokens), and int8's interleaves rows even for one.
    if (j->rows != NULL) {
        j->rows(j->w, r0, r1, j->a, j->tok, j->n, j->yrow);
        return;
    }
    for (int r = r0; r < r1; r++) {
        for (int i = 0; i < j->n; i++) {
            int t = j->tok != NULL ? j->tok[i] : i;
            j->yrow[i][r] = j->dot(j->w, r, j->a, t);
        }
    }
}

// One token (decode) reads each weight row once and uses it once: the threads stream memory, and
// one contiguous range each keeps each core's stream, and its prefetching, going from start to end
// (OLMoE-size decode, alternated token by token: 0.88-0.89x the time of 4 ranges a thread, where
// every new range starts cold). Several tokens per row are compute: 4 ranges a thread, so one that
// finishes early takes another (a 64-token prefill took 1.08x the time with one range a thread).
int rows_per_task(int rows, double work_per_row, int tokens) {
    int threads = threads_get();
    if (rows <= 0) return 1;
    if (threads <= 1 || (double)rows * work_per_row < POOL_MIN_WORK) return rows;
    int tasks = tokens > 1 ? threads * 4 : threads;
    int per = (rows + tasks - 1) / tasks;
    if (per < 1) per = 1;
    if (rows / per > 65535) per = rows / 65535 + 1;
    return per;
}

// A list of (matrix, row range) tasks over one or more products of prepared inputs.
typedef struct {
    int count;
    RowsJob *jobs;  // [count]
    int *first;     // [count + 1]: tasks of job i are first[i] .. first[i+1]
    int *per;       // [count]: rows per task of job i
} MultiJob;

static void multi_task(void *ctx, int task) {
    const MultiJob *m = ctx;
    int i = 0;
    while (task >= m->first[i + 1]) i++;
    int r0 = (task - m->first[i]) * m->per[i];
    int r1 = r0 + m->per[i] < m->jobs[i].w->rows ? r0 + m->per[i] : m->jobs[i].w->rows;
    rows_run(&m->jobs[i], r0, r1);
}

// The products y[i] = x_i @ dequant(w[i]).T in one pool run: x_i = x[0] for every i (`shared`: its
// layout prepared once per weight kind), or x[i] (prepared once per product).
static int products(float *const *y, const QMatrix *const *w, int count, const float *const *x, int shared, int n,
                    int act) {
    if (count < 1 || n < 0 || (act != ACT_F32 && act != ACT_Q8)) return COLI_EINVAL;
    int cols = w[0] != NULL ? w[0]->cols : -1;
    for (int i = 0; i < count; i++) {
        if (qmatrix_check(w[i]) != COLI_OK || (shared && w[i]->cols != cols)) return COLI_EINVAL;
    }
    if (n == 0) return COLI_OK;
    const Path *p = path_current();
    int nacts = shared ? QKIND_COUNT : count;
    Acts *acts = calloc((size_t)nacts, sizeof *acts);  // shared: one layout per weight kind present
    int *have = calloc((size_t)nacts, sizeof *have);
    int status = COLI_OK;
    RowsJob *jobs = calloc((size_t)count, sizeof *jobs);
    int *first = calloc((size_t)count + 1, sizeof *first);
    int *per = calloc((size_t)count, sizeof *per);
    float **yrow = calloc((size_t)count * (size_t)n, sizeof *yrow);
    if (acts == NULL || have == NULL || jobs == NULL || first == NULL || per == NULL || yrow == NULL) status = COLI_ENOMEM;
    for (int i = 0; i < count && status == COLI_OK; i++) {
        int kind = w[i]->kind, c = w[i]->cols, a = shared ? kind : i;
        if (!have[a]) {
            status = acts_prepare(&acts[a], x[shared ? 0 : i], n, c, kind, act);
            if (status != COLI_OK) break;
            have[a] = 1;
        }
        for (int t = 0; t < n; t++) yrow[(size_t)i * n + t] = y[i] + (size_t)t * (size_t)w[i]->rows;
        jobs[i] = (RowsJob){path_dot(p, kind, acts[a].act), path_rows(p, kind, acts[a].act, n), w[i], &acts[a], n, NULL,
                            yrow + (size_t)i * n};
        int bytes_per_row = kind == QKIND_F32 ? 4 * c : kind == QKIND_INT8 || kind == QKIND_FP8 ? c : c / 2;
        per[i] = rows_per_task(w[i]->rows, (double)n * c + bytes_per_row, n);
        // a product without columns (or rows) writes zeros here and takes no task
        first[i + 1] = first[i] + (c == 0 ? 0 : (w[i]->rows + per[i] - 1) / per[i]);
        if (c == 0) memset(y[i], 0, (size_t)n * (size_t)w[i]->rows * sizeof(float));
    }
    if (status == COLI_OK) {
        MultiJob m = {count, jobs, first, per};
        int ntasks = first[count];
        if (ntasks <= 1) {
            for (int task = 0; task < ntasks; task++) multi_task(&m, task);
        } else {
            pool_run(multi_task, &m, ntasks);
        }
    }
    for (int k = 0; k < nacts && have != NULL; k++) {
        if (have[k]) acts_free(&acts[k]);
    }
    free(acts);
    free(have);
    free(jobs);
    free(first);
    free(per);
    free(yrow);
    return status;
}

int matmul_multi(float *const *y, const QMatrix *const *w, int count, const float *x, int n, int act) {
    return products(y, w, count, &x, 1, n, act);
}

int matmul_each(float *const *y, const QMatrix *const *w, int count, const float *const *x, int n, int act) {
    return products(y, w, count, x, 0, n, act);
}

int matmul(float *y, const QMatrix *w, const float *x, int n, int act) {
    return matmul_multi(&y, &w, 1, x, n, act);
}

// ----------------------------------------------------------------------------
// Transposed product (MLA's absorbed key projection: a query times kv_b's key rows)

// Row r of w dequantised into out: f32 [cols], each element q * scale in float32 (fp8: e4m3(q) *
// 2^(s - 127); fp4: e2m1(q) * 2^(s - 127), the number FP4_TWICE[q] * 2^(s - 128) is, -0 kept).
static void dequant_row(const QMatrix *w, int r, float *out) {
    size_t row = (size_t)r, cols = (size_t)w->cols;
    switch (w->kind) {
    case QKIND_F32:
        memcpy(out, (const float *)w->data + row * cols, cols * sizeof(float));
        break;
    case QKIND_INT8: {
        const int8_t *q = (const int8_t *)w->data + row * cols;
        float scale = ((const float *)w->scales)[row];
        for (size_t j = 0; j < cols; j++) out[j] = (float)q[j] * scale;
        break;
    }
    case QKIND_INT4: {  // one scale per group of 64, two nibbles per byte (even column low)
        size_t row_bytes = (cols + 1) / 2, row_groups = (cols + INT4_GROUP - 1) / INT4_GROUP;
        const uint8_t *q = (const uint8_t *)w->data + row * row_bytes;
        const uint16_t *scales = (const uint16_t *)w->scales + row * row_groups;
        for (size_t g = 0; g < row_groups; g++) {
            float scale = f16_to_f32(scales[g]);
            size_t j0 = g * INT4_GROUP, j1 = j0 + INT4_GROUP < cols ? j0 + INT4_GROUP : cols;
            size_t pairs = (j1 - j0) / 2;  // whole bytes (j0 is even)
            for (size_t i = 0; i < pairs; i++) {
                uint8_t b = q[j0 / 2 + i];
                out[j0 + 2 * i] = (float)((int)(b & 0x0f) - 8) * scale;
                out[j0 + 2 * i + 1] = (float)((int)(b >> 4) - 8) * scale;
            }
            if (j0 + 2 * pairs < j1) out[j1 - 1] = (float)((int)(q[(j1 - 1) / 2] & 0x0f) - 8) * scale;  // odd cols
        }
        break;
    }
    case QKIND_FP8: {
        size_t blocks = (cols + FP8_BLOCK - 1) / FP8_BLOCK;
        const uint8_t *q = (const uint8_t *)w->data + row * cols;
        const uint8_t *scales = (const uint8_t *)w->scales + row / FP8_BLOCK * blocks;
        const float *e4m3 = e4m3_values();
        for (size_t j = 0; j < cols; j++) out[j] = e4m3[q[j]] * fp8_scale(scales[j / FP8_BLOCK]);
        break;
    }
    case QKIND_FP4: {
        size_t row_bytes = (cols + 1) / 2, groups = (cols + FP4_GROUP - 1) / FP4_GROUP;
        const uint8_t *q = (const uint8_t *)w->data + row * row_bytes;
        const uint8_t *scales = (const uint8_t *)w->scales + row * groups;
        for (size_t j = 0; j < cols; j++) {
            int nibble = j % 2 ? q[j / 2] >> 4 : q[j / 2] & 0x0f;
            out[j] = FP4_VALUES[nibble] * e8m0_to_f32(scales[j / FP4_GROUP]);
        }
        break;
    }
    }
}

int qmatrix_dequantize(float *out, const QMatrix *w) {
    if (qmatrix_check(w) != COLI_OK) return COLI_EINVAL;
    for (int r = 0; r < w->rows; r++) dequant_row(w, r, out + (size_t)r * (size_t)w->cols);
    return COLI_OK;
}

// y = x @ dequant(w) (all of y written); `scratch`: n * (w->cols rounded up to 64) floats, at least
// w->cols. The path's int4 loop where it has one (the same bits), else this one.
static void product_t(float *y, const QMatrix *w, const float *x, int n, float *scratch) {
    size_t rows = (size_t)w->rows, cols = (size_t)w->cols;
    const Path *p = path_current();
    if (w->kind == QKIND_INT4 && p->int4_t != NULL) {
        p->int4_t(y, w, x, n, scratch);
        return;
    }
    float *row = scratch;  // one dequantised weight row, reused by every token
    memset(y, 0, (size_t)n * cols * sizeof(float));
    for (size_t r = 0; r < rows; r++) {  // rows in order: each output element sums r = 0, 1, ...
        dequant_row(w, (int)r, row);
        for (size_t t = 0; t < (size_t)n; t++) {
            float xr = x[t * rows + r];
            float *yt = y + t * cols;
            for (size_t j = 0; j < cols; j++) yt[j] += xr * row[j];
        }
    }
}

typedef struct {
    float *const *y;
    const QMatrix *const *w;
    const float *const *x;
    int n;
    int failed;  // a task found no memory for its scratch
} EachT;

static void each_t_task(void *ctx, int i) {
    EachT *e = ctx;
    const QMatrix *w = e->w[i];
    size_t floats = (size_t)e->n * (((size_t)w->cols + 63) / 64 * 64);  // n >= 1: matmul_t_each returns at 0
    float *scratch = malloc(floats * sizeof(float) + 1);  // (+1: never malloc(0)) one per running task
    if (scratch == NULL) {
        e->failed = 1;
        return;
    }
    product_t(e->y[i], w, e->x[i], e->n, scratch);
    free(scratch);
}

int matmul_t_each(float *const *y, const QMatrix *const *w, int count, const float *const *x, int n) {
    if (count < 0 || n < 0) return COLI_EINVAL;
    for (int i = 0; i < count; i++) {
        if (qmatrix_check(w[i]) != COLI_OK) return COLI_EINVAL;
    }
    if (n == 0) return COLI_OK;
    EachT e = {y, w, x, n, 0};
    if (count == 1) {
        each_t_task(&e, 0);
    } else if (count > 1) {
        pool_run(each_t_task, &e, count);  // one product per task: each output element summed by one thread
    }
    return e.failed ? COLI_ENOMEM : COLI_OK;
}

int matmul_t(float *y, const QMatrix *w, const float *x, int n) { return matmul_t_each(&y, &w, 1, &x, n); }
