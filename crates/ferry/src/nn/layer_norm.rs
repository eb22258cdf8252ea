//! Layer normalization as a module.

use ferry_tensor::{DType, Device, Result, Tensor, TensorError};

use super::Module;

/// Normalizes each input over its trailing `normalized_shape` dimensions, then scales by a
/// learned `weight` and shifts by a learned `bias` (both of shape `normalized_shape`; ones and
/// zeros at first): [`Tensor::layer_norm`], with its fused kernels. Parameter names are
/// `weight` and `bias`, as in PyTorch's `nn.LayerNorm`, so checkpoints load as they are.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    normalized_shape: Vec<usize>,
    eps: f64,
    weight: Option<Tensor>,
    bias: Option<Tensor>,
}

impl LayerNorm {
    /// An `f32` layer over the last axis of length `features`, with `eps = 1e-5`, on `device`.
    pub fn new(features: usize, device: Device) -> Result<Self> {
        Self::with_options(&[features], 1e-5, true, DType::F32, device)
    }

    /// A layer over `normalized_shape` with `eps`; `affine` adds the weight and bias.
    pub fn with_options(
        normalized_shape: &[usize],
        eps: f64,
        affine: bool,
        dtype: DType,
        device: Device,
    ) -> Result<Self> {
        if normalized_shape.is_empty() || normalized_shape.contains(&0) {
            return Err(TensorError::InvalidArgument {
                op: "LayerNorm",
                message: format!(
                    "normalized_shape must be non-empty with no zero, got {normalized_shape:?}; \
                     pass the feature count, e.g. `&[512]`"
                ),
            });
        }
        let (weight, bias) = if affine {
            (
                Some(Tensor::ones(normalized_shape, dtype, device)?.with_grad()?),
                Some(Tensor::zeros(normalized_shape, dtype, device)?.with_grad()?),
            )
        } else {
            (None, None)
        };
        Ok(Self {
            normalized_shape: normalized_shape.to_vec(),
            eps,
            weight,
            bias,
        })
    }

    /// The normalized trailing shape.
    pub fn normalized_shape(&self) -> &[usize] {
        &self.normalized_shape
    }

    /// The scale, when the layer is affine.
    pub fn weight(&self) -> Option<&Tensor> {
        self.weight.as_ref()
    }

    /// The shift, when the layer is affine.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The constant added to the variance.
    pub fn eps(&self) -> f64 {
        self.eps
    }
}

impl Module for LayerNorm {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        input.layer_norm(
            &self.normalized_shape,
            self.weight.as_ref(),
            self.bias.as_ref(),
            self.eps,
        )
    }

    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        if let Some(w) = &self.weight {
            f(format!("{prefix}weight"), w);
        }
        if let Some(b) = &self.bias {
            f(format!("{prefix}bias"), b);
        }
    }

    fn visit_parameters_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(String, &mut Tensor) -> Result<()>,
    ) -> Result<()> {
        if let Some(w) = &mut self.weight {
            f(format!("{prefix}weight"), w)?;
        }
        if let Some(b) = &mut self.bias {
            f(format!("{prefix}bias"), b)?;
        }
        Ok(())
    }
}
