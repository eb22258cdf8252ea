// Elementwise kernels: unary maps (scalar parameters travel as `scalar`), broadcast binary ops,
// comparisons, dtype casts, fills and counter-based random numbers (strided copies and the
// gather are copy.cu's).
// The per-op functions ferry_unary, ferry_binary and ferry_compare come from ferry-tensor's op
// table (crates/ferry-tensor/src/ops/mod.rs), placed before this file; an unknown op code traps.

// ---- unary ---------------------------------------------------------------------------------
template <typename T>
__device__ void unary(int op, double scalar, const T* x, Strided lx, T* out, u64 n) {
    typedef typename Num<T>::Acc A;
    const A c = (A)scalar;
    constexpr int V = FERRY_PACK(sizeof(T));
    typedef Pack<T, V> P;
    u64 done = 0;
    if (packs<V>(lx, x, sizeof(T)) && aligned_to(out, sizeof(P))) {
        const u64 runs = n / V;
        FERRY_GRID_STRIDE(k, runs) {
            P p = *(const P*)(x + strided_offset(lx, k * V));
#pragma unroll
            for (int j = 0; j < V; ++j) p.v[j] = Num<T>::store(ferry_unary(op, Num<T>::load(p.v[j]), c));
            ((P*)out)[k] = p;
        }
        done = runs * V;
    }
    FERRY_GRID_STRIDE(r, n - done) {
        const u64 i = done + r;
        A v = Num<T>::load(x[strided_offset(lx, i)]);
        out[i] = Num<T>::store(ferry_unary(op, v, c));
    }
}

// ---- binary --------------------------------------------------------------------------------
template <typename T>
__device__ void binary(int op, const T* a, Strided la, const T* b, Strided lb, T* out, u64 n) {
    typedef typename Num<T>::Acc A;
    constexpr int V = FERRY_PACK(sizeof(T));
    typedef Pack<T, V> P;
    u64 done = 0;
    if (packs<V>(la, a, sizeof(T)) && packs<V>(lb, b, sizeof(T)) && aligned_to(out, sizeof(P))) {
        const u64 runs = n / V;
        FERRY_GRID_STRIDE(k, runs) {
            P x = *(const P*)(a + strided_offset(la, k * V));
            const P y = *(const P*)(b + strided_offset(lb, k * V));
#pragma unroll
            for (int j = 0; j < V; ++j)
                x.v[j] = Num<T>::store(ferry_binary(op, Num<T>::load(x.v[j]), Num<T>::load(y.v[j])));
            ((P*)out)[k] = x;
        }
        done = runs * V;
    }
    FERRY_GRID_STRIDE(r, n - done) {
        const u64 i = done + r;
        A x = Num<T>::load(a[strided_offset(la, i)]);
        A y = Num<T>::load(b[strided_offset(lb, i)]);
        out[i] = Num<T>::store(ferry_binary(op, x, y));
    }
}

template <typename T>
__device__ void compare(int op, const T* a, Strided la, const T* b, Strided lb, u8* out, u64 n) {
    typedef typename Num<T>::Acc A;
    FERRY_GRID_STRIDE(i, n) {
        A x = Num<T>::load(a[strided_offset(la, i)]);
        A y = Num<T>::load(b[strided_offset(lb, i)]);
        out[i] = ferry_compare(op, x, y) ? 1 : 0;
    }
}

// ---- casts, copies, fills --------------------------------------------------------------------
template <typename S, typename D>
__device__ void cast(const S* x, Strided lx, D* out, u64 n) {
    typedef typename Num<D>::Acc A;
    constexpr int V = FERRY_PACK(sizeof(S) > sizeof(D) ? sizeof(S) : sizeof(D));
    typedef Pack<S, V> In;
    typedef Pack<D, V> Out;
    u64 done = 0;
    if (packs<V>(lx, x, sizeof(S)) && aligned_to(out, sizeof(Out))) {
        const u64 runs = n / V;
        FERRY_GRID_STRIDE(k, runs) {
            const In p = *(const In*)(x + strided_offset(lx, k * V));
            Out q;
#pragma unroll
            for (int j = 0; j < V; ++j) q.v[j] = Num<D>::store((A)Num<S>::load(p.v[j]));
            ((Out*)out)[k] = q;
        }
        done = runs * V;
    }
    FERRY_GRID_STRIDE(r, n - done) {
        const u64 i = done + r;
        out[i] = Num<D>::store((A)Num<S>::load(x[strided_offset(lx, i)]));
    }
}

template <typename T>
__device__ void fill(T* out, u64 n, double value) {
    constexpr int V = FERRY_PACK(sizeof(T));
    typedef Pack<T, V> P;
    const T v = Num<T>::store((typename Num<T>::Acc)value);
    u64 done = 0;
    if (aligned_to(out, sizeof(P))) {
        P p;
#pragma unroll
        for (int j = 0; j < V; ++j) p.v[j] = v;
        const u64 runs = n / V;
        FERRY_GRID_STRIDE(k, runs) { ((P*)out)[k] = p; }
        done = runs * V;
    }
    FERRY_GRID_STRIDE(r, n - done) { out[done + r] = v; }
}

template <typename T>
__device__ void arange(T* out, u64 n, double start) {
    FERRY_GRID_STRIDE(i, n) { out[i] = Num<T>::store((typename Num<T>::Acc)(start + (double)i)); }
}

// Counter-based random numbers: element i of a draw with `seed` is a pure function of
// (seed, i), so results do not depend on the launch configuration.
__device__ __forceinline__ u64 splitmix64(u64 z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
__device__ __forceinline__ double uniform01(u64 seed, u64 i) {
    return (double)(splitmix64(seed ^ splitmix64(i)) >> 11) * (1.0 / 9007199254740992.0);
}

template <typename T>
__device__ void random(T* out, u64 n, u64 seed, int normal) {
    FERRY_GRID_STRIDE(i, n) {
        double v;
        if (normal) {  // Box-Muller on two independent uniforms
            double u1 = uniform01(seed, 2 * i) + 1e-300, u2 = uniform01(seed, 2 * i + 1);
            v = sqrt(-2.0 * log(u1)) * cospi(2.0 * u2);
        } else {
            v = uniform01(seed, i);
        }
        out[i] = Num<T>::store((typename Num<T>::Acc)v);
    }
}

// ---- rotary position embedding -----------------------------------------------------------------
// Over rows of `2 * half` elements: out = x * cos + rotate_half(x) * sin, rotate_half(x) =
// [-x2, x1] (the halves of the row); with `inverse` the transposed map, the rotation's gradient:
// out = g * cos + [(g * sin)2, -(g * sin)1]. One thread per pair (i, i + half) of a row: it
// reads both elements and both table entries once and writes both outputs. cos and sin share
// one layout (`lt`), broadcast to x's shape; out is contiguous in x's shape.
template <typename T>
__device__ void rotary(const T* x, Strided lx, const T* cos, const T* sin, Strided lt, T* out,
                       u64 pairs, u64 half, int inverse) {
    typedef typename Num<T>::Acc A;
    const unsigned int last = lx.ndim - 1;
    const u64 x_step = half * lx.strides[last], t_step = half * lt.strides[last];
    FERRY_GRID_STRIDE(p, pairs) {
        const u64 i = (p / half) * 2 * half + p % half;  // the first of the pair, row-major
        const u64 xo = strided_offset(lx, i), to = strided_offset(lt, i);
        const A x1 = Num<T>::load(x[xo]), x2 = Num<T>::load(x[xo + x_step]);
        const A c1 = Num<T>::load(cos[to]), c2 = Num<T>::load(cos[to + t_step]);
        const A s1 = Num<T>::load(sin[to]), s2 = Num<T>::load(sin[to + t_step]);
        A y1, y2;
        if (inverse) {
            y1 = x1 * c1 + x2 * s2;
            y2 = x2 * c2 - x1 * s1;
        } else {
            y1 = x1 * c1 - x2 * s1;
            y2 = x2 * c2 + x1 * s2;
        }
        out[i] = Num<T>::store(y1);
        out[i + half] = Num<T>::store(y2);
    }
}

// ---- exported instantiations -------------------------------------------------------------------
#define FLOAT_KERNELS(T)                                                                          \
    extern "C" __global__ void unary_##T(int op, double s, const T* x, Strided lx, T* o, u64 n) { \
        unary<T>(op, s, x, lx, o, n);                                                             \
    }                                                                                             \
    extern "C" __global__ void binary_##T(int op, const T* a, Strided la, const T* b, Strided lb, \
                                          T* o, u64 n) {                                          \
        binary<T>(op, a, la, b, lb, o, n);                                                        \
    }                                                                                             \
    extern "C" __global__ void random_##T(T* o, u64 n, u64 seed, int normal) {                   \
        random<T>(o, n, seed, normal);                                                            \
    }                                                                                             \
    extern "C" __global__ void rotary_##T(const T* x, Strided lx, const T* c, const T* s,         \
                                          Strided lt, T* o, u64 pairs, u64 half, int inverse) {   \
        rotary<T>(x, lx, c, s, lt, o, pairs, half, inverse);                                      \
    }
FLOAT_KERNELS(float)
FLOAT_KERNELS(double)
FLOAT_KERNELS(f16)
FLOAT_KERNELS(bf16)

#define ANY_KERNELS(T)                                                                             \
    extern "C" __global__ void compare_##T(int op, const T* a, Strided la, const T* b, Strided lb, \
                                           u8* o, u64 n) {                                         \
        compare<T>(op, a, la, b, lb, o, n);                                                        \
    }                                                                                              \
    extern "C" __global__ void fill_##T(T* o, u64 n, double v) { fill<T>(o, n, v); }              \
    extern "C" __global__ void arange_##T(T* o, u64 n, double start) { arange<T>(o, n, start); }
ANY_KERNELS(float)
ANY_KERNELS(double)
ANY_KERNELS(f16)
ANY_KERNELS(bf16)
ANY_KERNELS(i64)
ANY_KERNELS(u8)

#define CAST(S, D) \
    extern "C" __global__ void cast_##S##_##D(const S* x, Strided lx, D* o, u64 n) { cast<S, D>(x, lx, o, n); }
#define CASTS_FROM(S) CAST(S, float) CAST(S, double) CAST(S, f16) CAST(S, bf16) CAST(S, i64) CAST(S, u8)
CASTS_FROM(float)
CASTS_FROM(double)
CASTS_FROM(f16)
CASTS_FROM(bf16)
CASTS_FROM(i64)
CASTS_FROM(u8)
