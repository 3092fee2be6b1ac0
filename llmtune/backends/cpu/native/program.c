/* Compiled programs: a replayed decode step (graph/planner.py Replay) as one call: lt_run executes
 * a list of steps, each one graph op on fixed buffers (llmtune/native/program.py encodes them), so the ~600
 * kernels of a token cost no Python call each. The products run on the pool as lt_qlinear /
 * lt_f32_linear do, and so do attention's matrix products (a head a chunk); the other small ops
 * (norms, rope, the softmax, activations) on the calling thread.
 * Each op computes what llmtune's numpy kernel (backends/cpu.py) computes, in the same operation
 * order where numpy's is known (elementwise ops, rope, the softmax's pairwise sum), so most are
 * bit for bit numpy's; exp and the attention products' summation order differ by float rounding
 * (tests/test_native.py states the tolerance). */
#include "pool.h"

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

/* dot_strided8 of a with four rows at once: each row's lanes and sums as dot_strided8's (its bits),
 * four independent chains of adds instead of one (a 64-wide head's dot waited on its adds' latency) */
static float sum8(const float *s) { return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])); }

static void dot4_strided8(const float *a, const float *b0, const float *b1, const float *b2, const float *b3,
                          int64_t n, float *out) {
#if defined(__AVX__)
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {  /* a multiply, then an add: dot_strided8's roundings (no fma) */
        const __m256 x = _mm256_loadu_ps(a + i);
        s0 = _mm256_add_ps(s0, _mm256_mul_ps(x, _mm256_loadu_ps(b0 + i)));
        s1 = _mm256_add_ps(s1, _mm256_mul_ps(x, _mm256_loadu_ps(b1 + i)));
        s2 = _mm256_add_ps(s2, _mm256_mul_ps(x, _mm256_loadu_ps(b2 + i)));
        s3 = _mm256_add_ps(s3, _mm256_mul_ps(x, _mm256_loadu_ps(b3 + i)));
    }
    float l0[8], l1[8], l2[8], l3[8];
    _mm256_storeu_ps(l0, s0), _mm256_storeu_ps(l1, s1), _mm256_storeu_ps(l2, s2), _mm256_storeu_ps(l3, s3);
    float r0 = sum8(l0), r1 = sum8(l1), r2 = sum8(l2), r3 = sum8(l3);
    for (; i < n; i++) {
        r0 += a[i] * b0[i];
        r1 += a[i] * b1[i];
        r2 += a[i] * b2[i];
        r3 += a[i] * b3[i];
    }
    out[0] = r0, out[1] = r1, out[2] = r2, out[3] = r3;
#else
    out[0] = dot_strided8(a, b0, n), out[1] = dot_strided8(a, b1, n);
    out[2] = dot_strided8(a, b2, n), out[3] = dot_strided8(a, b3, n);
#endif
}

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
    const int64_t ps = s->n[5];  /* the positions' stride per sequence: 0 shared, T per sequence */
    for (int64_t t = 0; t < (ps ? B * T : T); t++)
        if (pos[t] < 0 || pos[t] >= N) return -1;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++)
                memcpy(cache + ((b * H + h) * N + pos[b * ps + t]) * d, x + ((b * T + t) * H + h) * d, (size_t)d * 4);
    return 0;
}

#define PV_COLS 64  /* p v: output columns a row sums in registers at once (a head of 64: all) */

/* out[b0, b1, i, j] = sum_k a[b0, b1, i, k] b[b0, b1, k, j] (element strides; out contiguous):
 * matrix c = b0 * B1 + b1 of them, a chunk of the pool (one head of a decode step's attention) */
static void matmul_task(void *arg, int64_t c) {
    const lt_step *s = arg;
    const float *a = s->p[0], *b = s->p[1];
    float *out = s->p[2];
    const int64_t B1 = s->n[1], M = s->n[2], N = s->n[3], K = s->n[4];
    const int64_t sa0 = s->n[5], sa1 = s->n[6], sam = s->n[7], sak = s->n[8];
    const int64_t sb0 = s->n[9], sb1 = s->n[10], sbk = s->n[11], sbn = s->n[12];
    const int64_t i0 = c / B1, i1 = c % B1;
    const float *A = a + i0 * sa0 + i1 * sa1, *Bm = b + i0 * sb0 + i1 * sb1;
    float *O = out + (i0 * B1 + i1) * M * N;
    /* a causal softmax's positions (fused): n[13] > 0, positions per sequence of n[13] matrices */
    const int32_t *qpos = s->p[3] ? (const int32_t *)s->p[3] + (s->n[13] ? (i0 * B1 + i1) / s->n[13] * s->n[14] : 0)
                                  : NULL;
    if (sak == 1 && sbk == 1) {  /* rows against rows (q k^T) */
        for (int64_t i = 0; i < M; i++) {
            int64_t j0 = 0, j1 = N;
            if (s->p[3]) {  /* scores only a causal softmax reads: its visible keys only */
                const int64_t qp = qpos[i % s->n[14]];
                j1 = qp + 1 < N ? qp + 1 : N;
                if (s->n[15] > 0 && qp - s->n[15] + 1 > 0) j0 = qp - s->n[15] + 1;
            }
            const float *q = A + i * sam;
            int64_t j = j0;
            for (; j + 4 <= j1; j += 4)
                dot4_strided8(q, Bm + j * sbn, Bm + (j + 1) * sbn, Bm + (j + 2) * sbn, Bm + (j + 3) * sbn, K,
                              O + i * N + j);
            for (; j < j1; j++) O[i * N + j] = dot_strided8(q, Bm + j * sbn, K);
        }
    } else if (sbn == 1) {  /* rows of b scaled and summed (p v) */
        for (int64_t i = 0; i < M; i++) {
            float *o = O + i * N;
            int64_t k0 = 0, k1 = K;
            if (s->p[3]) {  /* probabilities of a causal softmax: its visible keys only */
                const int64_t qp = qpos[i % s->n[14]];
                k1 = qp + 1 < K ? (qp + 1 > 0 ? qp + 1 : 0) : K;
                if (s->n[15] > 0 && qp - s->n[15] + 1 > 0) k0 = qp - s->n[15] + 1 < k1 ? qp - s->n[15] + 1 : k1;
            }
            int64_t c = 0;
            for (; c + PV_COLS <= N; c += PV_COLS) {  /* a block of columns summed in registers */
                float acc[PV_COLS] = {0};
                for (int64_t k = k0; k < k1; k++) {
                    const float av = A[i * sam + k * sak];
                    if (av == 0.f) continue;  /* a masked probability: adds nothing */
                    const float *br = Bm + k * sbk + c;
                    for (int j = 0; j < PV_COLS; j++) acc[j] += av * br[j];
                }
                memcpy(o + c, acc, sizeof(acc));
            }
            for (int64_t j = c; j < N; j++) o[j] = 0.f;
            for (int64_t k = k0; k < k1 && c < N; k++) {
                const float av = A[i * sam + k * sak];
                if (av == 0.f) continue;
                const float *br = Bm + k * sbk;
                for (int64_t j = c; j < N; j++) o[j] += av * br[j];
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

/* The matrices over the pool (each one chunk, computed as on one thread: the same bits) */
static void op_matmul(const lt_step *s, int nth) {
    const int64_t n_mat = s->n[0] * s->n[1];
    if (nth > 1 && n_mat > 1) {
        pool_run(matmul_task, (void *)s, n_mat, nth);
        return;
    }
    for (int64_t c = 0; c < n_mat; c++) matmul_task((void *)s, c);
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
            /* n[7] > 0: positions per sequence, of n[7] leading rows each */
            const int64_t qp = pos ? pos[(s->n[7] ? l / s->n[7] * n_q : 0) + r % n_q] : n_past + r % n_q;
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
            if (type == QT_Q8_0) {  /* q d */
                const float d = h2f(b);
                for (int j = 0; j < QK; j++) o[j] = (float)((const int8_t *)(b + 2))[j] * d;
                b += QT_Q8_0_BYTES;
            } else if (type == QT_Q4_0) {  /* (q - 8) d */
                const float d = h2f(b);
                for (int j = 0; j < QK / 2; j++) {
                    o[j] = ((float)(b[2 + j] & 15) - 8.f) * d;
                    o[j + QK / 2] = ((float)(b[2 + j] >> 4) - 8.f) * d;
                }
                b += QT_Q4_0_BYTES;
            } else {  /* QT_Q4_1: q d + m */
                const float d = h2f(b), m = h2f(b + 2);
                for (int j = 0; j < QK / 2; j++) {
                    o[j] = (float)(b[4 + j] & 15) * d + m;
                    o[j + QK / 2] = (float)(b[4 + j] >> 4) * d + m;
                }
                b += QT_Q4_1_BYTES;
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
            case OP_MATMUL: op_matmul(s, nth); break;
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
