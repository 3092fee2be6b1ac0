/* Packed float32 products (GEMM).
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
#include "pool.h"

#define GEMM_MR 8
#define GEMM_NR 48
#define GEMM_MC 256
#define GEMM_KC 2048  /* a sum over more k (the vocabulary's input gradient) runs in blocks of this */

#if defined(__AVX512F__)
#define LT_GEMM 1
/* C[rows, cols] = A[rows, K] (rows of lda floats, broadcast as they are: 8 sequential streams
 * need no packing) . Bp (K x NR panel) */
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

/* The thread count of a product called with nth = 0 (native/kernels.py follows OpenBLAS's, so a
 * trainer's one-worker-per-core or one-thread steps hold for both). */
void lt_set_gemm_threads(int nth) { atomic_store(&gemm_threads, nth > 0 ? nth : 1); }

/* c[i, r] = a[i] . W[r] for i < m, r < n, W packed by lt_pack_wt; a rows of lda floats, c rows
 * of ldc floats. Chunks of GEMM_MC rows, split by W's panels until the threads have eight each (a
 * worker that wakes late still takes its share);
 * nth 0: lt_set_gemm_threads's count. Returns 0, or -1 where this build has no packed product. */
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
