//! Helpers every copy uses, below all of them: the per-device copy stream and its ordering
//! after the default stream, pinned staging within the budget (and the meter that counts it),
//! dense sources, and wrapping a fresh buffer as a tensor.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use ferry_memory::cuda::{CudaDevice, PinnedBuffer, PinnedPool, Stream};
use ferry_memory::{Device, MemoryError};
use ferry_tensor::{Buffer, Layout, Result, Storage, Tensor};
use parking_lot::Mutex;
use rayon::prelude::*;

/// `t` when its elements fill its buffer from byte 0 in order, else a fresh contiguous copy on
/// its own device. Copies between devices move whole, dense buffers.
pub(crate) fn dense(t: &Tensor) -> Result<Tensor> {
    if !dense_copies(t) {
        Ok(t.detach())
    } else {
        t.detach().copy()
    }
}

/// Whether [`dense`] has to copy `t`.
pub(crate) fn dense_copies(t: &Tensor) -> bool {
    !(t.is_contiguous() && t.layout().offset() == 0 && t.storage().bytes() == t.nbytes())
}

pub(crate) fn cuda(ordinal: usize) -> Result<CudaDevice> {
    Ok(CudaDevice::get(ordinal)?)
}

/// A contiguous tensor over `buffer` on `device`; `buffer` was just allocated with `like`'s
/// `nbytes()`, so the layout fits it.
pub(crate) fn wrap(buffer: Buffer, like: &Tensor, device: Device) -> Tensor {
    let storage = Storage::new(buffer, like.dtype(), device);
    Tensor::from_storage(Arc::new(storage), Layout::contiguous(like.shape()))
        .expect("a buffer of like.nbytes() holds a contiguous tensor of like's shape")
}

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

/// A staging ring of `buffers` pinned buffers of `piece_bytes` each, every one exactly its
/// class (so a plan's bound holds), held on `meter`; `None` when the pinned budget has no room
/// for it.
pub(crate) fn staging_ring(
    pool: &'static PinnedPool,
    buffers: usize,
    piece_bytes: usize,
    meter: &mut StagingMeter,
) -> Result<Option<Vec<PinnedBuffer>>> {
    let mut ring = Vec::with_capacity(buffers);
    for _ in 0..buffers {
        match within_budget(pool.alloc_exact(piece_bytes))? {
            Some(buffer) => ring.push(buffer),
            None => return Ok(None), // what was taken goes back as `ring` drops
        }
    }
    meter.hold(ring.iter().map(PinnedBuffer::block_size).sum());
    Ok(Some(ring))
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
