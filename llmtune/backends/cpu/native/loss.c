/* The loss over the vocabulary, rows of logits x [rows, n]: the row logsumexp max + log(sum(exp(x -
 * max))) and the logits' gradient of the cross-entropy or per-token nll, (exp(x - lse) -
 * onehot(target)) w with w the row's weight (0 on a row whose target is negative), as numpy's
 * k_logsumexp, k_cross_entropy_back and k_token_nll_back write them, one pass a row over the pool
 * (LOSS_ROWS rows a task): a training step's 49,152-wide rows took numpy three to four passes
 * each. The exp is the vector one (within ~1 ulp of numpy's), the sum in double lanes in a fixed
 * order, so every value is within float32 rounding of numpy's and the same on any thread count. */
#include "pool.h"

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
