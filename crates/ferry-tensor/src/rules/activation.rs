//! Second derivatives of the smooth activations, as tensor ops (so they run on every device and
//! are differentiable in turn): the fused backward rows' own rules multiply the incoming
//! gradient by these.

use crate::op::math::{C, INV_SQRT_2PI, K};
use crate::{Result, Tensor};

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
