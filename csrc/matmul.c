// matmul.c — quantised matrix products: y = x @ dequant(w).T for f32, int8 and int4 weights.
//
// The weights are dequantised on the fly, never expanded in memory. Each output element is
// reduced in one fixed order, so results are deterministic:
//   f32:  sum_j w[j] * x[j], sequentially over j;
//   int8: (sum_j q[j] * x[j], sequentially) * scale, the row's scale applied once;
//   int4: for each group of 64 columns in order: acc = sum_j q[j] * x[j] sequentially,
//         then sum += acc * float32(scale of the group).
// All arithmetic is float32 with no contraction into FMA (built with -ffp-contract=off), so
// the portable path gives the same bits on every machine.
//
// Code paths: the three row dot products below are the portable reference. A SIMD path adds its
// own versions of them (in its own file, compiled with function-level target attributes) and
// `path` points at the best one the CPU supports; everything above the dot products is shared.
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"

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
// Row dot products, portable C

// w: f32 [cols]; x: f32 [cols]
static float dot_f32_portable(const float *w, const float *x, int cols) {
    float sum = 0.0f;
    for (int j = 0; j < cols; j++) {
        sum += w[j] * x[j];
    }
    return sum;
}

// w: int8 [cols]; scale: the row's f32 scale; x: f32 [cols]
static float dot_int8_portable(const int8_t *w, float scale, const float *x, int cols) {
    float sum = 0.0f;
    for (int j = 0; j < cols; j++) {
        sum += (float)w[j] * x[j];
    }
    return sum * scale;
}

// w: uint8 [ceil(cols/2)] nibbles q+8, even column low; scales: f16 bits [ceil(cols/64)];
// x: f32 [cols]
static float dot_int4_portable(const uint8_t *w, const uint16_t *scales, const float *x, int cols) {
    float sum = 0.0f;
    for (int g0 = 0; g0 < cols; g0 += INT4_GROUP) {
        int g1 = cols - g0 < INT4_GROUP ? cols : g0 + INT4_GROUP;  // the last group may be shorter
        float acc = 0.0f;
        int j = g0;  // even: groups start at multiples of 64
        for (; j + 1 < g1; j += 2) {
            uint8_t b = w[j / 2];
            acc += (float)((int)(b & 0x0f) - 8) * x[j];
            acc += (float)((int)(b >> 4) - 8) * x[j + 1];
        }
        if (j < g1) {  // odd cols: the last column sits alone in a low nibble
            acc += (float)((int)(w[j / 2] & 0x0f) - 8) * x[j];
        }
        sum += acc * f16_to_f32(scales[g0 / INT4_GROUP]);
    }
    return sum;
}

// ----------------------------------------------------------------------------
// Code paths

typedef struct {
    const char *name;
    float (*dot_f32)(const float *w, const float *x, int cols);
    float (*dot_int8)(const int8_t *w, float scale, const float *x, int cols);
    float (*dot_int4)(const uint8_t *w, const uint16_t *scales, const float *x, int cols);
} DotPath;

static const DotPath PORTABLE = {"portable", dot_f32_portable, dot_int8_portable, dot_int4_portable};

// The path in use. Run-time selection from the CPU's features goes here; for now only portable.
static const DotPath *path = &PORTABLE;

const char *simd_name(void) { return path->name; }

// ----------------------------------------------------------------------------
// Matrix products

int qmatrix_check(const QMatrix *w) {
    if (w == NULL || w->rows < 0 || w->cols < 0 || w->data == NULL) return COLI_EINVAL;
    switch (w->kind) {
    case QKIND_F32:
        return COLI_OK;
    case QKIND_INT8:
    case QKIND_INT4:
        return w->scales != NULL ? COLI_OK : COLI_EINVAL;
    default:
        return COLI_EINVAL;
    }
}

float qmatrix_row_dot(const QMatrix *w, int r, const float *x) {
    size_t row = (size_t)r;
    size_t cols = (size_t)w->cols;
    switch (w->kind) {
    case QKIND_F32: {
        const float *data = w->data;  // [rows, cols]
        return path->dot_f32(data + row * cols, x, w->cols);
    }
    case QKIND_INT8: {
        const int8_t *data = w->data;   // [rows, cols]
        const float *scales = w->scales;  // [rows]
        return path->dot_int8(data + row * cols, scales[row], x, w->cols);
    }
    case QKIND_INT4: {
        size_t row_bytes = (cols + 1) / 2;
        size_t row_groups = (cols + INT4_GROUP - 1) / INT4_GROUP;
        const uint8_t *data = w->data;     // [rows, row_bytes]
        const uint16_t *scales = w->scales;  // [rows, row_groups]
        return path->dot_int4(data + row * row_bytes, scales + row * row_groups, x, w->cols);
    }
    default:
        return 0.0f;  // unreachable after qmatrix_check
    }
}

int matmul(float *y, const QMatrix *w, const float *x, int n) {
    if (qmatrix_check(w) != COLI_OK || n < 0) return COLI_EINVAL;
    size_t rows = (size_t)w->rows, cols = (size_t)w->cols;
    // Row outer, token inner: one weight row is read from memory once and reused from cache by
    // every token.
    for (size_t r = 0; r < rows; r++) {
        for (size_t t = 0; t < (size_t)n; t++) {
            y[t * rows + r] = qmatrix_row_dot(w, (int)r, x + t * cols);
        }
    }
    return COLI_OK;
}

// ----------------------------------------------------------------------------
// Transposed product (MLA's absorbed key projection: a query times kv_b's key rows)

// Row r of w dequantised into out: f32 [cols], each element q * scale in float32.
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
    case QKIND_INT4: {
        size_t row_bytes = (cols + 1) / 2, row_groups = (cols + INT4_GROUP - 1) / INT4_GROUP;
        const uint8_t *q = (const uint8_t *)w->data + row * row_bytes;
        const uint16_t *scales = (const uint16_t *)w->scales + row * row_groups;
        for (size_t j = 0; j < cols; j++) {
            int nibble = j % 2 ? q[j / 2] >> 4 : q[j / 2] & 0x0f;
            out[j] = (float)(nibble - 8) * f16_to_f32(scales[j / INT4_GROUP]);
        }
        break;
    }
    }
}

int matmul_t(float *y, const QMatrix *w, const float *x, int n) {
    if (qmatrix_check(w) != COLI_OK || n < 0) return COLI_EINVAL;
    size_t rows = (size_t)w->rows, cols = (size_t)w->cols;
    memset(y, 0, (size_t)n * cols * sizeof(float));
    if (rows == 0 || cols == 0 || n == 0) return COLI_OK;
    float *row = malloc(cols * sizeof(float));  // one dequantised weight row, reused by every token
    if (row == NULL) return COLI_ENOMEM;
    for (size_t r = 0; r < rows; r++) {  // rows in order: each output element sums r = 0, 1, ...
        dequant_row(w, (int)r, row);
        for (size_t t = 0; t < (size_t)n; t++) {
            float xr = x[t * rows + r];
            float *yt = y + t * cols;
            for (size_t j = 0; j < cols; j++) yt[j] += xr * row[j];
        }
    }
    free(row);
    return COLI_OK;
}
