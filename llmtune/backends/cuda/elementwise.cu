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
