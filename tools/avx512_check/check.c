// check.c — the AVX-512 row dot products (csrc/matmul_avx512.c, compiled over SIMDe) against the
// portable ones, bit for bit, on random weights and activations of awkward sizes. For machines
// without AVX-512, where the real path cannot run: it checks the algorithm (lane order, masks,
// shuffles, vpdpbusd sums), not the compiler's AVX-512 code. Run: tools/avx512_check/run.sh
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../csrc/impl/kernels_impl.h"

extern const Path PATH_AVX512_SIMDE;

static uint64_t rng_state = 88172645463325252ull;
static uint32_t rnd(void) {
    rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
    return (uint32_t)rng_state;
}
static float rndf(void) { return ((int32_t)rnd() / 2147483648.0f) * 3.0f; }

int main(void) {
    static const int sizes[] = {1, 3, 16, 31, 63, 64, 65, 127, 130, 200, 511, 513, 1024, 2048, 4097};
    int kinds[] = {QKIND_F32, QKIND_INT8, QKIND_INT8, QKIND_INT4, QKIND_INT4};
    int acts[] = {ACT_F32, ACT_F32, ACT_Q8, ACT_F32, ACT_Q8};
    long checked = 0, bad = 0;
    for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++) {
        int cols = sizes[si], rows = 5, n = 3;
        for (int m = 0; m < 5; m++) {
            int kind = kinds[m], act = acts[m];
            // int4 x int8 for one token is matmul_avx2.c's VNNI dot (native code, not SIMDe): it
            // runs only where the CPU has AVX-512 VNNI (the kernel tests check it there)
            if (kind == QKIND_INT4 && act == ACT_Q8 && !__builtin_cpu_supports("avx512vnni")) {
                if (si == 0) printf("skipped: int4 x int8 (matmul_avx2.c's native VNNI dot; this CPU lacks AVX-512 VNNI)\n");
                continue;
            }
            size_t row_bytes = kind == QKIND_F32 ? 4 * (size_t)cols : kind == QKIND_INT8 ? (size_t)cols : ((size_t)cols + 1) / 2;
            size_t ngroups = ((size_t)cols + 63) / 64;
            uint8_t *data = malloc(rows * row_bytes + 256);  // padded: the shims' masked loads read plain memory
            for (size_t i = 0; i < rows * row_bytes + 256; i++) data[i] = (uint8_t)rnd();
            if (kind == QKIND_F32) for (size_t i = 0; i < (size_t)rows * cols; i++) ((float *)data)[i] = rndf();
            if (kind == QKIND_INT8) for (size_t i = 0; i < (size_t)rows * cols; i++) if (data[i] == 0x80) data[i] = 0x81;
            void *scales = NULL;
            if (kind == QKIND_INT8) {
                float *s = malloc(rows * sizeof(float));
                for (int r = 0; r < rows; r++) s[r] = fabsf(rndf()) / 100;
                scales = s;
            } else if (kind == QKIND_INT4) {
                uint16_t *s = malloc(rows * ngroups * sizeof(uint16_t) + 64);
                for (size_t i = 0; i < rows * ngroups; i++) s[i] = (uint16_t)(0x1000 + rnd() % 0x2000);  // normal and subnormal-ish halves
                scales = s;
            }
            QMatrix w = {kind, rows, cols, data, scales};
            float *x = malloc((size_t)n * cols * sizeof(float));
            for (size_t i = 0; i < (size_t)n * cols; i++) x[i] = rndf();
            x[cols / 2] = 0.0f;
            Acts a;
            acts_prepare(&a, x, n, cols, kind, act);
            dot_fn ref = path_dot(&PATH_PORTABLE, kind, a.act), got = path_dot(&PATH_AVX512_SIMDE, kind, a.act);
            for (int r = 0; r < rows; r++) {
                for (int t = 0; t < n; t++) {
                    float y0 = ref(&w, r, &a, t), y1 = got(&w, r, &a, t);
                    checked++;
                    if (memcmp(&y0, &y1, 4) != 0) {
                        if (bad++ < 10) printf("differ: kind %d act %d cols %d row %d tok %d: %.9g vs %.9g\n", kind, act, cols, r, t, y0, y1);
                    }
                }
            }
            acts_free(&a);
            free(x);
            free(data);
            free(scales);
        }
    }
    printf("%ld of %ld row dot products differ between portable and avx512 (SIMDe)\n", bad, checked);
    return bad != 0;
}
