// expert_ffn.c — routed experts' gated feed-forward, fused, many experts per call:
//   out = down( glu(gate x + gate_bias, up x + up_bias) ) + down_bias
// glu one of the kinds of ExpertMath (colibri.h): SwiGLU clamped at L or not (DeepSeek V4), GPT-OSS's
// SwiGLU with alpha and +1, GeGLU (tanh GELU), Kimi K3's SiTU-GLU; each bias optional (GPT-OSS).
//
// One call runs every expert of an MoE layer that is ready (moe_experts), in two parallel phases:
//   1. gate and up rows of every expert, for that expert's tokens, read together: the gated
//      intermediate h [n_e, inter] goes to a scratch buffer owned by the call, never to Python;
//   2. down rows of every expert, written straight into each (token, rank) slot of outs.
// Tasks are ranges of whole rows of one expert, so each output element is reduced by one thread in
// the fixed order of matmul.c, and a token's result never depends on the other tokens or experts
// in the call, on the thread count or on the code path.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "impl/kernels_impl.h"

typedef struct {
    const QMatrix *gate, *up, *down;
    const float *bg, *bu, *bd;  // gate_bias, up_bias [inter], down_bias [hidden] (NULL: none)
    int n;              // tokens routed to this expert
    int32_t *tok;       // [n] token (row of x) of each
    float *h;           // [n, inter] glu(gate x, up x)
    float *g;           // [n, inter] scratch: gate x
    float **grow, **hrow;  // [n] rows of g and h, for rows_fn
    Acts h_acts;        // h laid out for down
    float **yrow;       // [n] output row of each (a slot of outs)
    int per_up, per_down;  // rows per task in phase 1 / 2
} Expert;

// Kimi K3's SiTU-GLU: 4 tanh(g/4) σ(g) · 25 tanh(u/25) (colibri_core/layers/situ.py is the reference).
static float situ(float g, float u) {
    return (tanhf(g / 4.0f) * 4.0f) * (1.0f / (1.0f + expf(-g))) * (tanhf(u / 25.0f) * 25.0f);
}

// GPT-OSS's SwiGLU: (clamp(u, -L, L) + 1) · g' σ(alpha g'), g' = min(g, L); NaN stays NaN.
static float swiglu_oai(float g, float u, float limit, float alpha) {
    if (g > limit) g = limit;
    if (u > limit) u = limit;
    if (u < -limit) u = -limit;
    return (u + 1.0f) * (g / (1.0f + coli_expf(-(alpha * g))));
}

// GELU, tanh approximation (gelu_pytorch_tanh), · u: 0.5 g (1 + tanh(z)) = g σ(2z), z = √(2/π)(g + 0.044715 g³).
static float geglu_tanh(float g, float u) {
    float z = 0.7978845608f * (g + 0.044715f * (g * g * g));
    return g / (1.0f + coli_expf(-(2.0f * z))) * u;
}

// h[i] = glu(g[i], h[i]) for i < n, in place: the gated unit `m` (the SwiGLU in 8 lanes where `simd`).
static void glu_rows(const ExpertMath *m, float *h, const float *g, int n, int simd) {
    switch (m->glu) {
    case GLU_SWIGLU:
        swiglu_rows(h, g, h, n, m->limit, simd);
        break;
    case GLU_SWIGLU_OAI:
        for (int i = 0; i < n; i++) h[i] = swiglu_oai(g[i], h[i], m->limit, m->alpha);
        break;
    case GLU_GEGLU_TANH:
        for (int i = 0; i < n; i++) h[i] = geglu_tanh(g[i], h[i]);
        break;
    default:  // GLU_SITU
        for (int i = 0; i < n; i++) h[i] = situ(g[i], h[i]);
        break;
    }
}

static int math_check(const ExpertMath *m) {
    if (m == NULL || m->glu < GLU_SWIGLU || m->glu > GLU_SITU || !(m->limit > 0)) return COLI_EINVAL;
    if (m->glu == GLU_SWIGLU_OAI && !isfinite(m->alpha)) return COLI_EINVAL;
    return COLI_OK;
}

// y[i] += b[i] for i in r0..r1 (b NULL: nothing): a bias after its matmul, on the task's rows.
static void add_bias(float *y, const float *b, int r0, int r1) {
    if (b == NULL) return;
    for (int i = r0; i < r1; i++) y[i] += b[i];
}

typedef struct {
    const Path *path;
    int act;
    const ExpertMath *math;  // the gated unit
    Expert *e;          // [n_experts]
    int n_experts;
    const Acts *x_acts; // [QKIND_COUNT]: x laid out per weight kind
    int *first;         // [n_experts + 1] first task of each expert in the current phase
} MoeJob;

static int find_expert(const MoeJob *m, int task) {
    int lo = 0, hi = m->n_experts - 1;  // the last expert whose first task <= task
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (m->first[mid] <= task) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

static void gate_up_task(void *ctx, int task) {
    const MoeJob *m = ctx;
    int ei = find_expert(m, task);
    const Expert *e = &m->e[ei];
    const Acts *a = &m->x_acts[e->gate->kind];
    dot_fn dg = path_dot(m->path, e->gate->kind, a->act), du = path_dot(m->path, e->up->kind, a->act);
    int inter = e->gate->rows;
    int r0 = (task - m->first[ei]) * e->per_up;
    int r1 = r0 + e->per_up < inter ? r0 + e->per_up : inter;
    rows_fn rg = path_rows(m->path, e->gate->kind, a->act, e->n), ru = path_rows(m->path, e->up->kind, a->act, e->n);
    // gate x into grow, up x into hrow, then the gated unit in place over the task's rows
    if (rg != NULL && ru != NULL) {  // each weight row unpacked once for every token
        rg(e->gate, r0, r1, a, e->tok, e->n, e->grow);
        ru(e->up, r0, r1, a, e->tok, e->n, e->hrow);
    } else {
        for (int r = r0; r < r1; r++) {
            for (int i = 0; i < e->n; i++) {
                e->grow[i][r] = dg(e->gate, r, a, e->tok[i]);
                e->hrow[i][r] = du(e->up, r, a, e->tok[i]);
            }
        }
    }
    for (int i = 0; i < e->n; i++) {
        float *g = e->grow[i], *h = e->hrow[i];
        add_bias(g, e->bg, r0, r1);
        add_bias(h, e->bu, r0, r1);
        glu_rows(m->math, h + r0, g + r0, r1 - r0, m->path != &PATH_PORTABLE);
    }
}

static void down_task(void *ctx, int task) {
    const MoeJob *m = ctx;
    int ei = find_expert(m, task);
    const Expert *e = &m->e[ei];
    RowsJob j = {path_dot(m->path, e->down->kind, e->h_acts.act), path_rows(m->path, e->down->kind, e->h_acts.act, e->n),
                 e->down, &e->h_acts, e->n, NULL, e->yrow};
    int hidden = e->down->rows;
    int r0 = (task - m->first[ei]) * e->per_down, r1 = r0 + e->per_down < hidden ? r0 + e->per_down : hidden;
    rows_run(&j, r0, r1);
    for (int i = 0; i < e->n; i++) add_bias(e->yrow[i], e->bd, r0, r1);
}

static void run_phase(MoeJob *m, void (*fn)(void *, int)) {
    int ntasks = m->first[m->n_experts];
    if (ntasks <= 1) {
        for (int t = 0; t < ntasks; t++) fn(m, t);
    } else {
        pool_run(fn, m, ntasks);
    }
}

static int check_expert(const QMatrix *gate, const QMatrix *up, const QMatrix *down, int hidden) {
    if (qmatrix_check(gate) != COLI_OK || qmatrix_check(up) != COLI_OK || qmatrix_check(down) != COLI_OK) {
        return COLI_EINVAL;
    }
    int inter = gate->rows;
    if (gate->cols != hidden || up->rows != inter || up->cols != hidden || down->rows != hidden ||
        down->cols != inter || up->kind != gate->kind || down->kind != gate->kind) {
        return COLI_EINVAL;
    }
    return COLI_OK;
}

int moe_experts_slots(float *outs, const float *x, int T, int k, int hidden, const QMatrix *const *mats,
                      const float *const *bias, int n_experts, const int32_t *slots, const int32_t *start, int act,
                      const ExpertMath *math) {
    if (T < 0 || k < 1 || hidden < 0 || n_experts < 0 || (act != ACT_F32 && act != ACT_Q8) || math_check(math) != COLI_OK) {
        return COLI_EINVAL;
    }
    if (n_experts == 0) return COLI_OK;
    if (start[0] != 0) return COLI_EINVAL;
    long long nslots = (long long)T * k;
    for (int e = 0; e < n_experts; e++) {
        if (check_expert(mats[3 * e], mats[3 * e + 1], mats[3 * e + 2], hidden) != COLI_OK) return COLI_EINVAL;
        if (start[e + 1] < start[e] || start[e + 1] > nslots) return COLI_EINVAL;
    }
    int total = start[n_experts];
    for (int s = 0; s < total; s++) {
        if (slots[s] < 0 || slots[s] >= nslots) return COLI_EINVAL;
    }
    if (total == 0 || hidden == 0) {
        for (int s = 0; s < total; s++) memset(outs + (size_t)slots[s] * (size_t)hidden, 0, (size_t)hidden * sizeof(float));
        return COLI_OK;
    }

    MoeJob m = {path_current(), act, math, NULL, n_experts, NULL, NULL};
    Acts x_acts[QKIND_COUNT];
    int have[QKIND_COUNT] = {0};
    int status = COLI_OK;
    Expert *ex = calloc((size_t)n_experts, sizeof *ex);
    int *first = calloc((size_t)n_experts + 1, sizeof *first);
    int32_t *tok = malloc((size_t)total * sizeof *tok);
    float **yrow = malloc((size_t)total * sizeof *yrow);
    size_t h_size = 0;
    for (int e = 0; e < n_experts; e++) h_size += (size_t)(start[e + 1] - start[e]) * (size_t)mats[3 * e]->rows;
    float *h = malloc((h_size + 1) * sizeof *h);
    float *g = malloc((h_size + 1) * sizeof *g);
    float **ghrow = malloc(2 * ((size_t)total + 1) * sizeof *ghrow);
    if (ex == NULL || first == NULL || tok == NULL || yrow == NULL || h == NULL || g == NULL || ghrow == NULL) {
        status = COLI_ENOMEM;
    }

    // ---- lay out x once per weight kind; each expert's tokens, intermediate and output rows
    size_t h_at = 0;
    for (int e = 0; e < n_experts && status == COLI_OK; e++) {
        Expert *E = &ex[e];
        E->gate = mats[3 * e];
        E->up = mats[3 * e + 1];
        E->down = mats[3 * e + 2];
        if (bias != NULL) {
            E->bg = bias[3 * e];
            E->bu = bias[3 * e + 1];
            E->bd = bias[3 * e + 2];
        }
        int kind = E->gate->kind;
        if (!have[kind]) {
            status = acts_prepare(&x_acts[kind], x, T, hidden, kind, act);
            if (status != COLI_OK) break;
            have[kind] = 1;
        }
        E->n = start[e + 1] - start[e];
        E->tok = tok + start[e];
        E->yrow = yrow + start[e];
        for (int i = 0; i < E->n; i++) {
            int s = slots[start[e] + i];
            E->tok[i] = s / k;
            E->yrow[i] = outs + (size_t)s * (size_t)hidden;
        }
        int inter = E->gate->rows;
        E->h = h + h_at;
        E->g = g + h_at;
        E->grow = ghrow + 2 * (size_t)start[e];
        E->hrow = E->grow + E->n;
        for (int i = 0; i < E->n; i++) {
            E->grow[i] = E->g + (size_t)i * (size_t)inter;
            E->hrow[i] = E->h + (size_t)i * (size_t)inter;
        }
        h_at += (size_t)E->n * (size_t)inter;
        int bytes_per_row = kind == QKIND_F32 ? 4 * hidden : kind == QKIND_INT8 || kind == QKIND_FP8 ? hidden : hidden / 2;
        E->per_up = rows_per_task(inter, n_experts * (2.0 * E->n * hidden + 2 * bytes_per_row), E->n);
        E->per_down = rows_per_task(hidden, n_experts * ((double)E->n * inter + bytes_per_row * inter / (double)hidden), E->n);
    }
    m.e = ex;
    m.x_acts = x_acts;
    m.first = first;

    // ---- phase 1: h = glu(gate x + gate_bias, up x + up_bias), every expert
    if (status == COLI_OK) {
        for (int e = 0; e < n_experts; e++) {
            first[e + 1] = first[e] + (ex[e].n > 0 && ex[e].gate->rows > 0 ? (ex[e].gate->rows + ex[e].per_up - 1) / ex[e].per_up : 0);
        }
        run_phase(&m, gate_up_task);
    }
    // ---- phase 2: outs[slot] = down h + down_bias, every expert
    for (int e = 0; e < n_experts && status == COLI_OK; e++) {
        status = acts_prepare(&ex[e].h_acts, ex[e].h, ex[e].n, ex[e].gate->rows, ex[e].down->kind, act);
    }
    if (status == COLI_OK) {
        for (int e = 0; e < n_experts; e++) {
            first[e + 1] = first[e] + (ex[e].n > 0 ? (hidden + ex[e].per_down - 1) / ex[e].per_down : 0);
            if (ex[e].n > 0 && ex[e].gate->rows == 0) {  // inter 0: down of nothing is zero (+ down_bias)
                for (int i = 0; i < ex[e].n; i++) {
                    memset(ex[e].yrow[i], 0, (size_t)hidden * sizeof(float));
                    add_bias(ex[e].yrow[i], ex[e].bd, 0, hidden);
                }
                first[e + 1] = first[e];
            }
        }
        run_phase(&m, down_task);
    }

    for (int e = 0; ex != NULL && e < n_experts; e++) acts_free(&ex[e].h_acts);
    for (int kk = 0; kk < QKIND_COUNT; kk++) {
        if (have[kk]) acts_free(&x_acts[kk]);
    }
    free(ex);
    free(first);
    free(tok);
    free(yrow);
    free(h);
    free(g);
    free(ghrow);
    return status;
}

int expert_ffn(float *out, const QMatrix *gate, const QMatrix *up, const QMatrix *down, const float *const *bias,
               const float *x, int n, int act, const ExpertMath *math) {
    if (n < 0 || gate == NULL) return COLI_EINVAL;
    if (check_expert(gate, up, down, gate->cols) != COLI_OK) return COLI_EINVAL;
    int32_t *slots = malloc(((size_t)n + 1) * sizeof *slots);
    if (slots == NULL) return COLI_ENOMEM;
    for (int i = 0; i < n; i++) slots[i] = i;
    int32_t start[2] = {0, n};
    const QMatrix *mats[3] = {gate, up, down};
    int status = moe_experts_slots(out, x, n, 1, gate->cols, mats, bias, 1, slots, start, act, math);
    free(slots);
    return status;
}

int moe_experts(float *outs, const float *x, int T, int k, int hidden, const QMatrix *const *mats,
                const float *const *bias, int n_experts, const int64_t *ids, const int64_t *experts, int act,
                const ExpertMath *math) {
    if (T < 0 || k < 1 || n_experts < 0) return COLI_EINVAL;
    size_t nslots = (size_t)T * (size_t)k;
    int32_t *slots = malloc((nslots + 1) * sizeof *slots);
    int32_t *start = malloc(((size_t)n_experts + 1) * sizeof *start);
    if (slots == NULL || start == NULL) {
        free(slots);
        free(start);
        return COLI_ENOMEM;
    }
    // the slots of each expert, in slot order, experts in the order given
    int32_t at = 0;
    for (int e = 0; e < n_experts; e++) {
        start[e] = at;
        for (size_t s = 0; s < nslots; s++) {
            if (ids[s] == experts[e]) slots[at++] = (int32_t)s;
        }
    }
    start[n_experts] = at;
    int status = moe_experts_slots(outs, x, T, k, hidden, mats, bias, n_experts, slots, start, act, math);
    free(slots);
    free(start);
    return status;
}

int moe_block(float *out, const float *x, int T, int k, int hidden, const QMatrix *const *table,
              const float *const *table_bias, int n_table, const int64_t *ids, const float *weights,
              const QMatrix *const *shared, const float *const *shared_bias, const float *shared_scale, int act,
              const ExpertMath *math) {
    if (T < 0 || k < 1 || hidden < 0 || n_table < 1) return COLI_EINVAL;
    size_t nslots = (size_t)T * (size_t)k;
    for (size_t s = 0; s < nslots; s++) {
        if (ids[s] < 0 || ids[s] >= n_table) return COLI_EINVAL;
    }
    int ks = k + (shared != NULL);  // ranks per token: the shared expert, if any, is one more, the last
    size_t nks = (size_t)T * (size_t)ks;
    char *used = calloc((size_t)n_table, 1);
    int64_t *experts = malloc((nks + 1) * sizeof *experts);
    int64_t *ids_s = malloc((nks + 1) * sizeof *ids_s);  // [T, ks]
    float *weights_s = malloc((nks + 1) * sizeof *weights_s);  // [T, ks]
    const QMatrix **mats = malloc((3 * nks + 1) * sizeof *mats);
    const float **bias = calloc(3 * nks + 1, sizeof *bias);  // [3 * n] of the union (NULL entries: none)
    float *outs = malloc((nks * (size_t)hidden + 1) * sizeof *outs);
    int status = used == NULL || experts == NULL || ids_s == NULL || weights_s == NULL || mats == NULL ||
                 bias == NULL || outs == NULL ? COLI_ENOMEM : COLI_OK;
    if (status == COLI_OK) {
        for (size_t t = 0; t < (size_t)T; t++) {
            memcpy(ids_s + t * ks, ids + t * k, (size_t)k * sizeof *ids);
            memcpy(weights_s + t * ks, weights + t * k, (size_t)k * sizeof *weights);
            if (shared != NULL) {  // the shared expert: id n_table, weight its scale (1 without)
                ids_s[t * ks + k] = n_table;
                weights_s[t * ks + k] = shared_scale != NULL ? shared_scale[t] : 1.0f;
            }
        }
        int n = 0;  // the batch union, ascending (the order the store yields them), then the shared expert
        for (size_t s = 0; s < nslots; s++) used[ids[s]] = 1;
        for (int e = 0; e < n_table; e++) {
            if (!used[e]) continue;
            experts[n] = e;
            for (int m = 0; m < 3; m++) {
                mats[3 * n + m] = table[3 * e + m];
                if (table_bias != NULL) bias[3 * n + m] = table_bias[3 * e + m];
            }
            n++;
        }
        if (shared != NULL) {
            experts[n] = n_table;
            for (int m = 0; m < 3; m++) {
                mats[3 * n + m] = shared[m];
                if (shared_bias != NULL) bias[3 * n + m] = shared_bias[m];
            }
            n++;
        }
        status = moe_experts(outs, x, T, ks, hidden, mats, bias, n, ids_s, experts, act, math);
    }
    if (status == COLI_OK) status = moe_combine(out, outs, weights_s, T, ks, hidden);
    free(used);
    free(experts);
    free(ids_s);
    free(weights_s);
    free(mats);
    free(bias);
    free(outs);
    return status;
}

int moe_block_softmax(float *out, int64_t *ids, float *weights, const float *x, int T, int k, int hidden,
                      const QMatrix *router, int renormalize, const QMatrix *const *table,
                      const float *const *table_bias, int n_table, const QMatrix *const *shared,
                      const float *const *shared_bias, const float *shared_scale, int act, const ExpertMath *math) {
    if (T < 0 || k < 1 || k > n_table || hidden < 0 || router == NULL || router->rows != n_table || router->cols != hidden) {
        return COLI_EINVAL;
    }
    float *logits = malloc(((size_t)T * (size_t)n_table + 1) * sizeof *logits);  // [T, n_table]
    if (logits == NULL) return COLI_ENOMEM;
    int status = matmul(logits, router, x, T, act);
    if (status == COLI_OK) status = softmax_topk(weights, ids, logits, T, n_table, k, renormalize);
    free(logits);
    if (status != COLI_OK) return status;
    return moe_block(out, x, T, k, hidden, table, table_bias, n_table, ids, weights, shared, shared_bias, shared_scale,
                     act, math);
}

int moe_combine(float *out, const float *outs, const float *weights, int T, int k, int hidden) {
    if (T < 0 || k < 1 || hidden < 0) return COLI_EINVAL;
    for (size_t t = 0; t < (size_t)T; t++) {
        float *o = out + t * (size_t)hidden;
        const float *w = weights + t * (size_t)k;
        const float *slot = outs + t * (size_t)k * (size_t)hidden;  // [k, hidden]
        for (int j = 0; j < hidden; j++) o[j] = slot[j] * w[0];
        for (int r = 1; r < k; r++) {
            for (int j = 0; j < hidden; j++) o[j] += slot[(size_t)r * (size_t)hidden + j] * w[r];
        }
    }
    return COLI_OK;
}
