//! ferry's moves on any DLPack tensor (torch's, numpy's): the source is used in place, the
//! result is a `ferry.Tensor` that torch takes back without a copy. The GIL is released while
//! bytes move.

use ferry::memory::Device;
use ferry::memory::cuda::PinnedPool;
use ferry::tensor::Buffer;
use ferry::{ChunkSpec, DeviceMove, MoveOptions, Tensor};
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
        let pending = PyPending {
            tensor: Some(out),
            source: Some(source),
            report,
        };
        return Ok(Py::new(py, pending)?.into_any());
    }
    py.detach(move || drop(source));
    let pair = (PyTensor { inner: out }, PyReport::from(&report));
    Ok(pair.into_pyobject(py)?.into_any().unbind())
}

/// `t` on `device` in pieces through bounded pinned staging: `chunks` pieces, or staging of
/// at most `max_staging_bytes` (one of the two; 4 pieces when neither is given).
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
    let spec = match (chunks, max_staging_bytes) {
        (Some(_), Some(_)) => {
            return Err(PyValueError::new_err(
                "pass chunks or max_staging_bytes, not both",
            ));
        }
        (_, Some(bytes)) => ChunkSpec::MaxStagingBytes(bytes),
        (chunks, None) => ChunkSpec::Count(chunks.unwrap_or(4)),
    };
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

/// Page-locked memory ferry may hold at once, in bytes (staging and move results together).
#[pyfunction]
pub fn pinned_budget() -> PyResult<usize> {
    Ok(PinnedPool::global().map_err(|e| to_py(e.into()))?.budget())
}

/// Sets the pinned-memory budget; moves beyond it go through bounded staging into pageable
/// memory instead of failing.
#[pyfunction]
pub fn set_pinned_budget(bytes: usize) -> PyResult<()> {
    PinnedPool::global()
        .and_then(|p| p.set_budget(bytes))
        .map_err(|e| to_py(e.into()))
}

/// The pinned pool's statistics: allocated, reserved, cached and peak bytes, the budget, and
/// allocation counts.
#[pyfunction]
pub fn pinned_stats(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let s = PinnedPool::global().map_err(|e| to_py(e.into()))?.stats();
    let out = PyDict::new(py);
    out.set_item("allocated_bytes", s.allocated_bytes)?;
    out.set_item("reserved_bytes", s.reserved_bytes)?;
    out.set_item("cached_bytes", s.cached_bytes)?;
    out.set_item("peak_allocated_bytes", s.peak_allocated_bytes)?;
    out.set_item("budget_bytes", s.budget_bytes)?;
    out.set_item("allocations", s.allocations)?;
    out.set_item("cache_hits", s.cache_hits)?;
    Ok(out)
}

/// Whether a CUDA driver and at least one GPU are there.
#[pyfunction]
pub fn cuda_available() -> bool {
    ferry::memory::cuda::driver_present()
        && ferry::memory::cuda::devices().is_ok_and(|d| !d.is_empty())
}

/// Frees the cached blocks of `device`'s allocator (`cuda:N`) or of the pinned pool (`cpu`).
#[pyfunction]
pub fn empty_cache(device: &str) -> PyResult<()> {
    match parse_device(device)? {
        Device::Cpu => PinnedPool::global().and_then(|p| p.empty_cache()),
        Device::Cuda(n) => ferry::memory::cuda::CudaDevice::get(n).and_then(|d| d.empty_cache()),
    }
    .map_err(|e| to_py(e.into()))
}
