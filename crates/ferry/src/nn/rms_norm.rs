//! Root-mean-square normalization as a module.

use ferry_tensor::{DType, Device, Result, Tensor, TensorError};

use super::Module;

/// Scales each input by the reciprocal root mean square of its last axis, then by a learned
/// `weight` (ones at first, no bias): `weight * x / sqrt(mean(x²) + eps)`, as transformers'
/// `LlamaRMSNorm` and PyTorch's `nn.RMSNorm` compute it. The statistic is taken in `f32` for
/// half-precision inputs, whose normalized values are rounded back to the input's dtype before
/// the weight multiplies them (transformers' order, so bf16 models agree with it bit for bit
/// where the ops do). The parameter is named `weight`. One fused op
/// ([`Tensor::rms_norm`]) whose node keeps the input and one statistic per row.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    /// An `f32` layer over a last axis of `features`, on `device`.
    pub fn new(features: usize, eps: f64, device: Device) -> Result<Self> {
        Self::from_weight(Tensor::ones(&[features], DType::F32, device)?, eps)
    }

    /// A layer over a given `[features]` weight, made a leaf that requires grad.
    pub fn from_weight(weight: Tensor, eps: f64) -> Result<Self> {
        if weight.ndim() != 1 || eps.is_nan() || eps < 0.0 {
            return Err(TensorError::InvalidArgument {
                op: "RmsNorm",
                message: format!(
                    "the weight must be [features] and eps at least 0; got shape {:?}, eps {eps}",
                    weight.shape()
                ),
            });
        }
        Ok(Self {
            weight: weight.detach().with_grad()?,
            eps,
        })
    }

    /// The scale, `[features]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The term added to the mean square.
    pub fn eps(&self) -> f64 {
        self.eps
    }
}

impl Module for RmsNorm {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        let features = self.weight.shape()[0];
        if input.shape().last() != Some(&features) {
            return Err(TensorError::InvalidArgument {
                op: "RmsNorm",
                message: format!(
                    "the input's last axis must have {features} features, got shape {:?}",
                    input.shape()
                ),
            });
        }
        let weight = if self.weight.dtype() == input.dtype() {
            self.weight.clone()
        } else {
            self.weight.to_dtype(input.dtype())?
        };
        input.rms_norm(Some(&weight), self.eps)
    }

    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        f(format!("{prefix}weight"), &self.weight);
    }

    fn visit_parameters_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(String, &mut Tensor) -> Result<()>,
    ) -> Result<()> {
        f(format!("{prefix}weight"), &mut self.weight)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_divides_by_the_root_mean_square_then_scales() {
        let x = Tensor::from_vec(vec![3.0f64, 4.0, 0.0, 1.0, -1.0, 1.0], &[2, 3]).unwrap();
        let weight = Tensor::from_vec(vec![1.0f64, 2.0, 0.5], &[3]).unwrap();
        let norm = RmsNorm::from_weight(weight, 1e-6).unwrap();
        let y = norm.forward(&x).unwrap().to_vec::<f64>().unwrap();
        let rms = [
            ((9.0 + 16.0) / 3.0 + 1e-6f64).sqrt(),
            (1.0 + 1e-6f64).sqrt(),
        ];
        let want = [
            3.0 / rms[0],
            8.0 / rms[0],
            0.0,
            1.0 / rms[1],
            -2.0 / rms[1],
            0.5 / rms[1],
        ];
        for (y, w) in y.iter().zip(want) {
            assert!((y - w).abs() < 1e-12, "{y} vs {w}");
        }
        let names: Vec<String> = norm
            .named_parameters()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(names, ["weight"]);
    }

    #[test]
    fn its_gradients_are_right() {
        ferry_tensor::manual_seed(5);
        let x = Tensor::randn(&[3, 4], DType::F64, Device::Cpu).unwrap();
        let w = Tensor::randn(&[4], DType::F64, Device::Cpu).unwrap();
        let norm = RmsNorm::from_weight(w.clone(), 1e-5).unwrap();
        let mismatches = ferry_tensor::gradcheck::gradcheck(
            |t| norm.forward(&t[0]),
            std::slice::from_ref(&x),
            ferry_tensor::gradcheck::GradcheckOptions::default(),
        )
        .unwrap();
        assert!(mismatches.is_empty(), "{mismatches:?}");
        // d sum(y) / d weight[j] = sum over rows of the normalized x[.., j] (a fresh layer: the
        // gradcheck's passes added into the first one's weight).
        let norm = RmsNorm::from_weight(w, 1e-5).unwrap();
        norm.forward(&x).unwrap().sum().unwrap().backward().unwrap();
        let unit = RmsNorm::from_weight(Tensor::ones(&[4], DType::F64, Device::Cpu).unwrap(), 1e-5)
            .unwrap()
            .forward(&x)
            .unwrap()
            .sum_axis(0, false)
            .unwrap()
            .to_vec::<f64>()
            .unwrap();
        let grad = norm.weight().grad().unwrap().to_vec::<f64>().unwrap();
        for (g, u) in grad.iter().zip(&unit) {
            assert!((g - u).abs() < 1e-12, "{grad:?} vs {unit:?}");
        }
    }

    #[test]
    fn a_bf16_input_is_normalized_in_f32_and_keeps_its_dtype() {
        let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[1, 4])
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let norm = RmsNorm::new(4, 1e-6, Device::Cpu).unwrap();
        let y = norm.forward(&x).unwrap();
        assert_eq!(y.dtype(), DType::BF16);
        let rms = (30.0f64 / 4.0).sqrt();
        let got = y.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap();
        for (i, g) in got.iter().enumerate() {
            assert!((g - (i + 1) as f64 / rms).abs() < 1e-2, "{got:?}");
        }
    }

    #[test]
    fn a_wrong_width_is_an_error_naming_it() {
        let norm = RmsNorm::new(4, 1e-6, Device::Cpu).unwrap();
        let x = Tensor::zeros(&[2, 3], DType::F32, Device::Cpu).unwrap();
        let err = norm.forward(&x).unwrap_err().to_string();
        assert!(err.contains("4 features"), "{err}");
    }
}
