//! The pipelines behind chunked moves: pieces go through a ring of pinned staging buffers on a
//! dedicated stream, so the DMA of one piece overlaps the host copy of the previous one.
//!
//! When the pinned budget has no room even for the staging ring, the pieces go through the
//! driver's own pageable path instead (slower, but bounded and correct). Moves whose results
//! do not fit the pinned budget come here too (see `copy::beyond_budget`).

use std::collections::HashMap;
use std::sync::OnceLock;

use ferry_memory::cuda::{CudaDevice, PinnedBuffer, PinnedPool, Stream};
use ferry_memory::{Device, HostBuffer, HostPool, MemoryError};
use ferry_tensor::{Buffer, Result, Tensor, TensorError};
use parking_lot::Mutex;
use rayon::prelude::*;

use crate::chunked::ChunkPlan;
use crate::copy::{cuda, wrap};
use crate::report::{TransferPath, TransferReport};

/// One copy stream per device, made once: chunked and batched copies queue there so they can
/// overlap work on the default stream.
pub(crate) fn transfer_stream(dev: &CudaDevice) -> Result<Stream> {
    static STREAMS: OnceLock<Mutex<HashMap<usize, Stream>>> = OnceLock::new();
    let streams = STREAMS.get_or_init(Default::default);
    if let Some(stream) = streams.lock().get(&dev.ordinal()) {
        return Ok(stream.clone());
    }
    // Made outside the lock: a device's first second stream synchronizes the device. Should
    // two threads race here, one stream is kept and the other dropped.
    let stream = dev.new_stream()?;
    Ok(streams
        .lock()
        .entry(dev.ordinal())
        .or_insert(stream)
        .clone())
}

/// Orders `stream` after everything queued so far on `dev`'s default stream, where tensors
/// are produced.
pub(crate) fn after_default(dev: &CudaDevice, stream: &Stream) -> Result<()> {
    if stream != dev.default_stream() {
        stream.wait_event(&dev.default_stream().record()?)?;
    }
    Ok(())
}

/// Copies `src` into `dst` (same length), on all cores when it is large: page faults on fresh
/// pageable memory and memory bandwidth both scale with threads.
pub(crate) fn copy_bytes(dst: &mut [u8], src: &[u8]) {
    const PART: usize = 2 << 20;
    if dst.len() < 4 * PART {
        dst.copy_from_slice(src);
    } else {
        dst.par_chunks_mut(PART)
            .zip(src.par_chunks(PART))
            .for_each(|(d, s)| d.copy_from_slice(s));
    }
}

/// Staging a move holds, counted by the move itself as it allocates and frees: the pools'
/// statistics, and their peaks, belong to the user, so library code never resets them (and
/// other threads' allocations do not leak into a move's report).
#[derive(Debug, Default)]
pub(crate) struct StagingMeter {
    now: usize,
    peak: usize,
}

impl StagingMeter {
    /// `bytes` more are held.
    pub(crate) fn hold(&mut self, bytes: usize) {
        self.now += bytes;
        self.peak = self.peak.max(self.now);
    }

    /// `bytes` held before are given back.
    pub(crate) fn release(&mut self, bytes: usize) {
        self.now -= bytes;
    }

    /// The most held at once.
    pub(crate) fn peak(&self) -> usize {
        self.peak
    }
}

/// `Ok(None)` when the pinned budget refused the request (the caller goes pageable).
pub(crate) fn within_budget(
    alloc: std::result::Result<PinnedBuffer, MemoryError>,
) -> Result<Option<PinnedBuffer>> {
    match alloc {
        Ok(buffer) => Ok(Some(buffer)),
        Err(MemoryError::PinnedBudgetExceeded { .. }) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// The staging ring of `plan`, each buffer exactly its class (so the plan's bound holds), or
/// `None` when the pinned budget has no room for it.
fn staging_ring(
    pool: &'static PinnedPool,
    plan: &ChunkPlan,
    meter: &mut StagingMeter,
) -> Result<Option<Vec<PinnedBuffer>>> {
    let mut ring = Vec::with_capacity(plan.staging_buffers());
    for _ in 0..plan.staging_buffers() {
        match within_budget(pool.alloc_exact(plan.piece_bytes()))? {
            Some(buffer) => ring.push(buffer),
            None => return Ok(None), // what was taken goes back as `ring` drops
        }
    }
    meter.hold(ring.iter().map(PinnedBuffer::block_size).sum());
    Ok(Some(ring))
}

/// Where piece `i` of a source comes from: a byte range of the source's own storage when it is
/// contiguous, else a contiguous copy of the piece made on the source's device (so scratch
/// memory is bounded by one piece, like the staging). Returns the tensor, the byte offset and
/// the scratch bytes it holds (0 for a range of the source).
fn piece_source(src: &Tensor, plan: &ChunkPlan, i: usize) -> Result<(Tensor, usize, usize)> {
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
    match staging_ring(pool, plan, &mut meter)? {
        Some(ring) => download_through(src, &dev, plan, ring, &mut out, &mut meter)?,
        None => download_direct(src, &dev, plan, &mut out, &mut meter)?,
    }
    let mut report =
        TransferReport::new(TransferPath::Chunked { chunks: plan.len() }, src.nbytes());
    report.staging_peak_bytes = meter.peak();
    Ok((wrap(Buffer::Host(out), src, Device::Cpu), report))
}

/// Queues the download of piece `i` into `staging` on `stream`.
fn queue_download(
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
    match staging_ring(pool, plan, &mut meter)? {
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

#[cfg(test)]
mod tests {
    use super::StagingMeter;

    #[test]
    fn the_meter_keeps_the_most_held_at_once() {
        let mut meter = StagingMeter::default();
        meter.hold(100); // a ring
        meter.hold(30); // a scratch piece
        meter.release(30);
        meter.hold(20);
        meter.release(20);
        meter.release(100);
        assert_eq!(meter.peak(), 130);
        meter.hold(50);
        assert_eq!(meter.peak(), 130);
    }
}
