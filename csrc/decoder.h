// decoder.h — a whole decoder layer of the core's blocks in one call (a decode step would otherwise
// cross from Python into C four to six times a layer, and the interpreter runs cold after each).
//
// This header is also cffi's cdef (colibri_core/kernels/_build.py drops the lines starting with
// '#'): keep it to plain declarations.
#ifndef COLIBRI_DECODER_H
#define COLIBRI_DECODER_H

#include "colibri.h"
#include "deltanet.h"

// A pre-norm MoE decoder layer for the new tokens of n_seq sequences (a batch's generations; each
// gets the bits it gets alone), exactly the sequence of the calls the layer makes step by step
// (colibri_core/layers/decoder.py), so the same bits:
//   h1 = attn_block(h)                                     (attn: its own input norm and residual)
//     or h + deltanet_block(rms_norm(h, input_norm))       (deltanet)
//   x = rms_norm(h1, post_norm)
//   scale = sigmoid_f32(x shared_gateᵀ)                     (shared_gate NULL: no scale)
//   out = h1 + moe_block_softmax(x, router, k, renormalize, table, shared, scale)
// Sequence i's seq_T[i] rows follow those of the sequences before it in h, out, ids, weights, cos
// and sin. out, h: f32 [T, hidden] (out may not alias h; T = Σ seq_T); ids: int64 [T, k], weights:
// f32 [T, k] (written: the routing, for the caller's bookkeeping); table: 3 * n_table matrices as
// moe_block's (no biases); cos, sin, k_cache, v_cache, start, kv: attn_block's (attention
// mixer; NULL otherwise); conv_state, state: deltanet_block's, each sequence's states (DeltaNet mixer;
// NULL otherwise); act: the experts' arithmetic (the mixer's and the gate's are in the struct);
// seconds: NULL, or [2] += the wall seconds of the mixer and of the MoE sub-block (the engine's time
// split). COLI_OK, COLI_EINVAL (shapes) or COLI_ENOMEM.
typedef struct {
    const AttnBlock *attn;          // the token mixer: an attention sub-block, or (NULL)
    const DeltaNetBlock *deltanet;  //   a Gated DeltaNet on rms_norm(h, input_norm)
    const float *input_norm;        // [hidden] (deltanet only)
    int mixer_act;                  // the mixer's arithmetic
    const float *post_norm;         // [hidden]: the MoE sub-block's RMSNorm weight
    float eps;                      // both norms'
    const QMatrix *router;          // [n_table, hidden]: softmax over all experts, top k
    int k, renormalize;
    const QMatrix *const *shared;   // NULL or the shared expert's gate, up, down
    const QMatrix *shared_gate;     // NULL or [1, hidden]: the shared expert's sigmoid gate
    int gate_act;                   // its arithmetic
    const ExpertMath *math;         // the experts' gated unit
} MoELayer;
int moe_layer(float *out, int64_t *ids, float *weights, const float *h, int n_seq, const int *seq_T, const MoELayer *l,
              const QMatrix *const *table, int n_table, const float *cos, const float *sin, void *const *k_cache,
              void *const *v_cache, const int *start, int kv, float *const *conv_state, float *const *state, int act,
              double *seconds);

#endif  // COLIBRI_DECODER_H
