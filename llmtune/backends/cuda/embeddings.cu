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
