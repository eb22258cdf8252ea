//! The fully connected layer.

use ferry_tensor::{DType, Device, Result, Tensor, TensorError};

use super::{Init, Module};

/// `y = x · Wᵀ + b`, with `W` of shape `[out, in]` and `b` of shape `[out]`: PyTorch's layout,
/// so `nn.Linear` checkpoints load as they are.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    /// An `f32` layer on `device`: Kaiming-uniform weights (for ReLU networks) and a zero bias.
    pub fn new(in_features: usize, out_features: usize, device: Device) -> Result<Self> {
        Self::with_init(
            in_features,
            out_features,
            Init::KaimingUniform,
            DType::F32,
            device,
        )
    }

    /// A layer with weights drawn by `init`, a zero bias, of `dtype`, on `device`.
    pub fn with_init(
        in_features: usize,
        out_features: usize,
        init: Init,
        dtype: DType,
        device: Device,
    ) -> Result<Self> {
        let weight = init.tensor(&[out_features, in_features], dtype, device)?;
        let bias = Tensor::zeros(&[out_features], dtype, device)?;
        Self::from_tensors(weight, Some(bias))
    }

    /// A layer over given tensors (`[out, in]` and `[out]`), made leaves that require grad.
    pub fn from_tensors(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        if weight.ndim() != 2 {
            return Err(TensorError::InvalidArgument {
                op: "Linear",
                message: format!("the weight must be [out, in], got {:?}", weight.shape()),
            });
        }
        if let Some(b) = &bias
            && b.shape() != [weight.shape()[0]]
        {
            return Err(TensorError::ShapeMismatch {
                op: "Linear",
                lhs: weight.shape().into(),
                rhs: b.shape().into(),
                hint: "the bias must be [out] for a weight of [out, in]",
            });
        }
        Ok(Self {
            weight: weight.detach().with_grad()?,
            bias: bias.map(|b| b.detach().with_grad()).transpose()?,
        })
    }

    /// Drops the bias: `y = x · Wᵀ`.
    pub fn without_bias(mut self) -> Self {
        self.bias = None;
        self
    }

    /// The weight, `[out, in]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias, `[out]`.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }
}

impl Module for Linear {
    /// `input · Wᵀ + b` ([`Tensor::linear`]: one fused product on a GPU).
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        input.linear(&self.weight, self.bias.as_ref())
    }

    /// `relu(input · Wᵀ + b)`, the ReLU in the same product's epilogue on a GPU.
    fn forward_relu(&self, input: &Tensor) -> Result<Tensor> {
        input.linear_relu(&self.weight, self.bias.as_ref())
    }

    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        f(format!("{prefix}weight"), &self.weight);
        if let Some(b) = &self.bias {
            f(format!("{prefix}bias"), b);
        }
    }

    fn visit_parameters_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(String, &mut Tensor) -> Result<()>,
    ) -> Result<()> {
        f(format!("{prefix}weight"), &mut self.weight)?;
        if let Some(b) = &mut self.bias {
            f(format!("{prefix}bias"), b)?;
        }
        Ok(())
    }
}
