//! A lookup table of learned vectors.

use ferry_tensor::{DType, Device, Result, Tensor, TensorError};

use super::Module;

/// `num_embeddings` learned vectors of length `dim` (`weight`, `[num_embeddings, dim]`, drawn
/// from N(0, 1) as PyTorch's `nn.Embedding` does); the forward maps `i64` indices of any shape
/// to `indices.shape() + [dim]` with [`Tensor::embedding`]. Its gradient accumulates into the
/// rows used (atomically on CUDA), and the node keeps only the indices.
#[derive(Debug, Clone)]
pub struct Embedding {
    weight: Tensor,
}

impl Embedding {
    /// An `f32` table on `device`.
    pub fn new(num_embeddings: usize, dim: usize, device: Device) -> Result<Self> {
        Self::from_weight(Tensor::randn(&[num_embeddings, dim], DType::F32, device)?)
    }

    /// A table over a given `[num_embeddings, dim]` weight, made a leaf that requires grad.
    pub fn from_weight(weight: Tensor) -> Result<Self> {
        if weight.ndim() != 2 {
            return Err(TensorError::InvalidArgument {
                op: "Embedding",
                message: format!(
                    "the weight must be [num_embeddings, dim], got shape {:?}",
                    weight.shape()
                ),
            });
        }
        Ok(Self {
            weight: weight.detach().with_grad()?,
        })
    }

    /// The table, `[num_embeddings, dim]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// How many vectors the table holds.
    pub fn num_embeddings(&self) -> usize {
        self.weight.shape()[0]
    }

    /// The length of each vector.
    pub fn dim(&self) -> usize {
        self.weight.shape()[1]
    }
}

impl Module for Embedding {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        Tensor::embedding(&self.weight, input)
    }

    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        f(format!("{prefix}weight"), &self.weight);
    }

    fn visit_parameters_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(String, &mut Tensor) -> Result<()>,
    ) -> Result<()> {
        f(format!("{prefix}weight"), &mut self.weight)
    }
}
