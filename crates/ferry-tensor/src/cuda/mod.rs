//! CUDA kernels for every primitive: NVRTC-compiled sources from kernels/ for elementwise ops,
//! reductions and softmax, cuBLAS for matrix products. Everything runs on the device's default
//! stream, so ops are ordered without extra synchronization.

pub(crate) mod conv;
pub(crate) mod index;
pub(crate) mod kernels;
mod matmul;
pub(crate) use matmul::linear;
pub(crate) mod norm;
mod reduce;
pub(crate) use reduce::{nll, nll_backward, reduce, softmax, softmax_backward, sum_all};
pub(crate) mod select;

pub use kernels::{ALL as KERNEL_MODULES, compile_kernels};

use ferry_cuda::{Kernels, Launch, blocks_for};
use ferry_memory::cuda::{CudaDevice, DeviceBuffer};
use ferry_memory::{DType, Device, Element};
use parking_lot::MappedRwLockReadGuard;

use crate::layout::Layout;
use crate::op::{BinaryOp, CmpOp, UnaryOp};
use crate::storage::{Buffer, Storage};
use crate::{Result, Tensor, TensorError};
use kernels::Kernel;

pub(crate) use matmul::matmul;

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

fn device_of(t: &Tensor) -> Result<CudaDevice> {
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

/// The device buffer behind a CUDA tensor.
fn buffer(t: &Tensor) -> Result<MappedRwLockReadGuard<'_, DeviceBuffer>> {
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

fn wrap(dev: &CudaDevice, out: DeviceBuffer, dtype: DType, shape: &[usize]) -> Tensor {
    Tensor::from_shape(Storage::new(Buffer::Cuda(out), dtype, dev.device()), shape)
}

/// What every kernel with one fresh output starts and ends with: the CUDA `device` (an
/// input's, or where a tensor is created), memory for a contiguous `shape` of `dtype` there
/// (`op` names it in errors), `run` to load the kernel and launch it into that memory on the
/// device's default stream, and the memory handed back as a tensor of `shape`.
fn with_output(
    device: Device,
    op: &'static str,
    shape: &[usize],
    dtype: DType,
    run: impl FnOnce(&CudaDevice, &mut DeviceBuffer) -> Result<()>,
) -> Result<Tensor> {
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

pub(crate) fn unary(x: &Tensor, op: UnaryOp) -> Result<Tensor> {
    float_only(op.name(), x.dtype())?;
    let n = x.numel();
    with_output(x.device(), op.name(), x.shape(), x.dtype(), |dev, out| {
        let f = Kernel::Unary(x.dtype()).load(dev)?;
        let lx = KernelLayout::of(op.name(), x.layout())?;
        let src = buffer(x)?;
        launch(dev, &f, n)
            .arg_i32(op.code())
            .arg_f64(op.scalar())
            .arg_buffer(&src)
            .arg_pod(&lx)
            .arg_buffer_mut(out)
            .arg_u64(n as u64)
            .run()?;
        Ok(())
    })
}

pub(crate) fn binary(
    a: &Tensor,
    la: &Layout,
    b: &Tensor,
    lb: &Layout,
    op: BinaryOp,
) -> Result<Tensor> {
    float_only(op.name(), a.dtype())?;
    zip(
        a,
        la,
        b,
        lb,
        Kernel::Binary(a.dtype()),
        op.code(),
        a.dtype(),
        op.name(),
    )
}

pub(crate) fn compare(
    a: &Tensor,
    la: &Layout,
    b: &Tensor,
    lb: &Layout,
    op: CmpOp,
) -> Result<Tensor> {
    zip(
        a,
        la,
        b,
        lb,
        Kernel::Compare(a.dtype()),
        op.code(),
        DType::U8,
        op.name(),
    )
}

#[allow(clippy::too_many_arguments)]
fn zip(
    a: &Tensor,
    la: &Layout,
    b: &Tensor,
    lb: &Layout,
    kernel: Kernel,
    code: i32,
    out_dtype: DType,
    op: &'static str,
) -> Result<Tensor> {
    with_output(a.device(), op, la.shape(), out_dtype, |dev, out| {
        let n = la.numel();
        let f = kernel.load(dev)?;
        let (ka, kb) = (KernelLayout::of(op, la)?, KernelLayout::of(op, lb)?);
        let (x, y) = (buffer(a)?, buffer(b)?);
        launch(dev, &f, n)
            .arg_i32(code)
            .arg_buffer(&x)
            .arg_pod(&ka)
            .arg_buffer(&y)
            .arg_pod(&kb)
            .arg_buffer_mut(out)
            .arg_u64(n as u64)
            .run()?;
        Ok(())
    })
}

pub(crate) fn cast(x: &Tensor, dtype: DType) -> Result<Tensor> {
    let n = x.numel();
    with_output(x.device(), "to_dtype", x.shape(), dtype, |dev, out| {
        let f = Kernel::Cast(x.dtype(), dtype).load(dev)?;
        let lx = KernelLayout::of("to_dtype", x.layout())?;
        let src = buffer(x)?;
        launch(dev, &f, n)
            .arg_buffer(&src)
            .arg_pod(&lx)
            .arg_buffer_mut(out)
            .arg_u64(n as u64)
            .run()?;
        Ok(())
    })
}

/// Copies `x`'s elements (in row-major order, from `src`, its buffer) to where `dst` says
/// inside `out`.
fn copy_into(
    dev: &CudaDevice,
    x: &Tensor,
    src: &DeviceBuffer,
    out: &mut DeviceBuffer,
    dst: &Layout,
) -> Result<()> {
    let n = x.numel();
    if n == 0 {
        return Ok(());
    }
    let f = Kernel::Copy(x.dtype().size()).load(dev)?;
    let (lx, lo) = (
        KernelLayout::of("copy", x.layout())?,
        KernelLayout::of("copy", dst)?,
    );
    launch(dev, &f, n)
        .arg_buffer(src)
        .arg_pod(&lx)
        .arg_buffer_mut(out)
        .arg_pod(&lo)
        .arg_u64(n as u64)
        .run()?;
    Ok(())
}

/// Writes `src`'s elements into `dst`'s storage where `dst`'s layout says; `src` has storage of
/// its own (the caller copies it otherwise).
pub(crate) fn assign(dst: &Tensor, src: &Tensor) -> Result<()> {
    let dev = device_of(dst)?;
    let mut locks = Storage::lock_for_update("assign", &[dst.storage()], &[src.storage()])?;
    let (Buffer::Cuda(out), Buffer::Cuda(from)) = (&mut *locks.writes[0], &*locks.reads[0]) else {
        return Err(TensorError::UnsupportedDevice {
            op: "assign",
            device: dst.device(),
        });
    };
    copy_into(&dev, src, from, out, dst.layout())
}

pub(crate) fn contiguous(x: &Tensor) -> Result<Tensor> {
    with_output(
        x.device(),
        "contiguous",
        x.shape(),
        x.dtype(),
        |dev, out| {
            copy_into(dev, x, &*buffer(x)?, out, &Layout::contiguous(x.shape()))?;
            Ok(())
        },
    )
}

pub(crate) fn cat(parts: &[Tensor], axis: usize, shape: &[usize]) -> Result<Tensor> {
    let dtype = parts[0].dtype();
    with_output(parts[0].device(), "cat", shape, dtype, |dev, out| {
        // With nothing before the axis, each part is one run of bytes in the output: gather
        // them all in a few launches (a state dict packs hundreds of tensors this way).
        let outer: usize = shape[..axis].iter().product();
        if outer == 1 && parts.len() > 2 && parts.iter().all(Tensor::is_contiguous) {
            return gather(dev, parts, out);
        }
        let whole = Layout::contiguous(shape);
        let mut start = 0;
        for part in parts {
            let size = part.shape()[axis];
            let at = whole.narrow(axis, start, size);
            copy_into(dev, part, &*buffer(part)?, out, &at)?;
            start += size;
        }
        Ok(())
    })
}

/// Regions per gather launch; the table travels as a kernel parameter (kernels/elementwise.cu).
const GATHER_REGIONS: usize = 64;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct GatherTable {
    entries: [u64; 3 * GATHER_REGIONS],
}

/// Copies each contiguous part's bytes, back to back, into `out`.
fn gather(dev: &CudaDevice, parts: &[Tensor], out: &mut DeviceBuffer) -> Result<()> {
    let mut end = 0;
    let offsets: Vec<usize> = parts
        .iter()
        .map(|p| {
            end += p.nbytes();
            end - p.nbytes()
        })
        .collect();
    gather_at(dev, parts, &offsets, out)
}

/// Copies each contiguous part's bytes to its byte offset in `out`, in a few launches.
fn gather_at(
    dev: &CudaDevice,
    parts: &[Tensor],
    offsets: &[usize],
    out: &mut DeviceBuffer,
) -> Result<()> {
    let f = Kernel::Gather.load(dev)?;
    let sources = parts.iter().map(buffer).collect::<Result<Vec<_>>>()?;
    let batches = parts
        .chunks(GATHER_REGIONS)
        .zip(sources.chunks(GATHER_REGIONS));
    for ((batch, guards), to) in batches.zip(offsets.chunks(GATHER_REGIONS)) {
        let mut table = GatherTable {
            entries: [0; 3 * GATHER_REGIONS],
        };
        let mut bytes = 0;
        for (k, ((part, src), &at)) in batch.iter().zip(guards).zip(to).enumerate() {
            // Raw addresses inside the table: the read guards keep the buffers alive through
            // the launch, and their reuse is ordered on this same stream.
            let start = src.device_ptr() + (part.layout().offset() * part.dtype().size()) as u64;
            table.entries[3 * k..3 * k + 3].copy_from_slice(&[
                start,
                at as u64,
                part.nbytes() as u64,
            ]);
            bytes += part.nbytes();
        }
        let blocks = blocks_for((bytes / 16).max(1), THREADS).min(max_blocks(dev));
        dev.launch(&f, (blocks, 1, 1), (THREADS, 1, 1), 0, dev.default_stream())
            .arg_pod(&table)
            .arg_u64(batch.len() as u64)
            .arg_buffer_mut(out)
            .run()?;
    }
    Ok(())
}

/// Packs contiguous CUDA tensors of one dtype into one fresh 1-D buffer at `offsets` (bytes);
/// `len` bytes in all.
pub(crate) fn pack(parts: &[Tensor], offsets: &[usize], len: usize) -> Result<Tensor> {
    let dev = device_of(&parts[0])?;
    let dtype = parts[0].dtype();
    let mut out = dev.alloc(len, dev.default_stream())?;
    gather_at(&dev, parts, offsets, &mut out)?;
    Ok(wrap(&dev, out, dtype, &[len / dtype.size()]))
}

/// One fused Adam step on contiguous tensors, in place on `p`, `m` and `v`.
pub(crate) fn adam(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    step: &crate::op::AdamStep,
) -> Result<()> {
    float_only("adam_update", p.dtype())?;
    let dev = device_of(p)?;
    let f = Kernel::Adam(p.dtype()).load(&dev)?;
    let n = p.numel();
    let mut locks = Storage::lock_for_update(
        "adam_update",
        &[p.storage(), m.storage(), v.storage()],
        &[g.storage()],
    )?;
    let [pw, mw, vw] = &mut locks.writes[..] else {
        unreachable!("three write locks were asked for")
    };
    let (Buffer::Cuda(pb), Buffer::Cuda(mb), Buffer::Cuda(vb), Buffer::Cuda(grad)) =
        (&mut **pw, &mut **mw, &mut **vw, &*locks.reads[0])
    else {
        return Err(TensorError::UnsupportedDevice {
            op: "adam_update",
            device: p.device(),
        });
    };
    let offset = |t: &Tensor| t.layout().offset() as u64;
    launch(&dev, &f, n)
        .arg_buffer_mut(pb)
        .arg_u64(offset(p))
        .arg_buffer(grad)
        .arg_u64(offset(g))
        .arg_buffer_mut(mb)
        .arg_u64(offset(m))
        .arg_buffer_mut(vb)
        .arg_u64(offset(v))
        .arg_u64(n as u64)
        .arg_pod(step)
        .run()?;
    Ok(())
}

pub(crate) fn full(device: Device, shape: &[usize], dtype: DType, value: f64) -> Result<Tensor> {
    with_output(device, "full", shape, dtype, |dev, out| {
        let n = crate::layout::numel(shape);
        let f = Kernel::Fill(dtype).load(dev)?;
        launch(dev, &f, n)
            .arg_buffer_mut(out)
            .arg_u64(n as u64)
            .arg_f64(value)
            .run()?;
        Ok(())
    })
}

pub(crate) fn arange(ordinal: usize, start: f64, len: usize, dtype: DType) -> Result<Tensor> {
    with_output(
        Device::Cuda(ordinal),
        "arange",
        &[len],
        dtype,
        |dev, out| {
            let f = Kernel::Arange(dtype).load(dev)?;
            launch(dev, &f, len)
                .arg_buffer_mut(out)
                .arg_u64(len as u64)
                .arg_f64(start)
                .run()?;
            Ok(())
        },
    )
}

/// Uniform (or normal) samples; element i depends only on (seed, i).
pub(crate) fn random(
    ordinal: usize,
    shape: &[usize],
    dtype: DType,
    seed: u64,
    normal: bool,
) -> Result<Tensor> {
    let op = if normal { "randn" } else { "rand" };
    float_only(op, dtype)?;
    with_output(Device::Cuda(ordinal), op, shape, dtype, |dev, out| {
        let n = crate::layout::numel(shape);
        let f = Kernel::Random(dtype).load(dev)?;
        launch(dev, &f, n)
            .arg_buffer_mut(out)
            .arg_u64(n as u64)
            .arg_u64(seed)
            .arg_i32(normal as i32)
            .run()?;
        Ok(())
    })
}

/// `x` itself when its elements start at 0 and are contiguous, else a fresh copy that does:
/// reductions and softmax index from the start of their buffer.
fn dense(x: &Tensor) -> Result<Tensor> {
    if x.is_contiguous() && x.layout().offset() == 0 {
        Ok(x.clone())
    } else {
        contiguous(x)
    }
}

/// Elements of a contiguous CUDA tensor, copied out to a `Vec`.
pub(crate) fn read_elements<T: Element>(x: &Tensor) -> Result<Vec<T>> {
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
