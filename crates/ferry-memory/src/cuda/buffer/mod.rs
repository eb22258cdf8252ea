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

use parking_lot::Mutex;

use super::allocator::Block;
use super::device::CudaDevice;
use super::stream::{Event, Stream};
use crate::size::human_bytes;
use crate::{Device, MemoryError};

mod copy;

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

    /// Validates a byte range and the stream, binds the context, orders the use on `stream` as
    /// [`DeviceBuffer::record_stream`] does, and returns the device address of the range's
    /// start: what a library call that reads or writes part of the buffer passes (NCCL's
    /// collectives). Errors name `op`.
    pub fn range(
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
    pub(crate) fn range_after(
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

    /// Records, after work just queued on `stream` used this buffer (a copy, a collective), the
    /// event that later uses on other streams wait for, and that the allocator waits for before
    /// it reuses the memory. Nothing to do on the buffer's own stream.
    pub fn queued_on(&self, stream: &Stream) -> Result<(), MemoryError> {
        self.note_queued(stream)
    }

    /// Like [`DeviceBuffer::queued_on`], with an event the caller records on `stream` later:
    /// an NCCL collective queued inside a group is launched only when the group ends, so its
    /// event is recorded then. Until it is recorded the event counts as complete.
    pub fn queued_with(&self, stream: &Stream, event: &Arc<Event>) {
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
