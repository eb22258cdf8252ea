//! Streams (ordered queues of device work) and events (points in a stream that the host or
//! another stream can wait on, or time).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream, DriverError};

use crate::{Device, MemoryError};

/// Turns a cudarc driver error into ours, naming the call.
pub(crate) fn driver(call: &'static str) -> impl FnOnce(DriverError) -> MemoryError {
    move |e| MemoryError::Driver {
        call,
        message: e.to_string(),
    }
}

/// Stream identities are never reused, unlike driver handles: the allocator keys "freed on
/// this stream" by them, and a recycled handle would let a block skip its event check.
static NEXT_STREAM_ID: AtomicU64 = AtomicU64::new(1);

/// A queue of device work, executed in order. Cheap to clone (clones share the queue).
#[derive(Clone)]
pub struct Stream {
    inner: Arc<CudaStream>,
    id: u64,
}

impl Stream {
    pub(crate) fn wrap(inner: Arc<CudaStream>) -> Self {
        Self {
            inner,
            id: NEXT_STREAM_ID.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// A process-unique identity for this stream.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The device this stream runs on.
    pub fn device(&self) -> Device {
        Device::Cuda(self.inner.context().ordinal())
    }

    /// The raw `CUstream` handle as an integer (0 for the legacy default stream): what another
    /// runtime needs to order its work with this stream's (`torch.cuda.ExternalStream`).
    pub fn handle(&self) -> u64 {
        self.inner.cu_stream() as usize as u64
    }

    /// The cudarc stream, for code in ferry-memory's dependants that launches through cudarc.
    pub fn cudarc(&self) -> &Arc<CudaStream> {
        &self.inner
    }

    /// Blocks the host until all work queued so far has finished.
    pub fn synchronize(&self) -> Result<(), MemoryError> {
        self.inner
            .synchronize()
            .map_err(driver("cuStreamSynchronize"))
    }

    /// Makes later work on this stream wait until `event` has completed, without blocking the
    /// host. The event may belong to another stream or another device.
    pub fn wait_event(&self, event: &Event) -> Result<(), MemoryError> {
        self.inner
            .wait(&event.inner)
            .map_err(driver("cuStreamWaitEvent"))
    }

    /// Records an event (without timing, which is cheaper) at the current end of this stream.
    pub fn record(&self) -> Result<Event, MemoryError> {
        let event = Event::new(self, false)?;
        event.record(self)?;
        Ok(event)
    }

    /// Records an event that can be used with [`Event::elapsed_ms`].
    pub fn record_timed(&self) -> Result<Event, MemoryError> {
        let event = Event::new(self, true)?;
        event.record(self)?;
        Ok(event)
    }
}

impl PartialEq for Stream {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}

impl Eq for Stream {}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream")
            .field("id", &self.id)
            .field("device", &self.device())
            .finish()
    }
}

/// A marker in a stream: completes when the work queued before it has finished.
pub struct Event {
    inner: CudaEvent,
    timed: bool,
}

impl Event {
    /// A new, unrecorded event on `stream`'s device; `timed` enables [`Event::elapsed_ms`].
    pub fn new(stream: &Stream, timed: bool) -> Result<Self, MemoryError> {
        let flags = if timed {
            CUevent_flags::CU_EVENT_DEFAULT
        } else {
            CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        let inner = stream
            .inner
            .context()
            .new_event(Some(flags))
            .map_err(driver("cuEventCreate"))?;
        Ok(Self { inner, timed })
    }

    /// A new event with timing enabled.
    pub fn timed(stream: &Stream) -> Result<Self, MemoryError> {
        Self::new(stream, true)
    }

    /// Moves this event to the current end of `stream` (same device).
    pub fn record(&self, stream: &Stream) -> Result<(), MemoryError> {
        self.inner
            .record(&stream.inner)
            .map_err(driver("cuEventRecord"))
    }

    /// Blocks the host until the event has completed.
    pub fn synchronize(&self) -> Result<(), MemoryError> {
        self.inner
            .synchronize()
            .map_err(driver("cuEventSynchronize"))
    }

    /// Whether the recorded work has finished, without waiting; errors from that work surface
    /// here. An event never recorded counts as complete.
    pub fn query(&self) -> Result<bool, MemoryError> {
        self.inner.try_is_complete().map_err(driver("cuEventQuery"))
    }

    /// Like [`Event::query`], treating an error as "not complete".
    pub fn is_complete(&self) -> bool {
        self.query().unwrap_or(false)
    }

    /// Milliseconds between two timed events on the same device; waits for both.
    pub fn elapsed_ms(start: &Event, end: &Event) -> Result<f32, MemoryError> {
        if !start.timed || !end.timed {
            return Err(MemoryError::EventTimingDisabled);
        }
        start
            .inner
            .elapsed_ms(&end.inner)
            .map_err(driver("cuEventElapsedTime"))
    }

    /// The cudarc event.
    pub fn cudarc(&self) -> &CudaEvent {
        &self.inner
    }
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Event")
            .field("timed", &self.timed)
            .finish_non_exhaustive()
    }
}
