//! The geometry of a convolution or pooling window over NCHW images, as the kernels of every
//! device read it.

use crate::error::{Result, TensorError};

/// The geometry of one unfolding: input `[n, c, h, w]`, kernel `kh x kw`, stride, padding,
/// dilation and the output size `oh x ow`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub kh: usize,
    pub kw: usize,
    pub sh: usize,
    pub sw: usize,
    pub ph: usize,
    pub pw: usize,
    pub dh: usize,
    pub dw: usize,
    pub oh: usize,
    pub ow: usize,
}

impl Geometry {
    /// Checks the window against the input and derives the output size.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        op: &'static str,
        input: [usize; 4],
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
    ) -> Result<Self> {
        let [n, c, h, w] = input;
        let invalid = |message: String| Err(TensorError::InvalidArgument { op, message });
        if kernel.contains(&0) || stride.contains(&0) || dilation.contains(&0) {
            return invalid(format!(
                "kernel {kernel:?}, stride {stride:?} and dilation {dilation:?} must all be >= 1"
            ));
        }
        let mut out = [0; 2];
        for (i, size) in [h, w].into_iter().enumerate() {
            let span = dilation[i] * (kernel[i] - 1) + 1;
            let padded = size + 2 * padding[i];
            if padded < span {
                return invalid(format!(
                    "the window spans {span} (kernel {kernel:?}, dilation {dilation:?}) but the \
                     padded input is {padded} along {} (input {h}x{w}, padding {padding:?}); use \
                     a smaller kernel or more padding",
                    ["height", "width"][i]
                ));
            }
            out[i] = (padded - span) / stride[i] + 1;
        }
        Ok(Self {
            n,
            c,
            h,
            w,
            kh: kernel[0],
            kw: kernel[1],
            sh: stride[0],
            sw: stride[1],
            ph: padding[0],
            pw: padding[1],
            dh: dilation[0],
            dw: dilation[1],
            oh: out[0],
            ow: out[1],
        })
    }

    /// Taps per window.
    pub fn k(&self) -> usize {
        self.kh * self.kw
    }

    /// Windows per image.
    pub fn l(&self) -> usize {
        self.oh * self.ow
    }

    /// The same window over `[n, c]` images.
    pub(crate) fn with_images(mut self, n: usize, c: usize) -> Self {
        self.n = n;
        self.c = c;
        self
    }

    pub(crate) fn to_vec(self) -> Vec<usize> {
        vec![
            self.n, self.c, self.h, self.w, self.kh, self.kw, self.sh, self.sw, self.ph, self.pw,
            self.dh, self.dw, self.oh, self.ow,
        ]
    }

    pub(crate) fn from_slice(v: &[usize]) -> Self {
        Self {
            n: v[0],
            c: v[1],
            h: v[2],
            w: v[3],
            kh: v[4],
            kw: v[5],
            sh: v[6],
            sw: v[7],
            ph: v[8],
            pw: v[9],
            dh: v[10],
            dw: v[11],
            oh: v[12],
            ow: v[13],
        }
    }
}
