//! Indexing along one axis on a GPU (kernels/index.cu). Each launch counts out-of-range indices
//! in a 16-byte flag (count, one bad value) that is read back after it, so a bad index is an
//! error here as on the CPU; the kernels skip such indices and touch nothing outside the tensors.

use ferry_cuda::{CudaFunction, Kernels};
use ferry_memory::DType;
use ferry_memory::cuda::{CudaDevice, DeviceBuffer};

use super::copy::copy_into;
use super::kernels::INDEX;
use super::{Cuda, buffer, dense, float_only, launch, with_output};
use crate::kernel::{Dense, Indexing, Operand, View};
use crate::layout::{Layout, contiguous_strides, numel};
use crate::op::message::out_of_range;
use crate::{Result, TensorError};

/// An iteration shape over a target's strides, with the index replacing one axis; mirrors
/// `IndexGeom` in kernels/index.cu.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct IndexGeom {
    shape: [u64; 8],
    strides: [u64; 8],
    offset: u64,
    axis_len: u64,
    ndim: u32,
    axis: u32,
}

impl IndexGeom {
    fn new(
        op: &'static str,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
        axis: usize,
        axis_len: usize,
    ) -> Result<Self> {
        if shape.len() > 8 {
            return Err(TensorError::InvalidArgument {
                op,
                message: format!(
                    "CUDA kernels take at most 8 dimensions, got {}; reshape first",
                    shape.len()
                ),
            });
        }
        let mut g = IndexGeom {
            shape: [1; 8],
            strides: [0; 8],
            offset: offset as u64,
            axis_len: axis_len as u64,
            ndim: shape.len() as u32,
            axis: axis as u32,
        };
        for (d, (&n, &s)) in shape.iter().zip(strides).enumerate() {
            g.shape[d] = n as u64;
            g.strides[d] = s as u64;
        }
        Ok(g)
    }
}

/// The kernel `name` of kernels/index.cu.
fn function(dev: &CudaDevice, name: &'static str) -> Result<CudaFunction> {
    Ok(dev.function(&INDEX, name)?)
}

/// The copy kernel of `prefix` for elements of `size` bytes.
fn copy_kernel(prefix: &str, size: usize) -> &'static str {
    match (prefix, size) {
        ("index_select", 1) => "index_select_b8",
        ("index_select", 2) => "index_select_b16",
        ("index_select", 4) => "index_select_b32",
        ("index_select", _) => "index_select_b64",
        (_, 1) => "gather_axis_b8",
        (_, 2) => "gather_axis_b16",
        (_, 4) => "gather_axis_b32",
        _ => "gather_axis_b64",
    }
}

/// The accumulating kernel (`index_add` or `scatter_add`) for a float dtype.
fn add_kernel(scatter: bool, dtype: DType) -> &'static str {
    match (scatter, dtype) {
        (false, DType::F64) => "index_add_double",
        (false, DType::F16) => "index_add_f16",
        (false, DType::BF16) => "index_add_bf16",
        (false, _) => "index_add_float",
        (true, DType::F64) => "scatter_add_double",
        (true, DType::F16) => "scatter_add_f16",
        (true, DType::BF16) => "scatter_add_bf16",
        (true, _) => "scatter_add_float",
    }
}

/// Reads the launch's flag back: an error naming the range when any index was outside it.
fn check_flag(
    dev: &CudaDevice,
    bad: &DeviceBuffer,
    op: &'static str,
    len: usize,
    axis: usize,
    shape: &[usize],
) -> Result<()> {
    let mut flag = [0u64; 2];
    bad.copy_to_host_at(0, bytemuck::cast_slice_mut(&mut flag), dev.default_stream())?;
    if flag[0] == 0 {
        return Ok(());
    }
    Err(out_of_range(op, flag[0], flag[1] as i64, len, axis, shape))
}

/// `[outer, len, inner]` around `axis`.
fn split(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    (
        shape[..axis].iter().product(),
        shape[axis],
        shape[axis + 1..].iter().product(),
    )
}

impl Indexing for Cuda {
    fn index_select(&self, x: &Operand<'_>, axis: usize, index: &Operand<'_>) -> Result<Dense> {
        const OP: &str = "index_select";
        let (x, idx) = (dense(x)?, dense(index)?);
        let (_, len, inner) = split(x.shape(), axis);
        let k = idx.numel();
        let mut shape = x.shape().to_vec();
        shape[axis] = k;
        with_output(x.device(), OP, &shape, x.dtype(), |dev, out| {
            let n = numel(&shape);
            if n > 0 {
                let f = function(dev, copy_kernel(OP, x.dtype().size()))?;
                let mut bad = dev.alloc_zeroed(16, dev.default_stream())?;
                let (src, ib) = (buffer(&x)?, buffer(&idx)?);
                launch(dev, &f, n)
                    .arg_buffer(&src)
                    .arg_buffer(&ib)
                    .arg_buffer_mut(out)
                    .arg_u64(len as u64)
                    .arg_u64(k as u64)
                    .arg_u64(inner as u64)
                    .arg_u64(n as u64)
                    .arg_buffer_mut(&mut bad)
                    .run()?;
                check_flag(dev, &bad, OP, len, axis, x.shape())?;
            }
            Ok(())
        })
    }

    fn index_add(
        &self,
        x: &Operand<'_>,
        axis: usize,
        index: &Operand<'_>,
        src: &Operand<'_>,
    ) -> Result<Dense> {
        const OP: &str = "index_add";
        float_only(OP, x.dtype())?;
        let (idx, src) = (dense(index)?, dense(src)?);
        let (_, len, inner) = split(x.shape(), axis);
        let k = idx.numel();
        with_output(x.device(), OP, x.shape(), x.dtype(), |dev, out| {
            copy_of(dev, x, out)?;
            let n = src.numel();
            if n > 0 {
                let f = function(dev, add_kernel(false, x.dtype()))?;
                let mut bad = dev.alloc_zeroed(16, dev.default_stream())?;
                let (from, ib) = (buffer(&src)?, buffer(&idx)?);
                launch(dev, &f, n)
                    .arg_buffer_mut(out)
                    .arg_buffer(&ib)
                    .arg_buffer(&from)
                    .arg_u64(len as u64)
                    .arg_u64(k as u64)
                    .arg_u64(inner as u64)
                    .arg_u64(n as u64)
                    .arg_buffer_mut(&mut bad)
                    .run()?;
                check_flag(dev, &bad, OP, len, axis, x.shape())?;
            }
            Ok(())
        })
    }

    fn gather(&self, x: &Operand<'_>, axis: usize, index: &Operand<'_>) -> Result<Dense> {
        const OP: &str = "gather";
        let idx = dense(index)?;
        let shape = idx.shape().to_vec();
        with_output(x.device(), OP, &shape, x.dtype(), |dev, out| {
            let n = idx.numel();
            if n > 0 {
                // x is read through its own strides: no copy of a view.
                let geom = IndexGeom::new(
                    OP,
                    &shape,
                    x.layout().strides(),
                    x.layout().offset(),
                    axis,
                    x.shape()[axis],
                )?;
                let f = function(dev, copy_kernel(OP, x.dtype().size()))?;
                let mut bad = dev.alloc_zeroed(16, dev.default_stream())?;
                let (src, ib) = (buffer(x)?, buffer(&idx)?);
                launch(dev, &f, n)
                    .arg_buffer(&src)
                    .arg_pod(&geom)
                    .arg_buffer(&ib)
                    .arg_buffer_mut(out)
                    .arg_u64(n as u64)
                    .arg_buffer_mut(&mut bad)
                    .run()?;
                check_flag(dev, &bad, OP, x.shape()[axis], axis, x.shape())?;
            }
            Ok(())
        })
    }

    fn scatter_add(
        &self,
        x: &Operand<'_>,
        axis: usize,
        index: &Operand<'_>,
        src: &Operand<'_>,
    ) -> Result<Dense> {
        const OP: &str = "scatter_add";
        float_only(OP, x.dtype())?;
        let (idx, src) = (dense(index)?, dense(src)?);
        with_output(x.device(), OP, x.shape(), x.dtype(), |dev, out| {
            copy_of(dev, x, out)?;
            let n = idx.numel();
            if n > 0 {
                let geom = IndexGeom::new(
                    OP,
                    idx.shape(),
                    &contiguous_strides(x.shape()),
                    0,
                    axis,
                    x.shape()[axis],
                )?;
                let f = function(dev, add_kernel(true, x.dtype()))?;
                let mut bad = dev.alloc_zeroed(16, dev.default_stream())?;
                let (from, ib) = (buffer(&src)?, buffer(&idx)?);
                launch(dev, &f, n)
                    .arg_buffer_mut(out)
                    .arg_pod(&geom)
                    .arg_buffer(&ib)
                    .arg_buffer(&from)
                    .arg_u64(n as u64)
                    .arg_buffer_mut(&mut bad)
                    .run()?;
                check_flag(dev, &bad, OP, x.shape()[axis], axis, x.shape())?;
            }
            Ok(())
        })
    }
}

/// Copies `x` into `out` (fresh, of `x`'s shape), to accumulate into.
fn copy_of(dev: &CudaDevice, x: &Operand<'_>, out: &mut DeviceBuffer) -> Result<()> {
    copy_into(dev, x, &*buffer(x)?, out, &Layout::contiguous(x.shape()))
}

#[cfg(test)]
mod tests {
    use ferry_cuda::{compile_ptx, nvrtc_present};

    use super::*;

    /// Every kernel name this file launches is an entry of the compiled module (CI runs this
    /// with NVRTC 13.0; without NVRTC it says it was skipped).
    #[test]
    fn index_kernels_compile_and_are_exported() {
        if !nvrtc_present() {
            eprintln!("skipped: NVRTC not found");
            return;
        }
        let ptx = compile_ptx(&INDEX, "compute_90").unwrap_or_else(|e| panic!("{e}"));
        let mut names: Vec<&str> = [1, 2, 4, 8]
            .iter()
            .flat_map(|&s| [copy_kernel("index_select", s), copy_kernel("gather", s)])
            .collect();
        for d in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            names.extend([add_kernel(false, d), add_kernel(true, d)]);
        }
        for name in names {
            assert!(ptx.contains(&format!(".entry {name}(")), "{name} missing");
        }
    }

    #[test]
    fn the_geometry_matches_the_kernels_struct() {
        // 8 shape + 8 strides + offset + axis_len (u64 each), then two u32: no padding.
        assert_eq!(std::mem::size_of::<IndexGeom>(), 18 * 8 + 8);
    }
}
