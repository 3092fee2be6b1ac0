/* K-quant products: one Q4_K / Q5_K / Q6_K weight row against one q8_K activation row, the dot
 * products qdot.c's lt_qlinear runs for these types (the FFN down weights of llama.cpp's *_K_M
 * files).
 *
 * Where AVX2 is available each kernel computes what ggml's x86 kernel computes, bit for bit:
 * ggml-cpu/arch/x86/quants.c ggml_vec_dot_q{4,5,6}_K_q8_K, their __AVX2__ branch (ggml has no
 * AVX-512 branch for these three: its AVX-512 builds take the AVX2 one). There a super-block's
 * integer products land in eight int32 lanes, lane l holding bytes 4l..4l+3 of every 32-value
 * group times that group's scale, and one fused multiply-add per super-block scales the eight
 * lanes into eight float sums, horizontally added at the end (hsum_float_8). The integers are
 * exact however they are formed (|q| <= 63, |y| <= 127: no int16 pair sum saturates), so what has
 * to match is which products meet in which lane and every float step: those follow ggml's code,
 * the instructions need not (a VNNI build folds madd + add into one vpdpwssd, the same integers).
 * The min term is where the three differ, each written out at its kernel.
 *
 * No two-row variant (qdot.c's dot2_*): sharing the activation loads between two rows' chains
 * measured 3% slower here, and two rows in one 512-bit register 10% slower (a super-block's work
 * is bound by the instructions that unpack the weights, which no sharing removes).
 *
 * The portable loops are ggml-cpu/quants.c's ggml_vec_dot_q{4,5,6}_K_q8_K_generic, the reference:
 * they are the product of a build without AVX2, and lt_kdot runs them in any build, for the tests
 * (tests/test_native.py, which also holds the SIMD path to ggml's own recorded AVX2 outputs,
 * tests/data/kquant_dots.npz, bit for bit).
 */
#include "pool.h"

/* Q4_K / Q5_K: 2 bytes d, 2 bytes dmin, 12 bytes of 6-bit scales and mins (8 each), [Q5_K: 32
 * bytes of fifth bits], 128 bytes of nibbles. Q6_K: 128 bytes of low nibbles, 64 of high bit
 * pairs, 16 int8 scales, 2 bytes d. */
#define Q4K_BYTES 144
#define Q5K_BYTES 176
#define Q6K_BYTES 210

/* ------------------------------------------------------------------ portable (the *_generic loops) */
static void k_scales_mins(const uint8_t *sc12, uint8_t scales[8], uint8_t mins[8]) {
    for (int j = 0; j < 4; j++) {
        scales[j] = sc12[j] & 63;
        mins[j] = sc12[j + 4] & 63;
        scales[j + 4] = (sc12[j + 8] & 0xF) | ((sc12[j] >> 6) << 4);
        mins[j + 4] = (sc12[j + 8] >> 4) | ((sc12[j + 4] >> 6) << 4);
    }
}

static float ref_q45_k(const uint8_t *w, const void *vy, int nb, int five) {
    const block_q8_K *y = vy;
    const int bsz = five ? Q5K_BYTES : Q4K_BYTES;
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

static float ref_q4_k(const uint8_t *w, const void *vy, int nb) { return ref_q45_k(w, vy, nb, 0); }
static float ref_q5_k(const uint8_t *w, const void *vy, int nb) { return ref_q45_k(w, vy, nb, 1); }

static float ref_q6_k(const uint8_t *w, const void *vy, int nb) {
    const block_q8_K *y = vy;
    float sums[8] = {0}, sumf = 0;
    for (int i = 0; i < nb; i++, w += Q6K_BYTES) {
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

/* ------------------------------------------------------------------ AVX2 (ggml's x86 kernels' lanes) */
#if LT_AVX2
/* acc + a . b pairwise (int16 x int16 -> int32 lanes): madd then add, or VNNI's vpdpwssd, which
 * gives the same integers in one instruction (nothing here comes near int32's range). */
static inline __m256i madd_acc(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

/* The 12 bytes of 6-bit scales and mins (get_scale_min_k4's packing) as 16 int16: the 8 scales,
 * then the 8 mins. Scales and mins 0-3 are the low 6 bits of bytes 0-3 and 4-7; 4-7 take their
 * low 4 bits from byte 8-11's nibbles and the top 2 from bytes 0-7's top bits. */
static inline __m256i k4_scales_mins(const uint8_t *p) {
    uint32_t u[3];
    memcpy(u, p, 12);
    const uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
    const uint32_t sc_lo = u[0] & six, mn_lo = u[1] & six;
    const uint32_t sc_hi = (u[2] & four) | (((u[0] >> 6) & two) << 4);
    const uint32_t mn_hi = ((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4);
    return _mm256_cvtepu8_epi16(_mm_set_epi32((int)mn_hi, (int)mn_lo, (int)sc_hi, (int)sc_lo));
}

/* int16 number k of each 128-bit half, in all 16 int16 lanes (the halves hold the same 8) */
static inline __m256i k_pick16(__m256i v, int k) {
    return _mm256_shuffle_epi8(v, _mm256_set1_epi16((short)(((2 * k + 1) << 8) | (2 * k))));
}

/* The q8_K block's 16 sums of 16 as 8 sums of 32 (one per Q4_K / Q5_K sub-block), times the 8
 * mins, summed in pairs: int32 lane k = mins[2k] sum[2k] + mins[2k + 1] sum[2k + 1]. */
static inline __m128i k_mins_dot(__m256i sm, const int16_t *bsums) {
    const __m256i b = _mm256_loadu_si256((const __m256i *)bsums);
    const __m128i sums32 = _mm_hadd_epi16(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    return _mm_madd_epi16(_mm256_extracti128_si256(sm, 1), sums32);
}

/* The eight int32 lanes of one Q4_K / Q5_K super-block (five: the fifth bits at w + 16): each
 * 32-value sub-block's u8 x s8 pair products (maddubs) times its scale. */
static inline __m256i q45k_lanes(const uint8_t *w, __m256i sm, const int8_t *q8, int five) {
    const __m256i m4 = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
    const __m256i sc = _mm256_permute4x64_epi64(sm, 0x44);  /* the scales in both halves */
    const uint8_t *qs = w + (five ? 48 : 16);
    const __m256i hb = five ? _mm256_loadu_si256((const __m256i *)(w + 16)) : _mm256_setzero_si256();
    __m256i sumi = _mm256_setzero_si256();
    for (int j = 0; j < QK_K / 64; j++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
        __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if (five) {  /* the fifth bit (16) of value l of sub-block 2j is bit 2j of qh[l]; of 2j + 1, bit 2j + 1 */
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * j), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * j + 1), one), 4));
        }
        const __m256i y0 = _mm256_loadu_si256((const __m256i *)(q8 + 64 * j));
        const __m256i y1 = _mm256_loadu_si256((const __m256i *)(q8 + 64 * j + 32));
        sumi = madd_acc(sumi, k_pick16(sc, 2 * j), _mm256_maddubs_epi16(lo, y0));
        sumi = madd_acc(sumi, k_pick16(sc, 2 * j + 1), _mm256_maddubs_epi16(hi, y1));
    }
    return sumi;
}

/* The eight int32 lanes of one Q6_K super-block. The quants are read unsigned (0..63) and the
 * offset of 32 comes off at the end as ggml's kernel takes it: 32 (bsums . scales) paired into
 * the same eight lanes, int32 lane l = 32 (bsums[2l] sc[2l] + bsums[2l + 1] sc[2l + 1]). Each 16
 * values have their int8 scale: a 32-value group's lanes 0-3 take scale 2c, lanes 4-7 scale 2c + 1. */
static inline __m256i q6k_lanes(const uint8_t *w, const block_q8_K *y) {
    const __m256i m4 = _mm256_set1_epi8(0xF), b01 = _mm256_set1_epi8(3), b23 = _mm256_set1_epi8(12);
    const __m256i b45 = _mm256_set1_epi8(48), b67 = _mm256_set1_epi8((char)0xC0);
    const __m128i sc8 = _mm_loadu_si128((const __m128i *)(w + 192));
    const __m256i off = _mm256_slli_epi32(
        _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)y->bsums), _mm256_cvtepi8_epi16(sc8)), 5);
    __m256i sumi = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(w + 64 * h));
        const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(w + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
        /* value group k of this half: the low, low, high, high nibbles of ql0, ql1, ql0, ql1 with
         * bits 2k, 2k + 1 of qh as bits 4, 5 */
        const __m256i v[4] = {
            _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, b01), 4)),
            _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_slli_epi16(_mm256_and_si256(qh, b23), 2)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, b45)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                            _mm256_srli_epi16(_mm256_and_si256(qh, b67), 2)),
        };
        for (int k = 0; k < 4; k++) {
            const int c = 4 * h + k;
            const __m128i pick = _mm_set_epi64x((long long)(0x0101010101010101ULL * (uint64_t)(2 * c + 1)),
                                                (long long)(0x0101010101010101ULL * (uint64_t)(2 * c)));
            const __m256i scale = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, pick));
            const __m256i yq = _mm256_loadu_si256((const __m256i *)(y->qs + 32 * c));
            sumi = madd_acc(sumi, scale, _mm256_maddubs_epi16(v[k], yq));
        }
    }
    return _mm256_sub_epi32(sumi, off);
}

/* ggml_vec_dot_q4_K_q8_K: the min term in its own four float lanes, acc_m = fma(-y.d dmin,
 * k_mins_dot, acc_m) per super-block, added up (lane 0 + 2, 1 + 3, then the two) and added to
 * the hsum at the end. */
typedef struct { __m256 acc; __m128 accm; } k4acc_t;

static inline void q4k_step(k4acc_t *a, const uint8_t *w, const block_q8_K *y, int five) {
    const __m256i sm = k4_scales_mins(w + 4);
    const float d = y->d * h2f(w), dmin = -y->d * h2f(w + 2);
    a->accm = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(k_mins_dot(sm, y->bsums)), a->accm);
    a->acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(q45k_lanes(w, sm, y->qs, five)), a->acc);
}

static inline float q4k_end(k4acc_t a) {
    __m128 m = _mm_add_ps(a.accm, _mm_movehl_ps(a.accm, a.accm));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    return hsum_float_8(a.acc) + _mm_cvtss_f32(m);
}

static float simd_q4_k(const uint8_t *w, const void *vy, int nb) {
    const block_q8_K *y = vy;
    k4acc_t a = {_mm256_setzero_ps(), _mm_setzero_ps()};
    for (int i = 0; i < nb; i++, w += Q4K_BYTES) q4k_step(&a, w, y + i, 0);
    return q4k_end(a);
}

/* ggml_vec_dot_q5_K_q8_K: the min term's four int32 lanes summed as integers, then one scalar
 * summs += dmin * sum per super-block, which ggml's build (GCC, -std=gnu11: -ffp-contract=fast)
 * compiles to one fused multiply-add; this library is built with -ffp-contract=off, so it is
 * written out as fmaf. At the end hsum + summs. */
static inline float q5k_step(__m256 *acc, float summs, const uint8_t *w, const block_q8_K *y) {
    const __m256i sm = k4_scales_mins(w + 4);
    const float d = y->d * h2f(w), dmin = -y->d * h2f(w + 2);
    __m128i m = k_mins_dot(sm, y->bsums);
    m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0x4E));
    m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0xB1));
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(q45k_lanes(w, sm, y->qs, 1)), *acc);
    return fmaf(dmin, (float)_mm_cvtsi128_si32(m), summs);
}

static float simd_q5_k(const uint8_t *w, const void *vy, int nb) {
    const block_q8_K *y = vy;
    __m256 acc = _mm256_setzero_ps();
    float summs = 0.f;
    for (int i = 0; i < nb; i++, w += Q5K_BYTES) summs = q5k_step(&acc, summs, w, y + i);
    return hsum_float_8(acc) + summs;
}

/* ggml_vec_dot_q6_K_q8_K: no min term; acc = fma(y.d d, lanes, acc), then the hsum. */
static float simd_q6_k(const uint8_t *w, const void *vy, int nb) {
    const block_q8_K *y = vy;
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < nb; i++, w += Q6K_BYTES)
        acc = _mm256_fmadd_ps(_mm256_set1_ps(y[i].d * h2f(w + 208)), _mm256_cvtepi32_ps(q6k_lanes(w, y + i)), acc);
    return hsum_float_8(acc);
}
#endif

/* ------------------------------------------------------------------ what qdot.c's type table takes */
float dot_q4_k(const uint8_t *w, const void *y, int nb) {
#if LT_AVX2
    return simd_q4_k(w, y, nb);
#else
    return ref_q4_k(w, y, nb);
#endif
}

float dot_q5_k(const uint8_t *w, const void *y, int nb) {
#if LT_AVX2
    return simd_q5_k(w, y, nb);
#else
    return ref_q5_k(w, y, nb);
#endif
}

float dot_q6_k(const uint8_t *w, const void *y, int nb) {
#if LT_AVX2
    return simd_q6_k(w, y, nb);
#else
    return ref_q6_k(w, y, nb);
#endif
}

/* out[r] = W[r] . y for n_rows K-quant rows of w_stride bytes (type a QT_* id) and one q8_K row y
 * of nb blocks (lt_quantize_act's bytes), with this build's kernel or (portable) the reference
 * loop, one row at a time: what the tests compare. Returns 0, or -1 for a type that is no K-quant. */
int lt_kdot(int type, int portable, const uint8_t *w, int64_t w_stride, int64_t n_rows, const uint8_t *y, int64_t nb,
            float *out) {
    float (*dot)(const uint8_t *, const void *, int);
    switch (type) {
        case QT_Q4_K: dot = portable ? ref_q4_k : dot_q4_k; break;
        case QT_Q5_K: dot = portable ? ref_q5_k : dot_q5_k; break;
        case QT_Q6_K: dot = portable ? ref_q6_k : dot_q6_k; break;
        default: return -1;
    }
    for (int64_t r = 0; r < n_rows; r++) out[r] = dot(w + r * w_stride, y, (int)nb);
    return 0;
}
