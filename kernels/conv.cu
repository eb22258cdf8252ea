// Convolution and pooling helpers over contiguous NCHW tensors.
//
// im2col: one thread per column entry of [N, C*KH*KW, OH*OW] (row (c, kh, kw), column (oy, ox)),
// reading x[n, c, oy*sh + kh*dh - ph, ox*sw + kw*dw - pw], zero in the padding.
// col2im: its adjoint, one thread per input pixel, summing every column entry that reads the
// pixel (a gather: no atomics, the same sum order every run).
// pool_argmax: one thread per window of [P, OH*OW] planes; the flat index iy*W + ix of the
// window's maximum (padding skipped, NaN wins, the first maximum wins ties).

struct ConvGeometry {
    u64 c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow;
};

template <typename T>
__device__ void im2col(const T* x, T* cols, u64 total, ConvGeometry g) {
    FERRY_GRID_STRIDE(i, total) {
        u64 t = i;
        const u64 ox = t % g.ow; t /= g.ow;
        const u64 oy = t % g.oh; t /= g.oh;
        const u64 kw = t % g.kw; t /= g.kw;
        const u64 kh = t % g.kh; t /= g.kh;
        const u64 c = t % g.c;
        const u64 n = t / g.c;
        const i64 iy = (i64)(oy * g.sh + kh * g.dh) - (i64)g.ph;
        const i64 ix = (i64)(ox * g.sw + kw * g.dw) - (i64)g.pw;
        T v = Num<T>::store((typename Num<T>::Acc)0);
        if (iy >= 0 && ix >= 0 && iy < (i64)g.h && ix < (i64)g.w) {
            v = x[((n * g.c + c) * g.h + (u64)iy) * g.w + (u64)ix];
        }
        cols[i] = v;
    }
}

template <typename T>
__device__ void col2im(const T* cols, T* x, u64 total, ConvGeometry g) {
    typedef typename Num<T>::Acc A;
    const u64 k = g.kh * g.kw, l = g.oh * g.ow;
    FERRY_GRID_STRIDE(i, total) {
        u64 t = i;
        const i64 ix = (i64)(t % g.w); t /= g.w;
        const i64 iy = (i64)(t % g.h); t /= g.h;
        const u64 c = t % g.c;
        const u64 n = t / g.c;
        const T* base = cols + (n * g.c + c) * k * l;
        A acc = 0;
        for (u64 kh = 0; kh < g.kh; ++kh) {
            const i64 ty = iy + (i64)g.ph - (i64)(kh * g.dh);
            if (ty < 0 || ty % (i64)g.sh != 0) continue;
            const u64 oy = (u64)ty / g.sh;
            if (oy >= g.oh) continue;
            for (u64 kw = 0; kw < g.kw; ++kw) {
                const i64 tx = ix + (i64)g.pw - (i64)(kw * g.dw);
                if (tx < 0 || tx % (i64)g.sw != 0) continue;
                const u64 ox = (u64)tx / g.sw;
                if (ox >= g.ow) continue;
                acc += Num<T>::load(base[(kh * g.kw + kw) * l + oy * g.ow + ox]);
            }
        }
        x[i] = Num<T>::store(acc);
    }
}

template <typename T>
__device__ void pool_argmax(const T* x, i64* index, u64 total, ConvGeometry g) {
    typedef typename Num<T>::Acc A;
    FERRY_GRID_STRIDE(i, total) {
        u64 t = i;
        const u64 ox = t % g.ow; t /= g.ow;
        const u64 oy = t % g.oh;
        const u64 p = t / g.oh;
        const T* plane = x + p * g.h * g.w;
        A best = 0;
        i64 at = -1;
        for (u64 kh = 0; kh < g.kh; ++kh) {
            const i64 iy = (i64)(oy * g.sh + kh) - (i64)g.ph;
            if (iy < 0 || iy >= (i64)g.h) continue;
            for (u64 kw = 0; kw < g.kw; ++kw) {
                const i64 ix = (i64)(ox * g.sw + kw) - (i64)g.pw;
                if (ix < 0 || ix >= (i64)g.w) continue;
                const A v = Num<T>::load(plane[(u64)iy * g.w + (u64)ix]);
                if (at < 0 || (best == best && (v > best || v != v))) {
                    best = v;
                    at = iy * (i64)g.w + ix;
                }
            }
        }
        index[i] = at < 0 ? 0 : at;
    }
}

#define CONV_KERNELS(T)                                                                            \
    extern "C" __global__ void im2col_##T(const T* x, T* cols, u64 total, ConvGeometry g) {       \
        im2col<T>(x, cols, total, g);                                                              \
    }                                                                                              \
    extern "C" __global__ void col2im_##T(const T* cols, T* x, u64 total, ConvGeometry g) {       \
        col2im<T>(cols, x, total, g);                                                              \
    }                                                                                              \
    extern "C" __global__ void pool_argmax_##T(const T* x, i64* index, u64 total,                 \
                                               ConvGeometry g) {                                   \
        pool_argmax<T>(x, index, total, g);                                                        \
    }
CONV_KERNELS(float)
CONV_KERNELS(double)
CONV_KERNELS(f16)
CONV_KERNELS(bf16)
