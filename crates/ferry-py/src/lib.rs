//! ferry for PyTorch users: the Python module `ferry._ferry`, wrapped by the pure-Python
//! package `ferry` (python/ferry), which gives torch tensors ferry's moves.
//!
//! It owns the exchange with Python: DLPack both ways (`dlpack`), the Python handles of a ferry
//! tensor, a pending move and a transfer report (`tensor`), the moves themselves (`moves`) and
//! streaming (`streaming`), run with the GIL released, their order with torch's current stream
//! (`order`), optimizer offload for torch parameters (`optim`), the pools' budgets and
//! statistics (`memory`), and ferry's memory planner for `ferry.plan` (`plan`). Every entry
//! point runs in `errors::guarded`, so no Rust panic reaches Python as one. It does not own
//! autograd across the boundary: that is a `torch.autograd.Function` in the Python package, so
//! torch's own graph records the move.
//!
//! Key decision: every tensor crosses by DLPack, never by copy. A torch tensor handed to ferry
//! is used in place and kept alive by ferry's buffer; a ferry result handed to torch keeps the
//! ferry tensor alive, so its pinned or device memory returns to ferry's pools when torch
//! frees it.

mod checkpoint;
mod dlpack;
mod errors;
mod memory;
mod moves;
mod optim;
mod order;
mod plan;
mod state_dict;
mod streaming;
mod tensor;

use pyo3::prelude::*;

/// The extension module.
#[pymodule]
fn _ferry(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("FerryError", m.py().get_type::<errors::FerryError>())?;
    m.add_class::<tensor::PyTensor>()?;
    m.add_class::<tensor::PyPending>()?;
    m.add_class::<tensor::PyReport>()?;
    m.add_class::<streaming::PyChunkStream>()?;
    m.add_class::<optim::PyOffloadAdamW>()?;
    m.add_class::<checkpoint::PyPendingSave>()?;
    m.add_function(wrap_pyfunction!(checkpoint::save_async, m)?)?;
    m.add_function(wrap_pyfunction!(checkpoint::load_checkpoint, m)?)?;
    m.add_function(wrap_pyfunction!(checkpoint::reserve_device_copy, m)?)?;
    m.add_function(wrap_pyfunction!(moves::from_dlpack, m)?)?;
    m.add_function(wrap_pyfunction!(moves::to, m)?)?;
    m.add_function(wrap_pyfunction!(moves::to_chunked, m)?)?;
    m.add_function(wrap_pyfunction!(moves::to_async, m)?)?;
    m.add_function(wrap_pyfunction!(streaming::stream_to, m)?)?;
    m.add_function(wrap_pyfunction!(state_dict::move_state_dict, m)?)?;
    m.add_class::<state_dict::PyStateDictMove>()?;
    m.add_function(wrap_pyfunction!(moves::pin, m)?)?;
    m.add_function(wrap_pyfunction!(moves::record_stream, m)?)?;
    m.add_function(wrap_pyfunction!(order::set_current_streams, m)?)?;
    m.add_function(wrap_pyfunction!(memory::pinned_budget, m)?)?;
    m.add_function(wrap_pyfunction!(memory::set_pinned_budget, m)?)?;
    m.add_function(wrap_pyfunction!(memory::pinned_stats, m)?)?;
    m.add_function(wrap_pyfunction!(memory::cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(memory::empty_cache, m)?)?;
    m.add_function(wrap_pyfunction!(memory::memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(memory::empty_pinned, m)?)?;
    m.add_function(wrap_pyfunction!(memory::reset_peak_memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(plan::plan_memory, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
