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

// bitsandbytes' AdamW8bit (kOptimizerStatic8bit2StateBlockwise): one thread block per quantization
// block of at most ADAM8_PER_THREAD x blockDim values (quant/dynamic8.py BLOCK) (starts[b]..starts[b+1]), ADAM8_PER_THREAD values per thread.
// The moments are bytes indexing the dynamic maps code_m (signed) / code_v (unsigned) scaled by the
// block's absmax; each is dequantized, updated as adamw_step, and requantized to the entry nearest
// value / new absmax (binary search over the 255 midpoints; ties to the lower entry), the first
// moment keeping its sign. Matches backends/cpu.py _adamw8bit_range (1 - beta rounded once, on the host, as there).
__device__ __forceinline__ int nearest_code(const real* __restrict__ mid, real x) {
    int lo = 0, hi = 255;  // the number of midpoints below x
    while (lo < hi) {
        const int h = (lo + hi) >> 1;
        if (mid[h] < x) lo = h + 1;
        else hi = h;
    }
    return lo;
}

extern "C" __global__ void adamw8bit_step(real* __restrict__ w, const real* __restrict__ g, unsigned char* __restrict__ m,
                                          unsigned char* __restrict__ v, real* __restrict__ absmax_m,
                                          real* __restrict__ absmax_v, const long long* __restrict__ starts,
                                          long long n_blocks, const real* __restrict__ code_m,
                                          const real* __restrict__ code_v, real alpha, real beta1, real beta2, real one_beta1,
                                          real one_beta2, real eps, real wd, real beta1h, real beta2h) {
    __shared__ real cm[256], cv[256], mid_m[255], mid_v[255], scratch[32];
    for (int k = threadIdx.x; k < 256; k += blockDim.x) {
        cm[k] = code_m[k];
        cv[k] = code_v[k];
    }
    __syncthreads();
    for (int k = threadIdx.x; k < 255; k += blockDim.x) {
        mid_m[k] = (cm[k] + cm[k + 1]) * (real)0.5;
        mid_v[k] = (cv[k] + cv[k + 1]) * (real)0.5;
    }
    __syncthreads();
    for (long long b = blockIdx.x; b < n_blocks; b += gridDim.x) {
        const long long s = starts[b], e = starts[b + 1];
        const real am = absmax_m[b], av = absmax_v[b];  // read by every thread before thread 0 rewrites them
        real ms[ADAM8_PER_THREAD], vs[ADAM8_PER_THREAD];
        real top_m = 0, top_v = 0;
        for (int k = 0; k < ADAM8_PER_THREAD; k++) {
            const long long i = s + threadIdx.x + (long long)k * blockDim.x;
            if (i >= e) break;
            const real gi = g[i];
            ms[k] = cm[m[i]] * am * beta1 + gi * one_beta1;
            vs[k] = cv[v[i]] * av * beta2 + gi * gi * one_beta2;
            const real vh = sqrt(vs[k] * beta2h) + eps;
            w[i] = w[i] * ((real)1 - alpha * wd) - alpha * (ms[k] * beta1h) / vh;
            top_m = fmax(top_m, fmax(ms[k], -ms[k]));
            top_v = fmax(top_v, fmax(vs[k], -vs[k]));
        }
        const real new_m = block_reduce(top_m, scratch, true);
        const real new_v = block_reduce(top_v, scratch, true);
        if (threadIdx.x == 0) {
            absmax_m[b] = new_m;
            absmax_v[b] = new_v;
        }
        for (int k = 0; k < ADAM8_PER_THREAD; k++) {
            const long long i = s + threadIdx.x + (long long)k * blockDim.x;
            if (i >= e) break;
            const real xm = new_m > 0 ? ms[k] / new_m : (real)0, xv = new_v > 0 ? vs[k] / new_v : (real)0;
            int qm = nearest_code(mid_m, xm);
            if ((cm[qm] < 0) != (xm < 0)) qm += xm > 0 ? 1 : -1;
            m[i] = (unsigned char)qm;
            v[i] = (unsigned char)nearest_code(mid_v, xv);
        }
    }
}
