//! Asynchronous checkpoints of torch tensors: `ferry.save_async` over ferry's
//! [`save_async`](ferry::checkpoint::save_async), the tensors received through DLPack (no
//! copy), the snapshot ordered after torch's current streams. torch's own writes do not go
//! through ferry's storage locks: the Python package orders them (a barrier in every
//! optimizer's step, and a version check before the file is kept).

use std::collections::BTreeMap;
use std::path::PathBuf;

use ferry::checkpoint::{
    AsyncSaveOptions, AsyncSaveReport, Checkpoint, DEFAULT_STAGING_BYTES, DeviceCopy, LoadOptions,
    PendingSave, SnapshotMemory, SnapshotWaiter,
};
use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::dlpack::{self, Misaligned};
use crate::errors::{FerryError, guarded, to_py};
use crate::order::{TorchStream, torch_or_default};
use crate::tensor::{PyTensor, parse_device};

/// A save in flight (see `ferry.save_async`).
#[pyclass(name = "PendingSave", module = "ferry._ferry")]
pub struct PyPendingSave {
    inner: Mutex<Option<PendingSave>>,
    /// Waits for the snapshot without `inner`'s lock: a thread waiting (without the GIL) must
    /// not hold a lock that another thread, holding the GIL, then blocks on (an optimizer
    /// step's barrier asks `snapshot_taken` while a saving thread waits).
    snapshot: SnapshotWaiter,
    path: String,
}

fn gone() -> PyErr {
    PyValueError::new_err("this save was already waited for: wait() returns its report once")
}

fn report_dict<'py>(py: Python<'py>, r: &AsyncSaveReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("tensors", r.tensors)?;
    d.set_item("bytes", r.bytes)?;
    d.set_item("device_bytes", r.device_bytes)?;
    d.set_item("call_s", r.call.as_secs_f64())?;
    d.set_item("waited_for_previous_s", r.waited_for_previous.as_secs_f64())?;
    d.set_item("snapshot_s", r.snapshot.as_secs_f64())?;
    d.set_item("elapsed_s", r.elapsed.as_secs_f64())?;
    d.set_item("peak_extra_host_bytes", r.peak_extra_host_bytes)?;
    d.set_item("peak_pinned_bytes", r.peak_pinned_bytes)?;
    d.set_item(
        "memory",
        match r.memory {
            SnapshotMemory::Auto => "auto".to_string(),
            SnapshotMemory::Pageable => "pageable".to_string(),
            SnapshotMemory::Pinned => "pinned".to_string(),
            SnapshotMemory::Bounded(bytes) => bytes.to_string(),
        },
    )?;
    d.set_item("device_copied", r.device_copied)?;
    Ok(d)
}

#[pymethods]
impl PyPendingSave {
    /// The file being written.
    #[getter]
    fn path(&self) -> &str {
        &self.path
    }

    /// Whether every tensor has been copied.
    fn snapshot_taken(&self) -> PyResult<bool> {
        guarded(|| {
            let guard = self.inner.lock();
            Ok(guard.as_ref().ok_or_else(gone)?.is_snapshot_taken())
        })
    }

    /// Whether the call copied every GPU tensor on its GPU (`device_copy`): torch's writes to
    /// them then need not wait for the snapshot.
    fn device_copied_all(&self) -> PyResult<bool> {
        guarded(|| {
            let guard = self.inner.lock();
            Ok(guard.as_ref().ok_or_else(gone)?.device_copied_all())
        })
    }

    /// The names of the tensors the call copied on their GPU's copy stream, beside the work
    /// torch queues after it: torch's writes to them must come after
    /// `order_writes_after(streams)`.
    fn side_copied(&self) -> PyResult<Vec<String>> {
        guarded(|| {
            let guard = self.inner.lock();
            Ok(guard.as_ref().ok_or_else(gone)?.side_copied().to_vec())
        })
    }

    /// Makes torch's streams, as (device index, `cuda_stream` handle) pairs, wait on the GPU for
    /// the copies of `side_copied()`: what torch queues there afterwards may write those
    /// tensors. Never blocks.
    fn order_writes_after(&self, streams: Vec<(usize, u64)>) -> PyResult<()> {
        guarded(|| {
            let streams = streams
                .iter()
                .map(|&(ordinal, handle)| torch_or_default(ordinal, Some(handle)))
                .collect::<PyResult<Vec<_>>>()?;
            let guard = self.inner.lock();
            guard
                .as_ref()
                .ok_or_else(gone)?
                .order_writes_after(&streams)
                .map_err(|e| FerryError::new_err(e.to_string()))
        })
    }

    /// Whether the save has finished, well or not.
    fn done(&self) -> PyResult<bool> {
        guarded(|| {
            let guard = self.inner.lock();
            Ok(guard.as_ref().is_none_or(PendingSave::is_finished))
        })
    }

    /// Blocks (without the GIL) until every tensor has been copied.
    fn wait_snapshot(&self, py: Python<'_>) -> PyResult<()> {
        guarded(|| {
            if self.inner.lock().is_none() {
                return Err(gone());
            }
            let snapshot = self.snapshot.clone();
            py.detach(|| snapshot.wait());
            Ok(())
        })
    }

    /// Lets the file be renamed over the target once written (the package calls it after
    /// checking torch's version counters).
    fn confirm(&self) -> PyResult<()> {
        guarded(|| {
            let guard = self.inner.lock();
            guard.as_ref().ok_or_else(gone)?.confirm();
            Ok(())
        })
    }

    /// Keeps the target as it was: the file is removed once written, and wait() raises with
    /// `reason`.
    fn abandon(&self, reason: String) -> PyResult<()> {
        guarded(|| {
            let guard = self.inner.lock();
            guard.as_ref().ok_or_else(gone)?.abandon(reason);
            Ok(())
        })
    }

    /// Waits (without the GIL) for the file to be synced and renamed; its report as a dict.
    fn wait<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guarded(|| {
            let pending = self.inner.lock().take().ok_or_else(gone)?;
            let report = py
                .detach(|| pending.wait())
                .map_err(|e| FerryError::new_err(e.to_string()))?;
            report_dict(py, &report)
        })
    }
}

impl Drop for PyPendingSave {
    fn drop(&mut self) {
        // Waiting for the file here would hold the GIL for as long as the disk takes: a thread
        // waits instead, and an error reaches the next save (ferry's rule for dropped saves).
        if let Some(pending) = self.inner.lock().take() {
            let _ = std::thread::Builder::new()
                .name("ferry-save-drop".into())
                .spawn(move || drop(pending));
        }
    }
}

/// Starts writing `tensors` (torch tensors or DLPack capsules, named by `names`) to `path`;
/// the copies come after the work queued so far on each `(gpu, stream handle)` of `streams`
/// (torch's current streams) and on ferry's default streams. `memory` is `"auto"`,
/// `"pageable"`, `"pinned"` or `"bounded"` (with `bound` bytes). `device_copy`: copy the GPU
/// tensors on their GPU first where it has room (`None`), wherever memory can be had (`True`),
/// or never.
#[pyfunction]
#[pyo3(signature = (path, names, tensors, streams, memory="auto", bound=None, staging_bytes=DEFAULT_STAGING_BYTES, metadata=None, device_copy=None))]
#[allow(clippy::too_many_arguments)]
pub fn save_async(
    py: Python<'_>,
    path: PathBuf,
    names: Vec<String>,
    tensors: Vec<Bound<'_, PyAny>>,
    streams: Vec<(usize, u64)>,
    memory: &str,
    bound: Option<usize>,
    staging_bytes: usize,
    metadata: Option<BTreeMap<String, String>>,
    device_copy: Option<bool>,
) -> PyResult<PyPendingSave> {
    guarded(|| {
        if names.len() != tensors.len() {
            return Err(PyValueError::new_err(format!(
                "save_async: {} names for {} tensors",
                names.len(),
                tensors.len()
            )));
        }
        let memory = match (memory, bound) {
            ("auto", None) => SnapshotMemory::Auto,
            ("pageable", None) => SnapshotMemory::Pageable,
            ("pinned", None) => SnapshotMemory::Pinned,
            ("bounded", Some(bytes)) if bytes > 0 => SnapshotMemory::Bounded(bytes),
            _ => {
                return Err(PyValueError::new_err(format!(
                    "save_async: memory={memory:?} (bound {bound:?}) is not one of \"auto\", \
                     \"pageable\", \"pinned\", or a positive number of bytes for the bounded mode"
                )));
            }
        };
        let mut state = Vec::with_capacity(tensors.len());
        for (name, t) in names.into_iter().zip(&tensors) {
            // A misaligned host tensor is copied at the call: the copy is its snapshot.
            state.push((name, dlpack::import(py, t, Misaligned::Copy)?.tensor));
        }
        let mut ck = Checkpoint::from_tensors(state);
        for (key, value) in metadata.unwrap_or_default() {
            ck.set_metadata(key, value);
        }
        let after = streams
            .iter()
            .map(|&(ordinal, handle)| torch_or_default(ordinal, Some(handle)))
            .collect::<PyResult<Vec<_>>>()?;
        let options = AsyncSaveOptions {
            staging_bytes,
            memory,
            after,
            // Renamed only once the package has checked torch's versions (`confirm`).
            confirm: true,
            // Copied on ferry's default streams after torch's current streams' work...
            device_copy: match device_copy {
                None => DeviceCopy::IfRoom,
                Some(true) => DeviceCopy::Always,
                Some(false) => DeviceCopy::Off,
            },
        };
        let shown = path.display().to_string();
        let pending = py
            .detach(|| ck.save_async(&path, options))
            .map_err(|e| FerryError::new_err(e.to_string()))?;
        let save = PyPendingSave {
            snapshot: pending.snapshot_waiter(),
            inner: Mutex::new(Some(pending)),
            path: shown,
        };
        if device_copy != Some(false) {
            // ...and torch's current streams wait for the copies on the device, so nothing
            // torch queues after the call can write a tensor before its copy has read it.
            let ordered =
                streams.iter().try_for_each(|&(ordinal, handle)| {
                    match TorchStream::new(ordinal, Some(handle))? {
                        Some(torch) => torch.after().map_err(to_py),
                        None => Ok(()),
                    }
                });
            if let Err(e) = ordered {
                // Unconfirmed, the save would wait for the package's check forever.
                save.abandon(format!(
                    "torch's streams could not wait for the device copies: {e}"
                ))?;
                return Err(e);
            }
        }
        Ok(save)
    })
}

/// Takes the device memory the device copies of a `save_async` of `tensors` (torch tensors or
/// DLPack capsules) use into ferry's allocator cache now, so the first save's call allocates
/// nothing: `device_copy` as `save_async` takes it. Returns the bytes held ready.
#[pyfunction]
#[pyo3(signature = (tensors, device_copy=None))]
pub fn reserve_device_copy(
    py: Python<'_>,
    tensors: Vec<Bound<'_, PyAny>>,
    device_copy: Option<bool>,
) -> PyResult<usize> {
    guarded(|| {
        let mut state = Vec::with_capacity(tensors.len());
        for t in &tensors {
            // Only shapes, dtypes and devices are read: a misaligned host tensor needs no copy.
            let t = dlpack::import(py, t, Misaligned::Copy)?.tensor;
            state.push((String::new(), t));
        }
        let policy = match device_copy {
            None => DeviceCopy::IfRoom,
            Some(true) => DeviceCopy::Always,
            Some(false) => DeviceCopy::Off,
        };
        py.detach(|| ferry::checkpoint::reserve_device_copy(&state, policy))
            .map_err(to_py)
    })
}

/// The tensors of the safetensors file at `path`, in file order, on `device` (`"cpu"` or
/// `"cuda:N"`), and its metadata less ferry's checksum record: ferry's reader, which checks
/// the header against the file's length before allocating anything and every tensor's CRC32
/// (where the file has ferry's record) before returning any; onto a GPU the file streams
/// through at most `staging_bytes` of pinned staging. The file's dtypes must be ferry's.
#[pyfunction]
#[pyo3(signature = (path, device, staging_bytes=DEFAULT_STAGING_BYTES))]
#[allow(clippy::type_complexity)]
pub fn load_checkpoint(
    py: Python<'_>,
    path: PathBuf,
    device: &str,
    staging_bytes: usize,
) -> PyResult<(Vec<(String, PyTensor)>, BTreeMap<String, String>)> {
    guarded(|| {
        let device = parse_device(device)?;
        let (ck, _) = py
            .detach(|| Checkpoint::load_to(&path, device, LoadOptions { staging_bytes }))
            .map_err(|e| FerryError::new_err(e.to_string()))?;
        let (tensors, metadata) = ck.into_parts();
        let tensors = tensors
            .into_iter()
            .map(|(name, t)| (name, PyTensor::new(t)))
            .collect();
        Ok((tensors, metadata))
    })
}
