//! Mixed precision: an autocast scope that runs matrix products, linear layers, convolutions and
//! attention in `bf16` (or `f16`) while the model's weights stay `f32`, and a [`GradScaler`] for
//! `f16` training.
//!
//! Inside [`autocast`] the policy is PyTorch's `torch.autocast`:
//! - [`Tensor::matmul`](crate::Tensor::matmul), [`Tensor::linear`](crate::Tensor::linear) (so
//!   [`Linear`](crate::nn::Linear)), [`Tensor::conv2d`](crate::Tensor::conv2d) (so
//!   [`Conv2d`](crate::nn::Conv2d)) and
//!   [`Tensor::scaled_dot_product_attention`](crate::Tensor::scaled_dot_product_attention) cast
//!   their `f32` operands (biases too) to the scope's dtype and answer in it, so the activations
//!   between two products stay in the low precision: the next product takes them without a cast,
//!   and an activation between them (GELU, SiLU x gate, dropout) moves half the bytes;
//! - softmax, log-softmax, cross-entropy, layer and RMS norms take a low-precision input in `f32`
//!   and answer in `f32`;
//! - a binary elementwise op of an `f32` and a low-precision operand runs in `f32` (a residual
//!   stream in `f32` plus a block's `bf16` output stays `f32`); outside a scope that mix is an
//!   error.
//!
//! The casts are recorded ops, so each product saves its low-precision operands (half the bytes
//! of an `f32` product) and backward brings every gradient back to its tensor's dtype: the
//! weights' gradients are `f32`. Backward itself runs without autocast, in the dtypes the forward
//! left, even when called inside a scope.
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
//! let loss = autocast(DType::BF16, || {
//!     let y = layer.forward(&x)?;
//!     assert_eq!(y.dtype(), DType::BF16); // the layer runs and answers in bf16
//!     y.log_softmax(-1)?.mean() // log-softmax runs in f32
//! })?;
//! assert_eq!(loss.dtype(), DType::F32);
//! loss.backward()?;
//! assert_eq!(layer.weight().grad().unwrap().dtype(), DType::F32);
//! # Ok::<(), ferry::TensorError>(())
//! ```

mod scaler;

pub use ferry_tensor::autocast::{AutocastGuard, autocast_dtype};
pub use scaler::GradScaler;

use ferry_tensor::{DType, Result};

/// Runs `f` with matrix products, linear layers, convolutions and attention in `dtype`
/// (`DType::BF16`, or `DType::F16` with a [`GradScaler`]) on this thread, and returns its result. Scopes nest: the innermost wins,
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
