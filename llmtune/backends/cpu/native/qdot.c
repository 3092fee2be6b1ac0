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
 * eight float lanes); elsewhere the portable loops of ggml-cpu/quants.c (*_generic). The K-quant
 * rows' products (Q4_K, Q5_K, Q6_K against q8_K) are kdot.c's.
 *
 * Output rows are split in chunks of CHUNK_ROWS over the calling thread and the pool's workers
 * (pool.c). A type is named by ggml's type id (QT_* from llmtune/quant/types.py, see common.h), an
 * activation rounding by its ACT_* kind.
 *
 * Built by llmtune/native/build.py at first use; every entry point is tested against the numpy
 * path in tests/test_native.py.
 */
#include "pool.h"

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

/* K-quants (Q4_K, Q5_K, Q6_K): kdot.c */

/* ------------------------------------------------------------------ types */
typedef float (*dot_fn)(const uint8_t *, const void *, int);
typedef void (*dot2_fn)(const uint8_t *, const uint8_t *, const void *, int, float *, float *);

/* id: ggml's type id, the type code lt_qlinear takes (native/kernels.py TYPE_CODES, from the
 * registry llmtune/quant/types.py, as QT_* and ACT_*) */
typedef struct { int id; const char *name; int block, act; dot_fn dot; dot2_fn dot2; } qtype_t;
static const qtype_t QTYPES[] = {
    {QT_Q8_0, "Q8_0", QT_Q8_0_BLOCK, ACT_Q8_0, dot_q8_0, DOT2_Q8_0},
    {QT_Q4_0, "Q4_0", QT_Q4_0_BLOCK, ACT_Q8_0, dot_q4_0, NULL},
    {QT_Q4_1, "Q4_1", QT_Q4_1_BLOCK, ACT_Q8_1, dot_q4_1, DOT2_Q4_1},
    {QT_Q5_0, "Q5_0", QT_Q5_0_BLOCK, ACT_Q8_0, dot_q5_0, NULL},
    {QT_Q5_1, "Q5_1", QT_Q5_1_BLOCK, ACT_Q8_1, dot_q5_1, NULL},
    {QT_Q4_K, "Q4_K", QT_Q4_K_BLOCK, ACT_Q8_K, dot_q4_k, NULL},
    {QT_Q5_K, "Q5_K", QT_Q5_K_BLOCK, ACT_Q8_K, dot_q5_k, NULL},
    {QT_Q6_K, "Q6_K", QT_Q6_K_BLOCK, ACT_Q8_K, dot_q6_k, NULL},
};
#define N_QTYPES ((int)(sizeof(QTYPES) / sizeof(QTYPES[0])))

/* The entry of ggml type id `type`, or NULL where this file has no product for it. */
static const qtype_t *qtype_get(int type) {
    for (int i = 0; i < N_QTYPES; i++)
        if (QTYPES[i].id == type) return &QTYPES[i];
    return NULL;
}

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

/* One activation row quantized to `act` (ACT_Q8_0, ACT_Q8_1 or ACT_Q8_K); n a multiple of the block.
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
        /* the row after next into L2, ahead of the hardware prefetcher (a 1B model's Q4_K blocks
         * from the page cache: 6.3 -> 8.8 GB/s on two threads; from a copy ~4 % over the L1 hint) */
        for (int64_t l = 0; l < j->w_stride; l += 64) __builtin_prefetch(wr + 2 * j->w_stride + l, 0, 2);
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

/* out[i, r] = W[r] . x[i] for i < m, r < n_out: W in ggml type `type` (a QT_* id), rows of
 * w_stride bytes; x float32 [m, n_in] contiguous, quantized here as ggml quantizes it. Returns 0,
 * or -1 for a bad type or width, -2 when out of memory. */
int lt_qlinear(int type, const uint8_t *w, int64_t w_stride, int64_t n_out, int64_t n_in,
               const float *x, int64_t m, float *out, int64_t out_stride, int nth) {
    const qtype_t *qt = qtype_get(type);
    if (!qt || n_in % qt->block) return -1;
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

/* ------------------------------------------------------------------ packed Q8_0 / Q4_1 / Q5_0 / Q5_1 (AVX-512 VNNI)
 * A matrix repacked once (lt_pack) in groups of 8 rows, block by block: the 8 rows' fp16 scales
 * (and the mins of Q4_1 / Q5_1) side by side, Q5's fifth bits as one 64-bit mask per pair of rows,
 * then the 8 rows' quants (as llama.cpp's repack.cpp interleaves Q4_0 for its GEMV). Two rows fill
 * one 512-bit register: one vpdpbusd gives both rows' eight int32 pair sums of a block, and one
 * fused multiply-add accumulates both rows' eight float lanes. Each float lane is the lane of
 * ggml's AVX2 vec_dot (the same integers, the same scale product, one fma per block in block order,
 * the same final hsum and min term), so every output is the per-row kernel's, bit for bit; only
 * the loads and the integer work are shared. Signed quants go through vpdpbusd as unsigned ones,
 * less the offset times the sum of the four y, exact: Q8_0 as x + 128, Q5_0 as its stored 5-bit
 * value (x + 16). */
#define PACK_ROWS 8
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && LT_AVX2
#define LT_PACK 1
#else
#define LT_PACK 0
#endif

/* bytes of one block of a group: scales [, mins] [, Q5's four pair masks], the 8 rows' quants */
static int64_t pack_block_bytes(int type) {
    switch (type) {
        case QT_Q8_0: return 16 + 8 * 32;
        case QT_Q4_1: return 32 + 8 * 16;
        case QT_Q5_0: return 16 + 32 + 8 * 16;
        case QT_Q5_1: return 32 + 32 + 8 * 16;
        default: return 0;
    }
}

/* Q5 rows 2p and 2p + 1's fifth bits as the kernel's x register holds their values: bytes 0-15 row
 * 2p's values 0-15, 16-31 row 2p + 1's, 32-47 row 2p's values 16-31, 48-63 row 2p + 1's. */
static uint64_t q5_pair_mask(const uint8_t *a, const uint8_t *b) {
    uint32_t qa, qb;
    memcpy(&qa, a, 4);
    memcpy(&qb, b, 4);
    return (uint64_t)(qa & 0xFFFF) | (uint64_t)(qb & 0xFFFF) << 16 | (uint64_t)(qa >> 16) << 32 |
           (uint64_t)(qb >> 16) << 48;
}

/* Bytes of the packed copy of the n_rows / 8 whole groups (0: the type has no packed kernel here). */
/* K-quants keep their layout (kdot.c's row kernels; repacking them measured slower, see there): their
 * "packed" form is a copy of the rows in the process's own memory. Streaming a matrix from the
 * model file's page cache ran at 8.8 GB/s on two threads here (Q4_K, a 1B model's blocks), from an
 * anonymous copy at 14 (llama.cpp likewise reads its repacked Q4_K from its own buffer). */
static int is_kquant(int type) { return type == QT_Q4_K || type == QT_Q5_K || type == QT_Q6_K; }

static int64_t k_row_bytes(int type, int64_t n_in) {
    return n_in / QK_K * (type == QT_Q4_K ? QT_Q4_K_BYTES : type == QT_Q5_K ? QT_Q5_K_BYTES : QT_Q6_K_BYTES);
}

int64_t lt_pack_bytes(int type, int64_t n_rows, int64_t n_in) {
    if (is_kquant(type)) return LT_AVX2 && n_in % QK_K == 0 ? n_rows * k_row_bytes(type, n_in) : 0;
    if (!LT_PACK || !pack_block_bytes(type) || n_in % QK) return 0;
    return n_rows / PACK_ROWS * (n_in / QK) * pack_block_bytes(type);
}

void lt_pack(int type, const uint8_t *w, int64_t w_stride, int64_t n_rows, int64_t n_in, uint8_t *out) {
    if (is_kquant(type)) {
        const int64_t rb = k_row_bytes(type, n_in);
        for (int64_t r = 0; r < n_rows; r++) memcpy(out + r * rb, w + r * w_stride, (size_t)rb);
        return;
    }
    const int64_t nb = n_in / QK, gb = pack_block_bytes(type);
    const int64_t bsz = type == QT_Q8_0 ? QT_Q8_0_BYTES : type == QT_Q4_1 ? QT_Q4_1_BYTES
                      : type == QT_Q5_0 ? QT_Q5_0_BYTES : QT_Q5_1_BYTES;
    const int has_min = type == QT_Q4_1 || type == QT_Q5_1, q5 = type == QT_Q5_0 || type == QT_Q5_1;
    const int64_t qs_at = 16 + 16 * has_min + 32 * q5, hoff = 2 + 2 * has_min;  /* quants in a group block; qh in a row's */
    for (int64_t g = 0; g < n_rows / PACK_ROWS; g++)
        for (int64_t i = 0; i < nb; i++) {
            uint8_t *o = out + (g * nb + i) * gb;
            const uint8_t *b[PACK_ROWS];
            for (int r = 0; r < PACK_ROWS; r++) b[r] = w + (g * PACK_ROWS + r) * w_stride + i * bsz;
            for (int r = 0; r < PACK_ROWS; r++) {
                memcpy(o + 2 * r, b[r], 2);
                if (has_min) memcpy(o + 16 + 2 * r, b[r] + 2, 2);
                if (type == QT_Q8_0) memcpy(o + 16 + 32 * r, b[r] + 2, 32);
                else memcpy(o + qs_at + 16 * r, b[r] + hoff + 4 * q5, 16);
            }
            if (q5)
                for (int p = 0; p < PACK_ROWS / 2; p++) {
                    const uint64_t mask = q5_pair_mask(b[2 * p] + hoff, b[2 * p + 1] + hoff);
                    memcpy(o + 16 + 16 * has_min + 8 * p, &mask, 8);
                }
        }
}

#if LT_PACK
/* Software prefetch of a group block's lines 2 KiB ahead: a matrix streamed from memory (Gemma 3's
 * 178 MB Q8_0 output) ran at 16-17 GB/s on two threads without it, 24-26 with it (a float32 stream:
 * 26-27); on a matrix the caches hold it costs nothing measurable. */
#define PREFETCH_AHEAD 2048
static inline void prefetch_block(const uint8_t *g, int64_t bytes) {
    for (int64_t l = 0; l < bytes; l += 64) __builtin_prefetch(g + PREFETCH_AHEAD + l, 0, 3);
}

/* the activation row as the packed kernels read it: per block the quants (Q4_1 / Q5: 0-15 twice,
 * then 16-31 twice, to face two rows' low and high nibbles), and the offset times each four values'
 * sum for the signed types (Q8_0: 128 x, 8 lanes; Q5_0: 16 x, 16 lanes in that doubled order) */
static void prep_act(int type, const uint8_t *xq, int64_t nb, int8_t *yq, int32_t *ycorr) {
    for (int64_t i = 0; i < nb; i++) {
        const int8_t *q = type == QT_Q8_0 || type == QT_Q5_0 ? ((const block_q8_0 *)xq)[i].qs
                                                             : ((const block_q8_1 *)xq)[i].qs;
        int32_t sum4[8];
        for (int j = 0; j < 8; j++) sum4[j] = q[4 * j] + q[4 * j + 1] + q[4 * j + 2] + q[4 * j + 3];
        if (type == QT_Q8_0) {
            memcpy(yq + 32 * i, q, 32);
            for (int j = 0; j < 8; j++) ycorr[16 * i + j] = 128 * sum4[j];
            continue;
        }
        memcpy(yq + 64 * i, q, 16);
        memcpy(yq + 64 * i + 16, q, 16);
        memcpy(yq + 64 * i + 32, q + 16, 16);
        memcpy(yq + 64 * i + 48, q + 16, 16);
        if (type == QT_Q5_0)  /* lanes 0-3 and 4-7: values 0-15 (both rows), 8-11 and 12-15: 16-31 */
            for (int j = 0; j < 16; j++) ycorr[16 * i + j] = 16 * sum4[(j & 3) | (j & 8) >> 1];
    }
}

/* Up to GROUP_ROWS activation rows against one group (a batched decode step, a short prompt): the
 * weights' loads, flips and scale shuffles are shared, each row keeps its own accumulators. */
#define GROUP_ROWS 4
typedef struct {
    int n;
    const int8_t *yq[GROUP_ROWS];
    const float *yd[GROUP_ROWS];
    const int32_t *ycorr[GROUP_ROWS];
    float *out[GROUP_ROWS];
} act_rows_t;

/* The scale lanes of row pair p (block scales times the activation's, in group_q8_0's lane order)
 * are the weights' scales shuffled first, then multiplied by the activation scale: the same
 * products as multiplying first (each lane one float multiply of the same two numbers). */
static void group_q8_0(const uint8_t *g, int64_t nb, const act_rows_t *a) {
    __m512 acc[GROUP_ROWS][4];
    for (int t = 0; t < a->n; t++)
        for (int p = 0; p < 4; p++) acc[t][p] = _mm512_setzero_ps();
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i lo = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i two = _mm512_set1_epi32(2);
    for (int64_t i = 0; i < nb; i++, g += 16 + 8 * 32) {
        prefetch_block(g, 16 + 8 * 32);
        const __m512 wsc = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g)));
        __m512i x[4];
        __m512 sc[4];
        __m512i idx = lo;
        for (int p = 0; p < 4; p++, idx = _mm512_add_epi32(idx, two)) {
            x[p] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(g + 16 + 64 * p)), flip);
            sc[p] = _mm512_permutexvar_ps(idx, wsc);
        }
        for (int t = 0; t < a->n; t++) {
            const __m512 yd = _mm512_set1_ps(a->yd[t][i]);
            const __m512i y = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(a->yq[t] + 32 * i)));
            const __m512i corr = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(a->ycorr[t] + 16 * i)));
            for (int p = 0; p < 4; p++) {
                const __m512i d = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), x[p], y), corr);
                acc[t][p] = _mm512_fmadd_ps(_mm512_mul_ps(sc[p], yd), _mm512_cvtepi32_ps(d), acc[t][p]);
            }
        }
    }
    for (int t = 0; t < a->n; t++)
        for (int p = 0; p < 4; p++) {
            a->out[t][2 * p] = hsum_float_8(_mm512_castps512_ps256(acc[t][p]));
            a->out[t][2 * p + 1] = hsum_float_8(_mm512_extractf32x8_ps(acc[t][p], 1));
        }
}

static void group_q4_1(const uint8_t *g, int64_t nb, const int8_t *yq, const float *yd, const float *ys, float *out) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    __m256 summs = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const __m512i base = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i two = _mm512_set1_epi32(2);
    for (int64_t i = 0; i < nb; i++, g += 32 + 8 * 16) {
        prefetch_block(g, 32 + 8 * 16);
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

/* Q5_0 / Q5_1: group_q4_1's nibbles with the fifth bits set from the pair's mask (one masked byte
 * move); Q5_0's signed values as their stored 5-bit ones, less 16 x the four y's sum per lane. */
static void group_q5(const uint8_t *g, int64_t nb, int has_min, const int8_t *yq, const float *yd, const float *ys,
                     const int32_t *ycorr, float *out) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    __m256 summs = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const __m512i bit5 = _mm512_set1_epi8(0x10);
    const __m512i base = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i two = _mm512_set1_epi32(2);
    const int64_t gb = pack_block_bytes(has_min ? QT_Q5_1 : QT_Q5_0), masks = 16 + 16 * has_min, qs = masks + 32;
    for (int64_t i = 0; i < nb; i++, g += gb) {
        prefetch_block(g, gb);
        const __m256 sc = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g)), _mm256_set1_ps(yd[i]));
        if (has_min)
            summs = _mm256_add_ps(summs, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16))),
                                                       _mm256_set1_ps(ys[i])));
        const __m512 sc2 = _mm512_castps256_ps512(sc);
        const __m512i y = _mm512_loadu_si512((const void *)(yq + 64 * i));
        const __m512i corr = has_min ? _mm512_setzero_si512() : _mm512_loadu_si512((const void *)(ycorr + 16 * i));
        __m512i idx = base;
        for (int p = 0; p < 4; p++, idx = _mm512_add_epi32(idx, two)) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(g + qs + 32 * p));
            uint64_t hbits;
            memcpy(&hbits, g + masks + 8 * p, 8);
            const __m512i x = _mm512_or_si512(
                _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(q, m4)),
                                   _mm256_and_si256(_mm256_srli_epi16(q, 4), m4), 1),
                _mm512_maskz_mov_epi8(_cvtu64_mask64(hbits), bit5));
            const __m512i d = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), x, y), corr);
            acc[p] = _mm512_fmadd_ps(_mm512_permutexvar_ps(idx, sc2), _mm512_cvtepi32_ps(d), acc[p]);
        }
    }
    float mins[8];
    _mm256_storeu_ps(mins, summs);
    const __m512i rows = _mm512_set_epi32(15, 14, 13, 12, 7, 6, 5, 4, 11, 10, 9, 8, 3, 2, 1, 0);
    for (int p = 0; p < 4; p++) {  /* as group_q4_1; dot_q5 adds its (zero) min sum for Q5_0 too */
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
    int64_t chunk;  /* groups per claimed chunk (pack_chunk) */
} pjob_t;

/* Groups per claimed chunk: about 8 chunks a thread, 2 to 32 groups (16 to 256 rows). A big matrix
 * streamed from memory wants long runs of consecutive groups per thread (its 178 MB at 2 groups a
 * chunk: 17 GB/s; at 32: 20, with prefetching 25); a small one wants chunks enough to balance. */
static int64_t pack_chunk(int64_t n_groups, int nth) {
    const int64_t per = n_groups / (8 * (int64_t)(nth > 0 ? nth : 1));
    return per < 2 ? 2 : per > 32 ? 32 : per;
}

static void p_task(void *p, int64_t chunk) {
    const pjob_t *j = p;
    const int64_t g0 = chunk * j->chunk, g1 = g0 + j->chunk < j->n_groups ? g0 + j->chunk : j->n_groups;
    const int64_t gb = pack_block_bytes(j->type) * j->nb;
    for (int64_t g = g0; g < g1; g++)
        for (int64_t i0 = 0; i0 < j->m; i0 += GROUP_ROWS) {
            act_rows_t a = {(int)(j->m - i0 < GROUP_ROWS ? j->m - i0 : GROUP_ROWS), {0}, {0}, {0}, {0}};
            for (int t = 0; t < a.n; t++) {
                const int64_t i = i0 + t;
                a.out[t] = j->out + i * j->out_stride + g * PACK_ROWS;
                a.yd[t] = (const float *)(j->xq + i * j->xq_stride + j->scales_at);
                a.yq[t] = j->yq + i * j->yq_stride;
                a.ycorr[t] = j->ycorr + i * j->nb * 16;
            }
            if (j->type == QT_Q8_0) {
                group_q8_0(j->packed + g * gb, j->nb, &a);
                continue;
            }
            for (int t = 0; t < a.n; t++)
                if (j->type == QT_Q4_1) group_q4_1(j->packed + g * gb, j->nb, a.yq[t], a.yd[t], a.yd[t] + j->nb, a.out[t]);
                else group_q5(j->packed + g * gb, j->nb, j->type == QT_Q5_1, a.yq[t], a.yd[t], a.yd[t] + j->nb, a.ycorr[t],
                              a.out[t]);
        }
}

static __thread uint8_t *prep_buf = NULL;
static __thread int64_t prep_cap = 0;
#endif

/* lt_qlinear with the whole groups of 8 rows read from `packed` (lt_pack's copy of w), the rest
 * of the rows from w. Returns as lt_qlinear; -1 also where this build has no packed kernel. */
int lt_qlinear_packed(int type, const uint8_t *packed, const uint8_t *w, int64_t w_stride, int64_t n_out, int64_t n_in,
                      const float *x, int64_t m, float *out, int64_t out_stride, int nth) {
    if (is_kquant(type))
        return lt_pack_bytes(type, n_out, n_in) ? lt_qlinear(type, packed, k_row_bytes(type, n_in), n_out, n_in, x, m, out,
                                                             out_stride, nth) : -1;
#if LT_PACK
    if (!pack_block_bytes(type) || n_in % QK) return -1;
    const qtype_t *qt = qtype_get(type);
    const int64_t nb = n_in / QK, xq_stride = act_row_bytes(qt->act, n_in);
    const int64_t yq_stride = nb * (type == QT_Q8_0 ? 32 : 64), corr_bytes = nb * 16 * 4;
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
        prep_act(type, xq, nb, yq + i * yq_stride, ycorr + i * nb * 16);
    }
    /* the scales as floats follow each activation row's blocks (act_scales): d[nb], then s[nb] */
    const int64_t blk = qt->act == ACT_Q8_0 ? (int64_t)sizeof(block_q8_0) : (int64_t)sizeof(block_q8_1);
    pjob_t job = {type, packed, nb, n_out / PACK_ROWS, m, yq, ycorr, act_buf, yq_stride, xq_stride, nb * blk,
                  out, out_stride, pack_chunk(n_out / PACK_ROWS, nth)};
    pool_run(p_task, &job, (job.n_groups + job.chunk - 1) / job.chunk, nth);
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

/* The widest vectors this build's products use: 512 (AVX-512F on top of the AVX2 paths: dot_f32's
 * 16 lanes, the packed kernels where VNNI is there too), 256 (the AVX2 paths) or 0 (portable). */
int lt_simd(void) {
#if defined(__AVX512F__) && LT_AVX2
    return 512;
#else
    return LT_AVX2 ? 256 : 0;
#endif
}
