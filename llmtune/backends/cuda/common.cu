// Shared by every section (llmtune/backends/cuda/runtime.py kernel_source puts it first).
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
