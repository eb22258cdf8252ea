// Reductions of a contiguous tensor viewed as [outer, len, inner]: sum, max and argmax.
// Rows (inner == 1) reduce with one block per row; columns (inner > 1) with one thread per
// output, adjacent threads reading adjacent elements. Whole-tensor sums run in two passes.
// Op codes are reduce_op::sum, max and argmax, from ferry-tensor's op table; others trap.

#define REDUCE_THREADS 256

template <typename A>
__device__ __forceinline__ void combine(int op, A& v, i64& k, A w, i64 l) {
    if (op == reduce_op::sum) {
        v += w;
    } else if (w > v || (w == v && l < k) || (w != w && v == v)) {  // NaN wins, first index on ties
        v = w;
        k = l;
    }
}

// Every reduction accumulates in double: long f32 rows keep their digits, as on the CPU, and the
// kernels are bound by memory bandwidth, not arithmetic.
template <typename T>
__device__ void reduce_row(int op, const T* x, T* out, i64* out_index, u64 outer, u64 len) {
    typedef double A;
    reduce_op::check(op);
    __shared__ A values[REDUCE_THREADS];
    __shared__ i64 indices[REDUCE_THREADS];
    for (u64 row = blockIdx.x; row < outer; row += gridDim.x) {
        const T* r = x + row * len;
        A v = op == reduce_op::sum ? (A)0 : m_neg_inf((A)0);
        i64 k = 0;
        bool any = false;
        for (u64 j = threadIdx.x; j < len; j += blockDim.x) {
            A w = (A)Num<T>::load(r[j]);
            if (!any && op != reduce_op::sum) { v = w; k = (i64)j; any = true; }
            else combine(op, v, k, w, (i64)j);
        }
        if (!any && op != reduce_op::sum) k = (i64)len;  // an empty share loses every tie
        values[threadIdx.x] = v;
        indices[threadIdx.x] = k;
        __syncthreads();
        for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
            if (threadIdx.x < s) {
                combine(op, values[threadIdx.x], indices[threadIdx.x], values[threadIdx.x + s],
                        indices[threadIdx.x + s]);
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) {
            if (op == reduce_op::argmax) out_index[row] = indices[0];
            else out[row] = Num<T>::store((typename Num<T>::Acc)values[0]);
        }
        __syncthreads();
    }
}

template <typename T>
__device__ void reduce_col(int op, const T* x, T* out, i64* out_index, u64 outer, u64 len, u64 inner) {
    typedef double A;
    reduce_op::check(op);
    FERRY_GRID_STRIDE(t, outer * inner) {
        u64 o = t / inner, i = t % inner;
        const T* base = x + o * len * inner + i;
        A v = op == reduce_op::sum ? (A)0 : (A)Num<T>::load(base[0]);
        i64 k = 0;
        for (u64 j = op == reduce_op::sum ? 0 : 1; j < len; ++j) combine(op, v, k, (A)Num<T>::load(base[j * inner]), (i64)j);
        if (op == reduce_op::argmax) out_index[t] = k;
        else out[t] = Num<T>::store((typename Num<T>::Acc)v);
    }
}

// A sum down long columns (`len` rows of `inner` columns, `outer` times), tiled: a 32x32 block
// takes 32 neighbouring columns, its 32 rows of threads each add every 32nd row (reads stay
// coalesced along the columns), and the 32 partials of each column are added in shared memory.
// One thread per column, as reduce_col does, leaves most of the GPU idle when there are few
// columns (a bias gradient: 4096 columns of 1024 rows).
#define COL_TILE 32
template <typename T>
__device__ void sum_col_tiled(const T* x, T* out, u64 outer, u64 len, u64 inner) {
    __shared__ double part[COL_TILE][COL_TILE + 1];
    const u64 tiles = (inner + COL_TILE - 1) / COL_TILE;
    for (u64 b = blockIdx.x; b < outer * tiles; b += gridDim.x) {
        const u64 o = b / tiles, i = (b % tiles) * COL_TILE + threadIdx.x;
        double acc = 0.0;
        if (i < inner) {
            const T* base = x + o * len * inner + i;
            for (u64 j = threadIdx.y; j < len; j += COL_TILE) acc += (double)Num<T>::load(base[j * inner]);
        }
        part[threadIdx.y][threadIdx.x] = acc;
        __syncthreads();
        if (threadIdx.y == 0 && i < inner) {
            double s = 0.0;
            for (int y = 0; y < COL_TILE; ++y) s += part[y][threadIdx.x];
            out[o * inner + i] = Num<T>::store((typename Num<T>::Acc)s);
        }
        __syncthreads();
    }
}

// Pass one of a whole-tensor sum: each block leaves one partial, in f64.
template <typename T>
__device__ void sum_partial(const T* x, u64 n, double* partials) {
    __shared__ double sums[REDUCE_THREADS];
    double acc = 0.0;
    FERRY_GRID_STRIDE(i, n) { acc += (double)Num<T>::load(x[i]); }
    sums[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sums[threadIdx.x] += sums[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) partials[blockIdx.x] = sums[0];
}

// Pass two: one block adds the partials.
template <typename T>
__device__ void sum_finish(const double* partials, u64 parts, T* out) {
    __shared__ double sums[REDUCE_THREADS];
    double acc = 0.0;
    for (u64 i = threadIdx.x; i < parts; i += blockDim.x) acc += partials[i];
    sums[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sums[threadIdx.x] += sums[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[0] = Num<T>::store((typename Num<T>::Acc)sums[0]);
}

#define REDUCE_KERNELS(T)                                                                          \
    extern "C" __global__ void reduce_row_##T(int op, const T* x, T* o, i64* oi, u64 outer,       \
                                              u64 len) {                                           \
        reduce_row<T>(op, x, o, oi, outer, len);                                                   \
    }                                                                                              \
    extern "C" __global__ void reduce_col_##T(int op, const T* x, T* o, i64* oi, u64 outer,       \
                                              u64 len, u64 inner) {                                \
        reduce_col<T>(op, x, o, oi, outer, len, inner);                                            \
    }                                                                                              \
    extern "C" __global__ void sum_col_tiled_##T(const T* x, T* o, u64 outer, u64 len, u64 inner) { \
        sum_col_tiled<T>(x, o, outer, len, inner);                                                 \
    }                                                                                              \
    extern "C" __global__ void sum_partial_##T(const T* x, u64 n, double* p) { sum_partial<T>(x, n, p); } \
    extern "C" __global__ void sum_finish_##T(const double* p, u64 parts, T* o) { sum_finish<T>(p, parts, o); }
REDUCE_KERNELS(float)
REDUCE_KERNELS(double)
REDUCE_KERNELS(f16)
REDUCE_KERNELS(bf16)
