// kernels_impl.h — what the kernel files share inside the library (not part of cffi's cdef).
//
// Prepared activations (Acts), the row dot products every code path implements (Path), the jobs
// that split a product into tasks of whole rows, and the thread pool.
#ifndef COLIBRI_KERNELS_IMPL_H
#define COLIBRI_KERNELS_IMPL_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "../colibri.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define COLI_X86 1
#else
#define COLI_X86 0
#endif

// ----------------------------------------------------------------------------
// Prepared activations: x laid out once per call the way the row dot products read it.

typedef struct {
    int act;        // ACT_F32 | ACT_Q8
    int kind;       // QKIND_*: the weights these activations are laid out for
    int cols;       // columns of x
    int n;          // tokens (rows of x)
    size_t stride;  // elements per token in xf / xq
    int nb8;        // elements per token in xs / xsum: blocks of 64, padded to a multiple of 8
    // ACT_F32, f32 and int8 weights: x, then zeros up to a multiple of 16 columns;
    // ACT_F32, int4 weights: per group of 64 columns the 32 even then the 32 odd ones, zeros past cols;
    // ACT_F32, fp8 weights: x, then zeros up to a multiple of 128 columns;
    // ACT_F32, fp4 weights: per group of 32 columns the 16 even then the 16 odd ones, zeros past cols.
    float *xf;      // [n, stride] or NULL
    // ACT_Q8: q = rint(x * (127 / absmax)) per block of 64; int4 weights: per block the 32 even
    // then the 32 odd columns; fp4 weights: per block (two groups of 32, g and g+1) the 16 even
    // columns of g, the 16 even of g+1, the 16 odd of g, the 16 odd of g+1; int8 weights: natural
    // order; zeros past cols.
    int8_t *xq;     // [n, stride] or NULL
    float *xs;      // [n, nb8] block scale absmax / 127 (NaN for a block holding inf/NaN), zeros past
    int32_t *xsum;  // [n, nb8] sum of the block's q, zeros past
    int32_t *xsum32;  // ACT_Q8, fp4 weights: [n, 2 * nb8] sum of each group of 32's q, zeros past; else NULL
    // ACT_Q8, int4 and int8 weights, n > 1: xq with each chunk of 8 blocks transposed for the several-token
    // row kernels: viewing a chunk as 8 blocks x 16 four-byte words, word w of block b moves to
    // position 8w + b, so one 32-byte vector holds four values of each block.
    int8_t *xt;     // [n, stride] or NULL
} Acts;

// Lay out x f32 [n, cols] for weights of `kind` in arithmetic `act` (f32 and fp8 weights: always
// ACT_F32).
// Returns COLI_OK or COLI_ENOMEM. The same code for every path, so every path sees the same bits.
int acts_prepare(Acts *a, const float *x, int n, int cols, int kind, int act);
void acts_free(Acts *a);

// ----------------------------------------------------------------------------
// Code paths: row r of w dotted with token t of a, in the fixed order of matmul.c.

typedef float (*dot_fn)(const QMatrix *w, int r, const Acts *a, int t);

// Rows r0 .. r1-1 of w for n tokens at once (token i is row tok[i] of a, NULL: row i; row r writes
// yrow[i][r]): the weights are unpacked once for several tokens, in whatever order of rows and
// tokens the kernel likes. Bit for bit what the dot_fn of its kind gives.
typedef void (*rows_fn)(const QMatrix *w, int r0, int r1, const Acts *a, const int32_t *tok, int n,
                        float *const *yrow);

// One whole block of 64 activations quantised to int8, bit for bit as matmul.c's quantize_block:
// q[j] (int4_order: the 32 even columns, then the 32 odd ones) = rint(x[j] * (127 / absmax)),
// *scale = absmax / 127, *sum = Σ q; a block holding inf or NaN: q = 0, scale NaN, sum 0.
typedef void (*quant_fn)(const float *x, int int4_order, int8_t *q, float *scale, int32_t *sum);

// y = x @ dequant(w) (matmul_t) for n tokens, bit for bit matmul.c's portable product_t: y[t, j] =
// Σ over r = 0, 1, … in order of x[t, r] * (w[r, j] dequantised to float32 first), no FMA. y: f32
// [n, w->cols] (written); scratch: n * (w->cols rounded up to 64) floats.
typedef void (*tprod_fn)(float *y, const QMatrix *w, const float *x, int n, float *scratch);

typedef struct {
    const char *name;
    dot_fn f32;       // f32 weights
    dot_fn int8_f32;  // int8 weights, ACT_F32
    dot_fn int8_q8;   // int8 weights, ACT_Q8
    dot_fn int4_f32;  // int4 weights, ACT_F32
    dot_fn int4_q8;   // int4 weights, ACT_Q8
    rows_fn int4_q8_rows;  // optional (NULL): int4 weights, ACT_Q8, several tokens per row pass
    dot_fn fp8_f32;   // fp8 weights (ACT_F32 only)
    dot_fn fp4_f32;   // fp4 weights, ACT_F32
    dot_fn fp4_q8;    // fp4 weights, ACT_Q8
    rows_fn fp8_f32_rows;  // optional (NULL): fp8 weights, several tokens per row pass
    rows_fn fp4_f32_rows;  // optional (NULL): fp4 weights, ACT_F32, several tokens per row pass
    quant_fn quantize64;   // optional (NULL: matmul.c's scalar loop): one whole block of 64
    tprod_fn int4_t;       // optional (NULL: matmul.c's portable loop): matmul_t of int4 weights
    rows_fn int4_f32_rows; // optional (NULL): int4 weights, ACT_F32, several tokens per row pass
    rows_fn int8_f32_rows; // optional (NULL): int8 weights, ACT_F32, one token or several: rows interleaved
    rows_fn int8_q8_rows;  // optional (NULL): int8 weights, ACT_Q8, several tokens per row pass
    int q8_rows_from;      // the fewest tokens int4_q8_rows and int8_q8_rows take (0: 2); fewer take
                           // the dot row by row, where a rows kernel's transposition costs more than it saves
} Path;

// 2 * e2m1(nibble): the fp4 values as the integers 0, ±1, ±2, ±3, ±4, ±6, ±8, ±12 (matmul.c).
extern const int8_t FP4_TWICE[16];

// 2^(s - 127 - shift) of a UE8M0 byte s, exactly (a subnormal below 2^-126); NaN for s = 255.
static inline float e8m0_pow2(uint8_t s, int shift) {
    if (s == 255) return NAN;
    int e = (int)s - shift;
    uint32_t bits = e >= 1 ? (uint32_t)e << 23 : 0x00400000u >> -e;  // 2^-127 >> k = 2^(-127-k)
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

// The float32 scale a row's fp8 block / fp4 group is multiplied by: 2^(s - 127) for fp8 and, as
// the fp4 values are taken twice (FP4_TWICE), 2^(s - 128) for fp4; NaN for s = 255.
static inline float fp8_scale(uint8_t s) { return e8m0_pow2(s, 0); }
static inline float fp4_half_scale(uint8_t s) { return e8m0_pow2(s, 1); }

// The 32 bytes of int4 group g of a row, 0x88 (q = 0, 0) past the row's end (copied into tmp).
static inline const uint8_t *int4_group_bytes(const uint8_t *wr, int g, size_t row_bytes, uint8_t *tmp) {
    size_t at = (size_t)g * 32;
    if (at + 32 <= row_bytes) return wr + at;
    memset(tmp, 0x88, 32);
    memcpy(tmp, wr + at, row_bytes - at);
    return tmp;
}

extern const Path PATH_PORTABLE;
#if COLI_X86
extern const Path PATH_AVX2;    // matmul_avx2.c
extern const Path PATH_AVX512;  // matmul_avx512.c
extern const Path PATH_AMX;     // matmul_avx512.c: PATH_AVX512 with the tile unit's several-token rows
// matmul_avx2.c's kernels that the AVX-512 path uses too (it needs AVX2), where they are as fast or
// faster (`colibri bench kernels --simd all`): int8 weights with f32 activations, the fp8 dot
// products, fp4 with int8 activations, the several-token fp8 and fp4 rows, and the int8 activation
// quantiser; and the AVX-512 VNNI int4 x int8 kernels, which live beside AVX2's for their shared
// chunk layout: the one-token dot (256-bit vpdpbusd: on Zen 4, whose 512-bit operations take two
// cycles, a 512-bit version read no faster) and the several-token rows.
float dot_int8_f32_avx2(const QMatrix *w, int r, const Acts *a, int t);
float dot_int4_q8_avx2(const QMatrix *w, int r, const Acts *a, int t);
float dot_int4_q8_vnni(const QMatrix *w, int r, const Acts *a, int t);
void rows_int4_q8_avx2(const QMatrix *w, int r0, int r1, const Acts *a, const int32_t *tok, int n, float *const *yrow);
void rows_int4_q8_vnni(const QMatrix *w, int r0, int r1, const Acts *a, const int32_t *tok, int n, float *const *yrow);
// The AMX path's int4 and int8 rows with int8 activations on the tile unit, any n (matmul_avx512.c chooses when)
void rows_q8_tiles(const QMatrix *w, int r0, int r1, const Acts *a, const int32_t *tok, int n, float *const *yrow);
float dot_fp8_f32_avx2(const QMatrix *w, int r, const Acts *a, int t);
float dot_fp4_f32_avx2(const QMatrix *w, int r, const Acts *a, int t);
float dot_fp4_q8_avx2(const QMatrix *w, int r, const Acts *a, int t);
void rows_fp8_f32_avx2(const QMatrix *w, int r0, int r1, const Acts *a, const int32_t *tok, int n, float *const *yrow);
void rows_fp4_f32_avx2(const QMatrix *w, int r0, int r1, const Acts *a, const int32_t *tok, int n, float *const *yrow);
void quantize64_avx2(const float *x, int int4_order, int8_t *q, float *scale, int32_t *sum);
void product_t_int4_avx2(float *y, const QMatrix *w, const float *x, int n, float *scratch);
#endif

const Path *path_current(void);

// ----------------------------------------------------------------------------
// exp in float32 by colibri's own steps (layers.c), for the softmax of attention and the experts'
// SiLU: the same operations on every path, 8 lanes at a time where the path has AVX2, so every path
// and thread count gets the same bits (libm's expf is one value at a time, and not the same code on
// every machine). n = round(x log2 e), r = (x − n ln2_hi) − n ln2_lo, e^r by Cephes' expf
// polynomial, times 2^n in two steps (exact, then rounded once). Within 1 ulp of e^x (the kernel
// tests check it); +inf above 88.72284, 0 below −104, NaN stays NaN.
float coli_expf(float x);
// p[i] = coli_expf(p[i] − m) for i < n: a softmax's numerators. `simd`: 8 lanes at a time (AVX2).
void exp_shifted(float *p, int n, float m, int simd);
// h[i] = silu(min(g[i], L)) · clamp(u[i], −L, L), silu(a) = a / (1 + coli_expf(−a)), for i < n
// (L = INFINITY: no clamp; NaN stays NaN); h may be u.
void swiglu_rows(float *h, const float *g, const float *u, int n, float limit, int simd);
dot_fn path_dot(const Path *p, int kind, int act);
// The rows kernel for n tokens of weights `kind` in `act`, or NULL: the dot per row and token.
rows_fn path_rows(const Path *p, int kind, int act, int n);

// The rows of n_seq sequences stacked (a batch's generations in one call: attn_block, deltanet_block,
// moe_layer): Σ seq_T[i], or −1 where one is negative or the sum passes INT32_MAX.
static inline int seq_rows(int n_seq, const int *seq_T) {
    int T = 0;
    for (int i = 0; i < n_seq; i++) {
        if (seq_T[i] < 0 || seq_T[i] > INT32_MAX - T) return -1;
        T += seq_T[i];
    }
    return T;
}

// ----------------------------------------------------------------------------
// Rows jobs: the unit a task works on is a range of whole output rows, for every token.

typedef struct {
    dot_fn dot;
    rows_fn rows;           // NULL, or path_rows for these weights and n
    const QMatrix *w;
    const Acts *a;
    int n;                  // tokens
    const int32_t *tok;     // token i reads row tok[i] of a (NULL: row i)
    float *const *yrow;     // token i writes yrow[i][r] for row r
} RowsJob;

void rows_run(const RowsJob *j, int r0, int r1);

// Rows per task so that a product of `rows` rows x `work_per_row` multiply-adds, each row used by
// `tokens` tokens, splits well over the pool (whole rows only; the split never changes a result).
int rows_per_task(int rows, double work_per_row, int tokens);

// ----------------------------------------------------------------------------
// threads.c

// Work (multiply-adds or the like) below which a call runs on the caller alone: a wake-up costs more.
#define POOL_MIN_WORK 65536.0

// Run fn(ctx, i) for i in [0, ntasks) on the pool's threads and the caller; returns when all ran.
// Each task runs on exactly one thread. Called while the pool is busy (from another thread), the
// tasks run on the caller alone.
void pool_run(void (*fn)(void *ctx, int task), void *ctx, int ntasks);

#endif  // COLIBRI_KERNELS_IMPL_H
