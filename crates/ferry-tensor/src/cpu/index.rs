//! Indexing along one axis on the host: index_select, gather (any dtype), index_add and
//! scatter_add (float dtypes, accumulated in f64 per addition). Every index is checked against
//! the axis length before anything is written.

use ferry_memory::Element;
use rayon::prelude::*;

use super::{Cpu, PARALLEL_THRESHOLD, any_dispatch, build, dense, float_dispatch};
use crate::Result;
use crate::kernel::{Dense, Indexing, Operand, View};
use crate::layout::contiguous_strides;
use crate::op::message::out_of_range;

/// The indices of a host `i64` operand, in row-major order.
fn indices(op: &'static str, index: &Operand<'_>) -> Result<Vec<i64>> {
    let index = dense(index)?;
    let off = index.layout().offset();
    let data = index.storage().host::<i64>(op)?;
    Ok(data[off..off + index.numel()].to_vec())
}

/// Every index in `0..len`, or the error naming the range.
fn check(op: &'static str, idx: &[i64], len: usize, axis: usize, shape: &[usize]) -> Result<()> {
    let bad = |&k: &i64| k < 0 || k as u64 >= len as u64;
    match idx.iter().find(|k| bad(k)) {
        None => Ok(()),
        Some(&example) => {
            let count = idx.iter().filter(|k| bad(k)).count() as u64;
            Err(out_of_range(op, count, example, len, axis, shape))
        }
    }
}

/// `[outer, len, inner]` around `axis`.
fn split(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    (
        shape[..axis].iter().product(),
        shape[axis],
        shape[axis + 1..].iter().product(),
    )
}

impl Indexing for Cpu {
    fn index_select(&self, x: &Operand<'_>, axis: usize, index: &Operand<'_>) -> Result<Dense> {
        const OP: &str = "index_select";
        let idx = indices(OP, index)?;
        check(OP, &idx, x.shape()[axis], axis, x.shape())?;
        let x = dense(x)?;
        let (outer, len, inner) = split(x.shape(), axis);
        let k = idx.len();
        let mut shape = x.shape().to_vec();
        shape[axis] = k;
        any_dispatch!(x.dtype(), |T| {
            let off = x.layout().offset();
            let src = x.storage().host::<T>(OP)?;
            let src = &src[off..off + x.numel()];
            build::<T>(OP, &shape, |out| {
                if inner == 0 {
                    return;
                }
                // One row of `inner` elements per (o, j).
                let row = |(r, dst): (usize, &mut [T])| {
                    let (o, j) = (r / k, r % k);
                    let from = (o * len + idx[j] as usize) * inner;
                    dst.copy_from_slice(&src[from..from + inner]);
                };
                if outer * k * inner >= PARALLEL_THRESHOLD {
                    out.par_chunks_mut(inner).enumerate().for_each(row);
                } else {
                    out.chunks_mut(inner).enumerate().for_each(row);
                }
            })
        })
    }

    fn index_add(
        &self,
        x: &Operand<'_>,
        axis: usize,
        index: &Operand<'_>,
        src: &Operand<'_>,
    ) -> Result<Dense> {
        const OP: &str = "index_add";
        let idx = indices(OP, index)?;
        check(OP, &idx, x.shape()[axis], axis, x.shape())?;
        let (x, src) = (dense(x)?, dense(src)?);
        let (outer, len, inner) = split(x.shape(), axis);
        let k = idx.len();
        float_dispatch!(x.dtype(), OP, |T| {
            let (xo, so) = (x.layout().offset(), src.layout().offset());
            let base = x.storage().host::<T>(OP)?;
            let base = &base[xo..xo + x.numel()];
            let add = src.storage().host::<T>(OP)?;
            let add = &add[so..so + src.numel()];
            build::<T>(OP, x.shape(), |out| {
                out.copy_from_slice(base);
                for o in 0..outer {
                    for (j, &at) in idx.iter().enumerate() {
                        let to = (o * len + at as usize) * inner;
                        let from = (o * k + j) * inner;
                        for (d, s) in out[to..to + inner].iter_mut().zip(&add[from..from + inner]) {
                            *d = <T as Element>::from_f64(d.to_f64() + s.to_f64());
                        }
                    }
                }
            })
        })
    }

    fn gather(&self, x: &Operand<'_>, axis: usize, index: &Operand<'_>) -> Result<Dense> {
        const OP: &str = "gather";
        let idx = indices(OP, index)?;
        check(OP, &idx, x.shape()[axis], axis, x.shape())?;
        let x = dense(x)?;
        let strides = contiguous_strides(x.shape());
        let ishape = index.shape();
        any_dispatch!(x.dtype(), |T| {
            let off = x.layout().offset();
            let src = x.storage().host::<T>(OP)?;
            let src = &src[off..off + x.numel()];
            build::<T>(OP, ishape, |out| {
                let at = |(p, o): (usize, &mut T)| {
                    *o = src[offset(ishape, &strides, axis, p, idx[p] as usize)];
                };
                if out.len() >= PARALLEL_THRESHOLD {
                    out.par_iter_mut().enumerate().for_each(at);
                } else {
                    out.iter_mut().enumerate().for_each(at);
                }
            })
        })
    }

    fn scatter_add(
        &self,
        x: &Operand<'_>,
        axis: usize,
        index: &Operand<'_>,
        src: &Operand<'_>,
    ) -> Result<Dense> {
        const OP: &str = "scatter_add";
        let idx = indices(OP, index)?;
        check(OP, &idx, x.shape()[axis], axis, x.shape())?;
        let (x, src) = (dense(x)?, dense(src)?);
        let strides = contiguous_strides(x.shape());
        let ishape = index.shape();
        float_dispatch!(x.dtype(), OP, |T| {
            let (xo, so) = (x.layout().offset(), src.layout().offset());
            let base = x.storage().host::<T>(OP)?;
            let base = &base[xo..xo + x.numel()];
            let add = src.storage().host::<T>(OP)?;
            let add = &add[so..so + src.numel()];
            build::<T>(OP, x.shape(), |out| {
                out.copy_from_slice(base);
                for (p, (&at, s)) in idx.iter().zip(add).enumerate() {
                    let d = &mut out[offset(ishape, &strides, axis, p, at as usize)];
                    *d = <T as Element>::from_f64(d.to_f64() + s.to_f64());
                }
            })
        })
    }
}

/// The element offset in a dense array of `strides` of position `p` of `shape` (the index's),
/// with `at` along `axis`.
fn offset(shape: &[usize], strides: &[usize], axis: usize, mut p: usize, at: usize) -> usize {
    let mut off = 0;
    for d in (0..shape.len()).rev() {
        let c = p % shape[d];
        p /= shape[d];
        off += if d == axis { at } else { c } * strides[d];
    }
    off
}
