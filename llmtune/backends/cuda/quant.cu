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
