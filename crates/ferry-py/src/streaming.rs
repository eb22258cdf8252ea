//! Streaming from Python: a tensor's host chunks as an iterator, the next ones in flight while
//! the caller works on one.

use ferry::memory::Device;
use ferry::{ChunkStream, DeviceMove};
use pyo3::prelude::*;

use crate::dlpack::{self, Misaligned};
use crate::errors::{guarded, to_py};
use crate::moves::chunk_spec;
use crate::order::{self, TorchStream};
use crate::tensor::{PyReport, PyTensor, parse_device};

/// The host chunks of `t` along axis 0, in order, through a ring of pinned staging (at most a
/// `chunks`-th of the tensor, or at most `max_staging_bytes`; a quarter when neither is given):
/// an iterator of
/// `(index, start_row, stop_row, tensor)`. Detached data.
///
/// The copies read the source after the work queued so far on torch's current stream `stream`
/// (of the source's GPU); they run on ferry's copy stream while later work computes, so the
/// source must not be written until the stream is done (the Python package checks).
#[pyfunction]
#[pyo3(signature = (t, chunks=None, max_staging_bytes=None, stream=None, source=None))]
pub fn stream_to(
    py: Python<'_>,
    t: &Bound<'_, PyAny>,
    chunks: Option<usize>,
    max_staging_bytes: Option<usize>,
    stream: Option<u64>,
    source: Option<&str>,
) -> PyResult<PyChunkStream> {
    guarded(|| {
        let spec = chunk_spec(chunks, max_staging_bytes)?;
        if let Some(Device::Cuda(gpu)) = source.map(parse_device).transpose()? {
            order::before(TorchStream::new(gpu, stream)?.as_ref()).map_err(to_py)?;
        }
        let source = dlpack::import(py, t, Misaligned::Copy)?.tensor;
        let stream = py
            .detach(move || source.stream_to(Device::Cpu, spec))
            .map_err(to_py)?;
        Ok(PyChunkStream {
            inner: Some(stream),
        })
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
        guarded(|| {
            let Some(stream) = self.inner.as_mut() else {
                return Ok(None);
            };
            match py.detach(|| stream.next()) {
                None => Ok(None),
                Some(Err(err)) => {
                    self.close(py)?;
                    Err(to_py(err))
                }
                Some(Ok(chunk)) => {
                    let (index, rows) = (chunk.index(), chunk.rows());
                    let tensor = PyTensor::new(chunk.into_tensor());
                    Ok(Some((index, rows.start, rows.end, tensor)))
                }
            }
        })
    }

    /// Chunks in all.
    fn __len__(&self) -> usize {
        self.inner.as_ref().map_or(0, ChunkStream::chunks)
    }

    /// Milliseconds `next()` has waited for copies in all.
    #[getter]
    fn waited_ms(&self) -> PyResult<f64> {
        guarded(|| {
            let waited = self.inner.as_ref().map(|s| s.waited());
            Ok(waited.map_or(0.0, |w| w.as_secs_f64() * 1e3))
        })
    }

    /// What the stream has done so far: bytes handed out, staging peak, pieces.
    #[getter]
    fn report(&self) -> PyResult<Option<PyReport>> {
        guarded(|| Ok(self.inner.as_ref().map(|s| PyReport::from(&s.report()))))
    }

    /// Stops early: waits for the copies in flight and gives the staging back.
    fn close(&mut self, py: Python<'_>) -> PyResult<()> {
        guarded(|| {
            if let Some(stream) = self.inner.take() {
                py.detach(move || drop(stream));
            }
            Ok(())
        })
    }
}
