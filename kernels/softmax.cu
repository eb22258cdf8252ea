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

// Negative log-likelihood of [rows, cols] log-probabilities at one class per row, averaged: one
// block sums the picked entries. A target outside 0..cols reads nothing; it is counted in bad[0]
// and kept in bad[1] (one of them), and makes the loss NaN, so a step that used it cannot pass
// for a good one before the host reads the flag.
template <typename T>
__device__ void nll(const T* logp, const i64* targets, T* loss, u64 rows, u64 cols, i64* bad) {
    typedef typename Num<T>::Acc A;
    __shared__ A scratch[SOFTMAX_THREADS];
    A s = 0;
    for (u64 i = threadIdx.x; i < rows; i += blockDim.x) {
        const i64 t = targets[i];
        if (t < 0 || (u64)t >= cols) {
            atomicAdd((unsigned long long*)&bad[0], 1ull);
            atomicExch((unsigned long long*)&bad[1], (unsigned long long)t);
            s += m_neg_inf((A)0) - m_neg_inf((A)0);  // NaN
        } else {
            s += Num<T>::load(logp[i * cols + (u64)t]);
        }
    }
    s = block_reduce(s, false, scratch);
    if (threadIdx.x == 0) loss[0] = Num<T>::store(-s / (A)rows);
}

// nll's gradient with respect to the log-probabilities: -g / rows at each row's target, 0
// elsewhere (a row whose target is out of range gets zeros; nll flagged it already).
template <typename T>
__device__ void nll_backward(const i64* targets, const T* g, T* out, u64 rows, u64 cols) {
    typedef typename Num<T>::Acc A;
    const A scale = -Num<T>::load(g[0]) / (A)rows;
    const u64 n = rows * cols;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 row = i / cols;
        out[i] = Num<T>::store((u64)targets[row] == i - row * cols ? scale : (A)0);
    }
}

#define NLL_KERNELS(T)                                                                            \
    extern "C" __global__ void nll_##T(const T* logp, const i64* targets, T* loss, u64 rows,      \
                                       u64 cols, i64* bad) {                                      \
        nll<T>(logp, targets, loss, rows, cols, bad);                                             \
    }                                                                                             \
    extern "C" __global__ void nll_backward_##T(const i64* targets, const T* g, T* out, u64 rows, \
                                                u64 cols) {                                       \
        nll_backward<T>(targets, g, out, rows, cols);                                             \
    }
NLL_KERNELS(float)
NLL_KERNELS(double)
NLL_KERNELS(f16)
NLL_KERNELS(bf16)

// Softmax's and log-softmax's gradient over the last axis from the saved output y, fused like
// the forward: one block per row. log: dx = g - exp(y) * sum(g); else dx = y * (g - sum(g * y)).
template <typename T>
__device__ void softmax_backward(const T* y, const T* g, T* dx, u64 rows, u64 cols, int log_space) {
    typedef typename Num<T>::Acc A;
    __shared__ A scratch[SOFTMAX_THREADS];
    for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* yr = y + row * cols;
        const T* gr = g + row * cols;
        T* o = dx + row * cols;
        A s = 0;
        for (u64 j = threadIdx.x; j < cols; j += blockDim.x) {
            A gv = Num<T>::load(gr[j]);
            s += log_space ? gv : gv * Num<T>::load(yr[j]);
        }
        s = block_reduce(s, false, scratch);
        for (u64 j = threadIdx.x; j < cols; j += blockDim.x) {
            A yv = Num<T>::load(yr[j]), gv = Num<T>::load(gr[j]);
            o[j] = Num<T>::store(log_space ? gv - m_exp(yv) * s : yv * (gv - s));
        }
    }
}

#define SOFTMAX_BACKWARD_KERNELS(T)                                                           \
    extern "C" __global__ void softmax_backward_##T(const T* y, const T* g, T* dx, u64 rows,  \
                                                    u64 cols, int log_space) {                \
        softmax_backward<T>(y, g, dx, rows, cols, log_space);                                 \
    }
SOFTMAX_BACKWARD_KERNELS(float)
SOFTMAX_BACKWARD_KERNELS(double)
SOFTMAX_BACKWARD_KERNELS(f16)
SOFTMAX_BACKWARD_KERNELS(bf16)

// Cross-entropy of [rows, cols] logits against one target class per row, without a second
// [rows, cols] array: one block per row finds the row's log-sum-exp in one pass (each thread an
// online maximum and rescaled sum, merged across the block) and keeps it; one block then
// averages lse - x[target] over the rows whose target is not the ignored class, checking the
// targets as nll does; the backward rebuilds softmax from the kept log-sum-exp, one block a row.
template <typename A>
__device__ void lse_merge(A& m, A& s, A m2, A s2) {
    const A mx = m > m2 ? m : m2;
    if (mx == m_neg_inf((A)0)) return;  // both empty so far
    s = s * m_exp(m - mx) + s2 * m_exp(m2 - mx);
    m = mx;
}

template <typename T>
__device__ void cross_entropy_rows(const T* x, typename Num<T>::Acc* lse, u64 rows, u64 cols) {
    typedef typename Num<T>::Acc A;
    __shared__ A sm[SOFTMAX_THREADS];
    __shared__ A ss[SOFTMAX_THREADS];
    for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* r = x + row * cols;
        A m = m_neg_inf((A)0), s = 0;
        for (u64 j = threadIdx.x; j < cols; j += blockDim.x) {
            const A v = Num<T>::load(r[j]);
            if (v > m) {
                s = s * m_exp(m - v) + (A)1;
                m = v;
            } else {
                s += m_exp(v - m);
            }
        }
        sm[threadIdx.x] = m;
        ss[threadIdx.x] = s;
        __syncthreads();
        for (unsigned int h = blockDim.x / 2; h > 0; h >>= 1) {
            if (threadIdx.x < h) {
                A mm = sm[threadIdx.x], s2 = ss[threadIdx.x];
                lse_merge(mm, s2, sm[threadIdx.x + h], ss[threadIdx.x + h]);
                sm[threadIdx.x] = mm;
                ss[threadIdx.x] = s2;
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) lse[row] = sm[0] + m_log(ss[0]);
        __syncthreads();
    }
}

template <typename T>
__device__ void cross_entropy_mean(const T* x, const i64* targets, const typename Num<T>::Acc* lse,
                                   T* loss, u64 rows, u64 cols, i64 ignore, int has_ignore,
                                   i64* bad) {
    typedef typename Num<T>::Acc A;
    __shared__ A scratch[SOFTMAX_THREADS];
    A s = 0, n = 0;
    for (u64 i = threadIdx.x; i < rows; i += blockDim.x) {
        const i64 t = targets[i];
        if (has_ignore && t == ignore) continue;
        if (t < 0 || (u64)t >= cols) {
            atomicAdd((unsigned long long*)&bad[0], 1ull);
            atomicExch((unsigned long long*)&bad[1], (unsigned long long)t);
            s += m_neg_inf((A)0) - m_neg_inf((A)0);  // NaN
        } else {
            s += lse[i] - Num<T>::load(x[i * cols + (u64)t]);
        }
        n += (A)1;
    }
    s = block_reduce(s, false, scratch);
    n = block_reduce(n, false, scratch);
    if (threadIdx.x == 0) loss[0] = Num<T>::store(s / n);  // no row counted: 0 / 0, NaN
}

template <typename T>
__device__ void cross_entropy_backward(const T* x, const i64* targets,
                                       const typename Num<T>::Acc* lse,
                                       const typename Num<T>::Acc* scale, T* dx, u64 rows,
                                       u64 cols, i64 ignore, int has_ignore) {
    typedef typename Num<T>::Acc A;
    const A sc = scale[0];
    for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* r = x + row * cols;
        T* o = dx + row * cols;
        const i64 t = targets[row];
        const bool skip = has_ignore && t == ignore;
        const A l = lse[row];
        for (u64 j = threadIdx.x; j < cols; j += blockDim.x) {
            const A hot = (u64)t == j ? (A)1 : (A)0;
            o[j] = Num<T>::store(skip ? (A)0 : (m_exp(Num<T>::load(r[j]) - l) - hot) * sc);
        }
    }
}

#define CROSS_ENTROPY_KERNELS(T)                                                                   \
    extern "C" __global__ void cross_entropy_rows_##T(const T* x, Num<T>::Acc* lse, u64 rows,      \
                                                      u64 cols) {                                  \
        cross_entropy_rows<T>(x, lse, rows, cols);                                                 \
    }                                                                                              \
    extern "C" __global__ void cross_entropy_mean_##T(const T* x, const i64* targets,              \
                                                      const Num<T>::Acc* lse, T* loss, u64 rows,   \
                                                      u64 cols, i64 ignore, int has_ignore,        \
                                                      i64* bad) {                                  \
        cross_entropy_mean<T>(x, targets, lse, loss, rows, cols, ignore, has_ignore, bad);         \
    }                                                                                              \
    extern "C" __global__ void cross_entropy_backward_##T(                                        \
        const T* x, const i64* targets, const Num<T>::Acc* lse, const Num<T>::Acc* scale, T* dx,   \
        u64 rows, u64 cols, i64 ignore, int has_ignore) {                                          \
        cross_entropy_backward<T>(x, targets, lse, scale, dx, rows, cols, ignore, has_ignore);     \
    }
CROSS_ENTROPY_KERNELS(float)
CROSS_ENTROPY_KERNELS(double)
CROSS_ENTROPY_KERNELS(f16)
CROSS_ENTROPY_KERNELS(bf16)
