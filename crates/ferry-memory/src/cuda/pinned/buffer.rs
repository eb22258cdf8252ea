//! `PinnedBuffer`: page-locked bytes from the pool, readable only once the copy queued on them
//! has finished.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys::CUevent_flags;
use parking_lot::Mutex;

use super::{HostBlock, PinnedPool};
use crate::MemoryError;
use crate::cuda::stream::{Stream, driver};
use crate::size::human_bytes;

/// Page-locked host bytes from the [`PinnedPool`]. After an async copy it is "pending": reading
/// or writing it waits for the copy first, so a read-before-sync cannot happen.
pub struct PinnedBuffer {
    block: HostBlock,
    len: usize,
    /// Set by `record`; cleared once the event is seen complete.
    pending: AtomicBool,
    /// Streams other code used it on ([`PinnedBuffer::record_stream`]).
    uses: Mutex<Vec<Stream>>,
    pool: &'static PinnedPool,
}

// SAFETY: the buffer owns its block exclusively; shared access hands out only `&[u8]` (after
// the pending copy finished) and the event is thread-safe, as for `Vec<u8>`.
unsafe impl Send for PinnedBuffer {}
// SAFETY: as above; `pending` is atomic.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    pub(super) fn new(mut block: HostBlock, len: usize, pool: &'static PinnedPool) -> Self {
        // The pool hands out only blocks whose earlier users are done.
        block.after.clear();
        Self {
            pending: AtomicBool::new(block.pending),
            block,
            len,
            uses: Mutex::new(Vec::new()),
            pool,
        }
    }

    /// Notes that work queued on `stream` by other code (a copy torch queued from a tensor over
    /// this memory, say) may use the bytes: when the buffer is dropped, an event is recorded on
    /// `stream`, and the pool hands the block out again only once it has completed, so work
    /// queued there before the drop never sees the block reused. The counterpart of
    /// `torch.Tensor.record_stream`. ferry's own copies need no call: they record themselves.
    pub fn record_stream(&self, stream: &Stream) {
        let mut uses = self.uses.lock();
        if !uses.contains(stream) {
            uses.push(stream.clone());
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of the pool block behind it, as the pool's statistics count them: its size class,
    /// or the class above when a cached block was reused.
    pub fn block_size(&self) -> usize {
        self.block.size
    }

    /// Whether the last copy queued on it has finished (so reading will not wait).
    pub fn is_ready(&self) -> bool {
        if !self.pending.load(Ordering::Acquire) {
            return true;
        }
        let done = self
            .block
            .event
            .as_ref()
            .is_none_or(|e| e.try_is_complete() == Ok(true));
        if done {
            self.pending.store(false, Ordering::Release);
        }
        done
    }

    /// Blocks until the last copy queued on it has finished.
    pub fn wait(&self) -> Result<(), MemoryError> {
        if self.pending.load(Ordering::Acquire) {
            if let Some(event) = &self.block.event {
                event.synchronize().map_err(driver("cuEventSynchronize"))?;
            }
            self.pending.store(false, Ordering::Release);
        }
        Ok(())
    }

    /// The bytes, once the pending copy (if any) has finished.
    pub fn as_bytes(&self) -> Result<&[u8], MemoryError> {
        self.wait()?;
        // SAFETY: the block holds `len` initialised bytes and no DMA writes them any more.
        Ok(unsafe { std::slice::from_raw_parts(self.block.ptr.as_ptr(), self.len) })
    }

    /// The bytes, mutably, once the pending copy (if any) has finished.
    pub fn as_bytes_mut(&mut self) -> Result<&mut [u8], MemoryError> {
        self.wait()?;
        // SAFETY: as in `as_bytes`, and `&mut self` makes the access unique; no DMA reads them.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.block.ptr.as_ptr(), self.len) })
    }

    /// The address of the bytes, without waiting for a pending copy: for handing the memory to
    /// a consumer that reads it only after the caller has waited ([`PinnedBuffer::wait`]).
    pub fn as_ptr(&self) -> *const u8 {
        self.block.ptr.as_ptr()
    }

    /// The bytes without waiting, for queuing a copy that is ordered after the pending one.
    pub(crate) fn raw_bytes(&self) -> &[u8] {
        // SAFETY: `len` initialised bytes; only the driver reads them through this slice.
        unsafe { std::slice::from_raw_parts(self.block.ptr.as_ptr(), self.len) }
    }

    /// Mutable bytes without waiting, for a DMA destination ordered after the pending copy.
    pub(crate) fn raw_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `raw_bytes`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.block.ptr.as_ptr(), self.len) }
    }

    /// Makes `stream` wait, on the device, for the copy pending on this buffer.
    pub(crate) fn order_before(&self, stream: &Stream) -> Result<(), MemoryError> {
        if let (true, Some(event)) = (self.pending.load(Ordering::Acquire), &self.block.event) {
            stream
                .cudarc()
                .wait(event)
                .map_err(driver("cuStreamWaitEvent"))?;
        }
        Ok(())
    }

    /// Marks the end of a copy just queued on `stream`.
    pub(crate) fn record(&mut self, stream: &Stream) -> Result<(), MemoryError> {
        let ctx = stream.cudarc().context();
        // An event can only be recorded on streams of the context that created it.
        if self.block.event.as_ref().is_none_or(|e| e.context() != ctx) {
            let event = ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(driver("cuEventCreate"))?;
            self.block.event = Some(event);
        }
        let event = self.block.event.as_ref().expect("set above");
        event
            .record(stream.cudarc())
            .map_err(driver("cuEventRecord"))?;
        self.pending.store(true, Ordering::Release);
        Ok(())
    }

    /// Keeps a failed wait for the pool's next allocation: `Deref` cannot return it.
    fn defer_wait_error(&self, error: MemoryError) {
        self.pool.defer(
            format!(
                "reading a pinned buffer of {} through Deref (waiting for the copy into it)",
                human_bytes(self.len)
            ),
            error,
        );
    }
}

impl Deref for PinnedBuffer {
    type Target = [u8];

    /// Waits for the pending copy. A failed wait means the context is broken (nothing runs on it
    /// any more); the error is kept for the pool's next allocation, which names this read.
    fn deref(&self) -> &[u8] {
        if let Err(e) = self.wait() {
            self.defer_wait_error(e);
        }
        self.raw_bytes()
    }
}

impl DerefMut for PinnedBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        if let Err(e) = self.wait() {
            self.defer_wait_error(e);
        }
        self.raw_bytes_mut()
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.block.size == 0 {
            return;
        }
        let pending = *self.pending.get_mut();
        let mut after = Vec::new();
        for stream in std::mem::take(self.uses.get_mut()) {
            match stream.record() {
                Ok(event) => after.push(event),
                // Without an event, waiting for the stream is the only safe state (and a
                // failure to record means a broken context: the wait reports it).
                Err(_) => {
                    if let Err(e) = stream.synchronize() {
                        self.pool.defer(
                            format!(
                                "waiting for the work on stream {} that uses a pinned buffer of {} being dropped",
                                stream.id(),
                                human_bytes(self.len)
                            ),
                            e,
                        );
                    }
                }
            }
        }
        let block = HostBlock {
            ptr: self.block.ptr,
            size: self.block.size,
            event: self.block.event.take(),
            pending,
            after,
            mapping: self.block.mapping.take(),
        };
        self.pool.give_back(block);
    }
}

impl fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("len", &self.len)
            .field("ready", &self.is_ready())
            .finish()
    }
}
