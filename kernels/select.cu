// Choosing by a mask: where_cond over three broadcast layouts, and dropout as one fused op that
// draws its keep mask and scales in one pass (its backward applies the saved mask).

// Counter-based uniforms: element i of a draw with `seed` is a pure function of (seed, i), the
// same function as ferry-tensor's CPU dropout (src/cpu/select.rs), so a seed gives one mask on
// every device and every launch configuration.
__device__ __forceinline__ u64 select_splitmix64(u64 z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
__device__ __forceinline__ double select_uniform01(u64 seed, u64 i) {
    return (double)(select_splitmix64(seed ^ select_splitmix64(i)) >> 11) * (1.0 / 9007199254740992.0);
}

template <typename T>
__device__ void where_cond(const u8* c, Strided lc, const T* a, Strided la, const T* b, Strided lb,
                           T* out, u64 n) {
    FERRY_GRID_STRIDE(i, n) {
        out[i] = c[strided_offset(lc, i)] ? a[strided_offset(la, i)] : b[strided_offset(lb, i)];
    }
}

// Keeps element i when its uniform is >= p; the output is x * scale there and 0 elsewhere.
template <typename T>
__device__ void dropout(const T* x, Strided lx, T* out, u8* mask, u64 n, u64 seed, double p,
                        double scale) {
    typedef typename Num<T>::Acc A;
    const A s = (A)scale;
    FERRY_GRID_STRIDE(i, n) {
        const bool keep = select_uniform01(seed, i) >= p;
        mask[i] = keep ? 1 : 0;
        out[i] = Num<T>::store(keep ? Num<T>::load(x[strided_offset(lx, i)]) * s : (A)0);
    }
}

// Dropout's backward (and any reuse of a saved mask): x * scale where mask is set, else 0.
template <typename T>
__device__ void masked_scale(const T* x, Strided lx, const u8* mask, double scale, T* out, u64 n) {
    typedef typename Num<T>::Acc A;
    const A s = (A)scale;
    FERRY_GRID_STRIDE(i, n) {
        out[i] = Num<T>::store(mask[i] ? Num<T>::load(x[strided_offset(lx, i)]) * s : (A)0);
    }
}

#define WHERE_KERNEL(T)                                                                           \
    extern "C" __global__ void where_##T(const u8* c, Strided lc, const T* a, Strided la,        \
                                         const T* b, Strided lb, T* o, u64 n) {                  \
        where_cond<T>(c, lc, a, la, b, lb, o, n);                                                 \
    }
WHERE_KERNEL(float)
WHERE_KERNEL(double)
WHERE_KERNEL(f16)
WHERE_KERNEL(bf16)
WHERE_KERNEL(i64)
WHERE_KERNEL(u8)

#define DROPOUT_KERNELS(T)                                                                        \
    extern "C" __global__ void dropout_##T(const T* x, Strided lx, T* o, u8* mask, u64 n,        \
                                           u64 seed, double p, double scale) {                   \
        dropout<T>(x, lx, o, mask, n, seed, p, scale);                                            \
    }                                                                                             \
    extern "C" __global__ void masked_scale_##T(const T* x, Strided lx, const u8* mask,          \
                                                double scale, T* o, u64 n) {                     \
        masked_scale<T>(x, lx, mask, scale, o, n);                                                \
    }
DROPOUT_KERNELS(float)
DROPOUT_KERNELS(double)
DROPOUT_KERNELS(f16)
DROPOUT_KERNELS(bf16)
