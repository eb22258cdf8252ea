//! Optimizer offload for torch parameters: ferry's [`OffloadAdamW`] over torch's parameter
//! memory (DLPack, no copy), fed by the Python package's post-accumulate-grad hooks.
//!
//! The division of work: torch copies each gradient into the optimizer's pinned landing tensor
//! on ferry's gradient stream (a `torch.cuda.ExternalStream`, so torch's allocator keeps the
//! gradient's memory until the copy has read it, through `record_stream`), and says so here;
//! from then on ferry's threads step it on the CPU and upload the new weights on ferry's upload
//! stream, without the GIL. [`PyOffloadAdamW::step`] waits for those threads and makes torch's
//! current stream wait, on the device, for the uploads.

use ferry::Tensor;
use ferry::optim::{AdamHyper, OffloadAdamW, Optimizer};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::dlpack::{self, Misaligned};
use crate::errors::{guarded, to_py};
use crate::order::{self, TorchStream, torch_or_default};
use crate::tensor::PyTensor;

/// The engine behind `ferry.optim.OffloadAdamW` (see the module docs).
#[pyclass(name = "OffloadAdamW", module = "ferry._ferry")]
pub struct PyOffloadAdamW {
    inner: OffloadAdamW,
    ordinal: usize,
}

#[pymethods]
impl PyOffloadAdamW {
    /// AdamW over `params` (torch parameters on one GPU, as DLPack capsules or tensors, in
    /// order), its state on the host; `stream` is torch's current stream there, which the
    /// initial copy of the weights to the host is ordered after. `pinned_limit` bounds its
    /// pinned bytes (staging the buffers when a pair per parameter would pass it).
    #[new]
    #[pyo3(signature = (params, lr, betas, eps, weight_decay, delayed_update=false, hold_gradients=false, stream=None, pinned_limit=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        params: Vec<Bound<'_, PyAny>>,
        lr: f64,
        betas: (f64, f64),
        eps: f64,
        weight_decay: f64,
        delayed_update: bool,
        hold_gradients: bool,
        stream: Option<u64>,
        pinned_limit: Option<usize>,
    ) -> PyResult<Self> {
        guarded(|| {
            let mut tensors = Vec::with_capacity(params.len());
            for (i, p) in params.iter().enumerate() {
                let tensor = dlpack::import(py, p, Misaligned::Refuse)?.tensor;
                if !matches!(tensor.device(), ferry::memory::Device::Cuda(_)) {
                    return Err(PyValueError::new_err(format!(
                        "OffloadAdamW: parameter {i} is on {}; optimizer offload keeps the state \
                         of GPU parameters on the host: move the model to the GPU first \
                         (`model.cuda()`), or use torch.optim.AdamW for a model on the CPU",
                        tensor.device()
                    )));
                }
                tensors.push(tensor);
            }
            let Some(ferry::memory::Device::Cuda(ordinal)) = tensors.first().map(Tensor::device)
            else {
                return Err(PyValueError::new_err(
                    "OffloadAdamW: no parameters to optimize",
                ));
            };
            let torch = TorchStream::new(ordinal, stream)?;
            let inner = py
                .detach(|| {
                    // The weights' producers (torch's initialization) come first.
                    order::before(torch.as_ref())?;
                    let inner = match pinned_limit {
                        Some(limit) => OffloadAdamW::fed_within(tensors, lr, limit)?,
                        None => OffloadAdamW::fed(tensors, lr)?,
                    };
                    Ok::<_, ferry::TensorError>(
                        inner
                            .betas(betas.0, betas.1)
                            .eps(eps)
                            .weight_decay(weight_decay)
                            .hold_gradients(hold_gradients),
                    )
                })
                .map_err(to_py)?;
            if let (true, Some(staging)) = (delayed_update, inner.staging()) {
                return Err(PyValueError::new_err(format!(
                    "OffloadAdamW: delayed_update=True refused: {}",
                    staging.delayed_refusal()
                )));
            }
            Ok(Self {
                inner: inner.delayed_update(delayed_update),
                ordinal,
            })
        })
    }

    /// Parameter `i`'s landing tensor (pinned, its shape and dtype), for torch to copy its
    /// gradient into on the gradient stream.
    fn landing(&self, i: usize) -> PyResult<PyTensor> {
        guarded(|| {
            let tensor = self
                .inner
                .landing(i)
                .ok_or_else(|| PyValueError::new_err(format!("OffloadAdamW: no parameter {i}")))?;
            // Its only device use is the gradient copy, which the optimizer waits for.
            Ok(PyTensor {
                inner: tensor,
                ordered_by_caller: true,
            })
        })
    }

    /// Blocks (without the GIL) until parameter `i`'s landing tensor may be written: the step
    /// thread has read the last gradient handed over for it (staged: and a landing buffer is
    /// taken for it, which `landing(i)` then gives).
    fn wait_landing(&self, py: Python<'_>, i: usize) -> PyResult<()> {
        guarded(|| {
            let inner = &self.inner;
            py.detach(|| inner.wait_landing(i)).map_err(to_py)?;
            Ok(())
        })
    }

    /// When the pinned buffers are staged, the sentence that says so (see
    /// `OffloadAdamW::staging` in Rust); else `None`.
    fn staging(&self) -> Option<String> {
        self.inner.staging().map(|s| s.to_string())
    }

    /// The handle of the gradient stream (for `torch.cuda.ExternalStream`).
    fn gradient_stream(&self) -> u64 {
        self.inner.gradient_stream().handle()
    }

    /// The handle of the upload stream.
    fn upload_stream(&self) -> u64 {
        self.inner.upload_stream().handle()
    }

    /// The GPU the parameters are on.
    #[getter]
    fn device(&self) -> usize {
        self.ordinal
    }

    /// Parameter `i`'s gradient copy into its landing tensor is queued on the gradient stream;
    /// it is stepped with these hyperparameters once it lands.
    fn gradient_queued(
        &self,
        i: usize,
        lr: f64,
        betas: (f64, f64),
        eps: f64,
        weight_decay: f64,
    ) -> PyResult<()> {
        guarded(|| {
            let adam = AdamHyper {
                lr,
                betas,
                eps,
                weight_decay,
            };
            self.inner.gradient_queued(i, adam).map_err(to_py)
        })
    }

    /// Clips the gradients held for this step to a global norm of `max_norm`; their norm
    /// before. An error without held gradients.
    fn clip_grad_norm(&self, py: Python<'_>, max_norm: f64) -> PyResult<f64> {
        guarded(|| {
            let inner = &self.inner;
            py.detach(|| inner.clip_grad_norm(max_norm)).map_err(to_py)
        })
    }

    /// Multiplies the gradients held for this step by `factor`; whether any holds an infinity
    /// or a NaN. An error without held gradients.
    fn scale_grads(&self, py: Python<'_>, factor: f64) -> PyResult<bool> {
        guarded(|| {
            let inner = &self.inner;
            py.detach(|| inner.scale_grads(factor)).map_err(to_py)
        })
    }

    /// Drops the gradients held since the last step (nothing without held gradients).
    fn zero_grad(&self, py: Python<'_>) -> PyResult<()> {
        guarded(|| {
            let inner = &self.inner;
            py.detach(|| inner.zero_grad());
            Ok(())
        })
    }

    /// Waits for the steps of every gradient handed over, then makes torch's stream `stream`
    /// (its current stream) wait on the device for the uploads; counts the step.
    #[pyo3(signature = (stream=None))]
    fn step(&mut self, py: Python<'_>, stream: Option<u64>) -> PyResult<()> {
        guarded(|| {
            let torch = torch_or_default(self.ordinal, stream)?;
            let inner = &mut self.inner;
            py.detach(|| {
                inner.step()?;
                let uploaded = inner.upload_stream().record()?;
                torch.wait_event(&uploaded)?;
                Ok::<_, ferry::TensorError>(())
            })
            .map_err(to_py)
        })
    }

    /// Waits for every CPU step and uploads the weights the delayed update holds back, after
    /// the work queued on torch's stream `stream` so far; that stream then waits for them.
    #[pyo3(signature = (stream=None))]
    fn flush(&mut self, py: Python<'_>, stream: Option<u64>) -> PyResult<()> {
        guarded(|| {
            let torch = torch_or_default(self.ordinal, stream)?;
            let inner = &mut self.inner;
            py.detach(|| {
                let after = torch.record()?;
                inner.flush(Some(&after))?;
                torch.wait_event(&inner.upload_stream().record()?)?;
                Ok::<_, ferry::TensorError>(())
            })
            .map_err(to_py)
        })
    }

    /// Steps taken.
    fn steps(&self) -> u64 {
        self.inner.steps()
    }

    /// The state as `(name, host tensor)` pairs: `step`, `lr`, and per parameter `{i}.master`
    /// and, once stepped, `{i}.exp_avg` and `{i}.exp_avg_sq` (copies).
    fn state(&self, py: Python<'_>) -> PyResult<Vec<(String, PyTensor)>> {
        guarded(|| {
            let state = py.detach(|| self.inner.state_dict());
            Ok(state
                .into_iter()
                .map(|(name, t)| (name, PyTensor::new(t)))
                .collect())
        })
    }

    /// Replaces the state with `(name, host tensor)` pairs named as [`Self::state`] names them.
    fn load_state(
        &mut self,
        py: Python<'_>,
        state: Vec<(String, Bound<'_, PyAny>)>,
    ) -> PyResult<()> {
        guarded(|| {
            let mut tensors = Vec::with_capacity(state.len());
            for (name, t) in &state {
                tensors.push((
                    name.clone(),
                    dlpack::import(py, t, Misaligned::Copy)?.tensor,
                ));
            }
            let inner = &mut self.inner;
            py.detach(|| inner.load_state_dict(&tensors))
                .map_err(|e| PyValueError::new_err(format!("OffloadAdamW.load_state_dict: {e}")))
        })
    }

    /// Pinned bytes held (landing and upload buffers).
    fn pinned_bytes(&self) -> usize {
        self.inner.pinned_bytes()
    }

    /// Host bytes of the optimizer state (master weights and both moments).
    fn state_bytes(&self) -> usize {
        self.inner.state_bytes()
    }
}
