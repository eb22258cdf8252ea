//! Layer normalization: fused forward and backward kernels on both devices, with its gradient
//! rule here beside it.
//!
//! The forward keeps, per row, the mean and `1 / sqrt(var + eps)` (f32 for f32, f16 and bf16
//! inputs; f64 for f64), as one `[rows, 2]` auxiliary tensor; the node saves that, the input `x`
//! and (when `x` wants a gradient) the weight, which is a parameter held anyway. The backward is
//! one fused pass for `dx` plus a column reduction for the weight and bias gradients. Under
//! `create_graph` the rule computes the same gradients with differentiable tensor ops instead,
//! so second derivatives flow.

use ferry_graph::InputGrads;
use ferry_memory::DType;

use crate::autograd::{Rule, Save, Saved, record, should_record};
use crate::{Result, Tensor, TensorError, backend};

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
            Rule::new(save, (eps, (has_w, has_b)), layer_norm_backward).with_aux(stats)
        });
        y.reshape(self.shape())
    }
}

/// The gradients of layer_norm's inputs, in their order (x, then weight and bias if present).
fn layer_norm_backward(
    saved: &Saved<'_>,
    &(eps, (has_w, has_b)): &(f64, (bool, bool)),
    g: &Tensor,
    wanted: &[bool],
) -> Result<InputGrads<Tensor>> {
    let want_dx = wanted[0];
    let want_dw = has_w && wanted[1];
    let want_db = has_b && wanted[1 + has_w as usize];
    let x = if want_dx || want_dw {
        Some(saved.input(0)?)
    } else {
        None
    };
    let w = if has_w && want_dx {
        Some(saved.input(1)?)
    } else {
        None
    };
    let mut parts = vec![g];
    parts.extend(x.as_ref());
    parts.extend(w.as_ref());
    let (dx, dw, db) = if should_record(&parts) {
        // create_graph: differentiable ops, recomputing the statistics from x.
        composed_backward(g, x.as_ref(), w.as_ref(), eps, want_dx, want_dw, want_db)?
    } else if let Some(x) = &x {
        let stats = saved.aux()?;
        let want = [want_dx, want_dw, want_db];
        backend::layer_norm_backward(g, x, w.as_ref(), &stats, want)?
    } else {
        // Only the bias wants a gradient: a column sum of g.
        (
            None,
            None,
            want_db.then(|| g.sum_axis(0, false)).transpose()?,
        )
    };
    let mut grads = InputGrads::new();
    grads.push(dx);
    if has_w {
        grads.push(dw);
    }
    if has_b {
        grads.push(db);
    }
    Ok(grads)
}

type Grads = (Option<Tensor>, Option<Tensor>, Option<Tensor>);

/// The same gradients as the fused kernels, from tensor ops (recorded under `create_graph`).
fn composed_backward(
    g: &Tensor,
    x: Option<&Tensor>,
    w: Option<&Tensor>,
    eps: f64,
    want_dx: bool,
    want_dw: bool,
    want_db: bool,
) -> Result<Grads> {
    let db = if want_db {
        Some(g.sum_axis(0, false)?)
    } else {
        None
    };
    let Some(x) = x else {
        return Ok((None, None, db));
    };
    let cols = x.shape()[1] as f64;
    let xc = x.sub(&x.mean_axis(-1, true)?)?;
    let var = xc.mul(&xc)?.sum_axis(-1, true)?.div_scalar(cols)?;
    let rstd = var.add_scalar(eps)?.powf(-0.5)?;
    let xhat = xc.mul(&rstd)?;
    let dw = if want_dw {
        Some(g.mul(&xhat)?.sum_axis(0, false)?)
    } else {
        None
    };
    let dx = if want_dx {
        let gw = match w {
            Some(w) => g.mul(w)?,
            None => g.clone(),
        };
        let m1 = gw.mean_axis(-1, true)?;
        let m2 = gw.mul(&xhat)?.mean_axis(-1, true)?;
        Some(rstd.mul(&gw.sub(&m1)?.sub(&xhat.mul(&m2)?)?)?)
    } else {
        None
    };
    Ok((dx, dw, db))
}

/// The dtype the statistics are kept in for a tensor of `dtype`.
pub(crate) fn stats_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}
