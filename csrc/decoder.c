// decoder.c — a whole MoE decoder layer in one call (decoder.h): the mixer, the post-attention norm,
// the shared expert's gate and the MoE block, each the function the step-by-step path calls.
#define _GNU_SOURCE
#include <stdlib.h>
#include <time.h>

#include "decoder.h"
#include "impl/kernels_impl.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

int moe_layer(float *out, int64_t *ids, float *weights, const float *h, int n_seq, const int *seq_T, const MoELayer *l,
              const QMatrix *const *table, int n_table, const float *cos, const float *sin, void *const *k_cache,
              void *const *v_cache, const int *start, int kv, float *const *conv_state, float *const *state, int act,
              double *seconds) {
    if (n_seq < 1 || (l->attn == NULL) == (l->deltanet == NULL) || (l->deltanet && l->input_norm == NULL) ||
        l->router == NULL || l->post_norm == NULL) {
        return COLI_EINVAL;
    }
    int hidden = l->router->cols, T = seq_rows(n_seq, seq_T);  // every sequence's rows, stacked
    if (T < 0 || (l->shared_gate && (l->shared_gate->rows != 1 || l->shared_gate->cols != hidden))) return COLI_EINVAL;
    if (T == 0) return COLI_OK;
    size_t n = (size_t)T * (size_t)hidden;
    float *mid = malloc((2 * n + (size_t)T) * sizeof(float));  // h1, x, the shared expert's scale
    if (mid == NULL) return COLI_ENOMEM;
    float *x = mid + n, *scale = l->shared_gate ? x + n : NULL;
    double t0 = now();
    int status;
    if (l->attn) {
        status = attn_block(mid, h, n_seq, seq_T, l->attn, cos, sin, k_cache, v_cache, start, l->mixer_act, kv);
    } else {
        status = rms_norm(x, h, l->input_norm, T, hidden, l->eps);
        if (status == COLI_OK) status = deltanet_block(mid, x, n_seq, seq_T, l->deltanet, conv_state, state, l->mixer_act);
        if (status == COLI_OK) for (size_t i = 0; i < n; i++) mid[i] = h[i] + mid[i];
    }
    double t1 = now();
    if (status == COLI_OK) status = rms_norm(x, mid, l->post_norm, T, hidden, l->eps);
    if (status == COLI_OK && scale) {
        status = matmul_multi(&scale, &l->shared_gate, 1, x, T, l->gate_act);
        if (status == COLI_OK) status = sigmoid_f32(scale, scale, T);
    }
    if (status == COLI_OK) {
        status = moe_block_softmax(out, ids, weights, x, T, l->k, hidden, l->router, l->renormalize, table, NULL,
                                   n_table, l->shared, NULL, scale, act, l->math);
    }
    if (status == COLI_OK) for (size_t i = 0; i < n; i++) out[i] = mid[i] + out[i];
    if (seconds) {
        double t2 = now();
        seconds[0] += t1 - t0;
        seconds[1] += t2 - t1;
    }
    free(mid);
    return status;
}
