//! CPU kernels for choosing by a mask: `where_cond`, fused dropout and its backward.

use ferry_memory::Element;
use rayon::prelude::*;

use super::{CHUNK, Cpu, PARALLEL_THRESHOLD, any_dispatch, build, dense, float_dispatch};
use crate::Result;
use crate::kernel::{Dense, Operand, Select, View};

/// splitmix64's finalizer: a bijection of 64-bit words that mixes every bit.
pub(crate) fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Uniform in `[0, 1)` for element `i` of the draw `seed`: the same function as the CUDA
/// kernels' `uniform01` (kernels/select.cu), so both devices draw the same mask.
pub(crate) fn uniform01(seed: u64, i: u64) -> f64 {
    (splitmix64(seed ^ splitmix64(i)) >> 11) as f64 * (1.0 / 9_007_199_254_740_992.0)
}

impl Select for Cpu {
    /// `a` where `c != 0`, else `b`, over layouts already broadcast to the output's shape.
    fn where_cond(&self, c: &Operand<'_>, a: &Operand<'_>, b: &Operand<'_>) -> Result<Dense> {
        let (lc, la, lb) = (c.layout(), a.layout(), b.layout());
        let op = "where_cond";
        any_dispatch!(a.dtype(), |T| {
            let (cs, xs, ys) = (
                c.storage().host::<u8>(op)?,
                a.storage().host::<T>(op)?,
                b.storage().host::<T>(op)?,
            );
            build::<T>(op, la.shape(), |out| {
                let n = out.len();
                if n == 0 {
                    return;
                }
                if lc.is_contiguous() && la.is_contiguous() && lb.is_contiguous() {
                    let cs = &cs[lc.offset()..lc.offset() + n];
                    let xs = &xs[la.offset()..la.offset() + n];
                    let ys = &ys[lb.offset()..lb.offset() + n];
                    let run = |o: &mut [T], c: &[u8], x: &[T], y: &[T]| {
                        for (((o, &c), &x), &y) in o.iter_mut().zip(c).zip(x).zip(y) {
                            *o = if c != 0 { x } else { y };
                        }
                    };
                    if n >= PARALLEL_THRESHOLD {
                        out.par_chunks_mut(CHUNK)
                            .zip(cs.par_chunks(CHUNK))
                            .zip(xs.par_chunks(CHUNK).zip(ys.par_chunks(CHUNK)))
                            .for_each(|((o, c), (x, y))| run(o, c, x, y));
                    } else {
                        run(out, cs, xs, ys);
                    }
                } else {
                    let offsets = lc.offsets().zip(la.offsets()).zip(lb.offsets());
                    for (o, ((ic, ia), ib)) in out.iter_mut().zip(offsets) {
                        *o = if cs[ic] != 0 { xs[ia] } else { ys[ib] };
                    }
                }
            })
        })
    }

    /// Draws the keep mask of (seed, p) and scales the kept elements, in one pass; returns the
    /// output and the mask (1 kept, 0 dropped).
    fn dropout(&self, x: &Operand<'_>, p: f64, scale: f64, seed: u64) -> Result<(Dense, Dense)> {
        let x = dense(x)?;
        let n = x.numel();
        let off = x.layout().offset();
        float_dispatch!(x.dtype(), "dropout", |T| {
            let src = x.storage().host::<T>("dropout")?;
            let src = &src[off..off + n];
            let s = <T as Element>::from_f64(scale);
            let zero = <T as Element>::from_f64(0.0);
            let mask = build::<u8>("dropout", x.shape(), |mask| {
                fill_chunks(mask, |start, m| {
                    for (j, m) in m.iter_mut().enumerate() {
                        *m = (uniform01(seed, (start + j) as u64) >= p) as u8;
                    }
                })
            })?;
            let out = {
                let keep = mask.storage().host::<u8>("dropout")?;
                build::<T>("dropout", x.shape(), |out| {
                    fill_chunks(out, |start, o| {
                        let (x, k) = (&src[start..start + o.len()], &keep[start..start + o.len()]);
                        for ((o, &x), &k) in o.iter_mut().zip(x).zip(k) {
                            *o = if k != 0 { x * s } else { zero };
                        }
                    })
                })?
            };
            Ok((out, mask))
        })
    }

    /// `x * scale` where `mask` is nonzero, else 0 (`mask` contiguous, `x`'s shape).
    fn masked_scale(&self, x: &Operand<'_>, mask: &Operand<'_>, scale: f64) -> Result<Dense> {
        let (x, mask) = (dense(x)?, dense(mask)?);
        let n = x.numel();
        let (xo, mo) = (x.layout().offset(), mask.layout().offset());
        float_dispatch!(x.dtype(), "masked_scale", |T| {
            let src = x.storage().host::<T>("masked_scale")?;
            let keep = mask.storage().host::<u8>("masked_scale")?;
            let (src, keep) = (&src[xo..xo + n], &keep[mo..mo + n]);
            let s = <T as Element>::from_f64(scale);
            let zero = <T as Element>::from_f64(0.0);
            build::<T>("masked_scale", x.shape(), |out| {
                fill_chunks(out, |start, o| {
                    let (x, k) = (&src[start..start + o.len()], &keep[start..start + o.len()]);
                    for ((o, &x), &k) in o.iter_mut().zip(x).zip(k) {
                        *o = if k != 0 { x * s } else { zero };
                    }
                })
            })
        })
    }
}

/// Runs `f(start, chunk)` over `out` in chunks, in parallel when it is large.
fn fill_chunks<T: Send>(out: &mut [T], f: impl Fn(usize, &mut [T]) + Sync) {
    if out.len() >= PARALLEL_THRESHOLD {
        out.par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(k, o)| f(k * CHUNK, o));
    } else {
        f(0, out);
    }
}
