//! ferry's moves on any DLPack tensor (torch's, numpy's): the source is used in place, the
//! result is a `ferry.Tensor` that torch takes back without a copy. The GIL is released while
//! bytes move.
//!
//! Each move that touches a GPU takes `stream`, torch's current stream on that GPU (from the
//! Python package), and is ordered with it as torch's own `.to()` is (crate::order).

use std::collections::HashMap;
use std::sync::OnceLock;

use ferry::memory::Device;
use ferry::memory::cuda::{CudaDevice, Stream};
use ferry::tensor::Buffer;
use ferry::{ChunkSpec, DeviceMove, MoveOptions};
use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::dlpack::{self, Misaligned};
use crate::errors::{guarded, to_py};
use crate::order::{self, TorchStream};
use crate::tensor::{PyPending, PyReport, PyTensor, parse_device, parse_dtype};

/// A ferry tensor over `obj`'s memory (no copy); `obj` stays alive as long as it does.
/// Misaligned memory is refused (sharing it is the point), naming the fix.
#[pyfunction]
pub fn from_dlpack(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<PyTensor> {
    guarded(|| {
        Ok(PyTensor::new(
            dlpack::import(py, obj, Misaligned::Refuse)?.tensor,
        ))
    })
}

/// The GPU a move between `from` and `to` runs on, if any.
pub(crate) fn gpu_of(from: Device, to: Device) -> Option<usize> {
    match (from, to) {
        (Device::Cuda(n), _) | (_, Device::Cuda(n)) => Some(n),
        (Device::Cpu, Device::Cpu) => None,
    }
}

/// The DLPack device of a tensor or capsule without importing it: `capsule_device` when the
/// caller names it, else what an unused capsule says; other objects answer `__dlpack_device__`.
pub(crate) fn source_device(
    obj: &Bound<'_, PyAny>,
    capsule_device: Option<&str>,
) -> PyResult<Device> {
    if let Some(name) = capsule_device {
        return parse_device(name);
    }
    if let Some(device) = dlpack::capsule_device(obj) {
        return Ok(device);
    }
    let (kind, id) = obj
        .call_method0("__dlpack_device__")?
        .extract::<(i32, i32)>()?;
    Ok(if kind == 2 {
        Device::Cuda(usize::try_from(id).unwrap_or(0))
    } else {
        Device::Cpu
    })
}

/// `t` (from `source`, see [`source_device`]) imported for a move to `device`, after ferry's
/// default stream was ordered behind torch's stream `stream` on the GPU side of the move (the
/// source's producers come before a realigning copy and the move); and that torch stream, for
/// the move to order back.
fn import_ordered(
    py: Python<'_>,
    t: &Bound<'_, PyAny>,
    source: Option<&str>,
    device: Device,
    stream: Option<u64>,
) -> PyResult<(Option<TorchStream>, dlpack::Imported)> {
    let torch = match gpu_of(source_device(t, source)?, device) {
        Some(gpu) => TorchStream::new(gpu, stream)?,
        None => None,
    };
    order::before(torch.as_ref()).map_err(to_py)?;
    Ok((torch, dlpack::import(py, t, Misaligned::Copy)?))
}

/// `t` on `device`, cast to `dtype` on the way if given. Returns `(tensor, report)`, or with
/// `non_blocking` a `Pending` whose `wait()` returns them once the copy has landed.
///
/// `t` is a tensor, an array or a DLPack capsule (then `source` names its device); `stream` is
/// torch's current stream on the GPU side of the move, which the move is ordered with.
#[pyfunction]
#[pyo3(signature = (t, device, dtype=None, non_blocking=false, stream=None, source=None))]
pub fn to(
    py: Python<'_>,
    t: &Bound<'_, PyAny>,
    device: &str,
    dtype: Option<&str>,
    non_blocking: bool,
    stream: Option<u64>,
    source: Option<&str>,
) -> PyResult<Py<PyAny>> {
    guarded(|| {
        let device = parse_device(device)?;
        let options = MoveOptions {
            dtype: dtype.map(parse_dtype).transpose()?,
            non_blocking,
        };
        let (torch, imported) = import_ordered(py, t, source, device, stream)?;
        let source = imported.tensor;
        let (out, report) = py
            .detach(|| {
                let moved = source.to_with(device, options)?;
                order::after(torch.as_ref())?;
                Ok::<_, ferry::TensorError>(moved)
            })
            .map_err(to_py)?;
        let mut report = PyReport::from(&report);
        report.realigned_bytes = imported.realigned_bytes;
        let in_flight = matches!(&*out.storage().read(), Buffer::Pinned(b) if !b.is_ready());
        if non_blocking && in_flight {
            // The source is released only after the copy (dropping it waits for its stream).
            let pending = PyPending::landing(out, source, report);
            return Ok(Py::new(py, pending)?.into_any());
        }
        py.detach(move || drop(source));
        let pair = (PyTensor::new(out), report);
        Ok(pair.into_pyobject(py)?.into_any().unbind())
    })
}

/// `t` on `device` in pieces through bounded pinned staging: staging of at most a `chunks`-th
/// of the tensor, or of at most `max_staging_bytes` (one of the two; a quarter when neither is
/// given), never less than one row.
#[pyfunction]
#[pyo3(signature = (t, device, chunks=None, max_staging_bytes=None, stream=None, source=None))]
pub fn to_chunked(
    py: Python<'_>,
    t: &Bound<'_, PyAny>,
    device: &str,
    chunks: Option<usize>,
    max_staging_bytes: Option<usize>,
    stream: Option<u64>,
    source: Option<&str>,
) -> PyResult<(PyTensor, PyReport)> {
    guarded(|| {
        let device = parse_device(device)?;
        let spec = chunk_spec(chunks, max_staging_bytes)?;
        let (torch, imported) = import_ordered(py, t, source, device, stream)?;
        let source = imported.tensor;
        let (out, report) = py
            .detach(move || {
                let moved = source.to_chunked(device, spec)?;
                drop(source);
                order::after(torch.as_ref())?;
                Ok::<_, ferry::TensorError>(moved)
            })
            .map_err(to_py)?;
        let mut report = PyReport::from(&report);
        report.realigned_bytes = imported.realigned_bytes;
        Ok((PyTensor::new(out), report))
    })
}

/// Staging of at most a `chunks`-th of the tensor or at most `max_staging_bytes` (one of the
/// two; a quarter of the tensor when neither is given).
pub(crate) fn chunk_spec(
    chunks: Option<usize>,
    max_staging_bytes: Option<usize>,
) -> PyResult<ChunkSpec> {
    match (chunks, max_staging_bytes) {
        (Some(_), Some(_)) => Err(PyValueError::new_err(
            "pass chunks or max_staging_bytes, not both",
        )),
        (_, Some(bytes)) => Ok(ChunkSpec::MaxStagingBytes(bytes)),
        (chunks, None) => Ok(ChunkSpec::Count(chunks.unwrap_or(4))),
    }
}

/// `t` on `device`, queued on a copy stream of the GPU side that ferry keeps per device, and
/// returned at once as a `Pending`. The copy is ordered after the work already queued on torch's
/// current stream `stream` (where torch computed `t`), and runs while later work there computes:
/// that later work is not ordered after it unless `Pending.order_stream` says so.
#[pyfunction]
#[pyo3(signature = (t, device, stream=None, source=None))]
pub fn to_async(
    py: Python<'_>,
    t: &Bound<'_, PyAny>,
    device: &str,
    stream: Option<u64>,
    source: Option<&str>,
) -> PyResult<PyPending> {
    guarded(|| {
        let device = parse_device(device)?;
        let Some(gpu) = gpu_of(source_device(t, source)?, device) else {
            return Err(PyValueError::new_err(
                "to_async moves to or from a GPU; for a host tensor on the host use to()",
            ));
        };
        let (_, imported) = import_ordered(py, t, source, device, stream)?;
        let source = imported.tensor;
        let pending = py
            .detach(move || {
                let stream = copy_stream(gpu)?;
                source.to_async(device, &stream)
            })
            .map_err(to_py)?;
        Ok(PyPending::queued(pending, imported.realigned_bytes))
    })
}

/// The copy stream of GPU `ordinal`, made on first use and kept for the process.
pub(crate) fn copy_stream(ordinal: usize) -> ferry::Result<Stream> {
    static STREAMS: OnceLock<Mutex<HashMap<usize, Stream>>> = OnceLock::new();
    let mut streams = STREAMS.get_or_init(Default::default).lock();
    if let Some(stream) = streams.get(&ordinal) {
        return Ok(stream.clone());
    }
    let stream = CudaDevice::get(ordinal)?.new_stream()?;
    streams.insert(ordinal, stream.clone());
    Ok(stream)
}

/// Page-locks the host memory of `t` in place, within the pinned budget: returns a ferry tensor
/// over it that keeps it locked until freed, and whether it was locked now (`False`: it was
/// page-locked already).
#[pyfunction]
pub fn pin(py: Python<'_>, t: &Bound<'_, PyAny>) -> PyResult<(PyTensor, bool)> {
    guarded(|| {
        let imported = dlpack::import(py, t, Misaligned::Refuse)?;
        let tensor = imported.tensor;
        if tensor.device() != Device::Cpu {
            return Err(PyValueError::new_err(format!(
                "pin_ page-locks host memory; this tensor is on {}",
                tensor.device()
            )));
        }
        let locked = py.detach(|| tensor.pin_in_place()).map_err(to_py)?;
        Ok((PyTensor::new(tensor), locked))
    })
}

/// Notes that work queued on `stream` (a handle of GPU `ordinal`) uses the ferry memory at
/// address `ptr` (on GPU `ordinal` when `on_gpu`, else on the host): it is not reused before that
/// work has run. `False` when no memory ferry handed out holds the address.
#[pyfunction]
pub fn record_stream(ptr: usize, on_gpu: bool, ordinal: usize, stream: u64) -> PyResult<bool> {
    guarded(|| {
        let device = CudaDevice::get(ordinal).map_err(|e| to_py(e.into()))?;
        // SAFETY: a live stream of that GPU, named by the caller (torch's `Stream.cuda_stream`);
        // torch's streams live for the process.
        let stream = unsafe { device.borrow_stream(stream) }.map_err(|e| to_py(e.into()))?;
        let place = if on_gpu {
            Device::Cuda(ordinal)
        } else {
            Device::Cpu
        };
        Ok(dlpack::record_stream_at(ptr, place, &stream))
    })
}
