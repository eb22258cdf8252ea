//! Scaled dot-product attention on the host, one pass over the keys: each query row keeps a
//! running maximum, sum and weighted value sum (online softmax) over blocks of keys, so no
//! `q_len x kv_len` matrix is ever held, and saves the row's log-sum-exp, from which backward
//! recomputes each weight. Grouped-query: each key/value head serves `heads / kv_heads` query
//! heads. Arithmetic in `f64` whatever the element type; one task per query row (forward) or
//! per key/value head (backward).

use ferry_memory::Element;
use rayon::prelude::*;

use super::{Cpu, build, dense, float_dispatch, read_elements};
use crate::Result;
use crate::kernel::{Attention, Dense, Operand, View};
use crate::op::attention::Attend;
use crate::op::stats_dtype;

/// Keys per block of the forward pass.
const BLOCK: usize = 64;

/// The factor dropout leaves on weight `(row, j)`: 0 where dropped, else `1 / (1 - p)`. `row`
/// numbers the query rows over batch and heads.
fn keep(a: &Attend, row: usize, j: usize) -> f64 {
    if a.dropout == 0.0 {
        return 1.0;
    }
    let u = uniform(a.seed, (row * a.dims.kv_len + j) as u64);
    if u < a.dropout {
        0.0
    } else {
        1.0 / (1.0 - a.dropout)
    }
}

/// A uniform draw in [0, 1) for element `n` of stream `seed` (SplitMix64 of both): the same
/// mask in forward and backward without storing it.
fn uniform(seed: u64, n: u64) -> f64 {
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(n.wrapping_mul(0xD1B5_4A32_D192_ED03));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

fn dot<T: Element>(a: &[T], b: &[T]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x.to_f64() * y.to_f64()).sum()
}

/// Fills `out` (`[batch, heads, q_len, v_dim]`) and `lse` (`[batch, heads, q_len]`). A row that
/// sees no key (none, when `kv_len` is 0) gets zeros and a log-sum-exp of -inf.
fn forward<T: Element>(q: &[T], k: &[T], v: &[T], a: &Attend, out: &mut [T], lse: &mut [f64]) {
    let d = a.dims;
    let (dim, v_dim) = (d.dim, d.v_dim);
    out.par_chunks_mut(v_dim.max(1))
        .zip(lse.par_iter_mut())
        .enumerate()
        .for_each(|(row, (out, lse))| {
            let (bh, i) = (row / d.q_len, row % d.q_len);
            let (b, h) = (bh / d.heads, bh % d.heads);
            let kv = (b * d.kv_heads + h / d.group()) * d.kv_len;
            let q = &q[row * dim..(row + 1) * dim];
            let (mut max, mut sum) = (f64::NEG_INFINITY, 0.0);
            let mut acc = vec![0.0f64; v_dim];
            let mut scores = [0.0f64; BLOCK];
            let visible = d.visible(a.causal, i);
            for start in (0..visible).step_by(BLOCK) {
                let keys = start..(start + BLOCK).min(visible);
                let block = &mut scores[..keys.len()];
                for (s, j) in block.iter_mut().zip(keys.clone()) {
                    *s = a.scale * dot(q, &k[(kv + j) * dim..(kv + j + 1) * dim]);
                }
                let new_max = block.iter().copied().fold(max, f64::max);
                let rescale = (max - new_max).exp();
                sum *= rescale;
                acc.iter_mut().for_each(|x| *x *= rescale);
                for (&s, j) in block.iter().zip(keys) {
                    let p = (s - new_max).exp();
                    sum += p;
                    let weight = p * keep(a, row, j);
                    if weight != 0.0 {
                        let vj = &v[(kv + j) * v_dim..(kv + j + 1) * v_dim];
                        acc.iter_mut()
                            .zip(vj)
                            .for_each(|(x, y)| *x += weight * y.to_f64());
                    }
                }
                max = new_max;
            }
            for (o, x) in out.iter_mut().zip(&acc) {
                *o = T::from_f64(if sum > 0.0 { x / sum } else { 0.0 });
            }
            *lse = if sum > 0.0 {
                max + sum.ln()
            } else {
                f64::NEG_INFINITY
            };
        });
}

/// The gradients of `q`, `k` and `v` from the output's gradient `grad_out`, the forward's
/// inputs, its output `out` and its `lse`, written into `dq`, `dk` and `dv` (shaped as `q`, `k`
/// and `v`).
fn backward<T: Element>(
    [q, k, v]: [&[T]; 3],
    out: &[T],
    grad_out: &[T],
    lse: &[f64],
    a: &Attend,
    [dq, dk, dv]: [&mut [T]; 3],
) {
    let d = a.dims;
    let (dim, v_dim, group) = (d.dim, d.v_dim, d.group());
    let q_rows = group * d.q_len;
    // One task per key/value head: it owns its keys' gradients and its query heads' rows.
    dq.par_chunks_mut((q_rows * dim).max(1))
        .zip(dk.par_chunks_mut((d.kv_len * dim).max(1)))
        .zip(dv.par_chunks_mut((d.kv_len * v_dim).max(1)))
        .enumerate()
        .for_each(|(kvh, ((dq, dk), dv))| {
            let kv = kvh * d.kv_len;
            let (mut gk, mut gv) = (vec![0.0f64; d.kv_len * dim], vec![0.0f64; d.kv_len * v_dim]);
            let mut gq = vec![0.0f64; dim];
            for r in 0..q_rows {
                let row = kvh * q_rows + r;
                let i = r % d.q_len;
                let (qi, doi) = (
                    &q[row * dim..(row + 1) * dim],
                    &grad_out[row * v_dim..(row + 1) * v_dim],
                );
                let oi = &out[row * v_dim..(row + 1) * v_dim];
                // D_i = rowsum(P ∘ dP) = dO_i · O_i.
                let delta = dot(doi, oi);
                gq.iter_mut().for_each(|x| *x = 0.0);
                for j in 0..d.visible(a.causal, i) {
                    let (kj, vj) = (
                        &k[(kv + j) * dim..(kv + j + 1) * dim],
                        &v[(kv + j) * v_dim..(kv + j + 1) * v_dim],
                    );
                    let p = (a.scale * dot(qi, kj) - lse[row]).exp();
                    let keep = keep(a, row, j);
                    let gvj = &mut gv[j * v_dim..(j + 1) * v_dim];
                    gvj.iter_mut()
                        .zip(doi)
                        .for_each(|(g, x)| *g += p * keep * x.to_f64());
                    let ds = p * (keep * dot(doi, vj) - delta) * a.scale;
                    gq.iter_mut()
                        .zip(kj)
                        .for_each(|(g, x)| *g += ds * x.to_f64());
                    let gkj = &mut gk[j * dim..(j + 1) * dim];
                    gkj.iter_mut()
                        .zip(qi)
                        .for_each(|(g, x)| *g += ds * x.to_f64());
                }
                for (o, g) in dq[r * dim..(r + 1) * dim].iter_mut().zip(&gq) {
                    *o = T::from_f64(*g);
                }
            }
            dk.iter_mut()
                .zip(&gk)
                .for_each(|(o, g)| *o = T::from_f64(*g));
            dv.iter_mut()
                .zip(&gv)
                .for_each(|(o, g)| *o = T::from_f64(*g));
        });
}

/// The elements of an operand, contiguous, in order.
fn elements<T: Element>(x: &Operand<'_>) -> Result<Vec<T>> {
    read_elements::<T>(&dense(x)?.operand())
}

/// `values` as a host array of `shape` in `dtype`'s statistics dtype.
fn statistics(dtype: ferry_memory::DType, values: &[f64], shape: &[usize]) -> Result<Dense> {
    const OP: &str = "scaled_dot_product_attention";
    float_dispatch!(stats_dtype(dtype), OP, |S| build::<S>(OP, shape, |out| {
        out.iter_mut()
            .zip(values)
            .for_each(|(o, &v)| *o = S::from_f64(v))
    }))
}

impl Attention for Cpu {
    fn attention(
        &self,
        q: &Operand<'_>,
        k: &Operand<'_>,
        v: &Operand<'_>,
        how: &Attend,
    ) -> Result<Option<(Dense, Dense)>> {
        const OP: &str = "scaled_dot_product_attention";
        let d = how.dims;
        let rows = [d.batch, d.heads, d.q_len];
        let mut lse = vec![0.0f64; rows.iter().product()];
        let out = float_dispatch!(q.dtype(), OP, |T| {
            let (qs, ks, vs) = (elements::<T>(q)?, elements::<T>(k)?, elements::<T>(v)?);
            build::<T>(OP, &[d.batch, d.heads, d.q_len, d.v_dim], |out| {
                forward(&qs, &ks, &vs, how, out, &mut lse)
            })?
        });
        Ok(Some((out, statistics(q.dtype(), &lse, &rows)?)))
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
        const OP: &str = "scaled_dot_product_attention backward";
        let lse = float_dispatch!(lse.dtype(), OP, |S| elements::<S>(lse)?
            .into_iter()
            .map(S::to_f64)
            .collect::<Vec<f64>>());
        let grads = float_dispatch!(q.dtype(), OP, |T| {
            let (qs, ks, vs) = (elements::<T>(q)?, elements::<T>(k)?, elements::<T>(v)?);
            let (os, gs) = (elements::<T>(out)?, elements::<T>(g)?);
            let zero = T::from_f64(0.0);
            let (mut dq, mut dk, mut dv) = (
                vec![zero; qs.len()],
                vec![zero; ks.len()],
                vec![zero; vs.len()],
            );
            backward(
                [&qs, &ks, &vs],
                &os,
                &gs,
                &lse,
                how,
                [&mut dq, &mut dk, &mut dv],
            );
            let dense = |x: &Operand<'_>, values: Vec<T>| {
                build::<T>(OP, x.shape(), |o| o.copy_from_slice(&values))
            };
            [dense(q, dq)?, dense(k, dk)?, dense(v, dv)?]
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

    fn values(n: usize, salt: u64) -> Vec<f64> {
        (0..n)
            .map(|i| uniform(salt, i as u64) * 2.0 - 1.0)
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
        forward(q, k, v, &Attend { dims: d, ..a }, &mut out, &mut lse);
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
        let x = inputs(DIMS);
        for causal in [false, true] {
            for dropout in [0.0, 0.3] {
                let a = attend(causal, dropout);
                let (out, lse) = run(DIMS, a, &x);
                let (want, want_lse) = direct(DIMS, a, &x);
                close(&out, &want, 1e-12);
                close(&lse, &want_lse, 1e-12);
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
                backward([&x[0], &x[1], &x[2]], &out, &w, &lse, &how, [gq, gk, gv]);
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
