//! Many copies between device buffers and one pinned buffer, ordered once: the pinned buffer
//! waits for its previous copy once at the start, and records one event at the end, instead of
//! a wait and an event per copy. State dicts and chunked moves are made of these.

use cudarc::driver::result;

use super::buffer::DeviceBuffer;
use super::pinned::PinnedBuffer;
use super::stream::{Event, Stream, driver};
use crate::MemoryError;

/// Copies queued on one stream against one pinned buffer. The buffer is mutably borrowed for
/// the batch's life, so nothing reads it mid-batch; [`PinnedBatch::finish`] (or drop) records
/// the event every later read of the buffer waits for.
pub struct PinnedBatch<'a> {
    pinned: &'a mut PinnedBuffer,
    stream: &'a Stream,
    queued: usize,
    finished: bool,
}

impl PinnedBuffer {
    /// Starts a batch of copies on `stream` into or out of this buffer.
    pub fn batch<'a>(&'a mut self, stream: &'a Stream) -> Result<PinnedBatch<'a>, MemoryError> {
        self.order_before(stream)?;
        Ok(PinnedBatch {
            pinned: self,
            stream,
            queued: 0,
            finished: false,
        })
    }
}

impl PinnedBatch<'_> {
    fn pinned_range(&self, op: &'static str, offset: usize, len: usize) -> Result<(), MemoryError> {
        if offset
            .checked_add(len)
            .is_none_or(|end| end > self.pinned.len())
        {
            return Err(MemoryError::OutOfBounds {
                op,
                offset,
                len,
                buffer_len: self.pinned.len(),
            });
        }
        Ok(())
    }

    /// Queues `src[src_offset..src_offset + len]` into pinned bytes from `pinned_offset`,
    /// after everything queued so far on `src`'s own stream.
    pub fn download(
        &mut self,
        src: &DeviceBuffer,
        src_offset: usize,
        pinned_offset: usize,
        len: usize,
    ) -> Result<(), MemoryError> {
        self.download_from(src, src_offset, pinned_offset, len, None)
    }

    /// [`PinnedBatch::download`], ordered on the device after `ready` alone: an event
    /// recorded on `src`'s own stream ([`DeviceBuffer::stream`]) after the work that wrote
    /// its bytes, not after everything queued there since. Kernels queued there since, which
    /// read `src`, run alongside the copy instead of ahead of it (a checkpoint's snapshot,
    /// taken while training queues its next steps, copies the state as of its call). Work
    /// queued since that *writes* `src` races with the copy: the caller holds writers off
    /// until the copy is queued. The device memory's reuse waits for the copy either way.
    pub fn download_after(
        &mut self,
        src: &DeviceBuffer,
        src_offset: usize,
        pinned_offset: usize,
        len: usize,
        ready: &Event,
    ) -> Result<(), MemoryError> {
        self.download_from(src, src_offset, pinned_offset, len, Some(ready))
    }

    fn download_from(
        &mut self,
        src: &DeviceBuffer,
        src_offset: usize,
        pinned_offset: usize,
        len: usize,
        ready: Option<&Event>,
    ) -> Result<(), MemoryError> {
        let ptr = src.range_after("download", src_offset, len, self.stream, ready)?;
        self.pinned_range("download", pinned_offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let dst = &mut self.pinned.raw_bytes_mut()[pinned_offset..pinned_offset + len];
        // SAFETY: the device range lies in a live block marked used on this stream; the pinned
        // range lies in the buffer, which is borrowed mutably until the batch records its event,
        // and every later read waits for that event.
        unsafe { result::memcpy_dtoh_async(dst, ptr, self.stream.cudarc().cu_stream()) }
            .map_err(driver("cuMemcpyDtoHAsync"))?;
        self.queued += 1;
        // A later write of `src` on another stream waits for this read.
        src.queued_on(self.stream)
    }

    /// Queues pinned bytes from `pinned_offset` into `dst[dst_offset..dst_offset + len]`.
    pub fn upload(
        &mut self,
        dst: &mut DeviceBuffer,
        dst_offset: usize,
        pinned_offset: usize,
        len: usize,
    ) -> Result<(), MemoryError> {
        let ptr = dst.range("upload", dst_offset, len, self.stream)?;
        self.pinned_range("upload", pinned_offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let src = &self.pinned.raw_bytes()[pinned_offset..pinned_offset + len];
        // SAFETY: as in `download`; the pinned bytes are not rewritten or reused before the
        // batch's event completes.
        unsafe { result::memcpy_htod_async(ptr, src, self.stream.cudarc().cu_stream()) }
            .map_err(driver("cuMemcpyHtoDAsync"))?;
        self.queued += 1;
        // A later use of `dst` on another stream waits for this write.
        dst.queued_on(self.stream)
    }

    /// Number of copies queued so far.
    pub fn queued(&self) -> usize {
        self.queued
    }

    /// Records the batch's event: reading the buffer waits for every queued copy.
    pub fn finish(mut self) -> Result<(), MemoryError> {
        self.finished = true;
        self.pinned.record(self.stream)
    }
}

impl Drop for PinnedBatch<'_> {
    fn drop(&mut self) {
        if !self.finished && self.pinned.record(self.stream).is_err() {
            // Without an event the copies cannot be tracked; wait for them instead.
            let _ = self.stream.synchronize();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use crate::cuda::test_hooks::{SERIAL, hold};
    use crate::cuda::{CudaDevice, Event, PinnedPool};

    /// Whether `event` completes within `wait`.
    fn completes(event: &Event, wait: Duration) -> bool {
        let deadline = Instant::now() + wait;
        while !event.is_complete() {
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    /// A download ordered after its producers' event runs while work queued on the source's
    /// stream since (held there by a host function) has not: a checkpoint's snapshot beside
    /// training's next steps. A plain download waits for that work.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn a_download_after_its_producers_runs_beside_later_work_on_their_stream() {
        let _host_statistics = crate::host::tests::stats_turn();
        let _serial = SERIAL.lock();
        let dev = CudaDevice::get(0).unwrap();
        // The buffer's own stream, held below: nothing else of the process queues there.
        let home = dev.new_stream().unwrap();
        let copies = dev.new_stream().unwrap();
        let len = 1 << 20;
        let src = dev.alloc_zeroed(len, &home).unwrap();
        let ready = home.record().unwrap();
        let held = hold(&home);
        let pool = PinnedPool::global().unwrap();
        let (mut after, mut plain) = (pool.alloc(len).unwrap(), pool.alloc(len).unwrap());
        let mut batch = after.batch(&copies).unwrap();
        batch.download_after(&src, 0, 0, len, &ready).unwrap();
        batch.finish().unwrap();
        let after_done = copies.record().unwrap();
        let ran_beside = completes(&after_done, Duration::from_secs(10));
        let mut batch = plain.batch(&copies).unwrap();
        batch.download(&src, 0, 0, len).unwrap();
        batch.finish().unwrap();
        let plain_done = copies.record().unwrap();
        let plain_waited = !completes(&plain_done, Duration::from_millis(200));
        held.release();
        assert!(
            ran_beside,
            "the download waited for work queued after its event"
        );
        assert!(
            plain_waited,
            "a plain download did not wait for the held stream"
        );
        assert!(plain.as_bytes().unwrap().iter().all(|&b| b == 0));
        assert!(after.as_bytes().unwrap().iter().all(|&b| b == 0));
    }
}
