//! Scaled dot-product attention on the host, in blocks: for each (batch, head) and each block
//! of query rows, the scores of one block of keys at a time come from a GEMM, a running maximum
//! and sum per row rescale the accumulated output (online softmax), so no `q_len x kv_len`
//! matrix is ever held, and each row's log-sum-exp is saved, from which backward recomputes the
//! weights block by block (GEMMs again for the four products). Grouped-query: each key/value
//! head serves `heads / kv_heads` query heads. Arithmetic in `f32` (`f64` for `f64` inputs);
//! one task per (batch, head) forward, per (batch, key/value head) backward.

use ferry_memory::Element;
use ferry_memory::gemm::{self, GemmElement, MatRef};
use rayon::prelude::*;

use super::select::uniform01;
use super::{Cpu, build, dense, float_dispatch, read_elements};
use crate::Result;
use crate::kernel::{Attention, Dense, Operand, View};
use crate::op::attention::Attend;
use crate::op::stats_dtype;

/// Query rows and keys per block.
const BLOCK: usize = 64;

/// The number type the kernel computes in (its GEMMs and kept blocks; sums run in `f64`).
trait Real: GemmElement + Element + std::ops::Mul<Output = Self> {}

impl Real for f32 {}
impl Real for f64 {}

/// The factor dropout leaves on weight `(row, j)`: 0 where dropped, else `1 / (1 - p)`. `row`
/// numbers the query rows over batch and heads.
fn keep(a: &Attend, row: usize, j: usize) -> f64 {
    if a.dropout == 0.0 {
        return 1.0;
    }
    // Dropout's own draw, so the mask is the same in forward and backward without storing it.
    let u = uniform01(a.seed, (row * a.dims.kv_len + j) as u64);
    if u < a.dropout {
        0.0
    } else {
        1.0 / (1.0 - a.dropout)
    }
}

/// A row-major matrix of `cols` columns starting at `offset` of `data`.
fn rows<T>(data: &[T], offset: usize, cols: usize) -> MatRef<'_, T> {
    MatRef {
        data,
        offset,
        row_stride: cols,
        col_stride: 1,
    }
}

/// The transpose of a row-major matrix of `cols` columns starting at `offset`.
fn transposed<T>(data: &[T], offset: usize, cols: usize) -> MatRef<'_, T> {
    MatRef {
        data,
        offset,
        row_stride: 1,
        col_stride: cols,
    }
}

/// `dst = lhs (m x k) · rhs (k x n)`, on this thread.
fn product<T: GemmElement>(
    [m, n, k]: [usize; 3],
    lhs: MatRef<'_, T>,
    rhs: MatRef<'_, T>,
    dst: &mut [T],
) -> Result<()> {
    Ok(gemm::matmul(m, n, k, lhs, rhs, &mut dst[..m * n], 1)?)
}

/// The scores of query rows `i0..i0 + bq` of one head against keys `j0..j0 + bk`, scaled, with
/// the keys a causal row does not see at -inf, into `s` (`bq x bk`).
#[allow(clippy::too_many_arguments)]
fn scores<W: Real>(
    q: &[W],
    q_at: usize,
    k: &[W],
    k_at: usize,
    (i0, bq, j0, bk): (usize, usize, usize, usize),
    a: &Attend,
    s: &mut [W],
) -> Result<()> {
    let dim = a.dims.dim;
    product(
        [bq, bk, dim],
        rows(q, q_at + i0 * dim, dim),
        transposed(k, k_at + j0 * dim, dim),
        s,
    )?;
    let scale = W::from_f64(a.scale);
    for (r, row) in s[..bq * bk].chunks_mut(bk).enumerate() {
        let seen = a.dims.visible(a.causal, i0 + r);
        for (c, x) in row.iter_mut().enumerate() {
            *x = if j0 + c < seen {
                *x * scale
            } else {
                W::from_f64(f64::NEG_INFINITY)
            };
        }
    }
    Ok(())
}

/// The keys any row of `i0..i0 + bq` sees: `0..` this.
fn keys_seen(a: &Attend, i0: usize, bq: usize) -> usize {
    a.dims.visible(a.causal, i0 + bq - 1)
}

/// Fills `out` (`[batch, heads, q_len, v_dim]`) and `lse` (`[batch, heads, q_len]`). A row that
/// sees no key gets zeros and a log-sum-exp of -inf.
fn forward<W: Real>(
    q: &[W],
    k: &[W],
    v: &[W],
    a: &Attend,
    out: &mut [W],
    lse: &mut [f64],
) -> Result<()> {
    let d = a.dims;
    let (dim, v_dim) = (d.dim, d.v_dim);
    out.par_chunks_mut((d.q_len * v_dim).max(1))
        .zip(lse.par_chunks_mut(d.q_len.max(1)))
        .enumerate()
        .try_for_each(|(bh, (out, lse))| -> Result<()> {
            let (b, h) = (bh / d.heads, bh % d.heads);
            let (q_at, kv) = (
                bh * d.q_len * dim,
                (b * d.kv_heads + h / d.group()) * d.kv_len,
            );
            let mut s = vec![W::ZERO; BLOCK * BLOCK];
            let mut pv = vec![W::ZERO; BLOCK * v_dim];
            for i0 in (0..d.q_len).step_by(BLOCK) {
                let bq = BLOCK.min(d.q_len - i0);
                let mut max = vec![f64::NEG_INFINITY; bq];
                let mut sum = vec![0.0f64; bq];
                let mut acc = vec![0.0f64; bq * v_dim];
                for j0 in (0..keys_seen(a, i0, bq)).step_by(BLOCK) {
                    let bk = BLOCK.min(d.kv_len - j0);
                    scores(q, q_at, k, kv * dim, (i0, bq, j0, bk), a, &mut s)?;
                    for r in 0..bq {
                        let row = &mut s[r * bk..(r + 1) * bk];
                        let block_max =
                            row.iter().fold(f64::NEG_INFINITY, |m, x| m.max(x.to_f64()));
                        let new_max = max[r].max(block_max);
                        if new_max == f64::NEG_INFINITY {
                            row.iter_mut().for_each(|x| *x = W::ZERO);
                            continue;
                        }
                        let rescale = (max[r] - new_max).exp();
                        sum[r] *= rescale;
                        acc[r * v_dim..(r + 1) * v_dim]
                            .iter_mut()
                            .for_each(|x| *x *= rescale);
                        let at = bh * d.q_len + i0 + r;
                        for (c, x) in row.iter_mut().enumerate() {
                            let p = (x.to_f64() - new_max).exp();
                            sum[r] += p;
                            *x = W::from_f64(p * keep(a, at, j0 + c));
                        }
                        max[r] = new_max;
                    }
                    product(
                        [bq, v_dim, bk],
                        rows(&s, 0, bk),
                        rows(v, (kv + j0) * v_dim, v_dim),
                        &mut pv,
                    )?;
                    acc.iter_mut().zip(&pv).for_each(|(x, y)| *x += y.to_f64());
                }
                for r in 0..bq {
                    let total = sum[r];
                    let row = &mut out[(i0 + r) * v_dim..(i0 + r + 1) * v_dim];
                    for (o, x) in row.iter_mut().zip(&acc[r * v_dim..(r + 1) * v_dim]) {
                        *o = W::from_f64(if total > 0.0 { x / total } else { 0.0 });
                    }
                    lse[i0 + r] = if total > 0.0 {
                        max[r] + total.ln()
                    } else {
                        f64::NEG_INFINITY
                    };
                }
            }
            Ok(())
        })
}

/// The gradients of `q`, `k` and `v` from the output's gradient `grad_out`, the forward's
/// inputs, its output `out` and its `lse`, written into `dq`, `dk` and `dv` (shaped as `q`, `k`
/// and `v`).
fn backward<W: Real>(
    [q, k, v]: [&[W]; 3],
    out: &[W],
    grad_out: &[W],
    lse: &[f64],
    a: &Attend,
    [dq, dk, dv]: [&mut [W]; 3],
) -> Result<()> {
    let d = a.dims;
    let (dim, v_dim, group) = (d.dim, d.v_dim, d.group());
    let q_rows = group * d.q_len;
    // One task per key/value head: it owns its keys' gradients and its query heads' rows.
    dq.par_chunks_mut((q_rows * dim).max(1))
        .zip(dk.par_chunks_mut((d.kv_len * dim).max(1)))
        .zip(dv.par_chunks_mut((d.kv_len * v_dim).max(1)))
        .enumerate()
        .try_for_each(|(kvh, ((dq, dk), dv))| -> Result<()> {
            let kv = kvh * d.kv_len;
            let (mut gk, mut gv) = (vec![0.0f64; d.kv_len * dim], vec![0.0f64; d.kv_len * v_dim]);
            let mut gq = vec![0.0f64; q_rows * dim];
            let (mut p, mut pd) = (vec![W::ZERO; BLOCK * BLOCK], vec![W::ZERO; BLOCK * BLOCK]);
            let mut dp = vec![W::ZERO; BLOCK * BLOCK];
            let mut tmp = vec![W::ZERO; BLOCK * dim.max(v_dim)];
            for g in 0..group {
                let head = kvh * group + g;
                let (q_at, o_at) = (head * d.q_len * dim, head * d.q_len * v_dim);
                for i0 in (0..d.q_len).step_by(BLOCK) {
                    let bq = BLOCK.min(d.q_len - i0);
                    // D_i = rowsum(P ∘ dP) = dO_i · O_i.
                    let delta: Vec<f64> = (0..bq)
                        .map(|r| {
                            let at = o_at + (i0 + r) * v_dim;
                            let (o, g) = (&out[at..at + v_dim], &grad_out[at..at + v_dim]);
                            o.iter().zip(g).map(|(x, y)| x.to_f64() * y.to_f64()).sum()
                        })
                        .collect();
                    for j0 in (0..keys_seen(a, i0, bq)).step_by(BLOCK) {
                        let bk = BLOCK.min(d.kv_len - j0);
                        scores(q, q_at, k, kv * dim, (i0, bq, j0, bk), a, &mut p)?;
                        product(
                            [bq, bk, v_dim],
                            rows(grad_out, o_at + i0 * v_dim, v_dim),
                            transposed(v, (kv + j0) * v_dim, v_dim),
                            &mut dp,
                        )?;
                        for (r, &delta) in delta.iter().enumerate() {
                            let row = head * d.q_len + i0 + r;
                            let l = lse[row];
                            for c in 0..bk {
                                let at = r * bk + c;
                                let w = (p[at].to_f64() - l).exp();
                                let kept = keep(a, row, j0 + c);
                                pd[at] = W::from_f64(w * kept);
                                // dS = P ∘ (dP ∘ keep − D) · scale, into dp.
                                dp[at] =
                                    W::from_f64(w * (dp[at].to_f64() * kept - delta) * a.scale);
                            }
                        }
                        // dV += (P ∘ keep)ᵀ dO; dK += dSᵀ Q; dQ += dS K.
                        product(
                            [bk, v_dim, bq],
                            transposed(&pd, 0, bk),
                            rows(grad_out, o_at + i0 * v_dim, v_dim),
                            &mut tmp,
                        )?;
                        gv[j0 * v_dim..(j0 + bk) * v_dim]
                            .iter_mut()
                            .zip(&tmp)
                            .for_each(|(x, y)| *x += y.to_f64());
                        product(
                            [bk, dim, bq],
                            transposed(&dp, 0, bk),
                            rows(q, q_at + i0 * dim, dim),
                            &mut tmp,
                        )?;
                        gk[j0 * dim..(j0 + bk) * dim]
                            .iter_mut()
                            .zip(&tmp)
                            .for_each(|(x, y)| *x += y.to_f64());
                        product(
                            [bq, dim, bk],
                            rows(&dp, 0, bk),
                            rows(k, (kv + j0) * dim, dim),
                            &mut tmp,
                        )?;
                        let rows_at = (g * d.q_len + i0) * dim;
                        gq[rows_at..rows_at + bq * dim]
                            .iter_mut()
                            .zip(&tmp)
                            .for_each(|(x, y)| *x += y.to_f64());
                    }
                }
            }
            dq.iter_mut()
                .zip(&gq)
                .for_each(|(o, g)| *o = W::from_f64(*g));
            dk.iter_mut()
                .zip(&gk)
                .for_each(|(o, g)| *o = W::from_f64(*g));
            dv.iter_mut()
                .zip(&gv)
                .for_each(|(o, g)| *o = W::from_f64(*g));
            Ok(())
        })
}

/// The elements of an operand as `W`, contiguous, in order.
fn working<T: Element, W: Real>(x: &Operand<'_>) -> Result<Vec<W>> {
    let values = read_elements::<T>(&dense(x)?.operand())?;
    Ok(values
        .into_iter()
        .map(|v| W::from_f64(v.to_f64()))
        .collect())
}

/// `values` rounded to `T`, as a host array of `shape`.
fn output<T: Element, W: Real>(op: &'static str, shape: &[usize], values: &[W]) -> Result<Dense> {
    build::<T>(op, shape, |out| {
        out.iter_mut()
            .zip(values)
            .for_each(|(o, x)| *o = T::from_f64(x.to_f64()))
    })
}

/// The forward over elements of `T`, computed in `W`: the output and the log-sum-exp.
fn attend<T: Element, W: Real>(
    [q, k, v]: [&Operand<'_>; 3],
    how: &Attend,
) -> Result<(Dense, Vec<f64>)> {
    let d = how.dims;
    let (qs, ks, vs) = (
        working::<T, W>(q)?,
        working::<T, W>(k)?,
        working::<T, W>(v)?,
    );
    let mut out = vec![W::ZERO; d.batch * d.heads * d.q_len * d.v_dim];
    let mut lse = vec![0.0f64; d.batch * d.heads * d.q_len];
    forward(&qs, &ks, &vs, how, &mut out, &mut lse)?;
    let shape = [d.batch, d.heads, d.q_len, d.v_dim];
    Ok((output::<T, W>(OP, &shape, &out)?, lse))
}

/// The backward over elements of `T`, computed in `W`.
fn attend_backward<T: Element, W: Real>(
    [q, k, v, out, g]: [&Operand<'_>; 5],
    lse: &[f64],
    how: &Attend,
) -> Result<[Dense; 3]> {
    let (qs, ks, vs) = (
        working::<T, W>(q)?,
        working::<T, W>(k)?,
        working::<T, W>(v)?,
    );
    let (os, gs) = (working::<T, W>(out)?, working::<T, W>(g)?);
    let (mut dq, mut dk, mut dv) = (
        vec![W::ZERO; qs.len()],
        vec![W::ZERO; ks.len()],
        vec![W::ZERO; vs.len()],
    );
    backward(
        [&qs, &ks, &vs],
        &os,
        &gs,
        lse,
        how,
        [&mut dq, &mut dk, &mut dv],
    )?;
    Ok([
        output::<T, W>(OP, q.shape(), &dq)?,
        output::<T, W>(OP, k.shape(), &dk)?,
        output::<T, W>(OP, v.shape(), &dv)?,
    ])
}

const OP: &str = "scaled_dot_product_attention";

impl Attention for Cpu {
    fn attention(
        &self,
        q: &Operand<'_>,
        k: &Operand<'_>,
        v: &Operand<'_>,
        how: &Attend,
    ) -> Result<Option<(Dense, Dense)>> {
        let dtype = q.dtype();
        let (out, lse) = float_dispatch!(dtype, OP, |T| match dtype {
            ferry_memory::DType::F64 => attend::<T, f64>([q, k, v], how)?,
            _ => attend::<T, f32>([q, k, v], how)?,
        });
        let d = how.dims;
        let stats = float_dispatch!(stats_dtype(dtype), OP, |S| output::<S, f64>(
            OP,
            &[d.batch, d.heads, d.q_len],
            &lse
        )?);
        Ok(Some((out, stats)))
    }

    fn attention_backward(
        &self,
        q: &Operand<'_>,
        k: &Operand<'_>,
        v: &Operand<'_>,
        out: &Operand<'_>,
        g: &Operand<'_>,
        lse: &Operand<'_>,
        how: &Attend,
    ) -> Result<Option<[Dense; 3]>> {
        let lse: Vec<f64> = float_dispatch!(lse.dtype(), OP, |S| working::<S, f64>(lse)?);
        let dtype = q.dtype();
        let grads = float_dispatch!(dtype, OP, |T| match dtype {
            ferry_memory::DType::F64 => attend_backward::<T, f64>([q, k, v, out, g], &lse, how)?,
            _ => attend_backward::<T, f32>([q, k, v, out, g], &lse, how)?,
        });
        Ok(Some(grads))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::attention::Dims;

    const DIMS: Dims = Dims {
        batch: 2,
        heads: 4,
        kv_heads: 2,
        q_len: 3,
        kv_len: 70,
        dim: 5,
        v_dim: 3,
    };

    fn dot(a: &[f64], b: &[f64]) -> f64 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    fn values(n: usize, salt: u64) -> Vec<f64> {
        (0..n)
            .map(|i| uniform01(salt, i as u64) * 2.0 - 1.0)
            .collect()
    }

    fn inputs(d: Dims) -> [Vec<f64>; 3] {
        let rows = d.batch * d.kv_heads * d.kv_len;
        [
            values(d.batch * d.heads * d.q_len * d.dim, 1),
            values(rows * d.dim, 2),
            values(rows * d.v_dim, 3),
        ]
    }

    fn run(d: Dims, a: Attend, [q, k, v]: &[Vec<f64>; 3]) -> (Vec<f64>, Vec<f64>) {
        let rows = d.batch * d.heads * d.q_len;
        let (mut out, mut lse) = (vec![0.0; rows * d.v_dim], vec![0.0; rows]);
        forward(q, k, v, &Attend { dims: d, ..a }, &mut out, &mut lse).unwrap();
        (out, lse)
    }

    /// The scores of every row materialized, softmaxed and applied: what the pass avoids.
    fn direct(d: Dims, a: Attend, [q, k, v]: &[Vec<f64>; 3]) -> (Vec<f64>, Vec<f64>) {
        let (mut out, mut lse) = (Vec::new(), Vec::new());
        for row in 0..d.batch * d.heads * d.q_len {
            let (b, h, i) = (
                row / (d.heads * d.q_len),
                row / d.q_len % d.heads,
                row % d.q_len,
            );
            let kv = (b * d.kv_heads + h / d.group()) * d.kv_len;
            let seen = d.visible(a.causal, i);
            let s: Vec<f64> = (0..seen)
                .map(|j| a.scale * dot(&q[row * d.dim..][..d.dim], &k[(kv + j) * d.dim..][..d.dim]))
                .collect();
            let total: f64 = s.iter().map(|s| s.exp()).sum();
            lse.push(total.ln());
            for c in 0..d.v_dim {
                out.push(
                    (0..seen)
                        .map(|j| {
                            s[j].exp() / total
                                * keep(&Attend { dims: d, ..a }, row, j)
                                * v[(kv + j) * d.v_dim + c]
                        })
                        .sum(),
                );
            }
        }
        (out, lse)
    }

    fn close(a: &[f64], b: &[f64], tol: f64) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= tol * (1.0 + y.abs()), "at {i}: {x} vs {y}");
        }
    }

    fn attend(causal: bool, dropout: f64) -> Attend {
        Attend {
            dims: DIMS,
            scale: 0.45,
            causal,
            dropout,
            seed: 11,
        }
    }

    #[test]
    fn the_one_pass_equals_the_materialized_softmax() {
        // Several blocks of queries and of keys, the last ones partial.
        let long = Dims {
            q_len: 130,
            kv_len: 150,
            ..DIMS
        };
        for d in [DIMS, long] {
            let x = inputs(d);
            for causal in [false, true] {
                for dropout in [0.0, 0.3] {
                    let a = Attend {
                        dims: d,
                        ..attend(causal, dropout)
                    };
                    let (out, lse) = run(d, a, &x);
                    let (want, want_lse) = direct(d, a, &x);
                    close(&out, &want, 1e-12);
                    close(&lse, &want_lse, 1e-12);
                }
            }
        }
    }

    #[test]
    fn a_causal_row_sees_only_keys_up_to_its_position() {
        // Three queries at the end of five keys: rows see 3, 4 and 5 keys.
        let d = Dims { kv_len: 5, ..DIMS };
        assert_eq!(
            (0..3).map(|i| d.visible(true, i)).collect::<Vec<_>>(),
            [3, 4, 5]
        );
        assert_eq!(d.visible(false, 0), 5);
        // More queries than keys: the first rows see none, and give zeros.
        let d = Dims {
            q_len: 4,
            kv_len: 2,
            ..DIMS
        };
        assert_eq!(
            (0..4).map(|i| d.visible(true, i)).collect::<Vec<_>>(),
            [0, 0, 1, 2]
        );
        let (out, lse) = run(d, attend(true, 0.0), &inputs(d));
        assert!(out[..2 * d.v_dim].iter().all(|&o| o == 0.0));
        assert_eq!(lse[0], f64::NEG_INFINITY);
    }

    #[test]
    fn dropout_drops_its_share_the_same_way_each_time() {
        let a = attend(false, 0.25);
        let wide = Attend {
            dims: Dims {
                kv_len: 100_000,
                ..DIMS
            },
            ..a
        };
        let dropped = (0..100_000).filter(|&j| keep(&wide, 3, j) == 0.0).count();
        assert!((dropped as f64 / 1e5 - 0.25).abs() < 0.01, "{dropped}");
        assert!((0..100).all(|j| [0.0, 1.0 / 0.75].contains(&keep(&wide, 1, j))));
        let x = inputs(DIMS);
        assert_eq!(run(DIMS, a, &x), run(DIMS, a, &x));
        assert_ne!(
            run(DIMS, a, &x).0,
            run(DIMS, Attend { seed: 12, ..a }, &x).0
        );
    }

    /// `sum(out ∘ w)` for a fixed `w`, whose gradient backward computes from `grad_out = w`.
    #[test]
    fn backward_matches_central_differences() {
        let d = Dims {
            kv_len: 6,
            q_len: 4,
            ..DIMS
        };
        let w = values(d.batch * d.heads * d.q_len * d.v_dim, 9);
        for causal in [false, true] {
            for dropout in [0.0, 0.4] {
                let a = attend(causal, dropout);
                let x = inputs(d);
                let (out, lse) = run(d, a, &x);
                let mut grads = [
                    vec![0.0; x[0].len()],
                    vec![0.0; x[1].len()],
                    vec![0.0; x[2].len()],
                ];
                let [gq, gk, gv] = &mut grads;
                let how = Attend { dims: d, ..a };
                backward([&x[0], &x[1], &x[2]], &out, &w, &lse, &how, [gq, gk, gv]).unwrap();
                let loss = |x: &[Vec<f64>; 3]| -> f64 {
                    run(d, a, x).0.iter().zip(&w).map(|(o, w)| o * w).sum()
                };
                for (which, grad) in grads.iter().enumerate() {
                    for e in 0..grad.len() {
                        let h = 1e-6;
                        let mut up = x.clone();
                        up[which][e] += h;
                        let mut down = x.clone();
                        down[which][e] -= h;
                        let numeric = (loss(&up) - loss(&down)) / (2.0 * h);
                        assert!(
                            (numeric - grad[e]).abs() < 1e-7,
                            "input {which} element {e} (causal {causal}, dropout {dropout}): \
                             {numeric} vs {}",
                            grad[e]
                        );
                    }
                }
            }
        }
    }
}
