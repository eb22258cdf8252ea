//! CUDA kernels for every primitive: NVRTC-compiled sources from kernels/ for elementwise ops,
//! reductions and softmax, cuBLAS for matrix products. Everything runs on the device's default
//! stream, so ops are ordered without extra synchronization.

mod attention;
mod conv;
mod copy;
mod create;
mod elementwise;
mod index;
pub(crate) mod kernels;
mod loss;
mod matmul;
mod norm;
mod optim;
mod reduce;
mod select;

pub use kernels::{ALL as KERNEL_MODULES, compile_copy_kernels, compile_kernels};

use ferry_cuda::{Kernels, Launch, blocks_for};
use ferry_memory::cuda::{CudaDevice, DeviceBuffer};
use ferry_memory::{DType, Device, Element};
use parking_lot::MappedRwLockReadGuard;

use crate::Result;
use crate::TensorError;
use crate::kernel::{Copies, Dense, Operand, Source, View};
use crate::layout::Layout;
use crate::storage::{Buffer, Storage};

/// The kernels of CUDA devices (each call runs on its operands' device): each family's trait
/// (`kernel`) is implemented in its file here.
pub(crate) struct Cuda;

const THREADS: u32 = 256;
/// Blocks a grid-stride kernel is given per multiprocessor: enough to keep each one busy
/// (several resident blocks hide latency), few enough that a block does real work per launch.
const BLOCKS_PER_SM: u32 = 32;
/// Blocks of the row (and tile) kernels' grid-stride loops: blocks beyond this many wait anyway.
const MAX_ROW_BLOCKS: u32 = 65535;

/// A layout as the kernels' `Strided` struct sees it (kernels/common.cuh).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct KernelLayout {
    shape: [u64; 8],
    strides: [u64; 8],
    offset: u64,
    ndim: u32,
    contiguous: u32,
}

impl KernelLayout {
    fn of(op: &'static str, layout: &Layout) -> Result<Self> {
        if layout.ndim() > 8 {
            return Err(TensorError::InvalidArgument {
                op,
                message: format!(
                    "CUDA kernels take at most 8 dimensions, got {}; reshape first",
                    layout.ndim()
                ),
            });
        }
        let mut k = KernelLayout {
            shape: [1; 8],
            strides: [0; 8],
            offset: layout.offset() as u64,
            ndim: layout.ndim() as u32,
            // 1: contiguous; 2: strided with 32-bit index math; 0: strided, 64-bit.
            contiguous: if layout.is_contiguous() {
                1
            } else if layout.numel() < (1 << 32) {
                2
            } else {
                0
            },
        };
        for (d, (&n, &s)) in layout.shape().iter().zip(layout.strides()).enumerate() {
            k.shape[d] = n as u64;
            k.strides[d] = s as u64;
        }
        Ok(k)
    }
}

pub(crate) fn device(ordinal: usize) -> Result<CudaDevice> {
    Ok(CudaDevice::get(ordinal)?)
}

fn device_of(t: &impl View) -> Result<CudaDevice> {
    cuda_device(t.device())
}

fn cuda_device(device: Device) -> Result<CudaDevice> {
    match device {
        Device::Cuda(ordinal) => self::device(ordinal),
        other => Err(TensorError::UnsupportedDevice {
            op: "cuda kernel",
            device: other,
        }),
    }
}

/// The device buffer behind a CUDA operand.
fn buffer(t: &impl View) -> Result<MappedRwLockReadGuard<'_, DeviceBuffer>> {
    parking_lot::RwLockReadGuard::try_map(t.storage().read(), |b| match b {
        Buffer::Cuda(d) => Some(d),
        _ => None,
    })
    .map_err(|_| TensorError::UnsupportedDevice {
        op: "cuda kernel",
        device: t.device(),
    })
}

/// Device memory for a contiguous `shape` of `dtype`, sized by the checked helper: a shape too
/// large to address is refused here, before a wrapped size could allocate a few bytes that a
/// kernel then overruns.
fn alloc(
    dev: &CudaDevice,
    op: &'static str,
    shape: &[usize],
    dtype: DType,
) -> Result<DeviceBuffer> {
    let bytes = crate::layout::shape_bytes(op, shape, dtype)?;
    Ok(dev.alloc(bytes, dev.default_stream())?)
}

fn wrap(dev: &CudaDevice, out: DeviceBuffer, dtype: DType, shape: &[usize]) -> Dense {
    Dense::new(Storage::new(Buffer::Cuda(out), dtype, dev.device()), shape)
}

/// What every kernel with one fresh output starts and ends with: the CUDA `device` (an
/// input's, or where an array is created), memory for a contiguous `shape` of `dtype` there
/// (`op` names it in errors), `run` to load the kernel and launch it into that memory on the
/// device's default stream, and the memory handed back as the output of `shape`.
fn with_output(
    device: Device,
    op: &'static str,
    shape: &[usize],
    dtype: DType,
    run: impl FnOnce(&CudaDevice, &mut DeviceBuffer) -> Result<()>,
) -> Result<Dense> {
    let dev = cuda_device(device)?;
    let mut out = alloc(&dev, op, shape, dtype)?;
    run(&dev, &mut out)?;
    Ok(wrap(&dev, out, dtype, shape))
}

/// A one-dimensional grid-stride launch over `n` elements.
fn launch<'a>(dev: &'a CudaDevice, f: &'a ferry_cuda::CudaFunction, n: usize) -> Launch<'a> {
    let blocks = blocks_for(n.max(1), THREADS).min(max_blocks(dev));
    dev.launch(f, (blocks, 1, 1), (THREADS, 1, 1), 0, dev.default_stream())
}

/// The most blocks a grid-stride kernel needs on `dev`: [`BLOCKS_PER_SM`] for each of its
/// multiprocessors (132 on an H200, so 4,224).
fn max_blocks(dev: &CudaDevice) -> u32 {
    blocks_for_multiprocessors(dev.info().multiprocessors)
}

/// [`BLOCKS_PER_SM`] per multiprocessor; a count the driver reported as 0 or less counts as one.
fn blocks_for_multiprocessors(multiprocessors: i32) -> u32 {
    let sms = u32::try_from(multiprocessors).unwrap_or(1).max(1);
    sms.saturating_mul(BLOCKS_PER_SM)
}

fn float_only(op: &'static str, dtype: DType) -> Result<()> {
    if dtype.is_float() {
        Ok(())
    } else {
        Err(TensorError::UnsupportedDType {
            op,
            dtype,
            hint: "only float dtypes support this; cast with `.to_dtype(DType::F32)`",
        })
    }
}

/// `x` itself when its elements start at 0 and are contiguous, else a fresh copy that does:
/// reductions and softmax index from the start of their buffer.
fn dense<'a>(x: &Operand<'a>) -> Result<Source<'a>> {
    if x.is_contiguous() && x.layout().offset() == 0 {
        Ok(Source::InPlace(*x))
    } else {
        Cuda.contiguous(x).map(Source::Copy)
    }
}

/// Elements of a contiguous CUDA operand, copied out to a `Vec`.
pub(crate) fn read_elements<T: Element>(x: &Operand<'_>) -> Result<Vec<T>> {
    let dev = device_of(x)?;
    let mut data = vec![<T as Element>::from_f64(0.0); x.numel()];
    let src = buffer(x)?;
    let offset = x.layout().offset() * x.dtype().size();
    src.copy_to_host_at(
        offset,
        bytemuck::cast_slice_mut(&mut data),
        dev.default_stream(),
    )?;
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_stride_caps_follow_the_multiprocessor_count() {
        assert_eq!(blocks_for_multiprocessors(132), 132 * BLOCKS_PER_SM);
        assert_eq!(blocks_for_multiprocessors(16), 16 * BLOCKS_PER_SM);
        // A count the driver should never report still gives a usable grid.
        assert_eq!(blocks_for_multiprocessors(0), BLOCKS_PER_SM);
        assert_eq!(blocks_for_multiprocessors(-4), BLOCKS_PER_SM);
        assert_eq!(blocks_for_multiprocessors(i32::MAX), u32::MAX);
    }
}
