// expert_ffn.c — one routed expert's SwiGLU feed-forward, fused into a single call:
//   out = down( silu(gate x) * (up x) ),  silu(a) = a / (1 + exp(-a)).
// gate and up are read row by row together, so the gated intermediate h [n, inter] is written
// once, to a scratch buffer owned by the call, and never reaches Python. Every element is reduced
// in the fixed order of qmatrix_row_dot / matmul (matmul.c), so results are deterministic.
#include <math.h>
#include <stddef.h>
#include <stdlib.h>

#include "colibri.h"

static float silu(float a) { return a / (1.0f + expf(-a)); }

int expert_ffn(float *out, const QMatrix *gate, const QMatrix *up, const QMatrix *down,
               const float *x, int n) {
    if (qmatrix_check(gate) != COLI_OK || qmatrix_check(up) != COLI_OK ||
        qmatrix_check(down) != COLI_OK || n < 0) {
        return COLI_EINVAL;
    }
    int inter = gate->rows, hidden = gate->cols;
    if (up->rows != inter || up->cols != hidden || down->rows != hidden || down->cols != inter ||
        up->kind != gate->kind || down->kind != gate->kind) {
        return COLI_EINVAL;
    }

    size_t h_size = (size_t)n * (size_t)inter;
    float *h = malloc(h_size * sizeof(float));  // [n, inter]
    if (h == NULL && h_size > 0) return COLI_ENOMEM;

    // h = silu(gate x) * (up x); row outer so each gate/up row is reused from cache by every token
    for (size_t i = 0; i < (size_t)inter; i++) {
        for (size_t t = 0; t < (size_t)n; t++) {
            const float *xt = x + t * (size_t)hidden;  // [hidden]
            float g = qmatrix_row_dot(gate, (int)i, xt);
            float u = qmatrix_row_dot(up, (int)i, xt);
            h[t * (size_t)inter + i] = silu(g) * u;
        }
    }

    // out = down h
    int status = matmul(out, down, h, n);
    free(h);
    return status;
}
