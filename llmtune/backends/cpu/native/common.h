/* What every source of the kernel library (qdot.c, kdot.c, pool.c, sgemm.c, program.c, rope.c,
 * lora.c, attention.c, norm.c, loss.c; dequant.c's decoders too) shares: the SIMD switches and helpers,
 * fp16 decoding (ggml-impl.h), ggml's activation block layouts, and the storage and activation type
 * codes, which are not written here: build.py generates lt_types.h from llmtune/quant/types.py
 * (c_defines: QT_<NAME> is ggml's type id, ACT_<NAME> a vec_dot type's kind), as the CUDA backend's
 * kernels get them, and native/kernels.py and program.py pass the same registry's numbers.
 * Helpers used by several files are static inline here; functions defined in one file and called
 * from another are declared here (hidden: only the lt_* entry points are exported). */
#ifndef LT_COMMON_H
#define LT_COMMON_H

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lt_types.h"  /* generated at build time (build.py): QT_*, ACT_* */

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LT_AVX2 1
#else
#define LT_AVX2 0
#endif

#define LT_INTERNAL __attribute__((visibility("hidden")))

#define QK 32
#define QK_K 256
_Static_assert(QK == QT_Q4_0_BLOCK && QK == ACT_Q8_0_BLOCK && QK == ACT_Q8_1_BLOCK, "quant/types.py: block of 32");
_Static_assert(QK_K == QT_Q4_K_BLOCK && QK_K == ACT_Q8_K_BLOCK, "quant/types.py: super-block of 256");

/* ------------------------------------------------------------------ fp16 (ggml-impl.h) */
static inline float fp32_from_bits(uint32_t w) { float f; memcpy(&f, &w, 4); return f; }
static inline uint32_t fp32_to_bits(float f) { uint32_t w; memcpy(&w, &f, 4); return w; }

#if defined(__F16C__)
#include <immintrin.h>
static inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float f16_to_f32(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & UINT32_C(0x80000000);
    const uint32_t two_w = w + w;
    const uint32_t exp_offset = UINT32_C(0xE0) << 23;
    const float exp_scale = 0x1.0p-112f;
    const float normalized_value = fp32_from_bits((two_w >> 4) + exp_offset) * exp_scale;
    const uint32_t magic_mask = UINT32_C(126) << 23;
    const float magic_bias = 0.5f;
    const float denormalized_value = fp32_from_bits((two_w >> 17) | magic_mask) - magic_bias;
    const uint32_t denormalized_cutoff = UINT32_C(1) << 27;
    const uint32_t result = sign | (two_w < denormalized_cutoff ? fp32_to_bits(denormalized_value)
                                                                 : fp32_to_bits(normalized_value));
    return fp32_from_bits(result);
}
#endif

static inline uint16_t f32_to_f16(float f) {  /* round to nearest even, as ggml's and numpy's casts */
    const float scale_to_inf = 0x1.0p+112f;
    const float scale_to_zero = 0x1.0p-110f;
    float base = (fabsf(f) * scale_to_inf) * scale_to_zero;
    const uint32_t w = fp32_to_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & UINT32_C(0x80000000);
    uint32_t bias = shl1_w & UINT32_C(0xFF000000);
    if (bias < UINT32_C(0x71000000)) bias = UINT32_C(0x71000000);
    base = fp32_from_bits((bias >> 1) + UINT32_C(0x07800000)) + base;
    const uint32_t bits = fp32_to_bits(base);
    const uint32_t exp_bits = (bits >> 13) & UINT32_C(0x00007C00);
    const uint32_t mantissa_bits = bits & UINT32_C(0x00000FFF);
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return (uint16_t)((sign >> 16) | (shl1_w > UINT32_C(0xFF000000) ? UINT16_C(0x7E00) : nonsign));
}

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline float h2f(const uint8_t *p) { return f16_to_f32(rd16(p)); }

/* ggml's nearest_int: round half to even for |x| < 2^22 */
static inline int nearest_int(float fval) {
    float val = fval + 12582912.f;
    int i; memcpy(&i, &val, 4);
    return (i & 0x007fffff) - 0x00400000;
}

/* ------------------------------------------------------------------ activation blocks */
typedef struct { uint16_t d; int8_t qs[QK]; } block_q8_0;             /* 34 bytes */
typedef struct { uint16_t d, s; int8_t qs[QK]; } block_q8_1;          /* 36 bytes */
typedef struct { float d; int8_t qs[QK_K]; int16_t bsums[QK_K / 16]; } block_q8_K;  /* 292 bytes */
_Static_assert(sizeof(block_q8_0) == QT_Q8_0_BYTES, "quant/types.py: Q8_0 block bytes");


/* ------------------------------------------------------------------ AVX2 helpers (x86/quants.c) */
#if LT_AVX2
static inline float hsum_float_8(const __m256 x) {
    __m128 res = _mm256_extractf128_ps(x, 1);
    res = _mm_add_ps(res, _mm256_castps256_ps128(x));
    res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    res = _mm_add_ss(res, _mm_movehdup_ps(res));
    return _mm_cvtss_f32(res);
}

static inline __m256i bytes_from_nibbles_32(const uint8_t *rsi) {
    const __m128i tmp = _mm_loadu_si128((const __m128i *)rsi);
    const __m256i bytes = _mm256_insertf128_si256(_mm256_castsi128_si256(tmp), _mm_srli_epi16(tmp, 4), 1);
    return _mm256_and_si256(_mm256_set1_epi8(0xF), bytes);
}

static inline __m256i bytes_from_bits_32(const uint8_t *x) {  /* 32 bits -> 32 bytes of 0x00 / 0xFF */
    uint32_t x32;
    memcpy(&x32, x, 4);
    const __m256i shuf_mask = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                0x0101010101010101, 0x0000000000000000);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x32), shuf_mask);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

static inline __m256 mul_sum_us8_pairs_float(const __m256i ax, const __m256i sy) {
#if defined(__AVXVNNI__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), ax, sy));
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sy));
#else
    const __m256i dot = _mm256_maddubs_epi16(ax, sy);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_set1_epi16(1), dot));
#endif
}

static inline __m256 mul_sum_i8_pairs_float(const __m256i x, const __m256i y) {
    return mul_sum_us8_pairs_float(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x));
}
#endif


/* f32 weights (vec_dot_type F32): ggml_vec_dot_f32 (vec.cpp) as the same ISA builds it, bit for bit:
 * four vector accumulators of GGML_F32_EPR lanes (16 with AVX-512, 8 with AVX2), 4 x EPR values a
 * step, reduced as GGML_F32_VEC_REDUCE does ((s0 + s2) + (s1 + s3), then _mm512_reduce_add_ps or
 * the two hadds of GGML_F32x8_REDUCE), the leftover values added one by one. The 16-lane form is
 * also what makes a decode step's f32 products stream memory ~1.3x faster than the 8-lane one. */
static inline float dot_f32(const float *w, const float *x, int64_t n) {
    int64_t i = 0;
    float sumf = 0;
#if defined(__AVX512F__) && LT_AVX2
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (; i + 64 <= n; i += 64) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16), _mm512_loadu_ps(x + i + 16), s1);
        s2 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 32), _mm512_loadu_ps(x + i + 32), s2);
        s3 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 48), _mm512_loadu_ps(x + i + 48), s3);
    }
    sumf = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s2), _mm512_add_ps(s1, s3)));
#elif LT_AVX2
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 16), _mm256_loadu_ps(x + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 24), _mm256_loadu_ps(x + i + 24), s3);
    }
    const __m256 s = _mm256_add_ps(_mm256_add_ps(s0, s2), _mm256_add_ps(s1, s3));
    const __m128 t0 = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    const __m128 t1 = _mm_hadd_ps(t0, t0);
    sumf = _mm_cvtss_f32(_mm_hadd_ps(t1, t1));
#else
    float s[8] = {0};
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) s[l] += w[i + l] * x[i + l];
    for (int l = 0; l < 8; l++) sumf += s[l];
#endif
    for (; i < n; i++) sumf += w[i] * x[i];
    return sumf;
}

/* The end of task c's range when tasks take `per` of n items (rows of a pass, elements). */
static inline int64_t task_end(int64_t c, int64_t per, int64_t n) { return (c + 1) * per < n ? (c + 1) * per : n; }


/* exp of 16 floats (AVX-512): x = n ln2 + r, |r| <= ln2/2 (ln2 in two parts, Cody-Waite), exp(r)
 * = 1 + r + r^2 P(r) with Cephes expf's minimax P, scaled by 2^n; within ~1 ulp of the correctly
 * rounded value (libm's expf on the portable path). Overflow to inf, underflow to 0, NaN kept. */
#if defined(__AVX512F__)
#define LT_VEXP 1
static inline __m512 exp16(__m512 x) {
    const __m512 hi = _mm512_set1_ps(88.72283935546875f), lo = _mm512_set1_ps(-103.97208f);
    const __mmask16 over = _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    __m512 e = _mm512_scalef_ps(y, n);
    e = _mm512_mask_mov_ps(e, over, _mm512_set1_ps(INFINITY));
    return _mm512_mask_mov_ps(e, under, _mm512_setzero_ps());
}
#else
#define LT_VEXP 0
#endif

#if defined(__AVX512F__)
/* the lanes of the v-th 16-float vector of a row of `cols` floats (sgemm.c, attention.c) */
static inline __mmask16 gemm_mask(int cols, int v) {
    const int n = cols - 16 * v;
    return (__mmask16)(n >= 16 ? 0xFFFF : n > 0 ? (1u << n) - 1 : 0);
}
#endif

/* ------------------------------------------------------------------ entry points other files call */
int lt_qlinear(int type, const uint8_t *w, int64_t w_stride, int64_t n_out, int64_t n_in,
               const float *x, int64_t m, float *out, int64_t out_stride, int nth);
int lt_qlinear_packed(int type, const uint8_t *packed, const uint8_t *w, int64_t w_stride, int64_t n_out, int64_t n_in,
                      const float *x, int64_t m, float *out, int64_t out_stride, int nth);
int lt_f32_linear(const float *w, int64_t w_stride, int64_t n_out, int64_t n_in,
                  const float *x, int64_t m, float *out, int64_t out_stride, int nth);
void lt_rms_norm(const float *x, int64_t rows, int64_t n, float eps, float *out);
/* kdot.c: a Q4_K / Q5_K / Q6_K row against a q8_K row (qdot.c's type table) */
LT_INTERNAL float dot_q4_k(const uint8_t *w, const void *y, int nb);
LT_INTERNAL float dot_q5_k(const uint8_t *w, const void *y, int nb);
LT_INTERNAL float dot_q6_k(const uint8_t *w, const void *y, int nb);
LT_INTERNAL void swiglu(const float *g, const float *u, float *o, int64_t n);  /* norm.c: one call's rows */

#endif
