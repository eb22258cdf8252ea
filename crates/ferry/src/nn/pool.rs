//! Pooling layers and `Flatten`: no parameters.

use ferry_tensor::{Result, Tensor, TensorError};

use super::Module;

/// Max pooling over NCHW inputs ([`Tensor::max_pool2d`]): the graph keeps one `i64` index per
/// output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxPool2d {
    /// Window `[kh, kw]`.
    pub kernel: [usize; 2],
    /// Step `[sh, sw]`.
    pub stride: [usize; 2],
    /// Padding `[ph, pw]` (at most half the kernel; never selected).
    pub padding: [usize; 2],
}

impl MaxPool2d {
    /// A square window of `kernel`, moved by `kernel` (non-overlapping), no padding.
    pub fn new(kernel: usize) -> Self {
        Self {
            kernel: [kernel, kernel],
            stride: [kernel, kernel],
            padding: [0, 0],
        }
    }
}

impl Module for MaxPool2d {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        input.max_pool2d(self.kernel, self.stride, self.padding)
    }
}

/// Average pooling over NCHW inputs ([`Tensor::avg_pool2d`]); padded zeros count in each
/// window's divisor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AvgPool2d {
    /// Window `[kh, kw]`.
    pub kernel: [usize; 2],
    /// Step `[sh, sw]`.
    pub stride: [usize; 2],
    /// Zero padding `[ph, pw]` (at most half the kernel).
    pub padding: [usize; 2],
}

impl AvgPool2d {
    /// A square window of `kernel`, moved by `kernel` (non-overlapping), no padding.
    pub fn new(kernel: usize) -> Self {
        Self {
            kernel: [kernel, kernel],
            stride: [kernel, kernel],
            padding: [0, 0],
        }
    }
}

impl Module for AvgPool2d {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        input.avg_pool2d(self.kernel, self.stride, self.padding)
    }
}

/// Flattens every axis after the first: `[N, d1, d2, ..]` becomes `[N, d1·d2·..]` (a view when
/// the input is contiguous), between convolutional and linear layers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Flatten;

impl Module for Flatten {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        let Some((&n, rest)) = input.shape().split_first() else {
            return Err(TensorError::InvalidArgument {
                op: "Flatten",
                message: "cannot flatten a 0-d tensor: it has no batch axis; reshape it to [1] \
                          first"
                    .into(),
            });
        };
        input.reshape(&[n, rest.iter().product()])
    }
}
