//! `move_state_dict` from Python, tensor by tensor. [`PyStateDictMove::add`] imports each tensor
//! as the caller's loop over the dict reaches it, and one of 4 MiB or more bound for the host
//! starts crossing at once, so the link is busy while the rest of the dict is still being read;
//! [`PyStateDictMove::finish`] queues the rest as one batch (small tensors packed, one arena per
//! dtype), hands every result to torch while the last bytes cross, and waits once. Ordered with
//! torch's current stream on every GPU involved (crate::order), as the other moves are.
//!
//! The early copies run on the GPU's copy stream, not on ferry's default stream where the batch
//! packs its small tensors: a packing kernel queued behind milliseconds of copies would leave
//! the link idle while it ran (130 us of a 6.7 ms ViT-B/16 state dict on the H200).

use std::collections::HashMap;
use std::sync::OnceLock;
use std::sync::mpsc::{Sender, channel};

use ferry::memory::Device;
use ferry::memory::cuda::{CudaDevice, Event, Stream};
use ferry::tensor::Buffer;
use ferry::{DeviceMove, MoveOptions, Tensor, TensorError, TransferPath};
use parking_lot::Mutex;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::dlpack::{self, Misaligned};
use crate::errors::{guarded, to_py};
use crate::memory::pinned_tensor;
use crate::moves::{copy_stream, gpu_of, source_device};
use crate::order::{self, TorchStream};
use crate::tensor::{PyReport, PyTensor, parse_device};

/// Tensors of at least this many bytes move to the host on their own as soon as they are
/// imported (a copy's fixed cost is small beside theirs); smaller ones go in the batch.
const EARLY_FROM: usize = 4 << 20;

/// One state dict on its way to `device`: `add` each tensor, then `finish` once.
#[pyclass(name = "StateDictMove", module = "ferry")]
pub struct PyStateDictMove {
    device: Device,
    /// torch's stream on each GPU as the caller named them; `None`: asked from torch.
    given: Option<HashMap<usize, u64>>,
    /// Each GPU met so far.
    gpus: Vec<Gpu>,
    entries: Vec<Entry>,
    early_bytes: usize,
    realigned_bytes: usize,
    finished: bool,
}

/// A GPU the move reads from or writes to.
struct Gpu {
    ordinal: usize,
    /// torch's current stream there: its handle, and the borrowed stream when there is one to
    /// order with.
    handle: Option<u64>,
    torch: Option<TorchStream>,
    /// Recorded on ferry's default stream once it was ordered after torch's: the tensors'
    /// producers. The early copies wait for it on the copy stream.
    producers: Event,
    copies: Stream,
}

struct Entry {
    name: String,
    source: Tensor,
    /// The result, when its copy started at `add`.
    early: Option<Tensor>,
}

#[pymethods]
impl PyStateDictMove {
    /// A move of tensors to `device`; `streams` maps GPU ordinals to torch's stream there, when
    /// the caller names them (by default torch is asked for its current stream on each GPU met).
    #[new]
    #[pyo3(signature = (device, streams=None))]
    fn new(device: &str, streams: Option<HashMap<usize, u64>>) -> PyResult<Self> {
        guarded(|| {
            Ok(Self {
                device: parse_device(device)?,
                given: streams,
                gpus: Vec::new(),
                entries: Vec::new(),
                early_bytes: 0,
                realigned_bytes: 0,
                finished: false,
            })
        })
    }

    /// Adds `value` (a tensor, an array or a DLPack capsule; `source` may name a capsule's
    /// device) under `name`; a large one bound for the host starts crossing now.
    #[pyo3(signature = (name, value, source=None))]
    fn add(
        &mut self,
        py: Python<'_>,
        name: String,
        value: &Bound<'_, PyAny>,
        source: Option<&str>,
    ) -> PyResult<()> {
        guarded(|| {
            self.check_open()?;
            if let Some(gpu) = gpu_of(source_device(value, source)?, self.device) {
                self.order_with(py, gpu)?;
            }
            let imported = dlpack::import(py, value, Misaligned::Copy)?;
            self.realigned_bytes += imported.realigned_bytes;
            let t = imported.tensor;
            let early = match (self.device, t.device()) {
                (Device::Cpu, Device::Cuda(gpu))
                    if t.nbytes() >= EARLY_FROM && t.is_contiguous() =>
                {
                    let moved = match self.gpus.iter().find(|g| g.ordinal == gpu) {
                        Some(g) => download_beside(&t, &g.copies, &g.producers).map_err(to_py)?,
                        None => None,
                    };
                    let moved = match moved {
                        Some(moved) => moved,
                        None => {
                            t.to_with(Device::Cpu, MoveOptions::non_blocking())
                                .map_err(to_py)?
                                .0
                        }
                    };
                    self.early_bytes += t.nbytes();
                    Some(moved)
                }
                _ => None,
            };
            self.entries.push(Entry {
                name,
                source: t,
                early,
            });
            Ok(())
        })
    }

    /// Queues what is left, waits once, and returns `({name: tensor}, report)` in the order
    /// the tensors were added. With `to_torch` (torch's `from_dlpack`), each result is made a
    /// torch tensor while the copies cross; else it is a `ferry.Tensor`.
    #[pyo3(signature = (to_torch=None))]
    fn finish<'py>(
        &mut self,
        py: Python<'py>,
        to_torch: Option<Bound<'py, PyAny>>,
    ) -> PyResult<(Bound<'py, PyDict>, PyReport)> {
        guarded(|| {
            self.check_open()?;
            self.finished = true;
            let entries = std::mem::take(&mut self.entries);
            let device = self.device;
            let batch: Vec<(String, Tensor)> = entries
                .iter()
                .filter(|e| e.early.is_none())
                .map(|e| (e.name.clone(), e.source.clone()))
                .collect();
            let mut queued = py
                .detach(|| ferry::queue_state_dict(&batch, device))
                .map_err(to_py)?;
            drop(batch);
            let mut batched = queued.tensors().iter().map(|(_, t)| t.clone());
            let mut results: Vec<(String, Tensor)> = Vec::with_capacity(entries.len());
            for e in &entries {
                let Some(moved) = e.early.clone().or_else(|| batched.next()) else {
                    return Err(PyRuntimeError::new_err(format!(
                        "move_state_dict returned fewer tensors than it was given (none for \
                         {:?}); please report this",
                        e.name
                    )));
                };
                results.push((e.name.clone(), moved));
            }
            // Handed to torch before the wait: nothing reads them until this call returns.
            let out = PyDict::new(py);
            for (name, t) in &results {
                let value = match &to_torch {
                    Some(from_dlpack) => {
                        let stream = self.export_stream(t.device());
                        from_dlpack.call1((dlpack::export_landing(py, t, stream)?,))?
                    }
                    None => Bound::new(py, PyTensor::new(t.clone()))?.into_any(),
                };
                out.set_item(name, value)?;
            }
            let (early_bytes, tensors) = (self.early_bytes, results.len());
            drop(results);
            let gpus = std::mem::take(&mut self.gpus);
            let report = py
                .detach(move || {
                    let mut report = queued.wait()?;
                    drop(queued);
                    // The copies that started at `add`, on each GPU's copy stream (or, for
                    // the few that could not go there, its default stream), are waited for
                    // a stream at a time: the batch may have had nothing to queue, and
                    // waiting for each result's own copy costs a few microseconds apiece.
                    // Results read by ferry later find their copy's event complete.
                    for gpu in &gpus {
                        gpu.copies.synchronize()?;
                        CudaDevice::get(gpu.ordinal)?
                            .default_stream()
                            .synchronize()?;
                    }
                    report.bytes_moved += early_bytes;
                    report.path = TransferPath::Batched { tensors };
                    for gpu in &gpus {
                        order::after(gpu.torch.as_ref())?;
                    }
                    // Letting go of a hundred imported tensors waits for each one's stream and
                    // calls torch's deleters: a millisecond the caller need not wait for.
                    release_in_background(entries.into_iter().map(|e| e.source).collect());
                    Ok::<_, TensorError>(report)
                })
                .map_err(to_py)?;
            let mut report = PyReport::from(&report);
            report.realigned_bytes = self.realigned_bytes;
            Ok((out, report))
        })
    }
}

impl PyStateDictMove {
    fn check_open(&self) -> PyResult<()> {
        if self.finished {
            return Err(PyRuntimeError::new_err(
                "this StateDictMove has finished: start a new one for another state dict",
            ));
        }
        Ok(())
    }

    /// The first time GPU `gpu` is met, ferry's default stream there is ordered behind torch's
    /// current stream (the producers of what is added from now on).
    fn order_with(&mut self, py: Python<'_>, gpu: usize) -> PyResult<()> {
        if self.gpus.iter().any(|g| g.ordinal == gpu) {
            return Ok(());
        }
        let handle = match &self.given {
            Some(given) => given.get(&gpu).copied(),
            None => order::torch_stream(py, gpu)?,
        };
        let torch = TorchStream::new(gpu, handle)?;
        let producers = (|| {
            order::before(torch.as_ref())?;
            Ok::<_, TensorError>(CudaDevice::get(gpu)?.default_stream().record()?)
        })()
        .map_err(to_py)?;
        self.gpus.push(Gpu {
            ordinal: gpu,
            handle,
            torch,
            producers,
            copies: copy_stream(gpu).map_err(to_py)?,
        });
        Ok(())
    }

    /// The DLPack stream a result on `device` is handed to: torch's stream there (the legacy
    /// default stream when torch named none).
    fn export_stream(&self, device: Device) -> Option<isize> {
        let Device::Cuda(gpu) = device else {
            return None;
        };
        let handle = self
            .gpus
            .iter()
            .find(|g| g.ordinal == gpu)
            .and_then(|g| g.handle)
            .filter(|&h| h > 1);
        Some(handle.and_then(|h| isize::try_from(h).ok()).unwrap_or(1))
    }
}

/// Every tensor of `state_dict` (a dict of name to tensor, array or DLPack capsule) on
/// `device`, batched by dtype: `({name: tensor}, report)`. `sources` names the device of each
/// capsule; `streams` maps each GPU ordinal involved to torch's current stream there, which the
/// move is ordered with.
#[pyfunction]
#[pyo3(signature = (state_dict, device, streams=None, sources=None))]
pub fn move_state_dict<'py>(
    py: Python<'py>,
    state_dict: &Bound<'py, PyDict>,
    device: &str,
    streams: Option<HashMap<usize, u64>>,
    sources: Option<HashMap<String, String>>,
) -> PyResult<(Bound<'py, PyDict>, PyReport)> {
    guarded(|| {
        let mut ongoing = PyStateDictMove::new(device, streams)?;
        let sources = sources.unwrap_or_default();
        for (name, value) in state_dict.iter() {
            let name: String = name.extract()?;
            let source = sources.get(&name).map(String::as_str);
            ongoing.add(py, name, &value, source)?;
        }
        ongoing.finish(py, None)
    })
}

/// `t` (contiguous, on a GPU) copied into fresh pinned memory on `stream` after `producers`,
/// beside ferry's default stream; `None` when it cannot go that way (a view into a larger
/// buffer, or no room in the pinned budget), and the caller moves it the usual way.
fn download_beside(
    t: &Tensor,
    stream: &Stream,
    producers: &Event,
) -> ferry::Result<Option<Tensor>> {
    let guard = t.storage().read();
    let Buffer::Cuda(from) = &*guard else {
        return Ok(None);
    };
    if t.layout().offset() != 0 || from.len() != t.nbytes() {
        return Ok(None);
    }
    let Some(out) = pinned_tensor(t.shape(), t.dtype(), t.nbytes())? else {
        return Ok(None);
    };
    {
        let mut landing = out.storage().write();
        let Buffer::Pinned(to) = &mut *landing else {
            unreachable!("pinned_tensor is over a pinned block");
        };
        from.copy_to_pinned_async_after(to, stream, producers)?;
    }
    Ok(Some(out))
}

/// Drops imported tensors on a thread kept for it (starting a thread per call costs tens of
/// microseconds): each waits for the work ferry queued on it and then hands its memory back to
/// its producer (torch's deleters need no GIL). When no thread could be started, here.
fn release_in_background(tensors: Vec<Tensor>) {
    static RELEASER: OnceLock<Option<Mutex<Sender<Vec<Tensor>>>>> = OnceLock::new();
    let releaser = RELEASER.get_or_init(|| {
        let (send, receive) = channel::<Vec<Tensor>>();
        std::thread::Builder::new()
            .name("ferry-release".into())
            .spawn(move || receive.into_iter().for_each(drop))
            .ok()
            .map(|_| Mutex::new(send))
    });
    match releaser {
        Some(send) => {
            // A send fails only when the thread is gone; the tensors come back to be dropped here.
            if let Err(returned) = send.lock().send(tensors) {
                drop(returned.0);
            }
        }
        None => drop(tensors),
    }
}
