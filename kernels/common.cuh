// Shared definitions for every ferry kernel module: element types, conversions, strided indexing.
// NVRTC compiles each module as common.cuh followed by the module's own source; no system headers
// are needed, so the same sources compile with the NVRTC wheel on machines without a CUDA toolkit.

typedef unsigned char u8;
typedef long long i64;
typedef unsigned long long u64;

// 16-bit floats as bit patterns; conversions go through f32.
struct f16 { unsigned short bits; };
struct bf16 { unsigned short bits; };

__device__ __forceinline__ float f16_to_f32(f16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits));
    return f;
}
__device__ __forceinline__ f16 f32_to_f16(float f) {
    f16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
    return h;
}
__device__ __forceinline__ float bf16_to_f32(bf16 h) {
    return __int_as_float(((unsigned int)h.bits) << 16);
}
__device__ __forceinline__ bf16 f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    bf16 h;
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays a quiet NaN
        h.bits = (unsigned short)((u >> 16) | 0x40u);
    } else {                                // round to nearest even
        h.bits = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    return h;
}

// Num<T>: the type arithmetic on T happens in (Acc), and conversions to and from it.
template <typename T> struct Num;
template <> struct Num<float> {
    typedef float Acc;
    static __device__ __forceinline__ float load(float v) { return v; }
    static __device__ __forceinline__ float store(float v) { return v; }
};
template <> struct Num<double> {
    typedef double Acc;
    static __device__ __forceinline__ double load(double v) { return v; }
    static __device__ __forceinline__ double store(double v) { return v; }
};
template <> struct Num<f16> {
    typedef float Acc;
    static __device__ __forceinline__ float load(f16 v) { return f16_to_f32(v); }
    static __device__ __forceinline__ f16 store(float v) { return f32_to_f16(v); }
};
template <> struct Num<bf16> {
    typedef float Acc;
    static __device__ __forceinline__ float load(bf16 v) { return bf16_to_f32(v); }
    static __device__ __forceinline__ bf16 store(float v) { return f32_to_bf16(v); }
};
template <> struct Num<i64> {
    typedef double Acc;
    static __device__ __forceinline__ double load(i64 v) { return (double)v; }
    static __device__ __forceinline__ i64 store(double v) { return (i64)v; }
};
template <> struct Num<u8> {
    typedef float Acc;
    static __device__ __forceinline__ float load(u8 v) { return (float)v; }
    static __device__ __forceinline__ u8 store(float v) {
        return (u8)(v < 0.0f ? 0.0f : (v > 255.0f ? 255.0f : v));
    }
};

// A strided view: element i (row-major over shape) lives at offset + sum(index[d] * strides[d]).
// Mirrors ferry-tensor's `KernelLayout` (repr(C)); `contiguous` skips the index arithmetic.
#define FERRY_MAX_DIMS 8
struct Strided {
    u64 shape[FERRY_MAX_DIMS];
    u64 strides[FERRY_MAX_DIMS];
    u64 offset;
    unsigned int ndim;
    unsigned int contiguous;
};

// `contiguous` is 1 for a contiguous layout, 2 for a strided one whose element count fits in 32
// bits (index arithmetic in 32 bits: a 64-bit division costs several times as much), 0 otherwise.
__device__ __forceinline__ u64 strided_offset(const Strided& s, u64 i) {
    if (s.contiguous == 1) return s.offset + i;
    u64 offset = s.offset;
    if (s.contiguous == 2) {
        unsigned int j = (unsigned int)i;
        for (int d = (int)s.ndim - 1; d >= 0; --d) {
            unsigned int dim = (unsigned int)s.shape[d];
            offset += (u64)(j % dim) * s.strides[d];
            j /= dim;
        }
        return offset;
    }
    for (int d = (int)s.ndim - 1; d >= 0; --d) {
        u64 dim = s.shape[d];
        offset += (i % dim) * s.strides[d];
        i /= dim;
    }
    return offset;
}

#define FERRY_GRID_STRIDE(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)blockDim.x * gridDim.x)

// ---- packed access ---------------------------------------------------------------------------
// Elementwise kernels move V neighbouring elements in one access of up to 16 bytes (one load
// instruction instead of V: a 2-byte element read alone uses an eighth of each transaction).
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
    T v[V];
};

// Elements per access for element types of `bytes` bytes: 16 bytes' worth.
#define FERRY_PACK(bytes) (16 / (bytes))

__device__ __forceinline__ bool aligned_to(const void* p, u64 bytes) { return ((u64)p) % bytes == 0; }

// Whether `s` over a buffer at `base` of `size`-byte elements can be walked V elements at a time:
// element k*V (row-major) and the V-1 after it are adjacent in memory and the first sits on a
// V-element boundary. A contiguous layout qualifies from an aligned start (its last partial run,
// when the count is no multiple of V, goes element by element); a strided one when its last axis
// is contiguous and a multiple of V long and every other axis steps whole runs (a broadcast
// axis steps none: a bias added along rows qualifies).
template <int V>
__device__ __forceinline__ bool packs(const Strided& s, const void* base, u64 size) {
    if (!aligned_to(base, size * V) || s.offset % V != 0) return false;
    if (s.contiguous == 1) return true;
    if (s.ndim == 0) return false;
    const unsigned int last = s.ndim - 1;
    if (s.strides[last] != 1 || s.shape[last] % V != 0) return false;
    for (unsigned int d = 0; d < last; ++d)
        if (s.shape[d] != 1 && s.strides[d] % V != 0) return false;
    return true;
}

// Math overloads resolved by the accumulation type (float or double).
__device__ __forceinline__ float m_exp(float v) { return expf(v); }
__device__ __forceinline__ double m_exp(double v) { return exp(v); }
__device__ __forceinline__ float m_log(float v) { return logf(v); }
__device__ __forceinline__ double m_log(double v) { return log(v); }
__device__ __forceinline__ float m_tanh(float v) { return tanhf(v); }
__device__ __forceinline__ double m_tanh(double v) { return tanh(v); }
__device__ __forceinline__ float m_sqrt(float v) { return sqrtf(v); }
__device__ __forceinline__ double m_sqrt(double v) { return sqrt(v); }
__device__ __forceinline__ float m_pow(float v, float p) { return powf(v, p); }
__device__ __forceinline__ double m_pow(double v, double p) { return pow(v, p); }
__device__ __forceinline__ float m_neg_inf(float) { return __int_as_float(0xff800000); }
__device__ __forceinline__ double m_neg_inf(double) { return __longlong_as_double(0xfff0000000000000ll); }
