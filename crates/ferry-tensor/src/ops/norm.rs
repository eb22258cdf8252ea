//! Layer normalization and RMSNorm: fused forward and backward kernels on both devices, with
//! their gradient rules in `rules::norm`.
//!
//! The forward keeps, per row, the mean and `1 / sqrt(var + eps)` (f32 for f32, f16 and bf16
//! inputs; f64 for f64), as one `[rows, 2]` auxiliary tensor; the node saves that, the input `x`
//! and (when `x` wants a gradient) the weight, which is a parameter held anyway. The backward is
//! one fused pass for `dx` plus a column reduction for the weight and bias gradients. Under
//! `create_graph` the rule computes the same gradients with differentiable tensor ops instead,
//! so second derivatives flow. RMSNorm follows the same plan with one inverse root mean square
//! per row (`[rows]`) in place of the two statistics, and no bias.

use crate::autograd::{Save, record};
use crate::{Result, Tensor, TensorError, backend, rules};

impl Tensor {
    /// Normalizes over the trailing `normalized_shape` dimensions (usually `[features]`, the last
    /// axis): `y = (x - mean) / sqrt(var + eps) * weight + bias`, with the biased variance of
    /// each row. `weight` and `bias` (optional, each of shape `normalized_shape`) have `self`'s
    /// dtype and device. Float dtypes; statistics accumulate in f32 (f64 for f64 tensors).
    pub fn layer_norm(
        &self,
        normalized_shape: &[usize],
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        const OP: &str = "layer_norm";
        if let Some([Some(x), w, b]) = crate::autocast::norm_in_f32(self, weight, bias)? {
            return x.layer_norm(normalized_shape, w.as_ref(), b.as_ref(), eps);
        }
        let nd = normalized_shape.len();
        if nd == 0 || nd > self.ndim() || self.shape()[self.ndim() - nd..] != *normalized_shape {
            return Err(TensorError::InvalidArgument {
                op: OP,
                message: format!(
                    "normalized_shape {normalized_shape:?} must be the trailing dimensions of the \
                     input, shape {:?}; pass e.g. `&[{}]` to normalize over the last axis",
                    self.shape(),
                    self.shape().last().copied().unwrap_or(0)
                ),
            });
        }
        let cols: usize = normalized_shape.iter().product();
        if cols == 0 {
            return Err(TensorError::InvalidArgument {
                op: OP,
                message: "cannot normalize over zero elements: normalized_shape has a 0".into(),
            });
        }
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(TensorError::InvalidArgument {
                op: OP,
                message: format!("eps must be finite and >= 0, got {eps}; 1e-5 is usual"),
            });
        }
        if !self.dtype().is_float() {
            return Err(TensorError::UnsupportedDType {
                op: OP,
                dtype: self.dtype(),
                hint: "only float dtypes normalize; cast with `.to_dtype(DType::F32)`",
            });
        }
        for p in [weight, bias].into_iter().flatten() {
            self.same_kind(OP, p)?;
            if p.shape() != normalized_shape {
                return Err(TensorError::ShapeMismatch {
                    op: OP,
                    lhs: normalized_shape.into(),
                    rhs: p.dims(),
                    hint: "weight and bias must have the shape of normalized_shape",
                });
            }
        }
        let rows = self.numel() / cols;
        let x = self.reshape(&[rows, cols])?;
        let w = weight.map(|w| w.reshape(&[cols])).transpose()?;
        let b = bias.map(|b| b.reshape(&[cols])).transpose()?;
        let (y, stats) = backend::layer_norm(&x, w.as_ref(), b.as_ref(), eps)?;
        let mut inputs = vec![&x];
        inputs.extend(w.as_ref());
        inputs.extend(b.as_ref());
        let (has_w, has_b) = (w.is_some(), b.is_some());
        let x_grad = x.requires_grad();
        let w_grad = w.as_ref().is_some_and(Tensor::requires_grad);
        let y = record(y, OP, &inputs, || {
            let save = Save::input_if(0, x_grad || w_grad).and(Save::input_if(1, has_w && x_grad));
            rules::layer_norm(save, eps, (has_w, has_b), stats)
        });
        y.reshape(self.shape())
    }

    /// Root-mean-square normalization over the last axis: `y = x / sqrt(mean(x²) + eps) *
    /// weight`, as PyTorch's `rms_norm` and transformers' `LlamaRMSNorm`. `weight` (optional,
    /// `[features]`) has `self`'s dtype and device. Float dtypes; the statistic is taken in f32
    /// (f64 for f64 tensors), and for f16 and bf16 inputs the normalized value is rounded to the
    /// input's dtype before the weight multiplies it (transformers' order).
    ///
    /// The node keeps `x`, the weight (when `x` wants a gradient) and one inverse root mean
    /// square per row, never a normalized copy.
    pub fn rms_norm(&self, weight: Option<&Tensor>, eps: f64) -> Result<Tensor> {
        const OP: &str = "rms_norm";
        if let Some([Some(x), w, _]) = crate::autocast::norm_in_f32(self, weight, None)? {
            return x.rms_norm(w.as_ref(), eps);
        }
        let Some(&cols) = self.shape().last() else {
            return Err(TensorError::InvalidArgument {
                op: OP,
                message:
                    "a 0-dimensional tensor has no last axis to normalize; reshape it to `[1]` \
                          first"
                        .into(),
            });
        };
        if cols == 0 {
            return Err(TensorError::InvalidArgument {
                op: OP,
                message: format!(
                    "cannot normalize over zero elements: the last axis of shape {:?} is 0",
                    self.shape()
                ),
            });
        }
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(TensorError::InvalidArgument {
                op: OP,
                message: format!("eps must be finite and >= 0, got {eps}; 1e-6 is usual"),
            });
        }
        if !self.dtype().is_float() {
            return Err(TensorError::UnsupportedDType {
                op: OP,
                dtype: self.dtype(),
                hint: "only float dtypes normalize; cast with `.to_dtype(DType::F32)`",
            });
        }
        if let Some(w) = weight {
            self.same_kind(OP, w)?;
            if w.shape() != [cols] {
                return Err(TensorError::ShapeMismatch {
                    op: OP,
                    lhs: self.dims(),
                    rhs: w.dims(),
                    hint: "the weight must be [features], the input's last axis",
                });
            }
        }
        let rows = self.numel() / cols;
        let x = self.reshape(&[rows, cols])?;
        let (y, rstd) = backend::rms_norm(&x, weight, eps)?;
        let mut inputs = vec![&x];
        inputs.extend(weight);
        let has_w = weight.is_some();
        let x_grad = x.requires_grad();
        let w_grad = weight.is_some_and(Tensor::requires_grad);
        let y = record(y, OP, &inputs, || {
            let save = Save::input_if(0, x_grad || w_grad).and(Save::input_if(1, has_w && x_grad));
            rules::rms_norm(save, eps, has_w, rstd)
        });
        y.reshape(self.shape())
    }
}
