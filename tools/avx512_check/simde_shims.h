// simde_shims.h — SIMDe (libsimde-dev 0.7.x) with native names, plus the few AVX-512 intrinsics
// that version lacks, written out lane by lane from Intel's definitions. Only for
// tools/avx512_check: it runs csrc/matmul_avx512.c on a CPU without AVX-512.
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>
#include <string.h>

#ifndef __AVX512F__
typedef simde__mmask16 __mmask16;
typedef simde__mmask32 __mmask32;
typedef simde__mmask64 __mmask64;
#endif

static inline __m512i coli_maskz_loadu_epi8(__mmask64 k, const void *p) {
    int8_t v[64] = {0};
    for (int i = 0; i < 64; i++) if ((k >> i) & 1) v[i] = ((const int8_t *)p)[i];
    __m512i r; memcpy(&r, v, 64); return r;
}
static inline __m256i coli_mask_loadu_epi8_256(__m256i src, __mmask32 k, const void *p) {
    int8_t v[32]; memcpy(v, &src, 32);
    for (int i = 0; i < 32; i++) if ((k >> i) & 1) v[i] = ((const int8_t *)p)[i];
    __m256i r; memcpy(&r, v, 32); return r;
}
static inline __m128i coli_maskz_loadu_epi8_128(__mmask16 k, const void *p) {
    int8_t v[16] = {0};
    for (int i = 0; i < 16; i++) if ((k >> i) & 1) v[i] = ((const int8_t *)p)[i];
    __m128i r; memcpy(&r, v, 16); return r;
}
static inline __m512 coli_maskz_loadu_ps(__mmask16 k, const float *p) {
    float v[16] = {0};
    for (int i = 0; i < 16; i++) if ((k >> i) & 1) v[i] = p[i];
    __m512 r; memcpy(&r, v, 64); return r;
}
static inline __m512i coli_cvtepi8_epi32(__m128i a) {
    int8_t b[16]; int32_t v[16]; memcpy(b, &a, 16);
    for (int i = 0; i < 16; i++) v[i] = b[i];
    __m512i r; memcpy(&r, v, 64); return r;
}
static inline __m512 coli_cvtepi32_ps(__m512i a) {
    int32_t b[16]; float v[16]; memcpy(b, &a, 64);
    for (int i = 0; i < 16; i++) v[i] = (float)b[i];
    __m512 r; memcpy(&r, v, 64); return r;
}
static inline __m512i coli_cvtepu8_epi32(__m128i a) {
    uint8_t b[16]; int32_t v[16]; memcpy(b, &a, 16);
    for (int i = 0; i < 16; i++) v[i] = b[i];
    __m512i r; memcpy(&r, v, 64); return r;
}
static inline __m512i coli_shuffle_i64x2(__m512i a, __m512i b, int imm) {  // quarters 0, 1 of a; 2, 3 of b
    __m128i qa[4], qb[4], r[4]; memcpy(qa, &a, 64); memcpy(qb, &b, 64);
    r[0] = qa[imm & 3]; r[1] = qa[(imm >> 2) & 3]; r[2] = qb[(imm >> 4) & 3]; r[3] = qb[(imm >> 6) & 3];
    __m512i v; memcpy(&v, r, 64); return v;
}
static inline __m256i coli_maskz_loadu_epi16_256(__mmask16 k, const void *p) {
    int16_t v[16] = {0};
    for (int i = 0; i < 16; i++) if ((k >> i) & 1) v[i] = ((const int16_t *)p)[i];
    __m256i r; memcpy(&r, v, 32); return r;
}
static inline __m512 coli_cvtph_ps(__m256i a) {  // 16 halves: two 8-lane F16C conversions side by side
    __m128i h[2]; memcpy(h, &a, 32);
    __m256 f[2] = {_mm256_cvtph_ps(h[0]), _mm256_cvtph_ps(h[1])};
    __m512 r; memcpy(&r, f, 64); return r;
}
#define _mm512_maskz_loadu_epi8 coli_maskz_loadu_epi8
#define _mm256_maskz_loadu_epi16 coli_maskz_loadu_epi16_256
#define _mm512_cvtph_ps coli_cvtph_ps
#define _mm512_shuffle_i64x2 coli_shuffle_i64x2
#define _mm256_mask_loadu_epi8 coli_mask_loadu_epi8_256
#define _mm_maskz_loadu_epi8 coli_maskz_loadu_epi8_128
#define _mm512_maskz_loadu_ps coli_maskz_loadu_ps
#define _mm512_cvtepu8_epi32 coli_cvtepu8_epi32
#define _mm512_cvtepi8_epi32 coli_cvtepi8_epi32
#define _mm512_cvtepi32_ps coli_cvtepi32_ps
