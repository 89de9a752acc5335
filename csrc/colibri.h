// colibri.h — the C kernels of colibri, declared in one place.
//
// Every kernel reads the weight formats defined in colibri_core/quant.py (the one definition):
//   f32:  data float32 [rows, cols]; no scales.
//   int8: data int8 [rows, cols], q in [-127, 127]; scales float32 [rows]; w = q * scale.
//   int4: data uint8 [rows, ceil(cols/2)], nibble = q + 8, even column in the low nibble
//         (a padding high nibble for odd cols holds 8, i.e. q = 0);
//         scales float16 bits [rows, ceil(cols/64)], one per group of 64 columns
//         (the last group of a row may be shorter); w = q * float32(scale).
//   fp8:  (DeepSeek V3/V4 dense weights, loaded as they are) data uint8 [rows, cols], float8 e4m3fn
//         bytes (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; 0x7f/0xff NaN);
//         scales uint8 [ceil(rows/128), ceil(cols/128)], one UE8M0 byte s per 128x128 block;
//         w = e4m3(q) * 2^(s - 127) (s = 255: NaN).
//   fp4:  (DeepSeek V4 routed experts, loaded as they are) data uint8 [rows, ceil(cols/2)], E2M1
//         nibbles (bit 3 the sign; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), even column in the low
//         nibble; scales uint8 [rows, ceil(cols/32)], one UE8M0 byte per 32 columns;
//         w = e2m1(q) * 2^(s - 127).
// Matrices are row-major [rows, cols] = [out, in]; activations are float32 row-major [n, dim].
//
// Activations reach the quantised products in one of two arithmetics (`act`):
//   ACT_F32: float32 activations times the dequantised weights, in float32 — the exact mode, what
//            the transformers oracle computes (up to the order of the additions);
//   ACT_Q8:  activations quantised to int8 per block of 64 (scale = absmax/127, round half to
//            even), integer dot products per block, then float32 scaling — the fast mode, an
//            explicit option (f32 and fp8 weights always use ACT_F32).
//
// Determinism: each output element is reduced by one thread in one fixed order (matmul.c states
// it exactly), the same in the portable, AVX2 and AVX-512 code paths, so a result depends only on
// the inputs and `act`: not on the code path, the thread count or the batch it came in.
// colibri_core/kernels/reference.py models the same order in NumPy.
//
// This header is also cffi's cdef (colibri_core/kernels/_build.py drops the lines starting with
// '#'): keep it to plain declarations — no macros inside declarations, no inline functions.
#ifndef COLIBRI_H
#define COLIBRI_H

#include <stddef.h>
#include <stdint.h>

// ----------------------------------------------------------------------------
// Weights

enum {
    QKIND_F32 = 0,
    QKIND_INT8 = 1,
    QKIND_INT4 = 2,
    QKIND_FP8 = 3,
    QKIND_FP4 = 4,
    QKIND_COUNT = 5,  // number of kinds
    INT4_GROUP = 64,  // columns per int4 scale group
    FP8_BLOCK = 128,  // rows and columns per fp8 scale block
    FP4_GROUP = 32,   // columns per fp4 scale group
};

enum {
    ACT_F32 = 0,    // float32 activations (exact mode)
    ACT_Q8 = 1,     // activations quantised to int8 per block (fast mode)
    Q8_BLOCK = 64,  // columns per activation block in ACT_Q8
};

// Status codes returned by the kernels.
enum {
    COLI_OK = 0,
    COLI_EINVAL = -1,       // unknown kind or mismatched shapes
    COLI_ENOMEM = -2,       // a scratch buffer could not be allocated
    COLI_EUNSUPPORTED = -3, // a code path this CPU (or build) does not have
};

// A (possibly quantised) weight matrix [rows, cols]; the arrays are borrowed, never copied.
typedef struct {
    int kind;            // QKIND_F32 | QKIND_INT8 | QKIND_INT4 | QKIND_FP8 | QKIND_FP4
    int rows;            // output dimension
    int cols;            // input dimension
    const void *data;    // f32 [rows, cols] | int8 [rows, cols] | uint8 [rows, ceil(cols/2)] (int4, fp4)
                         // | uint8 [rows, cols] (fp8)
    const void *scales;  // NULL | f32 [rows] | f16 bits, uint16 [rows, ceil(cols/64)]
                         // | uint8 [ceil(rows/128), ceil(cols/128)] (fp8) | uint8 [rows, ceil(cols/32)] (fp4)
} QMatrix;

// ----------------------------------------------------------------------------
// matmul.c — quantised matrix products, code paths

// IEEE half (its bit pattern) to float, exactly; handles zero, subnormals, inf and NaN.
float f16_to_f32(uint16_t h);

// float8 e4m3fn byte to float, exactly (0x7f, 0xff: NaN).
float e4m3_to_f32(uint8_t q);

// UE8M0 scale byte to float: 2^(s - 127) exactly (s = 0: 2^-127, a subnormal; s = 255: NaN).
float e8m0_to_f32(uint8_t s);

// out = dequant(w), every element q * scale in float32, exactly what colibri_core.quant.dequantize
// gives (bit for bit). out: f32 [w->rows, w->cols] (written). COLI_OK or COLI_EINVAL.
int qmatrix_dequantize(float *out, const QMatrix *w);

// COLI_OK if w names a known kind, a non-negative shape and the (non-NULL) arrays that kind needs,
// else COLI_EINVAL. w: QMatrix.
int qmatrix_check(const QMatrix *w);

// y = x @ dequant(w).T, every token independently.
// y: f32 [n, w->rows] (written); w: QMatrix [rows, cols]; x: f32 [n, w->cols]; act: ACT_F32|ACT_Q8.
// Returns COLI_OK, COLI_EINVAL (bad w, n or act) or COLI_ENOMEM.
int matmul(float *y, const QMatrix *w, const float *x, int n, int act);

// Several products of one input in one call (e.g. q, k and v): y[i] = x @ dequant(w[i]).T.
// y: count pointers to f32 [n, w[i]->rows]; w: count matrices with one cols; x: f32 [n, cols].
// Each y[i] is exactly what matmul(y[i], w[i], x, n, act) writes.
int matmul_multi(float *const *y, const QMatrix *const *w, int count, const float *x, int n, int act);

// Several products, each of its own input (MLA's per-head value projections): y[i] = x[i] @
// dequant(w[i]).T. y: count pointers to f32 [n, w[i]->rows]; x: count pointers to f32 [n, w[i]->cols].
// Each y[i] is exactly what matmul(y[i], w[i], x[i], n, act) writes.
int matmul_each(float *const *y, const QMatrix *const *w, int count, const float *const *x, int n, int act);

// y = x @ dequant(w) (no transpose): y[t, j] = sum over r = 0, 1, ... of x[t, r] * w[r, j], each
// weight dequantised to float32 first (q * scale). MLA absorbs kv_b_proj's key rows this way.
// y: f32 [n, w->cols] (written); w: QMatrix [rows, cols]; x: f32 [n, w->rows].
// Returns COLI_OK, COLI_EINVAL when qmatrix_check(w) fails, or COLI_ENOMEM.
int matmul_t(float *y, const QMatrix *w, const float *x, int n);

// Several transposed products in one call, one task each (MLA's per-head key absorption):
// y[i] = x[i] @ dequant(w[i]). y: count pointers to f32 [n, w[i]->cols]; x: count pointers to f32
// [n, w[i]->rows]. Each y[i] is exactly what matmul_t(y[i], w[i], x[i], n) writes.
int matmul_t_each(float *const *y, const QMatrix *const *w, int count, const float *const *x, int n);

// The code path in use: "portable", "avx2" or "avx512".
const char *simd_name(void);

// 1 if this CPU and build can run the named path, else 0.
int simd_supported(const char *name);

// Use the named path ("portable" | "avx2" | "avx512"), or the best one the CPU has for "auto".
// COLI_EUNSUPPORTED for a path this CPU lacks, COLI_EINVAL for an unknown name; the path in use
// is unchanged then. The first kernel call selects from the environment variable COLIBRI_SIMD
// (unset: "auto"); an unusable value there makes simd_init_status() non-zero.
int simd_select(const char *name);

// COLI_OK, or the status of selecting COLIBRI_SIMD at start-up (the path fell back to "auto").
int simd_init_status(void);

// ----------------------------------------------------------------------------
// threads.c — the kernels' thread pool

// Threads the kernels use (the calling thread included); at start-up COLIBRI_THREADS, else the
// CPUs this process may run on.
int threads_get(void);

// Use n threads (1..256); COLI_EINVAL otherwise. Never changes a result, only the speed.
int threads_set(int n);

// ----------------------------------------------------------------------------
// expert_ffn.c — routed experts, fused

// The experts' gated unit h = glu(g, u) on g = gate x + gate_bias, u = up x + up_bias (f32 elementwise;
// colibri_core/kernels/reference.py `gated_unit` is the NumPy definition of each):
enum {
    GLU_SWIGLU = 0,      // silu(min(g, L)) · clamp(u, -L, L), silu(a) = a / (1 + exp(-a)) (DeepSeek V4: L = 10)
    GLU_SWIGLU_OAI = 1,  // (clamp(u, -L, L) + 1) · g' / (1 + exp(-alpha g')), g' = min(g, L) (GPT-OSS)
    GLU_GEGLU_TANH = 2,  // gelu_tanh(g) · u = g / (1 + exp(-2 c (g + 0.044715 g³))) · u, c = √(2/π)
    GLU_SITU = 3,        // Kimi K3's SiTU-GLU: 4 tanh(g/4) σ(g) · 25 tanh(u/25)
};

typedef struct {
    int glu;      // GLU_*
    float limit;  // the clamp L of GLU_SWIGLU / GLU_SWIGLU_OAI: > 0, INFINITY for none; unused by the others
    float alpha;  // GLU_SWIGLU_OAI's sigmoid slope (GPT-OSS: 1.702); unused by the others
} ExpertMath;

// out = down( glu(gate x + gate_bias, up x + up_bias) ) + down_bias, exp being coli_expf (the same
// bits on every code path). bias: NULL (no biases) or gate_bias f32 [inter], up_bias f32 [inter],
// down_bias f32 [hidden] at 0, 1, 2, each NULL for none. The [n, inter] intermediate lives in a
// scratch buffer owned by this call.
// out: f32 [n, hidden] (written); gate, up: QMatrix [inter, hidden]; down: QMatrix [hidden, inter];
// x: f32 [n, hidden]; act ACT_F32 | ACT_Q8. Returns COLI_OK, COLI_EINVAL (shapes/kinds/math) or COLI_ENOMEM.
int expert_ffn(float *out, const QMatrix *gate, const QMatrix *up, const QMatrix *down, const float *const *bias,
               const float *x, int n, int act, const ExpertMath *math);

// Many experts of one MoE layer in one call, each exactly as expert_ffn computes it.
// Slots are the flat (token, rank) positions t * k + r of the (T, k) routing table `ids`.
// outs: f32 [T * k, hidden]: every slot whose expert is in `experts` is written, others untouched;
// x: f32 [T, hidden]; mats: 3 * n_experts matrices, gate, up, down of experts[e] at 3e, 3e+1, 3e+2;
// bias: NULL or 3 * n_experts vectors (NULL entries: none), experts[e]'s at 3e, 3e+1, 3e+2 as in
// expert_ffn; ids: int64 [T, k] expert of each slot; experts: int64 [n_experts] (distinct).
int moe_experts(float *outs, const float *x, int T, int k, int hidden, const QMatrix *const *mats,
                const float *const *bias, int n_experts, const int64_t *ids, const int64_t *experts, int act,
                const ExpertMath *math);

// The same with the slots already grouped: those of expert e are slots[start[e] .. start[e+1]).
int moe_experts_slots(float *outs, const float *x, int T, int k, int hidden, const QMatrix *const *mats,
                      const float *const *bias, int n_experts, const int32_t *slots, const int32_t *start, int act,
                      const ExpertMath *math);

// A whole MoE layer whose experts are all at hand, in one call: moe_experts over the batch union of
// ids (ascending) into a scratch (T, k, hidden), then moe_combine into out — the same bits as those
// two calls. table: 3 * n_table matrices, expert e's gate, up, down at 3e, 3e+1, 3e+2; table_bias:
// NULL or their 3 * n_table bias vectors as moe_experts' bias; ids: int64 [T, k] in 0 .. n_table-1;
// weights: f32 [T, k]; out: f32 [T, hidden]. shared (NULL: none): the gate, up, down of an always-on
// expert (shared_bias: NULL or its 3 bias vectors), run in the same phases as one more rank after
// the k routed ones, weighted by shared_scale [T] (NULL: 1) — the bits of moe_block without it, plus
// shared_scale[t] · expert_ffn(shared, x[t]).
int moe_block(float *out, const float *x, int T, int k, int hidden, const QMatrix *const *table,
              const float *const *table_bias, int n_table, const int64_t *ids, const float *weights,
              const QMatrix *const *shared, const float *const *shared_bias, const float *shared_scale, int act,
              const ExpertMath *math);

// moe_block with the layer's softmax router in the same call (OLMoE's, Qwen's, Mixtral's MoE layer):
// logits = matmul(router, x), then softmax_topk(logits, k, renormalize) into ids and weights, then
// moe_block over them — the bits of those three calls, and one crossing from Python instead of three.
// router: QMatrix [n_table, hidden]; ids: int64 [T, k] and weights: f32 [T, k] (written: the routing,
// for the caller's bookkeeping); the other arguments as moe_block's.
int moe_block_softmax(float *out, int64_t *ids, float *weights, const float *x, int T, int k, int hidden,
                      const QMatrix *router, int renormalize, const QMatrix *const *table,
                      const float *const *table_bias, int n_table, const QMatrix *const *shared,
                      const float *const *shared_bias, const float *shared_scale, int act, const ExpertMath *math);

// out[t] = Σ_r weights[t, r] · outs[t, r], summed in rank order (out = o0 w0; out += o_r w_r).
// out: f32 [T, hidden]; outs: f32 [T, k, hidden]; weights: f32 [T, k].
int moe_combine(float *out, const float *outs, const float *weights, int T, int k, int hidden);

// ----------------------------------------------------------------------------
// layers.c — per-token layers (references: colibri_core/kernels/reference.py)

// The softmax router: per token, p = softmax(logits) over all E experts (max subtracted, float32),
// ids = the k largest p, largest first, ties to the lower index; weights = p[ids], divided by their
// sum (added in rank order) when `renormalize`. logits: f32 [T, E]; weights: f32 [T, k]; ids: int64
// [T, k]; 1 <= k <= E.
int softmax_topk(float *weights, int64_t *ids, const float *logits, int T, int E, int k, int renormalize);

// out[i] = e^x[i] in float32 by colibri's own steps, the exp of attention's softmax and the experts'
// SiLU: the same bits on every path (kernels_impl.h's coli_expf). out, x: f32 [n].
int exp_f32(float *out, const float *x, int n);

// out[i] = 1 / (1 + coli_expf(−x[i])) in float32 (a gate's sigmoid: 0 where the exp overflows).
// out, x: f32 [n] (out may be x).
int sigmoid_f32(float *out, const float *x, int n);

// out = x / sqrt(mean(x^2) + eps) * weight, row by row. out, x: f32 [n, dim]; weight: f32 [dim].
int rms_norm(float *out, const float *x, const float *weight, int n, int dim, float eps);

// out = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x[half:], x[:half]].
// out, x: f32 [T, heads, dim]; cos, sin: f32 [T, dim]; dim even.
int rope_rotate_half(float *out, const float *x, const float *cos, const float *sin, int T, int heads, int dim);

// Causal grouped-query attention of T new tokens (rows start .. start+T-1) over S cached ones.
// out: f32 [T, H, D] (written); q: f32 [T, H, D]; k, v: [S, Hkv, D] with S >= start + T, the new
// tokens' keys and values already in place, float32 (kv = KV_F32) or float16 (KV_F16: each element
// widened exactly, then the float32 cache's operations); H a multiple of Hkv; scale usually D^-0.5.
// window > 0: the token of row r sees rows r − window + 1 .. r only (a sliding window; 0: rows 0 .. r);
// sinks: NULL, or f32 [H] a logit per head joining its softmax without a value (GPT-OSS's sinks).
enum { KV_F32 = 0, KV_F16 = 1 };
int attention(float *out, const float *q, int T, int H, int D, const void *k, const void *v, int S, int Hkv,
              int start, float scale, int window, const float *sinks, int kv);

// out[i] = x[i] rounded to float16 (nearest, ties to even; NaN stays NaN, quiet): how a float16 KV
// cache stores a row. Returns COLI_OK.
int f16_from_f32(uint16_t *out, const float *x, size_t n);

// The pre-norm attention sub-block of a decoder layer (OLMoE, Qwen3-MoE and the like), for the new
// tokens of n_seq sequences (a batch's generations) in one call, exactly the sequence of the calls
// above; sequence i's seq_T[i] rows, at its positions start[i] .. start[i]+seq_T[i]-1, follow those
// of the sequences before it in h, out, cos and sin (T = Σ seq_T rows):
//   x = rms_norm(h, norm); q, k, v = x wq^T, x wk^T, x wv^T (one matmul_multi) + bq, bk, bv (each NULL: none);
//   gated: q, gate = each head's halves of the q projection;
//   q, k = rms_norm over each whole projection (QK_NORM_WHOLE: OLMoE) or each head (QK_NORM_HEAD:
//   Qwen3), or neither (0);
//   q, k, v clamped to ±clip (INFINITY: none); q, k = rope_rotate_half(·, cos, sin) on each head's
//   leading rotary_dim dims, the rest as they are;
//   per sequence: k, v written to rows start .. start+seq_T-1 of its k_cache, v_cache (rounded by
//   f16_from_f32 for KV_F16); a = attention(q, its cache rows 0 .. start+seq_T-1, scale, window,
//   sinks, kv);
//   gated: a = a · sigmoid_f32(gate);
//   out = h + (a wo^T + bo).
// Every step but attention runs on all T rows at once (each row's bits its own), so a sequence gets
// the bits it gets alone. out, h: f32 [T, hidden] (out may not alias h); cos, sin: f32 [T,
// rotary_dim]; k_cache[i], v_cache[i]: [start[i] + seq_T[i] (at least), kv_heads, head_dim],
// float32 (kv = KV_F32) or float16 (KV_F16). COLI_OK, COLI_EINVAL (shapes) or COLI_ENOMEM.
enum { QK_NORM_WHOLE = 1, QK_NORM_HEAD = 2 };
typedef struct {
    const float *norm;             // [hidden] the input RMSNorm's weight
    const QMatrix *wq, *wk, *wv;   // [heads * head_dim, hidden], [kv_heads * head_dim, hidden] (k, v)
    const QMatrix *wo;             // [hidden, heads * head_dim]
    int qk_norm;                   // 0, QK_NORM_WHOLE or QK_NORM_HEAD
    const float *q_norm, *k_norm;  // WHOLE: [heads * head_dim], [kv_heads * head_dim]; HEAD: [head_dim] each
    float clip;
    int heads, kv_heads, head_dim;
    float eps, scale;
    const float *bq, *bk, *bv;     // NULL or [heads * head_dim], [kv_heads * head_dim] (k, v): projection biases
    const float *bo;               // NULL or [hidden]: the output projection's bias
    const float *sinks;            // NULL or [heads]: attention's sink logits
    int window;                    // attention's sliding window (0: none)
    int gated;                     // wq gives per head [q | gate] ([heads * 2 head_dim, hidden]; bq likewise) and
                                   // the attention is multiplied by sigmoid_f32(gate) before wo (Qwen3.5/3.6)
    int rotary_dim;                // RoPE on each head's leading rotary_dim dims (cos, sin: [T, rotary_dim]);
                                   // 0: all head_dim
} AttnBlock;
int attn_block(float *out, const float *h, int n_seq, const int *seq_T, const AttnBlock *b, const float *cos,
               const float *sin, void *const *k_cache, void *const *v_cache, const int *start, int act, int kv);

// ----------------------------------------------------------------------------
// membench.c

// Read nbytes of buf (8-byte aligned) on every kernel thread, each its own contiguous share, and
// return the sum of its 64-bit words (so the reads cannot be skipped): the machine's read bandwidth.
uint64_t mem_read(const void *buf, size_t nbytes);

#endif  // COLIBRI_H
