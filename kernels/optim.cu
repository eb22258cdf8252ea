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

// p, m, v updated in place; offsets are in elements.
template <typename T>
__device__ void adam(T* p, u64 po, const T* g, u64 go, T* m, u64 mo, T* v, u64 vo, u64 n, AdamStep s) {
    typedef typename Num<T>::Acc A;
    FERRY_GRID_STRIDE(i, n) {
        A pi = Num<T>::load(p[po + i]);
        A gi = Num<T>::load(g[go + i]);
        if (s.weight_decay != 0.0) {
            if (s.decoupled) pi *= (A)(1.0 - s.lr * s.weight_decay);
            else gi += (A)s.weight_decay * pi;
        }
        A mi = (A)s.beta1 * Num<T>::load(m[mo + i]) + (A)(1.0 - s.beta1) * gi;
        A vi = (A)s.beta2 * Num<T>::load(v[vo + i]) + (A)(1.0 - s.beta2) * gi * gi;
        pi -= (A)(s.lr / s.bias_correction1) * mi / (m_sqrt(vi / (A)s.bias_correction2) + (A)s.eps);
        p[po + i] = Num<T>::store(pi);
        m[mo + i] = Num<T>::store(mi);
        v[vo + i] = Num<T>::store(vi);
    }
}

#define OPTIM_KERNELS(T)                                                                          \
    extern "C" __global__ void adam_##T(T* p, u64 po, const T* g, u64 go, T* m, u64 mo, T* v,     \
                                        u64 vo, u64 n, AdamStep s) {                              \
        adam<T>(p, po, g, go, m, mo, v, vo, n, s);                                                \
    }
OPTIM_KERNELS(float)
OPTIM_KERNELS(double)
OPTIM_KERNELS(f16)
OPTIM_KERNELS(bf16)
