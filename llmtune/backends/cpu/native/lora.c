/* Adapter terms (ops.lora): y + ((s x A^T) B^T) and its gradients for x [M, n_in], A [r, n_in], B
 * [n_out, r]: every product has the rank r on one side, so each is a few multiply-adds per element
 * streamed, and numpy's six calls (plus a scale and an add) cost more in calls than in arithmetic.
 * Vectors always run along the long side (n_in, n_out), never along the rank, so rank 8 wastes no
 * lane. Each output is one task's sum in a fixed order (lanes over ascending blocks, then the lanes
 * in a fixed tree, then the tail), so the thread count moves no bit; backends/cpu.py k_lora and
 * k_lora_back are the reference (OpenBLAS sums in its own order: agreement within float32
 * rounding). */
#include "pool.h"

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
