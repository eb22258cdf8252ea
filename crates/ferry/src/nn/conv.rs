//! The two-dimensional convolution layer.

use ferry_tensor::{Conv2dOptions, DType, Device, Result, Tensor, TensorError};

use super::{Init, Module};

/// A 2-D convolution over NCHW inputs: [`Tensor::conv2d`] with a learned `weight`
/// `[out_channels, in_channels / groups, kh, kw]` (Kaiming-uniform over the fan-in
/// `in_channels / groups · kh · kw`) and a `bias` `[out_channels]` (zeros). Parameter names are
/// `weight` and `bias`, as in PyTorch's `nn.Conv2d`, so checkpoints load as they are.
#[derive(Debug, Clone)]
pub struct Conv2d {
    weight: Tensor,
    bias: Option<Tensor>,
    options: Conv2dOptions,
}

impl Conv2d {
    /// An `f32` layer with a square `kernel`, stride 1, no padding, on `device`.
    pub fn new(
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        device: Device,
    ) -> Result<Self> {
        Self::with_options(
            in_channels,
            out_channels,
            [kernel, kernel],
            Conv2dOptions::default(),
            device,
        )
    }

    /// An `f32` layer with a `[kh, kw]` kernel and these stride, padding, dilation and groups.
    pub fn with_options(
        in_channels: usize,
        out_channels: usize,
        kernel: [usize; 2],
        options: Conv2dOptions,
        device: Device,
    ) -> Result<Self> {
        let g = options.groups;
        if g == 0
            || !in_channels.is_multiple_of(g)
            || !out_channels.is_multiple_of(g)
            || kernel.contains(&0)
        {
            return Err(TensorError::InvalidArgument {
                op: "Conv2d",
                message: format!(
                    "groups = {g} must be >= 1 and divide in_channels ({in_channels}) and \
                     out_channels ({out_channels}), and the kernel {kernel:?} must be non-empty"
                ),
            });
        }
        let fan_in = in_channels / g * kernel[0] * kernel[1];
        let weight = Init::KaimingUniform
            .tensor(&[out_channels, fan_in], DType::F32, device)?
            .reshape(&[out_channels, in_channels / g, kernel[0], kernel[1]])?;
        let bias = Tensor::zeros(&[out_channels], DType::F32, device)?;
        Self::from_tensors(weight, Some(bias), options)
    }

    /// A layer holding `weight` `[out, in / groups, kh, kw]` and `bias` `[out]` (made leaves
    /// that require grad).
    pub fn from_tensors(
        weight: Tensor,
        bias: Option<Tensor>,
        options: Conv2dOptions,
    ) -> Result<Self> {
        if weight.ndim() != 4 {
            return Err(TensorError::InvalidArgument {
                op: "Conv2d",
                message: format!(
                    "the weight must be [out, in / groups, kh, kw], got {:?}",
                    weight.shape()
                ),
            });
        }
        if let Some(b) = &bias
            && b.shape() != [weight.shape()[0]]
        {
            return Err(TensorError::ShapeMismatch {
                op: "Conv2d",
                lhs: weight.shape().into(),
                rhs: b.shape().into(),
                hint: "the bias must be [out] for a weight of [out, in / groups, kh, kw]",
            });
        }
        Ok(Self {
            weight: weight.detach().with_grad()?,
            bias: bias.map(|b| b.detach().with_grad()).transpose()?,
            options,
        })
    }

    /// The same layer without its bias.
    pub fn without_bias(mut self) -> Self {
        self.bias = None;
        self
    }

    /// The kernel weights, `[out, in / groups, kh, kw]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias, `[out]`, if the layer has one.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// Stride, padding, dilation and groups.
    pub fn options(&self) -> Conv2dOptions {
        self.options
    }
}

impl Module for Conv2d {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        input.conv2d(&self.weight, self.bias.as_ref(), self.options)
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
