//! Scaled dot-product attention, with an optional causal mask.

use ferry_tensor::{DType, Result, Tensor, TensorError};

/// `softmax(q kᵀ / sqrt(d) + mask) v` over the last two axes: `q` is `[.., Tq, d]`, `k`
/// `[.., Tk, d]`, `v` `[.., Tk, dv]`, leading axes broadcast (batch, heads); the result is
/// `[.., Tq, dv]`. With `causal`, query `i` attends to keys `0..=i + (Tk - Tq)` only (the
/// queries are the last `Tq` positions of the keys' sequence), as in a decoder.
///
/// Built from matmul, masked_fill and softmax, so its gradient flows to `q`, `k` and `v`
/// through theirs; the softmax keeps its output for backward, the matmuls their inputs.
pub fn scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
) -> Result<Tensor> {
    const OP: &str = "scaled_dot_product_attention";
    let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
    if qs.len() < 2 || ks.len() < 2 || vs.len() < 2 {
        return Err(TensorError::InvalidArgument {
            op: OP,
            message: format!(
                "q, k and v need at least two axes ([.., T, d]); got {qs:?}, {ks:?}, {vs:?}"
            ),
        });
    }
    let (tq, d) = (qs[qs.len() - 2], qs[qs.len() - 1]);
    let (tk, dk) = (ks[ks.len() - 2], ks[ks.len() - 1]);
    if d != dk || vs[vs.len() - 2] != tk {
        return Err(TensorError::InvalidArgument {
            op: OP,
            message: format!(
                "q [.., Tq, d] and k [.., Tk, d] must share d, and v must have Tk rows; got \
                 q {qs:?}, k {ks:?}, v {vs:?}"
            ),
        });
    }
    if causal && tq > tk {
        return Err(TensorError::InvalidArgument {
            op: OP,
            message: format!("a causal mask needs Tq <= Tk; got Tq {tq}, Tk {tk}"),
        });
    }
    let nd = ks.len();
    let scores = q
        .matmul(&k.transpose(nd as isize - 2, nd as isize - 1)?)?
        .mul_scalar(1.0 / (d as f64).sqrt())?;
    let scores = if causal {
        scores.masked_fill(&causal_mask(tq, tk, q)?, f64::NEG_INFINITY)?
    } else {
        scores
    };
    scores.softmax(-1)?.matmul(v)
}

/// `[Tq, Tk]`, true where query `i` may not see key `j` (`j > i + Tk - Tq`), on `like`'s device.
fn causal_mask(tq: usize, tk: usize, like: &Tensor) -> Result<Tensor> {
    let device = like.device();
    let rows = Tensor::arange(0.0, tq as f64, DType::F32, device)?
        .add_scalar((tk - tq) as f64)?
        .reshape(&[tq, 1])?;
    let cols = Tensor::arange(0.0, tk as f64, DType::F32, device)?.reshape(&[1, tk])?;
    cols.gt(&rows)
}

#[cfg(test)]
mod tests {
    use ferry_tensor::{Device, gradcheck};

    use super::*;

    #[test]
    fn causal_attention_sees_only_the_past_and_matches_a_direct_computation() {
        ferry_tensor::manual_seed(3);
        let q = Tensor::randn(&[2, 4, 3], DType::F64, Device::Cpu).unwrap();
        let k = Tensor::randn(&[2, 4, 3], DType::F64, Device::Cpu).unwrap();
        let v = Tensor::randn(&[2, 4, 5], DType::F64, Device::Cpu).unwrap();
        let out = scaled_dot_product_attention(&q, &k, &v, true).unwrap();
        assert_eq!(out.shape(), &[2, 4, 5]);
        let (qv, kv, vv) = (
            q.to_vec_f64().unwrap(),
            k.to_vec_f64().unwrap(),
            v.to_vec_f64().unwrap(),
        );
        let got = out.to_vec_f64().unwrap();
        for b in 0..2 {
            for i in 0..4 {
                let score = |j: usize| {
                    (0..3)
                        .map(|c| qv[(b * 4 + i) * 3 + c] * kv[(b * 4 + j) * 3 + c])
                        .sum::<f64>()
                        / 3f64.sqrt()
                };
                let weights: Vec<f64> = (0..=i).map(|j| score(j).exp()).collect();
                let total: f64 = weights.iter().sum();
                for c in 0..5 {
                    let want: f64 = (0..=i)
                        .map(|j| weights[j] / total * vv[(b * 4 + j) * 5 + c])
                        .sum();
                    let have = got[(b * 4 + i) * 5 + c];
                    assert!((want - have).abs() < 1e-12, "{want} vs {have}");
                }
            }
        }
    }

    #[test]
    fn its_gradients_pass_gradcheck_with_and_without_the_mask() {
        ferry_tensor::manual_seed(4);
        for causal in [false, true] {
            let q = Tensor::randn(&[2, 3, 4], DType::F64, Device::Cpu).unwrap();
            let k = Tensor::randn(&[2, 5, 4], DType::F64, Device::Cpu).unwrap();
            let v = Tensor::randn(&[2, 5, 2], DType::F64, Device::Cpu).unwrap();
            let mismatches = gradcheck::gradcheck(
                |x| scaled_dot_product_attention(&x[0], &x[1], &x[2], causal),
                &[q, k, v],
                gradcheck::GradcheckOptions::default(),
            )
            .unwrap();
            assert!(mismatches.is_empty(), "causal {causal}: {mismatches:?}");
        }
    }

    #[test]
    fn mismatched_shapes_are_errors_that_say_what_fits() {
        let t = |s: &[usize]| Tensor::zeros(s, DType::F32, Device::Cpu).unwrap();
        let err =
            scaled_dot_product_attention(&t(&[2, 3, 4]), &t(&[2, 3, 5]), &t(&[2, 3, 4]), false)
                .unwrap_err()
                .to_string();
        assert!(err.contains("share d"), "{err}");
        let err =
            scaled_dot_product_attention(&t(&[2, 6, 4]), &t(&[2, 3, 4]), &t(&[2, 3, 4]), true)
                .unwrap_err()
                .to_string();
        assert!(err.contains("Tq <= Tk"), "{err}");
    }
}
