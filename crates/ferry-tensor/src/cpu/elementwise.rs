//! Elementwise kernels: unary maps, broadcast binary ops, comparisons and casts. Each op's
//! function comes from the op table (`ops`), handed to a loop once per call.

use ferry_memory::simd::vectorized;
use ferry_memory::{DType, Element};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

use super::{CHUNK, Cpu, PARALLEL_THRESHOLD, any_dispatch, build, float_dispatch};
use crate::Result;
use crate::kernel::{Dense, Elementwise, Operand, View};
use crate::layout::Layout;
use crate::op::{BinaryLoop, BinaryOp, CmpOp, UnaryLoop, UnaryOp};

/// `out[i] = f(x[i])` over a strided input, parallel for large contiguous inputs.
fn map<T: Element, U: Element>(x: &[T], layout: &Layout, out: &mut [U], f: impl Fn(T) -> U + Sync) {
    if layout.is_contiguous() {
        let x = &x[layout.offset()..layout.offset() + out.len()];
        // Each contiguous run is compiled for AVX2 where the CPU has it (ferry_memory::simd).
        let run =
            |o: &mut [U], x: &[T]| vectorized(|| o.iter_mut().zip(x).for_each(|(o, &x)| *o = f(x)));
        if out.len() >= PARALLEL_THRESHOLD {
            out.par_chunks_mut(CHUNK)
                .zip(x.par_chunks(CHUNK))
                .for_each(|(o, x)| run(o, x));
        } else {
            run(out, x);
        }
    } else {
        let (len, stride) = layout.row();
        for (out, start) in out.chunks_mut(len.max(1)).zip(layout.row_starts()) {
            for (j, o) in out.iter_mut().enumerate() {
                *o = f(x[start + j * stride]);
            }
        }
    }
}

/// `out[i] = f(a[i], b[i])` over two layouts already broadcast to the output's shape.
fn zip_map<T: Element, U: Element>(
    a: &[T],
    la: &Layout,
    b: &[T],
    lb: &Layout,
    out: &mut [U],
    f: impl Fn(T, T) -> U + Sync,
) {
    let n = out.len();
    if n == 0 {
        return; // an empty input may have no element at its offset to broadcast
    }
    if la.is_contiguous() && lb.is_contiguous() {
        let (a, b) = (
            &a[la.offset()..la.offset() + n],
            &b[lb.offset()..lb.offset() + n],
        );
        let run = |o: &mut [U], a: &[T], b: &[T]| {
            vectorized(|| {
                o.iter_mut()
                    .zip(a.iter().zip(b))
                    .for_each(|(o, (&a, &b))| *o = f(a, b))
            })
        };
        if n >= PARALLEL_THRESHOLD {
            out.par_chunks_mut(CHUNK)
                .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
                .for_each(|(o, (a, b))| run(o, a, b));
        } else {
            run(out, a, b);
        }
    } else if lb.strides().iter().all(|&s| s == 0) {
        let b = b[lb.offset()];
        map(a, la, out, |a| f(a, b));
    } else if la.strides().iter().all(|&s| s == 0) {
        let a = a[la.offset()];
        map(b, lb, out, |b| f(a, b));
    } else {
        // Same shape, so the rows of both layouts line up.
        let ((len, sa), (_, sb)) = (la.row(), lb.row());
        let starts = la.row_starts().zip(lb.row_starts());
        for (out, (ra, rb)) in out.chunks_mut(len.max(1)).zip(starts) {
            for (j, o) in out.iter_mut().enumerate() {
                *o = f(a[ra + j * sa], b[rb + j * sb]);
            }
        }
    }
}

/// A unary op's loop: `out[i] = f(x[i])`.
struct Map<'a, T> {
    x: &'a [T],
    layout: &'a Layout,
    out: &'a mut [T],
}

impl<T: Element> UnaryLoop<T> for Map<'_, T> {
    type Output = ();
    fn run(self, f: impl Fn(T) -> T + Sync) {
        map(self.x, self.layout, self.out, f)
    }
}

/// A binary op's loop: `out[i] = f(a[i], b[i])`.
struct Zip<'a, T, U> {
    a: &'a [T],
    la: &'a Layout,
    b: &'a [T],
    lb: &'a Layout,
    out: &'a mut [U],
}

impl<T: Element> BinaryLoop<T, T> for Zip<'_, T, T> {
    type Output = ();
    fn run(self, f: impl Fn(T, T) -> T + Sync) {
        zip_map(self.a, self.la, self.b, self.lb, self.out, f)
    }
}

/// A comparison's loop: `out[i] = f(a[i], b[i])` as 1 or 0.
struct ZipBool<'a, T>(Zip<'a, T, u8>);

impl<T: Element> BinaryLoop<T, bool> for ZipBool<'_, T> {
    type Output = ();
    fn run(self, f: impl Fn(T, T) -> bool + Sync) {
        let z = self.0;
        zip_map(z.a, z.la, z.b, z.lb, z.out, |p, q| f(p, q) as u8)
    }
}

impl Elementwise for Cpu {
    fn unary(&self, x: &Operand<'_>, op: UnaryOp) -> Result<Dense> {
        float_dispatch!(x.dtype(), op.name(), |T| {
            let src = x.storage().host::<T>(op.name())?;
            build::<T>(op.name(), x.shape(), |out| {
                op.dispatch(Map {
                    x: &src,
                    layout: x.layout(),
                    out,
                })
            })
        })
    }

    /// `op` elementwise over layouts already broadcast to the output's shape.
    fn binary(&self, a: &Operand<'_>, b: &Operand<'_>, op: BinaryOp) -> Result<Dense> {
        let (la, lb) = (a.layout(), b.layout());
        float_dispatch!(a.dtype(), op.name(), |T| {
            let (x, y) = (
                a.storage().host::<T>(op.name())?,
                b.storage().host::<T>(op.name())?,
            );
            build::<T>(op.name(), la.shape(), |out| {
                op.dispatch(Zip {
                    a: &x,
                    la,
                    b: &y,
                    lb,
                    out,
                })
            })
        })
    }

    /// `op` as 1 or 0 (`u8`) over layouts already broadcast to the output's shape.
    fn compare(&self, a: &Operand<'_>, b: &Operand<'_>, op: CmpOp) -> Result<Dense> {
        let (la, lb) = (a.layout(), b.layout());
        any_dispatch!(a.dtype(), |T| {
            let (x, y) = (
                a.storage().host::<T>(op.name())?,
                b.storage().host::<T>(op.name())?,
            );
            build::<u8>(op.name(), la.shape(), |out| {
                op.dispatch::<T, _>(ZipBool(Zip {
                    a: &x,
                    la,
                    b: &y,
                    lb,
                    out,
                }))
            })
        })
    }

    /// Converts every element to `dtype`; the 16-bit float paths use half's vectorised slices.
    fn cast(&self, x: &Operand<'_>, dtype: DType) -> Result<Dense> {
        // Sized before `dense` copies a view: a result too large is refused without that copy.
        crate::layout::shape_bytes("to_dtype", x.shape(), dtype)?;
        let x = super::dense(x)?;
        let n = x.numel();
        let off = x.layout().offset();
        match (x.dtype(), dtype) {
            (DType::F32, DType::F16) => {
                let src = x.storage().host::<f32>("cast")?;
                build::<f16>("to_dtype", x.shape(), |out| {
                    par_convert(&src[off..off + n], out, |o, s| o.convert_from_f32_slice(s))
                })
            }
            (DType::F32, DType::BF16) => {
                let src = x.storage().host::<f32>("cast")?;
                build::<bf16>("to_dtype", x.shape(), |out| {
                    par_convert(&src[off..off + n], out, |o, s| o.convert_from_f32_slice(s))
                })
            }
            (DType::F16, DType::F32) => {
                let src = x.storage().host::<f16>("cast")?;
                build::<f32>("to_dtype", x.shape(), |out| {
                    par_convert(&src[off..off + n], out, |o, s| s.convert_to_f32_slice(o))
                })
            }
            (DType::BF16, DType::F32) => {
                let src = x.storage().host::<bf16>("cast")?;
                build::<f32>("to_dtype", x.shape(), |out| {
                    par_convert(&src[off..off + n], out, |o, s| s.convert_to_f32_slice(o))
                })
            }
            (from, to) => any_dispatch!(from, |S| {
                let src = x.storage().host::<S>("cast")?;
                let src = &src[off..off + n];
                any_dispatch!(to, |D| build::<D>(
                    "to_dtype",
                    x.shape(),
                    |out| par_convert(src, out, |o, s| {
                        o.iter_mut()
                            .zip(s)
                            .for_each(|(o, &s)| *o = <D as Element>::from_f64(s.to_f64()))
                    })
                ))
            }),
        }
    }
}

fn par_convert<S: Sync, D: Send>(src: &[S], out: &mut [D], f: impl Fn(&mut [D], &[S]) + Sync) {
    if out.len() >= PARALLEL_THRESHOLD {
        out.par_chunks_mut(CHUNK)
            .zip(src.par_chunks(CHUNK))
            .for_each(|(o, s)| f(o, s));
    } else {
        f(out, src);
    }
}
