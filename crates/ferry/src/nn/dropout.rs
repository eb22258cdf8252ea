//! Dropout: zeroes a random fraction of its input while training.

use ferry_tensor::{Result, Tensor, TensorError};

use super::Module;

/// Zeroes each element with probability `p` in training mode and scales the survivors by
/// `1 / (1 - p)`, so the expected output equals the input; in evaluation mode it is the
/// identity. Runs [`Tensor::dropout`]: one kernel draws the mask and scales, and backward keeps
/// only the mask. Masks come from the tensor generator, which [`crate::manual_seed`] seeds,
/// and are drawn on the input's device (a seed gives the same mask on every device).
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
        // One fused op: the mask is drawn and applied in one kernel, and the graph keeps only
        // the mask (one byte per element) for backward.
        input.dropout(self.p, self.training)
    }

    fn set_training(&mut self, training: bool) {
        self.training = training;
    }
}
