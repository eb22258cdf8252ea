//! Stream order with torch: every call that touches a GPU is told torch's current stream there
//! (`torch.cuda.current_stream(device).cuda_stream`, passed from Python), and ferry's work,
//! which runs on its own streams (each GPU's legacy default stream, and a copy stream per GPU),
//! is ordered with it as torch's own `.to()` on that stream would be:
//!
//! - [`TorchStream::before`]: ferry's default stream waits, on the device, for the work torch
//!   queued on its stream so far (the producers of the source);
//! - [`TorchStream::after`]: torch's stream waits for the work ferry queued (the copy's reads of
//!   the source and writes of the destination), so nothing torch queues later can overtake it.
//!
//! Neither blocks the host. When torch's current stream is the legacy default stream (torch's
//! default stream, handle 0), it is ferry's default stream and both are nothing.
//!
//! Pinned memory handed to torch is freed by torch (through the DLPack deleter) at a moment
//! ferry does not choose; [`current_streams`] asks torch for its current stream on each GPU then,
//! so the block is reused only after the work queued there has run (torch's own rule for its
//! pinned memory).

use ferry::memory::cuda::{CudaDevice, Stream};
use parking_lot::Mutex;
use pyo3::prelude::*;

use crate::errors::{guarded, to_py};

/// torch's current stream on one GPU, for the length of one call.
pub struct TorchStream {
    device: CudaDevice,
    stream: Stream,
}

impl TorchStream {
    /// torch's stream `handle` on GPU `ordinal`; `None` when there is nothing to order: no
    /// handle given (no torch in the call), or torch's current stream is the legacy default
    /// stream, which ferry's default stream is.
    pub fn new(ordinal: usize, handle: Option<u64>) -> PyResult<Option<Self>> {
        let Some(handle) = handle.filter(|&h| h > 1) else {
            return Ok(None);
        };
        let device = CudaDevice::get(ordinal).map_err(|e| to_py(e.into()))?;
        // SAFETY: the handle is torch's current stream of that GPU, read by the caller just
        // now; torch's streams come from pools that live for the process.
        let stream = unsafe { device.borrow_stream(handle) }.map_err(|e| to_py(e.into()))?;
        Ok(Some(Self { device, stream }))
    }

    /// ferry's default stream waits for the work queued on torch's stream so far.
    pub fn before(&self) -> ferry::Result<()> {
        let event = self.stream.record()?;
        Ok(self.device.default_stream().wait_event(&event)?)
    }

    /// torch's stream waits for the work queued on ferry's default stream so far.
    pub fn after(&self) -> ferry::Result<()> {
        let event = self.device.default_stream().record()?;
        Ok(self.stream.wait_event(&event)?)
    }
}

/// torch's stream `handle` on GPU `ordinal` as a ferry stream, the legacy default stream
/// (ferry's default stream) for handles 0 and 1: for making torch's current stream wait on an
/// event, which the legacy default stream must do too.
pub fn torch_or_default(ordinal: usize, handle: Option<u64>) -> PyResult<Stream> {
    match TorchStream::new(ordinal, handle)? {
        Some(torch) => Ok(torch.stream),
        None => Ok(CudaDevice::get(ordinal)
            .map_err(|e| to_py(e.into()))?
            .default_stream()
            .clone()),
    }
}

/// [`TorchStream::before`], when there is a torch stream to order with.
pub fn before(torch: Option<&TorchStream>) -> ferry::Result<()> {
    torch.map_or(Ok(()), TorchStream::before)
}

/// [`TorchStream::after`], when there is a torch stream to order with.
pub fn after(torch: Option<&TorchStream>) -> ferry::Result<()> {
    torch.map_or(Ok(()), TorchStream::after)
}

/// What ferry/__init__.py registered to read torch's current streams (see the module docs).
static CURRENT_STREAMS: Mutex<Option<Py<PyAny>>> = Mutex::new(None);

/// Registers `source(ordinals) -> [handle, ...]`, which returns torch's current stream on each
/// GPU ordinal it is given (an empty list when torch has not initialized CUDA).
#[pyfunction]
pub fn set_current_streams(source: Py<PyAny>) -> PyResult<()> {
    guarded(|| {
        *CURRENT_STREAMS.lock() = Some(source);
        Ok(())
    })
}

/// torch's current stream on GPU `ordinal`, asked through the registered source: `None` when
/// there is none (no torch in the process) or torch has not initialized CUDA.
pub fn torch_stream(py: Python<'_>, ordinal: usize) -> PyResult<Option<u64>> {
    let Some(source) = CURRENT_STREAMS.lock().as_ref().map(|s| s.clone_ref(py)) else {
        return Ok(None);
    };
    let handles: Vec<u64> = source.call1(py, (vec![ordinal],))?.extract(py)?;
    Ok(handles.first().copied())
}

/// What torch would have to finish before memory it may use is reused.
pub enum InUse {
    /// These streams (torch's current stream on each GPU ferry uses).
    Streams(Vec<Stream>),
    /// Nobody registered a source: no torch in the process, so nothing but ferry, which orders
    /// its own work, queues device work on ferry's memory.
    Nothing,
    /// The source could not be asked (the interpreter is shutting down, or it raised): only
    /// waiting for every device is safe.
    Unknown,
}

/// torch's current stream on every GPU ferry has used, asked now (from any thread; an exception
/// already in flight on this thread is kept).
pub fn current_streams() -> InUse {
    let devices = CudaDevice::made();
    if devices.is_empty() {
        return InUse::Nothing;
    }
    let handles = Python::try_attach(|py| {
        let source = CURRENT_STREAMS.lock().as_ref().map(|s| s.clone_ref(py));
        let source = source?;
        let in_flight = PyErr::take(py);
        let ordinals: Vec<usize> = devices.iter().map(CudaDevice::ordinal).collect();
        let answer = source
            .call1(py, (ordinals,))
            .and_then(|handles| handles.extract::<Vec<u64>>(py));
        if let Some(err) = in_flight {
            err.restore(py);
        }
        Some(answer.ok())
    });
    let handles = match handles {
        Some(Some(Some(handles))) => handles,
        Some(None) => return InUse::Nothing,
        _ => return InUse::Unknown,
    };
    let streams = devices
        .iter()
        .zip(handles)
        .filter_map(|(device, handle)| {
            // SAFETY: torch's current stream of that GPU, just read; torch's streams live for
            // the process.
            unsafe { device.borrow_stream(handle) }.ok()
        })
        .collect();
    InUse::Streams(streams)
}
