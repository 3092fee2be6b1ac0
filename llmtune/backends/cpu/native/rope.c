/* Rope. Norm-mode rope of float32 pairs over x [B, T, H, d] with tables cos2, sin2 [T, d] (each
 * pair's cos twice; -sin, sin): out = x * cos2 + swap(x) * sin2, the products and the sum each
 * rounded as backends/cpu_attention.py _rope_pairs rounds them, so every value is numpy's, bit for bit. Rows
 * (b, t) over the pool (nth 0: the compiled count). */
#include "pool.h"

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
