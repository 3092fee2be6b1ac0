/* Blockwise causal attention. The forward of ops.flash_attn (backends/cpu_attention.py k_flash_attn;
 * llama.cpp's ggml_flash_attn_ext) for evaluation passes past PLAIN_ATTENTION_MAX_T positions,
 * where numpy's block walk spent a fifth of a SmolLM2 f32 perplexity run in Python-sized pieces.
 * One task is FA_QB queries of one head; it keeps their scores transposed (key-major, S^T[s][r]),
 * so a query's running max, sum and rescale are lanes of a vector and the causal or window mask is
 * a lane mask per key. Per block of FA_KB keys: S^T = K Q^T (K rows broadcast, Q^T packed once),
 * scaled and masked; the online softmax (running max m, sum l, earlier sums rescaled by exp(m_old -
 * m), a row that sees no key yet keeps m = 0, as numpy's kernel does); O^T = O^T alpha + V^T P^T (V
 * rows broadcast). Outputs are O / l and the row logsumexp m + log(l) (the backward's input). Every
 * output is computed by one task in one order, so threads move no bit; against numpy only the
 * summation order and the vector exp differ (tests/test_native_attention.py states the tolerance).
 * AVX-512 only. */
#include "pool.h"

/* The compiled blockwise attention (lt_flash_attn, lt_flash_attn_back) is built in (1) or not (0). */
int lt_attention_built(void) { return LT_VEXP; }

#define FA_QB 32
#define FA_KB 64

typedef struct {
    const float *q, *k, *v;
    float *o, *lse;
    int64_t B, T, H, Hkv, d, window, n_qblk;
    float scale;
    atomic_int failed;  /* a thread found no memory for its scratch */
} fa_job_t;

#if LT_VEXP
/* st[i][*] = k_i . Q^T for nk <= 8 key rows (row stride ks): 8 keys x 32 queries per register pass */
static void fa_scores(const float *k, int64_t ks, const float *qt, int64_t d, float *st, int nk) {
    const float *kr[8];
    for (int i = 0; i < 8; i++) kr[i] = k + (i < nk ? i : nk - 1) * ks;
    __m512 c[8][2];
    for (int i = 0; i < 8; i++) c[i][0] = c[i][1] = _mm512_setzero_ps();
    for (int64_t jj = 0; jj < d; jj++) {
        const __m512 b0 = _mm512_load_ps(qt + jj * FA_QB), b1 = _mm512_load_ps(qt + jj * FA_QB + 16);
        for (int i = 0; i < 8; i++) {
            const __m512 a = _mm512_set1_ps(kr[i][jj]);
            c[i][0] = _mm512_fmadd_ps(a, b0, c[i][0]);
            c[i][1] = _mm512_fmadd_ps(a, b1, c[i][1]);
        }
    }
    for (int i = 0; i < nk; i++) {
        _mm512_store_ps(st + i * FA_QB, c[i][0]);
        _mm512_store_ps(st + i * FA_QB + 16, c[i][1]);
    }
}

/* rows c0 .. c0 + nc - 1 (nc <= 8) of O^T: ot = ot * alpha + sum_i v_i[c] P^T[i] over nk keys */
static void fa_values(const float *v, int64_t ks, const float *pt, int64_t nk, float *ot, int nc, __m512 a0, __m512 a1) {
    __m512 c[8][2];
    for (int cc = 0; cc < 8; cc++) {
        const int src = cc < nc ? cc : nc - 1;  /* past the rows: computed, not stored */
        c[cc][0] = _mm512_mul_ps(_mm512_load_ps(ot + src * FA_QB), a0);
        c[cc][1] = _mm512_mul_ps(_mm512_load_ps(ot + src * FA_QB + 16), a1);
    }
    for (int64_t i = 0; i < nk; i++) {
        const __m512 p0 = _mm512_load_ps(pt + i * FA_QB), p1 = _mm512_load_ps(pt + i * FA_QB + 16);
        const float *vr = v + i * ks;
        for (int cc = 0; cc < 8; cc++) {
            const __m512 a = _mm512_set1_ps(vr[cc < nc ? cc : nc - 1]);
            c[cc][0] = _mm512_fmadd_ps(a, p0, c[cc][0]);
            c[cc][1] = _mm512_fmadd_ps(a, p1, c[cc][1]);
        }
    }
    for (int cc = 0; cc < nc; cc++) {
        _mm512_store_ps(ot + cc * FA_QB, c[cc][0]);
        _mm512_store_ps(ot + cc * FA_QB + 16, c[cc][1]);
    }
}

/* The lanes r of queries t0 + r that see key s: s <= t0 + r, and t0 + r - s < window (if any). */
static inline __mmask16 fa_visible(int64_t s, int64_t t0, int64_t lane0, int64_t window) {
    const int64_t lo = s - t0 - lane0, hi = window ? lo + window : 16;  /* lanes [lo, hi) */
    const int64_t a = lo < 0 ? 0 : lo > 16 ? 16 : lo, b = hi < 0 ? 0 : hi > 16 ? 16 : hi;
    if (a >= b) return 0;
    return (__mmask16)((((uint32_t)1 << b) - 1) & ~(((uint32_t)1 << a) - 1));
}

/* dst[c][r] = src row r's element c for r < nq (rows rs floats apart), 0 past them */
static void fa_pack_t(float *dst, const float *src, int64_t rs, int64_t nq, int64_t d) {
    for (int64_t c = 0; c < d; c++)
        for (int64_t r = 0; r < FA_QB; r++) dst[c * FA_QB + r] = r < nq ? src[r * rs + c] : 0.f;
}

static __thread float *fa_buf = NULL;
static __thread int64_t fa_cap = 0;

/* A thread's scratch (Q^T, O^T, one block of S^T), 64-byte aligned, kept for its next call. */
static float *fa_scratch(int64_t floats) {
    if (fa_cap < floats) {
        free(fa_buf);
        fa_buf = aligned_alloc(64, (size_t)((floats * 4 + 63) / 64 * 64));
        fa_cap = fa_buf ? floats : 0;
    }
    return fa_buf;
}

static void fa_task(void *arg, int64_t chunk) {
    fa_job_t *j = arg;
    float *qt = fa_scratch((2 * j->d + FA_KB) * FA_QB);
    if (!qt) {
        atomic_store(&j->failed, 1);
        return;
    }
    const int64_t heads = j->B * j->H, qi = j->n_qblk - 1 - chunk / heads;  /* the longest rows first */
    const int64_t b = (chunk % heads) / j->H, h = chunk % j->H, kvh = h / (j->H / j->Hkv);
    const int64_t d = j->d, T = j->T, t0 = qi * FA_QB, nq = T - t0 < FA_QB ? T - t0 : FA_QB;
    const int64_t qs = j->H * d, ks = j->Hkv * d;  /* floats from one position to the next */
    const float *q = j->q + (b * T * j->H + h) * d;
    const float *k = j->k + (b * T * j->Hkv + kvh) * d, *v = j->v + (b * T * j->Hkv + kvh) * d;
    float *ot = qt + d * FA_QB, *st = ot + d * FA_QB;
    fa_pack_t(qt, q + t0 * qs, qs, nq, d);
    memset(ot, 0, (size_t)(d * FA_QB) * sizeof(float));
    const __m512 ninf = _mm512_set1_ps(-INFINITY), zero = _mm512_setzero_ps(), scale = _mm512_set1_ps(j->scale);
    __m512 m0 = ninf, m1 = ninf, l0 = zero, l1 = zero;
    const int64_t first = j->window && t0 - j->window + 1 > 0 ? t0 - j->window + 1 : 0, end = t0 + nq;
    for (int64_t s0 = first; s0 < end; s0 += FA_KB) {
        const int64_t nk = end - s0 < FA_KB ? end - s0 : FA_KB;
        for (int64_t i = 0; i < nk; i += 8) fa_scores(k + (s0 + i) * ks, ks, qt, d, st + i * FA_QB, nk - i < 8 ? (int)(nk - i) : 8);
        __m512 bm0 = ninf, bm1 = ninf;
        for (int64_t i = 0; i < nk; i++) {  /* scale, mask, the block's row max */
            const int64_t s = s0 + i;
            const __m512 x0 = _mm512_mask_mov_ps(ninf, fa_visible(s, t0, 0, j->window), _mm512_mul_ps(_mm512_load_ps(st + i * FA_QB), scale));
            const __m512 x1 = _mm512_mask_mov_ps(ninf, fa_visible(s, t0, 16, j->window), _mm512_mul_ps(_mm512_load_ps(st + i * FA_QB + 16), scale));
            _mm512_store_ps(st + i * FA_QB, x0);
            _mm512_store_ps(st + i * FA_QB + 16, x1);
            bm0 = _mm512_max_ps(bm0, x0);
            bm1 = _mm512_max_ps(bm1, x1);
        }
        __m512 n0 = _mm512_max_ps(m0, bm0), n1 = _mm512_max_ps(m1, bm1);
        n0 = _mm512_mask_mov_ps(n0, _mm512_cmp_ps_mask(n0, ninf, _CMP_EQ_OQ), zero);  /* no visible key yet */
        n1 = _mm512_mask_mov_ps(n1, _mm512_cmp_ps_mask(n1, ninf, _CMP_EQ_OQ), zero);
        const __m512 a0 = exp16(_mm512_sub_ps(m0, n0)), a1 = exp16(_mm512_sub_ps(m1, n1));
        __m512 sum0 = zero, sum1 = zero;
        for (int64_t i = 0; i < nk; i++) {
            const __m512 p0 = exp16(_mm512_sub_ps(_mm512_load_ps(st + i * FA_QB), n0));
            const __m512 p1 = exp16(_mm512_sub_ps(_mm512_load_ps(st + i * FA_QB + 16), n1));
            _mm512_store_ps(st + i * FA_QB, p0);
            _mm512_store_ps(st + i * FA_QB + 16, p1);
            sum0 = _mm512_add_ps(sum0, p0);
            sum1 = _mm512_add_ps(sum1, p1);
        }
        l0 = _mm512_add_ps(_mm512_mul_ps(l0, a0), sum0);
        l1 = _mm512_add_ps(_mm512_mul_ps(l1, a1), sum1);
        m0 = n0;
        m1 = n1;
        for (int64_t c0 = 0; c0 < d; c0 += 8)
            fa_values(v + s0 * ks + c0, ks, st, nk, ot + c0 * FA_QB, d - c0 < 8 ? (int)(d - c0) : 8, a0, a1);
    }
    float m[FA_QB], l[FA_QB];
    _mm512_storeu_ps(m, m0); _mm512_storeu_ps(m + 16, m1);
    _mm512_storeu_ps(l, l0); _mm512_storeu_ps(l + 16, l1);
    for (int64_t c = 0; c < d; c++) {  /* O / l a vector of queries at a time (a division is one either way) */
        _mm512_store_ps(ot + c * FA_QB, _mm512_div_ps(_mm512_load_ps(ot + c * FA_QB), l0));
        _mm512_store_ps(ot + c * FA_QB + 16, _mm512_div_ps(_mm512_load_ps(ot + c * FA_QB + 16), l1));
    }
    float *o = j->o + (b * T * j->H + h) * d, *lse = j->lse + (b * j->H + h) * T;
    for (int64_t r = 0; r < nq; r++) {
        for (int64_t c = 0; c < d; c++) o[(t0 + r) * qs + c] = ot[c * FA_QB + r];
        lse[t0 + r] = m[r] + logf(l[r]);
    }
}
#endif

/* The backward (cpu.k_flash_attn_back, FlashAttention-2's): per block P = exp(S - lse), dP = dO V^T,
 * dS = (dP - D) P scale with D = rowsum(dO * O), then dV = P^T dO, dK = dS^T Q, dQ = dS K. Two
 * passes, so that no output has two writers: one task per FAB_KB keys of a KV head (its dK and dV
 * over every query of the group that sees them), one per FA_QB queries of a head (its dQ); both
 * recompute their scores, in the forward's key-major layout (queries in vector lanes). */
typedef struct {
    const float *q, *k, *v, *o, *lse, *g;
    float *dq, *dk, *dv;
    int64_t B, T, H, Hkv, d, window, n_qblk, n_kblk;
    float scale;
    atomic_int failed;
    /* per query block of a head (index (b * H + h) * n_qblk + block), made once by fab_prep_task:
     * Q^T and dO^T [d][FA_QB], and the lanes' lse (+inf past the rows) and D = rowsum(dO * O) */
    float *qt, *gt, *lanes;
} fab_job_t;

#if LT_VEXP
/* One query block of one head, packed for both passes: Q^T, dO^T, and its lanes' lse (+inf past
 * the rows: P = 0 there) and D = rowsum(dO * O). */
static void fab_prep_task(void *arg, int64_t chunk) {
    fab_job_t *j = arg;
    const int64_t d = j->d, qs = j->H * d, bh = chunk / j->n_qblk, t0 = chunk % j->n_qblk * FA_QB;
    const int64_t nq = j->T - t0 < FA_QB ? j->T - t0 : FA_QB, base = (bh / j->H * j->T * j->H + bh % j->H) * d + t0 * qs;
    fa_pack_t(j->qt + chunk * d * FA_QB, j->q + base, qs, nq, d);
    fa_pack_t(j->gt + chunk * d * FA_QB, j->g + base, qs, nq, d);
    float *lse = j->lanes + chunk * 2 * FA_QB, *D = lse + FA_QB;
    const float *l = j->lse + bh * j->T + t0;
    for (int64_t r = 0; r < FA_QB; r++) {
        lse[r] = r < nq ? l[r] : INFINITY;
        float acc = 0.f;
        for (int64_t c = 0; r < nq && c < d; c++) acc += j->g[base + r * qs + c] * j->o[base + r * qs + c];
        D[r] = acc;
    }
}

/* For keys s0 .. s0 + nk - 1 against the block's queries (Q^T qt, dO^T gt packed): pt = P^T and
 * dst = dS^T, [nk][FA_QB] each (masked and padded lanes 0). */
static void fa_grad_block(const fab_job_t *j, const float *k, const float *v, int64_t ks, const float *qt, const float *gt,
                          const float *lse, const float *D, int64_t s0, int64_t nk, int64_t t0, float *pt, float *dst) {
    for (int64_t i = 0; i < nk; i += 8) {
        const int n8 = nk - i < 8 ? (int)(nk - i) : 8;
        fa_scores(k + (s0 + i) * ks, ks, qt, j->d, pt + i * FA_QB, n8);
        fa_scores(v + (s0 + i) * ks, ks, gt, j->d, dst + i * FA_QB, n8);
    }
    const __m512 scale = _mm512_set1_ps(j->scale), zero = _mm512_setzero_ps();
    for (int64_t i = 0; i < nk; i++)
        for (int half = 0; half < 2; half++) {
            const int64_t at = i * FA_QB + 16 * half;
            const __mmask16 seen = fa_visible(s0 + i, t0, 16 * half, j->window);
            const __m512 x = _mm512_sub_ps(_mm512_mul_ps(_mm512_load_ps(pt + at), scale), _mm512_loadu_ps(lse + 16 * half));
            const __m512 p = _mm512_mask_mov_ps(zero, seen, exp16(x));
            const __m512 ds = _mm512_mul_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_load_ps(dst + at), _mm512_loadu_ps(D + 16 * half)), p), scale);
            _mm512_store_ps(pt + at, p);
            _mm512_store_ps(dst + at, ds);
        }
}

/* acc[i][c] += sum_r coef[i][r] rows[r][c] for i < nk (acc rows d floats apart), r < nq (rows
 * rs floats apart): 4 keys x 64 columns of accumulators per register pass */
static void fa_rows_acc(float *acc, const float *coef, int64_t nk, const float *rows, int64_t rs, int64_t nq, int64_t d) {
    for (int64_t i0 = 0; i0 < nk; i0 += 4) {
        const int ni = nk - i0 < 4 ? (int)(nk - i0) : 4;
        for (int64_t c0 = 0; c0 < d; c0 += 64) {
            __mmask16 m[4];
            for (int vv = 0; vv < 4; vv++) m[vv] = gemm_mask((int)(d - c0 < 64 ? d - c0 : 64), vv);
            __m512 a[4][4];
            for (int ii = 0; ii < 4; ii++)
                for (int vv = 0; vv < 4; vv++)
                    a[ii][vv] = ii < ni ? _mm512_maskz_loadu_ps(m[vv], acc + (i0 + ii) * d + c0 + 16 * vv) : _mm512_setzero_ps();
            for (int64_t r = 0; r < nq; r++) {
                __m512 x[4];
                for (int vv = 0; vv < 4; vv++) x[vv] = _mm512_maskz_loadu_ps(m[vv], rows + r * rs + c0 + 16 * vv);
                for (int ii = 0; ii < 4; ii++) {
                    const __m512 cf = _mm512_set1_ps(coef[(i0 + (ii < ni ? ii : 0)) * FA_QB + r]);
                    for (int vv = 0; vv < 4; vv++) a[ii][vv] = _mm512_fmadd_ps(cf, x[vv], a[ii][vv]);
                }
            }
            for (int ii = 0; ii < ni; ii++)
                for (int vv = 0; vv < 4; vv++) _mm512_mask_storeu_ps(acc + (i0 + ii) * d + c0 + 16 * vv, m[vv], a[ii][vv]);
        }
    }
}

/* floats of a thread's scratch for the backward: dQ^T, P^T, dS^T, dK and dV tiles */
static int64_t fab_floats(int64_t d) { return d * FA_QB + 2 * FA_KB * FA_QB + 2 * FA_KB * d; }

/* keys per dK/dV task: a block of its own, smaller than the forward's, so that a short sequence's
 * few KV heads still give every thread tasks (the first block sees every query, the last few) */
#define FAB_KB 32

static void fab_keys_task(void *arg, int64_t chunk) {  /* dK, dV of FAB_KB keys of one KV head */
    fab_job_t *j = arg;
    float *pt = fa_scratch(fab_floats(j->d));
    if (!pt) { atomic_store(&j->failed, 1); return; }
    const int64_t d = j->d, T = j->T, G = j->H / j->Hkv, ks = j->Hkv * d, qs = j->H * d;
    const int64_t b = chunk / (j->Hkv * j->n_kblk), kvh = chunk / j->n_kblk % j->Hkv, s0 = chunk % j->n_kblk * FAB_KB;
    const int64_t nk = T - s0 < FAB_KB ? T - s0 : FAB_KB;
    float *dst = pt + FA_KB * FA_QB, *dk = dst + FA_KB * FA_QB, *dv = dk + FA_KB * d;
    const float *k = j->k + (b * T * j->Hkv + kvh) * d, *v = j->v + (b * T * j->Hkv + kvh) * d;
    memset(dk, 0, (size_t)(2 * FA_KB * d) * sizeof(float));
    /* the queries that see some key of the block: from the block's first key to its last + window */
    const int64_t t_end = j->window && s0 + nk - 1 + j->window < T ? s0 + nk - 1 + j->window : T;
    for (int64_t g = 0; g < G; g++) {
        const int64_t h = kvh * G + g;
        const float *q = j->q + (b * T * j->H + h) * d, *go = j->g + (b * T * j->H + h) * d;
        for (int64_t t0 = s0 / FA_QB * FA_QB; t0 < t_end; t0 += FA_QB) {
            const int64_t nq = T - t0 < FA_QB ? T - t0 : FA_QB, blk = (b * j->H + h) * j->n_qblk + t0 / FA_QB;
            const float *lse = j->lanes + blk * 2 * FA_QB;
            fa_grad_block(j, k, v, ks, j->qt + blk * d * FA_QB, j->gt + blk * d * FA_QB, lse, lse + FA_QB, s0, nk, t0,
                          pt, dst);
            fa_rows_acc(dv, pt, nk, go + t0 * qs, qs, nq, d);
            fa_rows_acc(dk, dst, nk, q + t0 * qs, qs, nq, d);
        }
    }
    for (int64_t i = 0; i < nk; i++) {
        memcpy(j->dk + (b * T * j->Hkv + kvh) * d + (s0 + i) * ks, dk + i * d, (size_t)d * sizeof(float));
        memcpy(j->dv + (b * T * j->Hkv + kvh) * d + (s0 + i) * ks, dv + i * d, (size_t)d * sizeof(float));
    }
}

static void fab_queries_task(void *arg, int64_t chunk) {  /* dQ of FA_QB queries of one head */
    fab_job_t *j = arg;
    float *dqt = fa_scratch(fab_floats(j->d));
    if (!dqt) { atomic_store(&j->failed, 1); return; }
    const int64_t heads = j->B * j->H, qi = j->n_qblk - 1 - chunk / heads;
    const int64_t b = (chunk % heads) / j->H, h = chunk % j->H, kvh = h / (j->H / j->Hkv);
    const int64_t d = j->d, T = j->T, t0 = qi * FA_QB, nq = T - t0 < FA_QB ? T - t0 : FA_QB;
    const int64_t qs = j->H * d, ks = j->Hkv * d, blk = (b * j->H + h) * j->n_qblk + qi;
    float *pt = dqt + d * FA_QB, *dst = pt + FA_KB * FA_QB;
    const float *k = j->k + (b * T * j->Hkv + kvh) * d, *v = j->v + (b * T * j->Hkv + kvh) * d;
    const float *qt = j->qt + blk * d * FA_QB, *gt = j->gt + blk * d * FA_QB, *lse = j->lanes + blk * 2 * FA_QB;
    memset(dqt, 0, (size_t)(d * FA_QB) * sizeof(float));
    const __m512 one = _mm512_set1_ps(1.0f);
    const int64_t first = j->window && t0 - j->window + 1 > 0 ? t0 - j->window + 1 : 0, end = t0 + nq;
    for (int64_t s0 = first; s0 < end; s0 += FA_KB) {
        const int64_t nk = end - s0 < FA_KB ? end - s0 : FA_KB;
        fa_grad_block(j, k, v, ks, qt, gt, lse, lse + FA_QB, s0, nk, t0, pt, dst);
        for (int64_t c0 = 0; c0 < d; c0 += 8)
            fa_values(k + s0 * ks + c0, ks, dst, nk, dqt + c0 * FA_QB, d - c0 < 8 ? (int)(d - c0) : 8, one, one);
    }
    float *dq = j->dq + (b * T * j->H + h) * d;
    for (int64_t r = 0; r < nq; r++)
        for (int64_t c = 0; c < d; c++) dq[(t0 + r) * qs + c] = dqt[c * FA_QB + r];
}
#endif

/* dq [B, T, H, d], dk and dv [B, T, Hkv, d] of lt_flash_attn from its inputs, its outputs o and
 * lse, and the output's gradient g (all contiguous float32). Returns 0, -1 where this build has
 * no vector exp, -2 when out of memory. */
int lt_flash_attn_back(const float *q, const float *k, const float *v, const float *o, const float *lse, const float *g,
                       float *dq, float *dk, float *dv, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t d,
                       float scale, int64_t window, int nth) {
#if LT_VEXP
    if (B <= 0 || T <= 0 || d <= 0 || Hkv <= 0 || H % Hkv) return -1;
    if (nth <= 0) nth = atomic_load(&gemm_threads);
    fab_job_t job = {q, k, v, o, lse, g, dq, dk, dv, B, T, H, Hkv, d, window, (T + FA_QB - 1) / FA_QB,
                     (T + FAB_KB - 1) / FAB_KB, scale, 0, NULL, NULL, NULL};
    const int64_t blocks = B * H * job.n_qblk, tile = d * FA_QB;
    float *prep = aligned_alloc(64, (size_t)(blocks * (2 * tile + 2 * FA_QB)) * sizeof(float));
    if (!prep) return -2;
    job.qt = prep, job.gt = prep + blocks * tile, job.lanes = prep + 2 * blocks * tile;
    pool_run(fab_prep_task, &job, blocks, nth);
    pool_run(fab_keys_task, &job, B * Hkv * job.n_kblk, nth);
    pool_run(fab_queries_task, &job, blocks, nth);
    free(prep);
    return atomic_load(&job.failed) ? -2 : 0;
#else
    (void)q; (void)k; (void)v; (void)o; (void)lse; (void)g; (void)dq; (void)dk; (void)dv; (void)B; (void)T; (void)H;
    (void)Hkv; (void)d; (void)scale; (void)window; (void)nth;
    return -1;
#endif
}

/* O [B, T, H, d] and the row logsumexp lse [B, H, T] (= [B, Hkv, G, T]) of causal attention over
 * q [B, T, H, d], k and v [B, T, Hkv, d], all contiguous float32; scale multiplies the scores,
 * window > 0 limits a query to the last `window` keys. nth threads (0: lt_set_gemm_threads's).
 * Returns 0, -1 where this build has no vector exp (AVX-512), -2 when out of memory. */
int lt_flash_attn(const float *q, const float *k, const float *v, float *o, float *lse, int64_t B, int64_t T,
                  int64_t H, int64_t Hkv, int64_t d, float scale, int64_t window, int nth) {
#if LT_VEXP
    if (B <= 0 || T <= 0 || d <= 0 || Hkv <= 0 || H % Hkv) return -1;
    if (nth <= 0) nth = atomic_load(&gemm_threads);
    fa_job_t job = {q, k, v, o, lse, B, T, H, Hkv, d, window, (T + FA_QB - 1) / FA_QB, scale, 0};
    pool_run(fa_task, &job, B * H * job.n_qblk, nth);
    return atomic_load(&job.failed) ? -2 : 0;
#else
    (void)q; (void)k; (void)v; (void)o; (void)lse; (void)B; (void)T; (void)H; (void)Hkv; (void)d; (void)scale;
    (void)window; (void)nth;
    return -1;
#endif
}
