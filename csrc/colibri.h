// colibri.h — the C kernels of colibri, declared in one place.
//
// Every kernel reads the weight formats defined in colibri_core/quant.py (the one definition):
//   f32:  data float32 [rows, cols]; no scales.
//   int8: data int8 [rows, cols], q in [-127, 127]; scales float32 [rows]; w = q * scale.
//   int4: data uint8 [rows, ceil(cols/2)], nibble = q + 8, even column in the low nibble
//         (a padding high nibble for odd cols holds 8, i.e. q = 0);
//         scales float16 bits [rows, ceil(cols/64)], one per group of 64 columns
//         (the last group of a row may be shorter); w = q * float32(scale).
// Matrices are row-major [rows, cols] = [out, in]; activations are float32 row-major [n, dim].
//
// Determinism: each output element is reduced in one fixed order (sequentially over the input
// dimension; for int4 group by group), so a result depends only on the inputs and the code path.
//
// This header is also cffi's cdef (colibri_core/kernels/_build.py drops the lines starting with
// '#'): keep it to plain declarations — no macros inside declarations, no inline functions.
#ifndef COLIBRI_H
#define COLIBRI_H

#include <stdint.h>

// ----------------------------------------------------------------------------
// Weights

enum {
    QKIND_F32 = 0,
    QKIND_INT8 = 1,
    QKIND_INT4 = 2,
    INT4_GROUP = 64,  // columns per int4 scale group
};

// Status codes returned by the kernels.
enum {
    COLI_OK = 0,
    COLI_EINVAL = -1,  // unknown kind or mismatched shapes
    COLI_ENOMEM = -2,  // a scratch buffer could not be allocated
};

// A (possibly quantised) weight matrix [rows, cols]; the arrays are borrowed, never copied.
typedef struct {
    int kind;            // QKIND_F32 | QKIND_INT8 | QKIND_INT4
    int rows;            // output dimension
    int cols;            // input dimension
    const void *data;    // f32 [rows, cols] | int8 [rows, cols] | uint8 [rows, ceil(cols/2)]
    const void *scales;  // NULL | f32 [rows] | f16 bits, uint16 [rows, ceil(cols/64)]
} QMatrix;

// ----------------------------------------------------------------------------
// matmul.c — quantised matrix products

// IEEE half (its bit pattern) to float, exactly; handles zero, subnormals, inf and NaN.
float f16_to_f32(uint16_t h);

// COLI_OK if w names a known kind, a non-negative shape and the (non-NULL) arrays that kind needs,
// else COLI_EINVAL. w: QMatrix.
int qmatrix_check(const QMatrix *w);

// dot(row r of w, x): one output element, reduced in the fixed order described above.
// w: QMatrix [rows, cols]; x: f32 [cols].
float qmatrix_row_dot(const QMatrix *w, int r, const float *x);

// y = x @ dequant(w).T, token by token.
// y: f32 [n, w->rows] (written); w: QMatrix [rows, cols]; x: f32 [n, w->cols].
// Returns COLI_OK, or COLI_EINVAL when qmatrix_check(w) fails.
int matmul(float *y, const QMatrix *w, const float *x, int n);

// y = x @ dequant(w) (no transpose): y[t, j] = sum over r = 0, 1, ... of x[t, r] * w[r, j], each
// weight dequantised to float32 first (q * scale). MLA absorbs kv_b_proj's key rows this way.
// y: f32 [n, w->cols] (written); w: QMatrix [rows, cols]; x: f32 [n, w->rows].
// Returns COLI_OK, COLI_EINVAL when qmatrix_check(w) fails, or COLI_ENOMEM.
int matmul_t(float *y, const QMatrix *w, const float *x, int n);

// The name of the code path in use ("portable"; SIMD paths are chosen here later).
const char *simd_name(void);

// ----------------------------------------------------------------------------
// expert_ffn.c — one routed expert, fused

// out = down( silu(gate x) * (up x) ), silu(a) = a / (1 + exp(-a)); the [n, inter] intermediate
// lives in a scratch buffer owned by this call.
// out: f32 [n, hidden] (written); gate, up: QMatrix [inter, hidden]; down: QMatrix [hidden, inter];
// x: f32 [n, hidden]. Returns COLI_OK, COLI_EINVAL (shapes/kinds) or COLI_ENOMEM.
int expert_ffn(float *out, const QMatrix *gate, const QMatrix *up, const QMatrix *down,
               const float *x, int n);

#endif  // COLIBRI_H
