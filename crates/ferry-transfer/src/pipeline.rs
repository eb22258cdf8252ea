//! The pipelines behind chunked moves: pieces go through a ring of pinned staging buffers on a
//! dedicated stream, so the DMA of one piece overlaps the host copy of the previous one.

use std::collections::HashMap;
use std::sync::OnceLock;

use ferry_memory::cuda::{CudaDevice, PinnedBuffer, PinnedPool, Stream};
use ferry_memory::{Device, HostPool};
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
    let mut streams = STREAMS.get_or_init(Default::default).lock();
    if let Some(stream) = streams.get(&dev.ordinal()) {
        return Ok(stream.clone());
    }
    let stream = dev.new_stream()?;
    streams.insert(dev.ordinal(), stream.clone());
    Ok(stream)
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

/// Pinned-pool bytes allocated now, after restarting its peak there; the pool's peak minus this
/// is what a move staged.
fn staging_baseline(pool: &PinnedPool) -> usize {
    pool.reset_peak();
    pool.stats().allocated_bytes
}

fn staging_ring(pool: &'static PinnedPool, plan: &ChunkPlan) -> Result<Vec<PinnedBuffer>> {
    (0..plan.staging_buffers())
        .map(|_| Ok(pool.alloc(plan.piece_bytes())?))
        .collect()
}

/// Where piece `i` of a source comes from: a byte range of the source's own storage when it is
/// contiguous, else a contiguous copy of the piece made on the source's device (so scratch
/// memory is bounded by one piece, like the staging).
fn piece_source(src: &Tensor, plan: &ChunkPlan, i: usize) -> Result<(Tensor, usize)> {
    let elem = src.dtype().size();
    if src.is_contiguous() {
        return Ok((
            src.clone(),
            src.layout().offset() * elem + plan.byte_range(i).start,
        ));
    }
    let rows = &plan.pieces()[i];
    let piece = src.narrow(0, rows.start, rows.len())?.copy()?;
    let offset = piece.layout().offset() * elem;
    Ok((piece, offset))
}

/// GPU to pageable host memory through the staging ring.
pub(crate) fn device_to_host(
    src: &Tensor,
    ordinal: usize,
    plan: &ChunkPlan,
) -> Result<(Tensor, TransferReport)> {
    let dev = cuda(ordinal)?;
    let pool = PinnedPool::global()?;
    let stream = transfer_stream(&dev)?;
    // Pooled pages are already faulted in: fresh ones would cost more than the link.
    let mut out = HostPool::global().alloc(src.nbytes())?;
    let baseline = staging_baseline(pool);
    dev.reset_peak();
    let device_baseline = dev.memory_stats().allocated_bytes;
    let mut ring = staging_ring(pool, plan)?;
    let slots = ring.len();
    after_default(&dev, &stream)?;
    let queue = |i: usize, staging: &mut PinnedBuffer| -> Result<()> {
        let (piece, offset) = piece_source(src, plan, i)?;
        if !src.is_contiguous() {
            // The piece was just made contiguous on the default stream.
            after_default(&dev, &stream)?;
        }
        let guard = piece.storage().read();
        let Buffer::Cuda(from) = &*guard else {
            return Err(TensorError::UnsupportedDevice {
                op: "to_chunked",
                device: piece.device(),
            });
        };
        let mut batch = staging.batch(&stream)?;
        batch.download(from, offset, 0, plan.byte_range(i).len())?;
        batch.finish()?;
        Ok(())
    };
    for (i, staging) in ring.iter_mut().enumerate() {
        queue(i, staging)?;
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
            queue(i + slots, staging)?;
        }
    }
    let mut report =
        TransferReport::new(TransferPath::Chunked { chunks: plan.len() }, src.nbytes());
    report.staging_peak_bytes = pool.stats().peak_allocated_bytes.saturating_sub(baseline)
        + dev
            .memory_stats()
            .peak_allocated_bytes
            .saturating_sub(device_baseline);
    drop(ring);
    Ok((wrap(Buffer::Host(out), src, Device::Cpu), report))
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
    let stream = transfer_stream(&dev)?;
    let mut out = dev.alloc(src.nbytes(), dev.default_stream())?;
    // The block may have been freed by work still queued on the default stream.
    after_default(&dev, &stream)?;
    let baseline = staging_baseline(pool);
    let mut ring = staging_ring(pool, plan)?;
    let slots = ring.len();
    for i in 0..plan.len() {
        let range = plan.byte_range(i);
        let (piece, offset) = piece_source(src, plan, i)?;
        let staging = &mut ring[i % slots];
        {
            let guard = piece.storage().read();
            let bytes = guard.host_bytes().ok_or(TensorError::NotOnHost {
                op: "to_chunked",
                device: piece.device(),
            })?;
            // Waits until the upload that last read this buffer has finished.
            let dst = staging.as_bytes_mut()?;
            copy_bytes(
                &mut dst[..range.len()],
                &bytes[offset..offset + range.len()],
            );
        }
        let mut batch = staging.batch(&stream)?;
        batch.upload(&mut out, range.start, 0, range.len())?;
        batch.finish()?;
    }
    stream.synchronize()?;
    let mut report =
        TransferReport::new(TransferPath::Chunked { chunks: plan.len() }, src.nbytes());
    report.staging_peak_bytes = pool.stats().peak_allocated_bytes.saturating_sub(baseline);
    Ok((wrap(Buffer::Cuda(out), src, Device::Cuda(ordinal)), report))
}
