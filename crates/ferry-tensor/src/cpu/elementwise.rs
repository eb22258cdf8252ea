//! Elementwise kernels: unary maps, broadcast binary ops, comparisons and casts.

use ferry_memory::{DType, Element};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use num_traits::Float;
use rayon::prelude::*;

use super::{CHUNK, PARALLEL_THRESHOLD, any_dispatch, build, float_dispatch};
use crate::layout::Layout;
use crate::ops::{BinaryOp, CmpOp, UnaryOp};
use crate::{Result, Tensor};

/// `out[i] = f(x[i])` over a strided input, parallel for large contiguous inputs.
fn map<T: Element, U: Element>(x: &[T], layout: &Layout, out: &mut [U], f: impl Fn(T) -> U + Sync) {
    if layout.is_contiguous() {
        let x = &x[layout.offset()..layout.offset() + out.len()];
        if out.len() >= PARALLEL_THRESHOLD {
            out.par_chunks_mut(CHUNK)
                .zip(x.par_chunks(CHUNK))
                .for_each(|(o, x)| o.iter_mut().zip(x).for_each(|(o, &x)| *o = f(x)));
        } else {
            out.iter_mut().zip(x).for_each(|(o, &x)| *o = f(x));
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
        if n >= PARALLEL_THRESHOLD {
            out.par_chunks_mut(CHUNK)
                .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
                .for_each(|(o, (a, b))| {
                    o.iter_mut()
                        .zip(a.iter().zip(b))
                        .for_each(|(o, (&a, &b))| *o = f(a, b))
                });
        } else {
            out.iter_mut()
                .zip(a.iter().zip(b))
                .for_each(|(o, (&a, &b))| *o = f(a, b));
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

pub(crate) fn unary(x: &Tensor, op: UnaryOp) -> Result<Tensor> {
    float_dispatch!(x.dtype(), op.name(), |T| {
        let src = x.storage().host::<T>(op.name())?;
        let c = |v: f64| <T as Element>::from_f64(v);
        let (zero, one) = (<T as Element>::from_f64(0.0), <T as Element>::from_f64(1.0));
        build::<T>(x.shape(), |out| match op {
            UnaryOp::Neg => map(&src, x.layout(), out, |v| -v),
            UnaryOp::Exp => map(&src, x.layout(), out, |v| v.exp()),
            UnaryOp::Log => map(&src, x.layout(), out, |v| v.ln()),
            UnaryOp::Relu => map(&src, x.layout(), out, |v| if v > zero { v } else { zero }),
            UnaryOp::Tanh => map(&src, x.layout(), out, |v| v.tanh()),
            UnaryOp::Sigmoid => map(&src, x.layout(), out, |v| one / (one + (-v).exp())),
            UnaryOp::Sqrt => map(&src, x.layout(), out, |v| v.sqrt()),
            UnaryOp::Abs => map(&src, x.layout(), out, |v| v.abs()),
            UnaryOp::Step => map(&src, x.layout(), out, |v| if v > zero { one } else { zero }),
            UnaryOp::AddScalar(s) => map(&src, x.layout(), out, |v| v + c(s)),
            UnaryOp::MulScalar(s) => map(&src, x.layout(), out, |v| v * c(s)),
            UnaryOp::PowScalar(p) => map(&src, x.layout(), out, |v| v.powf(c(p))),
        })
    })
}

pub(crate) fn binary(
    a: &Tensor,
    la: &Layout,
    b: &Tensor,
    lb: &Layout,
    op: BinaryOp,
) -> Result<Tensor> {
    float_dispatch!(a.dtype(), op.name(), |T| {
        let (x, y) = (
            a.storage().host::<T>(op.name())?,
            b.storage().host::<T>(op.name())?,
        );
        build::<T>(la.shape(), |out| match op {
            BinaryOp::Add => zip_map(&x, la, &y, lb, out, |p, q| p + q),
            BinaryOp::Sub => zip_map(&x, la, &y, lb, out, |p, q| p - q),
            BinaryOp::Mul => zip_map(&x, la, &y, lb, out, |p, q| p * q),
            BinaryOp::Div => zip_map(&x, la, &y, lb, out, |p, q| p / q),
        })
    })
}

pub(crate) fn compare(
    a: &Tensor,
    la: &Layout,
    b: &Tensor,
    lb: &Layout,
    op: CmpOp,
) -> Result<Tensor> {
    any_dispatch!(a.dtype(), |T| {
        let (x, y) = (
            a.storage().host::<T>(op.name())?,
            b.storage().host::<T>(op.name())?,
        );
        let f: fn(&T, &T) -> bool = match op {
            CmpOp::Eq => T::eq,
            CmpOp::Ne => T::ne,
            CmpOp::Lt => T::lt,
            CmpOp::Le => T::le,
            CmpOp::Gt => T::gt,
            CmpOp::Ge => T::ge,
        };
        build::<u8>(la.shape(), |out| {
            zip_map(&x, la, &y, lb, out, |p, q| f(&p, &q) as u8)
        })
    })
}

/// Converts every element to `dtype`; the 16-bit float paths use half's vectorised slices.
pub(crate) fn cast(x: &Tensor, dtype: DType) -> Result<Tensor> {
    let x = super::dense(x)?;
    let n = x.numel();
    let off = x.layout().offset();
    match (x.dtype(), dtype) {
        (DType::F32, DType::F16) => {
            let src = x.storage().host::<f32>("cast")?;
            build::<f16>(x.shape(), |out| {
                par_convert(&src[off..off + n], out, |o, s| o.convert_from_f32_slice(s))
            })
        }
        (DType::F32, DType::BF16) => {
            let src = x.storage().host::<f32>("cast")?;
            build::<bf16>(x.shape(), |out| {
                par_convert(&src[off..off + n], out, |o, s| o.convert_from_f32_slice(s))
            })
        }
        (DType::F16, DType::F32) => {
            let src = x.storage().host::<f16>("cast")?;
            build::<f32>(x.shape(), |out| {
                par_convert(&src[off..off + n], out, |o, s| s.convert_to_f32_slice(o))
            })
        }
        (DType::BF16, DType::F32) => {
            let src = x.storage().host::<bf16>("cast")?;
            build::<f32>(x.shape(), |out| {
                par_convert(&src[off..off + n], out, |o, s| s.convert_to_f32_slice(o))
            })
        }
        (from, to) => any_dispatch!(from, |S| {
            let src = x.storage().host::<S>("cast")?;
            let src = &src[off..off + n];
            any_dispatch!(to, |D| build::<D>(x.shape(), |out| par_convert(
                src,
                out,
                |o, s| {
                    o.iter_mut()
                        .zip(s)
                        .for_each(|(o, &s)| *o = <D as Element>::from_f64(s.to_f64()))
                }
            )))
        }),
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
