// Fused optimizer updates: one pass over parameter, gradient and moment buffers, in place,
// instead of a dozen elementwise kernels and temporaries per parameter and step.

// Mirrors ferry-tensor's `AdamStep` (repr(C)).
struct AdamStep {
    double lr;
    double beta1;
    double beta2;
    double eps;
    double weight_decay;
    double bias_correction1;
    double bias_correction2;
    unsigned int decoupled;
    unsigned int pad;
};

// One element's update, in the compute type.
template <typename A>
__device__ __forceinline__ void adam_one(A& pi, A gi, A& mi, A& vi, const AdamStep& s) {
    if (s.weight_decay != 0.0) {
        if (s.decoupled) pi *= (A)(1.0 - s.lr * s.weight_decay);
        else gi += (A)s.weight_decay * pi;
    }
    mi = (A)s.beta1 * mi + (A)(1.0 - s.beta1) * gi;
    vi = (A)s.beta2 * vi + (A)(1.0 - s.beta2) * gi * gi;
    pi -= (A)(s.lr / s.bias_correction1) * mi / (m_sqrt(vi / (A)s.bias_correction2) + (A)s.eps);
}

// p, m, v updated in place; offsets are in elements.
template <typename T>
__device__ void adam(T* p, u64 po, const T* g, u64 go, T* m, u64 mo, T* v, u64 vo, u64 n, AdamStep s) {
    typedef typename Num<T>::Acc A;
    FERRY_GRID_STRIDE(i, n) {
        A pi = Num<T>::load(p[po + i]);
        A mi = Num<T>::load(m[mo + i]);
        A vi = Num<T>::load(v[vo + i]);
        adam_one<A>(pi, Num<T>::load(g[go + i]), mi, vi, s);
        p[po + i] = Num<T>::store(pi);
        m[mo + i] = Num<T>::store(mi);
        v[vo + i] = Num<T>::store(vi);
    }
}

// f32 with every offset a multiple of 4 elements (buffers start 256-byte aligned): 16-byte loads
// and stores, four elements a thread, so the pass runs at the memory's speed; the same
// arithmetic per element as `adam`.
__device__ bool adam_vec4(float* p, u64 po, const float* g, u64 go, float* m, u64 mo, float* v,
                          u64 vo, u64 n, const AdamStep& s) {
    if (((po | go | mo | vo) & 3) != 0) return false;
    float4* p4 = (float4*)(p + po);
    const float4* g4 = (const float4*)(g + go);
    float4* m4 = (float4*)(m + mo);
    float4* v4 = (float4*)(v + vo);
    const u64 quads = n / 4;
    FERRY_GRID_STRIDE(i, quads) {
        float4 a = p4[i], b = g4[i], c = m4[i], d = v4[i];
        adam_one<float>(a.x, b.x, c.x, d.x, s);
        adam_one<float>(a.y, b.y, c.y, d.y, s);
        adam_one<float>(a.z, b.z, c.z, d.z, s);
        adam_one<float>(a.w, b.w, c.w, d.w, s);
        p4[i] = a;
        m4[i] = c;
        v4[i] = d;
    }
    const u64 done = quads * 4;
    FERRY_GRID_STRIDE(i, n - done) {
        const u64 k = done + i;
        adam_one<float>(p[po + k], g[go + k], m[mo + k], v[vo + k], s);
    }
    return true;
}

#define OPTIM_KERNELS(T)                                                                          \
    extern "C" __global__ void adam_##T(T* p, u64 po, const T* g, u64 go, T* m, u64 mo, T* v,     \
                                        u64 vo, u64 n, AdamStep s) {                              \
        adam<T>(p, po, g, go, m, mo, v, vo, n, s);                                                \
    }
extern "C" __global__ void adam_float(float* p, u64 po, const float* g, u64 go, float* m, u64 mo,
                                      float* v, u64 vo, u64 n, AdamStep s) {
    if (!adam_vec4(p, po, g, go, m, mo, v, vo, n, s)) adam<float>(p, po, g, go, m, mo, v, vo, n, s);
}
OPTIM_KERNELS(double)
OPTIM_KERNELS(f16)
OPTIM_KERNELS(bf16)
