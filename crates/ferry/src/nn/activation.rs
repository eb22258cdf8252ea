//! Activations: modules without parameters.

use ferry_tensor::{Result, Tensor};

use super::Module;

/// `max(x, 0)`, elementwise.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReLU;

impl Module for ReLU {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        input.relu()
    }

    fn is_relu(&self) -> bool {
        true
    }
}

/// `tanh(x)`, elementwise.
#[derive(Debug, Clone, Copy, Default)]
pub struct Tanh;

impl Module for Tanh {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        input.tanh()
    }
}
