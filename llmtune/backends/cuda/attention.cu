// ------------------------------------------------------------------ attention softmax (one block per row)
// Row r is query position p = n_past + r % n_q (has_pos: p = pos[r % n_q], positions given at run
// time; pos_rows > 0: positions per sequence pos[B, n_q], row r of sequence r / pos_rows is
// pos[r / pos_rows, r % n_q]) and sees keys 0..p, or with window > 0 only keys p - window + 1..p (llama.cpp's
// LLAMA_SWA_TYPE_STANDARD). x and out may alias: each element is read and then written by the same
// thread, after both reductions.
extern "C" __global__ void softmax_causal(const real* x, real* out, const int* __restrict__ pos, int has_pos,
                                          long long pos_rows, int n_kv, int n_q, int n_past, int window, real scale) {
    __shared__ real scratch[32];
    const long long row = blockIdx.x;
    const real* xr = x + row * n_kv;
    real* yr = out + row * n_kv;
    const int p = has_pos ? pos[(pos_rows ? row / pos_rows * n_q : 0) + row % n_q] : n_past + (int)(row % n_q);
    const int end = min(n_kv, p + 1);
    const int first = window > 0 ? max(0, p - window + 1) : 0;
    real mx = NEG_INF;
    for (int c = first + threadIdx.x; c < end; c += blockDim.x) mx = fmax(mx, xr[c] * scale);
    mx = block_reduce(mx, scratch, true);
    real sum = 0;
    for (int c = first + threadIdx.x; c < end; c += blockDim.x) sum += exp(xr[c] * scale - mx);
    sum = block_reduce(sum, scratch, false);
    for (int c = threadIdx.x; c < n_kv; c += blockDim.x)
        yr[c] = c >= first && c < end ? exp(xr[c] * scale - mx) / sum : (real)0;
}

// Row r of sequence b (rows_per_seq rows each) adds the run-time mask row mask[b, r % n_q] (0 or
// -inf; every row sees a key) before the softmax. x and out may alias, as in softmax_causal.
extern "C" __global__ void softmax_masked(const real* x, real* out, const real* __restrict__ mask, long long rows_per_seq,
                                          int n_kv, int n_q, real scale) {
    __shared__ real scratch[32];
    const long long row = blockIdx.x;
    const real* xr = x + row * n_kv;
    real* yr = out + row * n_kv;
    const real* mr = mask + ((row / rows_per_seq) * n_q + row % n_q) * n_kv;
    real mx = NEG_INF;
    for (int c = threadIdx.x; c < n_kv; c += blockDim.x) mx = fmax(mx, xr[c] * scale + mr[c]);
    mx = block_reduce(mx, scratch, true);
    real sum = 0;
    for (int c = threadIdx.x; c < n_kv; c += blockDim.x) sum += exp(xr[c] * scale + mr[c] - mx);
    sum = block_reduce(sum, scratch, false);
    for (int c = threadIdx.x; c < n_kv; c += blockDim.x) yr[c] = exp(xr[c] * scale + mr[c] - mx) / sum;
}

// dx = scale * y * (g - sum(g y))
extern "C" __global__ void softmax_back(const real* __restrict__ y, const real* __restrict__ g, real* __restrict__ out,
                                        int n, real scale) {
    __shared__ real scratch[32];
    const long long base = (long long)blockIdx.x * n;
    real dot = 0;
    for (int c = threadIdx.x; c < n; c += blockDim.x) dot += g[base + c] * y[base + c];
    dot = block_reduce(dot, scratch, false);
    for (int c = threadIdx.x; c < n; c += blockDim.x) out[base + c] = (g[base + c] - dot) * y[base + c] * scale;
}

// ------------------------------------------------------------------ blockwise attention (flash_attn)
// q [B, T, H, d], k/v [B, T, Hkv, d] contiguous; query head h reads KV head h / (H / Hkv). Row
// r = (b * H + h) * T + t of the logsumexp is query position t of head h. Query t sees keys
// fa_first(t)..t (window > 0: the last `window` positions, llama.cpp's LLAMA_SWA_TYPE_STANDARD).
// One block of FA_THREADS per row (a query row forward and for dq, a key row for dk/dv): no
// [T, T] matrix, scores recomputed where needed (FlashAttention-2), static shared memory only.
// FA_THREADS and FA_MAX_D (the head_dim bound: FA_MAX_D / FA_THREADS accumulators per thread) are
// #defines from attention.py's C_DEFINES, the numbers its launchers use.

__device__ __forceinline__ int fa_first(int t, int window) { return window > 0 ? max(0, t - window + 1) : 0; }

// The capped, scaled score of one query row against one key row (gemma2: cap * tanh(scale s / cap)).
__device__ __forceinline__ real fa_score(const real* qr, const real* kr, int d, real scale, real softcap) {
    real s = 0;
    for (int c = 0; c < d; ++c) s += qr[c] * kr[c];
    return softcap > 0 ? softcap * tanh(s * scale / softcap) : s * scale;
}

// d score / d (q.k): the scale, through the softcap's 1 - tanh^2 when there is one.
__device__ __forceinline__ real fa_dscore(real s, real scale, real softcap) {
    return softcap > 0 ? ((real)1 - (s / softcap) * (s / softcap)) * scale : scale;
}

__device__ __forceinline__ void fa_load_row(real* dst, const real* src, int d) {
    for (int c = threadIdx.x; c < d; c += blockDim.x) dst[c] = src[c];
    __syncthreads();
}

// Query row `row` = (b * H + h) * T + t of the forward and of dq: its position t, first visible
// key, offset in q / O / dO, and its KV head's keys and values (kstride apart per position).
struct FaQueryRow {
    int t, first;
    long long qoff, kstride;
    const real* kb;
    const real* vb;
};

__device__ __forceinline__ FaQueryRow fa_query_row(long long row, const real* k, const real* v, int T, int H, int Hkv,
                                                  int d, int window) {
    FaQueryRow r;
    r.t = (int)(row % T);
    const int h = (int)((row / T) % H);
    const long long b = row / ((long long)T * H);
    r.first = fa_first(r.t, window);
    r.kstride = (long long)Hkv * d;
    r.qoff = ((b * T + r.t) * H + h) * d;
    const long long kv = b * T * r.kstride + (long long)(h / (H / Hkv)) * d;
    r.kb = k + kv;
    r.vb = v + kv;
    return r;
}

// O and the row logsumexp: each thread keeps an online max/sum over its keys, the block merges
// them into lse, then keys are walked in chunks of FA_THREADS: p = exp(s - lse) into shared
// memory, and thread c accumulates sum_j p_j v_j[c] for its columns.
extern "C" __global__ void flash_attn_fwd(const real* __restrict__ q, const real* __restrict__ k, const real* __restrict__ v,
                                          real* __restrict__ out, real* __restrict__ lse, int T, int H, int Hkv, int d,
                                          real scale, real softcap, int window) {
    __shared__ real scratch[32];
    __shared__ real qs[FA_MAX_D];
    __shared__ real ps[FA_THREADS];
    const long long row = blockIdx.x;
    const FaQueryRow r = fa_query_row(row, k, v, T, H, Hkv, d, window);
    const int t = r.t, first = r.first;
    const long long kstride = r.kstride;
    const real *kb = r.kb, *vb = r.vb;
    fa_load_row(qs, q + r.qoff, d);
    real m = NEG_INF, l = 0;
    for (int j = first + threadIdx.x; j <= t; j += blockDim.x) {
        const real s = fa_score(qs, kb + j * kstride, d, scale, softcap);
        const real m_new = fmax(m, s);
        l = l * exp(m - m_new) + exp(s - m_new);
        m = m_new;
    }
    const real mx = block_reduce(m, scratch, true);
    const real sum = block_reduce(m == NEG_INF ? (real)0 : l * exp(m - mx), scratch, false);
    const real row_lse = mx + log(sum);
    real acc[FA_MAX_D / FA_THREADS];
    for (int i = 0; i < FA_MAX_D / FA_THREADS; ++i) acc[i] = 0;
    for (int j0 = first; j0 <= t; j0 += FA_THREADS) {
        const int j = j0 + threadIdx.x;
        ps[threadIdx.x] = j <= t ? exp(fa_score(qs, kb + j * kstride, d, scale, softcap) - row_lse) : (real)0;
        __syncthreads();
        const int n = min(FA_THREADS, t + 1 - j0);
        for (int c = threadIdx.x, i = 0; c < d; c += blockDim.x, ++i)
            for (int jj = 0; jj < n; ++jj) acc[i] += ps[jj] * vb[(j0 + jj) * kstride + c];
        __syncthreads();
    }
    real* orow = out + r.qoff;
    for (int c = threadIdx.x, i = 0; c < d; c += blockDim.x, ++i) orow[c] = acc[i];
    if (threadIdx.x == 0) lse[row] = row_lse;
}

// dq of one query row, and D = rowsum(dO * O) of it (saved for flash_attn_back_kv):
// dS_j = P_j (dP_j - D) d score_j, dP_j = dO . v_j, dq = sum_j dS_j k_j.
extern "C" __global__ void flash_attn_back_q(const real* __restrict__ q, const real* __restrict__ k,
                                             const real* __restrict__ v, const real* __restrict__ o,
                                             const real* __restrict__ lse, const real* __restrict__ g,
                                             real* __restrict__ dq, real* __restrict__ D, int T, int H, int Hkv, int d,
                                             real scale, real softcap, int window) {
    __shared__ real scratch[32];
    __shared__ real qs[FA_MAX_D];
    __shared__ real gs[FA_MAX_D];
    __shared__ real ds[FA_THREADS];
    const long long row = blockIdx.x;
    const FaQueryRow r = fa_query_row(row, k, v, T, H, Hkv, d, window);
    const int t = r.t, first = r.first;
    const long long kstride = r.kstride, qoff = r.qoff;
    const real *kb = r.kb, *vb = r.vb;
    fa_load_row(qs, q + qoff, d);
    fa_load_row(gs, g + qoff, d);
    real dot = 0;
    for (int c = threadIdx.x; c < d; c += blockDim.x) dot += gs[c] * o[qoff + c];
    const real Dr = block_reduce(dot, scratch, false), row_lse = lse[row];
    real acc[FA_MAX_D / FA_THREADS];
    for (int i = 0; i < FA_MAX_D / FA_THREADS; ++i) acc[i] = 0;
    for (int j0 = first; j0 <= t; j0 += FA_THREADS) {
        const int j = j0 + threadIdx.x;
        real dsj = 0;
        if (j <= t) {
            const real s = fa_score(qs, kb + j * kstride, d, scale, softcap);
            real dp = 0;
            for (int c = 0; c < d; ++c) dp += gs[c] * vb[j * kstride + c];
            dsj = exp(s - row_lse) * (dp - Dr) * fa_dscore(s, scale, softcap);
        }
        ds[threadIdx.x] = dsj;
        __syncthreads();
        const int n = min(FA_THREADS, t + 1 - j0);
        for (int c = threadIdx.x, i = 0; c < d; c += blockDim.x, ++i)
            for (int jj = 0; jj < n; ++jj) acc[i] += ds[jj] * kb[(j0 + jj) * kstride + c];
        __syncthreads();
    }
    for (int c = threadIdx.x, i = 0; c < d; c += blockDim.x, ++i) dq[qoff + c] = acc[i];
    if (threadIdx.x == 0) D[row] = Dr;
}

// dk, dv of one key row j of KV head hk: summed over the queries that see it, t = j..last, of
// every query head of the group (FA_THREADS (head, position) pairs per chunk):
// dv = sum P dO, dk = sum dS q.
extern "C" __global__ void flash_attn_back_kv(const real* __restrict__ q, const real* __restrict__ k,
                                              const real* __restrict__ v, const real* __restrict__ lse,
                                              const real* __restrict__ D, const real* __restrict__ g,
                                              real* __restrict__ dk, real* __restrict__ dv, int T, int H, int Hkv, int d,
                                              real scale, real softcap, int window) {
    __shared__ real ks[FA_MAX_D];
    __shared__ real vs[FA_MAX_D];
    __shared__ real ps[FA_THREADS];
    __shared__ real ds[FA_THREADS];
    __shared__ long long qrow[FA_THREADS];
    const long long row = blockIdx.x;
    const int j = (int)(row % T), hk = (int)((row / T) % Hkv);
    const long long b = row / ((long long)T * Hkv);
    const int G = H / Hkv;
    const int last = window > 0 ? min(T - 1, j + window - 1) : T - 1, n_t = last - j + 1;
    const long long koff = ((b * T + j) * Hkv + hk) * d;
    fa_load_row(ks, k + koff, d);
    fa_load_row(vs, v + koff, d);
    real acc_k[FA_MAX_D / FA_THREADS], acc_v[FA_MAX_D / FA_THREADS];
    for (int i = 0; i < FA_MAX_D / FA_THREADS; ++i) acc_k[i] = acc_v[i] = 0;
    for (int r0 = 0; r0 < G * n_t; r0 += FA_THREADS) {
        const int r = r0 + threadIdx.x;
        real p = 0, dsr = 0;
        long long off = 0;
        if (r < G * n_t) {
            const int h = hk * G + r / n_t, t = j + r % n_t;
            const long long lrow = (b * H + h) * T + t;
            off = ((b * T + t) * H + h) * d;
            const real s = fa_score(q + off, ks, d, scale, softcap);
            real dp = 0;
            for (int c = 0; c < d; ++c) dp += g[off + c] * vs[c];
            p = exp(s - lse[lrow]);
            dsr = p * (dp - D[lrow]) * fa_dscore(s, scale, softcap);
        }
        ps[threadIdx.x] = p;
        ds[threadIdx.x] = dsr;
        qrow[threadIdx.x] = off;
        __syncthreads();
        const int n = min(FA_THREADS, G * n_t - r0);
        for (int c = threadIdx.x, i = 0; c < d; c += blockDim.x, ++i)
            for (int rr = 0; rr < n; ++rr) {
                acc_v[i] += ps[rr] * g[qrow[rr] + c];
                acc_k[i] += ds[rr] * q[qrow[rr] + c];
            }
        __syncthreads();
    }
    for (int c = threadIdx.x, i = 0; c < d; c += blockDim.x, ++i) {
        dk[koff + c] = acc_k[i];
        dv[koff + c] = acc_v[i];
    }
}
