"""CUDA backend: cupy arrays, cuBLAS for matmuls, RawKernels for everything else.

Importing this module never imports cupy: `available()` and `CUDABackend()` do, lazily, so a
CPU-only install (no cupy, no driver) can import every llmtune module.

The backend talks to the device through a small runtime object (`_CupyRuntime`): an array
module `xp` (cupy), `launch` for the RawKernels in KERNEL_SOURCE, `gemm` for
cublas<t>gemmStridedBatched, and host/device copies; tests swap in a CPU emulator of the same
interface (tests/cuda_emu.py). Kernel semantics follow backends/cpu.py op for op. KERNEL_SOURCE
is compiled once per float type, with `typedef <float|double> real;` in front, so float64
(gradient checks) costs nothing extra. Matmuls read transposed and permuted views in place
through cuBLAS's transpose flags and batch strides (plan_gemm); `precision="tf32"|"bf16"` runs
them on tensor cores with float32 accumulation.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from llmtune.backends.base import Backend
from llmtune.errors import LlmtuneError
from llmtune.quant.types import c_defines, qtype_of

KERNEL_SOURCE = r"""
// Everything below is compiled with `typedef float real;` or `typedef double real;` in front.
#define FULL_MASK 0xffffffffu
#define POS_INF ((real)__int_as_float(0x7f800000))
#define NEG_INF ((real)__int_as_float(0xff800000))
#define QUIET_NAN ((real)__int_as_float(0x7fc00000))
// Grid-stride loop: any grid size covers any n.
#define GRID_STRIDE(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (long long)blockDim.x * gridDim.x)

__device__ __forceinline__ real warp_reduce(real v, bool is_max) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        const real other = __shfl_xor_sync(FULL_MASK, v, offset);
        v = is_max ? fmax(v, other) : v + other;
    }
    return v;
}

// Sum or max over the whole block (blockDim.x a multiple of 32); every thread gets the result.
// `scratch` is 32 values of shared memory; the leading barrier lets consecutive calls reuse it.
__device__ real block_reduce(real v, real* scratch, bool is_max) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    v = warp_reduce(v, is_max);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < n_warps ? scratch[lane] : (is_max ? NEG_INF : (real)0);
        v = warp_reduce(v, is_max);
        if (lane == 0) scratch[0] = v;
    }
    __syncthreads();
    return scratch[0];
}

__device__ __forceinline__ real sigmoid(real x) { return (real)1 / ((real)1 + exp(-x)); }

// ------------------------------------------------------------------ embeddings
extern "C" __global__ void get_rows(const real* __restrict__ w, const int* __restrict__ ids, real* __restrict__ out,
                                    long long n_ids, int n_cols, int n_rows) {
    GRID_STRIDE(i, n_ids * n_cols) {
        const long long r = i / n_cols;
        const int c = (int)(i - r * n_cols);
        const int id = ids[r];
        out[i] = (id >= 0 && id < n_rows) ? w[(long long)id * n_cols + c] : QUIET_NAN;  // NaN flags a bad id
    }
}

// out (zeroed by the caller)[ids[r]] += g[r]: the gradient of get_rows; repeated ids meet in atomicAdd.
extern "C" __global__ void add_rows(const real* __restrict__ g, const int* __restrict__ ids, real* __restrict__ out,
                                    long long n_ids, int n_cols, int n_rows) {
    GRID_STRIDE(i, n_ids * n_cols) {
        const long long r = i / n_cols;
        const int c = (int)(i - r * n_cols);
        const int id = ids[r];
        if (id >= 0 && id < n_rows) atomicAdd(out + (long long)id * n_cols + c, g[i]);
    }
}

// ------------------------------------------------------------------ rms norm (one block per row)
extern "C" __global__ void rms_norm(const real* __restrict__ x, real* __restrict__ out, int n, real eps) {
    __shared__ real scratch[32];
    const real* xr = x + (long long)blockIdx.x * n;
    real* yr = out + (long long)blockIdx.x * n;
    real ss = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    const real s = sqrt(block_reduce(ss, scratch, false) / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] / s;
}

// y = x r, r = 1/sqrt(mean(x^2) + eps)  =>  dx = r (g - x r^2 mean(g x))
extern "C" __global__ void rms_norm_back(const real* __restrict__ x, const real* __restrict__ g, real* __restrict__ out,
                                         int n, real eps) {
    __shared__ real scratch[32];
    const long long base = (long long)blockIdx.x * n;
    real sxx = 0, sgx = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        sxx += x[base + i] * x[base + i];
        sgx += g[base + i] * x[base + i];
    }
    sxx = block_reduce(sxx, scratch, false);
    sgx = block_reduce(sgx, scratch, false);
    const real r = (real)1 / sqrt(sxx / n + eps);
    const real coef = sgx * (r * r / n);
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[base + i] = (g[base + i] - x[base + i] * coef) * r;
}

// ------------------------------------------------------------------ layer norm (one block per row, ggml_norm)
extern "C" __global__ void layer_norm(const real* __restrict__ x, real* __restrict__ out, int n, real eps) {
    __shared__ real scratch[32];
    const real* xr = x + (long long)blockIdx.x * n;
    real* yr = out + (long long)blockIdx.x * n;
    real sx = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) sx += xr[i];
    const real mean = block_reduce(sx, scratch, false) / n;
    real sxx = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const real d = xr[i] - mean;
        sxx += d * d;
    }
    const real s = sqrt(block_reduce(sxx, scratch, false) / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = (xr[i] - mean) / s;
}

// xc = x - mean, r = 1/sqrt(mean(xc^2) + eps), y = xc r  =>  dx = r (g - mean(g) - xc r^2 mean(g xc))
extern "C" __global__ void layer_norm_back(const real* __restrict__ x, const real* __restrict__ g,
                                           real* __restrict__ out, int n, real eps) {
    __shared__ real scratch[32];
    const long long base = (long long)blockIdx.x * n;
    real sx = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) sx += x[base + i];
    const real mean = block_reduce(sx, scratch, false) / n;
    real sxx = 0, sg = 0, sgx = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const real d = x[base + i] - mean, gi = g[base + i];
        sxx += d * d;
        sg += gi;
        sgx += gi * d;
    }
    sxx = block_reduce(sxx, scratch, false);
    sg = block_reduce(sg, scratch, false);
    sgx = block_reduce(sgx, scratch, false);
    const real r = (real)1 / sqrt(sxx / n + eps);
    const real coef = sgx * (r * r / n), mg = sg / n;
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        out[base + i] = (g[base + i] - (x[base + i] - mean) * coef - mg) * r;
}

// ------------------------------------------------------------------ rope
// cos/sin of theta = freq_scale * pos[t] * base^(-2j/n_rot) / freq_factors[j] (ggml_rope_ext's
// factors; has_ff = 0: none, ff unread), in double like the CPU tables.
extern "C" __global__ void rope_table(const int* __restrict__ pos, const real* __restrict__ ff, real* __restrict__ cos_t,
                                      real* __restrict__ sin_t, int n_tok, int half, int n_rot, double base,
                                      double freq_scale, int has_ff, int inverse) {
    GRID_STRIDE(i, (long long)n_tok * half) {
        const int t = (int)(i / half), j = (int)(i - (long long)t * half);
        double theta = freq_scale * (double)pos[t] * pow(base, -(2.0 * j) / n_rot);
        if (has_ff) theta /= (double)ff[j];
        const double s = sin(theta);
        cos_t[i] = (real)cos(theta);
        sin_t[i] = (real)(inverse ? -s : s);
    }
}

// x[n_seq, n_tok, n_head, head_dim] with any element strides -> contiguous out. NORM mode rotates
// pairs (2k, 2k+1), NEOX mode (k, k + n_rot/2); dims from n_rot on pass through.
extern "C" __global__ void rope(const real* __restrict__ x, const real* __restrict__ cos_t,
                                const real* __restrict__ sin_t, real* __restrict__ out,
                                int n_seq, int n_tok, int n_head, int head_dim,
                                long long s_seq, long long s_tok, long long s_head, long long s_dim,
                                int n_rot, int neox) {
    const int half = n_rot / 2;
    GRID_STRIDE(i, (long long)n_seq * n_tok * n_head * head_dim) {
        const int j = (int)(i % head_dim);
        long long rest = i / head_dim;
        const int h = (int)(rest % n_head);
        rest /= n_head;
        const int t = (int)(rest % n_tok);
        const long long b = rest / n_tok;
        const real* xr = x + b * s_seq + t * s_tok + h * s_head;
        if (j >= n_rot) {
            out[i] = xr[j * s_dim];
            continue;
        }
        bool second;
        int k, i0, i1;
        if (neox) {
            second = j >= half;
            k = second ? j - half : j;
            i0 = k;
            i1 = k + half;
        } else {
            second = (j & 1) != 0;
            k = j >> 1;
            i0 = 2 * k;
            i1 = 2 * k + 1;
        }
        const real c = cos_t[(long long)t * half + k], s = sin_t[(long long)t * half + k];
        const real x0 = xr[i0 * s_dim], x1 = xr[i1 * s_dim];
        out[i] = second ? x0 * s + x1 * c : x0 * c - x1 * s;
    }
}

// ------------------------------------------------------------------ attention softmax (one block per row)
// Row r is query position p = n_past + r % n_q (has_pos: p = pos[r % n_q], positions given at run
// time) and sees keys 0..p, or with window > 0 only keys p - window + 1..p (llama.cpp's
// LLAMA_SWA_TYPE_STANDARD). x and out may alias: each element is read and then written by the same
// thread, after both reductions.
extern "C" __global__ void softmax_causal(const real* x, real* out, const int* __restrict__ pos, int has_pos, int n_kv,
                                          int n_q, int n_past, int window, real scale) {
    __shared__ real scratch[32];
    const long long row = blockIdx.x;
    const real* xr = x + row * n_kv;
    real* yr = out + row * n_kv;
    const int p = has_pos ? pos[row % n_q] : n_past + (int)(row % n_q);
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

// ------------------------------------------------------------------ blockwise attention (flash_attn)
// q [B, T, H, d], k/v [B, T, Hkv, d] contiguous; query head h reads KV head h / (H / Hkv). Row
// r = (b * H + h) * T + t of the logsumexp is query position t of head h. Query t sees keys
// fa_first(t)..t (window > 0: the last `window` positions, llama.cpp's LLAMA_SWA_TYPE_STANDARD).
// One block of FA_THREADS per row (a query row forward and for dq, a key row for dk/dv): no
// [T, T] matrix, scores recomputed where needed (FlashAttention-2), static shared memory only.
#define FA_THREADS 128
#define FA_MAX_D 512  // head_dim bound: FA_MAX_D / FA_THREADS accumulators per thread

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

// ------------------------------------------------------------------ KV cache
// cache[b, h, pos[t], c] = x[b, t, h, c]: x contiguous [B, T, H, d], cache contiguous [B, H, N, d].
extern "C" __global__ void cache_write(const real* __restrict__ x, const int* __restrict__ pos, real* __restrict__ cache,
                                       int n_tok, int n_head, int n_ctx, int d, long long n) {
    GRID_STRIDE(i, n) {
        const int c = (int)(i % d);
        long long r = i / d;
        const int h = (int)(r % n_head);
        r /= n_head;
        const int t = (int)(r % n_tok);
        const long long b = r / n_tok;
        cache[((b * n_head + h) * n_ctx + pos[t]) * d + c] = x[i];
    }
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

// ------------------------------------------------------------------ activations (contiguous, same shape)
extern "C" __global__ void silu_fwd(const real* __restrict__ x, real* __restrict__ out, long long n) {
    GRID_STRIDE(i, n) { out[i] = sigmoid(x[i]) * x[i]; }
}

// d silu = s (1 + x (1 - s))
extern "C" __global__ void silu_back(const real* __restrict__ x, const real* __restrict__ g, real* __restrict__ out,
                                     long long n) {
    GRID_STRIDE(i, n) {
        const real s = sigmoid(x[i]);
        out[i] = ((real)1 + x[i] * ((real)1 - s)) * s * g[i];
    }
}

extern "C" __global__ void swiglu_fwd(const real* __restrict__ gate, const real* __restrict__ up,
                                      real* __restrict__ out, long long n) {
    GRID_STRIDE(i, n) { out[i] = sigmoid(gate[i]) * gate[i] * up[i]; }
}

// wrt 0: d/d gate = silu'(gate) up g;  wrt 1: d/d up = silu(gate) g
extern "C" __global__ void swiglu_back(const real* __restrict__ gate, const real* __restrict__ up,
                                       const real* __restrict__ g, real* __restrict__ out, long long n, int wrt) {
    GRID_STRIDE(i, n) {
        const real a = gate[i], s = sigmoid(a);
        out[i] = wrt == 1 ? s * a * g[i] : ((real)1 + a * ((real)1 - s)) * s * up[i] * g[i];
    }
}

// GELU, tanh approximation (ggml_gelu): 0.5 x (1 + tanh(c x (1 + a x^2))), c = sqrt(2/pi), a = 0.044715
#define GELU_C ((real)0.79788456080286535587989211986876)
#define GELU_A ((real)0.044715)
__device__ __forceinline__ real gelu(real x) {
    return (real)0.5 * x * ((real)1 + tanh(GELU_C * x * ((real)1 + GELU_A * x * x)));
}

// d gelu = 0.5 (1 + th) (1 + x (1 - th) c (1 + 3 a x^2)), th = tanh(c x (1 + a x^2))
__device__ __forceinline__ real gelu_grad(real x) {
    const real th = tanh(GELU_C * x * ((real)1 + GELU_A * x * x));
    return (real)0.5 * ((real)1 + th) * ((real)1 + x * ((real)1 - th) * GELU_C * ((real)1 + (real)3 * GELU_A * x * x));
}

extern "C" __global__ void gelu_fwd(const real* __restrict__ x, real* __restrict__ out, long long n) {
    GRID_STRIDE(i, n) { out[i] = gelu(x[i]); }
}

extern "C" __global__ void gelu_back(const real* __restrict__ x, const real* __restrict__ g, real* __restrict__ out,
                                     long long n) {
    GRID_STRIDE(i, n) { out[i] = gelu_grad(x[i]) * g[i]; }
}

extern "C" __global__ void geglu_fwd(const real* __restrict__ gate, const real* __restrict__ up,
                                     real* __restrict__ out, long long n) {
    GRID_STRIDE(i, n) { out[i] = gelu(gate[i]) * up[i]; }
}

// wrt 0: d/d gate = gelu'(gate) up g;  wrt 1: d/d up = gelu(gate) g
extern "C" __global__ void geglu_back(const real* __restrict__ gate, const real* __restrict__ up,
                                      const real* __restrict__ g, real* __restrict__ out, long long n, int wrt) {
    GRID_STRIDE(i, n) { out[i] = wrt == 1 ? gelu(gate[i]) * g[i] : gelu_grad(gate[i]) * up[i] * g[i]; }
}

// cap tanh(x / cap). x and out may alias (softcap runs in place): one thread reads, then writes.
extern "C" __global__ void softcap_fwd(const real* x, real* out, long long n, real inv_cap, real cap) {
    GRID_STRIDE(i, n) { out[i] = tanh(x[i] * inv_cap) * cap; }
}

// g (1 - (y / cap)^2) from the output y; y and out may alias.
extern "C" __global__ void softcap_back(const real* y, const real* __restrict__ g, real* out, long long n, real inv_cap) {
    GRID_STRIDE(i, n) {
        const real t = y[i] * inv_cap;
        out[i] = ((real)1 - t * t) * g[i];
    }
}

// ------------------------------------------------------------------ weights kept in a GGUF type
// (quant/matmul.py is the reference: same values, same rounding of the activations). Type ids
// (QT_<name>, ggml's), block sizes and bytes come from quant/types.py's registry (c_defines).
__device__ __forceinline__ float half_bits_to_float(unsigned int h) {
    const unsigned int sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (e == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (mant << 13));
    if (e == 0u) return (sign ? -1.0f : 1.0f) * ((float)mant * 5.9604644775390625e-08f);  // mant * 2^-24, exact
    return __uint_as_float(sign | ((e + 112u) << 23) | (mant << 13));
}

__device__ __forceinline__ float load_half(const unsigned char* p) {
    return half_bits_to_float((unsigned int)p[0] | ((unsigned int)p[1] << 8));
}

// x rounded to the nearest fp16 (ties to even), as a float
__device__ __forceinline__ float round_half(float x) {
    const unsigned int bits = __float_as_uint(x), mag = bits & 0x7fffffffu;
    if (mag > 0x7f800000u) return x;                                                     // NaN
    if (mag >= 0x477ff000u) return __uint_as_float((bits & 0x80000000u) | 0x7f800000u);  // past 65504: inf
    if (mag < 0x38800000u) return rintf(x * 16777216.0f) * 5.9604644775390625e-08f;     // subnormal: 2^-24 steps
    return __uint_as_float((bits + 0x0fffu + ((bits >> 13) & 1u)) & 0xffffe000u);
}

// x rounded to bf16 as ggml_compute_fp32_to_bf16 does, as a float
__device__ __forceinline__ float round_bf16(float x) {
    const unsigned int bits = __float_as_uint(x);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return __uint_as_float((bits & 0xffff0000u) | 0x00400000u);
    return __uint_as_float((bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u);
}

// Q4_K / Q5_K: 6-bit scale and min of sub-block s (ggml get_scale_min_k4)
__device__ __forceinline__ void scale_min_k4(const unsigned char* q, int s, float* sc, float* m) {
    if (s < 4) {
        *sc = (float)(q[s] & 63);
        *m = (float)(q[s + 4] & 63);
    } else {
        *sc = (float)((q[s + 4] & 0xF) | ((q[s - 4] >> 6) << 4));
        *m = (float)((q[s + 4] >> 4) | ((q[s] >> 6) << 4));
    }
}

// value j of a row of `type` blocks
__device__ float dequant_value(const unsigned char* row, int type, int j) {
    switch (type) {
        case QT_F16: return load_half(row + 2 * j);
        case QT_BF16: return __uint_as_float(((unsigned int)row[2 * j] | ((unsigned int)row[2 * j + 1] << 8)) << 16);
        case QT_Q8_0: {
            const unsigned char* b = row + (j / QT_Q8_0_BLOCK) * QT_Q8_0_BYTES;
            return (float)(signed char)b[2 + j % QT_Q8_0_BLOCK] * load_half(b);
        }
        case QT_Q4_0: case QT_Q4_1: {
            const int e = j % 32, size = type == QT_Q4_0 ? QT_Q4_0_BYTES : QT_Q4_1_BYTES, off = type == QT_Q4_0 ? 2 : 4;
            const unsigned char* b = row + (j / 32) * size;
            const unsigned char byte = b[off + (e & 15)];
            const float q = (float)(e < 16 ? byte & 15 : byte >> 4);
            return type == QT_Q4_0 ? (q - 8.0f) * load_half(b) : q * load_half(b) + load_half(b + 2);
        }
        case QT_Q5_0: case QT_Q5_1: {
            const int e = j % 32, size = type == QT_Q5_0 ? QT_Q5_0_BYTES : QT_Q5_1_BYTES, off = type == QT_Q5_0 ? 2 : 4;
            const unsigned char* b = row + (j / 32) * size;
            const unsigned int qh = (unsigned int)b[off] | ((unsigned int)b[off + 1] << 8) |
                                    ((unsigned int)b[off + 2] << 16) | ((unsigned int)b[off + 3] << 24);
            const unsigned char byte = b[off + 4 + (e & 15)];
            const float q = (float)((e < 16 ? byte & 15 : byte >> 4) | (((qh >> e) & 1u) << 4));
            return type == QT_Q5_0 ? (q - 16.0f) * load_half(b) : q * load_half(b) + load_half(b + 2);
        }
        case QT_Q4_K: case QT_Q5_K: {
            const int e = j % 256, s = e / 32, l = e % 32;
            const unsigned char* b = row + (j / 256) * (type == QT_Q4_K ? QT_Q4_K_BYTES : QT_Q5_K_BYTES);
            const unsigned char byte = b[(type == QT_Q4_K ? 16 : 48) + 32 * (s / 2) + l];
            int q = (s & 1) ? byte >> 4 : byte & 15;
            if (type == QT_Q5_K) q |= ((b[16 + l] >> s) & 1) << 4;
            float sc, m;
            scale_min_k4(b + 4, s, &sc, &m);
            return (load_half(b) * sc) * (float)q - load_half(b + 2) * m;
        }
        case QT_Q6_K: {
            const int e = j % 256, n = e / 128, k = (e % 128) / 32, l = e % 32;
            const unsigned char* b = row + (j / QT_Q6_K_BLOCK) * QT_Q6_K_BYTES;
            const unsigned char lb = b[64 * n + (k & 1) * 32 + l];
            const int q = ((k < 2 ? lb & 15 : lb >> 4) | (((b[128 + 32 * n + l] >> (2 * k)) & 3) << 4)) - 32;
            return (load_half(b + 208) * (float)(signed char)b[192 + 8 * n + 2 * k + l / 16]) * (float)q;
        }
    }
    return QUIET_NAN;
}

// out[r, :] = row ids[r] (has_ids) or row0 + r of the stored matrix, dequantized
extern "C" __global__ void dequant_rows(const unsigned char* __restrict__ raw, const int* __restrict__ ids,
                                        real* __restrict__ out, long long n, int n_cols, long long row_bytes,
                                        long long row0, int has_ids, int n_rows, int type) {
    GRID_STRIDE(i, n) {
        const long long r = i / n_cols;
        const int j = (int)(i - r * n_cols);
        const long long src = has_ids ? (long long)ids[r] : row0 + r;
        out[i] = (src >= 0 && src < n_rows) ? (real)dequant_value(raw + src * row_bytes, type, j) : QUIET_NAN;
    }
}

// The min of every block of Q4_1 / Q5_1 rows row0.. : out [rows, n_blocks]
extern "C" __global__ void block_mins(const unsigned char* __restrict__ raw, real* __restrict__ out, long long n,
                                      int n_blocks, long long row_bytes, long long row0, int block_bytes) {
    GRID_STRIDE(i, n) {
        const long long r = i / n_blocks;
        const int k = (int)(i - r * n_blocks);
        out[i] = (real)load_half(raw + (row0 + r) * row_bytes + (long long)k * block_bytes + 2);
    }
}

// Activations rounded as ggml's CPU matmul converts them to a weight type's vec_dot_type, in float
// whatever `real` is: one thread per block of `block` values. kind (ACT_<vec_dot type>): ACT_F16,
// ACT_BF16, ACT_Q8_0, ACT_Q8_1 (corr[b] = fp16(d sum q) - fp16(d) sum q, for the weights' min
// term), ACT_Q8_K.
extern "C" __global__ void round_act(const real* __restrict__ x, real* __restrict__ out, real* __restrict__ corr,
                                     long long n_blocks, int block, int kind) {
    GRID_STRIDE(b, n_blocks) {
        const real* xb = x + b * block;
        real* ob = out + b * block;
        if (kind == ACT_F16) { for (int i = 0; i < block; ++i) ob[i] = (real)round_half((float)xb[i]); continue; }
        if (kind == ACT_BF16) { for (int i = 0; i < block; ++i) ob[i] = (real)round_bf16((float)xb[i]); continue; }
        if (kind == ACT_Q8_K) {  // quantize_row_q8_K_ref: the first largest |x| sets the (signed) scale
            float amax = 0.0f, mx = 0.0f;
            for (int i = 0; i < block; ++i) {
                const float v = (float)xb[i];
                if (fabsf(v) > amax) { amax = fabsf(v); mx = v; }
            }
            if (amax == 0.0f) { for (int i = 0; i < block; ++i) ob[i] = (real)0; continue; }
            const float iscale = -127.0f / mx, d = 1.0f / iscale;
            for (int i = 0; i < block; ++i) ob[i] = (real)(fminf(rintf(iscale * (float)xb[i]), 127.0f) * d);
            continue;
        }
        float amax = 0.0f;  // quantize_row_q8_0 / q8_1 (x86): d = amax / 127 stored fp16, q = rint(x * 127 / amax)
        for (int i = 0; i < block; ++i) amax = fmaxf(amax, fabsf((float)xb[i]));
        const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f, dh = round_half(d);
        float sum = 0.0f;
        for (int i = 0; i < block; ++i) {
            const float q = rintf((float)xb[i] * id);
            sum += q;
            ob[i] = (real)(q * dh);
        }
        if (kind == ACT_Q8_1) corr[b] = (real)(round_half(d * sum) - dh * sum);
    }
}

// ------------------------------------------------------------------ loss
// out[row] = max + log(sum(exp(x - max))) over a row of n (one block per row).
extern "C" __global__ void logsumexp_rows(const real* __restrict__ x, real* __restrict__ out, int n) {
    __shared__ real scratch[32];
    const real* xr = x + (long long)blockIdx.x * n;
    real mx = NEG_INF;
    for (int c = threadIdx.x; c < n; c += blockDim.x) mx = fmax(mx, xr[c]);
    mx = block_reduce(mx, scratch, true);
    real sum = 0;
    for (int c = threadIdx.x; c < n; c += blockDim.x) sum += exp(xr[c] - mx);
    sum = block_reduce(sum, scratch, false);
    if (threadIdx.x == 0) out[blockIdx.x] = log(sum) + mx;
}

// loss[row] = lse[row] - logits[row, target[row]]; a negative target (masked) carries 0, NaN flags a
// target past the vocabulary.
extern "C" __global__ void cross_entropy_rows(const real* __restrict__ logits, const int* __restrict__ targets,
                                              const real* __restrict__ lse, real* __restrict__ loss,
                                              long long n_rows, int n_vocab) {
    GRID_STRIDE(row, n_rows) {
        const int t = targets[row];
        loss[row] = t < 0 ? (real)0 : t < n_vocab ? lse[row] - logits[row * n_vocab + t] : QUIET_NAN;
    }
}

// d mean_counted_rows(lse - logit[target]) = (exp(logit - lse) - onehot(target)) * gs, gs = g / counted
// rows (divided by the caller, on the device); 0 on rows with a negative (masked) target. logits and out
// may alias (the backward runs in place): each element is read and then written by one thread.
extern "C" __global__ void cross_entropy_back(const real* logits, const int* __restrict__ targets,
                                              const real* __restrict__ lse, const real* __restrict__ gs, real* out,
                                              long long n_rows, int n_vocab) {
    const real g = gs[0];
    GRID_STRIDE(i, n_rows * n_vocab) {
        const long long row = i / n_vocab;
        const int c = (int)(i - row * n_vocab);
        const int t = targets[row];
        out[i] = t < 0 ? (real)0 : (exp(logits[i] - lse[row]) - (c == t ? (real)1 : (real)0)) * g;
    }
}

// numpy.argmax order: NaN above everything, ties to the lower index.
__device__ __forceinline__ bool argmax_better(real v, int i, real best_v, int best_i) {
    if (isnan(v)) return !isnan(best_v) || i < best_i;
    if (isnan(best_v)) return false;
    return v > best_v || (v == best_v && i < best_i);
}

// hit[row] = 1 when argmax(logits[row]) == targets[row], else 0.
extern "C" __global__ void count_correct_rows(const real* __restrict__ logits, const int* __restrict__ targets,
                                              real* __restrict__ hit, int n_vocab) {
    __shared__ real best_vs[32];
    __shared__ int best_is[32];
    const long long row = blockIdx.x;
    const real* lr = logits + row * n_vocab;
    real best_v = NEG_INF;
    int best_i = 0x7fffffff;
    for (int c = threadIdx.x; c < n_vocab; c += blockDim.x)
        if (argmax_better(lr[c], c, best_v, best_i)) { best_v = lr[c]; best_i = c; }
    for (int offset = 16; offset > 0; offset >>= 1) {
        const real v = __shfl_xor_sync(FULL_MASK, best_v, offset);
        const int i = __shfl_xor_sync(FULL_MASK, best_i, offset);
        if (argmax_better(v, i, best_v, best_i)) { best_v = v; best_i = i; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { best_vs[warp] = best_v; best_is[warp] = best_i; }
    __syncthreads();
    if (warp == 0) {
        best_v = lane < (int)(blockDim.x >> 5) ? best_vs[lane] : NEG_INF;
        best_i = lane < (int)(blockDim.x >> 5) ? best_is[lane] : 0x7fffffff;
        for (int offset = 16; offset > 0; offset >>= 1) {
            const real v = __shfl_xor_sync(FULL_MASK, best_v, offset);
            const int i = __shfl_xor_sync(FULL_MASK, best_i, offset);
            if (argmax_better(v, i, best_v, best_i)) { best_v = v; best_i = i; }
        }
        if (lane == 0) hit[row] = best_i == targets[row] ? (real)1 : (real)0;
    }
}

// ------------------------------------------------------------------ optimizers (one flat buffer)
// ggml_opt_step_adamw: beta1h = 1/(1 - beta1^t), beta2h = 1/(1 - beta2^t), decoupled weight decay.
extern "C" __global__ void adamw_step(real* __restrict__ w, const real* __restrict__ g, real* __restrict__ m,
                                      real* __restrict__ v, long long n, real alpha, real beta1, real beta2,
                                      real eps, real wd, real beta1h, real beta2h) {
    GRID_STRIDE(i, n) {
        const real gi = g[i];
        const real mi = m[i] * beta1 + gi * ((real)1 - beta1);
        const real vi = v[i] * beta2 + gi * gi * ((real)1 - beta2);
        m[i] = mi;
        v[i] = vi;
        const real vh = sqrt(vi * beta2h) + eps;
        w[i] = w[i] * ((real)1 - alpha * wd) - alpha * (mi * beta1h) / vh;
    }
}

extern "C" __global__ void sgd_step(real* __restrict__ w, const real* __restrict__ g, long long n, real alpha, real wd) {
    GRID_STRIDE(i, n) { w[i] = w[i] * ((real)1 - alpha * wd) - alpha * g[i]; }
}
"""

_C_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
_BLOCK = 256  # threads per block of the flat (grid-stride) kernels
_MAX_BLOCKS = 1 << 16
_FA_THREADS, _FA_MAX_D = 128, 512  # FA_THREADS, FA_MAX_D of the flash_attn kernels


def kernel_source(dtype) -> str:
    """KERNEL_SOURCE specialised for one float type."""
    return f"typedef {_C_TYPES[np.dtype(dtype)]} real;\n{c_defines()}{KERNEL_SOURCE}"


def _flat_grid(n: int) -> tuple:
    return (max(1, min((n + _BLOCK - 1) // _BLOCK, _MAX_BLOCKS)),)


def _row_threads(n: int) -> tuple:
    """Threads per block for a row of n elements: about 4 elements per thread, 32..1024."""
    t = 32
    while t < 1024 and t * 4 < n:
        t *= 2
    return (t,)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _unavailable_reason() -> str | None:
    """Why the CUDA backend cannot run here, or None when cupy sees a device."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken install raising something else
        return f"cupy is not importable ({_one_line(exc)}); install it with pip install 'llmtune[cuda]'"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"no usable CUDA device ({_one_line(exc)})"
    return None if n > 0 else "no CUDA device found"


def available() -> bool:
    """True when cupy is importable and sees at least one device. Never raises."""
    try:
        return _unavailable_reason() is None
    except Exception:
        return False


# ---------------------------------------------------------------------------------------- matmul plan
_OP_N, _OP_T = 0, 1  # cublasOperation_t


def _matrix_layout(rows: int, cols: int, s_row: int, s_col: int):
    """How cuBLAS (column-major) can read a row-major-indexed matrix with these element strides.

    (False, ld): rows are contiguous, so the memory holds its transpose column-major;
    (True, ld): columns are contiguous (a transposed view), memory holds the matrix column-major;
    None: neither (needs a copy). ld obeys cuBLAS's ld >= max(1, stored rows)."""
    if (cols == 1 or s_col == 1) and (rows == 1 or s_row >= cols):
        return False, s_row if rows > 1 else max(cols, 1)
    if (rows == 1 or s_row == 1) and (cols == 1 or s_col >= rows):
        return True, s_col if cols > 1 else max(rows, 1)
    return None


@dataclass(frozen=True)
class GemmPlan:
    """One cublas<t>gemmStridedBatched call per entry of `offsets`.

    In cuBLAS's column-major terms it computes C^T = op(X) op(Y) with X = op_b(b), Y = op_a(a):
    C[m, n] row-major is C^T[n, m] column-major, so `m_cm` = n, `n_cm` = m."""

    trans_x: int
    trans_y: int
    m_cm: int
    n_cm: int
    k: int
    ldx: int
    ldy: int
    ldc: int
    stride_x: int
    stride_y: int
    stride_c: int
    batch: int
    offsets: tuple  # ((offset_x, offset_y, offset_c), ...) in elements, one per call


def _batch_strides(shape, strides, batch_shape):
    """Element strides of an operand's batch axes aligned to batch_shape (0 where broadcast)."""
    lead = len(batch_shape) - (len(shape) - 2)
    out = [0] * len(batch_shape)
    for i, (size, stride) in enumerate(zip(shape[:-2], strides[:-2])):
        out[lead + i] = stride if size != 1 else 0
    return out


def _collapse_batch(batch_shape, per_operand):
    """Merge batch axes that index memory as one axis in every operand -> [(size, (strides...))]."""
    dims = []
    for i, size in enumerate(batch_shape):
        if size == 1:
            continue
        st = tuple(s[i] for s in per_operand)
        if dims and all(p == q * size for p, q in zip(dims[-1][1], st)):
            dims[-1] = (dims[-1][0] * size, st)
        else:
            dims.append((size, st))
    return dims


def plan_gemm(a_shape, a_strides, b_shape, b_strides, c_shape, c_strides, ta: bool, tb: bool):
    """The cuBLAS calls computing c = op(a) @ op(b) (numpy batch broadcasting), strides in elements.

    None when an operand's matrices are neither row- nor column-contiguous, or c is not
    row-contiguous: the caller copies that operand and plans again. Transposed views (the
    `ta`/`tb` flags and permuted inputs) are read in place through cuBLAS's transpose flags."""
    def mat(shape, strides, t):
        r, c, sr, sc = shape[-2], shape[-1], strides[-2], strides[-1]
        return (c, r, sc, sr) if t else (r, c, sr, sc)

    am, ak, asr, asc = mat(a_shape, a_strides, ta)
    bk, bn, bsr, bsc = mat(b_shape, b_strides, tb)
    la, lb = _matrix_layout(am, ak, asr, asc), _matrix_layout(bk, bn, bsr, bsc)
    lc = _matrix_layout(c_shape[-2], c_shape[-1], c_strides[-2], c_strides[-1])
    if la is None or lb is None or lc is None or lc[0]:
        return None
    batch_shape = tuple(c_shape[:-2])
    per_operand = [_batch_strides(b_shape, b_strides, batch_shape), _batch_strides(a_shape, a_strides, batch_shape),
                   _batch_strides(c_shape, c_strides, batch_shape)]
    dims = _collapse_batch(batch_shape, per_operand)
    batch, inner = (dims[-1][0], dims[-1][1]) if dims else (1, (0, 0, 0))
    outer = dims[:-1]
    offsets = []
    for idx in itertools.product(*[range(size) for size, _ in outer]):
        offsets.append(tuple(sum(i * st[j] for i, (_, st) in zip(idx, outer)) for j in range(3)))
    return GemmPlan(
        trans_x=_OP_T if lb[0] else _OP_N, trans_y=_OP_T if la[0] else _OP_N,
        m_cm=bn, n_cm=am, k=ak, ldx=lb[1], ldy=la[1], ldc=lc[1],
        stride_x=inner[0], stride_y=inner[1], stride_c=inner[2], batch=batch, offsets=tuple(offsets),
    )


def _element_strides(a) -> tuple:
    return tuple(s // a.itemsize for s in a.strides)


# ---------------------------------------------------------------------------------------- runtime
class _CupyRuntime:
    """Device primitives on a real GPU through cupy (kernels compiled with NVRTC, cuBLAS gemm)."""

    def __init__(self):
        reason = _unavailable_reason()
        if reason is not None:
            raise LlmtuneError(f"--backend cuda: {reason}")
        import cupy

        self.xp = cupy
        self._functions = {}
        self._modules = {}
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props.get("name", b"?")
        self.device_name = name.decode() if isinstance(name, bytes) else str(name)

    def free_memory(self) -> int:
        free, _total = self.xp.cuda.runtime.memGetInfo()
        return int(free) + int(self.xp.get_default_memory_pool().free_bytes())

    def prepare(self, dtype) -> None:
        """Compile the kernels and load cuBLAS now, so a broken toolkit fails with one clear line."""
        try:
            self._function("sgd_step", dtype)
            from cupy_backends.cuda.libs import cublas  # noqa: F401  (loads libcublas)

            self.xp.cuda.device.get_cublas_handle()
        except Exception as exc:
            if type(exc).__name__ == "CompileException":  # a bug in KERNEL_SOURCE, not the user's setup
                raise
            raise LlmtuneError(f"--backend cuda: cannot load NVRTC or cuBLAS ({_one_line(exc)})") from None

    def _function(self, name, dtype):
        key = (name, np.dtype(dtype))
        fn = self._functions.get(key)
        if fn is None:
            module = self._modules.get(key[1])
            if module is None:
                module = self._modules[key[1]] = self.xp.RawModule(code=kernel_source(dtype))
            fn = self._functions[key] = module.get_function(name)
        return fn

    def launch(self, name, dtype, grid, block, args) -> None:
        self._function(name, dtype)(grid, block, args)

    def gemm(self, dtype, plan: GemmPlan, x_ptr: int, y_ptr: int, c_ptr: int, precision: str = "f32") -> None:
        """precision "tf32" / "bf16": float32 in and out, tensor-core products of inputs rounded to
        TF32 / bf16 with float32 accumulation (cuBLAS's FAST_TF32 / FAST_16BF compute types)."""
        from cupy_backends.cuda.libs import cublas

        dtype = np.dtype(dtype)
        one, zero = np.ones((), dtype), np.zeros((), dtype)
        handle = self.xp.cuda.device.get_cublas_handle()
        cublas.setPointerMode(handle, 0)  # CUBLAS_POINTER_MODE_HOST: alpha/beta are host scalars
        size = dtype.itemsize
        for ox, oy, oc in plan.offsets:
            head = (handle, plan.trans_x, plan.trans_y, plan.m_cm, plan.n_cm, plan.k, one.ctypes.data)
            x, y, c = x_ptr + ox * size, y_ptr + oy * size, c_ptr + oc * size
            if precision == "f32" or dtype != np.float32:
                fn = cublas.sgemmStridedBatched if dtype == np.float32 else cublas.dgemmStridedBatched
                fn(*head, x, plan.ldx, plan.stride_x, y, plan.ldy, plan.stride_y,
                   zero.ctypes.data, c, plan.ldc, plan.stride_c, plan.batch)
                continue
            # cuBLAS enum values (cublasComputeType_t, cudaDataType_t, cublasGemmAlgo_t) as fallbacks
            compute = {"tf32": getattr(cublas, "CUBLAS_COMPUTE_32F_FAST_TF32", 77),
                       "bf16": getattr(cublas, "CUBLAS_COMPUTE_32F_FAST_16BF", 75)}[precision]
            r32 = getattr(self.xp.cuda.runtime, "CUDA_R_32F", 0)
            cublas.gemmStridedBatchedEx(*head, x, r32, plan.ldx, plan.stride_x, y, r32, plan.ldy, plan.stride_y,
                                        zero.ctypes.data, c, r32, plan.ldc, plan.stride_c, plan.batch, compute,
                                        getattr(cublas, "CUBLAS_GEMM_DEFAULT", -1))

    @staticmethod
    def ptr(a) -> int:
        return a.data.ptr

    def to_device(self, host, dtype):
        return self.xp.array(host, dtype=dtype, order="C")

    def to_host(self, a) -> np.ndarray:
        return self.xp.asnumpy(a)

    def synchronize(self) -> None:
        self.xp.cuda.get_current_stream().synchronize()


# ---------------------------------------------------------------------------------------- backend
PRECISIONS = ("f32", "tf32", "bf16")
# ggml type ids of the stored-weight types (the dequant_rows kernel's switch), and round_act's kinds


class CUDABackend(Backend):
    """Kernels of backends/cpu.py on an NVIDIA GPU. float32, or float64 for gradient checks.

    precision: matmul inputs as stored ("f32"), or rounded to TF32 / bf16 on tensor cores with
    float32 accumulation ("tf32", "bf16"); weights, activations and optimizer state stay float32.
    `runtime` replaces the cupy runtime (tests run the same kernels under a CPU emulator)."""

    name = "cuda"
    q_scratch_elements = 1 << 26  # floats of W dequantized at once by qlinear / qlinear_back (256 MiB)
    # op name -> kernel method, one entry per op of graph/ops.OPS (bound per instance in __init__)
    KERNELS = {
        "sum_to": "_k_sum_to",
        "broadcast_to": "_k_broadcast_to",
        "add": "_k_add",
        "mul": "_k_mul",
        "scale": "_k_scale",
        "silu": "_k_silu",
        "silu_back": "_k_silu_back",
        "swiglu": "_k_swiglu",
        "swiglu_back": "_k_swiglu_back",
        "gelu": "_k_gelu",
        "gelu_back": "_k_gelu_back",
        "geglu": "_k_geglu",
        "geglu_back": "_k_geglu_back",
        "softcap": "_k_softcap",
        "softcap_back": "_k_softcap_back",
        "matmul": "_k_matmul",
        "qlinear": "_k_qlinear",
        "qlinear_back": "_k_qlinear_back",
        "qget_rows": "_k_qget_rows",
        "dequantize": "_k_dequantize",
        "reshape": "_k_reshape",
        "permute": "_k_permute",
        "cont": "_k_cont",
        "slice": "_k_slice",
        "pad": "_k_pad",
        "get_rows": "_k_get_rows",
        "add_rows": "_k_add_rows",
        "rms_norm": "_k_rms_norm",
        "rms_norm_back": "_k_rms_norm_back",
        "layer_norm": "_k_layer_norm",
        "layer_norm_back": "_k_layer_norm_back",
        "rope": "_k_rope",
        "softmax_causal": "_k_softmax_causal",
        "softmax_masked": "_k_softmax_masked",
        "softmax_back": "_k_softmax_back",
        "flash_attn": "_k_flash_attn",
        "flash_attn_back": "_k_flash_attn_back",
        "after": "_k_after",
        "cache_write": "_k_cache_write",
        "logsumexp": "_k_logsumexp",
        "cross_entropy": "_k_cross_entropy",
        "cross_entropy_back": "_k_cross_entropy_back",
        "count_correct": "_k_count_correct",
    }

    def __init__(self, dtype=np.float32, runtime=None, precision: str = "f32"):
        super().__init__(dtype)
        if self.dtype not in _C_TYPES:
            raise LlmtuneError(f"--backend cuda: dtype {self.dtype} is not supported (float32 or float64)")
        if precision not in PRECISIONS or (precision != "f32" and self.dtype != np.float32):
            raise LlmtuneError(f"--precision: {precision!r} is not available for {self.dtype} (choose f32, tf32 or bf16 "
                               "with float32)")
        self.precision = precision
        self.rt = runtime if runtime is not None else _CupyRuntime()
        if hasattr(self.rt, "prepare"):
            self.rt.prepare(self.dtype)
        self.xp = self.rt.xp
        self.device_name = getattr(self.rt, "device_name", "?")
        self.kernels = {op: getattr(self, method) for op, method in self.KERNELS.items()}

    # -- memory --------------------------------------------------------------------------
    def asarray(self, host, dtype=None):
        if isinstance(host, self.xp.ndarray):
            return self._contig(host, dtype)
        host = np.asarray(host)
        return self.rt.to_device(host, dtype or host.dtype)

    def to_numpy(self, arr) -> np.ndarray:
        return self.rt.to_host(arr)

    def zeros(self, shape, dtype=None):
        return self.xp.zeros(shape, dtype=dtype or self.dtype)

    def arena(self, nbytes):
        return self.xp.empty(max(int(nbytes), 1), dtype=np.uint8)

    def view(self, arena, shape, dtype, offset=0):
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        return arena[offset : offset + n].view(dtype).reshape(shape)

    def synchronize(self) -> None:
        self.rt.synchronize()

    def available_memory(self):
        """Free device memory in bytes (the finetune memory check), or None when unknown."""
        probe = getattr(self.rt, "free_memory", None)
        return probe() if probe is not None else None

    def accumulate(self, dst, src) -> None:
        self.xp.add(dst, src, out=dst)

    # -- helpers -------------------------------------------------------------------------
    def _launch(self, name, dtype, grid, block, *args) -> None:
        self.rt.launch(name, np.dtype(dtype), grid, block, args)

    def _contig(self, a, dtype=None):
        """a itself when C-contiguous (and of dtype), else a contiguous copy; keeps 0-d arrays 0-d."""
        if a.flags.c_contiguous and (dtype is None or a.dtype == dtype):
            return a
        return self.xp.array(a, dtype=dtype or a.dtype, order="C", copy=True)

    def _ids(self, ids):
        """Integer inputs as contiguous int32 device arrays (host arrays are copied over)."""
        if not isinstance(ids, self.xp.ndarray):
            ids = self.rt.to_device(np.asarray(ids), np.int32)
        return self._contig(ids, np.int32)

    def _rows(self, x):
        """x as contiguous [rows, last axis] plus its sizes."""
        x = self._contig(x)
        n = x.shape[-1] if x.ndim else 1
        return x, (x.size // n if n else 0), n

    def _flat(self, name, out, *inputs, extra=()):
        """A grid-stride kernel over same-shaped contiguous inputs and out."""
        ins = [self._contig(a) for a in inputs]
        if out.size:
            self._launch(name, out.dtype, _flat_grid(out.size), (_BLOCK,), *ins, out, np.int64(out.size), *extra)
        return out

    # -- elementwise (cupy ufuncs broadcast like numpy) -------------------------------------
    def _k_add(self, out, a, b):
        return self.xp.add(a, b, out=out)

    def _k_mul(self, out, a, b):
        return self.xp.multiply(a, b, out=out)

    def _k_scale(self, out, a, s):
        return self.xp.multiply(a, a.dtype.type(s), out=out)

    def _k_sum_to(self, out, x, shape):
        lead = x.ndim - len(shape)
        axes = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape) if s == 1 and x.shape[lead + i] != 1)
        reduced = tuple(d for i, d in enumerate(x.shape) if i not in axes)
        self.xp.sum(x, axis=axes, out=out.reshape(reduced))
        return out

    def _k_broadcast_to(self, out, x, shape):
        return self.xp.broadcast_to(x, shape)

    def _k_silu(self, out, x):
        return self._flat("silu_fwd", out, x)

    def _k_silu_back(self, out, x, g):
        return self._flat("silu_back", out, x, g)

    def _k_swiglu(self, out, gate, up):
        return self._flat("swiglu_fwd", out, gate, up)

    def _k_swiglu_back(self, out, gate, up, g, wrt):
        return self._flat("swiglu_back", out, gate, up, g, extra=(np.int32(wrt),))

    def _k_gelu(self, out, x):
        return self._flat("gelu_fwd", out, x)

    def _k_gelu_back(self, out, x, g):
        return self._flat("gelu_back", out, x, g)

    def _k_geglu(self, out, gate, up):
        return self._flat("geglu_fwd", out, gate, up)

    def _k_geglu_back(self, out, gate, up, g, wrt):
        return self._flat("geglu_back", out, gate, up, g, extra=(np.int32(wrt),))

    def _k_softcap(self, out, x, cap):
        r = out.dtype.type
        return self._flat("softcap_fwd", out, x, extra=(r(1.0 / cap), r(cap)))

    def _k_softcap_back(self, out, y, g, cap):
        return self._flat("softcap_back", out, y, g, extra=(out.dtype.type(1.0 / cap),))

    # -- matmul (cuBLAS) --------------------------------------------------------------------
    def _k_matmul(self, out, a, b, ta, tb):
        k = a.shape[-2] if ta else a.shape[-1]
        if out.size == 0:
            return out
        if k == 0:
            out.fill(0)
            return out
        if not out.flags.c_contiguous:
            tmp = self.xp.empty(out.shape, out.dtype)
            self._k_matmul(tmp, a, b, ta, tb)
            self.xp.copyto(out, tmp)
            return out
        plan = self._plan(a, b, out, ta, tb)
        if plan is None:  # a view cuBLAS cannot read in place: copy the operand(s) that need it
            a, b = self._readable(a), self._readable(b)
            plan = self._plan(a, b, out, ta, tb)
        self.rt.gemm(out.dtype, plan, self.rt.ptr(b), self.rt.ptr(a), self.rt.ptr(out), self.precision)
        return out

    @staticmethod
    def _plan(a, b, out, ta, tb):
        return plan_gemm(a.shape, _element_strides(a), b.shape, _element_strides(b), out.shape,
                         _element_strides(out), ta, tb)

    def _readable(self, x):
        s = _element_strides(x)
        r, c, sr, sc = x.shape[-2], x.shape[-1], s[-2], s[-1]
        return x if _matrix_layout(r, c, sr, sc) is not None else self._contig(x)

    # -- weights kept in a GGUF type (dequantized a row block at a time, then cuBLAS) -----------
    def _dequant(self, out, w, qtype, row0=0, ids=None):
        """out [rows, n_cols] = rows row0.. (or ids) of the stored matrix w (uint8 [rows, bytes])."""
        if out.size:
            has_ids = ids is not None
            ids = self._ids(ids) if has_ids else self._no_ids()
            self._launch("dequant_rows", out.dtype, _flat_grid(out.size), (_BLOCK,), w, ids, out, np.int64(out.size),
                         np.int32(out.shape[-1]), np.int64(w.shape[1]), np.int64(row0), np.int32(has_ids),
                         np.int32(w.shape[0]), np.int32(qtype_of(qtype).ggml_id))
        return out

    def _no_ids(self):
        ids = getattr(self, "_dummy_ids", None)
        if ids is None:
            ids = self._dummy_ids = self.rt.to_device(np.zeros(1, np.int32), np.int32)
        return ids

    def _gemm_into(self, c, a, b, tb):
        """c = a @ op(b) for row-contiguous 2-D views (c may be a column slice of a wider matrix)."""
        plan = self._plan(a, b, c, False, tb)
        self.rt.gemm(c.dtype, plan, self.rt.ptr(b), self.rt.ptr(a), self.rt.ptr(c), self.precision)

    def _q_block_rows(self, n_rows, n_cols):
        return max(1, min(n_rows, self.q_scratch_elements // max(1, n_cols)))

    def _k_qlinear(self, out, x, w, qtype, round_x):
        qt = qtype_of(qtype)
        n_out, n_in = out.shape[-1], x.shape[-1]
        x2, o2 = self._contig(x).reshape(-1, n_in), out.reshape(-1, n_out)
        if out.size == 0:
            return out
        corr = None
        if round_x:
            xr = self.xp.empty(x2.shape, x2.dtype)
            block = qt.act_type.block
            corr = self.xp.empty((x2.shape[0], n_in // 32 if qt.has_min else 1), x2.dtype)
            if x2.size:
                n_blocks = x2.size // block
                self._launch("round_act", x2.dtype, _flat_grid(n_blocks), (_BLOCK,), x2, xr, corr, np.int64(n_blocks),
                             np.int32(block), np.int32(qt.act_type.kind))
            x2 = xr
        rb = self._q_block_rows(n_out, n_in)
        wb = self.xp.empty((rb, n_in), out.dtype)
        for r0 in range(0, n_out, rb):
            r1 = min(n_out, r0 + rb)
            blk = self._dequant(wb[: r1 - r0], w, qtype, r0)
            if n_in == 0:
                o2[:, r0:r1] = 0
                continue
            self._gemm_into(o2[:, r0:r1], x2, blk, True)
            if round_x and qt.has_min:  # + corr @ mins^T: ggml's min term uses s = fp16(d sum q)
                nb = n_in // 32
                mins = self.xp.empty((r1 - r0, nb), out.dtype)
                self._launch("block_mins", out.dtype, _flat_grid(mins.size), (_BLOCK,), w, mins, np.int64(mins.size),
                             np.int32(nb), np.int64(w.shape[1]), np.int64(r0), np.int32(qt.size))
                part = self.xp.empty((x2.shape[0], r1 - r0), out.dtype)
                self._gemm_into(part, corr, mins, True)
                self.xp.add(o2[:, r0:r1], part, out=o2[:, r0:r1])
        return out

    def _k_qlinear_back(self, out, g, w, qtype):
        n_in, n_out = out.shape[-1], g.shape[-1]
        g2, o2 = self._contig(g).reshape(-1, n_out), out.reshape(-1, n_in)
        if out.size == 0:
            return out
        if n_out == 0:
            out.fill(0)
            return out
        rb = self._q_block_rows(n_out, n_in)
        wb = self.xp.empty((rb, n_in), out.dtype)
        part = None
        for r0 in range(0, n_out, rb):
            r1 = min(n_out, r0 + rb)
            blk = self._dequant(wb[: r1 - r0], w, qtype, r0)
            if r0 == 0:
                self._gemm_into(o2, g2[:, r0:r1], blk, False)
                continue
            if part is None:
                part = self.xp.empty(o2.shape, out.dtype)
            self._gemm_into(part, g2[:, r0:r1], blk, False)
            self.xp.add(o2, part, out=o2)
        return out

    def _k_qget_rows(self, out, w, ids, qtype):
        ids = self._ids(ids).reshape(-1)
        return self._dequant(out.reshape(ids.size, out.shape[-1]), w, qtype, ids=ids).reshape(out.shape)

    def _k_dequantize(self, out, w, qtype):
        return self._dequant(out.reshape(-1, out.shape[-1]), w, qtype).reshape(out.shape)

    # -- shape ops ----------------------------------------------------------------------------
    def _k_reshape(self, out, x, shape):
        return x.reshape(shape)

    def _k_permute(self, out, x, axes):
        return x.transpose(axes)

    def _k_cont(self, out, x):
        self.xp.copyto(out, x)
        return out

    def _k_slice(self, out, x, axis, start, stop):
        return x[(slice(None),) * axis + (slice(start, stop),)]

    def _k_pad(self, out, x, axis, start):
        out.fill(0)
        out[(slice(None),) * axis + (slice(start, start + x.shape[axis]),)] = x
        return out

    # -- embeddings ---------------------------------------------------------------------------
    def _k_get_rows(self, out, w, ids):
        ids = self._ids(ids)
        w2 = self._contig(w).reshape(w.shape[0], -1)
        total = ids.size * w2.shape[1]
        if total:
            self._launch("get_rows", out.dtype, _flat_grid(total), (_BLOCK,), w2, ids, out,
                         np.int64(ids.size), np.int32(w2.shape[1]), np.int32(w2.shape[0]))
        return out

    def _k_add_rows(self, out, g, ids, n_rows):
        ids = self._ids(ids)
        out.fill(0)
        g2 = self._contig(g).reshape(ids.size, -1)
        total = g2.size
        if total:
            self._launch("add_rows", out.dtype, _flat_grid(total), (_BLOCK,), g2, ids, out,
                         np.int64(ids.size), np.int32(g2.shape[1]), np.int32(n_rows))
        return out

    # -- normalization ------------------------------------------------------------------------
    def _k_rms_norm(self, out, x, eps):
        x, rows, n = self._rows(x)
        if rows:
            self._launch("rms_norm", out.dtype, (rows,), _row_threads(n), x, out, np.int32(n), out.dtype.type(eps))
        return out

    def _k_rms_norm_back(self, out, x, g, eps):
        x, rows, n = self._rows(x)
        if rows:
            self._launch("rms_norm_back", out.dtype, (rows,), _row_threads(n), x, self._contig(g), out,
                         np.int32(n), out.dtype.type(eps))
        return out

    def _k_layer_norm(self, out, x, eps):
        x, rows, n = self._rows(x)
        if rows:
            self._launch("layer_norm", out.dtype, (rows,), _row_threads(n), x, out, np.int32(n), out.dtype.type(eps))
        return out

    def _k_layer_norm_back(self, out, x, g, eps):
        x, rows, n = self._rows(x)
        if rows:
            self._launch("layer_norm_back", out.dtype, (rows,), _row_threads(n), x, self._contig(g), out,
                         np.int32(n), out.dtype.type(eps))
        return out

    # -- rope -----------------------------------------------------------------------------------
    def _k_rope(self, out, x, pos, freq_factors=None, *, n_rot, base, freq_scale, mode, inverse):
        pos = self._ids(pos)
        x4 = x if x.ndim == 4 else x.reshape((-1,) + x.shape[-3:])
        n_seq, n_tok, n_head, head_dim = x4.shape
        if out.size == 0:
            return out
        half = n_rot // 2
        dtype = out.dtype
        cos_t = self.xp.empty((n_tok, half), dtype)
        sin_t = self.xp.empty((n_tok, half), dtype)
        if half:
            ff = cos_t if freq_factors is None else self._contig(freq_factors.reshape(-1), dtype)
            self._launch("rope_table", dtype, _flat_grid(n_tok * half), (_BLOCK,), pos, ff, cos_t, sin_t,
                         np.int32(n_tok), np.int32(half), np.int32(n_rot), np.float64(base),
                         np.float64(freq_scale), np.int32(freq_factors is not None), np.int32(bool(inverse)))
        strides = [np.int64(s) for s in _element_strides(x4)]
        self._launch("rope", dtype, _flat_grid(out.size), (_BLOCK,), x4, cos_t, sin_t, out,
                     np.int32(n_seq), np.int32(n_tok), np.int32(n_head), np.int32(head_dim), *strides,
                     np.int32(n_rot), np.int32(mode == "neox"))
        return out

    # -- attention softmax ----------------------------------------------------------------------
    def _k_softmax_causal(self, out, x, pos=None, *, scale, n_q, n_past, window=0):
        x, rows, n = self._rows(x)
        if rows:
            if pos is None:  # a valid pointer the kernel never reads
                pos_arg, has_pos = getattr(self, "_no_pos", None), 0
                if pos_arg is None:
                    pos_arg = self._no_pos = self.rt.to_device(np.zeros(1, np.int32), np.int32)
            else:
                pos_arg, has_pos = self._ids(pos), 1
            self._launch("softmax_causal", out.dtype, (rows,), _row_threads(n), x, out, pos_arg, np.int32(has_pos),
                         np.int32(n), np.int32(n_q), np.int32(n_past), np.int32(window), out.dtype.type(scale))
        return out

    def _k_softmax_masked(self, out, x, mask, *, scale):
        x, rows, n = self._rows(x)
        if rows:
            mask = self._contig(mask, out.dtype)
            self._launch("softmax_masked", out.dtype, (rows,), _row_threads(n), x, out, mask,
                         np.int64(rows // mask.shape[0]), np.int32(n), np.int32(mask.shape[1]), out.dtype.type(scale))
        return out

    # -- blockwise attention ----------------------------------------------------------------------
    def _fa_args(self, q, k, out, scale, softcap, window) -> tuple:
        """(q, k contiguous), grid rows and the shape/attribute arguments shared by the kernels."""
        B, T, H, d = q.shape
        if d > _FA_MAX_D:
            raise LlmtuneError(f"flash_attn: head_dim {d} > {_FA_MAX_D}, the CUDA kernel's bound")
        r = out.dtype.type
        return (np.int32(T), np.int32(H), np.int32(k.shape[2]), np.int32(d), r(scale), r(softcap), np.int32(window))

    def _k_flash_attn(self, out, q, k, v, *, scale, softcap, window):
        """O | logsumexp of ops.flash_attn (packed): one block per query row."""
        q, k, v = self._contig(q), self._contig(k), self._contig(v)
        if q.size:
            self._launch("flash_attn_fwd", out.dtype, (q.size // q.shape[-1],), (_FA_THREADS,), q, k, v, out[: q.size],
                         out[q.size :], *self._fa_args(q, k, out, scale, softcap, window))
        return out

    def _k_flash_attn_back(self, out, q, k, v, packed, g, *, scale, softcap, window):
        """dq | dk | dv of ops.flash_attn: dq per query row (which also leaves D = rowsum(dO * O)),
        then dk, dv per key row."""
        q, k, v, g = self._contig(q), self._contig(k), self._contig(v), self._contig(g)
        if q.size:
            args = self._fa_args(q, k, out, scale, softcap, window)
            rows = q.size // q.shape[-1]
            D = self.xp.empty(rows, dtype=out.dtype)
            nq, nkv = q.size, k.size
            o, lse = packed[:nq], packed[nq:]
            self._launch("flash_attn_back_q", out.dtype, (rows,), (_FA_THREADS,), q, k, v, o, lse, g, out[:nq], D, *args)
            self._launch("flash_attn_back_kv", out.dtype, (k.size // k.shape[-1],), (_FA_THREADS,), q, k, v, lse, D, g,
                         out[nq : nq + nkv], out[nq + nkv :], *args)
        return out

    def _k_after(self, out, x, dep):
        return x

    # -- KV cache -------------------------------------------------------------------------------
    def _k_cache_write(self, out, cache, x, pos):
        """cache[:, :, pos[t]] = x[:, t] in place (cache contiguous); returns the cache."""
        if not cache.flags.c_contiguous:
            raise ValueError("cache_write: the cache must be contiguous")
        x = self._contig(x)
        B, T, H, d = x.shape
        if x.size:
            self._launch("cache_write", cache.dtype, _flat_grid(x.size), (_BLOCK,), x, self._ids(pos), cache,
                         np.int32(T), np.int32(H), np.int32(cache.shape[2]), np.int32(d), np.int64(x.size))
        return cache

    def _k_softmax_back(self, out, y, g, scale):
        y, rows, n = self._rows(y)
        if rows:
            self._launch("softmax_back", out.dtype, (rows,), _row_threads(n), y, self._contig(g), out,
                         np.int32(n), out.dtype.type(scale))
        return out

    # -- loss -----------------------------------------------------------------------------------
    def _k_logsumexp(self, out, x):
        x, rows, n = self._rows(x)
        if rows:
            self._launch("logsumexp_rows", out.dtype, (rows,), _row_threads(n), x, out, np.int32(n))
        return out

    def _counted(self, targets, rows: int, dtype):
        """The divisor of the mean, on the device: the rows whose target is not negative (masked),
        or the row count when every row is masked (loss 0; no rows at all: NaN, as numpy)."""
        n = self.xp.count_nonzero(targets >= 0)
        return self.xp.asarray(self.xp.where(n > 0, n, rows), dtype=dtype)

    def _k_cross_entropy(self, out, logits, targets, lse):
        logits, rows, n_vocab = self._rows(logits)
        targets = self._ids(targets).reshape(-1)
        losses = self.xp.empty(rows, logits.dtype)
        if rows:
            self._launch("cross_entropy_rows", out.dtype, _flat_grid(rows), (_BLOCK,), logits,
                         targets, self._contig(lse), losses, np.int64(rows), np.int32(n_vocab))
        self.xp.sum(losses, out=out)
        self.xp.divide(out, self._counted(targets, rows, out.dtype), out=out)  # mean over the counted rows
        return out

    def _k_cross_entropy_back(self, out, logits, targets, lse, g):
        logits, rows, n_vocab = self._rows(logits)
        targets = self._ids(targets).reshape(-1)
        if out.size:
            gs = self._contig(self.xp.asarray(self.xp.asarray(g, dtype=out.dtype) / self._counted(targets, rows, out.dtype),
                                              dtype=out.dtype))
            self._launch("cross_entropy_back", out.dtype, _flat_grid(out.size), (_BLOCK,), logits,
                         targets, self._contig(lse), gs, out, np.int64(rows), np.int32(n_vocab))
        return out

    def _per_row(self, name, logits, targets):
        """A [rows] buffer filled by a one-block-per-row kernel over the logits."""
        logits, rows, n_vocab = self._rows(logits)
        targets = self._ids(targets).reshape(-1)
        per_row = self.xp.empty(rows, logits.dtype)
        if rows:
            self._launch(name, logits.dtype, (rows,), _row_threads(n_vocab), logits, targets, per_row, np.int32(n_vocab))
        return per_row

    def _k_count_correct(self, out, logits, targets):
        hits = self._per_row("count_correct_rows", logits, targets)
        self.xp.sum(hits, out=out)
        return out

    # -- optimizer (fused over one flat buffer) ----------------------------------------------------
    def _check_flat(self, *bufs) -> int:
        n = bufs[0].size
        for b in bufs:
            if b.size != n or not b.flags.c_contiguous or b.dtype != bufs[0].dtype:
                raise ValueError("optimizer buffers must be contiguous, of one dtype and one size")
        return n

    def adamw_step(self, w, g, m, v, *, lr, beta1, beta2, eps, wd, t):
        n = self._check_flat(w, g, m, v)
        if n:
            r = w.dtype.type
            self._launch("adamw_step", w.dtype, _flat_grid(n), (_BLOCK,), w, g, m, v, np.int64(n), r(lr), r(beta1),
                         r(beta2), r(eps), r(wd), r(1.0 / (1.0 - beta1**t)), r(1.0 / (1.0 - beta2**t)))

    def sgd_step(self, w, g, *, lr, wd):
        n = self._check_flat(w, g)
        if n:
            r = w.dtype.type
            self._launch("sgd_step", w.dtype, _flat_grid(n), (_BLOCK,), w, g, np.int64(n), r(lr), r(wd))
