//! `DeviceBuffer`: bytes in GPU memory, owned through the caching allocator, with copies that
//! check lengths and devices before any driver call.
//!
//! # Ordering across streams
//!
//! A buffer's uses on one stream run in order. Across streams, ferry orders them itself:
//!
//! - A use on a stream other than the buffer's home stream (the one it was allocated on, where
//!   ferry's kernels produce data) first waits, on the device, for the work queued on the home
//!   stream so far: a copy on a copy stream, or a peer copy on the other GPU's stream, reads
//!   what its producers wrote.
//! - Every copy this crate queues on such a stream records an event after itself. Until that
//!   event completes, any later use of the buffer on another stream (an in-place write on the
//!   default stream: `assign`, an optimizer step) waits for it on the device, so an
//!   asynchronous move reads the values it was issued on.
//!
//! Kernels that callers launch themselves on a stream other than the home stream are ordered
//! after the home stream's work too, and their memory is not reused before they finish, but
//! later uses are not ordered after them: record an event and wait on it
//! ([`Stream::record`], [`Stream::wait_event`]).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::driver::result;
use parking_lot::Mutex;

use super::allocator::Block;
use super::device::CudaDevice;
use super::pinned::PinnedBuffer;
use super::stream::{Event, Stream, driver};
use crate::error::human_bytes;
use crate::{Device, MemoryError};

/// Device memory. Dropping it returns the block to its device's cache, ordered after the work
/// already queued on the buffer's stream, so a buffer may be dropped right after queuing a copy
/// or a kernel that uses it.
pub struct DeviceBuffer {
    device: CudaDevice,
    /// `None` for an empty buffer (the driver refuses zero-byte allocations).
    block: Option<Memory>,
    len: usize,
    /// The stream it was allocated on; the block's reuse is ordered on it.
    stream: Stream,
    /// Its uses on other streams.
    foreign: Mutex<ForeignUses>,
    /// `foreign.in_flight.len()`, read without the lock: most buffers never leave home.
    in_flight: AtomicUsize,
}

/// Where a buffer's bytes come from.
enum Memory {
    /// A block of the device's caching allocator, given back to it on drop.
    Pooled(Block),
    /// Memory another runtime owns ([`DeviceBuffer::from_external`]), released by dropping
    /// `owner` once the work queued on it is done.
    External {
        ptr: u64,
        owner: Box<dyn Send + Sync>,
    },
}

/// What a buffer knows of its uses on streams other than its home stream.
#[derive(Default)]
struct ForeignUses {
    /// Streams that touched it, each with the event recorded after its last use there when that
    /// use was a copy this crate queued (`None` after any other use: a caller's kernels). At
    /// drop the home stream waits for that event, or for all the stream's work so far, before
    /// the block is reused: waiting for the event alone keeps a free from waiting on later
    /// copies of other buffers queued on the same copy stream.
    streams: Vec<(Stream, Option<Arc<Event>>)>,
    /// Per stream (by id), an event recorded after the last copy queued there on this buffer;
    /// uses on other streams wait for it until it completes.
    in_flight: Vec<(u64, Arc<Event>)>,
}

impl DeviceBuffer {
    pub(crate) fn new(device: CudaDevice, block: Block, len: usize, stream: Stream) -> Self {
        Self {
            device,
            block: Some(Memory::Pooled(block)),
            len,
            stream,
            foreign: Mutex::new(ForeignUses::default()),
            in_flight: AtomicUsize::new(0),
        }
    }

    pub(crate) fn empty(device: CudaDevice, stream: Stream) -> Self {
        Self {
            device,
            block: None,
            len: 0,
            stream,
            foreign: Mutex::new(ForeignUses::default()),
            in_flight: AtomicUsize::new(0),
        }
    }

    /// A buffer over `len` bytes of `device` memory at `ptr` that another runtime owns (a torch
    /// tensor received through DLPack, say), used in place: work on it is ordered on `stream`
    /// like any buffer's, and dropping it waits for that work before it drops `owner`, which
    /// gives the memory back to its runtime. Not counted in the allocator's statistics.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be memory of `device` (or reachable from it) that stays allocated,
    /// and is not reused by anyone, until `owner` is dropped; any work the other runtime queued
    /// on it must be ordered before the work queued here (for DLPack, the consumer's stream
    /// passed to `__dlpack__`).
    pub unsafe fn from_external(
        device: &CudaDevice,
        ptr: u64,
        len: usize,
        stream: &Stream,
        owner: Box<dyn Send + Sync>,
    ) -> Self {
        Self {
            device: device.clone(),
            block: Some(Memory::External { ptr, owner }),
            len,
            stream: stream.clone(),
            foreign: Mutex::new(ForeignUses::default()),
            in_flight: AtomicUsize::new(0),
        }
    }

    /// Whether the bytes belong to another runtime ([`DeviceBuffer::from_external`]).
    pub fn is_external(&self) -> bool {
        matches!(self.block, Some(Memory::External { .. }))
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device it lives on.
    pub fn device(&self) -> Device {
        self.device.device()
    }

    /// The device, with its allocator and kernels.
    pub fn cuda_device(&self) -> &CudaDevice {
        &self.device
    }

    /// The stream it was allocated on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The raw `CUdeviceptr` as an integer, for kernel arguments (0 for an empty buffer).
    pub fn device_ptr(&self) -> u64 {
        match &self.block {
            Some(Memory::Pooled(block)) => block.ptr,
            Some(Memory::External { ptr, .. }) => *ptr,
            None => 0,
        }
    }

    /// Notes that work on `stream` is about to use this buffer, and orders it: on a stream
    /// other than the buffer's own it waits for the work queued on the buffer's stream, and on
    /// any stream it waits for copies still in flight on others (see the module docs). The
    /// memory is not reused before that work finishes. Launches, GEMMs and copies in this crate
    /// call it for you.
    ///
    /// Should the ordering fail (a broken context), it waits on the host instead; if even that
    /// fails, the error is reported by the next call on the device.
    pub fn record_stream(&self, stream: &Stream) {
        if self.order_use(stream).is_err()
            && let Err(error) = self.order_on_host()
        {
            self.device.defer(
                format!(
                    "ordering a use of a {} device buffer on {} (stream {}) after its other uses",
                    human_bytes(self.len),
                    self.device(),
                    stream.id()
                ),
                error,
            );
        }
    }

    /// Notes that work another runtime queued on `stream` uses this buffer (the counterpart of
    /// `torch.Tensor.record_stream`): when the buffer is dropped, the home stream waits for the
    /// work queued on `stream` by then before the block can be reused. Unlike
    /// [`DeviceBuffer::record_stream`] it orders nothing now.
    pub fn record_use(&self, stream: &Stream) {
        if *stream == self.stream || self.is_empty() {
            return;
        }
        let mut foreign = self.foreign.lock();
        match foreign.streams.iter_mut().find(|(s, _)| s == stream) {
            Some((_, last_copy)) => *last_copy = None,
            None => foreign.streams.push((stream.clone(), None)),
        }
    }

    /// [`DeviceBuffer::record_stream`], returning the error.
    fn order_use(&self, stream: &Stream) -> Result<(), MemoryError> {
        self.order_use_after(stream, None)
    }

    /// [`DeviceBuffer::order_use`]; on another stream than the home stream, the use waits for
    /// `producers` when given (an event on the home stream after the work that wrote the bytes)
    /// instead of for everything queued on the home stream so far.
    fn order_use_after(
        &self,
        stream: &Stream,
        producers: Option<&Event>,
    ) -> Result<(), MemoryError> {
        if *stream != self.stream {
            // The bytes' producers run on the home stream.
            match producers {
                Some(event) => stream.wait_event(event)?,
                None => stream.wait_event(&self.stream.record()?)?,
            }
            self.record_use(stream);
        }
        if self.in_flight.load(Ordering::Acquire) == 0 {
            return Ok(());
        }
        let waits: Vec<Arc<Event>> = {
            let mut foreign = self.foreign.lock();
            // Errors count as "not complete": the wait below surfaces them.
            foreign.in_flight.retain(|(_, event)| !event.is_complete());
            self.in_flight
                .store(foreign.in_flight.len(), Ordering::Release);
            foreign
                .in_flight
                .iter()
                .filter(|(id, _)| *id != stream.id())
                .map(|(_, event)| Arc::clone(event))
                .collect()
        };
        for event in waits {
            stream.wait_event(&event)?;
        }
        Ok(())
    }

    /// The ordering of `order_use`, done by waiting on the host for everything that could be
    /// using the buffer.
    fn order_on_host(&self) -> Result<(), MemoryError> {
        self.stream.synchronize()?;
        let events: Vec<Arc<Event>> = self
            .foreign
            .lock()
            .in_flight
            .iter()
            .map(|(_, event)| Arc::clone(event))
            .collect();
        for event in events {
            event.synchronize()?;
        }
        Ok(())
    }

    /// Records, after a copy just queued on `stream` used this buffer, the event later uses on
    /// other streams wait for. Nothing to do on the home stream, whose order is the stream's.
    fn note_queued(&self, stream: &Stream) -> Result<(), MemoryError> {
        if *stream == self.stream || self.is_empty() {
            return Ok(());
        }
        let event = match stream.record() {
            Ok(event) => Arc::new(event),
            // Without an event, waiting for the copy is the only way to order what follows.
            Err(_) => return stream.synchronize(),
        };
        let mut foreign = self.foreign.lock();
        if let Some((_, last_copy)) = foreign.streams.iter_mut().find(|(s, _)| s == stream) {
            *last_copy = Some(Arc::clone(&event));
        }
        match foreign
            .in_flight
            .iter_mut()
            .find(|(id, _)| *id == stream.id())
        {
            // Later work on one stream completes after earlier work: the newer event covers both.
            Some(slot) => slot.1 = event,
            None => foreign.in_flight.push((stream.id(), event)),
        }
        self.in_flight
            .store(foreign.in_flight.len(), Ordering::Release);
        Ok(())
    }

    /// Copies all of `src` (pageable or not) into this buffer; returns when the copy is done.
    pub fn copy_from_host(&mut self, src: &[u8], stream: &Stream) -> Result<(), MemoryError> {
        self.expect_len("copy_from_host", src.len())?;
        self.copy_from_host_at(0, src, stream)
    }

    /// Copies `src` into bytes `offset..offset + src.len()`; returns when the copy is done.
    pub fn copy_from_host_at(
        &mut self,
        offset: usize,
        src: &[u8],
        stream: &Stream,
    ) -> Result<(), MemoryError> {
        let dst = self.range("copy_from_host", offset, src.len(), stream)?;
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst..dst + src.len()` lies in our block (checked above); `src` is borrowed
        // until the stream synchronize below, so the driver never reads it after we return.
        unsafe { result::memcpy_htod_async(dst, src, stream.cudarc().cu_stream()) }
            .map_err(driver("cuMemcpyHtoDAsync"))?;
        stream.synchronize()
    }

    /// Copies the whole buffer into `dst`; returns when the bytes are there.
    pub fn copy_to_host(&self, dst: &mut [u8], stream: &Stream) -> Result<(), MemoryError> {
        self.expect_len("copy_to_host", dst.len())?;
        self.copy_to_host_at(0, dst, stream)
    }

    /// Copies bytes `offset..offset + dst.len()` into `dst`; returns when the bytes are there.
    pub fn copy_to_host_at(
        &self,
        offset: usize,
        dst: &mut [u8],
        stream: &Stream,
    ) -> Result<(), MemoryError> {
        let src = self.range("copy_to_host", offset, dst.len(), stream)?;
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: the source range lies in our block; `dst` is exclusively borrowed until the
        // synchronize below, so nothing reads it while the DMA writes.
        unsafe { result::memcpy_dtoh_async(dst, src, stream.cudarc().cu_stream()) }
            .map_err(driver("cuMemcpyDtoHAsync"))?;
        stream.synchronize()?;
        // The stream's earlier work is done, so are the flag copies queued on it: a value read
        // back never hides a failed device check that came before it.
        self.cuda_device().poll_checks(false)
    }

    /// Queues a copy of all of `src` (same device, same length) into this buffer.
    pub fn copy_from_device(
        &mut self,
        src: &DeviceBuffer,
        stream: &Stream,
    ) -> Result<(), MemoryError> {
        self.expect_len("copy_from_device", src.len())?;
        self.copy_region(0, src, 0, src.len(), stream)
    }

    /// Queues a copy of `len` bytes from `src[src_offset..]` to `self[dst_offset..]` (same device).
    pub fn copy_region(
        &mut self,
        dst_offset: usize,
        src: &DeviceBuffer,
        src_offset: usize,
        len: usize,
        stream: &Stream,
    ) -> Result<(), MemoryError> {
        if src.device() != self.device() {
            return Err(MemoryError::DeviceMismatch {
                op: "copy_region",
                expected: self.device(),
                actual: src.device(),
            });
        }
        let dst_ptr = self.range("copy_region", dst_offset, len, stream)?;
        let src_ptr = src.range("copy_region", src_offset, len, stream)?;
        if len == 0 {
            return Ok(());
        }
        // SAFETY: both ranges lie in live blocks (checked above) and `&mut self` keeps the
        // destination distinct from `src`; both are marked used on `stream`, so neither block is
        // reused before the copy finishes.
        unsafe { result::memcpy_dtod_async(dst_ptr, src_ptr, len, stream.cudarc().cu_stream()) }
            .map_err(driver("cuMemcpyDtoDAsync"))?;
        src.note_queued(stream)?;
        self.note_queued(stream)
    }

    /// Queues a copy of all of `src`, which lives on another GPU, into this buffer. `stream` may
    /// belong to either device. Direct over NVLink/PCIe after
    /// [`CudaDevice::enable_peer_access`], staged through the host otherwise.
    ///
    /// The copy waits, on the device, for the work queued so far on both buffers' own streams
    /// (where their data is produced), and later uses of either buffer on other streams wait
    /// for the copy (see the module docs on ordering).
    pub fn copy_from_peer(
        &mut self,
        src: &DeviceBuffer,
        stream: &Stream,
    ) -> Result<(), MemoryError> {
        self.expect_len("copy_from_peer", src.len())?;
        if stream.device() != self.device() && stream.device() != src.device() {
            return Err(MemoryError::DeviceMismatch {
                op: "copy_from_peer",
                expected: self.device(),
                actual: stream.device(),
            });
        }
        self.device.check()?;
        src.device.check()?;
        if self.is_empty() {
            return Ok(());
        }
        // Records an event on the source's stream (on its own device) and makes the copy
        // stream wait for it: the copy reads what the source's producers wrote.
        src.order_use(stream)?;
        self.order_use(stream)?;
        stream
            .cudarc()
            .context()
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))?;
        let (dst_ctx, src_ctx) = (
            self.device.inner.ctx.cu_ctx(),
            src.device.inner.ctx.cu_ctx(),
        );
        if src.device() == self.device() {
            // One device (two of its streams): an ordinary device copy.
            // SAFETY: both blocks are live, `len` bytes each, in the bound context, distinct
            // (`&mut self`), and marked used on `stream`.
            unsafe {
                result::memcpy_dtod_async(
                    self.device_ptr(),
                    src.device_ptr(),
                    self.len,
                    stream.cudarc().cu_stream(),
                )
            }
            .map_err(driver("cuMemcpyDtoDAsync"))?;
            src.note_queued(stream)?;
            return self.note_queued(stream);
        }
        // SAFETY: both pointers are live blocks of `len` bytes in their own contexts, both
        // marked used on `stream`; the contexts live as long as their devices.
        unsafe {
            result::memcpy_peer_async(
                dst_ctx,
                self.device_ptr(),
                src_ctx,
                src.device_ptr(),
                self.len,
                stream.cudarc().cu_stream(),
            )
        }
        .map_err(driver("cuMemcpyPeerAsync"))?;
        src.note_queued(stream)?;
        self.note_queued(stream)
    }

    /// Queues a copy of all of `src` into this buffer and returns at once; `src` records an
    /// event so it is neither rewritten nor reused by the pool before the copy has read it.
    pub fn copy_from_pinned_async(
        &mut self,
        src: &mut PinnedBuffer,
        stream: &Stream,
    ) -> Result<(), MemoryError> {
        self.expect_len("copy_from_pinned_async", src.len())?;
        self.copy_from_pinned_async_at(0, src, stream)
    }

    /// Like [`DeviceBuffer::copy_from_pinned_async`], into bytes `offset..offset + src.len()`.
    pub fn copy_from_pinned_async_at(
        &mut self,
        offset: usize,
        src: &mut PinnedBuffer,
        stream: &Stream,
    ) -> Result<(), MemoryError> {
        let dst = self.range("copy_from_pinned_async", offset, src.len(), stream)?;
        if src.is_empty() {
            return Ok(());
        }
        src.order_before(stream)?;
        // SAFETY: the range lies in our block; the pinned bytes stay allocated and unwritten
        // until the event recorded below completes (PinnedBuffer waits on it before handing out
        // `&mut` and the pool before reuse).
        unsafe { result::memcpy_htod_async(dst, src.raw_bytes(), stream.cudarc().cu_stream()) }
            .map_err(driver("cuMemcpyHtoDAsync"))?;
        mark_pending(src, stream)?;
        self.note_queued(stream)
    }

    /// Queues a copy of the whole buffer into `dst` and returns at once; `dst` cannot be read
    /// (it waits) until the copy has finished.
    pub fn copy_to_pinned_async(
        &self,
        dst: &mut PinnedBuffer,
        stream: &Stream,
    ) -> Result<(), MemoryError> {
        self.expect_len("copy_to_pinned_async", dst.len())?;
        self.copy_to_pinned_async_at(0, dst, stream)
    }

    /// Like [`DeviceBuffer::copy_to_pinned_async`], from bytes `offset..offset + dst.len()`.
    pub fn copy_to_pinned_async_at(
        &self,
        offset: usize,
        dst: &mut PinnedBuffer,
        stream: &Stream,
    ) -> Result<(), MemoryError> {
        self.download("copy_to_pinned_async", offset, dst, stream, None)
    }

    /// Queues the device-to-pinned copy of bytes `offset..offset + dst.len()` on `stream`,
    /// ordered after `producers` when given (else after everything on the home stream).
    fn download(
        &self,
        op: &'static str,
        offset: usize,
        dst: &mut PinnedBuffer,
        stream: &Stream,
        producers: Option<&Event>,
    ) -> Result<(), MemoryError> {
        let src = self.range_after(op, offset, dst.len(), stream, producers)?;
        if dst.is_empty() {
            return Ok(());
        }
        dst.order_before(stream)?;
        // SAFETY: the range lies in our block; `dst` is not readable, writable or reusable
        // until the event recorded below completes, and the block is not reused before it
        // either (`note_queued` makes its free wait for the copy).
        unsafe { result::memcpy_dtoh_async(dst.raw_bytes_mut(), src, stream.cudarc().cu_stream()) }
            .map_err(driver("cuMemcpyDtoHAsync"))?;
        mark_pending(dst, stream)?;
        // An in-place write of this buffer on another stream now waits for the copy.
        self.note_queued(stream)
    }

    /// [`DeviceBuffer::copy_to_pinned_async`], ordered on the device after `ready` alone: an
    /// event recorded on this buffer's own stream after the work that wrote its bytes (see
    /// [`DeviceBuffer::stream`]), not after everything queued there so far. Kernels queued on
    /// the buffer's stream since, which read it, run alongside the copy instead of ahead of it
    /// (activation offload queues the copy of a saved activation after the op that reads it
    /// next, yet wants it to start when its producer ends). Work queued since that *writes* the
    /// buffer races with the copy, and the pinned bytes are then unspecified; the device memory
    /// stays valid either way (its reuse waits for the copy), and later uses on other streams
    /// wait for the copy as after any copy.
    pub fn copy_to_pinned_async_after(
        &self,
        dst: &mut PinnedBuffer,
        stream: &Stream,
        ready: &Event,
    ) -> Result<(), MemoryError> {
        self.expect_len("copy_to_pinned_async_after", dst.len())?;
        if ready.cudarc().context() != self.stream.cudarc().context() {
            return Err(MemoryError::DeviceMismatch {
                op: "copy_to_pinned_async_after",
                expected: self.device(),
                actual: Device::Cuda(ready.cudarc().context().ordinal()),
            });
        }
        self.download("copy_to_pinned_async_after", 0, dst, stream, Some(ready))
    }

    /// Queues setting every byte to zero.
    pub fn memset_zero(&mut self, stream: &Stream) -> Result<(), MemoryError> {
        let ptr = self.range("memset_zero", 0, self.len, stream)?;
        if self.is_empty() {
            return Ok(());
        }
        // SAFETY: `ptr..ptr + len` is our live block, marked used on `stream`.
        unsafe { result::memset_d8_async(ptr, 0, self.len, stream.cudarc().cu_stream()) }
            .map_err(driver("cuMemsetD8Async"))?;
        self.note_queued(stream)
    }

    fn expect_len(&self, op: &'static str, actual: usize) -> Result<(), MemoryError> {
        if actual == self.len {
            Ok(())
        } else {
            Err(MemoryError::LengthMismatch {
                op,
                expected: self.len,
                actual,
            })
        }
    }

    /// Validates a byte range and the stream, binds the context, marks the stream as a user, and
    /// returns the device address of the range's start.
    pub(crate) fn range(
        &self,
        op: &'static str,
        offset: usize,
        len: usize,
        stream: &Stream,
    ) -> Result<u64, MemoryError> {
        self.range_after(op, offset, len, stream, None)
    }

    /// [`DeviceBuffer::range`], the use ordered after `producers` when given (see
    /// [`DeviceBuffer::order_use_after`]).
    fn range_after(
        &self,
        op: &'static str,
        offset: usize,
        len: usize,
        stream: &Stream,
        producers: Option<&Event>,
    ) -> Result<u64, MemoryError> {
        self.device.check()?;
        self.device.check_stream(op, stream)?;
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(MemoryError::OutOfBounds {
                op,
                offset,
                len,
                buffer_len: self.len,
            });
        }
        self.device.bind()?;
        self.order_use_after(stream, producers)?;
        // Waiting may have bound another context (an event's); the copy runs in ours.
        self.device.bind()?;
        Ok(self.device_ptr() + offset as u64)
    }

    /// [`DeviceBuffer::note_queued`], for the pinned batch in this crate.
    pub(crate) fn queued_on(&self, stream: &Stream) -> Result<(), MemoryError> {
        self.note_queued(stream)
    }

    /// Like [`DeviceBuffer::note_queued`], with an event the caller records on `stream` later:
    /// an NCCL collective queued inside a group is launched only when the group ends, so its
    /// event is recorded then. Until it is recorded the event counts as complete.
    pub(crate) fn queued_with(&self, stream: &Stream, event: &Arc<Event>) {
        if *stream == self.stream || self.is_empty() {
            return;
        }
        let mut foreign = self.foreign.lock();
        if let Some((_, last_copy)) = foreign.streams.iter_mut().find(|(s, _)| s == stream) {
            *last_copy = Some(Arc::clone(event));
        }
        match foreign
            .in_flight
            .iter_mut()
            .find(|(id, _)| *id == stream.id())
        {
            Some(slot) => slot.1 = Arc::clone(event),
            None => foreign.in_flight.push((stream.id(), Arc::clone(event))),
        }
        self.in_flight
            .store(foreign.in_flight.len(), Ordering::Release);
    }
}

/// Records the copy just queued on `pinned`. If that fails, waits for the stream instead, so the
/// buffer is never handed out while a DMA still uses it.
fn mark_pending(pinned: &mut PinnedBuffer, stream: &Stream) -> Result<(), MemoryError> {
    pinned.record(stream).inspect_err(|_| {
        // The record error is the one to report; a failing wait means the context is gone.
        let _ = stream.synchronize();
    })
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let block = match self.block.take() {
            None => return,
            Some(Memory::Pooled(block)) => block,
            Some(Memory::External { owner, .. }) => {
                self.release_external(owner);
                return;
            }
        };
        let what = |doing: &str| {
            format!(
                "{doing} a {} device buffer on {} being dropped",
                human_bytes(self.len),
                self.device.device()
            )
        };
        // Other streams' uses: a copy this crate queued there (the stream's last use of the
        // buffer) is waited for by the allocator, which reuses the block only once the copy's
        // event completes, so freeing never makes the home stream wait for a copy (a pipeline
        // that drops each frame after queuing its move keeps the GPU and the link overlapped).
        // Any other use (a caller's kernels) is folded into the home stream's order.
        let foreign = std::mem::take(self.foreign.get_mut());
        let mut after = Vec::new();
        for (other, last_copy) in foreign.streams {
            let joined = match last_copy {
                Some(event) => {
                    if !event.is_complete() {
                        after.push(event);
                    }
                    Ok(())
                }
                None => other
                    .record()
                    .and_then(|event| self.stream.wait_event(&event)),
            };
            if let Err(e) = joined {
                self.device.defer(
                    what("ordering the reuse (after its uses on other streams) of"),
                    e,
                );
                // Without the join, waiting for the other stream is the only safe state.
                if let Err(e) = other.synchronize() {
                    self.device
                        .defer(what("waiting for another stream's use of"), e);
                }
            }
        }
        let record = self.device.is_multi_stream();
        if let Err(e) = self
            .device
            .inner
            .allocator
            .release(block, &self.stream, record, after)
        {
            self.device.defer(
                what("returning to the allocator (recording its free on its stream)"),
                e,
            );
        }
    }
}

impl DeviceBuffer {
    /// Waits for every stream that used this external memory, then drops its owner: the other
    /// runtime may reuse the memory at once, on a stream ferry does not order against.
    fn release_external(&mut self, owner: Box<dyn Send + Sync>) {
        let foreign = std::mem::take(self.foreign.get_mut());
        let streams =
            std::iter::once(self.stream.clone()).chain(foreign.streams.into_iter().map(|(s, _)| s));
        for stream in streams {
            if let Err(e) = stream.synchronize() {
                let doing = format!(
                    "waiting for the work on a {} external device buffer on {} being dropped",
                    human_bytes(self.len),
                    self.device.device()
                );
                self.device.defer(doing, e);
            }
        }
        drop(owner);
    }
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("device", &self.device())
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

// Tensors holding buffers are shared across threads.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<DeviceBuffer>()
};
