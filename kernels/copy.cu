// Copies between device buffers: strided copies of elements of 1, 2, 4 and 8 bytes, and the
// gather that packs many byte regions into one buffer. A module of its own, small, so that the
// first copy of a process (a checkpoint's device copy, say) compiles these kernels alone in
// milliseconds rather than every elementwise kernel.

// ---- strided copy ----------------------------------------------------------------------------
template <typename T>
__device__ void copy(const T* x, Strided lx, T* out, Strided lout, u64 n) {
    constexpr int V = FERRY_PACK(sizeof(T));
    typedef Pack<T, V> P;
    u64 done = 0;
    if (packs<V>(lx, x, sizeof(T)) && packs<V>(lout, out, sizeof(T))) {
        const u64 runs = n / V;
        FERRY_GRID_STRIDE(k, runs) {
            *(P*)(out + strided_offset(lout, k * V)) = *(const P*)(x + strided_offset(lx, k * V));
        }
        done = runs * V;
    }
    FERRY_GRID_STRIDE(r, n - done) {
        const u64 i = done + r;
        out[strided_offset(lout, i)] = x[strided_offset(lx, i)];
    }
}

#define COPY(T, NAME) \
    extern "C" __global__ void copy_##NAME(const T* x, Strided lx, T* o, Strided lo, u64 n) { copy<T>(x, lx, o, lo, n); }
COPY(u8, b8)
COPY(unsigned short, b16)
COPY(unsigned int, b32)
COPY(u64, b64)

// ---- gather: many byte regions into one buffer, in one launch ----------------------------------
// The table travels by value as a kernel parameter (no upload, no synchronization): up to
// GATHER_REGIONS entries of (source address, destination offset, length). The whole grid strides
// through each region, 16 bytes at a time where source, destination and length allow it. A state
// dict or a concatenation of many tensors becomes a few launches instead of one per tensor.
#define GATHER_REGIONS 64
struct GatherTable {
    u64 entries[3 * GATHER_REGIONS];
};

extern "C" __global__ void gather_regions(GatherTable table, u64 regions, u8* dst) {
    const u64 thread = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 threads = (u64)blockDim.x * gridDim.x;
    for (u64 r = 0; r < regions; ++r) {
        const u8* src = (const u8*)table.entries[3 * r];
        u8* out = dst + table.entries[3 * r + 1];
        const u64 len = table.entries[3 * r + 2];
        if ((((u64)src | (u64)out | len) & 15) == 0) {
            const uint4* s = (const uint4*)src;
            uint4* o = (uint4*)out;
            for (u64 i = thread; i < len / 16; i += threads) o[i] = s[i];
        } else {
            for (u64 i = thread; i < len; i += threads) out[i] = src[i];
        }
    }
}
