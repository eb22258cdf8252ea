//! The Python-side handles: `ferry.Tensor` (a ferry tensor torch can take through DLPack), a
//! pending move, and a transfer report.

use ferry::memory::{DType, Device};
use ferry::tensor::Buffer;
use ferry::{PendingTensor, Tensor, TransferPath, TransferReport};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::dlpack;
use crate::errors::{guarded, to_py};
use crate::order::torch_or_default;

/// torch's name of a ferry dtype (`float32`, `bfloat16`, ...).
pub fn torch_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float32",
        DType::F64 => "float64",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::I64 => "int64",
        DType::U8 => "uint8",
    }
}

/// A dtype from torch's or ferry's name (`float32`, `torch.float32`, `f32`, ...); anything else
/// is a `TypeError`, as torch's `t.to(dtype=...)` raises.
pub fn parse_dtype(name: &str) -> PyResult<DType> {
    let name = name.strip_prefix("torch.").unwrap_or(name);
    let dtype = match name {
        "float32" | "float" => DType::F32,
        "float64" | "double" => DType::F64,
        "float16" | "half" => DType::F16,
        "bfloat16" => DType::BF16,
        "int64" | "long" => DType::I64,
        "uint8" => DType::U8,
        other => other.parse().map_err(|_| {
            PyTypeError::new_err(format!(
                "unknown dtype `{other}`: use float32, float64, float16, bfloat16, int64 or uint8"
            ))
        })?,
    };
    Ok(dtype)
}

/// A device from `cpu`, `cuda` or `cuda:N`.
pub fn parse_device(name: &str) -> PyResult<Device> {
    name.parse()
        .map_err(|e: ferry::memory::MemoryError| PyValueError::new_err(e.to_string()))
}

/// A ferry tensor. Hand it to `torch.from_dlpack` (which `ferry.to_torch` does) to get a
/// torch tensor over the same memory.
#[pyclass(name = "Tensor", module = "ferry", frozen)]
pub struct PyTensor {
    pub inner: Tensor,
    /// Whoever asked for it orders every device use of its memory itself (the offload scope's
    /// pinned blocks): torch freeing it need not wait for torch's current stream.
    pub ordered_by_caller: bool,
}

impl PyTensor {
    pub fn new(inner: Tensor) -> Self {
        Self {
            inner,
            ordered_by_caller: false,
        }
    }
}

#[pymethods]
impl PyTensor {
    /// The shape, as a tuple.
    #[getter]
    fn shape(&self) -> Vec<usize> {
        self.inner.shape().to_vec()
    }

    /// torch's name of the dtype.
    #[getter]
    fn dtype(&self) -> &'static str {
        torch_name(self.inner.dtype())
    }

    /// `cpu` or `cuda:N`.
    #[getter]
    fn device(&self) -> String {
        self.inner.device().to_string()
    }

    /// Whether the bytes live in page-locked memory (a GPU-to-host move's landing place).
    #[getter]
    fn is_pinned(&self) -> bool {
        matches!(&*self.inner.storage().read(), Buffer::Pinned(_))
    }

    /// DLPack export; waits for a copy still landing in the tensor.
    #[pyo3(signature = (stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<isize>,
        max_version: Option<Bound<'_, PyAny>>,
        dl_device: Option<Bound<'_, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let _ = (max_version, dl_device);
        guarded(|| {
            if copy == Some(true) {
                return Err(PyValueError::new_err(
                    "ferry exports without copying; call .clone() on the torch tensor instead",
                ));
            }
            dlpack::export(py, &self.inner, stream, self.ordered_by_caller)
        })
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        dlpack::device_of(&self.inner)
    }

    fn __repr__(&self) -> String {
        format!(
            "ferry.Tensor(shape={:?}, dtype={}, device={})",
            self.inner.shape(),
            torch_name(self.inner.dtype()),
            self.inner.device()
        )
    }
}

/// A non-blocking move still in flight: `wait()` hands the tensor out once its copy is done,
/// so it cannot be read early.
#[pyclass(name = "Pending", module = "ferry")]
pub struct PyPending {
    /// `None` once `wait()` has handed the tensor out.
    in_flight: Option<InFlight>,
}

/// The two kinds of move in flight.
enum InFlight {
    /// A `non_blocking` move on the default stream: its result's pinned buffer carries the
    /// copy's event; the imported source is released after the copy.
    Landing {
        tensor: Tensor,
        source: Tensor,
        report: PyReport,
    },
    /// A move queued on a copy stream ([`ferry::DeviceMove::to_async`]) (boxed: it is large),
    /// and the bytes its misaligned source was realigned by.
    Queued(Box<PendingTensor>, usize),
}

impl PyPending {
    pub fn landing(tensor: Tensor, source: Tensor, report: PyReport) -> Self {
        Self {
            in_flight: Some(InFlight::Landing {
                tensor,
                source,
                report,
            }),
        }
    }

    pub fn queued(pending: PendingTensor, realigned_bytes: usize) -> Self {
        Self {
            in_flight: Some(InFlight::Queued(Box::new(pending), realigned_bytes)),
        }
    }
}

#[pymethods]
impl PyPending {
    /// Whether the copy has finished (never blocks).
    fn ready(&self) -> PyResult<bool> {
        guarded(|| {
            let ready = match &self.in_flight {
                Some(InFlight::Landing { tensor, .. }) => match &*tensor.storage().read() {
                    Buffer::Pinned(b) => b.is_ready(),
                    _ => true,
                },
                Some(InFlight::Queued(pending, _)) => pending.is_ready(),
                None => true,
            };
            Ok(ready)
        })
    }

    /// Makes `stream` (a handle of GPU `ordinal`: torch's current stream) wait on the device for
    /// the copy, so that work queued there afterwards (a write of the source, a read of the
    /// result) runs after it has landed. Never blocks the host. A move already waited for, or
    /// one on the default stream (ordered with torch's stream when it was queued), needs nothing.
    fn order_stream(&self, ordinal: usize, stream: u64) -> PyResult<()> {
        guarded(|| {
            let Some(InFlight::Queued(pending, _)) = &self.in_flight else {
                return Ok(());
            };
            let torch = torch_or_default(ordinal, Some(stream))?;
            pending.order_stream(&torch).map_err(to_py)
        })
    }

    /// Blocks until the copy has finished and returns `(tensor, report)`; a second call is an
    /// error.
    fn wait(&mut self, py: Python<'_>) -> PyResult<(PyTensor, PyReport)> {
        guarded(|| {
            let in_flight = self.in_flight.take().ok_or_else(|| {
                PyValueError::new_err("wait() was already called on this pending move")
            })?;
            let (tensor, report) = py
                .detach(move || match in_flight {
                    InFlight::Landing {
                        tensor,
                        source,
                        report,
                    } => {
                        let waited = match &*tensor.storage().read() {
                            Buffer::Pinned(b) => b.wait(),
                            _ => Ok(()),
                        };
                        drop(source);
                        waited.map_err(ferry::TensorError::from)?;
                        Ok((tensor, report))
                    }
                    InFlight::Queued(pending, realigned_bytes) => {
                        let (tensor, report) = (*pending).wait()?;
                        let mut report = PyReport::from(&report);
                        report.realigned_bytes = realigned_bytes;
                        Ok((tensor, report))
                    }
                })
                .map_err(to_py)?;
            Ok((PyTensor::new(tensor), report))
        })
    }
}

/// What a move did: bytes, route, staging, graph nodes, time.
#[pyclass(name = "TransferReport", module = "ferry", frozen, get_all)]
#[derive(Clone)]
pub struct PyReport {
    /// Bytes that crossed the device boundary.
    pub bytes_moved: usize,
    /// The route (`same_device`, `host_to_device`, `device_to_pinned`, `device_to_pageable`,
    /// `chunked`, `peer`, ...).
    pub path: String,
    /// Pieces of a chunked or peer move, tensors of a batched one (1 otherwise).
    pub chunks: usize,
    /// Largest staging memory in use at once.
    pub staging_peak_bytes: usize,
    /// Graph nodes the move recorded.
    pub nodes_recorded: usize,
    /// Graph nodes pruned because the move let go of the source.
    pub nodes_pruned: usize,
    /// Bytes of gradient buffers copied (always 0).
    pub grad_bytes_copied: usize,
    /// Wall time of the move in milliseconds (until enqueued, for a non-blocking move).
    pub elapsed_ms: f64,
    /// Bytes of a misaligned source (foreign memory at an odd offset) that were copied into
    /// aligned memory before the move; 0 normally.
    pub realigned_bytes: usize,
}

impl From<&TransferReport> for PyReport {
    fn from(r: &TransferReport) -> Self {
        let (path, chunks) = match r.path {
            TransferPath::SameDevice => ("same_device", 1),
            TransferPath::HostToDevice => ("host_to_device", 1),
            TransferPath::DeviceToPinned => ("device_to_pinned", 1),
            TransferPath::DeviceToPageable => ("device_to_pageable", 1),
            TransferPath::DeviceToDevice => ("device_to_device", 1),
            TransferPath::Peer { chunks, .. } => ("peer", chunks),
            TransferPath::Chunked { chunks } => ("chunked", chunks),
            TransferPath::Batched { tensors } => ("batched", tensors),
            _ => ("other", 1),
        };
        Self {
            bytes_moved: r.bytes_moved,
            path: path.to_string(),
            chunks,
            staging_peak_bytes: r.staging_peak_bytes,
            nodes_recorded: r.nodes_recorded,
            nodes_pruned: r.nodes_pruned,
            grad_bytes_copied: r.grad_bytes_copied,
            elapsed_ms: r.elapsed.as_secs_f64() * 1e3,
            realigned_bytes: 0,
        }
    }
}

#[pymethods]
impl PyReport {
    fn __repr__(&self) -> String {
        format!(
            "TransferReport(path={}, bytes_moved={}, chunks={}, staging_peak_bytes={}, \
             nodes_recorded={}, realigned_bytes={}, elapsed_ms={:.3})",
            self.path,
            self.bytes_moved,
            self.chunks,
            self.staging_peak_bytes,
            self.nodes_recorded,
            self.realigned_bytes,
            self.elapsed_ms
        )
    }
}
