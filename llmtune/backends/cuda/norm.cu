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

// ------------------------------------------------------------------ 1 / L2 norm of each row (DoRA's weight norm)
extern "C" __global__ void row_rnorm(const real* __restrict__ x, real* __restrict__ out, int n) {
    __shared__ real scratch[32];
    const real* xr = x + (long long)blockIdx.x * n;
    real ss = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_reduce(ss, scratch, false);
    if (threadIdx.x == 0) out[blockIdx.x] = (real)1 / sqrt(ss);
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
