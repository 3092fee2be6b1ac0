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

// token_nll's gradient: (exp(logit - lse) - onehot(target)) * g[row], 0 on rows with a negative
// (masked) target; logits and out may alias, as in cross_entropy_back.
extern "C" __global__ void token_nll_back(const real* logits, const int* __restrict__ targets,
                                          const real* __restrict__ lse, const real* __restrict__ g, real* out,
                                          long long n_rows, int n_vocab) {
    GRID_STRIDE(i, n_rows * n_vocab) {
        const long long row = i / n_vocab;
        const int c = (int)(i - row * n_vocab);
        const int t = targets[row];
        out[i] = t < 0 ? (real)0 : (exp(logits[i] - lse[row]) - (c == t ? (real)1 : (real)0)) * g[row];
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
