// Row-wise softmax and log-softmax over the last axis of a contiguous tensor, fused: one block
// per row makes three passes over the row in cache (max, sum of exponentials, write) instead of
// the five kernels and round trips through memory the composed version costs.

#define SOFTMAX_THREADS 256

template <typename A>
__device__ A block_reduce(A v, bool is_max, A* scratch) {
    scratch[threadIdx.x] = v;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            A w = scratch[threadIdx.x + s];
            scratch[threadIdx.x] = is_max ? (w > scratch[threadIdx.x] ? w : scratch[threadIdx.x])
                                          : scratch[threadIdx.x] + w;
        }
        __syncthreads();
    }
    A r = scratch[0];
    __syncthreads();
    return r;
}

template <typename T>
__device__ void softmax(const T* x, T* out, u64 rows, u64 cols, int log_space) {
    typedef typename Num<T>::Acc A;
    __shared__ A scratch[SOFTMAX_THREADS];
    for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* r = x + row * cols;
        T* o = out + row * cols;
        A m = m_neg_inf((A)0);
        for (u64 j = threadIdx.x; j < cols; j += blockDim.x) {
            A v = Num<T>::load(r[j]);
            m = v > m ? v : m;
        }
        m = block_reduce(m, true, scratch);
        A s = 0;
        for (u64 j = threadIdx.x; j < cols; j += blockDim.x) s += m_exp(Num<T>::load(r[j]) - m);
        s = block_reduce(s, false, scratch);
        const A log_s = m_log(s);
        for (u64 j = threadIdx.x; j < cols; j += blockDim.x) {
            A v = Num<T>::load(r[j]) - m;
            o[j] = Num<T>::store(log_space ? v - log_s : m_exp(v) / s);
        }
    }
}

#define SOFTMAX_KERNELS(T)                                                                         \
    extern "C" __global__ void softmax_##T(const T* x, T* o, u64 rows, u64 cols, int log_space) { \
        softmax<T>(x, o, rows, cols, log_space);                                                   \
    }
SOFTMAX_KERNELS(float)
SOFTMAX_KERNELS(double)
SOFTMAX_KERNELS(f16)
SOFTMAX_KERNELS(bf16)
