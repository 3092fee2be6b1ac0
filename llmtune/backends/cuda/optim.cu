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
