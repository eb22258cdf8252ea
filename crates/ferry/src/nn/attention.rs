//! Scaled dot-product attention, with an optional causal mask.

use ferry_tensor::{AttentionOptions, Result, Tensor};

/// `softmax(q kᵀ / sqrt(d) + mask) v` over the last two axes: `q` is `[.., Tq, d]`, `k`
/// `[.., Tk, d]`, `v` `[.., Tk, dv]`, leading axes broadcast (batch, heads); the result is
/// `[.., Tq, dv]`. With `causal`, query `i` attends to keys `0..=i + (Tk - Tq)` only (the
/// queries are the last `Tq` positions of the keys' sequence), as in a decoder. With three or
/// more axes, `k` and `v` may have fewer heads (axis -3) than `q`, each serving a group of
/// query heads (grouped-query attention).
///
/// One op, [`Tensor::scaled_dot_product_attention`] (which also takes a scale and dropout): its
/// node keeps `q`, `k`, `v`, the output and a log-sum-exp per query row, never the `Tq x Tk`
/// weights, which backward recomputes.
pub fn scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
) -> Result<Tensor> {
    let options = AttentionOptions {
        causal,
        ..AttentionOptions::default()
    };
    q.scaled_dot_product_attention(k, v, options)
}

#[cfg(test)]
mod tests {
    use ferry_tensor::{DType, Device, gradcheck};

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
    fn grouped_heads_dropout_and_bad_options_through_the_op() {
        use ferry_tensor::AttentionOptions;
        ferry_tensor::manual_seed(6);
        let r = |s: &[usize]| Tensor::randn(s, DType::F32, Device::Cpu).unwrap();
        let (q, k, v) = (r(&[1, 4, 3, 8]), r(&[1, 2, 3, 8]), r(&[1, 2, 3, 8]));
        let plain = scaled_dot_product_attention(&q, &k, &v, false).unwrap();
        assert_eq!(plain.shape(), &[1, 4, 3, 8]);
        let dropped = |seed| {
            ferry_tensor::manual_seed(seed);
            let options = AttentionOptions {
                dropout: 0.5,
                ..AttentionOptions::default()
            };
            q.scaled_dot_product_attention(&k, &v, options)
                .unwrap()
                .to_vec::<f32>()
                .unwrap()
        };
        assert_eq!(dropped(1), dropped(1));
        assert_ne!(dropped(1), plain.to_vec::<f32>().unwrap());
        let three = r(&[1, 3, 3, 8]);
        let err = scaled_dot_product_attention(&q, &three, &three, false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("dividing q's"), "{err}");
        let options = AttentionOptions {
            dropout: 1.0,
            ..AttentionOptions::default()
        };
        let err = q
            .scaled_dot_product_attention(&k, &v, options)
            .unwrap_err()
            .to_string();
        assert!(err.contains("[0, 1)"), "{err}");
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
