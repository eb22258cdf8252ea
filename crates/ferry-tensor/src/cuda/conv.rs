//! im2col, col2im and the pooling argmax on a GPU (kernels/conv.cu): grid-stride kernels, one
//! thread per output element; col2im gathers (no atomics), so its sums are deterministic. The
//! convolution's products run through the cuBLAS path of `Tensor::matmul`.

use ferry_memory::DType;
use ferry_memory::cuda::{CudaDevice, CudaFunction};

use super::kernels::CONV;
use super::{alloc, buffer, dense, device_of, float_only, launch, wrap};
use crate::ops::conv::Geometry;
use crate::{Result, Tensor};

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

/// `[N, C, H, W]` to `[N, C·KH·KW, OH·OW]`.
pub(crate) fn im2col(x: &Tensor, g: &Geometry) -> Result<Tensor> {
    const OP: &str = "im2col";
    float_only(OP, x.dtype())?;
    let x = dense(x)?;
    let dev = device_of(&x)?;
    let shape = [g.n, g.c * g.k(), g.l()];
    let total: usize = shape.iter().product();
    let mut out = alloc(&dev, OP, &shape, x.dtype())?;
    if total > 0 {
        let f = function(&dev, float_name!("im2col_", x.dtype()))?;
        let src = buffer(&x)?;
        launch(&dev, &f, total)
            .arg_buffer(&src)
            .arg_buffer_mut(&mut out)
            .arg_u64(total as u64)
            .arg_pod(&geometry_arg(g))
            .run()?;
    }
    Ok(wrap(&dev, out, x.dtype(), &shape))
}

/// `[N, C·KH·KW, OH·OW]` to `[N, C, H, W]`, summing overlaps.
pub(crate) fn col2im(cols: &Tensor, g: &Geometry) -> Result<Tensor> {
    const OP: &str = "col2im";
    float_only(OP, cols.dtype())?;
    let cols = dense(cols)?;
    let dev = device_of(&cols)?;
    let shape = [g.n, g.c, g.h, g.w];
    let total: usize = shape.iter().product();
    let mut out = alloc(&dev, OP, &shape, cols.dtype())?;
    if total > 0 {
        let f = function(&dev, float_name!("col2im_", cols.dtype()))?;
        let src = buffer(&cols)?;
        launch(&dev, &f, total)
            .arg_buffer(&src)
            .arg_buffer_mut(&mut out)
            .arg_u64(total as u64)
            .arg_pod(&geometry_arg(g))
            .run()?;
    }
    Ok(wrap(&dev, out, cols.dtype(), &shape))
}

/// The `i64` flat index of each window's maximum, `[P, OH·OW]`, for planes `[P, H·W]`.
pub(crate) fn pool_argmax(x: &Tensor, g: &Geometry) -> Result<Tensor> {
    const OP: &str = "max_pool2d";
    float_only(OP, x.dtype())?;
    let x = dense(x)?;
    let dev = device_of(&x)?;
    let shape = [g.n, g.l()];
    let total: usize = shape.iter().product();
    let mut out = alloc(&dev, OP, &shape, DType::I64)?;
    if total > 0 {
        let f = function(&dev, float_name!("pool_argmax_", x.dtype()))?;
        let src = buffer(&x)?;
        launch(&dev, &f, total)
            .arg_buffer(&src)
            .arg_buffer_mut(&mut out)
            .arg_u64(total as u64)
            .arg_pod(&geometry_arg(g))
            .run()?;
    }
    Ok(wrap(&dev, out, DType::I64, &shape))
}

#[cfg(test)]
mod tests {
    use ferry_memory::cuda::{compile_ptx, nvrtc_present};

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
