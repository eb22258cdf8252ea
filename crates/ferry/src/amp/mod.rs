//! Mixed precision: an autocast scope that runs matrix products in `bf16` (or `f16`) while the
//! model's weights stay `f32`, and a [`GradScaler`] for `f16` training.
//!
//! Inside [`autocast`], every matrix product with an `f32` operand ([`Tensor::matmul`](crate::Tensor::matmul), so
//! [`Linear`](crate::nn::Linear) too) casts its `f32` operands to the scope's dtype, multiplies
//! in it, and casts the product back to `f32`; so does every convolution
//! ([`Tensor::conv2d`](crate::Tensor::conv2d), [`Conv2d`](crate::nn::Conv2d)), whose bias is
//! added in `f32`. Everything else (reductions, softmax,
//! cross-entropy, normalisation, the loss) therefore runs in `f32`. The casts are recorded ops,
//! so the graph holds, for each product, a `to_dtype` into the low precision for each `f32`
//! operand, the `matmul` itself (saving its low-precision operands: half the bytes of an `f32`
//! product), and a `to_dtype` back to `f32`. Backward runs the product's gradient in the low
//! precision and casts it to `f32` on its way to the weights, whose gradients are `f32`.
//!
//! Key decision: the product comes back as `f32` rather than staying in the low precision. One
//! cast per product buys that no other op needs an autocast rule and no mixed-dtype arithmetic
//! arises (an `f32` bias added to a `bf16` product would be a dtype mismatch).
//!
//! `bf16` has the exponent range of `f32` and needs no loss scaling. `f16` does: its smallest
//! normal number is 6e-5, and small gradients flush to zero. [`GradScaler`] multiplies the loss
//! by a large factor before backward, divides the gradients by it before the step, skips steps
//! whose gradients overflowed, and adapts the factor.
//!
//! ```
//! use ferry::amp::autocast;
//! use ferry::nn::{Linear, Module};
//! use ferry::prelude::*;
//!
//! let layer = Linear::new(4, 2, Device::Cpu)?;
//! let x = Tensor::randn(&[8, 4], DType::F32, Device::Cpu)?;
//! let y = autocast(DType::BF16, || layer.forward(&x))?;
//! assert_eq!(y.dtype(), DType::F32); // computed in bf16, handed back in f32
//! y.sum()?.backward()?;
//! assert_eq!(layer.weight().grad().unwrap().dtype(), DType::F32);
//! # Ok::<(), ferry::TensorError>(())
//! ```

mod scaler;

pub use ferry_tensor::autocast::{AutocastGuard, autocast_dtype};
pub use scaler::GradScaler;

use ferry_tensor::{DType, Result};

/// Runs `f` with matrix products in `dtype` (`DType::BF16`, or `DType::F16` with a
/// [`GradScaler`]) on this thread, and returns its result. Scopes nest: the innermost wins,
/// and the state before the call is restored when it returns (or unwinds). Any other dtype is
/// an error.
pub fn autocast<T>(dtype: DType, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let _scope = AutocastGuard::new(Some(dtype))?;
    f()
}

/// Runs `f` with autocast off (products of `f32` operands in `f32`), for a part of a model that
/// must stay in full precision inside a larger [`autocast`] scope.
pub fn without_autocast<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    let _scope = AutocastGuard::new(None)?;
    f()
}

/// Whether this thread is inside an [`autocast`] scope (and not inside a
/// [`without_autocast`] one).
pub fn is_autocast_enabled() -> bool {
    autocast_dtype().is_some()
}
