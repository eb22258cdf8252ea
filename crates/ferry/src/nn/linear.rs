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

/// What follows a [`Dense`] block's product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// Nothing: the product alone.
    Identity,
    /// `max(x, 0)`, in the product's epilogue on a GPU.
    ReLU,
    /// `tanh(x)`.
    Tanh,
}

/// A [`Linear`] layer and its activation as one block: a unit a
/// [`PlannedChain`](super::PlannedChain) keeps, offloads or recomputes (it is `Clone`, as a
/// recomputed block must be). Its parameters are the layer's (`weight`, `bias`).
#[derive(Debug, Clone)]
pub struct Dense {
    linear: Linear,
    activation: Activation,
}

impl Dense {
    /// An `f32` block on `device` ([`Linear::new`]'s initialization).
    pub fn new(
        in_features: usize,
        out_features: usize,
        activation: Activation,
        device: Device,
    ) -> Result<Self> {
        let linear = Linear::new(in_features, out_features, device)?;
        Ok(Self { linear, activation })
    }
}

impl Module for Dense {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        match self.activation {
            Activation::Identity => self.linear.forward(input),
            Activation::ReLU => self.linear.forward_relu(input),
            Activation::Tanh => self.linear.forward(input)?.tanh(),
        }
    }

    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        self.linear.visit_parameters(prefix, f);
    }

    fn visit_parameters_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(String, &mut Tensor) -> Result<()>,
    ) -> Result<()> {
        self.linear.visit_parameters_mut(prefix, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dense_block_is_its_layer_then_its_activation() -> Result<()> {
        let x = Tensor::randn(&[5, 8], DType::F32, Device::Cpu)?;
        for activation in [Activation::Identity, Activation::ReLU, Activation::Tanh] {
            let dense = Dense::new(8, 3, activation, Device::Cpu)?;
            let product = dense.linear.forward(&x)?;
            let expected = match activation {
                Activation::Identity => product,
                Activation::ReLU => product.relu()?,
                Activation::Tanh => product.tanh()?,
            };
            assert_eq!(
                dense.forward(&x)?.to_vec::<f32>()?,
                expected.to_vec::<f32>()?,
                "{activation:?}"
            );
            let names: Vec<String> = dense
                .named_parameters()
                .into_iter()
                .map(|(n, _)| n)
                .collect();
            assert_eq!(names, ["weight", "bias"]);
        }
        Ok(())
    }
}
