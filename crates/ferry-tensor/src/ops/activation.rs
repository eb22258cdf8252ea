//! Smooth activations (GELU in both forms, SiLU), sine and cosine, clamping, and elementwise
//! maximum and minimum. Each is a row of the op table (`ops`), so it runs as one kernel on every
//! device; the gradient rules sit in `rules` and use the fused backward rows declared next to
//! them (`silu_backward`, `gelu_backward`, `gelu_tanh_backward`, `max_share`).
//!
//! The helpers here are the CPU functions those rows call and the second derivatives that
//! the backward rows' own rules need.

use ferry_memory::Element;
use num_traits::Float;

use crate::ops::{BinaryOp, UnaryOp};
use crate::{Result, Tensor, TensorError};

/// `√(2/π)`, the tanh approximation's scale.
const K: f64 = 0.797_884_560_802_865_4;
/// The tanh approximation's cubic coefficient.
const C: f64 = 0.044_715;
/// `1/√(2π)`, the standard normal density at 0.
const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// The error function, to double precision: `2/√π e^{-x²} Σ 2ⁿ x^{2n+1} / (1·3·…·(2n+1))`,
/// a series of positive terms (no cancellation) that converges for every `x`; beyond
/// `|x| = 6` erf is ±1 to within 2e-17.
pub(crate) fn erf(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    if x.abs() >= 6.0 {
        return x.signum();
    }
    let x2 = x * x;
    let (mut term, mut sum) = (x, x);
    let mut n = 0.0;
    loop {
        n += 1.0;
        term *= 2.0 * x2 / (2.0 * n + 1.0);
        sum += term;
        if term.abs() <= sum.abs() * 1e-17 {
            break;
        }
    }
    2.0 / std::f64::consts::PI.sqrt() * (-x2).exp() * sum
}

fn to_f64<T: Element>(v: T) -> f64 {
    <T as Element>::to_f64(v)
}

fn from_f64<T: Element>(v: f64) -> T {
    <T as Element>::from_f64(v)
}

/// GELU's tanh form on the CPU, computed in `f64` for every element type.
pub(crate) fn gelu_tanh_cpu<T: Element>(v: T) -> T {
    let x = to_f64(v);
    from_f64(0.5 * x * (1.0 + (K * (x + C * x * x * x)).tanh()))
}

/// Exact GELU on the CPU.
pub(crate) fn gelu_erf_cpu<T: Element>(v: T) -> T {
    let x = to_f64(v);
    from_f64(0.5 * x * (1.0 + erf(x * std::f64::consts::FRAC_1_SQRT_2)))
}

/// d/dx of the tanh form: `½(1 + t) + ½ x (1 - t²) u'` with `u = K(x + C x³)`, `t = tanh u`.
fn gelu_tanh_slope(x: f64) -> f64 {
    let t = (K * (x + C * x * x * x)).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * K * (1.0 + 3.0 * C * x * x)
}

/// d/dx of exact GELU: `Φ(x) + x φ(x)`.
fn gelu_erf_slope(x: f64) -> f64 {
    0.5 * (1.0 + erf(x * std::f64::consts::FRAC_1_SQRT_2)) + x * INV_SQRT_2PI * (-0.5 * x * x).exp()
}

pub(crate) fn gelu_tanh_backward_cpu<T: Element>(g: T, x: T) -> T {
    from_f64(to_f64(g) * gelu_tanh_slope(to_f64(x)))
}

pub(crate) fn gelu_erf_backward_cpu<T: Element>(g: T, x: T) -> T {
    from_f64(to_f64(g) * gelu_erf_slope(to_f64(x)))
}

pub(crate) fn silu_backward_cpu<T: Element + Float>(g: T, x: T) -> T {
    let s = T::one() / (T::one() + (-x).exp());
    g * s * (T::one() + x * (T::one() - s))
}

pub(crate) fn max_share_cpu<T: Element + Float>(a: T, b: T) -> T {
    if a > b {
        T::one()
    } else if a == b {
        from_f64(0.5)
    } else {
        T::zero()
    }
}

// Second derivatives, as tensor ops (so they run on every device and are differentiable in
// turn): the backward rows' own rules multiply the incoming gradient by these.

/// silu'' = σ(1 - σ)(2 + x(1 - 2σ)).
pub(crate) fn silu_curvature(x: &Tensor) -> Result<Tensor> {
    let s = x.sigmoid()?;
    let one_minus = s.neg()?.add_scalar(1.0)?;
    let inner = x
        .mul(&s.mul_scalar(-2.0)?.add_scalar(1.0)?)?
        .add_scalar(2.0)?;
    s.mul(&one_minus)?.mul(&inner)
}

/// gelu'' = φ(x)(2 - x²).
pub(crate) fn gelu_erf_curvature(x: &Tensor) -> Result<Tensor> {
    let x2 = x.mul(x)?;
    let phi = x2.mul_scalar(-0.5)?.exp()?.mul_scalar(INV_SQRT_2PI)?;
    phi.mul(&x2.neg()?.add_scalar(2.0)?)
}

/// gelu_tanh'' = (1 - t²)(u' + ½ x (u'' - 2 t u'²)), `u' = K(1 + 3C x²)`, `u'' = 6 C K x`.
pub(crate) fn gelu_tanh_curvature(x: &Tensor) -> Result<Tensor> {
    let x2 = x.mul(x)?;
    let t = x
        .mul(&x2.mul_scalar(C)?.add_scalar(1.0)?)?
        .mul_scalar(K)?
        .tanh()?;
    let du = x2.mul_scalar(3.0 * C * K)?.add_scalar(K)?;
    let ddu = x.mul_scalar(6.0 * C * K)?;
    let bracket = ddu.sub(&t.mul(&du.mul(&du)?)?.mul_scalar(2.0)?)?;
    let inner = du.add(&x.mul(&bracket)?.mul_scalar(0.5)?)?;
    t.mul(&t)?.neg()?.add_scalar(1.0)?.mul(&inner)
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_matches_reference_values() {
        // erf at a few points, to 16 digits (Abramowitz & Stegun table 7.1 / high-precision).
        let cases = [
            (0.0, 0.0),
            (0.1, 0.112_462_916_018_284_9),
            (0.5, 0.520_499_877_813_046_5),
            (1.0, 0.842_700_792_949_714_9),
            (2.0, 0.995_322_265_018_952_7),
            (3.0, 0.999_977_909_503_001_4),
            (-1.5, -0.966_105_146_475_310_8),
        ];
        for (x, want) in cases {
            let got = erf(x);
            assert!((got - want).abs() <= 2e-15, "erf({x}) = {got}, want {want}");
        }
        assert_eq!(erf(7.0), 1.0);
        assert_eq!(erf(-9.0), -1.0);
        assert!(erf(f64::NAN).is_nan());
    }

    #[test]
    fn slopes_match_central_differences() {
        let h = 1e-6;
        for x in [-3.0, -1.2, -0.3, 0.0, 0.4, 1.7, 4.0] {
            let g = |f: fn(f64) -> f64| (f(x + h) - f(x - h)) / (2.0 * h);
            let erf_form = g(gelu_erf_cpu::<f64>);
            let tanh_form = g(gelu_tanh_cpu::<f64>);
            assert!((gelu_erf_slope(x) - erf_form).abs() < 1e-8, "gelu' at {x}");
            assert!(
                (gelu_tanh_slope(x) - tanh_form).abs() < 1e-8,
                "gelu_tanh' at {x}"
            );
        }
    }
}
