//! Memory from Python: the pinned pool's budget and statistics, ferry's GPU allocators'
//! statistics and caches, and page-locked host tensors from the pinned pool.

use std::sync::Arc;

use ferry::memory::cuda::{CudaDevice, PinnedPool};
use ferry::memory::{Device, MemoryError};
use ferry::tensor::{Buffer, Storage};
use ferry::{DType, Layout, Tensor};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{guarded, to_py};
use crate::tensor::{PyTensor, parse_device, parse_dtype};

/// Page-locked memory ferry may hold at once, in bytes (staging and move results together).
#[pyfunction]
pub fn pinned_budget() -> PyResult<usize> {
    guarded(|| Ok(PinnedPool::global().map_err(|e| to_py(e.into()))?.budget()))
}

/// Sets the pinned-memory budget; moves beyond it go through bounded staging into pageable
/// memory instead of failing.
#[pyfunction]
pub fn set_pinned_budget(bytes: usize) -> PyResult<()> {
    guarded(|| {
        PinnedPool::global()
            .and_then(|p| p.set_budget(bytes))
            .map_err(|e| to_py(e.into()))
    })
}

/// The pinned pool's statistics: allocated, reserved, cached and peak bytes, the budget,
/// allocation counts, and the bytes pinned in place.
#[pyfunction]
pub fn pinned_stats(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    guarded(|| {
        let s = PinnedPool::global().map_err(|e| to_py(e.into()))?.stats();
        let out = PyDict::new(py);
        out.set_item("allocated_bytes", s.allocated_bytes)?;
        out.set_item("reserved_bytes", s.reserved_bytes)?;
        out.set_item("cached_bytes", s.cached_bytes)?;
        out.set_item("peak_allocated_bytes", s.peak_allocated_bytes)?;
        out.set_item("budget_bytes", s.budget_bytes)?;
        out.set_item("allocations", s.allocations)?;
        out.set_item("cache_hits", s.cache_hits)?;
        out.set_item("registered_bytes", s.registered_bytes)?;
        Ok(out)
    })
}

/// Whether a CUDA driver and at least one GPU are there.
#[pyfunction]
pub fn cuda_available() -> PyResult<bool> {
    guarded(|| {
        Ok(ferry::memory::cuda::driver_present()
            && ferry::memory::cuda::devices().is_ok_and(|d| !d.is_empty()))
    })
}

/// Frees the cached blocks of `device`'s allocator (`cuda:N`) or of the pinned pool (`cpu`).
#[pyfunction]
pub fn empty_cache(device: &str) -> PyResult<()> {
    guarded(|| {
        match parse_device(device)? {
            Device::Cpu => PinnedPool::global().and_then(|p| p.empty_cache()),
            Device::Cuda(n) => {
                ferry::memory::cuda::CudaDevice::get(n).and_then(|d| d.empty_cache())
            }
        }
        .map_err(|e| to_py(e.into()))
    })
}

/// The statistics of GPU `device`'s allocator (`cuda:N`), ferry's own memory only: a dict of
/// `allocated_bytes`, `reserved_bytes`, `peak_allocated_bytes`, `allocations`, `cache_hits`,
/// `device_allocations` and `frees`.
#[pyfunction]
pub fn memory_stats<'py>(py: Python<'py>, device: &str) -> PyResult<Bound<'py, PyDict>> {
    guarded(|| {
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
    })
}

/// Starts `peak_allocated_bytes` of GPU `device`'s allocator over from what is allocated now.
#[pyfunction]
pub fn reset_peak_memory_stats(device: &str) -> PyResult<()> {
    guarded(|| {
        cuda_device(device)?.reset_peak();
        Ok(())
    })
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
/// its data where it is). Its block returns to the pool when the last holder lets go, after
/// the work torch queued on its current stream by then, unless `ordered_by_caller` (the caller
/// frees it only once its own copies are done).
#[pyfunction]
#[pyo3(signature = (shape, dtype, ordered_by_caller=false))]
pub fn empty_pinned(
    py: Python<'_>,
    shape: Vec<usize>,
    dtype: &str,
    ordered_by_caller: bool,
) -> PyResult<Option<PyTensor>> {
    guarded(|| {
        let dtype = parse_dtype(dtype)?;
        let bytes = ferry::memory::size::shape_bytes(&shape, dtype).ok_or_else(|| {
            PyValueError::new_err(format!(
                "empty_pinned: a {dtype} tensor of shape {shape:?} is too large to allocate"
            ))
        })?;
        let tensor = py
            .detach(|| pinned_tensor(&shape, dtype, bytes))
            .map_err(to_py)?;
        Ok(tensor.map(|inner| PyTensor {
            inner,
            ordered_by_caller,
        }))
    })
}

/// An uninitialised host tensor of `shape` and `dtype` (`bytes` in all) over a block of ferry's
/// pinned pool; `None` when the pinned budget has no room.
pub(crate) fn pinned_tensor(
    shape: &[usize],
    dtype: DType,
    bytes: usize,
) -> ferry::Result<Option<Tensor>> {
    let block = match PinnedPool::global().and_then(|pool| pool.alloc(bytes)) {
        Ok(block) => block,
        Err(MemoryError::PinnedBudgetExceeded { .. }) => return Ok(None),
        Err(err) => return Err(err.into()),
    };
    let storage = Storage::new(Buffer::Pinned(block), dtype, Device::Cpu);
    Ok(Some(Tensor::from_storage(
        Arc::new(storage),
        Layout::contiguous(shape),
    )?))
}
