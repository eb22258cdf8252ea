//! ferry's moves on any DLPack tensor (torch's, numpy's): the source is used in place, the
//! result is a `ferry.Tensor` that torch takes back without a copy. The GIL is released while
//! bytes move.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use ferry::memory::cuda::{CudaDevice, PinnedPool, Stream};
use ferry::memory::{Device, MemoryError};
use ferry::tensor::{Buffer, Storage};
use ferry::{ChunkSpec, ChunkStream, DeviceMove, Layout, MoveOptions, Tensor};
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
fn chunk_spec(chunks: Option<usize>, max_staging_bytes: Option<usize>) -> PyResult<ChunkSpec> {
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

/// The host chunks of `t` along axis 0, in order, through a ring of pinned staging (at most a
/// `chunks`-th of the tensor, or at most `max_staging_bytes`; a quarter when neither is given):
/// an iterator of
/// `(index, start_row, stop_row, tensor)`. Detached data.
#[pyfunction]
#[pyo3(signature = (t, chunks=None, max_staging_bytes=None))]
pub fn stream_to(
    py: Python<'_>,
    t: &Bound<'_, PyAny>,
    chunks: Option<usize>,
    max_staging_bytes: Option<usize>,
) -> PyResult<PyChunkStream> {
    let spec = chunk_spec(chunks, max_staging_bytes)?;
    let source = dlpack::import(py, t)?;
    let stream = py
        .detach(move || source.stream_to(Device::Cpu, spec))
        .map_err(to_py)?;
    Ok(PyChunkStream {
        inner: Some(stream),
    })
}

/// A GPU tensor's host chunks in flight: iterate it, or `close()` it to stop early and give the
/// staging back.
#[pyclass(name = "ChunkStream", module = "ferry")]
pub struct PyChunkStream {
    /// `None` once closed.
    inner: Option<ChunkStream>,
}

#[pymethods]
impl PyChunkStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// The next chunk, `(index, start_row, stop_row, tensor)`; waits for its copy only.
    fn __next__(&mut self, py: Python<'_>) -> PyResult<Option<(usize, usize, usize, PyTensor)>> {
        let Some(stream) = self.inner.as_mut() else {
            return Ok(None);
        };
        match py.detach(|| stream.next()) {
            None => Ok(None),
            Some(Err(err)) => {
                self.close(py);
                Err(to_py(err))
            }
            Some(Ok(chunk)) => {
                let (index, rows) = (chunk.index(), chunk.rows());
                let tensor = PyTensor {
                    inner: chunk.into_tensor(),
                };
                Ok(Some((index, rows.start, rows.end, tensor)))
            }
        }
    }

    /// Chunks in all.
    fn __len__(&self) -> usize {
        self.inner.as_ref().map_or(0, ChunkStream::chunks)
    }

    /// Milliseconds `next()` has waited for copies in all.
    #[getter]
    fn waited_ms(&self) -> f64 {
        self.inner
            .as_ref()
            .map_or(0.0, |s| s.waited().as_secs_f64() * 1e3)
    }

    /// What the stream has done so far: bytes handed out, staging peak, pieces.
    #[getter]
    fn report(&self) -> Option<PyReport> {
        self.inner.as_ref().map(|s| PyReport::from(&s.report()))
    }

    /// Stops early: waits for the copies in flight and gives the staging back.
    fn close(&mut self, py: Python<'_>) {
        if let Some(stream) = self.inner.take() {
            py.detach(move || drop(stream));
        }
    }
}

/// The statistics of GPU `device`'s allocator (`cuda:N`), ferry's own memory only: a dict of
/// `allocated_bytes`, `reserved_bytes`, `peak_allocated_bytes`, `allocations`, `cache_hits`,
/// `device_allocations` and `frees`.
#[pyfunction]
pub fn memory_stats<'py>(py: Python<'py>, device: &str) -> PyResult<Bound<'py, PyDict>> {
    let stats = cuda_device(device)?.memory_stats();
    let out = PyDict::new(py);
    out.set_item("allocated_bytes", stats.allocated_bytes)?;
    out.set_item("reserved_bytes", stats.reserved_bytes)?;
    out.set_item("peak_allocated_bytes", stats.peak_allocated_bytes)?;
    out.set_item("allocations", stats.allocations)?;
    out.set_item("cache_hits", stats.cache_hits)?;
    out.set_item("device_allocations", stats.device_allocations)?;
    out.set_item("frees", stats.frees)?;
    Ok(out)
}

/// Starts `peak_allocated_bytes` of GPU `device`'s allocator over from what is allocated now.
#[pyfunction]
pub fn reset_peak_memory_stats(device: &str) -> PyResult<()> {
    cuda_device(device)?.reset_peak();
    Ok(())
}

fn cuda_device(device: &str) -> PyResult<CudaDevice> {
    match parse_device(device)? {
        Device::Cuda(n) => CudaDevice::get(n).map_err(|e| to_py(e.into())),
        Device::Cpu => Err(PyValueError::new_err(
            "memory_stats is about a GPU's allocator: pass cuda:N (pinned_stats() covers the host)",
        )),
    }
}

/// An uninitialised host tensor of `shape` and `dtype` in page-locked memory from ferry's
/// pinned pool, within its budget: `None` when the budget has no room (the caller then keeps
/// its data where it is). Its block returns to the pool when the last holder lets go.
#[pyfunction]
pub fn empty_pinned(py: Python<'_>, shape: Vec<usize>, dtype: &str) -> PyResult<Option<PyTensor>> {
    let dtype = parse_dtype(dtype)?;
    let bytes = shape.iter().product::<usize>() * dtype.size();
    let block = py.detach(|| PinnedPool::global().and_then(|pool| pool.alloc(bytes)));
    let block = match block {
        Ok(block) => block,
        Err(MemoryError::PinnedBudgetExceeded { .. }) => return Ok(None),
        Err(err) => return Err(to_py(err.into())),
    };
    let storage = Storage::new(Buffer::Pinned(block), dtype, Device::Cpu);
    let tensor =
        Tensor::from_storage(Arc::new(storage), Layout::contiguous(&shape)).map_err(to_py)?;
    Ok(Some(PyTensor { inner: tensor }))
}
