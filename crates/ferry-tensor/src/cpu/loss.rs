//! Cross-entropy on the host: one task per row computes the row's log-sum-exp in f64 and, from
//! it, the row's loss; the backward rebuilds each row's softmax from the saved log-sum-exp.

use ferry_memory::Element;
use rayon::prelude::*;

use super::{Cpu, PARALLEL_THRESHOLD, build, dense, float_dispatch};
use crate::kernel::{Dense, Loss, Operand, View};
use crate::op::stats_dtype;
use crate::{Result, TensorError};

const OP: &str = "cross_entropy";
const BACKWARD: &str = "cross_entropy backward";

/// Whether row `target` adds to the loss (it is not the ignored class).
fn counted(target: i64, ignore: Option<i64>) -> bool {
    ignore != Some(target)
}

/// The targets of a host operand, each checked to be a class or the ignored one.
fn targets(targets: &Operand<'_>, classes: usize, ignore: Option<i64>) -> Result<Vec<i64>> {
    let targets = dense(targets)?;
    let off = targets.layout().offset();
    let t = targets.storage().host::<i64>(OP)?[off..off + targets.numel()].to_vec();
    let bad: Vec<i64> = t
        .iter()
        .copied()
        .filter(|&k| counted(k, ignore) && (k < 0 || k as usize >= classes))
        .collect();
    if let Some(&example) = bad.first() {
        return Err(TensorError::InvalidArgument {
            op: OP,
            message: crate::op::message::classes_message(bad.len() as i64, example, classes),
        });
    }
    Ok(t)
}

/// `log Σ exp(row)`, shifted by the row's maximum, in f64.
fn log_sum_exp<T: Element>(row: &[T]) -> f64 {
    let max = row
        .iter()
        .map(|v| v.to_f64())
        .fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        return max;
    }
    let sum: f64 = row.iter().map(|v| (v.to_f64() - max).exp()).sum();
    max + sum.ln()
}

impl Loss for Cpu {
    fn cross_entropy(
        &self,
        logits: &Operand<'_>,
        targets: &Operand<'_>,
        ignore: Option<i64>,
    ) -> Result<Option<(Dense, Dense)>> {
        let (rows, classes) = (logits.shape()[0], logits.shape()[1]);
        let t = self::targets(targets, classes, ignore)?;
        let x = dense(logits)?;
        let (lse, loss) = float_dispatch!(x.dtype(), OP, |T| {
            let off = x.layout().offset();
            let src = x.storage().host::<T>(OP)?;
            let src = &src[off..off + x.numel()];
            let row = |r: &[T]| log_sum_exp(r);
            let lse: Vec<f64> = if x.numel() >= PARALLEL_THRESHOLD {
                src.par_chunks(classes.max(1)).map(row).collect()
            } else {
                src.chunks(classes.max(1)).map(row).collect()
            };
            let (mut total, mut count) = (0.0, 0usize);
            for (i, (&k, &l)) in t.iter().zip(&lse).enumerate() {
                if counted(k, ignore) {
                    total += l - src[i * classes + k as usize].to_f64();
                    count += 1;
                }
            }
            // No row counted: 0 / 0, NaN, as PyTorch gives.
            let loss = build::<T>(OP, &[], |out| {
                out[0] = <T as Element>::from_f64(total / count as f64)
            })?;
            (lse, loss)
        });
        let lse = float_dispatch!(stats_dtype(x.dtype()), OP, |S| {
            build::<S>(OP, &[rows], |out| {
                for (o, &v) in out.iter_mut().zip(&lse) {
                    *o = <S as Element>::from_f64(v);
                }
            })?
        });
        Ok(Some((loss, lse)))
    }

    fn cross_entropy_backward(
        &self,
        logits: &Operand<'_>,
        targets: &Operand<'_>,
        lse: &Operand<'_>,
        scale: &Operand<'_>,
        ignore: Option<i64>,
    ) -> Result<Option<Dense>> {
        let classes = logits.shape()[1].max(1);
        let t = self::targets(targets, classes, ignore)?;
        let (lse, scale) = (dense(lse)?, dense(scale)?);
        let (lse, scale) = float_dispatch!(lse.dtype(), BACKWARD, |S| {
            let off = lse.layout().offset();
            let l = lse.storage().host::<S>(BACKWARD)?[off..off + lse.numel()]
                .iter()
                .map(|v| v.to_f64())
                .collect::<Vec<f64>>();
            let s = scale.storage().host::<S>(BACKWARD)?[scale.layout().offset()].to_f64();
            (l, s)
        });
        let x = dense(logits)?;
        float_dispatch!(x.dtype(), BACKWARD, |T| {
            let off = x.layout().offset();
            let src = x.storage().host::<T>(BACKWARD)?;
            let src = &src[off..off + x.numel()];
            build::<T>(BACKWARD, x.shape(), |out| {
                let row = |(i, (o, r)): (usize, (&mut [T], &[T]))| {
                    let k = t[i];
                    if !counted(k, ignore) {
                        o.fill(<T as Element>::from_f64(0.0));
                        return;
                    }
                    for (j, (o, v)) in o.iter_mut().zip(r).enumerate() {
                        let p = (v.to_f64() - lse[i]).exp();
                        let hot = if j as i64 == k { 1.0 } else { 0.0 };
                        *o = <T as Element>::from_f64((p - hot) * scale);
                    }
                };
                if x.numel() >= PARALLEL_THRESHOLD {
                    out.par_chunks_mut(classes)
                        .zip(src.par_chunks(classes))
                        .enumerate()
                        .for_each(row);
                } else {
                    out.chunks_mut(classes)
                        .zip(src.chunks(classes))
                        .enumerate()
                        .for_each(row);
                }
            })
        })
        .map(Some)
    }
}
