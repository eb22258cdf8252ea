// Layer normalization and RMSNorm over the last axis of a contiguous tensor, fused.
//
// Forward: one block per row makes three passes over the row in cache (mean, variance about the
// mean, write) and keeps the row's mean and 1/sqrt(var + eps) in `stats` ([rows, 2], in the
// accumulation type) for the backward.
// Backward: one block per row computes dx from g, x, the weight and the saved statistics; the
// weight and bias gradients are column sums over rows, made in two deterministic steps (partial
// sums over chunks of rows, then a sum of the chunks), with no atomics.

#define NORM_THREADS 256
#define NORM_COLS 32   // columns per block of the parameter-gradient kernel
#define NORM_ROWS 8    // threads per column in that block

template <typename A>
__device__ __forceinline__ A norm_warp_sum(A v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The sum over the block of each thread's v: each warp by shuffles, then the first warp sums the
// warps' sums; every thread gets the total. `scratch` holds 32 values.
template <typename A>
__device__ A norm_block_warp_sum(A v, A* scratch) {
    const unsigned int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = norm_warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = threadIdx.x < (blockDim.x >> 5) ? scratch[lane] : (A)0;
        v = norm_warp_sum(v);
        if (lane == 0) scratch[0] = v;
    }
    __syncthreads();
    const A r = scratch[0];
    __syncthreads();
    return r;
}

template <typename T>
__device__ void layer_norm(const T* x, const T* w, const T* b, T* y,
                           typename Num<T>::Acc* stats, u64 rows, u64 cols, double eps) {
    typedef typename Num<T>::Acc A;
    __shared__ A scratch[32];
    for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* r = x + row * cols;
        T* o = y + row * cols;
        A s = 0;
        for (u64 j = threadIdx.x; j < cols; j += blockDim.x) s += Num<T>::load(r[j]);
        const A mean = norm_block_warp_sum(s, scratch) / (A)cols;
        A q = 0;
        for (u64 j = threadIdx.x; j < cols; j += blockDim.x) {
            A d = Num<T>::load(r[j]) - mean;
            q += d * d;
        }
        const A rstd = (A)1 / m_sqrt(norm_block_warp_sum(q, scratch) / (A)cols + (A)eps);
        for (u64 j = threadIdx.x; j < cols; j += blockDim.x) {
            A v = (Num<T>::load(r[j]) - mean) * rstd;
            if (w) v *= Num<T>::load(w[j]);
            if (b) v += Num<T>::load(b[j]);
            o[j] = Num<T>::store(v);
        }
        if (threadIdx.x == 0) {
            stats[2 * row] = mean;
            stats[2 * row + 1] = rstd;
        }
    }
}

// dx = rstd (gw - mean(gw) - x̂ mean(gw x̂)) with gw = g w and x̂ = (x - mean) rstd.
template <typename T>
__device__ void layer_norm_backward(const T* g, const T* x, const T* w,
                                    const typename Num<T>::Acc* stats, T* dx, u64 rows,
                                    u64 cols) {
    typedef typename Num<T>::Acc A;
    __shared__ A scratch[32];
    for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* gr = g + row * cols;
        const T* xr = x + row * cols;
        T* o = dx + row * cols;
        const A mean = stats[2 * row], rstd = stats[2 * row + 1];
        A s1 = 0, s2 = 0;
        for (u64 j = threadIdx.x; j < cols; j += blockDim.x) {
            A gw = Num<T>::load(gr[j]);
            if (w) gw *= Num<T>::load(w[j]);
            s1 += gw;
            s2 += gw * (Num<T>::load(xr[j]) - mean) * rstd;
        }
        const A m1 = norm_block_warp_sum(s1, scratch) / (A)cols;
        const A m2 = norm_block_warp_sum(s2, scratch) / (A)cols;
        for (u64 j = threadIdx.x; j < cols; j += blockDim.x) {
            A gw = Num<T>::load(gr[j]);
            if (w) gw *= Num<T>::load(w[j]);
            A xh = (Num<T>::load(xr[j]) - mean) * rstd;
            o[j] = Num<T>::store(rstd * (gw - m1 - xh * m2));
        }
    }
}

// Partial column sums of g x̂ (for the weight) and g (for the bias) over one chunk of rows:
// block (NORM_COLS, NORM_ROWS), grid (column blocks, chunks); partial is [chunks, 2, cols].
template <typename T>
__device__ void layer_norm_params(const T* g, const T* x, const typename Num<T>::Acc* stats,
                                  typename Num<T>::Acc* partial, u64 rows, u64 cols,
                                  u64 rows_per_chunk) {
    typedef typename Num<T>::Acc A;
    __shared__ A sw[NORM_ROWS][NORM_COLS + 1];
    __shared__ A sb[NORM_ROWS][NORM_COLS + 1];
    const u64 j = (u64)blockIdx.x * NORM_COLS + threadIdx.x;
    const u64 start = (u64)blockIdx.y * rows_per_chunk;
    const u64 end = start + rows_per_chunk < rows ? start + rows_per_chunk : rows;
    A aw = 0, ab = 0;
    if (j < cols) {
        for (u64 r = start + threadIdx.y; r < end; r += NORM_ROWS) {
            A gv = Num<T>::load(g[r * cols + j]);
            aw += gv * (Num<T>::load(x[r * cols + j]) - stats[2 * r]) * stats[2 * r + 1];
            ab += gv;
        }
    }
    sw[threadIdx.y][threadIdx.x] = aw;
    sb[threadIdx.y][threadIdx.x] = ab;
    __syncthreads();
    if (threadIdx.y == 0 && j < cols) {
        for (int k = 1; k < NORM_ROWS; ++k) {
            aw += sw[k][threadIdx.x];
            ab += sb[k][threadIdx.x];
        }
        partial[(2 * (u64)blockIdx.y) * cols + j] = aw;
        partial[(2 * (u64)blockIdx.y + 1) * cols + j] = ab;
    }
}

// dw[j] and db[j] (either may be null) as sums of the chunks' partial sums.
template <typename T>
__device__ void layer_norm_params_finish(const typename Num<T>::Acc* partial, T* dw, T* db,
                                         u64 chunks, u64 cols) {
    typedef typename Num<T>::Acc A;
    FERRY_GRID_STRIDE(j, cols) {
        A aw = 0, ab = 0;
        for (u64 c = 0; c < chunks; ++c) {
            aw += partial[2 * c * cols + j];
            ab += partial[(2 * c + 1) * cols + j];
        }
        if (dw) dw[j] = Num<T>::store(aw);
        if (db) db[j] = Num<T>::store(ab);
    }
}

#define NORM_KERNELS(T)                                                                            \
    extern "C" __global__ void layer_norm_##T(const T* x, const T* w, const T* b, T* y,           \
                                              Num<T>::Acc* stats, u64 rows, u64 cols,             \
                                              double eps) {                                        \
        layer_norm<T>(x, w, b, y, stats, rows, cols, eps);                                         \
    }                                                                                              \
    extern "C" __global__ void layer_norm_backward_##T(const T* g, const T* x, const T* w,        \
                                                       const Num<T>::Acc* stats, T* dx, u64 rows, \
                                                       u64 cols) {                                 \
        layer_norm_backward<T>(g, x, w, stats, dx, rows, cols);                                    \
    }                                                                                              \
    extern "C" __global__ void layer_norm_params_##T(const T* g, const T* x,                      \
                                                     const Num<T>::Acc* stats,                     \
                                                     Num<T>::Acc* partial, u64 rows, u64 cols,     \
                                                     u64 rows_per_chunk) {                         \
        layer_norm_params<T>(g, x, stats, partial, rows, cols, rows_per_chunk);                    \
    }                                                                                              \
    extern "C" __global__ void layer_norm_params_finish_##T(const Num<T>::Acc* partial, T* dw,    \
                                                            T* db, u64 chunks, u64 cols) {         \
        layer_norm_params_finish<T>(partial, dw, db, chunks, cols);                                \
    }
NORM_KERNELS(float)
NORM_KERNELS(double)
NORM_KERNELS(f16)
NORM_KERNELS(bf16)

// RMSNorm: y = x / sqrt(mean(x²) + eps) * w, one block per row (a multiple of 32 threads, at
// most 1024) reducing by warp shuffles; the row's 1/sqrt(mean(x²) + eps) is kept in `rstd`
// ([rows], in the accumulation type). The normalized value is rounded to T before the weight
// multiplies it (transformers' LlamaRMSNorm order; exact for float and double).

template <typename T>
__device__ void rms_norm(const T* x, const T* w, T* y, typename Num<T>::Acc* rstd, u64 rows,
                         u64 cols, double eps) {
    typedef typename Num<T>::Acc A;
    __shared__ A scratch[32];
    for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* r = x + row * cols;
        T* o = y + row * cols;
        A s = 0;
        for (u64 j = threadIdx.x; j < cols; j += blockDim.x) {
            const A v = Num<T>::load(r[j]);
            s += v * v;
        }
        const A inv = (A)1 / m_sqrt(norm_block_warp_sum(s, scratch) / (A)cols + (A)eps);
        for (u64 j = threadIdx.x; j < cols; j += blockDim.x) {
            const T n = Num<T>::store(Num<T>::load(r[j]) * inv);
            o[j] = w ? Num<T>::store(Num<T>::load(n) * Num<T>::load(w[j])) : n;
        }
        if (threadIdx.x == 0) rstd[row] = inv;
    }
}

// dx = rstd (gw - x̂ mean(gw x̂)) with gw = g w and x̂ = x rstd.
template <typename T>
__device__ void rms_norm_backward(const T* g, const T* x, const T* w,
                                  const typename Num<T>::Acc* rstd, T* dx, u64 rows, u64 cols) {
    typedef typename Num<T>::Acc A;
    __shared__ A scratch[32];
    for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* gr = g + row * cols;
        const T* xr = x + row * cols;
        T* o = dx + row * cols;
        const A r = rstd[row];
        A s = 0;
        for (u64 j = threadIdx.x; j < cols; j += blockDim.x) {
            A gw = Num<T>::load(gr[j]);
            if (w) gw *= Num<T>::load(w[j]);
            s += gw * Num<T>::load(xr[j]);
        }
        const A m = norm_block_warp_sum(s, scratch) * r / (A)cols;
        for (u64 j = threadIdx.x; j < cols; j += blockDim.x) {
            A gw = Num<T>::load(gr[j]);
            if (w) gw *= Num<T>::load(w[j]);
            o[j] = Num<T>::store(r * (gw - Num<T>::load(xr[j]) * r * m));
        }
    }
}

// Partial column sums of g x̂ (for the weight) over one chunk of rows: block (NORM_COLS,
// NORM_ROWS), grid (column blocks, chunks); partial is [chunks, cols].
template <typename T>
__device__ void rms_norm_params(const T* g, const T* x, const typename Num<T>::Acc* rstd,
                                typename Num<T>::Acc* partial, u64 rows, u64 cols,
                                u64 rows_per_chunk) {
    typedef typename Num<T>::Acc A;
    __shared__ A sw[NORM_ROWS][NORM_COLS + 1];
    const u64 j = (u64)blockIdx.x * NORM_COLS + threadIdx.x;
    const u64 start = (u64)blockIdx.y * rows_per_chunk;
    const u64 end = start + rows_per_chunk < rows ? start + rows_per_chunk : rows;
    A aw = 0;
    if (j < cols) {
        for (u64 r = start + threadIdx.y; r < end; r += NORM_ROWS)
            aw += Num<T>::load(g[r * cols + j]) * Num<T>::load(x[r * cols + j]) * rstd[r];
    }
    sw[threadIdx.y][threadIdx.x] = aw;
    __syncthreads();
    if (threadIdx.y == 0 && j < cols) {
        for (int k = 1; k < NORM_ROWS; ++k) aw += sw[k][threadIdx.x];
        partial[(u64)blockIdx.y * cols + j] = aw;
    }
}

// dw[j] as the sum of the chunks' partial sums.
template <typename T>
__device__ void rms_norm_params_finish(const typename Num<T>::Acc* partial, T* dw, u64 chunks,
                                       u64 cols) {
    typedef typename Num<T>::Acc A;
    FERRY_GRID_STRIDE(j, cols) {
        A a = 0;
        for (u64 c = 0; c < chunks; ++c) a += partial[c * cols + j];
        dw[j] = Num<T>::store(a);
    }
}

#define RMS_NORM_KERNELS(T)                                                                        \
    extern "C" __global__ void rms_norm_##T(const T* x, const T* w, T* y, Num<T>::Acc* rstd,      \
                                            u64 rows, u64 cols, double eps) {                      \
        rms_norm<T>(x, w, y, rstd, rows, cols, eps);                                               \
    }                                                                                              \
    extern "C" __global__ void rms_norm_backward_##T(const T* g, const T* x, const T* w,          \
                                                     const Num<T>::Acc* rstd, T* dx, u64 rows,     \
                                                     u64 cols) {                                   \
        rms_norm_backward<T>(g, x, w, rstd, dx, rows, cols);                                       \
    }                                                                                              \
    extern "C" __global__ void rms_norm_params_##T(const T* g, const T* x,                        \
                                                   const Num<T>::Acc* rstd, Num<T>::Acc* partial,  \
                                                   u64 rows, u64 cols, u64 rows_per_chunk) {       \
        rms_norm_params<T>(g, x, rstd, partial, rows, cols, rows_per_chunk);                       \
    }                                                                                              \
    extern "C" __global__ void rms_norm_params_finish_##T(const Num<T>::Acc* partial, T* dw,      \
                                                          u64 chunks, u64 cols) {                  \
        rms_norm_params_finish<T>(partial, dw, chunks, cols);                                      \
    }
RMS_NORM_KERNELS(float)
RMS_NORM_KERNELS(double)
RMS_NORM_KERNELS(f16)
RMS_NORM_KERNELS(bf16)
