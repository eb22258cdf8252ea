//! Smooth activations (GELU in both forms, SiLU), sine and cosine, clamping, and elementwise
//! maximum and minimum. Each is a row of the op table (`op`), so it runs as one kernel on every
//! device; the gradient rules sit in `rules` and use the fused backward rows declared next to
//! them (`silu_backward`, `gelu_backward`, `gelu_tanh_backward`, `max_share`).

use crate::op::{BinaryOp, UnaryOp};
use crate::{Result, Tensor, TensorError};

impl Tensor {
    /// Exact GELU, `x Φ(x) = x/2 (1 + erf(x/√2))`, with `Φ` the standard normal CDF.
    /// One kernel forward; the backward is one fused kernel from the saved input.
    pub fn gelu(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Gelu)
    }

    /// GELU's tanh approximation, `x/2 (1 + tanh(√(2/π) (x + 0.044715 x³)))` (the form GPT-2
    /// trained with). Saves its input.
    pub fn gelu_tanh(&self) -> Result<Tensor> {
        self.unary(UnaryOp::GeluTanh)
    }

    /// GELU in the form asked for: the tanh approximation when `approximate`, else exact.
    pub fn gelu_with(&self, approximate: bool) -> Result<Tensor> {
        if approximate {
            self.gelu_tanh()
        } else {
            self.gelu()
        }
    }

    /// SiLU (swish), `x σ(x)`. Saves its input; the backward is one fused kernel.
    pub fn silu(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Silu)
    }

    /// Sine, elementwise. Saves its input.
    pub fn sin(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Sin)
    }

    /// Cosine, elementwise. Saves its input.
    pub fn cos(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Cos)
    }

    /// `max(self, min)`: the gradient passes where `self >= min`, else 0. NaN stays NaN.
    pub fn clamp_min(&self, min: f64) -> Result<Tensor> {
        check_bound("clamp_min", "min", min)?;
        self.unary(UnaryOp::ClampMin(min))
    }

    /// `min(self, max)`: the gradient passes where `self <= max`, else 0. NaN stays NaN.
    pub fn clamp_max(&self, max: f64) -> Result<Tensor> {
        check_bound("clamp_max", "max", max)?;
        self.unary(UnaryOp::ClampMax(max))
    }

    /// Every element limited to `[min, max]`; the gradient is 1 where `min <= self <= max` and
    /// 0 outside. Records two nodes (clamp_min, clamp_max), each saving its input.
    pub fn clamp(&self, min: f64, max: f64) -> Result<Tensor> {
        check_bound("clamp", "min", min)?;
        check_bound("clamp", "max", max)?;
        if min > max {
            return Err(TensorError::InvalidArgument {
                op: "clamp",
                message: format!(
                    "min = {min} is above max = {max}; pass the bounds as (lower, upper)"
                ),
            });
        }
        self.clamp_min(min)?.clamp_max(max)
    }

    /// The larger of `self` and `rhs` elementwise, broadcasting; NaN if either is. The gradient
    /// goes to the larger input; on a tie each input gets half. Saves both inputs.
    pub fn maximum(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(rhs, BinaryOp::Maximum)
    }

    /// The smaller of `self` and `rhs` elementwise, broadcasting; NaN if either is. The
    /// gradient goes to the smaller input; on a tie each input gets half. Saves both inputs.
    pub fn minimum(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(rhs, BinaryOp::Minimum)
    }

    /// The share of maximum's gradient that reaches `self`: 1 where `self > rhs`, ½ on ties,
    /// else 0 (no gradient of its own).
    pub(crate) fn max_share(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(rhs, BinaryOp::MaxShare)
    }

    /// silu's backward from its input `x`: `self σ(x)(1 + x(1 - σ(x)))`.
    pub(crate) fn silu_backward(&self, x: &Tensor) -> Result<Tensor> {
        self.binary(x, BinaryOp::SiluBackward)
    }

    /// gelu's backward from its input `x`: `self (Φ(x) + x φ(x))`.
    pub(crate) fn gelu_backward(&self, x: &Tensor) -> Result<Tensor> {
        self.binary(x, BinaryOp::GeluBackward)
    }

    /// gelu_tanh's backward from its input `x`.
    pub(crate) fn gelu_tanh_backward(&self, x: &Tensor) -> Result<Tensor> {
        self.binary(x, BinaryOp::GeluTanhBackward)
    }
}

/// A clamp bound must be a number (infinities are allowed: no bound on that side).
fn check_bound(op: &'static str, which: &str, bound: f64) -> Result<()> {
    if bound.is_nan() {
        return Err(TensorError::InvalidArgument {
            op,
            message: format!(
                "{which} is NaN; pass a number (f64::INFINITY or NEG_INFINITY for no bound)"
            ),
        });
    }
    Ok(())
}
