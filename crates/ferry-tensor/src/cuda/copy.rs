//! Copies that rearrange elements on a GPU: strided to contiguous, writes into a view, and
//! concatenation and packing (a gather of many regions in a few launches).

use ferry_cuda::{Kernels, blocks_for};
use ferry_memory::cuda::{CudaDevice, DeviceBuffer};

use super::kernels::Kernel;
use super::{
    Cuda, KernelLayout, THREADS, buffer, device_of, launch, max_blocks, with_output, wrap,
};
use crate::kernel::{Copies, Dense, Operand, View};
use crate::layout::Layout;
use crate::storage::{Buffer, Storage};
use crate::{Result, TensorError};

/// Copies `x`'s elements (in row-major order, from `src`, its buffer) to where `dst` says
/// inside `out`.
pub(super) fn copy_into(
    dev: &CudaDevice,
    x: &Operand<'_>,
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

impl Copies for Cuda {
    fn contiguous(&self, x: &Operand<'_>) -> Result<Dense> {
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

    /// Writes `src`'s elements into `dst`'s storage where `dst`'s layout says; `src` has storage of
    /// its own (the caller copies it otherwise).
    fn assign(&self, dst: &Operand<'_>, src: &Operand<'_>) -> Result<()> {
        let dev = device_of(dst)?;
        let mut locks = Storage::lock_for_update("assign", &[dst.storage()], &[src.storage()])?;
        let (Buffer::Cuda(out), Buffer::Cuda(from)) = (&mut *locks.writes[0], &*locks.reads[0])
        else {
            return Err(TensorError::UnsupportedDevice {
                op: "assign",
                device: dst.device(),
            });
        };
        copy_into(&dev, src, from, out, dst.layout())
    }

    fn cat(&self, parts: &[Operand<'_>], axis: usize, shape: &[usize]) -> Result<Dense> {
        let dtype = parts[0].dtype();
        with_output(parts[0].device(), "cat", shape, dtype, |dev, out| {
            // With nothing before the axis, each part is one run of bytes in the output: gather
            // them all in a few launches (a state dict packs hundreds of tensors this way).
            let outer: usize = shape[..axis].iter().product();
            if outer == 1 && parts.len() > 2 && parts.iter().all(|p| p.is_contiguous()) {
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

    /// Packs contiguous CUDA operands of one dtype into one fresh 1-D buffer at `offsets` (bytes);
    /// `len` bytes in all.
    fn pack(&self, parts: &[Operand<'_>], offsets: &[usize], len: usize) -> Result<Dense> {
        let dev = device_of(&parts[0])?;
        let dtype = parts[0].dtype();
        let mut out = dev.alloc(len, dev.default_stream())?;
        gather_at(&dev, parts, offsets, &mut out)?;
        Ok(wrap(&dev, out, dtype, &[len / dtype.size()]))
    }
}

/// Regions per gather launch; the table travels as a kernel parameter (kernels/elementwise.cu).
const GATHER_REGIONS: usize = 64;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct GatherTable {
    entries: [u64; 3 * GATHER_REGIONS],
}

/// Copies each contiguous part's bytes, back to back, into `out`.
fn gather(dev: &CudaDevice, parts: &[Operand<'_>], out: &mut DeviceBuffer) -> Result<()> {
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
    parts: &[Operand<'_>],
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
