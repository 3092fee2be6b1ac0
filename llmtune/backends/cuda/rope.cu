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
