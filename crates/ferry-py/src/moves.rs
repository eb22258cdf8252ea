//! ferry's moves on any DLPack tensor (torch's, numpy's): the source is used in place, the
//! result is a `ferry.Tensor` that torch takes back without a copy. The GIL is released while
//! bytes move.

use std::collections::HashMap;
use std::sync::OnceLock;

use ferry::memory::Device;
use ferry::memory::cuda::{CudaDevice, Stream};
use ferry::tensor::Buffer;
use ferry::{ChunkSpec, DeviceMove, MoveOptions, Tensor};
use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::dlpack;
use crate::errors::to_py;
use crate::tensor::{PyPending, PyReport, PyTensor, parse_device, parse_dtype};

/// A ferry tensor over `obj`'s memory (no copy); `obj` stays alive as long as it does.
#[pyfunction]
pub fn from_dlpack(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<PyTensor> {
    Ok(PyTensor {
        inner: dlpack::import(py, obj)?,
    })
}

/// `t` on `device`, cast to `dtype` on the way if given. Returns `(tensor, report)`, or with
/// `non_blocking` a `Pending` whose `wait()` returns them once the copy has landed.
#[pyfunction]
#[pyo3(signature = (t, device, dtype=None, non_blocking=false))]
pub fn to(
    py: Python<'_>,
    t: &Bound<'_, PyAny>,
    device: &str,
    dtype: Option<&str>,
    non_blocking: bool,
) -> PyResult<Py<PyAny>> {
    let device = parse_device(device)?;
    let options = MoveOptions {
        dtype: dtype.map(parse_dtype).transpose()?,
        non_blocking,
    };
    let source = dlpack::import(py, t)?;
    let moved = source.clone();
    let (out, report) = py
        .detach(move || moved.to_with(device, options))
        .map_err(to_py)?;
    let in_flight = matches!(&*out.storage().read(), Buffer::Pinned(b) if !b.is_ready());
    if non_blocking && in_flight {
        // The source is released only after the copy (dropping it waits for its stream).
        let pending = PyPending::landing(out, source, report);
        return Ok(Py::new(py, pending)?.into_any());
    }
    py.detach(move || drop(source));
    let pair = (PyTensor { inner: out }, PyReport::from(&report));
    Ok(pair.into_pyobject(py)?.into_any().unbind())
}

/// `t` on `device` in pieces through bounded pinned staging: staging of at most a `chunks`-th
/// of the tensor, or of at most `max_staging_bytes` (one of the two; a quarter when neither is
/// given), never less than one row.
#[pyfunction]
#[pyo3(signature = (t, device, chunks=None, max_staging_bytes=None))]
pub fn to_chunked(
    py: Python<'_>,
    t: &Bound<'_, PyAny>,
    device: &str,
    chunks: Option<usize>,
    max_staging_bytes: Option<usize>,
) -> PyResult<(PyTensor, PyReport)> {
    let device = parse_device(device)?;
    let spec = chunk_spec(chunks, max_staging_bytes)?;
    let source = dlpack::import(py, t)?;
    let (out, report) = py
        .detach(move || {
            let moved = source.to_chunked(device, spec);
            drop(source);
            moved
        })
        .map_err(to_py)?;
    Ok((PyTensor { inner: out }, PyReport::from(&report)))
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

/// Every tensor of `state_dict` (a dict of name to tensor) on `device`, batched by dtype:
/// `({name: tensor}, report)`.
#[pyfunction]
pub fn move_state_dict<'py>(
    py: Python<'py>,
    state_dict: &Bound<'py, PyDict>,
    device: &str,
) -> PyResult<(Bound<'py, PyDict>, PyReport)> {
    let device = parse_device(device)?;
    let mut tensors: Vec<(String, Tensor)> = Vec::with_capacity(state_dict.len());
    for (name, value) in state_dict.iter() {
        let name: String = name.extract()?;
        tensors.push((name, dlpack::import(py, &value)?));
    }
    let (moved, report) = py
        .detach(move || {
            let moved = ferry::move_state_dict(&tensors, device);
            drop(tensors);
            moved
        })
        .map_err(to_py)?;
    let out = PyDict::new(py);
    for (name, t) in moved {
        out.set_item(name, PyTensor { inner: t })?;
    }
    Ok((out, PyReport::from(&report)))
}

/// `t` on `device`, queued on a copy stream of the GPU side that ferry keeps per device, and
/// returned at once as a `Pending`. The copy is ordered after the work already queued on the
/// default stream (where torch computed `t`), and runs while later work there computes.
#[pyfunction]
pub fn to_async(py: Python<'_>, t: &Bound<'_, PyAny>, device: &str) -> PyResult<PyPending> {
    let device = parse_device(device)?;
    let source = dlpack::import(py, t)?;
    let gpu = match (source.device(), device) {
        (Device::Cuda(n), _) | (_, Device::Cuda(n)) => n,
        (Device::Cpu, Device::Cpu) => {
            return Err(PyValueError::new_err(
                "to_async moves to or from a GPU; for a host tensor on the host use to()",
            ));
        }
    };
    let pending = py
        .detach(move || {
            let stream = copy_stream(gpu)?;
            source.to_async(device, &stream)
        })
        .map_err(to_py)?;
    Ok(PyPending::queued(pending))
}

/// The copy stream of GPU `ordinal`, made on first use and kept for the process.
fn copy_stream(ordinal: usize) -> ferry::Result<Stream> {
    static STREAMS: OnceLock<Mutex<HashMap<usize, Stream>>> = OnceLock::new();
    let mut streams = STREAMS.get_or_init(Default::default).lock();
    if let Some(stream) = streams.get(&ordinal) {
        return Ok(stream.clone());
    }
    let stream = CudaDevice::get(ordinal)?.new_stream()?;
    streams.insert(ordinal, stream.clone());
    Ok(stream)
}
