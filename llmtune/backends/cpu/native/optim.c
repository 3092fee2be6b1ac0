/* Optimizer updates in one pass over memory (backends/cpu/optim.py adamw_range is the reference: the
 * same float32 operations in the same order, each rounded, built with -ffp-contract=off so no
 * multiply-add is fused, and sqrt and division correctly rounded in both), so every weight and
 * moment is the numpy path's, bit for bit. numpy's blocked update makes eleven trips through a
 * cache-sized block; this one reads w, g, m, v once and writes w, m, v once: a full finetune's
 * AdamW over 135M values is memory-bound. Single-threaded: the caller splits a buffer over the
 * cores (threads.parallel_ranges), each range one call. */
#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* ggml_opt_step_adamw as optim.py adamw_range writes it, for n elements:
 *   m = m * b1 + g * omb1;  v = v * b2 + (g * g) * omb2;
 *   u = (m / (sqrt(v * c2) + eps)) * lrc1;  w = w * keep (if decay);  w = w - u
 * with the constants already rounded to float32 as numpy rounds a Python float against a float32
 * array (omb1 = 1 - beta1, omb2 = 1 - beta2, c2 = 1 / (1 - beta2^t), lrc1 = lr / (1 - beta1^t)). */
void lt_adamw(float *w, const float *g, float *m, float *v, int64_t n, float b1, float omb1, float b2, float omb2,
              float c2, float eps, float lrc1, float keep, int decay) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 vb1 = _mm512_set1_ps(b1), vomb1 = _mm512_set1_ps(omb1), vb2 = _mm512_set1_ps(b2),
                 vomb2 = _mm512_set1_ps(omb2), vc2 = _mm512_set1_ps(c2), veps = _mm512_set1_ps(eps),
                 vlr = _mm512_set1_ps(lrc1), vkeep = _mm512_set1_ps(keep);
    for (; i + 16 <= n; i += 16) {
        const __m512 gi = _mm512_loadu_ps(g + i);
        const __m512 mi = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(m + i), vb1), _mm512_mul_ps(gi, vomb1));
        const __m512 vi = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(v + i), vb2),
                                        _mm512_mul_ps(_mm512_mul_ps(gi, gi), vomb2));
        const __m512 den = _mm512_add_ps(_mm512_sqrt_ps(_mm512_mul_ps(vi, vc2)), veps);
        const __m512 u = _mm512_mul_ps(_mm512_div_ps(mi, den), vlr);
        __m512 wi = _mm512_loadu_ps(w + i);
        if (decay) wi = _mm512_mul_ps(wi, vkeep);
        _mm512_storeu_ps(m + i, mi);
        _mm512_storeu_ps(v + i, vi);
        _mm512_storeu_ps(w + i, _mm512_sub_ps(wi, u));
    }
#endif
    for (; i < n; i++) {
        const float mi = m[i] * b1 + g[i] * omb1;
        const float vi = v[i] * b2 + (g[i] * g[i]) * omb2;
        const float u = (mi / (sqrtf(vi * c2) + eps)) * lrc1;
        m[i] = mi;
        v[i] = vi;
        w[i] = (decay ? w[i] * keep : w[i]) - u;
    }
}

/* out[b] = sum of x[i]^2 over block b (block elements each, the last one shorter), in float64:
 * the step's gradient norm and its finiteness in one read (a float32 value squared in float64
 * cannot overflow, so a sum that is not finite means a NaN or inf in x). Each block sums in one
 * fixed order (sixteen lanes, then the lanes in order), so the partials do not depend on how the
 * caller splits the buffer over its threads. */
void lt_sum_squares(const float *x, int64_t n, int64_t block, double *out) {
    for (int64_t b0 = 0; b0 < n; b0 += block, out++) {
        const int64_t b1 = b0 + block < n ? b0 + block : n;
        double lane[16] = {0};
        int64_t i = b0;
#if defined(__AVX512F__)
        __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
        for (; i + 16 <= b1; i += 16) {
            const __m512d lo = _mm512_cvtps_pd(_mm256_loadu_ps(x + i)), hi = _mm512_cvtps_pd(_mm256_loadu_ps(x + i + 8));
            a0 = _mm512_fmadd_pd(lo, lo, a0);
            a1 = _mm512_fmadd_pd(hi, hi, a1);
        }
        _mm512_storeu_pd(lane, a0);
        _mm512_storeu_pd(lane + 8, a1);
#else
        for (; i + 16 <= b1; i += 16)
            for (int l = 0; l < 16; l++) lane[l] = fma((double)x[i + l], (double)x[i + l], lane[l]);
#endif
        double s = 0.0;
        for (int l = 0; l < 16; l++) s += lane[l];
        for (; i < b1; i++) s += (double)x[i] * (double)x[i];
        *out = s;
    }
}
