//! Gradient clipping: by the global L2 norm of all gradients, or by value.
//!
//! Both work on the gradients where they are: the norm is reduced on the gradients' device
//! and read back once (one read per device the gradients live on: one for a model on one
//! device), the scaling is a device op. Parameters without a gradient are skipped.
//!
//! Key decision: a clipped gradient is replaced by its scaled copy
//! ([`Tensor::set_grad`]) rather than overwritten element by element. One gradient tensor can
//! be handed to two leaves (the gradient of `a + b` reaches `a` and `b` as the same tensor),
//! and writing into it would scale it twice. The parameter's `.grad()` afterwards is the
//! clipped one, exactly as if it had been scaled in place.
//!
//! ```
//! use ferry::optim::clip_grad_norm;
//! use ferry::prelude::*;
//!
//! let w = Tensor::from_slice(&[1.0f32, 1.0], &[2])?.with_grad()?;
//! w.mul_scalar(3.0)?.sum()?.backward()?; // grad [3, 3] (norm 3·√2)
//! let total = clip_grad_norm([&w], 1.0)?;
//! assert!((total - 3.0 * 2f64.sqrt()).abs() < 1e-6);
//! let g = w.grad().unwrap().to_vec::<f32>()?;
//! assert!((g[0] - 0.5f32.sqrt()).abs() < 1e-6); // scaled to norm 1
//! # Ok::<(), ferry::TensorError>(())
//! ```

use std::borrow::Borrow;

use ferry_tensor::{DType, Device, Result, Tensor, TensorError};

/// How [`clip_grad_norm_with`] treats a norm that is not finite.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ClipOptions {
    /// Return an error (naming the cause) when the total norm is infinite or NaN, instead of
    /// returning that norm. Either way the gradients are left as they are.
    pub error_if_nonfinite: bool,
}

/// Scales all gradients together so that their global L2 norm (over every element of every
/// gradient) is at most `max_norm`, and returns the norm they had before. Gradients are left
/// as they are when the norm is at most `max_norm`, and when it is not finite (check the
/// returned value with `is_finite()`, or use [`clip_grad_norm_with`] to make that an error).
/// Above it, each gradient is multiplied by `max_norm / (norm + 1e-6)`.
pub fn clip_grad_norm<T: Borrow<Tensor>>(
    params: impl IntoIterator<Item = T>,
    max_norm: f64,
) -> Result<f64> {
    clip_grad_norm_with(params, max_norm, ClipOptions::default())
}

/// [`clip_grad_norm`] with options.
pub fn clip_grad_norm_with<T: Borrow<Tensor>>(
    params: impl IntoIterator<Item = T>,
    max_norm: f64,
    options: ClipOptions,
) -> Result<f64> {
    if !(max_norm.is_finite() && max_norm > 0.0) {
        return Err(TensorError::InvalidArgument {
            op: "clip_grad_norm",
            message: format!(
                "max_norm is {max_norm}; gradients are scaled down to this norm, so give a finite number above 0 (1.0 is common)"
            ),
        });
    }
    let params: Vec<T> = params.into_iter().collect();
    let _no_grad = ferry_tensor::no_grad();
    let total = grad_norm(params.iter().map(Borrow::borrow))?;
    if !total.is_finite() {
        if options.error_if_nonfinite {
            return Err(TensorError::InvalidArgument {
                op: "clip_grad_norm",
                message: format!(
                    "the gradients' total norm is {total}: some gradient holds an infinity or a NaN, so no scaling can clip it; skip this step (a GradScaler does so for f16 training), lower the learning rate, or find the op that overflowed with ferry::debug"
                ),
            });
        }
        return Ok(total);
    }
    let coef = max_norm / (total + 1e-6);
    if coef < 1.0 {
        for p in &params {
            let p = p.borrow();
            if let Some(g) = p.grad() {
                p.set_grad(Some(g.mul_scalar(coef)?));
            }
        }
    }
    Ok(total)
}

/// The global L2 norm of the parameters' gradients (parameters without one count as zero),
/// computed on the gradients' device in `f32` (`f64` where a gradient is `f64`) and read back
/// once per device. No gradient is changed.
pub fn grad_norm<T: Borrow<Tensor>>(params: impl IntoIterator<Item = T>) -> Result<f64> {
    let _no_grad = ferry_tensor::no_grad();
    // Gradients grouped by device, in the order the devices are first seen.
    let mut groups: Vec<(Device, Vec<Tensor>)> = Vec::new();
    for p in params {
        let Some(g) = p.borrow().grad() else { continue };
        if !g.dtype().is_float() {
            return Err(TensorError::UnsupportedDType {
                op: "clip_grad_norm",
                dtype: g.dtype(),
                hint: "gradients are floats; a parameter with an integer gradient was set by hand, fix its set_grad",
            });
        }
        match groups.iter_mut().find(|(d, _)| *d == g.device()) {
            Some((_, grads)) => grads.push(g),
            None => groups.push((g.device(), vec![g])),
        }
    }
    let mut squares = 0.0;
    for (_, grads) in &groups {
        squares += squared_sum(grads)?.item()?;
    }
    Ok(squares.sqrt())
}

/// `Σ g²` over every element of `grads` (all on one device), as a 0-dimensional tensor on that
/// device: one square-and-sum per gradient, the partial sums gathered and summed.
fn squared_sum(grads: &[Tensor]) -> Result<Tensor> {
    let acc = if grads.iter().any(|g| g.dtype() == DType::F64) {
        DType::F64
    } else {
        DType::F32
    };
    let partial = grads
        .iter()
        .map(|g| {
            let g = g.to_dtype(if g.dtype() == DType::F64 {
                DType::F64
            } else {
                DType::F32
            })?;
            g.mul(&g)?.sum()?.to_dtype(acc)?.reshape(&[1])
        })
        .collect::<Result<Vec<_>>>()?;
    match partial.as_slice() {
        [one] => one.sum(),
        many => Tensor::cat(&many.iter().collect::<Vec<_>>(), 0)?.sum(),
    }
}

/// Clamps every element of every gradient into `[-clip_value, clip_value]` (exactly: elements
/// inside are untouched, elements outside become the bound, infinities included). Each clamped
/// gradient replaces the old one, as in [`clip_grad_norm`].
pub fn clip_grad_value<T: Borrow<Tensor>>(
    params: impl IntoIterator<Item = T>,
    clip_value: f64,
) -> Result<()> {
    if !(clip_value.is_finite() && clip_value >= 0.0) {
        return Err(TensorError::InvalidArgument {
            op: "clip_grad_value",
            message: format!(
                "clip_value is {clip_value}; gradients are clamped into [-clip_value, clip_value], so give a finite number at least 0"
            ),
        });
    }
    let _no_grad = ferry_tensor::no_grad();
    for p in params {
        let p = p.borrow();
        if let Some(g) = p.grad() {
            // min(max(g, -c), c) = -max(-max(g, -c), -c).
            let low = max_scalar(&g, -clip_value)?;
            p.set_grad(Some(max_scalar(&low.neg()?, -clip_value)?.neg()?));
        }
    }
    Ok(())
}

/// `max(x, s)` elementwise, exactly: the larger of each element and `s`, picked by a max
/// reduction over `[x, s]` stacked on a new leading axis.
fn max_scalar(x: &Tensor, s: f64) -> Result<Tensor> {
    let bound = Tensor::full(x.shape(), s, x.dtype(), x.device())?;
    Tensor::cat(&[&x.unsqueeze(0)?, &bound.unsqueeze(0)?], 0)?.max_axis(0, false)
}

/// Multiplies each parameter's gradient by `factor` (replacing it by the scaled copy) and
/// returns whether any of them holds an infinity or a NaN: one sum per gradient, read back
/// once per device. What [`super::Optimizer::scale_grads`] does by default.
pub fn scale_grads<T: Borrow<Tensor>>(
    params: impl IntoIterator<Item = T>,
    factor: f64,
) -> Result<bool> {
    let _no_grad = ferry_tensor::no_grad();
    // One sum per gradient, gathered per device.
    let mut sums: Vec<(Device, Vec<Tensor>)> = Vec::new();
    for p in params {
        let p = p.borrow();
        let Some(g) = p.grad() else { continue };
        let g = g.mul_scalar(factor)?;
        let wide = match g.dtype() {
            DType::F64 => DType::F64,
            _ => DType::F32,
        };
        let s = g
            .to_dtype(wide)?
            .sum()?
            .to_dtype(DType::F64)?
            .reshape(&[1])?;
        p.set_grad(Some(g));
        match sums.iter_mut().find(|(d, _)| *d == s.device()) {
            Some((_, v)) => v.push(s),
            None => sums.push((s.device(), vec![s])),
        }
    }
    let mut found = false;
    for (_, parts) in &sums {
        let total = match parts.as_slice() {
            [one] => one.sum()?,
            many => Tensor::cat(&many.iter().collect::<Vec<_>>(), 0)?.sum()?,
        };
        found |= !total.item()?.is_finite();
    }
    Ok(found)
}
