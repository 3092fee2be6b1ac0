// ------------------------------------------------------------------ KV cache
// cache[b, h, pos[t], c] = x[b, t, h, c]: x contiguous [B, T, H, d], cache contiguous [B, H, N, d];
// pos_stride = n_tok: positions per sequence pos[B, T] (cache[b, h, pos[b, t], c]), 0: shared pos[T].
extern "C" __global__ void cache_write(const real* __restrict__ x, const int* __restrict__ pos, real* __restrict__ cache,
                                       int n_tok, int n_head, int n_ctx, int d, int pos_stride, long long n) {
    GRID_STRIDE(i, n) {
        const int c = (int)(i % d);
        long long r = i / d;
        const int h = (int)(r % n_head);
        r /= n_head;
        const int t = (int)(r % n_tok);
        const long long b = r / n_tok;
        cache[((b * n_head + h) * n_ctx + pos[b * pos_stride + t]) * d + c] = x[i];
    }
}
