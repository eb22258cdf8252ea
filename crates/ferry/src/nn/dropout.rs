//! Dropout: zeroes a random fraction of its input while training.

use ferry_tensor::{Result, Tensor, TensorError};

use super::Module;

/// Zeroes each element with probability `p` in training mode and scales the survivors by
/// `1 / (1 - p)`, so the expected output equals the input; in evaluation mode it is the
/// identity. Masks come from the tensor generator, which [`crate::manual_seed`] seeds, and
/// are drawn on the input's device.
#[derive(Debug, Clone)]
pub struct Dropout {
    p: f64,
    training: bool,
}

impl Dropout {
    /// Dropout with probability `p` in `[0, 1)`, in training mode.
    pub fn new(p: f64) -> Result<Self> {
        if !(0.0..1.0).contains(&p) {
            return Err(TensorError::InvalidArgument {
                op: "Dropout::new",
                message: format!("p = {p}: the drop probability must lie in [0, 1)"),
            });
        }
        Ok(Self { p, training: true })
    }

    /// The drop probability.
    pub fn p(&self) -> f64 {
        self.p
    }

    /// Whether the module is in training mode (dropping).
    pub fn is_training(&self) -> bool {
        self.training
    }
}

impl Module for Dropout {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        if !self.training || self.p == 0.0 {
            return Ok(input.clone());
        }
        // u - p > 0 with probability 1 - p: the mask keeps, scaled, what survives.
        let keep = Tensor::rand(input.shape(), input.dtype(), input.device())?
            .sub_scalar(self.p)?
            .step()?
            .mul_scalar(1.0 / (1.0 - self.p))?;
        input.mul(&keep)
    }

    fn set_training(&mut self, training: bool) {
        self.training = training;
    }
}
