//! Two-dimensional convolution and pooling over NCHW tensors (their gradient rules are in
//! `rules::conv`).
//!
//! On CUDA, where libcudnn loads, the forward and both gradients are cuDNN's convolution passes
//! (deterministic algorithms, no TF32 for f32). Elsewhere (the CPU, a GPU without cuDNN,
//! `FERRY_CUDNN=0`) a convolution is lowered to im2col and a matrix product: `im2col` unfolds
//! every receptive field of the input into a column (`[N, C·KH·KW, OH·OW]`), the grouped weight
//! (`[G, O/G, C/G·KH·KW]`) multiplies the columns (the `gemm` crate on the CPU, cuBLAS on CUDA),
//! and `col2im`, its adjoint, folds columns back into an image by summing overlapping entries.
//! On CUDA both are kernels of kernels/conv.cu.
//!
//! The conv2d node keeps the input and the weight (not the columns, which are `KH·KW` times
//! larger). Its backward, under `create_graph`, is written with differentiable ops (`im2col`,
//! `col2im`, matmul, sums), so second derivatives flow on either path.
//!
//! Max pooling finds the index of each window's maximum (a kernel: it records nothing) and picks
//! the values with [`Tensor::gather`], whose node keeps only those `i64` indices. Average
//! pooling (padding counted in the divisor) is `im2col` followed by a mean over each window.

use ferry_cuda::ConvPass;

use crate::autograd::{Save, record};
use crate::op::conv::Geometry;
use crate::{Result, Tensor, TensorError, backend, rules};

/// Stride, padding, dilation and groups of [`Tensor::conv2d`]: `[height, width]` pairs.
///
/// The default is stride 1, no padding, dilation 1 and one group.
///
/// ```
/// use ferry_tensor::Conv2dOptions;
/// let o = Conv2dOptions::default().stride(2).padding(1).groups(2);
/// assert_eq!((o.stride, o.padding, o.dilation, o.groups), ([2, 2], [1, 1], [1, 1], 2));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv2dOptions {
    /// Step between windows, `[sh, sw]` (each >= 1).
    pub stride: [usize; 2],
    /// Zeros added on each side, `[ph, pw]`.
    pub padding: [usize; 2],
    /// Spacing between kernel taps, `[dh, dw]` (each >= 1).
    pub dilation: [usize; 2],
    /// Channel groups: input and output channels both split into this many groups, each
    /// convolved on its own (>= 1, dividing both channel counts).
    pub groups: usize,
}

impl Default for Conv2dOptions {
    fn default() -> Self {
        Self {
            stride: [1, 1],
            padding: [0, 0],
            dilation: [1, 1],
            groups: 1,
        }
    }
}

impl Conv2dOptions {
    /// The same stride along both axes.
    pub fn stride(mut self, s: usize) -> Self {
        self.stride = [s, s];
        self
    }

    /// The same padding along both axes.
    pub fn padding(mut self, p: usize) -> Self {
        self.padding = [p, p];
        self
    }

    /// The same dilation along both axes.
    pub fn dilation(mut self, d: usize) -> Self {
        self.dilation = [d, d];
        self
    }

    /// The number of channel groups.
    pub fn groups(mut self, g: usize) -> Self {
        self.groups = g;
        self
    }
}

/// The `[n, c, h, w]` of a 4-D input, or an error naming the layout conv and pooling want.
fn nchw(op: &'static str, x: &Tensor) -> Result<[usize; 4]> {
    match *x.shape() {
        [n, c, h, w] => Ok([n, c, h, w]),
        _ => Err(TensorError::InvalidArgument {
            op,
            message: format!(
                "the input must be 4-D [batch, channels, height, width], got shape {:?}; add a \
                 batch axis with `.unsqueeze(0)` for a single image",
                x.shape()
            ),
        }),
    }
}

fn float_input(op: &'static str, x: &Tensor) -> Result<()> {
    if x.dtype().is_float() {
        Ok(())
    } else {
        Err(TensorError::UnsupportedDType {
            op,
            dtype: x.dtype(),
            hint: "convolution and pooling need a float dtype; cast with `.to_dtype(DType::F32)`",
        })
    }
}

impl Tensor {
    /// Two-dimensional cross-correlation of an NCHW input `[N, C, H, W]` with `weight`
    /// `[O, C / groups, KH, KW]`, plus `bias` `[O]` if given: the output is `[N, O, OH, OW]`
    /// with `OH = (H + 2·ph - dh·(KH - 1) - 1) / sh + 1` (and the same for `OW`).
    ///
    /// Float dtypes; all three tensors on one device with one dtype. Gradients reach the input,
    /// the weight and the bias; the node keeps the input and the weight. Runs through cuDNN on a GPU
    /// where libcudnn loads, else as im2col and a matrix product (see the module docs).
    pub fn conv2d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        options: Conv2dOptions,
    ) -> Result<Tensor> {
        const OP: &str = "conv2d";
        let [n, c, h, w] = nchw(OP, self)?;
        float_input(OP, self)?;
        self.same_kind(OP, weight)?;
        let groups = options.groups;
        let [o, cg, kh, kw] = match *weight.shape() {
            [o, cg, kh, kw] => [o, cg, kh, kw],
            _ => {
                return Err(TensorError::InvalidArgument {
                    op: OP,
                    message: format!(
                        "the weight must be 4-D [out_channels, in_channels / groups, kh, kw], got \
                         shape {:?}",
                        weight.shape()
                    ),
                });
            }
        };
        if groups == 0 || !c.is_multiple_of(groups) || !o.is_multiple_of(groups) || cg * groups != c
        {
            return Err(TensorError::InvalidArgument {
                op: OP,
                message: format!(
                    "groups = {groups} must be >= 1 and divide both the input channels ({c}) and \
                     the output channels ({o}), and the weight's second axis ({cg}) must be \
                     in_channels / groups = {}",
                    c / groups.max(1)
                ),
            });
        }
        if let Some(b) = bias {
            self.same_kind(OP, b)?;
            if b.shape() != [o] {
                return Err(TensorError::ShapeMismatch {
                    op: OP,
                    lhs: weight.dims(),
                    rhs: b.dims(),
                    hint: "the bias must be [out_channels], the weight's first axis",
                });
            }
        }
        let geo = Geometry::new(
            OP,
            [n, c, h, w],
            [kh, kw],
            options.stride,
            options.padding,
            options.dilation,
        )?;
        if let Some(y) = crate::autocast::conv2d(self, weight, bias, options)? {
            return Ok(y);
        }
        // The forward itself records one node: the ops below run on detached tensors.
        let (x, w) = (self.detach(), weight.detach());
        let y = match backend::convolution(ConvPass::Forward, &geo, groups, o, &x, &w)? {
            Some(y) => y,
            None => conv_forward(&x, &w, groups, &geo)?,
        };
        let y = match bias {
            Some(b) => y.add(&b.detach().reshape(&[1, o, 1, 1])?)?,
            None => y,
        };
        let mut inputs = vec![self, weight];
        inputs.extend(bias);
        let (x_grad, w_grad) = (self.requires_grad(), weight.requires_grad());
        Ok(record(y, OP, &inputs, || {
            // dx needs the weight, dw needs the input; the bias gradient needs neither.
            let save = Save::input_if(0, w_grad).and(Save::input_if(1, x_grad));
            rules::conv2d(save, &geo, groups, bias.is_some())
        }))
    }

    /// Max pooling over `kernel` windows of an NCHW input, moved by `stride`, over an input
    /// padded by `padding` (padding never wins: it is left out of each window, so it must be at
    /// most half the kernel). The output is `[N, C, OH, OW]`.
    ///
    /// The maximum of each window is found by index (NaN wins, first maximum on ties) and picked
    /// with [`Tensor::gather`], so the graph keeps one `i64` index per output, not the input;
    /// the gradient goes to each window's maximum.
    pub fn max_pool2d(
        &self,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
    ) -> Result<Tensor> {
        const OP: &str = "max_pool2d";
        let geo = pool_geometry(OP, self, kernel, stride, padding)?;
        let (n, c) = (geo.n, geo.c);
        let planes = geo.with_images(n * c, 1);
        let x = self.reshape(&[n * c, geo.h * geo.w])?;
        let index = backend::pool_argmax(&x.detach(), &planes)?;
        x.gather(1, &index)?.reshape(&[n, c, geo.oh, geo.ow])
    }

    /// Average pooling over `kernel` windows of an NCHW input, moved by `stride`, over an input
    /// zero-padded by `padding` (at most half the kernel). Every window divides by
    /// `kernel[0] * kernel[1]`: padded zeros count. The output is `[N, C, OH, OW]`; the graph
    /// keeps no tensor (the window mean is linear).
    pub fn avg_pool2d(
        &self,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
    ) -> Result<Tensor> {
        const OP: &str = "avg_pool2d";
        let geo = pool_geometry(OP, self, kernel, stride, padding)?;
        let (n, c) = (geo.n, geo.c);
        let planes = geo.with_images(n * c, 1);
        let x = self.reshape(&[n * c, 1, geo.h, geo.w])?;
        x.im2col(&planes)?
            .sum_axis(1, false)?
            .div_scalar(geo.k() as f64)?
            .reshape(&[n, c, geo.oh, geo.ow])
    }
}

fn pool_geometry(
    op: &'static str,
    x: &Tensor,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
) -> Result<Geometry> {
    let dims = nchw(op, x)?;
    float_input(op, x)?;
    if dims[2] == 0 || dims[3] == 0 {
        return Err(TensorError::InvalidArgument {
            op,
            message: format!("cannot pool an empty image, input shape {:?}", x.shape()),
        });
    }
    if (0..2).any(|i| 2 * padding[i] > kernel[i]) {
        return Err(TensorError::InvalidArgument {
            op,
            message: format!(
                "padding {padding:?} must be at most half the kernel {kernel:?}, so that every \
                 window overlaps the input; lower the padding"
            ),
        });
    }
    Geometry::new(op, dims, kernel, stride, padding, [1, 1])
}

/// `[N, O, OH, OW]` from detached (or differentiable) tensors: im2col and one grouped product.
fn conv_forward(x: &Tensor, weight: &Tensor, groups: usize, geo: &Geometry) -> Result<Tensor> {
    let o = weight.shape()[0];
    let cgk = geo.c / groups * geo.k();
    let cols = x.im2col(geo)?.reshape(&[geo.n, groups, cgk, geo.l()])?;
    let w = weight.reshape(&[groups, o / groups, cgk])?;
    w.matmul(&cols)?.reshape(&[geo.n, o, geo.oh, geo.ow])
}

impl Tensor {
    /// Unfolds `self` (`[N, C, H, W]`) into `[N, C·KH·KW, OH·OW]`: row `(c, kh, kw)`, column
    /// `(oy, ox)` holds `x[c, oy·sh + kh·dh - ph, ox·sw + kw·dw - pw]`, zero outside the input.
    /// Recorded; its gradient is [`Tensor::col2im`].
    pub(crate) fn im2col(&self, geo: &Geometry) -> Result<Tensor> {
        let out = backend::im2col(self, geo)?;
        Ok(record(out, "im2col", &[self], || rules::im2col(geo)))
    }

    /// Folds columns `[N, C·KH·KW, OH·OW]` back into `[N, C, H, W]`, summing the entries that
    /// land on one pixel: the adjoint of [`Tensor::im2col`], which is its gradient. Recorded.
    pub(crate) fn col2im(&self, geo: &Geometry) -> Result<Tensor> {
        let out = backend::col2im(self, geo)?;
        Ok(record(out, "col2im", &[self], || rules::col2im(geo)))
    }
}
