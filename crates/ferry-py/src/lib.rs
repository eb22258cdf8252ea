//! ferry for PyTorch users: the Python module `ferry._ferry`, wrapped by the pure-Python
//! package `ferry` (python/ferry), which gives torch tensors ferry's moves.
//!
//! It owns the exchange with Python: DLPack both ways (`dlpack`), the Python handles of a ferry
//! tensor, a pending move and a transfer report (`tensor`), and the moves themselves (`moves`),
//! run with the GIL released. It does not own autograd across the boundary: that is a
//! `torch.autograd.Function` in the Python package, so torch's own graph records the move.
//!
//! Key decision: every tensor crosses by DLPack, never by copy. A torch tensor handed to ferry
//! is used in place and kept alive by ferry's buffer; a ferry result handed to torch keeps the
//! ferry tensor alive, so its pinned or device memory returns to ferry's pools when torch
//! frees it.

mod dlpack;
mod errors;
mod moves;
mod tensor;

use pyo3::prelude::*;

/// The extension module.
#[pymodule]
fn _ferry(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("FerryError", m.py().get_type::<errors::FerryError>())?;
    m.add_class::<tensor::PyTensor>()?;
    m.add_class::<tensor::PyPending>()?;
    m.add_class::<tensor::PyReport>()?;
    m.add_class::<moves::PyChunkStream>()?;
    m.add_function(wrap_pyfunction!(moves::from_dlpack, m)?)?;
    m.add_function(wrap_pyfunction!(moves::to, m)?)?;
    m.add_function(wrap_pyfunction!(moves::to_chunked, m)?)?;
    m.add_function(wrap_pyfunction!(moves::to_async, m)?)?;
    m.add_function(wrap_pyfunction!(moves::stream_to, m)?)?;
    m.add_function(wrap_pyfunction!(moves::move_state_dict, m)?)?;
    m.add_function(wrap_pyfunction!(moves::pinned_budget, m)?)?;
    m.add_function(wrap_pyfunction!(moves::set_pinned_budget, m)?)?;
    m.add_function(wrap_pyfunction!(moves::pinned_stats, m)?)?;
    m.add_function(wrap_pyfunction!(moves::cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(moves::empty_cache, m)?)?;
    m.add_function(wrap_pyfunction!(moves::memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(moves::empty_pinned, m)?)?;
    m.add_function(wrap_pyfunction!(moves::reset_peak_memory_stats, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
