//! Convolutions on a GPU: through cuDNN where libcudnn loads ([`convolution`]), else im2col and
//! col2im (kernels/conv.cu: grid-stride kernels, one thread per output element; col2im gathers,
//! no atomics, so its sums are deterministic) with the products on the cuBLAS path of
//! the matrix product. The pooling argmax is a kernel of the same file.

use std::sync::OnceLock;

use ferry_cuda::{
    ConvInput, ConvOutput, ConvPass, ConvSpec, CudaFunction, Dnn, Kernels, cudnn_present,
};
use ferry_memory::DType;
use ferry_memory::cuda::CudaDevice;

use super::kernels::CONV;
use super::{Cuda, buffer, dense, float_only, launch, with_output};
use crate::Result;
use crate::kernel::{Conv, Dense, Operand, View};
use crate::op::conv::Geometry;

fn function(dev: &CudaDevice, name: &'static str) -> Result<CudaFunction> {
    Ok(dev.function(&CONV, name)?)
}

/// `$prefix` followed by the C name of a float dtype.
macro_rules! float_name {
    ($prefix:literal, $dtype:expr) => {
        match $dtype {
            DType::F64 => concat!($prefix, "double"),
            DType::F16 => concat!($prefix, "f16"),
            DType::BF16 => concat!($prefix, "bf16"),
            _ => concat!($prefix, "float"),
        }
    };
}

/// The kernels' `ConvGeometry` struct: 13 `u64` fields in this order.
fn geometry_arg(g: &Geometry) -> [u64; 13] {
    [
        g.c, g.h, g.w, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw, g.oh, g.ow,
    ]
    .map(|v| v as u64)
}

/// Whether conv2d of `dtype` runs through cuDNN: libcudnn loads and `FERRY_CUDNN` is not `0`
/// (set it to compare with the im2col path).
fn cudnn_enabled(dtype: DType) -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    let enabled = *ENABLED
        .get_or_init(|| std::env::var("FERRY_CUDNN").map_or(true, |v| v != "0") && cudnn_present());
    enabled && matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
}

impl Conv for Cuda {
    /// One cuDNN convolution pass for `geo` with `filters` output channels: `Forward` takes
    /// (x, w) and gives y, `BackwardData` (dy, w) gives dx, `BackwardFilter` (x, dy) gives dw.
    /// `None` where cuDNN does not load, is turned off, or does not take the dtype.
    fn convolution(
        &self,
        pass: ConvPass,
        geo: &Geometry,
        groups: usize,
        filters: usize,
        first: &Operand<'_>,
        second: &Operand<'_>,
    ) -> Result<Option<Dense>> {
        const OP: &str = "conv2d";
        let dtype = first.dtype();
        if !cudnn_enabled(dtype) {
            return Ok(None);
        }
        let (first, second) = (dense(first)?, dense(second)?);
        let spec = ConvSpec {
            dtype,
            input: [geo.n, geo.c, geo.h, geo.w],
            filter: [filters, geo.c / groups.max(1), geo.kh, geo.kw],
            stride: [geo.sh, geo.sw],
            padding: [geo.ph, geo.pw],
            dilation: [geo.dh, geo.dw],
            groups,
        };
        let shape = match pass {
            ConvPass::Forward => vec![geo.n, filters, geo.oh, geo.ow],
            ConvPass::BackwardData => vec![geo.n, geo.c, geo.h, geo.w],
            ConvPass::BackwardFilter => spec.filter.to_vec(),
        };
        with_output(first.device(), OP, &shape, dtype, |dev, out| {
            let size = dtype.size();
            let (a, b) = (buffer(&first)?, buffer(&second)?);
            dev.convolution(
                pass,
                &spec,
                ConvInput {
                    buffer: &a,
                    offset_bytes: first.layout().offset() * size,
                },
                ConvInput {
                    buffer: &b,
                    offset_bytes: second.layout().offset() * size,
                },
                ConvOutput {
                    buffer: out,
                    offset_bytes: 0,
                },
                dev.default_stream(),
            )?;
            drop((a, b));
            Ok(())
        })
        .map(Some)
    }

    /// `[N, C, H, W]` to `[N, C·KH·KW, OH·OW]`.
    fn im2col(&self, x: &Operand<'_>, g: &Geometry) -> Result<Dense> {
        let shape = [g.n, g.c * g.k(), g.l()];
        let kernel = float_name!("im2col_", x.dtype());
        window_kernel("im2col", kernel, x, g, &shape, x.dtype())
    }

    /// `[N, C·KH·KW, OH·OW]` to `[N, C, H, W]`, summing overlaps.
    fn col2im(&self, cols: &Operand<'_>, g: &Geometry) -> Result<Dense> {
        let shape = [g.n, g.c, g.h, g.w];
        let kernel = float_name!("col2im_", cols.dtype());
        window_kernel("col2im", kernel, cols, g, &shape, cols.dtype())
    }

    /// The `i64` flat index of each window's maximum, `[P, OH·OW]`, for planes `[P, H·W]`.
    fn pool_argmax(&self, x: &Operand<'_>, g: &Geometry) -> Result<Dense> {
        let kernel = float_name!("pool_argmax_", x.dtype());
        window_kernel("max_pool2d", kernel, x, g, &[g.n, g.l()], DType::I64)
    }
}

/// One launch of a kernels/conv.cu kernel over the windows of `g`: a thread per element of the
/// fresh `shape` of `dtype` it writes from the float input `x`.
fn window_kernel(
    op: &'static str,
    kernel: &'static str,
    x: &Operand<'_>,
    g: &Geometry,
    shape: &[usize],
    dtype: DType,
) -> Result<Dense> {
    float_only(op, x.dtype())?;
    let x = dense(x)?;
    let total: usize = shape.iter().product();
    with_output(x.device(), op, shape, dtype, |dev, out| {
        if total > 0 {
            let f = function(dev, kernel)?;
            let src = buffer(&x)?;
            launch(dev, &f, total)
                .arg_buffer(&src)
                .arg_buffer_mut(out)
                .arg_u64(total as u64)
                .arg_pod(&geometry_arg(g))
                .run()?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use ferry_cuda::{compile_ptx, nvrtc_present};

    use super::*;

    /// Every kernel this file launches is exported by kernels/conv.cu (CI has NVRTC 13.0).
    #[test]
    fn conv_kernels_are_exported() {
        if !nvrtc_present() {
            eprintln!("skipped: NVRTC not found");
            return;
        }
        let ptx = compile_ptx(&CONV, "compute_90").unwrap_or_else(|e| panic!("{e}"));
        for d in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            for name in [
                float_name!("im2col_", d),
                float_name!("col2im_", d),
                float_name!("pool_argmax_", d),
            ] {
                assert!(ptx.contains(&format!(".entry {name}(")), "{name} missing");
            }
        }
    }
}
