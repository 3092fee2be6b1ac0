/* Row norms and the gated activation: rms_norm (one call's rows, and a pass's rows and input
 * gradient over the pool) and swiglu with its backward. */
#include "pool.h"

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

/* sigmoid as numpy's kernels compute it: 1 / (1 + exp(-g)) */
static inline float sigmoid1(float g) { return 1.0f / (1.0f + expf(-g)); }
#if LT_VEXP
static inline __m512 sigmoid16(__m512 g) {
    const __m512 one = _mm512_set1_ps(1.0f);
    return _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}
#endif

/* silu(g) u as numpy's kernel: sigmoid(g) g, times u */
void swiglu(const float *g, const float *u, float *o, int64_t n) {
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
