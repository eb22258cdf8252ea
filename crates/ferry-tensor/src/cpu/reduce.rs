//! Reductions along one axis of a contiguous tensor, seen as `[outer, len, inner]`.

use ferry_memory::Element;
use num_traits::Float;
use rayon::prelude::*;

use super::{Cpu, PARALLEL_THRESHOLD, build, float_dispatch};
use crate::Result;
use crate::kernel::{Dense, Operand, Reduce, View};
use crate::op::ReduceOp;

impl Reduce for Cpu {
    fn nll_backward(
        &self,
        targets: &Operand<'_>,
        g: &Operand<'_>,
        classes: usize,
    ) -> Result<Option<Dense>> {
        nll_gradient(targets, g, classes).map(Some)
    }

    /// Reduces axis `axis` of `x` away (the caller restores it for keepdim).
    fn reduce(&self, x: &Operand<'_>, axis: usize, op: ReduceOp) -> Result<Dense> {
        let x = super::dense(x)?;
        let shape = x.shape();
        let outer: usize = shape[..axis].iter().product();
        let len = shape[axis];
        let inner: usize = shape[axis + 1..].iter().product();
        let mut out_shape = shape.to_vec();
        out_shape.remove(axis);
        let name = match op {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
            ReduceOp::ArgMax => "argmax",
        };
        float_dispatch!(x.dtype(), name, |T| {
            let off = x.layout().offset();
            let src = x.storage().host::<T>(name)?;
            let src = &src[off..off + x.numel()];
            let at = |o: usize, j: usize, i: usize| src[(o * len + j) * inner + i];
            match op {
                ReduceOp::Sum => build::<T>(name, &out_shape, |out| {
                    fill(out, outer * len * inner, |k| {
                        let (o, i) = (k / inner.max(1), k % inner.max(1));
                        // Accumulate in f64: long f32 rows lose digits otherwise.
                        <T as Element>::from_f64(if inner == 1 {
                            sum_f64(&src[o * len..(o + 1) * len])
                        } else {
                            (0..len).map(|j| at(o, j, i).to_f64()).sum()
                        })
                    })
                }),
                ReduceOp::Max => build::<T>(name, &out_shape, |out| {
                    fill(out, outer * len * inner, |k| {
                        let (o, i) = (k / inner.max(1), k % inner.max(1));
                        (0..len)
                            .map(|j| at(o, j, i))
                            .fold(
                                T::neg_infinity(),
                                |m, v| if v > m || v.is_nan() { v } else { m },
                            )
                    })
                }),
                ReduceOp::ArgMax => build::<i64>(name, &out_shape, |out| {
                    fill(out, outer * len * inner, |k| {
                        let (o, i) = (k / inner.max(1), k % inner.max(1));
                        let mut best = 0;
                        for j in 1..len {
                            if at(o, j, i) > at(o, best, i) {
                                best = j;
                            }
                        }
                        best as i64
                    })
                }),
            }
        })
    }

    /// Sum of every element, accumulated in f64 in parallel chunks.
    fn sum_all(&self, x: &Operand<'_>) -> Result<Dense> {
        let x = super::dense(x)?;
        float_dispatch!(x.dtype(), "sum", |T| {
            let off = x.layout().offset();
            let src = x.storage().host::<T>("sum")?;
            let src = &src[off..off + x.numel()];
            let total: f64 = if src.len() >= PARALLEL_THRESHOLD {
                src.par_chunks(super::CHUNK).map(sum_f64).sum()
            } else {
                sum_f64(src)
            };
            build::<T>("sum", &[], |out| out[0] = <T as Element>::from_f64(total))
        })
    }

    /// Softmax (or log-softmax) over the last axis, one row per task.
    fn softmax(&self, x: &Operand<'_>, log: bool) -> Result<Dense> {
        let x = super::dense(x)?;
        let cols = x.shape().last().copied().unwrap_or(1).max(1);
        float_dispatch!(x.dtype(), "softmax", |T| {
            let off = x.layout().offset();
            let src = x.storage().host::<T>("softmax")?;
            let src = &src[off..off + x.numel()];
            build::<T>("softmax", x.shape(), |out| {
                let row = |(o, r): (&mut [T], &[T])| {
                    let max = r
                        .iter()
                        .map(|v| v.to_f64())
                        .fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = r.iter().map(|v| (v.to_f64() - max).exp()).sum();
                    for (o, v) in o.iter_mut().zip(r) {
                        let shifted = v.to_f64() - max;
                        let value = if log {
                            shifted - sum.ln()
                        } else {
                            shifted.exp() / sum
                        };
                        *o = <T as Element>::from_f64(value);
                    }
                };
                if x.numel() >= PARALLEL_THRESHOLD {
                    out.par_chunks_mut(cols)
                        .zip(src.par_chunks(cols))
                        .for_each(row);
                } else {
                    out.chunks_mut(cols).zip(src.chunks(cols)).for_each(row);
                }
            })
        })
    }

    /// `-mean(logp[i, targets[i]])` of `[rows, classes]` log-probabilities; targets outside
    /// `0..classes` are an error.
    fn nll(&self, logp: &Operand<'_>, targets: &Operand<'_>) -> Result<Dense> {
        let logp = super::dense(logp)?;
        let targets = super::dense(targets)?;
        let classes = logp.shape()[1];
        let t_off = targets.layout().offset();
        let t = targets.storage().host::<i64>("cross_entropy")?;
        let t = &t[t_off..t_off + targets.numel()];
        let bad: Vec<i64> = t
            .iter()
            .copied()
            .filter(|&k| k < 0 || k as usize >= classes)
            .collect();
        if let Some(&example) = bad.first() {
            return Err(crate::TensorError::InvalidArgument {
                op: "cross_entropy",
                message: crate::op::message::classes_message(bad.len() as i64, example, classes),
            });
        }
        float_dispatch!(logp.dtype(), "cross_entropy", |T| {
            let off = logp.layout().offset();
            let src = logp.storage().host::<T>("cross_entropy")?;
            let src = &src[off..off + logp.numel()];
            let picked: f64 = t
                .iter()
                .enumerate()
                .map(|(row, &k)| src[row * classes + k as usize].to_f64())
                .sum();
            let mean = -picked / t.len().max(1) as f64;
            build::<T>("cross_entropy", &[], |out| {
                out[0] = <T as Element>::from_f64(mean)
            })
        })
    }
}

/// `out[k] = f(k)`, in parallel when the work behind `out` is large.
fn fill<U: Element>(out: &mut [U], work: usize, f: impl Fn(usize) -> U + Sync) {
    if work >= PARALLEL_THRESHOLD && out.len() > 1 {
        out.par_iter_mut().enumerate().for_each(|(k, o)| *o = f(k));
    } else {
        out.iter_mut().enumerate().for_each(|(k, o)| *o = f(k));
    }
}

/// Sum in f64 with eight independent accumulators, so the adds pipeline (and vectorise)
/// instead of waiting on one another.
fn sum_f64<T: Element>(values: &[T]) -> f64 {
    ferry_memory::simd::vectorized(|| {
        let mut lanes = [0.0f64; 8];
        let chunks = values.chunks_exact(8);
        let tail: f64 = chunks.remainder().iter().map(|v| v.to_f64()).sum();
        for chunk in chunks {
            for (lane, v) in lanes.iter_mut().zip(chunk) {
                *lane += v.to_f64();
            }
        }
        lanes.iter().sum::<f64>() + tail
    })
}

/// nll's gradient: `-g / rows` at each row's target of a `[rows, classes]` tensor, 0 elsewhere.
fn nll_gradient(targets: &Operand<'_>, g: &Operand<'_>, classes: usize) -> Result<Dense> {
    let targets = super::dense(targets)?;
    let t_off = targets.layout().offset();
    let t = targets.storage().host::<i64>("cross_entropy backward")?;
    let t = &t[t_off..t_off + targets.numel()];
    let rows = t.len();
    let g = super::dense(g)?;
    float_dispatch!(g.dtype(), "cross_entropy backward", |T| {
        let g_off = g.layout().offset();
        let scale = -g.storage().host::<T>("cross_entropy backward")?[g_off].to_f64() / rows as f64;
        build::<T>("cross_entropy backward", &[rows, classes], |out| {
            out.fill(<T as Element>::from_f64(0.0));
            for (row, &k) in t.iter().enumerate() {
                if (0..classes as i64).contains(&k) {
                    out[row * classes + k as usize] = <T as Element>::from_f64(scale);
                }
            }
        })
    })
}
