// ceiling.c — how fast the exact (float32-activation) one-token dot of int4 and int8 weights can be
// on this CPU, one core.
//
// The exact mode's contract is its arithmetic (matmul.c): int4, per group of 64 weights and each of
// 16 lanes, A = ((q0·x0 + q1·x1) + q2·x2) + q3·x3, every product and sum rounded to float32, then
// S += A·scale: 5 multiplies and 4 adds of 16 lanes per 32 bytes of weights; int8, per 16 columns
// L += w·x: 1 multiply and 1 add of 16 lanes per 16 bytes. That much float work is owed whatever
// the code does to turn the stored integers into floats. Measured on one core with the weights in
// L2 (so memory does not limit), in GB/s of weights:
//   kernel       the path's real one-token kernel (csrc/, linked in), conversions included;
//   arithmetic   the contract's multiplies and adds alone, the weights handed over as floats
//                already (its bits checked equal to the kernel's first): no kernel that keeps
//                the contract runs faster on this core;
//   int8 acts    the path's kernel with int8 activations (the explicit fast mode), for scale;
// and one core's read bandwidth (mem_read, one thread, 512 MB). `arithmetic / read` is the best
// fraction of one core's read bandwidth the exact mode can reach here with the products computed.
// Where the CPU has AVX-512, two more lines: the same int4 contract with the products looked up
// instead (interleaved_512: a layout the engine does not have), its bits checked too; and one core's
// rate of 512-bit vpdpbusd (64 byte products each), which caps several tokens an expert with int8
// activations whatever else a kernel does: each token owes one per 64 weights. Without VNNI (the
// AVX2 path) the same cap comes from the product steps the AVX2 kernels take per 32 bytes of
// weights and token, timed the same way: int8 x int8 sign + maddubs + madd + add (|w| x sign(q, w),
// no cheaper exact step found: csrc/matmul_avx2.c, rows_int8_q8_avx2), int4 x int8 two maddubs +
// adds (64 weights), a madd every 8 maddubs.
// Every rate is also given in cycles per 64 weights, at the clock a chain of dependent register adds
// measures (one a cycle), beside how many 512-bit and 256-bit float multiplies one core starts a
// cycle (independent chains): a kernel's vector instructions per 64 weights (its loop's, objdump)
// over its cycles tells whether the ports that run them, not memory or latency, bind it.
// Run: tools/exact_ceiling/run.sh
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../../csrc/impl/kernels_impl.h"

enum { COLS = 4096, GROUPS = COLS / 64, ROWS = 32 };  // int4 64 KB, int8 128 KB of weights: in L2

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

// The kernels' final sum of the 16 lanes: l + l+8, then + 4, + 2, + 1
static float tree16(const float *l) {
    float s8[8], s4[4];
    for (int i = 0; i < 8; i++) s8[i] = l[i] + l[i + 8];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// The int4 contract's arithmetic alone, every row; q: the weights as floats in the order the kernel
// reads them ([row][group][4][16]); x: the group-ordered activations (Acts.xf). 4 rows side by side,
// each group's activations loaded once for all 4 (the kernel runs one row at a time: this is the
// faster arrangement). Row r + k and group g take the floats of row (r + k) & rmask, group g & gmask:
// every one (~0, ~0) for the bits, or 4 rows x 4 groups (3, 3) to time it: its floats, 8 times the
// kernel's bytes, then come from L1 instead of L2.
__attribute__((target("avx512f"))) static void arithmetic4_512(const float *q, int rmask, int gmask, const float *x,
                                                                  const float *scale, float *y) {
    for (int r = 0; r < ROWS; r += 4) {
        __m512 S[4];
        for (int k = 0; k < 4; k++) S[k] = _mm512_setzero_ps();
        for (int g = 0; g < GROUPS; g++) {
            const float *xg = x + (size_t)g * 64;
            __m512 xv[4];
            for (int i = 0; i < 4; i++) xv[i] = _mm512_loadu_ps(xg + 16 * i);
            for (int k = 0; k < 4; k++) {
                const float *qg = q + (size_t)((r + k) & rmask) * COLS + (size_t)(g & gmask) * 64;
                __m512 A = _mm512_mul_ps(_mm512_loadu_ps(qg), xv[0]);
                for (int i = 1; i < 4; i++) A = _mm512_add_ps(A, _mm512_mul_ps(_mm512_loadu_ps(qg + 16 * i), xv[i]));
                S[k] = _mm512_add_ps(S[k], _mm512_mul_ps(A, _mm512_set1_ps(scale[(r + k) * GROUPS + g])));
            }
        }
        for (int k = 0; k < 4; k++) {
            float l[16];
            _mm512_storeu_ps(l, S[k]);
            y[r + k] = tree16(l);
        }
    }
}

// The same with 8 lanes a vector (AVX2: each 16-lane step is two 8-lane ones), 2 rows side by side
// (AVX2 has 16 vector registers)
__attribute__((target("avx2"))) static void arithmetic4_256(const float *q, int rmask, int gmask, const float *x,
                                                               const float *scale, float *y) {
    for (int r = 0; r < ROWS; r += 2) {
        __m256 S[2][2];
        for (int k = 0; k < 2; k++) S[k][0] = S[k][1] = _mm256_setzero_ps();
        for (int g = 0; g < GROUPS; g++) {
            const float *xg = x + (size_t)g * 64;
            for (int k = 0; k < 2; k++) {
                const float *qg = q + (size_t)((r + k) & rmask) * COLS + (size_t)(g & gmask) * 64;
                __m256 A = _mm256_mul_ps(_mm256_loadu_ps(qg), _mm256_loadu_ps(xg));
                __m256 B = _mm256_mul_ps(_mm256_loadu_ps(qg + 8), _mm256_loadu_ps(xg + 8));
                for (int i = 1; i < 4; i++) {
                    A = _mm256_add_ps(A, _mm256_mul_ps(_mm256_loadu_ps(qg + 16 * i), _mm256_loadu_ps(xg + 16 * i)));
                    B = _mm256_add_ps(B, _mm256_mul_ps(_mm256_loadu_ps(qg + 16 * i + 8), _mm256_loadu_ps(xg + 16 * i + 8)));
                }
                __m256 sc = _mm256_set1_ps(scale[(r + k) * GROUPS + g]);
                S[k][0] = _mm256_add_ps(S[k][0], _mm256_mul_ps(A, sc));
                S[k][1] = _mm256_add_ps(S[k][1], _mm256_mul_ps(B, sc));
            }
        }
        for (int k = 0; k < 2; k++) {
            float l[16];
            _mm256_storeu_ps(l, S[k][0]);
            _mm256_storeu_ps(l + 8, S[k][1]);
            y[r + k] = tree16(l);
        }
    }
}

// int8 weights: per row 16 lanes, L += w·x per 16 columns in order, then tree16 · the row's scale;
// 4 rows side by side as the kernels run them (one row's chain of adds would bound it by their
// latency). Row r + k and column j take the floats of row (r + k) & rmask, column j & cmask: every
// one (~0, ~0) for the bits, or 4 rows x 64 (3, 63) to time it from L1.
__attribute__((target("avx512f"))) static void arithmetic8_512(const float *wf, int rmask, int cmask, const float *x,
                                                                  const float *scale, float *y) {
    for (int r = 0; r < ROWS; r += 4) {
        __m512 L[4];
        for (int k = 0; k < 4; k++) L[k] = _mm512_setzero_ps();
        for (int j = 0; j < COLS; j += 16) {
            __m512 xv = _mm512_loadu_ps(x + j);
            for (int k = 0; k < 4; k++)
                L[k] = _mm512_add_ps(L[k], _mm512_mul_ps(_mm512_loadu_ps(wf + (size_t)((r + k) & rmask) * COLS + (j & cmask)), xv));
        }
        for (int k = 0; k < 4; k++) {
            float l[16];
            _mm512_storeu_ps(l, L[k]);
            y[r + k] = tree16(l) * scale[r + k];
        }
    }
}

__attribute__((target("avx2"))) static void arithmetic8_256(const float *wf, int rmask, int cmask, const float *x,
                                                               const float *scale, float *y) {
    for (int r = 0; r < ROWS; r += 4) {
        __m256 A[4], B[4];
        for (int k = 0; k < 4; k++) A[k] = B[k] = _mm256_setzero_ps();
        for (int j = 0; j < COLS; j += 16) {
            __m256 xa = _mm256_loadu_ps(x + j), xb = _mm256_loadu_ps(x + j + 8);
            for (int k = 0; k < 4; k++) {
                const float *p = wf + (size_t)((r + k) & rmask) * COLS + (j & cmask);
                A[k] = _mm256_add_ps(A[k], _mm256_mul_ps(_mm256_loadu_ps(p), xa));
                B[k] = _mm256_add_ps(B[k], _mm256_mul_ps(_mm256_loadu_ps(p + 8), xb));
            }
        }
        for (int k = 0; k < 4; k++) {
            float l[16];
            _mm256_storeu_ps(l, A[k]);
            _mm256_storeu_ps(l + 8, B[k]);
            y[r + k] = tree16(l) * scale[r + k];
        }
    }
}

// The int4 contract with rows in the vector lanes: 16 rows at a time, and for each column c a table
// of its 16 possible products (n - 8)·x_c (the very products the kernel rounds), so one permute by
// the rows' nibbles gives 16 rows' products: no multiply and no nibble-to-float conversion per
// weight. It needs the weights interleaved ([16-row block][group][lane pair][row]: per row the
// dword of bytes l, l + 16, l + 1, l + 17, lane pair l = 2p), which the engine's layout is not.
enum { IL_ROWS = 16 };
__attribute__((target("avx512f"))) static void interleaved_512(const uint32_t *il, const float *scale_il,
                                                                  const float (*table)[16], float *y) {
    for (int blk = 0; blk < ROWS / IL_ROWS; blk++) {
        __m512 S[16];
        for (int l = 0; l < 16; l++) S[l] = _mm512_setzero_ps();
        for (int g = 0; g < GROUPS; g++) {
            const float(*T)[16] = table + (size_t)g * 64;  // even columns 0-31, odd 32-63 (Acts.xf order)
            const uint32_t *d8 = il + ((size_t)blk * GROUPS + g) * 8 * IL_ROWS;
            __m512 sc = _mm512_loadu_ps(scale_il + ((size_t)blk * GROUPS + g) * IL_ROWS);
            for (int pair = 0; pair < 8; pair++) {
                __m512i d = _mm512_loadu_si512(d8 + pair * IL_ROWS);
                for (int h = 0; h < 2; h++) {  // lane l: its nibbles at bits 0 (lo[l]), 8 (lo[l+16]), 4, 12 (hi)
                    int l = 2 * pair + h;
                    __m512i e = h ? _mm512_srli_epi32(d, 16) : d;
                    __m512 A = _mm512_permutexvar_ps(e, _mm512_loadu_ps(T[l]));
                    A = _mm512_add_ps(A, _mm512_permutexvar_ps(_mm512_srli_epi32(e, 8), _mm512_loadu_ps(T[l + 16])));
                    A = _mm512_add_ps(A, _mm512_permutexvar_ps(_mm512_srli_epi32(e, 4), _mm512_loadu_ps(T[32 + l])));
                    A = _mm512_add_ps(A, _mm512_permutexvar_ps(_mm512_srli_epi32(e, 12), _mm512_loadu_ps(T[48 + l])));
                    S[l] = _mm512_add_ps(S[l], _mm512_mul_ps(A, sc));
                }
            }
        }
        float lanes[16][16];
        for (int l = 0; l < 16; l++) _mm512_storeu_ps(lanes[l], S[l]);
        for (int r = 0; r < IL_ROWS; r++) {
            float v[16];
            for (int l = 0; l < 16; l++) v[l] = lanes[l][r];
            y[blk * IL_ROWS + r] = tree16(v);
        }
    }
}

__attribute__((target("avx512f"))) static void product_tables_512(const float *x, float (*table)[16]) {
    const __m512 q = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    for (int c = 0; c < COLS; c++) _mm512_storeu_ps(table[c], _mm512_mul_ps(q, _mm512_set1_ps(x[c])));
}

static uint32_t rng = 2463534242u;
static uint32_t rnd(void) {
    rng ^= rng << 13; rng ^= rng >> 17; rng ^= rng << 5;
    return rng;
}

static volatile float sink;

// GB/s of weights for `pass_` (every row once, `nbytes` of weights), best of 5 runs of ~0.2 s
#define MEASURE(nbytes, pass_)                                                                  \
    ({                                                                                          \
        double best = 0;                                                                        \
        for (int run = 0; run < 5; run++) {                                                     \
            long reps = 0;                                                                      \
            double t0 = now(), dt;                                                              \
            do {                                                                                \
                pass_;                                                                          \
                reps++;                                                                         \
            } while ((dt = now() - t0) < 0.2);                                                  \
            double gbps = (double)reps * (double)(nbytes) / dt / 1e9;                           \
            if (gbps > best) best = gbps;                                                       \
        }                                                                                       \
        best;                                                                                   \
    })
#define EACH_ROW(call) for (int r = 0; r < ROWS; r++) sink = (call)

// The core's clock: a chain of dependent register adds, one a cycle (an add of an immediate can
// take no cycle at all on recent cores: a register operand keeps each one waiting on the last).
static double clock_hz(void) {
    unsigned long x = 0, n = 100000000;
    double t0 = now();
    for (unsigned long i = 0; i < n; i++) __asm__ volatile("add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0" : "+r"(x) : "r"(i));
    double dt = now() - t0;
    sink = (float)x;
    return 4.0 * (double)n / dt;
}

// Float multiplies a second on one core in registers of vector type V (512- or 256-bit, GCC's vector
// extensions): 12 independent chains.
#define MULTIPLIES(name, isa, V)                                                                   \
    __attribute__((target(isa))) static double name(void) {                                        \
        V a[12], b = (V){0} + 1.0000001f;                                                          \
        for (int i = 0; i < 12; i++) a[i] = (V){0} + (float)i;                                     \
        long n = 20000000;                                                                         \
        double t0 = now();                                                                         \
        for (long it = 0; it < n; it++) {                                                          \
            _Pragma("GCC unroll 12") for (int i = 0; i < 12; i++) a[i] = a[i] * b;                 \
            __asm__ volatile("" : "+x"(b)); /* not hoisted out of the loop */                      \
        }                                                                                          \
        double dt = now() - t0;                                                                    \
        for (int i = 1; i < 12; i++) a[0] += a[i];                                                 \
        sink = a[0][0];                                                                            \
        return 12.0 * (double)n / dt;                                                              \
    }
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
MULTIPLIES(multiplies_512, "avx512f", f32x16)
MULTIPLIES(multiplies_256, "avx2", f32x8)

// Seconds a 512-bit vpdpbusd on one core: 12 independent chains (more than latency x throughput),
// the operands in registers.
__attribute__((target("avx512f,avx512vnni"))) static double vpdpbusd_seconds(void) {
    __m512i b = _mm512_set1_epi8(3), c = _mm512_set1_epi8(5), s[12];
    for (int i = 0; i < 12; i++) s[i] = _mm512_set1_epi32(i);
    long n = 20000000;
    double t0 = now();
    for (long it = 0; it < n; it++) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++) s[i] = _mm512_dpbusd_epi32(s[i], b, c);
        __asm__ volatile("" : "+v"(b), "+v"(c));  // not hoisted out of the loop
    }
    double dt = now() - t0;
    for (int i = 1; i < 12; i++) s[0] = _mm512_add_epi32(s[0], s[i]);
    sink = (float)_mm512_reduce_add_epi32(s[0]);
    return dt / (12.0 * (double)n);
}

// Seconds per 32 bytes of weights and token of the AVX2 kernels' product steps on one core, the
// operands in registers: 6 chains, each with its own activations (re-read every round, so nothing
// is hoisted). int8: s += madd(maddubs(|w|, sign(x, w)), 1); int4: p += maddubs(w, x) twice (the
// nibbles of 32 bytes), s += madd(p, 1) every 8 maddubs.
__attribute__((target("avx2"))) static double avx2_product_seconds(int int4) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i w = _mm256_set1_epi8(-3), u = _mm256_abs_epi8(w), x[6], s[6], p[6];
    for (int i = 0; i < 6; i++) x[i] = _mm256_set1_epi8((char)(i + 1)), s[i] = p[i] = _mm256_setzero_si256();
    long n = 20000000;
    double t0 = now();
    for (long it = 0; it < n; it++) {
        __asm__ volatile("" : "+x"(x[0]), "+x"(x[1]), "+x"(x[2]), "+x"(x[3]), "+x"(x[4]), "+x"(x[5]));
        if (int4) {
#pragma GCC unroll 6
            for (int i = 0; i < 6; i++) {
                p[i] = _mm256_add_epi16(p[i], _mm256_maddubs_epi16(u, x[i]));
                p[i] = _mm256_add_epi16(p[i], _mm256_maddubs_epi16(w, x[i]));
            }
            if ((it & 3) == 3) {
#pragma GCC unroll 6
                for (int i = 0; i < 6; i++) s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(p[i], ones)), p[i] = _mm256_setzero_si256();
            }
        } else {
#pragma GCC unroll 6
            for (int i = 0; i < 6; i++) s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(x[i], w)), ones));
        }
    }
    double dt = now() - t0;
    for (int i = 1; i < 6; i++) s[0] = _mm256_add_epi32(s[0], _mm256_add_epi32(s[i], p[i]));
    sink = (float)_mm256_extract_epi32(s[0], 0);
    return dt / (6.0 * (double)n);
}

int main(void) {
    size_t row_bytes = COLS / 2;
    uint8_t *data = malloc(ROWS * row_bytes);
    uint16_t *scales = malloc(ROWS * GROUPS * sizeof *scales);
    float *x = malloc(COLS * sizeof *x), *q = malloc((size_t)ROWS * COLS * sizeof *q), *scf = malloc(ROWS * GROUPS * sizeof *scf);
    for (size_t i = 0; i < ROWS * row_bytes; i++) data[i] = (uint8_t)rnd();
    for (int i = 0; i < ROWS * GROUPS; i++) scales[i] = (uint16_t)(0x2000 + rnd() % 0x1000), scf[i] = f16_to_f32(scales[i]);
    for (int i = 0; i < COLS; i++) x[i] = (float)((int32_t)rnd()) / 2147483648.0f;
    // the floats the kernels make of the nibbles, in their order: per group the low nibbles of
    // bytes 0-31 (even columns), then the high ones (odd columns)
    for (int r = 0; r < ROWS; r++)
        for (int g = 0; g < GROUPS; g++)
            for (int b = 0; b < 32; b++) {
                uint8_t v = data[(size_t)r * row_bytes + (size_t)g * 32 + b];
                q[(size_t)r * COLS + (size_t)g * 64 + b] = (float)((v & 15) - 8);
                q[(size_t)r * COLS + (size_t)g * 64 + 32 + b] = (float)((v >> 4) - 8);
            }
    int8_t *data8 = malloc((size_t)ROWS * COLS);
    float *w8f = malloc((size_t)ROWS * COLS * sizeof *w8f), scale8[ROWS];
    for (size_t i = 0; i < (size_t)ROWS * COLS; i++) data8[i] = (int8_t)(rnd() % 255 - 127), w8f[i] = data8[i];
    for (int r = 0; r < ROWS; r++) scale8[r] = 0.001f + (float)(rnd() % 1000) * 1e-5f;
    QMatrix w = {.kind = QKIND_INT4, .rows = ROWS, .cols = COLS, .data = data, .scales = scales};
    QMatrix w8 = {.kind = QKIND_INT8, .rows = ROWS, .cols = COLS, .data = data8, .scales = scale8};
    Acts af, aq, a8, a8q;
    if (acts_prepare(&af, x, 1, COLS, QKIND_INT4, ACT_F32) != COLI_OK || acts_prepare(&aq, x, 1, COLS, QKIND_INT4, ACT_Q8) != COLI_OK ||
        acts_prepare(&a8, x, 1, COLS, QKIND_INT8, ACT_F32) != COLI_OK || acts_prepare(&a8q, x, 1, COLS, QKIND_INT8, ACT_Q8) != COLI_OK) {
        fprintf(stderr, "acts_prepare failed\n");
        return 1;
    }
    threads_set(1);
    size_t nbytes = (size_t)512 << 20;
    uint64_t *buf = malloc(nbytes);
    memset(buf, 1, nbytes);
    double read = 0;
    for (int pass = 0; pass < 5; pass++) {
        double t0 = now();
        sink = (float)mem_read(buf, nbytes);
        double gbps = nbytes / (now() - t0) / 1e9;
        if (gbps > read) read = gbps;
    }
    double hz = clock_hz();
    printf("one core, one token, weights in L2 (%d x %d), GB/s of weights; read bandwidth of one core %.1f GB/s\n", ROWS, COLS, read);
    printf("clock %.2f GHz (dependent adds); float multiplies a cycle: 256-bit %.2f", hz / 1e9,
           simd_supported("avx2") ? multiplies_256() / hz : 0.0);
    if (simd_supported("avx512")) printf(", 512-bit %.2f", multiplies_512() / hz);
    printf("; (cycles per 64 weights)\n");
    printf("%-8s %-5s %16s %18s %16s   %s\n", "path", "wts", "kernel", "arithmetic", "int8 acts", "arithmetic / read");
#define CYCLES(gbps, bytes64) (hz * (bytes64) / ((gbps) * 1e9))  // cycles per 64 weights at `gbps`
    const Path *paths[] = {&PATH_AVX2, &PATH_AVX512};
    for (int p = 0; p < 2; p++) {
        if (!simd_supported(paths[p]->name)) {
            printf("%-8s this CPU cannot run it\n", paths[p]->name);
            continue;
        }
        const Path *path = paths[p];
        // int4: the kernel row by row against the arithmetic, the same bits first
        float y[ROWS], ya[ROWS], *yrow[1] = {y};
        for (int r = 0; r < ROWS; r++) y[r] = path->int4_f32(&w, r, &af, 0);
        (p == 0 ? arithmetic4_256 : arithmetic4_512)(q, ~0, ~0, af.xf, scf, ya);
        for (int r = 0; r < ROWS; r++) {
            if (memcmp(&y[r], &ya[r], sizeof y[r]) != 0) {
                fprintf(stderr, "%s int4 row %d: the arithmetic loop gives %a, the kernel %a\n", path->name, r, ya[r], y[r]);
                return 1;
            }
        }
        size_t b4 = (size_t)ROWS * row_bytes, b8 = (size_t)ROWS * COLS;
        double kernel = MEASURE(b4, EACH_ROW(path->int4_f32(&w, r, &af, 0)));
        double arith = MEASURE(b4, (p == 0 ? arithmetic4_256 : arithmetic4_512)(q, 3, 3, af.xf, scf, ya));
        double q8 = MEASURE(b4, EACH_ROW(path->int4_q8(&w, r, &aq, 0)));
        printf("%-8s %-5s %8.1f (%5.1f) %10.1f (%5.1f) %8.1f (%5.1f)   %.0f %%\n", path->name, "int4", kernel,
               CYCLES(kernel, 32), arith, CYCLES(arith, 32), q8, CYCLES(q8, 32), 100 * arith / read);
        // int8: the path's rows kernel over all rows against the arithmetic, the same bits first
        path->int8_f32_rows(&w8, 0, ROWS, &a8, NULL, 1, yrow);
        (p == 0 ? arithmetic8_256 : arithmetic8_512)(w8f, ~0, ~0, a8.xf, scale8, ya);
        for (int r = 0; r < ROWS; r++) {
            if (memcmp(&y[r], &ya[r], sizeof y[r]) != 0) {
                fprintf(stderr, "%s int8 row %d: the arithmetic loop gives %a, the kernel %a\n", path->name, r, ya[r], y[r]);
                return 1;
            }
        }
        kernel = MEASURE(b8, path->int8_f32_rows(&w8, 0, ROWS, &a8, NULL, 1, yrow));
        arith = MEASURE(b8, (p == 0 ? arithmetic8_256 : arithmetic8_512)(w8f, 3, 63, a8.xf, scale8, ya));
        q8 = MEASURE(b8, EACH_ROW(path->int8_q8(&w8, r, &a8q, 0)));
        printf("%-8s %-5s %8.1f (%5.1f) %10.1f (%5.1f) %8.1f (%5.1f)   %.0f %%\n", path->name, "int8", kernel,
               CYCLES(kernel, 64), arith, CYCLES(arith, 64), q8, CYCLES(q8, 64), 100 * arith / read);
    }
    if (simd_supported("avx512")) {
        uint32_t *il = malloc((size_t)ROWS * row_bytes);
        float *scale_il = malloc(ROWS * GROUPS * sizeof *scale_il), (*table)[16] = malloc(COLS * sizeof *table), y[ROWS];
        for (int blk = 0; blk < ROWS / IL_ROWS; blk++)
            for (int g = 0; g < GROUPS; g++)
                for (int r = 0; r < IL_ROWS; r++) {
                    const uint8_t *b = data + (size_t)(blk * IL_ROWS + r) * row_bytes + (size_t)g * 32;
                    scale_il[((size_t)blk * GROUPS + g) * IL_ROWS + r] = scf[(blk * IL_ROWS + r) * GROUPS + g];
                    for (int pair = 0; pair < 8; pair++) {
                        int l = 2 * pair;
                        il[(((size_t)blk * GROUPS + g) * 8 + pair) * IL_ROWS + r] =
                            b[l] | (uint32_t)b[l + 16] << 8 | (uint32_t)b[l + 1] << 16 | (uint32_t)b[l + 17] << 24;
                    }
                }
        product_tables_512(af.xf, table);
        interleaved_512(il, scale_il, (const float(*)[16])table, y);
        for (int r = 0; r < ROWS; r++) {
            float k = PATH_AVX512.int4_f32(&w, r, &af, 0);
            if (memcmp(&k, &y[r], sizeof k) != 0) {
                fprintf(stderr, "interleaved row %d: %a, the kernel %a\n", r, y[r], k);
                return 1;
            }
        }
        double b4 = (double)ROWS * row_bytes, il_gbps = MEASURE(b4, interleaved_512(il, scale_il, (const float(*)[16])table, y));
        double t0 = now();
        for (int i = 0; i < 100; i++) product_tables_512(i & 1 ? x : af.xf, table);  // two inputs: not hoisted
        printf("avx512   int4 with the products looked up, rows interleaved: %.1f GB/s, the same bits "
               "(its tables: %.1f us a token for %d columns)\n", il_gbps, (now() - t0) / 100 * 1e6, COLS);
    }
    if (simd_supported("avx512")) {
        double dp = vpdpbusd_seconds();
        printf("avx512   vpdpbusd (512-bit): %.3f ns on one core; the multiply-adds alone of 8 tokens an expert "
               "(int8 activations) cap one core at %.1f GB/s of int8 weights, %.1f of int4 (%.0f %%, %.0f %% of its read)\n",
               dp * 1e9, 64 / (8 * dp) / 1e9, 32 / (8 * dp) / 1e9, 100 * 64 / (8 * dp) / 1e9 / read, 100 * 32 / (8 * dp) / 1e9 / read);
    }
    if (simd_supported("avx2")) {
        double p8 = avx2_product_seconds(0), p4 = avx2_product_seconds(1);
        printf("avx2     product steps per 32 bytes and token: int8 x int8 %.3f ns, int4 x int8 %.3f ns on one core; "
               "those alone of 8 tokens an expert cap one core at %.1f GB/s of int8 weights, %.1f of int4 "
               "(%.0f %%, %.0f %% of its read)\n",
               p8 * 1e9, p4 * 1e9, 32 / (8 * p8) / 1e9, 32 / (8 * p4) / 1e9, 100 * 32 / (8 * p8) / 1e9 / read,
               100 * 32 / (8 * p4) / 1e9 / read);
    }
    return 0;
}
