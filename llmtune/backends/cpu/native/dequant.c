/* Rows of ggml blocks decoded to float32 (ggml's dequantize_row_q4_0 ... dequantize_row_q6_K), the
 * same arithmetic, step for step, as quant/matmul.py's numpy decoders: a product then a sum, each
 * rounded to float32 (built with -ffp-contract=off, so no fused multiply-add), so every value is
 * the numpy path's, bit for bit. Single-threaded: the callers run one per core already (training
 * and evaluation workers). */
#include "common.h"  /* h2f: the fp16 decode every kernel uses; QT_*: ggml's type ids */

static void row_q8_0(const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += QT_Q8_0_BYTES, o += QT_Q8_0_BLOCK) {
        const float d = h2f(b);
        const int8_t *q = (const int8_t *)(b + 2);
        for (int l = 0; l < 32; l++) o[l] = (float)q[l] * d;
    }
}

static void row_q4_0(const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += QT_Q4_0_BYTES, o += QT_Q4_0_BLOCK) {
        const float d = h2f(b);
        for (int l = 0; l < 16; l++) {
            o[l] = ((float)(b[2 + l] & 15) - 8.0f) * d;
            o[l + 16] = ((float)(b[2 + l] >> 4) - 8.0f) * d;
        }
    }
}

static void row_q4_1(const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += QT_Q4_1_BYTES, o += QT_Q4_1_BLOCK) {
        const float d = h2f(b), m = h2f(b + 2);
        for (int l = 0; l < 16; l++) {
            o[l] = (float)(b[4 + l] & 15) * d + m;
            o[l + 16] = (float)(b[4 + l] >> 4) * d + m;
        }
    }
}

static inline uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static void row_q5_0(const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += QT_Q5_0_BYTES, o += QT_Q5_0_BLOCK) {
        const float d = h2f(b);
        const uint32_t qh = le32(b + 2);
        for (int l = 0; l < 16; l++) {
            const int lo = (b[6 + l] & 15) | (((qh >> l) & 1) << 4);
            const int hi = (b[6 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
            o[l] = ((float)lo - 16.0f) * d;
            o[l + 16] = ((float)hi - 16.0f) * d;
        }
    }
}

static void row_q5_1(const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += QT_Q5_1_BYTES, o += QT_Q5_1_BLOCK) {
        const float d = h2f(b), m = h2f(b + 2);
        const uint32_t qh = le32(b + 4);
        for (int l = 0; l < 16; l++) {
            const int lo = (b[8 + l] & 15) | (((qh >> l) & 1) << 4);
            const int hi = (b[8 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
            o[l] = (float)lo * d + m;
            o[l + 16] = (float)hi * d + m;
        }
    }
}

/* ggml get_scale_min_k4: the 6-bit scale and min of sub-block j from a K block's 12 scale bytes */
static inline void scale_min_k4(int j, const uint8_t *s, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* d * scale and dmin * min (float32 products, as ggml) of sub-blocks 2j and 2j + 1 of a Q4_K / Q5_K block */
static inline void k_pair(const uint8_t *b, float d, float dmin, int j, float *d0, float *mm0, float *d1, float *mm1) {
    int sc0, m0, sc1, m1;
    scale_min_k4(2 * j, b + 4, &sc0, &m0);
    scale_min_k4(2 * j + 1, b + 4, &sc1, &m1);
    *d0 = d * (float)sc0, *mm0 = dmin * (float)m0;
    *d1 = d * (float)sc1, *mm1 = dmin * (float)m1;
}

static void row_q4_k(const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += QT_Q4_K_BYTES, o += QT_Q4_K_BLOCK) {
        const float d = h2f(b), dmin = h2f(b + 2);
        const uint8_t *qs = b + 16;
        for (int j = 0; j < 4; j++) {
            float d0, mm0, d1, mm1;
            k_pair(b, d, dmin, j, &d0, &mm0, &d1, &mm1);
            float *oj = o + 64 * j;
            for (int l = 0; l < 32; l++) {
                oj[l] = (float)(qs[32 * j + l] & 15) * d0 - mm0;
                oj[l + 32] = (float)(qs[32 * j + l] >> 4) * d1 - mm1;
            }
        }
    }
}

static void row_q5_k(const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += QT_Q5_K_BYTES, o += QT_Q5_K_BLOCK) {
        const float d = h2f(b), dmin = h2f(b + 2);
        const uint8_t *qh = b + 16, *qs = b + 48;
        for (int j = 0; j < 4; j++) {
            float d0, mm0, d1, mm1;
            k_pair(b, d, dmin, j, &d0, &mm0, &d1, &mm1);
            float *oj = o + 64 * j;
            for (int l = 0; l < 32; l++) {
                const int lo = (qs[32 * j + l] & 15) | (((qh[l] >> (2 * j)) & 1) << 4);
                const int hi = (qs[32 * j + l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4);
                oj[l] = (float)lo * d0 - mm0;
                oj[l + 32] = (float)hi * d1 - mm1;
            }
        }
    }
}

static void row_q6_k(const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += QT_Q6_K_BYTES, o += QT_Q6_K_BLOCK) {
        const float d = h2f(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int n = 0; n < 2; n++) {
            const uint8_t *ql = b + 64 * n, *qh = b + 128 + 32 * n;
            for (int k = 0; k < 4; k++) {
                const float s0 = d * (float)sc[8 * n + 2 * k], s1 = d * (float)sc[8 * n + 2 * k + 1];
                float *ok = o + 128 * n + 32 * k;
                const uint8_t *qlk = ql + 32 * (k & 1);
                for (int l = 0; l < 32; l++) {
                    const int lowbits = k < 2 ? (qlk[l] & 15) : (qlk[l] >> 4);
                    const int q = lowbits | (((qh[l] >> (2 * k)) & 3) << 4);
                    ok[l] = ((float)q - 32.0f) * (l < 16 ? s0 : s1);
                }
            }
        }
    }
}

typedef void (*row_fn)(const uint8_t *, int64_t, float *);
/* code: ggml's type id (QT_*, kernels.py TYPE_CODES) */
static const struct { int code, block; row_fn row; } ROWS[] = {
    {QT_Q8_0, QT_Q8_0_BLOCK, row_q8_0}, {QT_Q4_0, QT_Q4_0_BLOCK, row_q4_0}, {QT_Q4_1, QT_Q4_1_BLOCK, row_q4_1},
    {QT_Q5_0, QT_Q5_0_BLOCK, row_q5_0}, {QT_Q5_1, QT_Q5_1_BLOCK, row_q5_1}, {QT_Q4_K, QT_Q4_K_BLOCK, row_q4_k},
    {QT_Q5_K, QT_Q5_K_BLOCK, row_q5_k}, {QT_Q6_K, QT_Q6_K_BLOCK, row_q6_k},
};

/* out[r, :n_cols] (row stride out_stride floats) = rows r of raw (row stride raw_stride bytes);
 * returns 0, or -1 for an unknown type or a width that is no whole number of blocks. */
int lt_dequant(int code, const uint8_t *raw, int64_t raw_stride, int64_t rows, int64_t n_cols, float *out,
               int64_t out_stride) {
    for (size_t k = 0; k < sizeof(ROWS) / sizeof(ROWS[0]); k++) {
        if (ROWS[k].code != code) continue;
        if (n_cols % ROWS[k].block) return -1;
        for (int64_t r = 0; r < rows; r++) ROWS[k].row(raw + r * raw_stride, n_cols / ROWS[k].block, out + r * out_stride);
        return 0;
    }
    return -1;
}

/* Activation rows rounded as ggml-cpu's quantize_row_q8_0 / q8_1 (x86) and decoded back, step for
 * step quant/matmul.py's _round_q8_0: per block of 32, d = amax / 127, q = rint(x * 127 / amax),
 * x~ = q * fp16(d); with_sum (Q8_1) also the correction fp16(d * sum q) - fp16(d) * sum q per
 * block into corr [rows, n / 32]. Needs the compiler's _Float16 (its conversions round to nearest
 * even, as numpy's float16 cast); returns -1 without it (numpy then rounds). */
int lt_round_q8(const float *x, int64_t rows, int64_t n, int with_sum, float *xr, float *corr) {
#ifdef __FLT16_MAX__
    if (n % 32) return -1;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < n / 32; b++) {
            const float *xb = x + r * n + 32 * b;
            float *ob = xr + r * n + 32 * b;
            uint32_t amax_bits = 0;  /* the largest magnitude bit pattern, as the numpy path's integer max */
            for (int l = 0; l < 32; l++) {
                uint32_t u;
                memcpy(&u, xb + l, 4);
                u &= 0x7FFFFFFFu;
                amax_bits = u > amax_bits ? u : amax_bits;
            }
            float amax;
            memcpy(&amax, &amax_bits, 4);
            const float d = amax / 127.0f, inv = amax != 0.0f ? 127.0f / amax : 0.0f;
            const float dh = (float)(_Float16)d;
            float sq = 0.0f;
            for (int l = 0; l < 32; l++) {
                const float q = __builtin_rintf(xb[l] * inv);
                sq += q;  /* integers below 2^24: exact in any order */
                ob[l] = q * dh;
            }
            if (with_sum) corr[r * (n / 32) + b] = (float)(_Float16)(d * sq) - dh * sq;
        }
    }
    return 0;
#else
    (void)x, (void)rows, (void)n, (void)with_sum, (void)xr, (void)corr;
    return -1;
#endif
}
