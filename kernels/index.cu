// Indexing along one axis: index_select and gather read through i64 indices, index_add and
// scatter_add accumulate through them with atomics (the order of additions into one element is
// not fixed, so float sums may differ in the last bits from run to run).
//
// Every kernel checks each index against the axis length; an index outside it is skipped (no
// memory outside the tensor is touched), counted in bad[0] and kept in bad[1] (one of them), and
// the host reads both back and reports the first as an error.

// An iteration shape (the index's, for gather and scatter_add) over a target tensor's strides
// (elements) along which `axis` is replaced by the index. Mirrors cuda/index.rs's `IndexGeom`.
struct IndexGeom {
    u64 shape[FERRY_MAX_DIMS];
    u64 strides[FERRY_MAX_DIMS];
    u64 offset;
    u64 axis_len;
    unsigned int ndim;
    unsigned int axis;
};

__device__ __forceinline__ bool index_ok(i64 k, u64 len, u64* bad) {
    if (k >= 0 && (u64)k < len) return true;
    atomicAdd((unsigned long long*)&bad[0], 1ull);
    atomicExch((unsigned long long*)&bad[1], (unsigned long long)k);
    return false;
}

// Offset in the target of element `p` of the iteration shape, with index `k` on the axis.
__device__ __forceinline__ u64 geom_offset(const IndexGeom& g, u64 p, u64 k) {
    u64 off = g.offset;
    for (int d = (int)g.ndim - 1; d >= 0; --d) {
        u64 dim = g.shape[d];
        u64 c = p % dim;
        p /= dim;
        off += ((unsigned int)d == g.axis ? k : c) * g.strides[d];
    }
    return off;
}

// Accumulation into memory other threads may add to at the same time.
__device__ __forceinline__ void atomic_acc(float* a, float v) { atomicAdd(a, v); }
__device__ __forceinline__ void atomic_acc(double* a, double v) { atomicAdd(a, v); }

// 16-bit floats: a compare-and-swap loop on the aligned 32-bit word holding the element (device
// buffers start 256-byte aligned and are rounded up, so that word lies inside the allocation).
template <typename H>
__device__ __forceinline__ void atomic_acc_16(H* a, float v) {
    unsigned int* word = (unsigned int*)((u64)a & ~(u64)3);
    unsigned int shift = ((u64)a & 2) ? 16u : 0u;
    unsigned int old = *word, assumed;
    do {
        assumed = old;
        H h;
        h.bits = (unsigned short)((assumed >> shift) & 0xffffu);
        H r = Num<H>::store(Num<H>::load(h) + v);
        unsigned int next = (assumed & ~(0xffffu << shift)) | ((unsigned int)r.bits << shift);
        old = atomicCAS(word, assumed, next);
    } while (assumed != old);
}
__device__ __forceinline__ void atomic_acc(f16* a, float v) { atomic_acc_16(a, v); }
__device__ __forceinline__ void atomic_acc(bf16* a, float v) { atomic_acc_16(a, v); }

// out[o, j, i] = x[o, idx[j], i] for a dense x of [outer, len, inner] and idx of [k].
template <typename E>
__device__ void index_select(const E* x, const i64* idx, E* out, u64 len, u64 k, u64 inner,
                             u64 n, u64* bad) {
    FERRY_GRID_STRIDE(p, n) {
        u64 i = p % inner;
        u64 j = (p / inner) % k;
        u64 o = p / (inner * k);
        i64 at = idx[j];
        out[p] = index_ok(at, len, bad) ? x[(o * len + (u64)at) * inner + i] : (E)0;
    }
}

// out[p] = x[.. idx[p] on the axis ..] over the index's shape; x through its own strides.
template <typename E>
__device__ void gather_axis(const E* x, IndexGeom g, const i64* idx, E* out, u64 n, u64* bad) {
    FERRY_GRID_STRIDE(p, n) {
        i64 at = idx[p];
        out[p] = index_ok(at, g.axis_len, bad) ? x[geom_offset(g, p, (u64)at)] : (E)0;
    }
}

// out[o, idx[j], i] += src[o, j, i]; out dense [outer, len, inner], src dense [outer, k, inner].
template <typename T>
__device__ void index_add(T* out, const i64* idx, const T* src, u64 len, u64 k, u64 inner,
                          u64 n, u64* bad) {
    FERRY_GRID_STRIDE(p, n) {
        u64 i = p % inner;
        u64 j = (p / inner) % k;
        u64 o = p / (inner * k);
        i64 at = idx[j];
        if (index_ok(at, len, bad)) {
            atomic_acc(&out[(o * len + (u64)at) * inner + i], Num<T>::load(src[p]));
        }
    }
}

// out[.. idx[p] on the axis ..] += src[p] over the index's shape (src dense in that shape).
template <typename T>
__device__ void scatter_add(T* out, IndexGeom g, const i64* idx, const T* src, u64 n, u64* bad) {
    FERRY_GRID_STRIDE(p, n) {
        i64 at = idx[p];
        if (index_ok(at, g.axis_len, bad)) {
            atomic_acc(&out[geom_offset(g, p, (u64)at)], Num<T>::load(src[p]));
        }
    }
}

// Copies move elements by size: one kernel per width serves every dtype of that width.
#define INDEX_COPY_KERNELS(E, W)                                                                   \
    extern "C" __global__ void index_select_##W(const E* x, const i64* idx, E* out, u64 len,      \
                                                u64 k, u64 inner, u64 n, u64* bad) {              \
        index_select<E>(x, idx, out, len, k, inner, n, bad);                                      \
    }                                                                                              \
    extern "C" __global__ void gather_axis_##W(const E* x, IndexGeom g, const i64* idx, E* out,   \
                                               u64 n, u64* bad) {                                 \
        gather_axis<E>(x, g, idx, out, n, bad);                                                    \
    }
INDEX_COPY_KERNELS(u8, b8)
INDEX_COPY_KERNELS(unsigned short, b16)
INDEX_COPY_KERNELS(unsigned int, b32)
INDEX_COPY_KERNELS(u64, b64)

#define INDEX_ADD_KERNELS(T)                                                                       \
    extern "C" __global__ void index_add_##T(T* out, const i64* idx, const T* src, u64 len,       \
                                             u64 k, u64 inner, u64 n, u64* bad) {                 \
        index_add<T>(out, idx, src, len, k, inner, n, bad);                                        \
    }                                                                                              \
    extern "C" __global__ void scatter_add_##T(T* out, IndexGeom g, const i64* idx, const T* src, \
                                               u64 n, u64* bad) {                                 \
        scatter_add<T>(out, g, idx, src, n, bad);                                                  \
    }
INDEX_ADD_KERNELS(float)
INDEX_ADD_KERNELS(double)
INDEX_ADD_KERNELS(f16)
INDEX_ADD_KERNELS(bf16)
