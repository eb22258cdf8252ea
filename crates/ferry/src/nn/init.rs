//! Weight initialisation: Kaiming (He) and Xavier (Glorot), uniform or normal.
//!
//! Samples come from the tensor generator, so [`crate::manual_seed`] makes a model's initial
//! weights repeat exactly; they are drawn on the target device directly (no host copy).

use ferry_tensor::{DType, Device, Result, Tensor, TensorError};

/// How to fill a weight of shape `[fan_out, fan_in]` (or any shape whose last axis is the
/// input width).
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum Init {
    /// `U(-b, b)` with `b = gain · √(3 / fan_in)`, gain `√2` (for ReLU): keeps the forward
    /// variance of a ReLU network constant (He et al., 2015).
    KaimingUniform,
    /// `N(0, σ²)` with `σ = √2 / √fan_in`.
    KaimingNormal,
    /// `U(-b, b)` with `b = √(6 / (fan_in + fan_out))` (Glorot and Bengio, 2010), for tanh.
    XavierUniform,
    /// `N(0, σ²)` with `σ = √(2 / (fan_in + fan_out))`.
    XavierNormal,
    /// `U(-1/√fan_in, 1/√fan_in)`: what PyTorch's `nn.Linear` uses for its bias.
    FanInUniform,
    /// All zeros.
    Zeros,
}

impl Init {
    /// A tensor of `shape` initialised this way. `fan_in` is the last axis, `fan_out` the
    /// first (for a 1-D shape both are its length).
    pub fn tensor(self, shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        let (fan_in, fan_out) = fans(shape)?;
        match self {
            Init::KaimingUniform => uniform(shape, (6.0 / fan_in).sqrt(), dtype, device),
            Init::KaimingNormal => normal(shape, (2.0 / fan_in).sqrt(), dtype, device),
            Init::XavierUniform => uniform(shape, (6.0 / (fan_in + fan_out)).sqrt(), dtype, device),
            Init::XavierNormal => normal(shape, (2.0 / (fan_in + fan_out)).sqrt(), dtype, device),
            Init::FanInUniform => uniform(shape, 1.0 / fan_in.sqrt(), dtype, device),
            Init::Zeros => Tensor::zeros(shape, dtype, device),
        }
    }
}

fn fans(shape: &[usize]) -> Result<(f64, f64)> {
    match shape {
        [] | [0, ..] | [.., 0] => Err(TensorError::InvalidArgument {
            op: "Init::tensor",
            message: format!("cannot derive fan-in and fan-out from shape {shape:?}"),
        }),
        [n] => Ok((*n as f64, *n as f64)),
        [out, .., inp] => Ok((*inp as f64, *out as f64)),
    }
}

fn uniform(shape: &[usize], bound: f64, dtype: DType, device: Device) -> Result<Tensor> {
    Tensor::rand(shape, dtype, device)?
        .mul_scalar(2.0 * bound)?
        .sub_scalar(bound)
}

fn normal(shape: &[usize], std: f64, dtype: DType, device: Device) -> Result<Tensor> {
    Tensor::randn(shape, dtype, device)?.mul_scalar(std)
}

/// Kaiming-uniform weights of `shape` (see [`Init::KaimingUniform`]).
pub fn kaiming_uniform(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
    Init::KaimingUniform.tensor(shape, dtype, device)
}

/// Xavier-uniform weights of `shape` (see [`Init::XavierUniform`]).
pub fn xavier_uniform(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
    Init::XavierUniform.tensor(shape, dtype, device)
}
