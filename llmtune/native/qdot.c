/* Products of a few activation rows with a matrix kept in its ggml block type, as ggml's CPU
 * matmul computes them (ggml-cpu.c ggml_compute_forward_mul_mat with vec_dot): each activation
 * row is quantized to the weight type's vec_dot_type (q8_0, q8_1, q8_K), then every output is an
 * exact integer dot product per block times the two scales.
 *
 * The block layouts are ggml's (ggml-common.h). The activation quantizers are those of x86 builds
 * (ggml-cpu/arch/x86/quants.c quantize_row_q8_0 / q8_1; quantize_row_q8_K_ref), which is how
 * llmtune's numpy path (quant/matmul.py round_activations) rounds too, so both paths see the
 * same integers. Where AVX2 is available the dot products follow ggml's AVX2 kernels
 * (ggml_vec_dot_q4_0_q8_0 & co.: per-block int32 pair sums, one fused multiply-add per block into
 * eight float lanes); elsewhere the portable loops of ggml-cpu/quants.c (*_generic).
 *
 * Output rows are split in chunks of CHUNK_ROWS over the calling thread and a small pool of
 * workers that claim chunks as they come (pool_run: spin briefly, then sleep on a condition
 * variable; recreated after fork).
 *
 * Built by llmtune/native/build.py at first use; every entry point is tested against the numpy
 * path in tests/test_native.py.
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LT_AVX2 1
#else
#define LT_AVX2 0
#endif

#define QK 32
#define QK_K 256

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

/* quantize_row_q8_0 / q8_1 (x86): d = amax / 127 stored as fp16, q = round(x * (127 / amax)),
 * for q8_1 also s = fp16(d * sum q) with d unrounded. */
static void quantize_q8_01(const float *x, int64_t n, uint8_t *out, int with_sum) {
    const int64_t nb = n / QK;
    const size_t bsz = with_sum ? sizeof(block_q8_1) : sizeof(block_q8_0);
    for (int64_t i = 0; i < nb; i++, x += QK) {
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.f;
        const float id = amax != 0.0f ? 127.f / amax : 0.0f;
        int8_t *qs;
        uint8_t *blk = out + i * bsz;
        int sum = 0;
        if (with_sum) {
            block_q8_1 *y = (block_q8_1 *)blk;
            qs = y->qs;
            y->d = f32_to_f16(d);
        } else {
            block_q8_0 *y = (block_q8_0 *)blk;
            qs = y->qs;
            y->d = f32_to_f16(d);
        }
        for (int j = 0; j < QK; j++) {
            const int q = (int)nearbyintf(x[j] * id);
            qs[j] = (int8_t)q;
            sum += q;
        }
        if (with_sum) ((block_q8_1 *)blk)->s = f32_to_f16(d * (float)sum);
    }
}

/* quantize_row_q8_K_ref */
static void quantize_q8_K(const float *x, int64_t n, block_q8_K *y) {
    const int64_t nb = n / QK_K;
    for (int64_t i = 0; i < nb; i++, x += QK_K) {
        float max = 0, amax = 0;
        for (int j = 0; j < QK_K; ++j) {
            const float ax = fabsf(x[j]);
            if (ax > amax) { amax = ax; max = x[j]; }
        }
        if (!amax) {
            memset(&y[i], 0, sizeof(block_q8_K));
            continue;
        }
        const float iscale = -127.f / max;
        for (int j = 0; j < QK_K; ++j) {
            const int v = nearest_int(iscale * x[j]);
            y[i].qs[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int j = 0; j < QK_K / 16; ++j) {
            int sum = 0;
            for (int ii = 0; ii < 16; ++ii) sum += y[i].qs[j * 16 + ii];
            y[i].bsums[j] = (int16_t)sum;
        }
        y[i].d = 1 / iscale;
    }
}

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

/* ------------------------------------------------------------------ dot products, one row each
 * w: one weight row of nb blocks; y: the quantized activation row. */
static float dot_q8_0(const uint8_t *w, const void *vy, int nb) {
    const block_q8_0 *y = vy;
#if LT_AVX2
    const float *yd = (const float *)(y + nb);
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < nb; i++, w += 34) {
        const __m256 d = _mm256_set1_ps(h2f(w) * yd[i]);
        const __m256i qx = _mm256_loadu_si256((const __m256i *)(w + 2));
        const __m256i qy = _mm256_loadu_si256((const __m256i *)y[i].qs);
        acc = _mm256_fmadd_ps(d, mul_sum_i8_pairs_float(qx, qy), acc);
    }
    return hsum_float_8(acc);
#else
    float sumf = 0;
    for (int i = 0; i < nb; i++, w += 34) {
        const int8_t *qx = (const int8_t *)(w + 2);
        int sumi = 0;
        for (int j = 0; j < QK; j++) sumi += qx[j] * y[i].qs[j];
        sumf += sumi * (h2f(w) * f16_to_f32(y[i].d));
    }
    return sumf;
#endif
}

static float dot_q4_0(const uint8_t *w, const void *vy, int nb) {
    const block_q8_0 *y = vy;
#if LT_AVX2
    const float *yd = (const float *)(y + nb);
    __m256 acc = _mm256_setzero_ps();
    const __m256i off = _mm256_set1_epi8(8);
    for (int i = 0; i < nb; i++, w += 18) {
        const __m256 d = _mm256_set1_ps(h2f(w) * yd[i]);
        const __m256i qx = _mm256_sub_epi8(bytes_from_nibbles_32(w + 2), off);
        const __m256i qy = _mm256_loadu_si256((const __m256i *)y[i].qs);
        acc = _mm256_fmadd_ps(d, mul_sum_i8_pairs_float(qx, qy), acc);
    }
    return hsum_float_8(acc);
#else
    float sumf = 0;
    for (int i = 0; i < nb; i++, w += 18) {
        const uint8_t *qs = w + 2;
        int sumi0 = 0, sumi1 = 0;
        for (int j = 0; j < QK / 2; ++j) {
            sumi0 += ((qs[j] & 0x0F) - 8) * y[i].qs[j];
            sumi1 += ((qs[j] >> 4) - 8) * y[i].qs[j + QK / 2];
        }
        sumf += (sumi0 + sumi1) * h2f(w) * f16_to_f32(y[i].d);
    }
    return sumf;
#endif
}

static float dot_q4_1(const uint8_t *w, const void *vy, int nb) {
    const block_q8_1 *y = vy;
#if LT_AVX2
    const float *yd = (const float *)(y + nb), *ys = yd + nb;  /* the scales as floats (act_scales) */
    __m256 acc = _mm256_setzero_ps();
    float summs = 0;
    for (int i = 0; i < nb; i++, w += 20) {
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(*(const int32_t *)w));  /* d, m of the block */
        summs += _mm_cvtss_f32(_mm_movehdup_ps(dm)) * ys[i];
        const __m256 d0d1 = _mm256_mul_ps(_mm256_broadcastss_ps(dm), _mm256_set1_ps(yd[i]));
        const __m256i qx = bytes_from_nibbles_32(w + 4);
        const __m256i qy = _mm256_loadu_si256((const __m256i *)y[i].qs);
        acc = _mm256_fmadd_ps(d0d1, mul_sum_us8_pairs_float(qx, qy), acc);
    }
    return hsum_float_8(acc) + summs;
#else
    float sumf = 0;
    for (int i = 0; i < nb; i++, w += 20) {
        const uint8_t *qs = w + 4;
        int sumi0 = 0, sumi1 = 0;
        for (int j = 0; j < QK / 2; ++j) {
            sumi0 += (qs[j] & 0x0F) * y[i].qs[j];
            sumi1 += (qs[j] >> 4) * y[i].qs[j + QK / 2];
        }
        sumf += (h2f(w) * f16_to_f32(y[i].d)) * (sumi0 + sumi1) + h2f(w + 2) * f16_to_f32(y[i].s);
    }
    return sumf;
#endif
}

/* Two weight rows against one activation row at once (the activation loads shared, two
 * independent accumulator chains); each row's operations and their order are those of the one-row
 * kernel above, so each result is bit for bit the same. AVX2 only. */
#if LT_AVX2
static void dot2_q4_1(const uint8_t *w0, const uint8_t *w1, const void *vy, int nb, float *s0, float *s1) {
    const block_q8_1 *y = vy;
    const float *yd = (const float *)(y + nb), *ys = yd + nb;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float summs0 = 0, summs1 = 0;
    for (int i = 0; i < nb; i++, w0 += 20, w1 += 20) {
        const __m128 dm0 = _mm_cvtph_ps(_mm_cvtsi32_si128(*(const int32_t *)w0));
        const __m128 dm1 = _mm_cvtph_ps(_mm_cvtsi32_si128(*(const int32_t *)w1));
        summs0 += _mm_cvtss_f32(_mm_movehdup_ps(dm0)) * ys[i];
        summs1 += _mm_cvtss_f32(_mm_movehdup_ps(dm1)) * ys[i];
        const __m256 dy = _mm256_set1_ps(yd[i]);
        const __m256i qy = _mm256_loadu_si256((const __m256i *)y[i].qs);
        acc0 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_broadcastss_ps(dm0), dy),
                               mul_sum_us8_pairs_float(bytes_from_nibbles_32(w0 + 4), qy), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_broadcastss_ps(dm1), dy),
                               mul_sum_us8_pairs_float(bytes_from_nibbles_32(w1 + 4), qy), acc1);
    }
    *s0 = hsum_float_8(acc0) + summs0;
    *s1 = hsum_float_8(acc1) + summs1;
}

static void dot2_q8_0(const uint8_t *w0, const uint8_t *w1, const void *vy, int nb, float *s0, float *s1) {
    const block_q8_0 *y = vy;
    const float *yd = (const float *)(y + nb);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int i = 0; i < nb; i++, w0 += 34, w1 += 34) {
        const __m256i qy = _mm256_loadu_si256((const __m256i *)y[i].qs);
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(h2f(w0) * yd[i]),
                               mul_sum_i8_pairs_float(_mm256_loadu_si256((const __m256i *)(w0 + 2)), qy), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(h2f(w1) * yd[i]),
                               mul_sum_i8_pairs_float(_mm256_loadu_si256((const __m256i *)(w1 + 2)), qy), acc1);
    }
    *s0 = hsum_float_8(acc0);
    *s1 = hsum_float_8(acc1);
}
#define DOT2_Q4_1 dot2_q4_1
#define DOT2_Q8_0 dot2_q8_0
#else
#define DOT2_Q4_1 NULL
#define DOT2_Q8_0 NULL
#endif

/* Q5_0 / Q5_1: the fifth bit of value j is bit j of qh. */
static float dot_q5(const uint8_t *w, const void *vy, int nb, int has_min) {
    const int bsz = has_min ? 24 : 22, hoff = has_min ? 4 : 2;
    float summs = 0;
#if LT_AVX2
    const float *yd = (const float *)((const uint8_t *)vy + nb * (has_min ? sizeof(block_q8_1) : sizeof(block_q8_0)));
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < nb; i++, w += bsz) {
        const int8_t *ys = has_min ? ((const block_q8_1 *)vy)[i].qs : ((const block_q8_0 *)vy)[i].qs;
        const __m256 d = _mm256_set1_ps(h2f(w) * yd[i]);
        __m256i qx = bytes_from_nibbles_32(w + hoff + 4);
        __m256i bxhi = bytes_from_bits_32(w + hoff);
        const __m256i qy = _mm256_loadu_si256((const __m256i *)ys);
        if (has_min) {  /* ggml_vec_dot_q5_1_q8_1: q | 16 where the bit is set, unsigned */
            summs += h2f(w + 2) * yd[nb + i];
            bxhi = _mm256_and_si256(bxhi, _mm256_set1_epi8(0x10));
            qx = _mm256_or_si256(qx, bxhi);
            acc = _mm256_fmadd_ps(d, mul_sum_us8_pairs_float(qx, qy), acc);
        } else {        /* ggml_vec_dot_q5_0_q8_0: (q | 16) - 16 = q - 16 where the bit is clear */
            bxhi = _mm256_andnot_si256(bxhi, _mm256_set1_epi8((char)0xF0));
            qx = _mm256_or_si256(qx, bxhi);
            acc = _mm256_fmadd_ps(d, mul_sum_i8_pairs_float(qx, qy), acc);
        }
    }
    return hsum_float_8(acc) + summs;
#else
    float sumf = 0;
    for (int i = 0; i < nb; i++, w += bsz) {
        const int8_t *ys = has_min ? ((const block_q8_1 *)vy)[i].qs : ((const block_q8_0 *)vy)[i].qs;
        const float dy = f16_to_f32(has_min ? ((const block_q8_1 *)vy)[i].d : ((const block_q8_0 *)vy)[i].d);
        uint32_t qh;
        memcpy(&qh, w + hoff, 4);
        const uint8_t *qs = w + hoff + 4;
        const int off = has_min ? 0 : 16;
        int sumi0 = 0, sumi1 = 0;
        for (int j = 0; j < QK / 2; ++j) {
            const int xh0 = ((qh >> j) & 1) << 4, xh1 = ((qh >> (j + 16)) & 1) << 4;
            sumi0 += (((qs[j] & 0x0F) | xh0) - off) * ys[j];
            sumi1 += (((qs[j] >> 4) | xh1) - off) * ys[j + QK / 2];
        }
        sumf += (h2f(w) * dy) * (sumi0 + sumi1);
        if (has_min) summs += h2f(w + 2) * f16_to_f32(((const block_q8_1 *)vy)[i].s);
    }
    return sumf + summs;
#endif
}

static float dot_q5_0(const uint8_t *w, const void *vy, int nb) { return dot_q5(w, vy, nb, 0); }
static float dot_q5_1(const uint8_t *w, const void *vy, int nb) { return dot_q5(w, vy, nb, 1); }

/* K-quants: ggml-cpu/quants.c ggml_vec_dot_q{4,5,6}_K_q8_K_generic (eight int32 lanes per
 * super-block, scaled into eight float sums). */
static void k_scales_mins(const uint8_t *sc12, uint8_t scales[8], uint8_t mins[8]) {
    for (int j = 0; j < 4; j++) {
        scales[j] = sc12[j] & 63;
        mins[j] = sc12[j + 4] & 63;
        scales[j + 4] = (sc12[j + 8] & 0xF) | ((sc12[j] >> 6) << 4);
        mins[j + 4] = (sc12[j + 8] >> 4) | ((sc12[j + 4] >> 6) << 4);
    }
}

static float dot_q45_k(const uint8_t *w, const void *vy, int nb, int five) {
    const block_q8_K *y = vy;
    const int bsz = five ? 176 : 144;
    float sums[8] = {0}, sumf = 0;
    for (int i = 0; i < nb; i++, w += bsz) {
        const uint8_t *q4 = w + (five ? 48 : 16), *hm = w + 16;
        int8_t a[QK_K];
        uint8_t m = 1;
        for (int j = 0; j < QK_K / 64; ++j, q4 += 32) {
            for (int l = 0; l < 32; ++l) a[64 * j + l] = (int8_t)((q4[l] & 0xF) + (five && (hm[l] & m) ? 16 : 0));
            m <<= 1;
            for (int l = 0; l < 32; ++l) a[64 * j + 32 + l] = (int8_t)((q4[l] >> 4) + (five && (hm[l] & m) ? 16 : 0));
            m <<= 1;
        }
        uint8_t scales[8], mins[8];
        k_scales_mins(w + 4, scales, mins);
        int sumi = 0;
        for (int j = 0; j < QK_K / 16; ++j) sumi += y[i].bsums[j] * mins[j / 2];
        int32_t aux32[8] = {0};
        for (int j = 0; j < QK_K / 32; ++j) {
            const int32_t scale = scales[j];
            for (int k = 0; k < 4; ++k)
                for (int l = 0; l < 8; ++l) aux32[l] += scale * (y[i].qs[32 * j + 8 * k + l] * a[32 * j + 8 * k + l]);
        }
        const float d = h2f(w) * y[i].d;
        for (int l = 0; l < 8; ++l) sums[l] += d * aux32[l];
        const float dmin = h2f(w + 2) * y[i].d;
        sumf -= dmin * sumi;
    }
    for (int l = 0; l < 8; ++l) sumf += sums[l];
    return sumf;
}

static float dot_q4_k(const uint8_t *w, const void *vy, int nb) { return dot_q45_k(w, vy, nb, 0); }
static float dot_q5_k(const uint8_t *w, const void *vy, int nb) { return dot_q45_k(w, vy, nb, 1); }

static float dot_q6_k(const uint8_t *w, const void *vy, int nb) {
    const block_q8_K *y = vy;
    float sums[8] = {0}, sumf = 0;
    for (int i = 0; i < nb; i++, w += 210) {
        const uint8_t *q4 = w, *qh = w + 128;
        const int8_t *sc = (const int8_t *)(w + 192);
        int8_t a[QK_K];
        for (int j = 0; j < QK_K; j += 128, q4 += 64, qh += 32) {
            for (int l = 0; l < 32; ++l) {
                a[j + l + 0] = (int8_t)((q4[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                a[j + l + 32] = (int8_t)((q4[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                a[j + l + 64] = (int8_t)((q4[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                a[j + l + 96] = (int8_t)((q4[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            }
        }
        int32_t aux32[8] = {0};
        for (int j = 0; j < QK_K / 16; ++j) {
            const int scale = sc[j];
            for (int k = 0; k < 2; ++k)
                for (int l = 0; l < 8; ++l) aux32[l] += scale * (y[i].qs[16 * j + 8 * k + l] * a[16 * j + 8 * k + l]);
        }
        const float d = h2f(w + 208) * y[i].d;
        for (int l = 0; l < 8; ++l) sums[l] += d * aux32[l];
    }
    for (int l = 0; l < 8; ++l) sumf += sums[l];
    return sumf;
}

/* f32 weights (vec_dot_type F32): ggml_vec_dot_f32, four vector accumulators */
static float dot_f32(const float *w, const float *x, int64_t n) {
    int64_t i = 0;
    float sumf = 0;
#if LT_AVX2
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 16), _mm256_loadu_ps(x + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 24), _mm256_loadu_ps(x + i + 24), s3);
    }
    sumf = hsum_float_8(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
#else
    float s[8] = {0};
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) s[l] += w[i + l] * x[i + l];
    for (int l = 0; l < 8; l++) sumf += s[l];
#endif
    for (; i < n; i++) sumf += w[i] * x[i];
    return sumf;
}

/* ------------------------------------------------------------------ types */
typedef float (*dot_fn)(const uint8_t *, const void *, int);
typedef void (*dot2_fn)(const uint8_t *, const uint8_t *, const void *, int, float *, float *);
enum { ACT_Q8_0 = 0, ACT_Q8_1 = 1, ACT_Q8_K = 2 };

typedef struct { const char *name; int block, act; dot_fn dot; dot2_fn dot2; } qtype_t;
static const qtype_t QTYPES[] = {  /* index = the type code lt_qlinear takes (native/kernels.py TYPE_CODES) */
    {"Q8_0", QK, ACT_Q8_0, dot_q8_0, DOT2_Q8_0}, {"Q4_0", QK, ACT_Q8_0, dot_q4_0, NULL},
    {"Q4_1", QK, ACT_Q8_1, dot_q4_1, DOT2_Q4_1},
    {"Q5_0", QK, ACT_Q8_0, dot_q5_0, NULL}, {"Q5_1", QK, ACT_Q8_1, dot_q5_1, NULL},
    {"Q4_K", QK_K, ACT_Q8_K, dot_q4_k, NULL}, {"Q5_K", QK_K, ACT_Q8_K, dot_q5_k, NULL},
    {"Q6_K", QK_K, ACT_Q8_K, dot_q6_k, NULL},
};
#define N_QTYPES ((int)(sizeof(QTYPES) / sizeof(QTYPES[0])))

static int64_t act_row_bytes(int act, int64_t n) {
    switch (act) {  /* q8_0 / q8_1 blocks, then their d (and s) as floats (act_scales) */
        case ACT_Q8_0: return n / QK * (int64_t)(sizeof(block_q8_0) + 4);
        case ACT_Q8_1: return n / QK * (int64_t)(sizeof(block_q8_1) + 8);
        default: return n / QK_K * (int64_t)sizeof(block_q8_K);
    }
}

/* The fp16 scales of a q8_0 / q8_1 row also as floats after its blocks (the same values, converted
 * once instead of once per weight row): d[nb], then for q8_1 s[nb]. */
static void act_scales(uint8_t *row, int64_t nb, int with_sum) {
    float *f = (float *)(row + nb * (with_sum ? sizeof(block_q8_1) : sizeof(block_q8_0)));
    for (int64_t i = 0; i < nb; i++) {
        if (with_sum) {
            const block_q8_1 *b = (const block_q8_1 *)row + i;
            f[i] = f16_to_f32(b->d);
            f[nb + i] = f16_to_f32(b->s);
        } else {
            f[i] = f16_to_f32(((const block_q8_0 *)row)[i].d);
        }
    }
}

/* One activation row quantized to `act` (0: q8_0, 1: q8_1, 2: q8_K); n a multiple of the block.
 * `out` holds lt_act_row_bytes(act, n) bytes: the ggml blocks first. */
void lt_quantize_act(int act, const float *x, int64_t n, uint8_t *out) {
    if (act == ACT_Q8_K) {
        quantize_q8_K(x, n, (block_q8_K *)out);
    } else {
        quantize_q8_01(x, n, out, act == ACT_Q8_1);
        act_scales(out, n / QK, act == ACT_Q8_1);
    }
}

int64_t lt_act_row_bytes(int act, int64_t n) { return act_row_bytes(act, n); }

/* ------------------------------------------------------------------ thread pool
 * A job is n_chunks calls fn(arg, chunk); the calling thread and the workers claim chunks from one
 * atomic ticket (job generation << 40 | n_chunks << 20 | next chunk), so on a busy machine a worker
 * that is not scheduled takes nothing and the caller does the rest: the caller waits only for
 * chunks a worker has claimed. Workers spin LT_SPIN_NS for the next job, then sleep: 5 ms, since
 * a training step's products come a few small ops apart and a worker woken from sleep joins a
 * product late (200 us cost a SmolLM2 LoRA step ~3 %). */
#define LT_MAX_THREADS 64
#define LT_SPIN_NS 5000000
#define LT_MAX_CHUNKS ((1 << 20) - 1)

typedef void (*task_fn)(void *arg, int64_t chunk);

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n_workers, sleepers;
    atomic_uint gen;          /* bumped when a job is published */
    atomic_uint_fast64_t ticket;
    atomic_int busy;          /* workers inside a job */
    atomic_uintptr_t fn, arg; /* the job (read by workers that may come late: see claim) */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, 0, 0};
static pthread_mutex_t pool_start = PTHREAD_MUTEX_INITIALIZER;  /* one job on the pool at a time */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* The next chunk of job `gen`, or -1 when it has none left (or is no longer the current job). */
static int64_t claim(unsigned gen) {
    uint_fast64_t t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
    for (;;) {
        const uint_fast64_t next = t & LT_MAX_CHUNKS, total = (t >> 20) & LT_MAX_CHUNKS;
        if ((unsigned)((t >> 40) & 0xFFFFFF) != (gen & 0xFFFFFF) || next >= total) return -1;
        if (atomic_compare_exchange_weak_explicit(&pool.ticket, &t, t + 1, memory_order_acq_rel, memory_order_acquire))
            return (int64_t)next;
    }
}

static void run_chunks(unsigned gen, task_fn fn, void *arg) {
    for (int64_t c; (c = claim(gen)) >= 0;) fn(arg, c);
}

static void *worker_main(void *p) {
    (void)p;
    unsigned seen = 0;
    for (;;) {
        int64_t t0 = 0;
        int spins = 0;
        while (atomic_load_explicit(&pool.gen, memory_order_acquire) == seen) {
            if (++spins % 256 == 0) {
                const int64_t t = now_ns();
                if (!t0) t0 = t;
                else if (t - t0 > LT_SPIN_NS) {
                    pthread_mutex_lock(&pool.mu);
                    pool.sleepers++;
                    while (atomic_load_explicit(&pool.gen, memory_order_acquire) == seen)
                        pthread_cond_wait(&pool.cv, &pool.mu);
                    pool.sleepers--;
                    pthread_mutex_unlock(&pool.mu);
                    break;
                }
            }
            cpu_relax();
        }
        atomic_fetch_add_explicit(&pool.busy, 1, memory_order_acq_rel);
        /* a late worker may read the next job's fn/arg with this gen: claim() then finds the
         * ticket of another generation (or none left) and nothing runs */
        seen = atomic_load_explicit(&pool.gen, memory_order_acquire);
        const task_fn fn = (task_fn)atomic_load_explicit(&pool.fn, memory_order_acquire);
        void *arg = (void *)atomic_load_explicit(&pool.arg, memory_order_acquire);
        run_chunks(seen, fn, arg);
        atomic_fetch_sub_explicit(&pool.busy, 1, memory_order_acq_rel);
    }
    return NULL;
}

static void pool_after_fork(void) {  /* the child has no workers: start afresh */
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.cv, NULL);
    pthread_mutex_init(&pool_start, NULL);
    pool.n_workers = pool.sleepers = 0;
    atomic_store(&pool.busy, 0);
}

static int pool_grow(int n_workers) {
    static int atfork_done = 0;
    if (!atfork_done) { pthread_atfork(NULL, NULL, pool_after_fork); atfork_done = 1; }
    while (pool.n_workers < n_workers) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&th, &attr, worker_main, NULL);
        pthread_attr_destroy(&attr);
        if (rc) break;
        pool.n_workers++;
    }
    return pool.n_workers;
}

/* fn(arg, c) for every chunk c < n_chunks, over the calling thread and nth - 1 workers */
static void pool_run(task_fn fn, void *arg, int64_t n_chunks, int nth) {
    if (nth > LT_MAX_THREADS) nth = LT_MAX_THREADS;
    if (nth <= 1 || n_chunks <= 1 || n_chunks > LT_MAX_CHUNKS || pthread_mutex_trylock(&pool_start) != 0) {
        for (int64_t c = 0; c < n_chunks; c++) fn(arg, c);  /* alone (or another caller has the pool) */
        return;
    }
    if (pool_grow(nth - 1) == 0) {
        pthread_mutex_unlock(&pool_start);
        for (int64_t c = 0; c < n_chunks; c++) fn(arg, c);
        return;
    }
    const unsigned gen = atomic_load_explicit(&pool.gen, memory_order_relaxed) + 1;
    atomic_store_explicit(&pool.fn, (uintptr_t)fn, memory_order_release);
    atomic_store_explicit(&pool.arg, (uintptr_t)arg, memory_order_release);
    atomic_store_explicit(&pool.ticket, ((uint_fast64_t)(gen & 0xFFFFFF) << 40) | ((uint_fast64_t)n_chunks << 20),
                          memory_order_release);
    pthread_mutex_lock(&pool.mu);
    atomic_store_explicit(&pool.gen, gen, memory_order_release);
    if (pool.sleepers) pthread_cond_broadcast(&pool.cv);
    pthread_mutex_unlock(&pool.mu);
    run_chunks(gen, fn, arg);
    int spins = 0;
    while (atomic_load_explicit(&pool.busy, memory_order_acquire) > 0) {  /* chunks a worker still runs */
        if (++spins % 1024 == 0) sched_yield();
        cpu_relax();
    }
    pthread_mutex_unlock(&pool_start);
}

/* ------------------------------------------------------------------ products */
#define CHUNK_ROWS 16

typedef struct {
    dot_fn dot;
    dot2_fn dot2;  /* two rows at once, where the type has it */
    const uint8_t *w;
    int64_t w_stride, n_out, nb;
    const uint8_t *xq;
    int64_t xq_stride, m;
    float *out;
    int64_t out_stride;
    const float *xf;  /* f32 weights: the activations as they are */
    int64_t n_in;
} job_t;

static void q_task(void *p, int64_t chunk) {
    const job_t *j = p;
    const int64_t r0 = chunk * CHUNK_ROWS, r1 = r0 + CHUNK_ROWS < j->n_out ? r0 + CHUNK_ROWS : j->n_out;
    int64_t r = r0;
    if (j->dot2)
        for (; r + 1 < r1; r += 2) {
            const uint8_t *w0 = j->w + r * j->w_stride;
            for (int64_t i = 0; i < j->m; i++) {
                float *o = j->out + i * j->out_stride + r;
                j->dot2(w0, w0 + j->w_stride, j->xq + i * j->xq_stride, (int)j->nb, o, o + 1);
            }
        }
    for (; r < r1; r++) {
        const uint8_t *wr = j->w + r * j->w_stride;
        for (int64_t i = 0; i < j->m; i++)
            j->out[i * j->out_stride + r] = j->dot(wr, j->xq + i * j->xq_stride, (int)j->nb);
    }
}

static void f32_task(void *p, int64_t chunk) {
    const job_t *j = p;
    const int64_t r0 = chunk * CHUNK_ROWS, r1 = r0 + CHUNK_ROWS < j->n_out ? r0 + CHUNK_ROWS : j->n_out;
    for (int64_t r = r0; r < r1; r++) {
        const float *wr = (const float *)(j->w + r * j->w_stride);
        for (int64_t i = 0; i < j->m; i++)
            j->out[i * j->out_stride + r] = dot_f32(wr, j->xf + i * j->n_in, j->n_in);
    }
}

static __thread uint8_t *act_buf = NULL;
static __thread int64_t act_cap = 0;

/* out[i, r] = W[r] . x[i] for i < m, r < n_out: W in ggml type `type` (QTYPES index), rows of
 * w_stride bytes; x float32 [m, n_in] contiguous, quantized here as ggml quantizes it. Returns 0,
 * or -1 for a bad type or width, -2 when out of memory. */
int lt_qlinear(int type, const uint8_t *w, int64_t w_stride, int64_t n_out, int64_t n_in,
               const float *x, int64_t m, float *out, int64_t out_stride, int nth) {
    if (type < 0 || type >= N_QTYPES || n_in % QTYPES[type].block) return -1;
    const qtype_t *qt = &QTYPES[type];
    const int64_t xq_stride = act_row_bytes(qt->act, n_in);
    if (act_cap < xq_stride * m) {
        uint8_t *buf = realloc(act_buf, (size_t)(xq_stride * m));
        if (!buf) return -2;
        act_buf = buf;
        act_cap = xq_stride * m;
    }
    for (int64_t i = 0; i < m; i++) lt_quantize_act(qt->act, x + i * n_in, n_in, act_buf + i * xq_stride);
    job_t job = {qt->dot, qt->dot2, w, w_stride, n_out, n_in / qt->block, act_buf, xq_stride, m, out, out_stride, NULL, n_in};
    pool_run(q_task, &job, (n_out + CHUNK_ROWS - 1) / CHUNK_ROWS, nth);
    return 0;
}

/* ------------------------------------------------------------------ packed Q8_0 / Q4_1 (AVX-512 VNNI)
 * A matrix repacked once (lt_pack) in groups of 8 rows, block by block: the 8 rows' fp16 scales
 * (and Q4_1's mins) side by side, then the 8 rows' quants (as llama.cpp's repack.cpp interleaves
 * Q4_0 for its GEMV). Two rows fill one 512-bit register: one vpdpbusd gives both rows' eight
 * int32 pair sums of a block, and one fused multiply-add accumulates both rows' eight float lanes.
 * Each float lane is the lane of ggml's AVX2 vec_dot (the same integers, the same scale product,
 * one fma per block in block order, the same final hsum and min term), so every output is the
 * per-row kernel's, bit for bit; only the loads and the integer work are shared. Q8_0's signed
 * quants go through vpdpbusd as x + 128 (unsigned), less 128 * (sum of the four y), exact. */
#define PACK_ROWS 8
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && LT_AVX2
#define LT_PACK 1
#else
#define LT_PACK 0
#endif

static int64_t pack_block_bytes(int type) { return type == 0 ? 16 + 8 * 32 : type == 2 ? 32 + 8 * 16 : 0; }

/* Bytes of the packed copy of the n_rows / 8 whole groups (0: the type has no packed kernel here). */
int64_t lt_pack_bytes(int type, int64_t n_rows, int64_t n_in) {
    if (!LT_PACK || !pack_block_bytes(type) || n_in % QK) return 0;
    return n_rows / PACK_ROWS * (n_in / QK) * pack_block_bytes(type);
}

void lt_pack(int type, const uint8_t *w, int64_t w_stride, int64_t n_rows, int64_t n_in, uint8_t *out) {
    const int64_t nb = n_in / QK, gb = pack_block_bytes(type), bsz = type == 0 ? 34 : 20;
    for (int64_t g = 0; g < n_rows / PACK_ROWS; g++)
        for (int64_t i = 0; i < nb; i++) {
            uint8_t *o = out + (g * nb + i) * gb;
            for (int r = 0; r < PACK_ROWS; r++) {
                const uint8_t *b = w + (g * PACK_ROWS + r) * w_stride + i * bsz;
                if (type == 0) {
                    memcpy(o + 2 * r, b, 2);
                    memcpy(o + 16 + 32 * r, b + 2, 32);
                } else {
                    memcpy(o + 2 * r, b, 2);
                    memcpy(o + 16 + 2 * r, b + 2, 2);
                    memcpy(o + 32 + 16 * r, b + 4, 16);
                }
            }
        }
}

#if LT_PACK
/* the activation row as the packed kernels read it: per block the quants (Q4_1: 0-15 twice, then
 * 16-31 twice, to face two rows' low and high nibbles), Q8_0's 128 * four-value sums */
static void prep_act(int type, const uint8_t *xq, int64_t nb, int8_t *yq, int32_t *ycorr) {
    for (int64_t i = 0; i < nb; i++) {
        const int8_t *q = type == 0 ? ((const block_q8_0 *)xq)[i].qs : ((const block_q8_1 *)xq)[i].qs;
        if (type == 0) {
            memcpy(yq + 32 * i, q, 32);
            for (int j = 0; j < 8; j++) ycorr[8 * i + j] = 128 * (q[4 * j] + q[4 * j + 1] + q[4 * j + 2] + q[4 * j + 3]);
        } else {
            memcpy(yq + 64 * i, q, 16);
            memcpy(yq + 64 * i + 16, q, 16);
            memcpy(yq + 64 * i + 32, q + 16, 16);
            memcpy(yq + 64 * i + 48, q + 16, 16);
        }
    }
}

static void group_q8_0(const uint8_t *g, int64_t nb, const int8_t *yq, const float *yd, const int32_t *ycorr, float *out) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i lo = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i two = _mm512_set1_epi32(2);
    for (int64_t i = 0; i < nb; i++, g += 16 + 8 * 32) {
        const __m256 sc = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g)), _mm256_set1_ps(yd[i]));
        const __m512 sc2 = _mm512_castps256_ps512(sc);
        const __m512i y = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(yq + 32 * i)));
        const __m512i corr = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(ycorr + 8 * i)));
        __m512i idx = lo;
        for (int p = 0; p < 4; p++, idx = _mm512_add_epi32(idx, two)) {
            const __m512i x = _mm512_xor_si512(_mm512_loadu_si512((const void *)(g + 16 + 64 * p)), flip);
            const __m512i d = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), x, y), corr);
            acc[p] = _mm512_fmadd_ps(_mm512_permutexvar_ps(idx, sc2), _mm512_cvtepi32_ps(d), acc[p]);
        }
    }
    for (int p = 0; p < 4; p++) {
        out[2 * p] = hsum_float_8(_mm512_castps512_ps256(acc[p]));
        out[2 * p + 1] = hsum_float_8(_mm512_extractf32x8_ps(acc[p], 1));
    }
}

static void group_q4_1(const uint8_t *g, int64_t nb, const int8_t *yq, const float *yd, const float *ys, float *out) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    __m256 summs = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const __m512i base = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i two = _mm512_set1_epi32(2);
    for (int64_t i = 0; i < nb; i++, g += 32 + 8 * 16) {
        const __m256 sc = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g)), _mm256_set1_ps(yd[i]));
        summs = _mm256_add_ps(summs, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16))),
                                                   _mm256_set1_ps(ys[i])));
        const __m512 sc2 = _mm512_castps256_ps512(sc);
        const __m512i y = _mm512_loadu_si512((const void *)(yq + 64 * i));
        __m512i idx = base;
        for (int p = 0; p < 4; p++, idx = _mm512_add_epi32(idx, two)) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(g + 32 + 32 * p));
            const __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(q, m4)),
                                                 _mm256_and_si256(_mm256_srli_epi16(q, 4), m4), 1);
            const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), x, y);
            acc[p] = _mm512_fmadd_ps(_mm512_permutexvar_ps(idx, sc2), _mm512_cvtepi32_ps(d), acc[p]);
        }
    }
    float mins[8];
    _mm256_storeu_ps(mins, summs);
    const __m512i rows = _mm512_set_epi32(15, 14, 13, 12, 7, 6, 5, 4, 11, 10, 9, 8, 3, 2, 1, 0);
    for (int p = 0; p < 4; p++) {  /* lanes 0-3 and 8-11 are row 2p's, 4-7 and 12-15 row 2p + 1's */
        const __m512 v = _mm512_permutexvar_ps(rows, acc[p]);
        out[2 * p] = hsum_float_8(_mm512_castps512_ps256(v)) + mins[2 * p];
        out[2 * p + 1] = hsum_float_8(_mm512_extractf32x8_ps(v, 1)) + mins[2 * p + 1];
    }
}

typedef struct {
    int type;
    const uint8_t *packed;
    int64_t nb, n_groups, m;
    const int8_t *yq;
    const int32_t *ycorr;
    const uint8_t *xq;  /* the quantized rows, their scales as floats after each row's blocks */
    int64_t yq_stride, xq_stride, scales_at;
    float *out;
    int64_t out_stride;
} pjob_t;

#define PACK_CHUNK 2  /* groups per claimed chunk: 16 rows */

static void p_task(void *p, int64_t chunk) {
    const pjob_t *j = p;
    const int64_t g0 = chunk * PACK_CHUNK, g1 = g0 + PACK_CHUNK < j->n_groups ? g0 + PACK_CHUNK : j->n_groups;
    const int64_t gb = pack_block_bytes(j->type) * j->nb;
    for (int64_t g = g0; g < g1; g++)
        for (int64_t i = 0; i < j->m; i++) {
            float *o = j->out + i * j->out_stride + g * PACK_ROWS;
            const float *yd = (const float *)(j->xq + i * j->xq_stride + j->scales_at);
            if (j->type == 0)
                group_q8_0(j->packed + g * gb, j->nb, j->yq + i * j->yq_stride, yd, j->ycorr + i * j->nb * 8, o);
            else
                group_q4_1(j->packed + g * gb, j->nb, j->yq + i * j->yq_stride, yd, yd + j->nb, o);
        }
}

static __thread uint8_t *prep_buf = NULL;
static __thread int64_t prep_cap = 0;
#endif

/* lt_qlinear with the whole groups of 8 rows read from `packed` (lt_pack's copy of w), the rest
 * of the rows from w. Returns as lt_qlinear; -1 also where this build has no packed kernel. */
int lt_qlinear_packed(int type, const uint8_t *packed, const uint8_t *w, int64_t w_stride, int64_t n_out, int64_t n_in,
                      const float *x, int64_t m, float *out, int64_t out_stride, int nth) {
#if LT_PACK
    if ((type != 0 && type != 2) || n_in % QK) return -1;
    const qtype_t *qt = &QTYPES[type];
    const int64_t nb = n_in / QK, xq_stride = act_row_bytes(qt->act, n_in);
    const int64_t yq_stride = nb * (type == 0 ? 32 : 64), corr_bytes = type == 0 ? nb * 32 : 0;
    const int64_t need = m * (xq_stride + yq_stride + corr_bytes) + 64;
    if (act_cap < xq_stride * m) {
        uint8_t *buf = realloc(act_buf, (size_t)(xq_stride * m));
        if (!buf) return -2;
        act_buf = buf;
        act_cap = xq_stride * m;
    }
    if (prep_cap < need) {
        uint8_t *buf = realloc(prep_buf, (size_t)need);
        if (!buf) return -2;
        prep_buf = buf;
        prep_cap = need;
    }
    int8_t *yq = (int8_t *)prep_buf;
    int32_t *ycorr = (int32_t *)(prep_buf + m * yq_stride);
    for (int64_t i = 0; i < m; i++) {
        uint8_t *xq = act_buf + i * xq_stride;
        lt_quantize_act(qt->act, x + i * n_in, n_in, xq);
        prep_act(type, xq, nb, yq + i * yq_stride, ycorr + i * nb * 8);
    }
    /* the scales as floats follow each activation row's blocks (act_scales): d[nb], then s[nb] */
    const int64_t blk = type == 0 ? (int64_t)sizeof(block_q8_0) : (int64_t)sizeof(block_q8_1);
    pjob_t job = {type, packed, nb, n_out / PACK_ROWS, m, yq, ycorr, act_buf, yq_stride, xq_stride, nb * blk,
                  out, out_stride};
    pool_run(p_task, &job, (job.n_groups + PACK_CHUNK - 1) / PACK_CHUNK, nth);
    const int64_t done = job.n_groups * PACK_ROWS;
    for (int64_t r = done; r < n_out; r++)
        for (int64_t i = 0; i < m; i++)
            out[i * out_stride + r] = qt->dot(w + r * w_stride, act_buf + i * xq_stride, (int)nb);
    return 0;
#else
    (void)type; (void)packed; (void)w; (void)w_stride; (void)n_out; (void)n_in; (void)x; (void)m; (void)out;
    (void)out_stride; (void)nth;
    return -1;
#endif
}

/* out[i, r] = W[r] . x[i] for float32 W rows of w_stride bytes (ggml_vec_dot_f32). */
int lt_f32_linear(const float *w, int64_t w_stride, int64_t n_out, int64_t n_in,
                  const float *x, int64_t m, float *out, int64_t out_stride, int nth) {
    job_t job = {NULL, NULL, (const uint8_t *)w, w_stride, n_out, 0, NULL, 0, m, out, out_stride, x, n_in};
    pool_run(f32_task, &job, (n_out + CHUNK_ROWS - 1) / CHUNK_ROWS, nth);
    return 0;
}

/* ------------------------------------------------------------------ packed float32 products
 * C = A W^T for a frozen float32 W [N, K] (a training pass's base weights), as BLIS / Goto's
 * GEMM does it: W^T is packed once into panels of GEMM_NR columns, k-major (Bp[p][k][c] =
 * W[p*NR + c][k], the last panel zero-filled); A's rows are read as they are (a training pass's
 * rows are short: packing them cost more than it saved). The micro-kernel keeps an MR x NR block
 * of C in 24 AVX-512 registers: per k, three loads of the W panel and MR broadcasts of A. Every
 * C element is one sum over k in order (in blocks of GEMM_KC past it), whatever the chunks and
 * threads, so the bits do not depend on the thread count (numpy's BLAS sums in another order:
 * tests state the tolerance). A panel (~110 KB at K = 576) is read from memory once per chunk of
 * GEMM_MC rows and reused from L2 by each of its row blocks; OpenBLAS's sgemm with a transposed B
 * runs ~1.2-1.6x slower on a training pass's 128-row shapes (BENCHMARKS). */
#define GEMM_MR 8
#define GEMM_NR 48
#define GEMM_MC 256
#define GEMM_KC 2048  /* a sum over more k (the vocabulary's input gradient) runs in blocks of this */

#if defined(__AVX512F__)
#define LT_GEMM 1
/* C[rows, cols] = A[rows, K] (rows of lda floats, broadcast as they are: 8 sequential streams
 * need no packing) . Bp (K x NR panel) */
static inline __mmask16 gemm_mask(int cols, int v) {
    const int n = cols - 16 * v;
    return (__mmask16)(n >= 16 ? 0xFFFF : n > 0 ? (1u << n) - 1 : 0);
}

/* accumulate: add to C's values (a later block of k) instead of overwriting them */
static void gemm_micro(const float *A, int64_t lda, const float *Bp, int64_t K, float *C, int64_t ldc, int rows, int cols,
                       int accumulate) {
    const float *a[GEMM_MR];
    for (int r = 0; r < GEMM_MR; r++) a[r] = A + (r < rows ? r : rows - 1) * lda;  /* past the rows: not stored */
    __m512 c[GEMM_MR][3];
    for (int r = 0; r < GEMM_MR; r++)
        for (int v = 0; v < 3; v++)
            c[r][v] = accumulate && r < rows ? _mm512_maskz_loadu_ps(gemm_mask(cols, v), C + r * ldc + 16 * v)
                                             : _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++, Bp += GEMM_NR) {
        const __m512 b0 = _mm512_load_ps(Bp), b1 = _mm512_load_ps(Bp + 16), b2 = _mm512_load_ps(Bp + 32);
        for (int r = 0; r < GEMM_MR; r++) {
            const __m512 av = _mm512_set1_ps(a[r][k]);
            c[r][0] = _mm512_fmadd_ps(av, b0, c[r][0]);
            c[r][1] = _mm512_fmadd_ps(av, b1, c[r][1]);
            c[r][2] = _mm512_fmadd_ps(av, b2, c[r][2]);
        }
    }
    if (cols == GEMM_NR) {
        for (int r = 0; r < rows; r++) {
            _mm512_storeu_ps(C + r * ldc, c[r][0]);
            _mm512_storeu_ps(C + r * ldc + 16, c[r][1]);
            _mm512_storeu_ps(C + r * ldc + 32, c[r][2]);
        }
        return;
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < 3; v++) _mm512_mask_storeu_ps(C + r * ldc + 16 * v, gemm_mask(cols, v), c[r][v]);
}
#else
#define LT_GEMM 0
#endif

static int64_t gemm_panels(int64_t n) { return (n + GEMM_NR - 1) / GEMM_NR; }

/* Floats of W's packed form (0: this build has no packed product). */
int64_t lt_pack_wt_floats(int64_t n, int64_t k) { return LT_GEMM ? gemm_panels(n) * GEMM_NR * k : 0; }

typedef struct {
    const float *w;
    int64_t s_n, s_k, n, k;
    float *bp;
} pack_job_t;

static void pack_task(void *arg, int64_t p) {  /* one panel */
    const pack_job_t *j = arg;
    const int64_t k = j->k, s_n = j->s_n, s_k = j->s_k;
    float *panel = j->bp + p * k * GEMM_NR;
    const int64_t r0 = p * GEMM_NR, cols = j->n - r0 < GEMM_NR ? j->n - r0 : GEMM_NR;
    if (s_n == 1) {  /* a panel row is contiguous in w */
        for (int64_t kk = 0; kk < k; kk++) {
            memcpy(panel + kk * GEMM_NR, j->w + r0 + kk * s_k, (size_t)cols * sizeof(float));
            for (int64_t c = cols; c < GEMM_NR; c++) panel[kk * GEMM_NR + c] = 0.f;
        }
        return;
    }
    for (int64_t k0 = 0; k0 < k; k0 += 64) {  /* 64 columns of the panel's rows at a time: stays in L1 */
        const int64_t k1 = k0 + 64 < k ? k0 + 64 : k;
        for (int64_t c = 0; c < GEMM_NR; c++)
            for (int64_t kk = k0; kk < k1; kk++) panel[kk * GEMM_NR + c] = c < cols ? j->w[(r0 + c) * s_n + kk * s_k] : 0.f;
    }
}

/* bp = W [n, k] packed into lt_pack_wt_floats(n, k) floats (64-byte aligned): element (r, kk) of
 * W at w[r * s_n + kk * s_k], so W^T of a row-major matrix packs as well (s_n = 1). Panels over nth
 * threads: a new pack's first write to each page costs more than the copy (a fault), so all cores
 * take their share. */
void lt_pack_wt(const float *w, int64_t s_n, int64_t s_k, int64_t n, int64_t k, float *bp, int nth) {
    pack_job_t job = {w, s_n, s_k, n, k, bp};
    pool_run(pack_task, &job, gemm_panels(n), nth);
}

typedef struct {
    const float *a, *bp;
    float *c;
    int64_t lda, ldc, m, n, k, n_split;
} gemm_job_t;

/* rows [i0, i1) of C, panels [p0, p1) of W^T: each panel (in L1/L2) against every row block */
static void gemm_task(void *arg, int64_t chunk) {
#if LT_GEMM
    const gemm_job_t *j = arg;
    const int64_t mi = chunk / j->n_split, ni = chunk % j->n_split, np_all = gemm_panels(j->n);
    const int64_t i0 = mi * GEMM_MC, i1 = i0 + GEMM_MC < j->m ? i0 + GEMM_MC : j->m;
    const int64_t p0 = np_all * ni / j->n_split, p1 = np_all * (ni + 1) / j->n_split;
    const int64_t panel_floats = j->k * GEMM_NR, n_blocks = (i1 - i0 + GEMM_MR - 1) / GEMM_MR;
    for (int64_t k0 = 0; k0 < j->k; k0 += GEMM_KC) {  /* a long sum in blocks: the panel's block stays in L2 */
        const int64_t kc = j->k - k0 < GEMM_KC ? j->k - k0 : GEMM_KC;
        const int64_t ahead = ((kc * GEMM_NR + n_blocks - 1) / n_blocks + 15) / 16 * 16;  /* floats per row block */
        for (int64_t p = p0; p < p1; p++) {
            const int64_t cols = j->n - p * GEMM_NR < GEMM_NR ? j->n - p * GEMM_NR : GEMM_NR;
            const float *block = j->bp + p * panel_floats + k0 * GEMM_NR;
            const float *next = p + 1 < p1 ? block + panel_floats : NULL;
            for (int64_t r0 = i0, b = 0; r0 < i1; r0 += GEMM_MR, b++) {
                const int64_t rows = i1 - r0 < GEMM_MR ? i1 - r0 : GEMM_MR;
                /* the next panel comes from memory (a training pass meets each weight once) while
                 * this one is multiplied: a share of its lines into L2 per row block */
                if (next)
                    for (int64_t f = b * ahead; f < (b + 1) * ahead && f < kc * GEMM_NR; f += 16)
                        _mm_prefetch((const char *)(next + f), _MM_HINT_T1);
                gemm_micro(j->a + r0 * j->lda + k0, j->lda, block, kc, j->c + r0 * j->ldc + p * GEMM_NR, j->ldc,
                           (int)rows, (int)cols, k0 > 0);
            }
        }
    }
#else
    (void)arg; (void)chunk;
#endif
}

/* c[i, r] = a[i] . W[r] for i < m, r < n, W packed by lt_pack_wt; a rows of lda floats, c rows
 * of ldc floats. Chunks of GEMM_MC rows, split by W's panels until the threads have eight each (a
 * worker that wakes late still takes its share);
 * nth 0: lt_set_gemm_threads's count. Returns 0, or -1 where this build has no packed product. */
static atomic_int gemm_threads = 1;

/* The thread count of a product called with nth = 0 (native/kernels.py follows OpenBLAS's, so a
 * trainer's one-worker-per-core or one-thread steps hold for both). */
void lt_set_gemm_threads(int nth) { atomic_store(&gemm_threads, nth > 0 ? nth : 1); }

int lt_sgemm_packed(const float *a, int64_t lda, int64_t m, const float *bp, int64_t n, int64_t k,
                    float *c, int64_t ldc, int nth) {
    if (!LT_GEMM) return -1;
    if (nth <= 0) nth = atomic_load(&gemm_threads);
    const int64_t n_m = (m + GEMM_MC - 1) / GEMM_MC, want = 8 * (nth > 1 ? nth : 1);
    int64_t n_split = n_m >= want ? 1 : (want + n_m - 1) / n_m;
    if (n_split > gemm_panels(n)) n_split = gemm_panels(n);
    gemm_job_t job = {a, bp, c, lda, ldc, m, n, k, n_split};
    pool_run(gemm_task, &job, n_m * n_split, nth);
    return 0;
}

/* out[i] = x[i] / sqrt(mean(x[i]^2) + eps) for rows of n floats (ggml_compute_forward_rms_norm_f32:
 * the squares summed in double; the division as llmtune's numpy kernel writes it). */
/* The sum of x[i]^2 (each square rounded to float, as ggml's rms_norm) in double: eight running
 * sums a lane each, so the additions do not wait on one another (one chain of 576 dependent double
 * adds was most of a pass's norm), then a fixed tree. The order differs from ggml's one running
 * sum only in the double's last bits, which the float mean rounds away. */
static inline double sum_squares_f64(const float *x, int64_t n) {
    double s[8] = {0, 0, 0, 0, 0, 0, 0, 0}, tail = 0.0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) s[l] += (double)(x[i + l] * x[i + l]);
    for (; i < n; i++) tail += (double)(x[i] * x[i]);
    return (((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]))) + tail;
}

void lt_rms_norm(const float *x, int64_t rows, int64_t n, float eps, float *out) {
    for (int64_t r = 0; r < rows; r++, x += n, out += n) {
        const double sum = sum_squares_f64(x, n);
        const float d = sqrtf((float)(sum / (double)n) + eps);
        for (int64_t i = 0; i < n; i++) out[i] = x[i] / d;
    }
}

/* The end of task c's range when tasks take `per` of n items (rows of a pass, elements). */
static inline int64_t task_end(int64_t c, int64_t per, int64_t n) { return (c + 1) * per < n ? (c + 1) * per : n; }

/* rms_norm over a pass's rows (lt_rms_norm, each row as one call computes it) and its input
 * gradient as numpy's k_rms_norm_back writes it, r = 1 / sqrt(sum(x^2) / n + eps),
 * dx = (g - x (sum(g x) r^2 / n)) r, its sums dot_f32's (a fixed order, so not numpy's bits:
 * within float32 rounding of them); RMS_ROWS rows a task over the pool. */
#define RMS_ROWS 8

typedef struct {
    const float *x, *g;  /* g: the output gradient (NULL: the forward) */
    float *out;
    int64_t rows, n;
    float eps;
} rms_job_t;

static void rms_task(void *arg, int64_t c) {
    const rms_job_t *j = arg;
    const int64_t n = j->n, r0 = c * RMS_ROWS, r1 = task_end(c, RMS_ROWS, j->rows);
    if (!j->g) {
        lt_rms_norm(j->x + r0 * n, r1 - r0, n, j->eps, j->out + r0 * n);
        return;
    }
    for (int64_t row = r0; row < r1; row++) {
        const float *x = j->x + row * n, *g = j->g + row * n;
        float *o = j->out + row * n;
        const float r = 1.0f / sqrtf(dot_f32(x, x, n) / (float)n + j->eps);
        const float gx = dot_f32(g, x, n) * (r * r / (float)n);
        for (int64_t i = 0; i < n; i++) o[i] = (g[i] - x[i] * gx) * r;
    }
}

static void rms_run(rms_job_t job, int nth) {
    if (nth <= 0) nth = atomic_load(&gemm_threads);
    pool_run(rms_task, &job, (job.rows + RMS_ROWS - 1) / RMS_ROWS, nth);
}

void lt_rms_norm_rows(const float *x, int64_t rows, int64_t n, float eps, float *out, int nth) {
    rms_run((rms_job_t){.x = x, .out = out, .rows = rows, .n = n, .eps = eps}, nth);
}

void lt_rms_norm_back(const float *x, const float *g, float *out, int64_t rows, int64_t n, float eps, int nth) {
    rms_run((rms_job_t){.x = x, .g = g, .out = out, .rows = rows, .n = n, .eps = eps}, nth);
}

/* ------------------------------------------------------------------ compiled programs
 * A replayed decode step (graph/planner.py Replay) as one call: lt_run executes a list of steps,
 * each one graph op on fixed buffers (llmtune/native/program.py encodes them), so the ~600
 * kernels of a token cost no Python call each. The products run on the pool as lt_qlinear /
 * lt_f32_linear do; the small ops (norms, rope, attention, activations) on the calling thread.
 * Each op computes what llmtune's numpy kernel (backends/cpu.py) computes, in the same operation
 * order where numpy's is known (elementwise ops, rope, the softmax's pairwise sum), so most are
 * bit for bit numpy's; exp and the attention products' summation order differ by float rounding
 * (tests/test_native.py states the tolerance). */
enum { OP_ADD = 0, OP_MUL = 1, OP_RMS_NORM = 2, OP_QLINEAR = 3, OP_F32_LINEAR = 4, OP_ROPE = 5,
       OP_CACHE_WRITE = 6, OP_MATMUL = 7, OP_SOFTMAX_CAUSAL = 8, OP_SWIGLU = 9, OP_GET_ROWS = 10,
       OP_QGET_ROWS = 11, OP_SCALE = 12 };

typedef struct {
    int64_t op;
    int64_t n[16];
    void *p[6];
    double f[2];
} lt_step;  /* the layout of program.py's Step structure */

/* numpy's pairwise summation of float32 (umath loops: 8 accumulators up to 128 elements, halves
 * above), so a softmax's denominator is numpy's to the bit */
static float pairwise_sum(const float *a, int64_t n) {
    if (n < 8) {
        float res = 0.f;
        for (int64_t i = 0; i < n; i++) res += a[i];
        return res;
    }
    if (n <= 128) {
        float r[8];
        for (int j = 0; j < 8; j++) r[j] = a[j];
        int64_t i;
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++) r[j] += a[i + j];
        float res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += a[i];
        return res;
    }
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise_sum(a, n2) + pairwise_sum(a + n2, n - n2);
}

static float dot_strided8(const float *a, const float *b, int64_t n) {  /* 8 partial sums: vectorizes */
    float s[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) s[l] += a[i + l] * b[i + l];
    float r = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}

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

/* out[i] = exp(x[i] - sub) (in place allowed) */
static void exp_sub(const float *x, float sub, float *out, int64_t n) {
    int64_t i = 0;
#if LT_VEXP
    const __m512 s = _mm512_set1_ps(sub);
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), s)));
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(out + i, m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), s)));
        return;
    }
#endif
    for (; i < n; i++) out[i] = expf(x[i] - sub);
}

/* sigmoid as numpy's kernels compute it: 1 / (1 + exp(-g)) */
static inline float sigmoid1(float g) { return 1.0f / (1.0f + expf(-g)); }
#if LT_VEXP
static inline __m512 sigmoid16(__m512 g) {
    const __m512 one = _mm512_set1_ps(1.0f);
    return _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}
#endif

/* silu(g) u as numpy's kernel: sigmoid(g) g, times u */
static void swiglu(const float *g, const float *u, float *o, int64_t n) {
    int64_t i = 0;
#if LT_VEXP
    for (; i + 16 <= n; i += 16) {
        const __m512 gv = _mm512_loadu_ps(g + i);
        _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_mul_ps(sigmoid16(gv), gv), _mm512_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) o[i] = (sigmoid1(g[i]) * g[i]) * u[i];
}

/* swiglu's gradients as numpy's k_swiglu_back writes them, s = sigmoid(gate):
 * wrt 1 (up): (s gate) dy; wrt 0 (gate): (((1 - s) gate + 1) s) up dy. */
static void swiglu_back(const float *g, const float *u, const float *dy, float *o, int64_t n, int wrt) {
    int64_t i = 0;
#if LT_VEXP
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
        const __m512 gv = _mm512_loadu_ps(g + i), sg = sigmoid16(gv);
        const __m512 r = wrt == 1 ? _mm512_mul_ps(sg, gv)
                                  : _mm512_mul_ps(_mm512_mul_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(one, sg), gv), one), sg),
                                                  _mm512_loadu_ps(u + i));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(r, _mm512_loadu_ps(dy + i)));
    }
#endif
    for (; i < n; i++) {
        const float sg = sigmoid1(g[i]);
        o[i] = (wrt == 1 ? sg * g[i] : (((1.0f - sg) * g[i] + 1.0f) * sg) * u[i]) * dy[i];
    }
}

/* Training's swiglu passes (arrays of any size) over the pool, in chunks of EW_CHUNK elements: a
 * multiple of the 16 lanes, so every element takes the path it takes in one call and the thread
 * count moves no bit. (A pooled add measured slower in a step than numpy's on one core: memory
 * bound, its operands in the other core's cache half the time.) */
#define EW_CHUNK 8192
enum { EW_SWIGLU, EW_SWIGLU_BACK };

typedef struct {
    const float *a, *b, *c;
    float *o;
    int64_t n;
    int kind, wrt;
} ew_job_t;

static void ew_task(void *arg, int64_t chunk) {
    const ew_job_t *j = arg;
    const int64_t i0 = chunk * EW_CHUNK, n = task_end(chunk, EW_CHUNK, j->n) - i0;
    if (j->kind == EW_SWIGLU)
        swiglu(j->a + i0, j->b + i0, j->o + i0, n);
    else
        swiglu_back(j->a + i0, j->b + i0, j->c + i0, j->o + i0, n, j->wrt);
}

static void ew_run(ew_job_t job, int nth) {
    if (nth <= 0) nth = atomic_load(&gemm_threads);
    pool_run(ew_task, &job, (job.n + EW_CHUNK - 1) / EW_CHUNK, nth);
}

/* training's swiglu (the same kernel as a decode step's) */
void lt_swiglu(const float *g, const float *u, float *o, int64_t n, int nth) {
    ew_run((ew_job_t){.a = g, .b = u, .o = o, .n = n, .kind = EW_SWIGLU}, nth);
}

void lt_swiglu_back(const float *g, const float *u, const float *dy, float *o, int64_t n, int wrt, int nth) {
    ew_run((ew_job_t){.a = g, .b = u, .c = dy, .o = o, .n = n, .kind = EW_SWIGLU_BACK, .wrt = wrt}, nth);
}

/* The loss over the vocabulary, rows of logits x [rows, n]: the row logsumexp max + log(sum(exp(x -
 * max))) and the logits' gradient of the cross-entropy or per-token nll, (exp(x - lse) -
 * onehot(target)) w with w the row's weight (0 on a row whose target is negative), as numpy's
 * k_logsumexp, k_cross_entropy_back and k_token_nll_back write them, one pass a row over the pool
 * (LOSS_ROWS rows a task): a training step's 49,152-wide rows took numpy three to four passes
 * each. The exp is the vector one (within ~1 ulp of numpy's), the sum in double lanes in a fixed
 * order, so every value is within float32 rounding of numpy's and the same on any thread count. */
#define LOSS_ROWS 4

typedef struct {
    const float *x, *lse, *w;
    const int32_t *t;
    float *out;
    int64_t rows, n;
    float w_all;
} loss_job_t;

static float loss_row_max(const float *x, int64_t n) {
    int64_t i = 0;
    float m = -INFINITY;
#if LT_VEXP
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= n; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(x + i));
    m = _mm512_reduce_max_ps(mv);
#endif
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* sum(exp(x - sub)) in double lanes (perplexity.cpp sums its floats' exps in a double too): a
 * 49,152-wide row summed in float32 lanes drifted by a few 1e-7 of the total, one way. */
static double loss_row_sum_exp(const float *x, float sub, int64_t n) {
    int64_t i = 0;
    double sum = 0.0;
#if LT_VEXP
    const __m512 s = _mm512_set1_ps(sub);
    __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd(), acc2 = _mm512_setzero_pd(), acc3 = _mm512_setzero_pd();
    for (; i + 32 <= n; i += 32) {
        const __m512 e0 = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), s));
        const __m512 e1 = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i + 16), s));
        acc0 = _mm512_add_pd(acc0, _mm512_cvtps_pd(_mm512_castps512_ps256(e0)));
        acc1 = _mm512_add_pd(acc1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e0), 1))));
        acc2 = _mm512_add_pd(acc2, _mm512_cvtps_pd(_mm512_castps512_ps256(e1)));
        acc3 = _mm512_add_pd(acc3, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e1), 1))));
    }
    sum = _mm512_reduce_add_pd(_mm512_add_pd(_mm512_add_pd(acc0, acc1), _mm512_add_pd(acc2, acc3)));
#endif
    for (; i < n; i++) sum += (double)expf(x[i] - sub);
    return sum;
}

static void lse_task(void *arg, int64_t c) {
    const loss_job_t *j = arg;
    const int64_t r1 = task_end(c, LOSS_ROWS, j->rows);
    for (int64_t r = c * LOSS_ROWS; r < r1; r++) {
        const float *x = j->x + r * j->n, m = loss_row_max(x, j->n);
        j->out[r] = (float)(log(loss_row_sum_exp(x, m, j->n)) + (double)m);
    }
}

static void loss_back_task(void *arg, int64_t c) {
    const loss_job_t *j = arg;
    const int64_t r1 = task_end(c, LOSS_ROWS, j->rows), n = j->n;
    for (int64_t r = c * LOSS_ROWS; r < r1; r++) {
        const float *x = j->x + r * n;
        float *o = j->out + r * n;
        const int64_t t = j->t[r];
        if (t < 0) {
            memset(o, 0, (size_t)n * sizeof(float));
            continue;
        }
        const float lse = j->lse[r], w = j->w ? j->w[r] : j->w_all;
        int64_t i = 0;
#if LT_VEXP
        const __m512 lv = _mm512_set1_ps(lse), wv = _mm512_set1_ps(w), one = _mm512_set1_ps(1.0f);
        for (; i + 16 <= n; i += 16) {
            __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), lv));
            if (t >= i && t < i + 16) e = _mm512_mask_sub_ps(e, (__mmask16)(1u << (t - i)), e, one);
            _mm512_storeu_ps(o + i, _mm512_mul_ps(e, wv));
        }
#endif
        for (; i < n; i++) o[i] = (i == t ? expf(x[i] - lse) - 1.0f : expf(x[i] - lse)) * w;
    }
}

/* lse[r] = the logsumexp of row r of x [rows, n] */
void lt_logsumexp(const float *x, int64_t rows, int64_t n, float *lse, int nth) {
    if (nth <= 0) nth = atomic_load(&gemm_threads);
    loss_job_t job = {.x = x, .out = lse, .rows = rows, .n = n};
    pool_run(lse_task, &job, (rows + LOSS_ROWS - 1) / LOSS_ROWS, nth);
}

/* out = (exp(x - lse) - onehot(t)) w per row (w: per row, or NULL and w_all), 0 where t < 0; out may be x */
void lt_loss_back(const float *x, const float *lse, const int32_t *t, const float *w, float w_all, float *out,
                  int64_t rows, int64_t n, int nth) {
    if (nth <= 0) nth = atomic_load(&gemm_threads);
    loss_job_t job = {.x = x, .lse = lse, .w = w, .t = t, .out = out, .rows = rows, .n = n, .w_all = w_all};
    pool_run(loss_back_task, &job, (rows + LOSS_ROWS - 1) / LOSS_ROWS, nth);
}

static void op_rope(const lt_step *s) {
    const float *x = s->p[0];
    const int32_t *pos = s->p[1];
    float *out = s->p[2];
    const double *inv_freq = s->p[3];
    const int64_t B = s->n[0], T = s->n[1], H = s->n[2], d = s->n[3], n_rot = s->n[4], neox = s->n[5];
    const int inverse = (int)s->n[6];
    const double freq_scale = s->f[0];
    const int64_t half = n_rot / 2;
    float cs[512], sn[512];  /* n_rot <= 1024 (program.py checks) */
    for (int64_t t = 0; t < T; t++) {
        const double p = freq_scale * (double)pos[t];
        for (int64_t i = 0; i < half; i++) {
            const double theta = p * inv_freq[i];
            cs[i] = (float)cos(theta);
            sn[i] = inverse ? -(float)sin(theta) : (float)sin(theta);
        }
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t off = ((b * T + t) * H + h) * d;
                const float *xr = x + off;
                float *o = out + off;
                for (int64_t i = 0; i < half; i++) {
                    const int64_t i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
                    const float x0 = xr[i0], x1 = xr[i1];
                    o[i0] = x0 * cs[i] - x1 * sn[i];
                    o[i1] = x1 * cs[i] + x0 * sn[i];
                }
                for (int64_t i = n_rot; i < d; i++) o[i] = xr[i];
            }
    }
}

static int op_cache_write(const lt_step *s) {
    float *cache = s->p[0];
    const float *x = s->p[1];
    const int32_t *pos = s->p[2];
    const int64_t B = s->n[0], H = s->n[1], N = s->n[2], d = s->n[3], T = s->n[4];
    for (int64_t t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= N) return -1;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++)
                memcpy(cache + ((b * H + h) * N + pos[t]) * d, x + ((b * T + t) * H + h) * d, (size_t)d * 4);
    return 0;
}

/* out[b0, b1, i, j] = sum_k a[b0, b1, i, k] b[b0, b1, k, j] (element strides; out contiguous) */
static void op_matmul(const lt_step *s) {
    const float *a = s->p[0], *b = s->p[1];
    float *out = s->p[2];
    const int64_t B0 = s->n[0], B1 = s->n[1], M = s->n[2], N = s->n[3], K = s->n[4];
    const int64_t sa0 = s->n[5], sa1 = s->n[6], sam = s->n[7], sak = s->n[8];
    const int64_t sb0 = s->n[9], sb1 = s->n[10], sbk = s->n[11], sbn = s->n[12];
    for (int64_t i0 = 0; i0 < B0; i0++)
        for (int64_t i1 = 0; i1 < B1; i1++) {
            const float *A = a + i0 * sa0 + i1 * sa1, *Bm = b + i0 * sb0 + i1 * sb1;
            float *O = out + (i0 * B1 + i1) * M * N;
            if (sak == 1 && sbk == 1) {  /* rows against rows (q k^T) */
                for (int64_t i = 0; i < M; i++) {
                    int64_t j0 = 0, j1 = N;
                    if (s->p[3]) {  /* scores only a causal softmax reads: its visible keys only */
                        const int64_t qp = ((const int32_t *)s->p[3])[i % s->n[14]];
                        j1 = qp + 1 < N ? qp + 1 : N;
                        if (s->n[15] > 0 && qp - s->n[15] + 1 > 0) j0 = qp - s->n[15] + 1;
                    }
                    for (int64_t j = j0; j < j1; j++) O[i * N + j] = dot_strided8(A + i * sam, Bm + j * sbn, K);
                }
            } else if (sbn == 1) {  /* rows of b scaled and summed (p v) */
                for (int64_t i = 0; i < M; i++) {
                    float *o = O + i * N;
                    int64_t k0 = 0, k1 = K;
                    if (s->p[3]) {  /* probabilities of a causal softmax: its visible keys only */
                        const int64_t qp = ((const int32_t *)s->p[3])[i % s->n[14]];
                        k1 = qp + 1 < K ? (qp + 1 > 0 ? qp + 1 : 0) : K;
                        if (s->n[15] > 0 && qp - s->n[15] + 1 > 0) k0 = qp - s->n[15] + 1 < k1 ? qp - s->n[15] + 1 : k1;
                    }
                    for (int64_t j = 0; j < N; j++) o[j] = 0.f;
                    for (int64_t k = k0; k < k1; k++) {
                        const float av = A[i * sam + k * sak];
                        if (av == 0.f) continue;  /* a masked probability: adds nothing */
                        const float *br = Bm + k * sbk;
                        for (int64_t j = 0; j < N; j++) o[j] += av * br[j];
                    }
                }
            } else {
                for (int64_t i = 0; i < M; i++)
                    for (int64_t j = 0; j < N; j++) {
                        float acc = 0.f;
                        for (int64_t k = 0; k < K; k++) acc += A[i * sam + k * sak] * Bm[k * sbk + j * sbn];
                        O[i * N + j] = acc;
                    }
            }
        }
}

/* softmax(scale x + causal mask) per row, numpy's order over the visible keys: scaled, max
 * subtracted, exp, divided by numpy's pairwise sum of them (numpy sums the masked zeros too: the
 * same value, grouped differently past 8 keys) */
static void op_softmax_causal(const lt_step *s) {
    const float *x = s->p[0];
    const int32_t *pos = s->p[1];
    float *out = s->p[2];
    const int64_t lead = s->n[0], rows = s->n[1], n_kv = s->n[2], n_q = s->n[3], n_past = s->n[4], window = s->n[5];
    const float scale = (float)s->f[0];
    for (int64_t l = 0; l < lead; l++)
        for (int64_t r = 0; r < rows; r++) {
            const float *xr = x + (l * rows + r) * n_kv;
            float *o = out + (l * rows + r) * n_kv;
            const int64_t qp = pos ? pos[r % n_q] : n_past + r % n_q;
            /* visible keys k0 <= k < k1; the masked ones are exactly 0 (not read: exp(-inf) for any
             * finite score) */
            const int64_t k1 = qp + 1 < n_kv ? (qp + 1 > 0 ? qp + 1 : 0) : n_kv;
            const int64_t k0 = window > 0 && qp - window + 1 > 0 ? (qp - window + 1 < k1 ? qp - window + 1 : k1) : 0;
            float mx = -INFINITY;
            for (int64_t k = k0; k < k1; k++) {
                o[k] = xr[k] * scale + 0.f;
                mx = fmaxf(mx, o[k]);
            }
            exp_sub(o + k0, mx, o + k0, k1 - k0);
            if (!s->n[6]) {  /* (n[6]: the one reader sums the visible keys only) */
                for (int64_t k = 0; k < k0; k++) o[k] = 0.f;
                for (int64_t k = k1; k < n_kv; k++) o[k] = 0.f;
            }
            const float sum = pairwise_sum(o + k0, k1 - k0);
            for (int64_t k = k0; k < k1; k++) o[k] /= sum;
        }
}

static int op_qget_rows(const lt_step *s) {
    const uint8_t *w = s->p[0];
    const int32_t *ids = s->p[1];
    float *out = s->p[2];
    const int64_t n_ids = s->n[0], n = s->n[1], stride = s->n[2], n_rows = s->n[3], type = s->n[4];
    for (int64_t r = 0; r < n_ids; r++) {
        if (ids[r] < 0 || ids[r] >= n_rows) return -1;
        const uint8_t *b = w + ids[r] * stride;
        float *o = out + r * n;
        for (int64_t i = 0; i < n / QK; i++, o += QK) {
            if (type == 0) {  /* Q8_0: q d */
                const float d = h2f(b);
                for (int j = 0; j < QK; j++) o[j] = (float)((const int8_t *)(b + 2))[j] * d;
                b += 34;
            } else if (type == 1) {  /* Q4_0: (q - 8) d */
                const float d = h2f(b);
                for (int j = 0; j < QK / 2; j++) {
                    o[j] = ((float)(b[2 + j] & 15) - 8.f) * d;
                    o[j + QK / 2] = ((float)(b[2 + j] >> 4) - 8.f) * d;
                }
                b += 18;
            } else {  /* Q4_1: q d + m */
                const float d = h2f(b), m = h2f(b + 2);
                for (int j = 0; j < QK / 2; j++) {
                    o[j] = (float)(b[4 + j] & 15) * d + m;
                    o[j + QK / 2] = (float)(b[4 + j] >> 4) * d + m;
                }
                b += 20;
            }
        }
    }
    return 0;
}

static int prof_on = 0;
static int64_t prof_ns[16], prof_calls[16];

/* Per-op timers of lt_run (off by default): on != 0 switches them on and clears them; `out` (if
 * not NULL) receives the nanoseconds and calls per op code so far, 16 of each. */
void lt_profile(int on, int64_t *out) {
    if (out) {
        memcpy(out, prof_ns, sizeof(prof_ns));
        memcpy(out + 16, prof_calls, sizeof(prof_calls));
    }
    if (on) {
        memset(prof_ns, 0, sizeof(prof_ns));
        memset(prof_calls, 0, sizeof(prof_calls));
    }
    prof_on = on;
}

static int64_t run_step(const lt_step *s, int nth);

/* Runs steps[0 .. n_steps) in order. Returns -1 when every step ran, else the index of the step
 * that failed (a position or row id out of range, a bad type). */
int64_t lt_run(const lt_step *steps, int64_t n_steps, int nth) {
    for (int64_t k = 0; k < n_steps; k++) {
        const int64_t t0 = prof_on ? now_ns() : 0;
        if (run_step(&steps[k], nth)) return k;
        if (prof_on && steps[k].op >= 0 && steps[k].op < 16) {
            prof_ns[steps[k].op] += now_ns() - t0;
            prof_calls[steps[k].op]++;
        }
    }
    return -1;
}

/* One step; nonzero when it failed. */
static int64_t run_step(const lt_step *s, int nth) {
    {
        switch (s->op) {
            case OP_ADD: case OP_MUL: {
                const float *a = s->p[0], *b = s->p[1];
                float *o = s->p[2];
                /* n[0] elements as rows of n[1]; n[2]: b is one row repeated (else b is as a) */
                const int64_t n = s->n[0], nr = s->n[1], bcast = s->n[2];
                for (int64_t i0 = 0; i0 < n; i0 += nr) {
                    const float *br = bcast ? b : b + i0;
                    if (s->op == OP_ADD) for (int64_t j = 0; j < nr; j++) o[i0 + j] = a[i0 + j] + br[j];
                    else for (int64_t j = 0; j < nr; j++) o[i0 + j] = a[i0 + j] * br[j];
                }
                break;
            }
            case OP_SCALE: {
                const float *a = s->p[0];
                float *o = s->p[2];
                const float f = (float)s->f[0];
                for (int64_t i = 0; i < s->n[0]; i++) o[i] = a[i] * f;
                break;
            }
            case OP_RMS_NORM: lt_rms_norm(s->p[0], s->n[0], s->n[1], (float)s->f[0], s->p[2]); break;
            case OP_QLINEAR:  /* p[3]: the packed copy, where there is one */
                if (s->p[3] ? lt_qlinear_packed((int)s->n[0], s->p[3], s->p[1], s->n[1], s->n[2], s->n[3], s->p[0],
                                                s->n[4], s->p[2], s->n[5], nth)
                            : lt_qlinear((int)s->n[0], s->p[1], s->n[1], s->n[2], s->n[3], s->p[0], s->n[4], s->p[2],
                                         s->n[5], nth))
                    return 1;
                break;
            case OP_F32_LINEAR: lt_f32_linear(s->p[1], s->n[1], s->n[2], s->n[3], s->p[0], s->n[4], s->p[2], s->n[5], nth); break;
            case OP_ROPE: op_rope(s); break;
            case OP_CACHE_WRITE: if (op_cache_write(s)) return 1; break;
            case OP_MATMUL: op_matmul(s); break;
            case OP_SOFTMAX_CAUSAL: op_softmax_causal(s); break;
            case OP_SWIGLU: {
                swiglu(s->p[0], s->p[1], s->p[2], s->n[0]);
                break;
            }
            case OP_GET_ROWS: {
                const float *w = s->p[0];
                const int32_t *ids = s->p[1];
                float *o = s->p[2];
                for (int64_t r = 0; r < s->n[0]; r++) {
                    if (ids[r] < 0 || ids[r] >= s->n[3]) return 1;
                    memcpy(o + r * s->n[1], w + ids[r] * s->n[2], (size_t)s->n[1] * 4);
                }
                break;
            }
            case OP_QGET_ROWS: if (op_qget_rows(s)) return 1; break;
            default: return 1;
        }
    }
    return 0;
}

int64_t lt_step_size(void) { return (int64_t)sizeof(lt_step); }

/* ------------------------------------------------------------------ rope
 * Norm-mode rope of float32 pairs over x [B, T, H, d] with tables cos2, sin2 [T, d] (each pair's
 * cos twice; -sin, sin): out = x * cos2 + swap(x) * sin2, the products and the sum each rounded as
 * backends/cpu.py _rope_pairs rounds them, so every value is numpy's, bit for bit. Rows (b, t) over
 * the pool (nth 0: the compiled count). */
typedef struct {
    const float *x, *cos2, *sin2;
    float *out;
    int64_t T, H, d;
} rope_job_t;

static void rope_task(void *arg, int64_t row) {
    const rope_job_t *j = arg;
    const int64_t t = row % j->T, n = j->H * j->d;
    const float *x = j->x + row * n, *c2 = j->cos2 + t * j->d, *s2 = j->sin2 + t * j->d;
    float *o = j->out + row * n;
    for (int64_t h = 0; h < j->H; h++, x += j->d, o += j->d) {
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= j->d; i += 16) {
            const __m512 xv = _mm512_loadu_ps(x + i), sw = _mm512_permute_ps(xv, 0xB1);  /* (x1, x0) per pair */
            _mm512_storeu_ps(o + i, _mm512_add_ps(_mm512_mul_ps(xv, _mm512_loadu_ps(c2 + i)),
                                                  _mm512_mul_ps(sw, _mm512_loadu_ps(s2 + i))));
        }
#endif
        for (; i < j->d; i += 2) {
            const float x0 = x[i], x1 = x[i + 1];
            o[i] = x0 * c2[i] + x1 * s2[i];
            o[i + 1] = x1 * c2[i + 1] + x0 * s2[i + 1];
        }
    }
}

void lt_rope_pairs(const float *x, const float *cos2, const float *sin2, float *out, int64_t B, int64_t T, int64_t H,
                   int64_t d, int nth) {
    if (nth <= 0) nth = atomic_load(&gemm_threads);
    rope_job_t job = {x, cos2, sin2, out, T, H, d};
    pool_run(rope_task, &job, B * T, nth);
}

/* ------------------------------------------------------------------ adapter terms (ops.lora)
 * y + ((s x A^T) B^T) and its gradients for x [M, n_in], A [r, n_in], B [n_out, r]: every product
 * has the rank r on one side, so each is a few multiply-adds per element streamed, and numpy's
 * six calls (plus a scale and an add) cost more in calls than in arithmetic. Vectors always run
 * along the long side (n_in, n_out), never along the rank, so rank 8 wastes no lane. Each output
 * is one task's sum in a fixed order (lanes over ascending blocks, then the lanes in a fixed
 * tree, then the tail), so the thread count moves no bit; backends/cpu.py k_lora and k_lora_back
 * are the reference (OpenBLAS sums in its own order: agreement within float32 rounding). */
#define LR_LANES 16
#define LR_MAX_RANK 128
#define LR_ROWS 8      /* rows of x per task */
#define LR_GROUP 4     /* rank values summed at once (independent chains) */
#define LR_BLOCKS 4    /* output vectors at a time (independent chains) */
#define LR_DOT_ROWS 4  /* rows sharing each loaded vector of A (B^T) in a rank-r product */
#define LR_COMBINE_ROWS 4  /* rows sharing each loaded vector in a product back to n columns */
#define LR_COLS (LR_BLOCKS * LR_LANES)
#define LR_OUTER_J 8   /* rank values of dA / dB^T summed at once */
#define LR_OUTER_V 2   /* vectors of their columns summed at once */
#define LR_OUTER_COLS (LR_OUTER_V * LR_LANES)  /* columns of dA / dB^T per task */

/* LR_LANES floats: one zmm where AVX-512 is built (fused multiply-adds, as OpenBLAS's products:
 * the reference's order is not kept anyway, and a multiply-add a cycle halves a rank-8 term's
 * time), else an array the compiler may vectorize */
#if defined(__AVX512F__)
typedef __m512 lr_vec;
static inline lr_vec lr_zero(void) { return _mm512_setzero_ps(); }
static inline lr_vec lr_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void lr_store(float *p, lr_vec v) { _mm512_storeu_ps(p, v); }
static inline lr_vec lr_add(lr_vec a, lr_vec b) { return _mm512_add_ps(a, b); }
static inline lr_vec lr_axpy(lr_vec acc, float x, lr_vec w) { return _mm512_fmadd_ps(_mm512_set1_ps(x), w, acc); }
static inline lr_vec lr_fma(lr_vec acc, lr_vec x, lr_vec w) { return _mm512_fmadd_ps(x, w, acc); }
#else
typedef struct { float v[LR_LANES]; } lr_vec;
static inline lr_vec lr_zero(void) { lr_vec z = {{0}}; return z; }
static inline lr_vec lr_load(const float *p) { lr_vec r; memcpy(r.v, p, sizeof(r.v)); return r; }
static inline void lr_store(float *p, lr_vec v) { memcpy(p, v.v, sizeof(v.v)); }
static inline lr_vec lr_add(lr_vec a, lr_vec b) {
    for (int l = 0; l < LR_LANES; l++) a.v[l] += b.v[l];
    return a;
}
static inline lr_vec lr_axpy(lr_vec acc, float x, lr_vec w) {
    for (int l = 0; l < LR_LANES; l++) acc.v[l] += x * w.v[l];
    return acc;
}
static inline lr_vec lr_fma(lr_vec acc, lr_vec x, lr_vec w) {
    for (int l = 0; l < LR_LANES; l++) acc.v[l] += x.v[l] * w.v[l];
    return acc;
}
#endif

/* the lanes' sum in a fixed tree: halves added pairwise (lane i + lane i + 8, then + 4, + 2, + 1) */
static inline float lr_sum(lr_vec v) {
#if defined(__AVX512F__)
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
#else
    float l[LR_LANES];
    lr_store(l, v);
    for (int w = LR_LANES / 2; w > 0; w /= 2)
        for (int i = 0; i < w; i++) l[i] += l[i + w];
    return l[0];
#endif
}

/* out[i * ld_out + q] = s * sum over k of v[i * ld_v + k] w[q, k] for rows i < nr of v and q < ng
 * (w rows n apart): the vector lanes over ascending blocks, then lr_sum, then the tail. Each
 * loaded vector of w serves nr rows; inlined with constant nr and ng so the sums stay in registers. */
static inline __attribute__((always_inline)) void lr_dots_n(const float *v, int64_t ld_v, const float *w, int64_t n,
                                                            float s, float *out, int64_t ld_out, const int nr,
                                                            const int ng) {
    const int64_t nv = n / LR_LANES * LR_LANES;
    lr_vec acc[LR_DOT_ROWS][LR_GROUP];
    for (int i = 0; i < nr; i++)
        for (int q = 0; q < ng; q++) acc[i][q] = lr_zero();
    for (int64_t k = 0; k < nv; k += LR_LANES) {
        lr_vec vk[LR_DOT_ROWS];
        for (int i = 0; i < nr; i++) vk[i] = lr_load(v + i * ld_v + k);
        for (int q = 0; q < ng; q++) {
            const lr_vec wq = lr_load(w + q * n + k);
            for (int i = 0; i < nr; i++) acc[i][q] = lr_fma(acc[i][q], vk[i], wq);
        }
    }
    for (int i = 0; i < nr; i++)
        for (int q = 0; q < ng; q++) {
            float tail = 0;
            for (int64_t k = nv; k < n; k++) tail += v[i * ld_v + k] * w[q * n + k];
            out[i * ld_out + q] = (lr_sum(acc[i][q]) + tail) * s;
        }
}

/* out[i, j] = s * sum over k of v[i, k] w[j, k] for rows i < nr of v (nr <= LR_DOT_ROWS; v rows n
 * apart, out rows r apart) and j < r (w [r, n] row-major) */
static void lr_dots(const float *v, int nr, const float *w, int64_t r, int64_t n, float s, float *out) {
    for (int64_t j0 = 0; j0 < r; j0 += LR_GROUP) {
        const int ng = r - j0 < LR_GROUP ? (int)(r - j0) : LR_GROUP;
        if (nr == LR_DOT_ROWS && ng == LR_GROUP)
            lr_dots_n(v, n, w + j0 * n, n, s, out + j0, r, LR_DOT_ROWS, LR_GROUP);
        else
            for (int i = 0; i < nr; i++) lr_dots_n(v + i * n, n, w + j0 * n, n, s, out + i * r + j0, r, 1, ng);
    }
}

/* out[i, i0 + ...] for rows i < nr and n_blocks vectors: (base ? base : 0) + sum over j ascending
 * of c[i, j] w[j, :] (c rows r apart, w [r, n] row-major, base and out rows n apart); each loaded
 * vector of w serves nr rows; inlined with constants so the sums stay in registers */
static inline __attribute__((always_inline)) void lr_combine_n(const float *c, const float *w, int64_t r, int64_t n,
                                                               const float *base, float *out, int64_t i0,
                                                               const int nr, const int n_blocks) {
    lr_vec acc[LR_COMBINE_ROWS][LR_BLOCKS];
    for (int i = 0; i < nr; i++)
        for (int q = 0; q < n_blocks; q++) acc[i][q] = lr_zero();
    for (int64_t j = 0; j < r; j++)
        for (int q = 0; q < n_blocks; q++) {
            const lr_vec wq = lr_load(w + j * n + i0 + q * LR_LANES);
            for (int i = 0; i < nr; i++) acc[i][q] = lr_axpy(acc[i][q], c[i * r + j], wq);
        }
    for (int i = 0; i < nr; i++)
        for (int q = 0; q < n_blocks; q++) {
            const int64_t o = i * n + i0 + q * LR_LANES;
            lr_store(out + o, base ? lr_add(lr_load(base + o), acc[i][q]) : acc[i][q]);
        }
}

/* out[i, :] = (base ? base[i, :] : 0) + sum over j ascending of c[i, j] w[j, :] for rows i < nr */
static void lr_combine(const float *c, int nr, const float *w, int64_t r, int64_t n, const float *base, float *out) {
    int64_t i0 = 0;
    for (; i0 + LR_COLS <= n; i0 += LR_COLS) {
        if (nr == LR_COMBINE_ROWS)
            lr_combine_n(c, w, r, n, base, out, i0, LR_COMBINE_ROWS, LR_BLOCKS);
        else
            for (int i = 0; i < nr; i++)
                lr_combine_n(c + i * r, w, r, n, base ? base + i * n : NULL, out + i * n, i0, 1, LR_BLOCKS);
    }
    if (i0 + LR_LANES <= n) {
        const int nb = (int)((n - i0) / LR_LANES);
        for (int i = 0; i < nr; i++) lr_combine_n(c + i * r, w, r, n, base ? base + i * n : NULL, out + i * n, i0, 1, nb);
        i0 += nb * LR_LANES;
    }
    for (int i = 0; i < nr; i++)
        for (int64_t k = i0; k < n; k++) {
            float acc = 0;
            for (int64_t j = 0; j < r; j++) acc += c[i * r + j] * w[j * n + k];
            out[i * n + k] = base ? base[i * n + k] + acc : acc;
        }
}

/* acc[j0 + jj][q * LR_LANES ...] for jj < nj <= LR_OUTER_J, q < nb <= LR_OUTER_V: sums over m
 * ascending of c[m, j] v[m, k0 + ...], one pass over v's rows; inlined with constants so the
 * sums stay in registers */
static inline __attribute__((always_inline)) void lr_outer_n(const float *c, const float *v, int64_t M, int64_t r,
                                                             int64_t n, int64_t k0, int64_t j0, const int nj,
                                                             const int nb, float acc[][LR_OUTER_COLS]) {
    lr_vec s[LR_OUTER_J][LR_OUTER_V];
    for (int jj = 0; jj < nj; jj++)
        for (int q = 0; q < nb; q++) s[jj][q] = lr_zero();
    for (int64_t m = 0; m < M; m++) {
        const float *vm = v + m * n + k0, *cm = c + m * r + j0;
        lr_vec vq[LR_OUTER_V];
        for (int q = 0; q < nb; q++) vq[q] = lr_load(vm + q * LR_LANES);
        for (int jj = 0; jj < nj; jj++)
            for (int q = 0; q < nb; q++) s[jj][q] = lr_axpy(s[jj][q], cm[jj], vq[q]);
    }
    for (int jj = 0; jj < nj; jj++)
        for (int q = 0; q < nb; q++) lr_store(acc[j0 + jj] + q * LR_LANES, s[jj][q]);
}

/* acc[j][i] = sum over m ascending of c[m, j] v[m, k0 + i] for j < r, i < kn <= LR_OUTER_COLS
 * (c [M, r], v [M, n]): the columns of dA (c = u, v = x) or of dB^T (c = t, v = g) */
static void lr_outer_cols(const float *c, const float *v, int64_t M, int64_t r, int64_t n, int64_t k0, int64_t kn,
                          float acc[][LR_OUTER_COLS]) {
    const int nb = (int)(kn / LR_LANES);
    for (int64_t j0 = 0; j0 < r; j0 += LR_OUTER_J) {
        const int nj = r - j0 < LR_OUTER_J ? (int)(r - j0) : LR_OUTER_J;
        if (nj == LR_OUTER_J && nb == LR_OUTER_V)
            lr_outer_n(c, v, M, r, n, k0, j0, LR_OUTER_J, LR_OUTER_V, acc);
        else if (nb > 0)
            lr_outer_n(c, v, M, r, n, k0, j0, nj, nb, acc);
    }
    for (int64_t i = (int64_t)nb * LR_LANES; i < kn; i++)  /* columns past the last whole vector */
        for (int64_t j = 0; j < r; j++) {
            float sum = 0;
            for (int64_t m = 0; m < M; m++) sum += c[m * r + j] * v[m * n + k0 + i];
            acc[j][i] = sum;
        }
}

typedef struct {
    const float *x, *a, *bT, *g, *y;
    float *out, *t, *u, *dx, *da, *db;
    int64_t M, n_in, n_out, r, n_col_tasks;
    float s;
} lora_job_t;

/* B^T [r, n_out] (rows of n_out, the vectors' side), or NULL */
static float *lr_transpose_b(const float *b, int64_t n_out, int64_t r) {
    float *bT = malloc((size_t)(r * n_out) * sizeof(float));
    if (bT)
        for (int64_t n = 0; n < n_out; n++)
            for (int64_t k = 0; k < r; k++) bT[k * n_out + n] = b[n * r + k];
    return bT;
}

static void lora_fwd_task(void *arg, int64_t c) {
    const lora_job_t *j = arg;
    float t[LR_ROWS * LR_MAX_RANK];
    for (int64_t m0 = c * LR_ROWS, m1 = task_end(c, LR_ROWS, j->M); m0 < m1; m0 += LR_COMBINE_ROWS) {
        const int nr = m1 - m0 < LR_COMBINE_ROWS ? (int)(m1 - m0) : LR_COMBINE_ROWS;
        for (int i = 0; i < nr; i += LR_DOT_ROWS)
            lr_dots(j->x + (m0 + i) * j->n_in, nr - i < LR_DOT_ROWS ? nr - i : LR_DOT_ROWS, j->a, j->r, j->n_in, j->s,
                    t + i * j->r);
        lr_combine(t, nr, j->bT, j->r, j->n_out, j->y + m0 * j->n_out, j->out + m0 * j->n_out);
    }
}

/* out = y + ((s x A^T) B^T); out may be y. Returns 0, or -1 (nothing written) for a rank over
 * LR_MAX_RANK or an allocation failure. */
int lt_lora(const float *y, const float *x, const float *a, const float *b, float *out, int64_t M, int64_t n_in,
            int64_t n_out, int64_t r, float s, int nth) {
    if (r < 1 || r > LR_MAX_RANK) return -1;
    if (nth <= 0) nth = atomic_load(&gemm_threads);
    float *bT = lr_transpose_b(b, n_out, r);
    if (!bT) return -1;
    lora_job_t job = {.x = x, .a = a, .bT = bT, .y = y, .out = out, .M = M, .n_in = n_in, .n_out = n_out, .r = r,
                      .s = s};
    pool_run(lora_fwd_task, &job, (M + LR_ROWS - 1) / LR_ROWS, nth);
    free(bT);
    return 0;
}

/* rows of x: u = s (g B), t = s (x A^T) (kept for dA, dB), dx = u A */
static void lora_rows_task(void *arg, int64_t c) {
    const lora_job_t *j = arg;
    for (int64_t m0 = c * LR_ROWS, m1 = task_end(c, LR_ROWS, j->M); m0 < m1; m0 += LR_COMBINE_ROWS) {
        const int nr = m1 - m0 < LR_COMBINE_ROWS ? (int)(m1 - m0) : LR_COMBINE_ROWS;
        for (int i = 0; i < nr; i += LR_DOT_ROWS) {
            const int n2 = nr - i < LR_DOT_ROWS ? nr - i : LR_DOT_ROWS;
            lr_dots(j->g + (m0 + i) * j->n_out, n2, j->bT, j->r, j->n_out, j->s, j->u + (m0 + i) * j->r);
            lr_dots(j->x + (m0 + i) * j->n_in, n2, j->a, j->r, j->n_in, j->s, j->t + (m0 + i) * j->r);
        }
        if (j->dx) lr_combine(j->u + m0 * j->r, nr, j->a, j->r, j->n_in, NULL, j->dx + m0 * j->n_in);
    }
}

/* dA [r, n_in] by LR_OUTER_COLS columns (sum over m of u[m, j] x[m, :]), then dB [n_out, r] by LR_OUTER_COLS
 * of its rows (sum over m of t[m, j] g[m, :], stored transposed) */
static void lora_weights_task(void *arg, int64_t c) {
    const lora_job_t *j = arg;
    float acc[LR_MAX_RANK][LR_OUTER_COLS];
    const int for_a = c < j->n_col_tasks;
    const int64_t n = for_a ? j->n_in : j->n_out, k0 = (for_a ? c : c - j->n_col_tasks) * LR_OUTER_COLS;
    const int64_t kn = k0 + LR_OUTER_COLS < n ? LR_OUTER_COLS : n - k0;
    lr_outer_cols(for_a ? j->u : j->t, for_a ? j->x : j->g, j->M, j->r, n, k0, kn, acc);
    for (int64_t jr = 0; jr < j->r; jr++)
        for (int64_t i = 0; i < kn; i++) {
            if (for_a)
                j->da[jr * n + k0 + i] = acc[jr][i];
            else
                j->db[(k0 + i) * j->r + jr] = acc[jr][i];
        }
}

/* dx (NULL: not wanted), dA, dB of lt_lora for the output gradient g [M, n_out]. Returns 0, or
 * -1 (nothing written) as lt_lora. */
int lt_lora_back(const float *x, const float *a, const float *b, const float *g, float *dx, float *da, float *db,
                 int64_t M, int64_t n_in, int64_t n_out, int64_t r, float s, int nth) {
    if (r < 1 || r > LR_MAX_RANK) return -1;
    if (nth <= 0) nth = atomic_load(&gemm_threads);
    float *bT = lr_transpose_b(b, n_out, r), *tu = malloc((size_t)(2 * M * r) * sizeof(float));
    if (!bT || !tu) {
        free(bT);
        free(tu);
        return -1;
    }
    lora_job_t job = {.x = x, .a = a, .bT = bT, .g = g, .t = tu, .u = tu + M * r, .dx = dx, .da = da, .db = db,
                      .M = M, .n_in = n_in, .n_out = n_out, .r = r, .s = s,
                      .n_col_tasks = (n_in + LR_OUTER_COLS - 1) / LR_OUTER_COLS};
    pool_run(lora_rows_task, &job, (M + LR_ROWS - 1) / LR_ROWS, nth);
    pool_run(lora_weights_task, &job, job.n_col_tasks + (n_out + LR_OUTER_COLS - 1) / LR_OUTER_COLS, nth);
    free(bT);
    free(tu);
    return 0;
}

/* The compiled blockwise attention (lt_flash_attn, lt_flash_attn_back) is built in (1) or not (0). */
int lt_attention_built(void) { return LT_VEXP; }

/* This file's AVX2 path is compiled in (1) or the portable one (0). */
int lt_simd(void) { return LT_AVX2; }

/* ------------------------------------------------------------------ blockwise causal attention
 * The forward of ops.flash_attn (backends/cpu.py k_flash_attn; llama.cpp's ggml_flash_attn_ext)
 * for evaluation passes past PLAIN_ATTENTION_MAX_T positions, where numpy's block walk spent a
 * fifth of a SmolLM2 f32 perplexity run in Python-sized pieces. One task is FA_QB queries of one
 * head; it keeps their scores transposed (key-major, S^T[s][r]), so a query's running max, sum and
 * rescale are lanes of a vector and the causal or window mask is a lane mask per key. Per block
 * of FA_KB keys: S^T = K Q^T (K rows broadcast, Q^T packed once), scaled and masked; the online
 * softmax (running max m, sum l, earlier sums rescaled by exp(m_old - m), a row that sees no key
 * yet keeps m = 0, as numpy's kernel does); O^T = O^T alpha + V^T P^T (V rows broadcast). Outputs
 * are O / l and the row logsumexp m + log(l) (the backward's input). Every output is computed by
 * one task in one order, so threads move no bit; against numpy only the summation order and the
 * vector exp differ (tests/test_native_attention.py states the tolerance). AVX-512 only. */
#define FA_QB 32
#define FA_KB 64

typedef struct {
    const float *q, *k, *v;
    float *o, *lse;
    int64_t B, T, H, Hkv, d, window, n_qblk;
    float scale;
    atomic_int failed;  /* a thread found no memory for its scratch */
} fa_job_t;

#if LT_VEXP
/* st[i][*] = k_i . Q^T for nk <= 8 key rows (row stride ks): 8 keys x 32 queries per register pass */
static void fa_scores(const float *k, int64_t ks, const float *qt, int64_t d, float *st, int nk) {
    const float *kr[8];
    for (int i = 0; i < 8; i++) kr[i] = k + (i < nk ? i : nk - 1) * ks;
    __m512 c[8][2];
    for (int i = 0; i < 8; i++) c[i][0] = c[i][1] = _mm512_setzero_ps();
    for (int64_t jj = 0; jj < d; jj++) {
        const __m512 b0 = _mm512_load_ps(qt + jj * FA_QB), b1 = _mm512_load_ps(qt + jj * FA_QB + 16);
        for (int i = 0; i < 8; i++) {
            const __m512 a = _mm512_set1_ps(kr[i][jj]);
            c[i][0] = _mm512_fmadd_ps(a, b0, c[i][0]);
            c[i][1] = _mm512_fmadd_ps(a, b1, c[i][1]);
        }
    }
    for (int i = 0; i < nk; i++) {
        _mm512_store_ps(st + i * FA_QB, c[i][0]);
        _mm512_store_ps(st + i * FA_QB + 16, c[i][1]);
    }
}

/* rows c0 .. c0 + nc - 1 (nc <= 8) of O^T: ot = ot * alpha + sum_i v_i[c] P^T[i] over nk keys */
static void fa_values(const float *v, int64_t ks, const float *pt, int64_t nk, float *ot, int nc, __m512 a0, __m512 a1) {
    __m512 c[8][2];
    for (int cc = 0; cc < 8; cc++) {
        const int src = cc < nc ? cc : nc - 1;  /* past the rows: computed, not stored */
        c[cc][0] = _mm512_mul_ps(_mm512_load_ps(ot + src * FA_QB), a0);
        c[cc][1] = _mm512_mul_ps(_mm512_load_ps(ot + src * FA_QB + 16), a1);
    }
    for (int64_t i = 0; i < nk; i++) {
        const __m512 p0 = _mm512_load_ps(pt + i * FA_QB), p1 = _mm512_load_ps(pt + i * FA_QB + 16);
        const float *vr = v + i * ks;
        for (int cc = 0; cc < 8; cc++) {
            const __m512 a = _mm512_set1_ps(vr[cc < nc ? cc : nc - 1]);
            c[cc][0] = _mm512_fmadd_ps(a, p0, c[cc][0]);
            c[cc][1] = _mm512_fmadd_ps(a, p1, c[cc][1]);
        }
    }
    for (int cc = 0; cc < nc; cc++) {
        _mm512_store_ps(ot + cc * FA_QB, c[cc][0]);
        _mm512_store_ps(ot + cc * FA_QB + 16, c[cc][1]);
    }
}

/* The lanes r of queries t0 + r that see key s: s <= t0 + r, and t0 + r - s < window (if any). */
static inline __mmask16 fa_visible(int64_t s, int64_t t0, int64_t lane0, int64_t window) {
    const int64_t lo = s - t0 - lane0, hi = window ? lo + window : 16;  /* lanes [lo, hi) */
    const int64_t a = lo < 0 ? 0 : lo > 16 ? 16 : lo, b = hi < 0 ? 0 : hi > 16 ? 16 : hi;
    if (a >= b) return 0;
    return (__mmask16)((((uint32_t)1 << b) - 1) & ~(((uint32_t)1 << a) - 1));
}

/* dst[c][r] = src row r's element c for r < nq (rows rs floats apart), 0 past them */
static void fa_pack_t(float *dst, const float *src, int64_t rs, int64_t nq, int64_t d) {
    for (int64_t c = 0; c < d; c++)
        for (int64_t r = 0; r < FA_QB; r++) dst[c * FA_QB + r] = r < nq ? src[r * rs + c] : 0.f;
}

static __thread float *fa_buf = NULL;
static __thread int64_t fa_cap = 0;

/* A thread's scratch (Q^T, O^T, one block of S^T), 64-byte aligned, kept for its next call. */
static float *fa_scratch(int64_t floats) {
    if (fa_cap < floats) {
        free(fa_buf);
        fa_buf = aligned_alloc(64, (size_t)((floats * 4 + 63) / 64 * 64));
        fa_cap = fa_buf ? floats : 0;
    }
    return fa_buf;
}

static void fa_task(void *arg, int64_t chunk) {
    fa_job_t *j = arg;
    float *qt = fa_scratch((2 * j->d + FA_KB) * FA_QB);
    if (!qt) {
        atomic_store(&j->failed, 1);
        return;
    }
    const int64_t heads = j->B * j->H, qi = j->n_qblk - 1 - chunk / heads;  /* the longest rows first */
    const int64_t b = (chunk % heads) / j->H, h = chunk % j->H, kvh = h / (j->H / j->Hkv);
    const int64_t d = j->d, T = j->T, t0 = qi * FA_QB, nq = T - t0 < FA_QB ? T - t0 : FA_QB;
    const int64_t qs = j->H * d, ks = j->Hkv * d;  /* floats from one position to the next */
    const float *q = j->q + (b * T * j->H + h) * d;
    const float *k = j->k + (b * T * j->Hkv + kvh) * d, *v = j->v + (b * T * j->Hkv + kvh) * d;
    float *ot = qt + d * FA_QB, *st = ot + d * FA_QB;
    fa_pack_t(qt, q + t0 * qs, qs, nq, d);
    memset(ot, 0, (size_t)(d * FA_QB) * sizeof(float));
    const __m512 ninf = _mm512_set1_ps(-INFINITY), zero = _mm512_setzero_ps(), scale = _mm512_set1_ps(j->scale);
    __m512 m0 = ninf, m1 = ninf, l0 = zero, l1 = zero;
    const int64_t first = j->window && t0 - j->window + 1 > 0 ? t0 - j->window + 1 : 0, end = t0 + nq;
    for (int64_t s0 = first; s0 < end; s0 += FA_KB) {
        const int64_t nk = end - s0 < FA_KB ? end - s0 : FA_KB;
        for (int64_t i = 0; i < nk; i += 8) fa_scores(k + (s0 + i) * ks, ks, qt, d, st + i * FA_QB, nk - i < 8 ? (int)(nk - i) : 8);
        __m512 bm0 = ninf, bm1 = ninf;
        for (int64_t i = 0; i < nk; i++) {  /* scale, mask, the block's row max */
            const int64_t s = s0 + i;
            const __m512 x0 = _mm512_mask_mov_ps(ninf, fa_visible(s, t0, 0, j->window), _mm512_mul_ps(_mm512_load_ps(st + i * FA_QB), scale));
            const __m512 x1 = _mm512_mask_mov_ps(ninf, fa_visible(s, t0, 16, j->window), _mm512_mul_ps(_mm512_load_ps(st + i * FA_QB + 16), scale));
            _mm512_store_ps(st + i * FA_QB, x0);
            _mm512_store_ps(st + i * FA_QB + 16, x1);
            bm0 = _mm512_max_ps(bm0, x0);
            bm1 = _mm512_max_ps(bm1, x1);
        }
        __m512 n0 = _mm512_max_ps(m0, bm0), n1 = _mm512_max_ps(m1, bm1);
        n0 = _mm512_mask_mov_ps(n0, _mm512_cmp_ps_mask(n0, ninf, _CMP_EQ_OQ), zero);  /* no visible key yet */
        n1 = _mm512_mask_mov_ps(n1, _mm512_cmp_ps_mask(n1, ninf, _CMP_EQ_OQ), zero);
        const __m512 a0 = exp16(_mm512_sub_ps(m0, n0)), a1 = exp16(_mm512_sub_ps(m1, n1));
        __m512 sum0 = zero, sum1 = zero;
        for (int64_t i = 0; i < nk; i++) {
            const __m512 p0 = exp16(_mm512_sub_ps(_mm512_load_ps(st + i * FA_QB), n0));
            const __m512 p1 = exp16(_mm512_sub_ps(_mm512_load_ps(st + i * FA_QB + 16), n1));
            _mm512_store_ps(st + i * FA_QB, p0);
            _mm512_store_ps(st + i * FA_QB + 16, p1);
            sum0 = _mm512_add_ps(sum0, p0);
            sum1 = _mm512_add_ps(sum1, p1);
        }
        l0 = _mm512_add_ps(_mm512_mul_ps(l0, a0), sum0);
        l1 = _mm512_add_ps(_mm512_mul_ps(l1, a1), sum1);
        m0 = n0;
        m1 = n1;
        for (int64_t c0 = 0; c0 < d; c0 += 8)
            fa_values(v + s0 * ks + c0, ks, st, nk, ot + c0 * FA_QB, d - c0 < 8 ? (int)(d - c0) : 8, a0, a1);
    }
    float m[FA_QB], l[FA_QB];
    _mm512_storeu_ps(m, m0); _mm512_storeu_ps(m + 16, m1);
    _mm512_storeu_ps(l, l0); _mm512_storeu_ps(l + 16, l1);
    for (int64_t c = 0; c < d; c++) {  /* O / l a vector of queries at a time (a division is one either way) */
        _mm512_store_ps(ot + c * FA_QB, _mm512_div_ps(_mm512_load_ps(ot + c * FA_QB), l0));
        _mm512_store_ps(ot + c * FA_QB + 16, _mm512_div_ps(_mm512_load_ps(ot + c * FA_QB + 16), l1));
    }
    float *o = j->o + (b * T * j->H + h) * d, *lse = j->lse + (b * j->H + h) * T;
    for (int64_t r = 0; r < nq; r++) {
        for (int64_t c = 0; c < d; c++) o[(t0 + r) * qs + c] = ot[c * FA_QB + r];
        lse[t0 + r] = m[r] + logf(l[r]);
    }
}
#endif

/* The backward (cpu.k_flash_attn_back, FlashAttention-2's): per block P = exp(S - lse), dP = dO V^T,
 * dS = (dP - D) P scale with D = rowsum(dO * O), then dV = P^T dO, dK = dS^T Q, dQ = dS K. Two
 * passes, so that no output has two writers: one task per FAB_KB keys of a KV head (its dK and dV
 * over every query of the group that sees them), one per FA_QB queries of a head (its dQ); both
 * recompute their scores, in the forward's key-major layout (queries in vector lanes). */
typedef struct {
    const float *q, *k, *v, *o, *lse, *g;
    float *dq, *dk, *dv;
    int64_t B, T, H, Hkv, d, window, n_qblk, n_kblk;
    float scale;
    atomic_int failed;
    /* per query block of a head (index (b * H + h) * n_qblk + block), made once by fab_prep_task:
     * Q^T and dO^T [d][FA_QB], and the lanes' lse (+inf past the rows) and D = rowsum(dO * O) */
    float *qt, *gt, *lanes;
} fab_job_t;

#if LT_VEXP
/* One query block of one head, packed for both passes: Q^T, dO^T, and its lanes' lse (+inf past
 * the rows: P = 0 there) and D = rowsum(dO * O). */
static void fab_prep_task(void *arg, int64_t chunk) {
    fab_job_t *j = arg;
    const int64_t d = j->d, qs = j->H * d, bh = chunk / j->n_qblk, t0 = chunk % j->n_qblk * FA_QB;
    const int64_t nq = j->T - t0 < FA_QB ? j->T - t0 : FA_QB, base = (bh / j->H * j->T * j->H + bh % j->H) * d + t0 * qs;
    fa_pack_t(j->qt + chunk * d * FA_QB, j->q + base, qs, nq, d);
    fa_pack_t(j->gt + chunk * d * FA_QB, j->g + base, qs, nq, d);
    float *lse = j->lanes + chunk * 2 * FA_QB, *D = lse + FA_QB;
    const float *l = j->lse + bh * j->T + t0;
    for (int64_t r = 0; r < FA_QB; r++) {
        lse[r] = r < nq ? l[r] : INFINITY;
        float acc = 0.f;
        for (int64_t c = 0; r < nq && c < d; c++) acc += j->g[base + r * qs + c] * j->o[base + r * qs + c];
        D[r] = acc;
    }
}

/* For keys s0 .. s0 + nk - 1 against the block's queries (Q^T qt, dO^T gt packed): pt = P^T and
 * dst = dS^T, [nk][FA_QB] each (masked and padded lanes 0). */
static void fa_grad_block(const fab_job_t *j, const float *k, const float *v, int64_t ks, const float *qt, const float *gt,
                          const float *lse, const float *D, int64_t s0, int64_t nk, int64_t t0, float *pt, float *dst) {
    for (int64_t i = 0; i < nk; i += 8) {
        const int n8 = nk - i < 8 ? (int)(nk - i) : 8;
        fa_scores(k + (s0 + i) * ks, ks, qt, j->d, pt + i * FA_QB, n8);
        fa_scores(v + (s0 + i) * ks, ks, gt, j->d, dst + i * FA_QB, n8);
    }
    const __m512 scale = _mm512_set1_ps(j->scale), zero = _mm512_setzero_ps();
    for (int64_t i = 0; i < nk; i++)
        for (int half = 0; half < 2; half++) {
            const int64_t at = i * FA_QB + 16 * half;
            const __mmask16 seen = fa_visible(s0 + i, t0, 16 * half, j->window);
            const __m512 x = _mm512_sub_ps(_mm512_mul_ps(_mm512_load_ps(pt + at), scale), _mm512_loadu_ps(lse + 16 * half));
            const __m512 p = _mm512_mask_mov_ps(zero, seen, exp16(x));
            const __m512 ds = _mm512_mul_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_load_ps(dst + at), _mm512_loadu_ps(D + 16 * half)), p), scale);
            _mm512_store_ps(pt + at, p);
            _mm512_store_ps(dst + at, ds);
        }
}

/* acc[i][c] += sum_r coef[i][r] rows[r][c] for i < nk (acc rows d floats apart), r < nq (rows
 * rs floats apart): 4 keys x 64 columns of accumulators per register pass */
static void fa_rows_acc(float *acc, const float *coef, int64_t nk, const float *rows, int64_t rs, int64_t nq, int64_t d) {
    for (int64_t i0 = 0; i0 < nk; i0 += 4) {
        const int ni = nk - i0 < 4 ? (int)(nk - i0) : 4;
        for (int64_t c0 = 0; c0 < d; c0 += 64) {
            __mmask16 m[4];
            for (int vv = 0; vv < 4; vv++) m[vv] = gemm_mask((int)(d - c0 < 64 ? d - c0 : 64), vv);
            __m512 a[4][4];
            for (int ii = 0; ii < 4; ii++)
                for (int vv = 0; vv < 4; vv++)
                    a[ii][vv] = ii < ni ? _mm512_maskz_loadu_ps(m[vv], acc + (i0 + ii) * d + c0 + 16 * vv) : _mm512_setzero_ps();
            for (int64_t r = 0; r < nq; r++) {
                __m512 x[4];
                for (int vv = 0; vv < 4; vv++) x[vv] = _mm512_maskz_loadu_ps(m[vv], rows + r * rs + c0 + 16 * vv);
                for (int ii = 0; ii < 4; ii++) {
                    const __m512 cf = _mm512_set1_ps(coef[(i0 + (ii < ni ? ii : 0)) * FA_QB + r]);
                    for (int vv = 0; vv < 4; vv++) a[ii][vv] = _mm512_fmadd_ps(cf, x[vv], a[ii][vv]);
                }
            }
            for (int ii = 0; ii < ni; ii++)
                for (int vv = 0; vv < 4; vv++) _mm512_mask_storeu_ps(acc + (i0 + ii) * d + c0 + 16 * vv, m[vv], a[ii][vv]);
        }
    }
}

/* floats of a thread's scratch for the backward: dQ^T, P^T, dS^T, dK and dV tiles */
static int64_t fab_floats(int64_t d) { return d * FA_QB + 2 * FA_KB * FA_QB + 2 * FA_KB * d; }

/* keys per dK/dV task: a block of its own, smaller than the forward's, so that a short sequence's
 * few KV heads still give every thread tasks (the first block sees every query, the last few) */
#define FAB_KB 32

static void fab_keys_task(void *arg, int64_t chunk) {  /* dK, dV of FAB_KB keys of one KV head */
    fab_job_t *j = arg;
    float *pt = fa_scratch(fab_floats(j->d));
    if (!pt) { atomic_store(&j->failed, 1); return; }
    const int64_t d = j->d, T = j->T, G = j->H / j->Hkv, ks = j->Hkv * d, qs = j->H * d;
    const int64_t b = chunk / (j->Hkv * j->n_kblk), kvh = chunk / j->n_kblk % j->Hkv, s0 = chunk % j->n_kblk * FAB_KB;
    const int64_t nk = T - s0 < FAB_KB ? T - s0 : FAB_KB;
    float *dst = pt + FA_KB * FA_QB, *dk = dst + FA_KB * FA_QB, *dv = dk + FA_KB * d;
    const float *k = j->k + (b * T * j->Hkv + kvh) * d, *v = j->v + (b * T * j->Hkv + kvh) * d;
    memset(dk, 0, (size_t)(2 * FA_KB * d) * sizeof(float));
    /* the queries that see some key of the block: from the block's first key to its last + window */
    const int64_t t_end = j->window && s0 + nk - 1 + j->window < T ? s0 + nk - 1 + j->window : T;
    for (int64_t g = 0; g < G; g++) {
        const int64_t h = kvh * G + g;
        const float *q = j->q + (b * T * j->H + h) * d, *go = j->g + (b * T * j->H + h) * d;
        for (int64_t t0 = s0 / FA_QB * FA_QB; t0 < t_end; t0 += FA_QB) {
            const int64_t nq = T - t0 < FA_QB ? T - t0 : FA_QB, blk = (b * j->H + h) * j->n_qblk + t0 / FA_QB;
            const float *lse = j->lanes + blk * 2 * FA_QB;
            fa_grad_block(j, k, v, ks, j->qt + blk * d * FA_QB, j->gt + blk * d * FA_QB, lse, lse + FA_QB, s0, nk, t0,
                          pt, dst);
            fa_rows_acc(dv, pt, nk, go + t0 * qs, qs, nq, d);
            fa_rows_acc(dk, dst, nk, q + t0 * qs, qs, nq, d);
        }
    }
    for (int64_t i = 0; i < nk; i++) {
        memcpy(j->dk + (b * T * j->Hkv + kvh) * d + (s0 + i) * ks, dk + i * d, (size_t)d * sizeof(float));
        memcpy(j->dv + (b * T * j->Hkv + kvh) * d + (s0 + i) * ks, dv + i * d, (size_t)d * sizeof(float));
    }
}

static void fab_queries_task(void *arg, int64_t chunk) {  /* dQ of FA_QB queries of one head */
    fab_job_t *j = arg;
    float *dqt = fa_scratch(fab_floats(j->d));
    if (!dqt) { atomic_store(&j->failed, 1); return; }
    const int64_t heads = j->B * j->H, qi = j->n_qblk - 1 - chunk / heads;
    const int64_t b = (chunk % heads) / j->H, h = chunk % j->H, kvh = h / (j->H / j->Hkv);
    const int64_t d = j->d, T = j->T, t0 = qi * FA_QB, nq = T - t0 < FA_QB ? T - t0 : FA_QB;
    const int64_t qs = j->H * d, ks = j->Hkv * d, blk = (b * j->H + h) * j->n_qblk + qi;
    float *pt = dqt + d * FA_QB, *dst = pt + FA_KB * FA_QB;
    const float *k = j->k + (b * T * j->Hkv + kvh) * d, *v = j->v + (b * T * j->Hkv + kvh) * d;
    const float *qt = j->qt + blk * d * FA_QB, *gt = j->gt + blk * d * FA_QB, *lse = j->lanes + blk * 2 * FA_QB;
    memset(dqt, 0, (size_t)(d * FA_QB) * sizeof(float));
    const __m512 one = _mm512_set1_ps(1.0f);
    const int64_t first = j->window && t0 - j->window + 1 > 0 ? t0 - j->window + 1 : 0, end = t0 + nq;
    for (int64_t s0 = first; s0 < end; s0 += FA_KB) {
        const int64_t nk = end - s0 < FA_KB ? end - s0 : FA_KB;
        fa_grad_block(j, k, v, ks, qt, gt, lse, lse + FA_QB, s0, nk, t0, pt, dst);
        for (int64_t c0 = 0; c0 < d; c0 += 8)
            fa_values(k + s0 * ks + c0, ks, dst, nk, dqt + c0 * FA_QB, d - c0 < 8 ? (int)(d - c0) : 8, one, one);
    }
    float *dq = j->dq + (b * T * j->H + h) * d;
    for (int64_t r = 0; r < nq; r++)
        for (int64_t c = 0; c < d; c++) dq[(t0 + r) * qs + c] = dqt[c * FA_QB + r];
}
#endif

/* dq [B, T, H, d], dk and dv [B, T, Hkv, d] of lt_flash_attn from its inputs, its outputs o and
 * lse, and the output's gradient g (all contiguous float32). Returns 0, -1 where this build has
 * no vector exp, -2 when out of memory. */
int lt_flash_attn_back(const float *q, const float *k, const float *v, const float *o, const float *lse, const float *g,
                       float *dq, float *dk, float *dv, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t d,
                       float scale, int64_t window, int nth) {
#if LT_VEXP
    if (B <= 0 || T <= 0 || d <= 0 || Hkv <= 0 || H % Hkv) return -1;
    if (nth <= 0) nth = atomic_load(&gemm_threads);
    fab_job_t job = {q, k, v, o, lse, g, dq, dk, dv, B, T, H, Hkv, d, window, (T + FA_QB - 1) / FA_QB,
                     (T + FAB_KB - 1) / FAB_KB, scale, 0, NULL, NULL, NULL};
    const int64_t blocks = B * H * job.n_qblk, tile = d * FA_QB;
    float *prep = aligned_alloc(64, (size_t)(blocks * (2 * tile + 2 * FA_QB)) * sizeof(float));
    if (!prep) return -2;
    job.qt = prep, job.gt = prep + blocks * tile, job.lanes = prep + 2 * blocks * tile;
    pool_run(fab_prep_task, &job, blocks, nth);
    pool_run(fab_keys_task, &job, B * Hkv * job.n_kblk, nth);
    pool_run(fab_queries_task, &job, blocks, nth);
    free(prep);
    return atomic_load(&job.failed) ? -2 : 0;
#else
    (void)q; (void)k; (void)v; (void)o; (void)lse; (void)g; (void)dq; (void)dk; (void)dv; (void)B; (void)T; (void)H;
    (void)Hkv; (void)d; (void)scale; (void)window; (void)nth;
    return -1;
#endif
}

/* O [B, T, H, d] and the row logsumexp lse [B, H, T] (= [B, Hkv, G, T]) of causal attention over
 * q [B, T, H, d], k and v [B, T, Hkv, d], all contiguous float32; scale multiplies the scores,
 * window > 0 limits a query to the last `window` keys. nth threads (0: lt_set_gemm_threads's).
 * Returns 0, -1 where this build has no vector exp (AVX-512), -2 when out of memory. */
int lt_flash_attn(const float *q, const float *k, const float *v, float *o, float *lse, int64_t B, int64_t T,
                  int64_t H, int64_t Hkv, int64_t d, float scale, int64_t window, int nth) {
#if LT_VEXP
    if (B <= 0 || T <= 0 || d <= 0 || Hkv <= 0 || H % Hkv) return -1;
    if (nth <= 0) nth = atomic_load(&gemm_threads);
    fa_job_t job = {q, k, v, o, lse, B, T, H, Hkv, d, window, (T + FA_QB - 1) / FA_QB, scale, 0};
    pool_run(fa_task, &job, B * H * job.n_qblk, nth);
    return atomic_load(&job.failed) ? -2 : 0;
#else
    (void)q; (void)k; (void)v; (void)o; (void)lse; (void)B; (void)T; (void)H; (void)Hkv; (void)d; (void)scale;
    (void)window; (void)nth;
    return -1;
#endif
}
