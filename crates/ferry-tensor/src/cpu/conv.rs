//! im2col, col2im and the pooling argmax on the host, one image (or plane) per rayon task.

use ferry_memory::Element;
use rayon::prelude::*;

use super::{Cpu, build, dense, float_dispatch};
use crate::Result;
use crate::kernel::{Conv, Dense, Operand, View};
use crate::op::conv::Geometry;

/// The input coordinate of output `o`, tap `k` along one axis, or `None` in the padding.
#[inline]
fn source(o: usize, k: usize, stride: usize, dil: usize, pad: usize, size: usize) -> Option<usize> {
    let i = (o * stride + k * dil).checked_sub(pad)?;
    (i < size).then_some(i)
}

impl Conv for Cpu {
    /// `[N, C, H, W]` to `[N, C·KH·KW, OH·OW]` (see `ops::conv::im2col`).
    fn im2col(&self, x: &Operand<'_>, g: &Geometry) -> Result<Dense> {
        const OP: &str = "im2col";
        let x = dense(x)?;
        let (k, l) = (g.k(), g.l());
        let image = g.c * g.h * g.w;
        let cols_per_image = g.c * k * l;
        float_dispatch!(x.dtype(), OP, |T| {
            let data = x.storage().host::<T>(OP)?;
            let src = &data[x.layout().offset()..x.layout().offset() + g.n * image];
            build::<T>(OP, &[g.n, g.c * k, l], |out| {
                let zero = <T as Element>::from_f64(0.0);
                let one = |(img, o): (&[T], &mut [T])| {
                    for c in 0..g.c {
                        let plane = &img[c * g.h * g.w..(c + 1) * g.h * g.w];
                        for kh in 0..g.kh {
                            for kw in 0..g.kw {
                                let row = &mut o[((c * g.kh + kh) * g.kw + kw) * l..][..l];
                                for oy in 0..g.oh {
                                    let iy = source(oy, kh, g.sh, g.dh, g.ph, g.h);
                                    for ox in 0..g.ow {
                                        let ix = source(ox, kw, g.sw, g.dw, g.pw, g.w);
                                        row[oy * g.ow + ox] = match (iy, ix) {
                                            (Some(iy), Some(ix)) => plane[iy * g.w + ix],
                                            _ => zero,
                                        };
                                    }
                                }
                            }
                        }
                    }
                };
                if cols_per_image == 0 {
                    return;
                }
                if image == 0 {
                    out.fill(zero);
                    return;
                }
                out.par_chunks_mut(cols_per_image)
                    .zip(src.par_chunks(image))
                    .map(|(o, i)| (i, o))
                    .for_each(one);
            })
        })
    }

    /// `[N, C·KH·KW, OH·OW]` to `[N, C, H, W]`, summing overlaps (in f64) (see
    /// `ops::conv::col2im`).
    fn col2im(&self, cols: &Operand<'_>, g: &Geometry) -> Result<Dense> {
        const OP: &str = "col2im";
        let cols = dense(cols)?;
        let (k, l) = (g.k(), g.l());
        let image = g.c * g.h * g.w;
        let cols_per_image = g.c * k * l;
        float_dispatch!(cols.dtype(), OP, |T| {
            let data = cols.storage().host::<T>(OP)?;
            let off = cols.layout().offset();
            let src = &data[off..off + g.n * cols_per_image];
            build::<T>(OP, &[g.n, g.c, g.h, g.w], |out| {
                let one = |(o, cs): (&mut [T], &[T])| {
                    let mut acc = vec![0.0f64; image];
                    for c in 0..g.c {
                        let plane = &mut acc[c * g.h * g.w..(c + 1) * g.h * g.w];
                        for kh in 0..g.kh {
                            for kw in 0..g.kw {
                                let row = &cs[((c * g.kh + kh) * g.kw + kw) * l..][..l];
                                for oy in 0..g.oh {
                                    let Some(iy) = source(oy, kh, g.sh, g.dh, g.ph, g.h) else {
                                        continue;
                                    };
                                    for ox in 0..g.ow {
                                        if let Some(ix) = source(ox, kw, g.sw, g.dw, g.pw, g.w) {
                                            plane[iy * g.w + ix] += row[oy * g.ow + ox].to_f64();
                                        }
                                    }
                                }
                            }
                        }
                    }
                    for (o, a) in o.iter_mut().zip(acc) {
                        *o = <T as Element>::from_f64(a);
                    }
                };
                if image == 0 {
                    return;
                }
                if cols_per_image == 0 {
                    out.fill(<T as Element>::from_f64(0.0));
                    return;
                }
                out.par_chunks_mut(image)
                    .zip(src.par_chunks(cols_per_image))
                    .for_each(one);
            })
        })
    }

    /// For planes `x` (`[P, H·W]`, `g.n = P`), the flat index `iy·W + ix` of each window's maximum
    /// as `[P, OH·OW]` `i64`: padding is skipped, NaN wins, the first maximum wins ties.
    fn pool_argmax(&self, x: &Operand<'_>, g: &Geometry) -> Result<Dense> {
        const OP: &str = "max_pool2d";
        let x = dense(x)?;
        let (hw, l) = (g.h * g.w, g.l());
        float_dispatch!(x.dtype(), OP, |T| {
            let data = x.storage().host::<T>(OP)?;
            let off = x.layout().offset();
            let src = &data[off..off + g.n * hw];
            build::<i64>(OP, &[g.n, l], |out| {
                let one = |(o, plane): (&mut [i64], &[T])| {
                    for oy in 0..g.oh {
                        for ox in 0..g.ow {
                            let mut best = f64::NEG_INFINITY;
                            let mut at: i64 = -1;
                            for kh in 0..g.kh {
                                let Some(iy) = source(oy, kh, g.sh, 1, g.ph, g.h) else {
                                    continue;
                                };
                                for kw in 0..g.kw {
                                    let Some(ix) = source(ox, kw, g.sw, 1, g.pw, g.w) else {
                                        continue;
                                    };
                                    let v = plane[iy * g.w + ix].to_f64();
                                    if at < 0 || (!best.is_nan() && (v > best || v.is_nan())) {
                                        best = v;
                                        at = (iy * g.w + ix) as i64;
                                    }
                                }
                            }
                            o[oy * g.ow + ox] = at.max(0);
                        }
                    }
                };
                if l == 0 || hw == 0 {
                    out.fill(0);
                    return;
                }
                out.par_chunks_mut(l).zip(src.par_chunks(hw)).for_each(one);
            })
        })
    }
}
