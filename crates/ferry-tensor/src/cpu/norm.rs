//! Layer normalization and RMSNorm over the last axis of a `[rows, cols]` tensor on the host:
//! statistics in f64, one row per task; the weight and bias gradients are column sums in f64.

use ferry_memory::{DType, Element};
use rayon::prelude::*;

use super::{Cpu, PARALLEL_THRESHOLD, build, dense, float_dispatch};
use crate::Result;
use crate::kernel::{Dense, Norm, Operand, View};
use crate::op::stats_dtype;

/// The elements of a host operand of `T`, in row-major order, as f64.
fn elements<T: Element>(op: &'static str, t: &Operand<'_>) -> Result<Vec<f64>> {
    let t = dense(t)?;
    let off = t.layout().offset();
    let data = t.storage().host::<T>(op)?;
    Ok(data[off..off + t.numel()]
        .iter()
        .map(|v| v.to_f64())
        .collect())
}

/// Builds per-row statistics of `shape` (layer norm's `[rows, 2]`: mean and rstd; RMSNorm's
/// `[rows]`: rstd) in `stats_dtype(dtype)`.
fn stats_output(op: &'static str, dtype: DType, stats: &[f64], shape: &[usize]) -> Result<Dense> {
    float_dispatch!(stats_dtype(dtype), op, |S| {
        build::<S>(op, shape, |out| {
            for (o, &v) in out.iter_mut().zip(stats) {
                *o = <S as Element>::from_f64(v);
            }
        })
    })
}

/// `[cols]` sums over the rows of `f(row, col)`, in f64, as `T`.
fn column_sums<T: Element>(
    op: &'static str,
    rows: usize,
    cols: usize,
    f: &dyn Fn(usize, usize) -> f64,
) -> Result<Dense> {
    let mut acc = vec![0.0f64; cols];
    for i in 0..rows {
        for (j, a) in acc.iter_mut().enumerate() {
            *a += f(i, j);
        }
    }
    build::<T>(op, &[cols], |out| {
        for (o, &a) in out.iter_mut().zip(&acc) {
            *o = <T as Element>::from_f64(a);
        }
    })
}

/// Runs `row` on each of `out`'s rows of `cols` with its index, in parallel for large tensors.
fn each_row<T: Send>(out: &mut [T], cols: usize, row: impl Fn((usize, &mut [T])) + Sync + Send) {
    if out.len() >= PARALLEL_THRESHOLD {
        out.par_chunks_mut(cols).enumerate().for_each(row);
    } else {
        out.chunks_mut(cols).enumerate().for_each(row);
    }
}

impl Norm for Cpu {
    /// `y` and the `[rows, 2]` statistics of `x` (`[rows, cols]`).
    fn layer_norm(
        &self,
        x: &Operand<'_>,
        w: Option<&Operand<'_>>,
        b: Option<&Operand<'_>>,
        eps: f64,
    ) -> Result<(Dense, Dense)> {
        const OP: &str = "layer_norm";
        let (rows, cols) = (x.shape()[0], x.shape()[1]);
        let mut stats = vec![0.0f64; 2 * rows];
        let y = float_dispatch!(x.dtype(), OP, |T| {
            let xs = elements::<T>(OP, x)?;
            let ws = w.map(|w| elements::<T>(OP, w)).transpose()?;
            let bs = b.map(|b| elements::<T>(OP, b)).transpose()?;
            // Statistics rounded to the dtype they are kept in, so the backward sees the same.
            let keep = |v: f64| {
                if x.dtype() == DType::F64 {
                    v
                } else {
                    v as f32 as f64
                }
            };
            build::<T>(OP, x.shape(), |out| {
                let row = |((o, r), st): ((&mut [T], &[f64]), &mut [f64])| {
                    let mean = r.iter().sum::<f64>() / cols as f64;
                    let var = r.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / cols as f64;
                    let rstd = 1.0 / (var + eps).sqrt();
                    for (j, (o, &v)) in o.iter_mut().zip(r).enumerate() {
                        let mut y = (v - mean) * rstd;
                        if let Some(ws) = &ws {
                            y *= ws[j];
                        }
                        if let Some(bs) = &bs {
                            y += bs[j];
                        }
                        *o = <T as Element>::from_f64(y);
                    }
                    st[0] = keep(mean);
                    st[1] = keep(rstd);
                };
                if rows * cols >= PARALLEL_THRESHOLD {
                    out.par_chunks_mut(cols)
                        .zip(xs.par_chunks(cols))
                        .zip(stats.par_chunks_mut(2))
                        .for_each(row);
                } else {
                    out.chunks_mut(cols)
                        .zip(xs.chunks(cols))
                        .zip(stats.chunks_mut(2))
                        .for_each(row);
                }
            })?
        });
        Ok((y, stats_output(OP, x.dtype(), &stats, &[rows, 2])?))
    }

    /// `dx`, `dweight`, `dbias` (each only when `want` says so) from the output gradient `g`, the
    /// input `x`, the weight and the saved statistics.
    fn layer_norm_backward(
        &self,
        g: &Operand<'_>,
        x: &Operand<'_>,
        w: Option<&Operand<'_>>,
        stats: &Operand<'_>,
        want: [bool; 3],
    ) -> Result<(Option<Dense>, Option<Dense>, Option<Dense>)> {
        const OP: &str = "layer_norm backward";
        let (rows, cols) = (x.shape()[0], x.shape()[1]);
        let st = float_dispatch!(stats.dtype(), OP, |S| elements::<S>(OP, stats)?);
        float_dispatch!(x.dtype(), OP, |T| {
            let gs = elements::<T>(OP, g)?;
            let xs = elements::<T>(OP, x)?;
            let ws = w.map(|w| elements::<T>(OP, w)).transpose()?;
            let dx = if want[0] {
                Some(build::<T>(OP, x.shape(), |out| {
                    let row = |(i, o): (usize, &mut [T])| {
                        let (mean, rstd) = (st[2 * i], st[2 * i + 1]);
                        let (gr, xr) =
                            (&gs[i * cols..(i + 1) * cols], &xs[i * cols..(i + 1) * cols]);
                        let gw = |j: usize| gr[j] * ws.as_ref().map_or(1.0, |w| w[j]);
                        let (mut s1, mut s2) = (0.0, 0.0);
                        for (j, &xv) in xr.iter().enumerate() {
                            s1 += gw(j);
                            s2 += gw(j) * (xv - mean) * rstd;
                        }
                        let (m1, m2) = (s1 / cols as f64, s2 / cols as f64);
                        for (j, o) in o.iter_mut().enumerate() {
                            let xh = (xr[j] - mean) * rstd;
                            *o = <T as Element>::from_f64(rstd * (gw(j) - m1 - xh * m2));
                        }
                    };
                    if rows * cols >= PARALLEL_THRESHOLD {
                        out.par_chunks_mut(cols).enumerate().for_each(row);
                    } else {
                        out.chunks_mut(cols).enumerate().for_each(row);
                    }
                })?)
            } else {
                None
            };
            let column_sums = |f: &dyn Fn(usize, usize) -> f64| column_sums::<T>(OP, rows, cols, f);
            let dw = if want[1] {
                Some(column_sums(&|i, j| {
                    gs[i * cols + j] * (xs[i * cols + j] - st[2 * i]) * st[2 * i + 1]
                })?)
            } else {
                None
            };
            let db = if want[2] {
                Some(column_sums(&|i, j| gs[i * cols + j])?)
            } else {
                None
            };
            Ok((dx, dw, db))
        })
    }

    /// `y` and the `[rows]` inverse root mean squares of `x` (`[rows, cols]`).
    fn rms_norm(
        &self,
        x: &Operand<'_>,
        w: Option<&Operand<'_>>,
        eps: f64,
    ) -> Result<(Dense, Dense)> {
        const OP: &str = "rms_norm";
        let (rows, cols) = (x.shape()[0], x.shape()[1]);
        let dtype = x.dtype();
        // The statistic as it is kept (f32 but for f64), so forward and backward use one value.
        let keep = |v: f64| {
            if dtype == DType::F64 {
                v
            } else {
                v as f32 as f64
            }
        };
        let half = matches!(dtype, DType::F16 | DType::BF16);
        let mut rstd = vec![0.0f64; rows];
        let y = float_dispatch!(dtype, OP, |T| {
            let xs = elements::<T>(OP, x)?;
            let ws = w.map(|w| elements::<T>(OP, w)).transpose()?;
            let row_rstd = |r: &[f64]| {
                keep(1.0 / (r.iter().map(|v| v * v).sum::<f64>() / cols as f64 + eps).sqrt())
            };
            if xs.len() >= PARALLEL_THRESHOLD {
                rstd.par_iter_mut()
                    .zip(xs.par_chunks(cols))
                    .for_each(|(s, r)| *s = row_rstd(r));
            } else {
                rstd.iter_mut()
                    .zip(xs.chunks(cols))
                    .for_each(|(s, r)| *s = row_rstd(r));
            }
            build::<T>(OP, x.shape(), |out| {
                each_row(out, cols, |(i, o)| {
                    let r = &xs[i * cols..(i + 1) * cols];
                    for (j, (o, &v)) in o.iter_mut().zip(r).enumerate() {
                        let mut y = v * rstd[i];
                        if half {
                            // Rounded to the input's dtype before the weight (transformers).
                            y = <T as Element>::from_f64(y).to_f64();
                        }
                        if let Some(ws) = &ws {
                            y *= ws[j];
                        }
                        *o = <T as Element>::from_f64(y);
                    }
                })
            })?
        });
        Ok((y, stats_output(OP, dtype, &rstd, &[rows])?))
    }

    /// `dx` and `dweight` (each only when `want` says so) from the output gradient `g`, the
    /// input `x`, the weight and the saved inverse root mean squares.
    fn rms_norm_backward(
        &self,
        g: &Operand<'_>,
        x: &Operand<'_>,
        w: Option<&Operand<'_>>,
        rstd: &Operand<'_>,
        want: [bool; 2],
    ) -> Result<(Option<Dense>, Option<Dense>)> {
        const OP: &str = "rms_norm backward";
        let cols = x.shape()[1];
        let rows = x.shape()[0];
        let st = float_dispatch!(rstd.dtype(), OP, |S| elements::<S>(OP, rstd)?);
        float_dispatch!(x.dtype(), OP, |T| {
            let gs = elements::<T>(OP, g)?;
            let xs = elements::<T>(OP, x)?;
            let ws = w.map(|w| elements::<T>(OP, w)).transpose()?;
            // dx = rstd (gw - x̂ mean(gw x̂)) with gw = g w and x̂ = x rstd.
            let dx = if want[0] {
                Some(build::<T>(OP, x.shape(), |out| {
                    each_row(out, cols, |(i, o)| {
                        let (gr, xr) =
                            (&gs[i * cols..(i + 1) * cols], &xs[i * cols..(i + 1) * cols]);
                        let gw = |j: usize| gr[j] * ws.as_ref().map_or(1.0, |w| w[j]);
                        let r = st[i];
                        let m = (0..cols).map(|j| gw(j) * xr[j] * r).sum::<f64>() / cols as f64;
                        for (j, o) in o.iter_mut().enumerate() {
                            *o = <T as Element>::from_f64(r * (gw(j) - xr[j] * r * m));
                        }
                    })
                })?)
            } else {
                None
            };
            let dw = if want[1] {
                Some(column_sums::<T>(OP, rows, cols, &|i, j| {
                    gs[i * cols + j] * xs[i * cols + j] * st[i]
                })?)
            } else {
                None
            };
            Ok((dx, dw))
        })
    }
}
