//! The pipelines behind chunked moves: pieces go through a ring of pinned staging buffers on a
//! dedicated stream, so the DMA of one piece overlaps the host copy of the previous one.
//!
//! When the pinned budget has no room even for the staging ring, the pieces go through the
//! driver's own pageable path instead (slower, but bounded and correct). Moves whose results
//! do not fit the pinned budget come here too (see `copy::beyond_budget`).

use ferry_memory::cuda::{CudaDevice, PinnedBuffer, PinnedPool, Stream};
use ferry_memory::{Device, HostBuffer, HostPool};
use ferry_tensor::{Buffer, Result, Tensor, TensorError};

use crate::plan::ChunkPlan;
use crate::report::{TransferPath, TransferReport};
use crate::staging::{
    StagingMeter, after_default, copy_bytes, cuda, staging_ring, transfer_stream, wrap,
};

/// Where piece `i` of a source comes from: a byte range of the source's own storage when it is
/// contiguous, else a contiguous copy of the piece made on the source's device (so scratch
/// memory is bounded by one piece, like the staging). Returns the tensor, the byte offset and
/// the scratch bytes it holds (0 for a range of the source).
pub(crate) fn piece_source(
    src: &Tensor,
    plan: &ChunkPlan,
    i: usize,
) -> Result<(Tensor, usize, usize)> {
    let elem = src.dtype().size();
    if src.is_contiguous() {
        return Ok((
            src.clone(),
            src.layout().offset() * elem + plan.byte_range(i).start,
            0,
        ));
    }
    let rows = &plan.pieces()[i];
    let piece = src.narrow(0, rows.start, rows.len())?.copy()?;
    let offset = piece.layout().offset() * elem;
    let scratch = match piece.device() {
        Device::Cuda(_) => CudaDevice::block_size(piece.nbytes()),
        Device::Cpu => piece.nbytes(),
    };
    Ok((piece, offset, scratch))
}

/// GPU to pageable host memory (from the host pool) through the staging ring.
pub(crate) fn device_to_host(
    src: &Tensor,
    ordinal: usize,
    plan: &ChunkPlan,
) -> Result<(Tensor, TransferReport)> {
    let dev = cuda(ordinal)?;
    let pool = PinnedPool::global()?;
    // Pooled pages are already faulted in: fresh ones would cost more than the link.
    let mut out = HostPool::global().alloc(src.nbytes())?;
    let mut meter = StagingMeter::default();
    match staging_ring(pool, plan.staging_buffers(), plan.piece_bytes(), &mut meter)? {
        Some(ring) => download_through(src, &dev, plan, ring, &mut out, &mut meter)?,
        None => download_direct(src, &dev, plan, &mut out, &mut meter)?,
    }
    let mut report =
        TransferReport::new(TransferPath::Chunked { chunks: plan.len() }, src.nbytes());
    report.staging_peak_bytes = meter.peak();
    Ok((wrap(Buffer::Host(out), src, Device::Cpu), report))
}

/// Queues the download of piece `i` into `staging` on `stream`.
pub(crate) fn queue_download(
    src: &Tensor,
    dev: &CudaDevice,
    plan: &ChunkPlan,
    i: usize,
    staging: &mut PinnedBuffer,
    stream: &Stream,
    meter: &mut StagingMeter,
) -> Result<()> {
    let (piece, offset, scratch) = piece_source(src, plan, i)?;
    meter.hold(scratch);
    if scratch > 0 {
        // The piece was just made contiguous on the default stream.
        after_default(dev, stream)?;
    }
    {
        let guard = piece.storage().read();
        let Buffer::Cuda(from) = &*guard else {
            return Err(TensorError::UnsupportedDevice {
                op: "to_chunked",
                device: piece.device(),
            });
        };
        let mut batch = staging.batch(stream)?;
        batch.download(from, offset, 0, plan.byte_range(i).len())?;
        batch.finish()?;
    }
    // The scratch piece goes back to the allocator, its reuse ordered after the download.
    drop(piece);
    meter.release(scratch);
    Ok(())
}

fn download_through(
    src: &Tensor,
    dev: &CudaDevice,
    plan: &ChunkPlan,
    mut ring: Vec<PinnedBuffer>,
    out: &mut HostBuffer,
    meter: &mut StagingMeter,
) -> Result<()> {
    let stream = transfer_stream(dev)?;
    let slots = ring.len();
    after_default(dev, &stream)?;
    for (i, staging) in ring.iter_mut().enumerate() {
        queue_download(src, dev, plan, i, staging, &stream, meter)?;
    }
    for i in 0..plan.len() {
        let range = plan.byte_range(i);
        let staging = &mut ring[i % slots];
        // Waits for piece i only; piece i + 1 is in flight in the other buffer meanwhile.
        let bytes = staging.as_bytes()?;
        copy_bytes(
            &mut out.as_bytes_mut()[range.clone()],
            &bytes[..range.len()],
        );
        if i + slots < plan.len() {
            queue_download(src, dev, plan, i + slots, staging, &stream, meter)?;
        }
    }
    let ring_bytes = ring.iter().map(PinnedBuffer::block_size).sum();
    drop(ring);
    meter.release(ring_bytes);
    Ok(())
}

/// Without pinned staging: each piece through the driver's pageable path, on the default
/// stream (ordered after the source's producers), one at a time.
fn download_direct(
    src: &Tensor,
    dev: &CudaDevice,
    plan: &ChunkPlan,
    out: &mut HostBuffer,
    meter: &mut StagingMeter,
) -> Result<()> {
    for i in 0..plan.len() {
        let range = plan.byte_range(i);
        let (piece, offset, scratch) = piece_source(src, plan, i)?;
        meter.hold(scratch);
        {
            let guard = piece.storage().read();
            let Buffer::Cuda(from) = &*guard else {
                return Err(TensorError::UnsupportedDevice {
                    op: "to_chunked",
                    device: piece.device(),
                });
            };
            from.copy_to_host_at(offset, &mut out.as_bytes_mut()[range], dev.default_stream())?;
        }
        drop(piece);
        meter.release(scratch);
    }
    Ok(())
}

/// Host memory to a GPU through the staging ring: the host fills one buffer while the other
/// uploads.
pub(crate) fn host_to_device(
    src: &Tensor,
    ordinal: usize,
    plan: &ChunkPlan,
) -> Result<(Tensor, TransferReport)> {
    let dev = cuda(ordinal)?;
    let pool = PinnedPool::global()?;
    let mut out = dev.alloc(src.nbytes(), dev.default_stream())?;
    let mut meter = StagingMeter::default();
    match staging_ring(pool, plan.staging_buffers(), plan.piece_bytes(), &mut meter)? {
        Some(ring) => upload_through(src, &dev, plan, ring, &mut out, &mut meter)?,
        None => {
            // Without pinned staging: the driver's pageable path, a piece at a time.
            for i in 0..plan.len() {
                let range = plan.byte_range(i);
                let (piece, offset, scratch) = piece_source(src, plan, i)?;
                meter.hold(scratch);
                let guard = piece.storage().read();
                let bytes = host_bytes(&guard, &piece)?;
                out.copy_from_host_at(
                    range.start,
                    &bytes[offset..offset + range.len()],
                    dev.default_stream(),
                )?;
                drop(guard);
                meter.release(scratch);
            }
        }
    }
    let mut report =
        TransferReport::new(TransferPath::Chunked { chunks: plan.len() }, src.nbytes());
    report.staging_peak_bytes = meter.peak();
    Ok((wrap(Buffer::Cuda(out), src, Device::Cuda(ordinal)), report))
}

fn host_bytes<'a>(buffer: &'a Buffer, piece: &Tensor) -> Result<&'a [u8]> {
    buffer.host_slice("to_chunked", piece.device())
}

fn upload_through(
    src: &Tensor,
    dev: &CudaDevice,
    plan: &ChunkPlan,
    mut ring: Vec<PinnedBuffer>,
    out: &mut ferry_memory::cuda::DeviceBuffer,
    meter: &mut StagingMeter,
) -> Result<()> {
    let stream = transfer_stream(dev)?;
    // The block may have been freed by work still queued on the default stream.
    after_default(dev, &stream)?;
    let slots = ring.len();
    for i in 0..plan.len() {
        let range = plan.byte_range(i);
        let (piece, offset, scratch) = piece_source(src, plan, i)?;
        meter.hold(scratch);
        let staging = &mut ring[i % slots];
        {
            let guard = piece.storage().read();
            let bytes = host_bytes(&guard, &piece)?;
            // Waits until the upload that last read this buffer has finished.
            let dst = staging.as_bytes_mut()?;
            copy_bytes(
                &mut dst[..range.len()],
                &bytes[offset..offset + range.len()],
            );
        }
        drop(piece);
        meter.release(scratch);
        let mut batch = staging.batch(&stream)?;
        batch.upload(out, range.start, 0, range.len())?;
        batch.finish()?;
    }
    stream.synchronize()?;
    let ring_bytes = ring.iter().map(PinnedBuffer::block_size).sum();
    drop(ring);
    meter.release(ring_bytes);
    Ok(())
}
