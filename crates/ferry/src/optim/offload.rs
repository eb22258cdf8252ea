//! Optimizer offload: AdamW whose fp32 master weights and moments live in host memory, stepped
//! by [`super::host`] on the CPU while backward still runs on the GPU.
//!
//! The GPU keeps the parameters (f32, bf16 or f16) and no optimizer state. Each parameter's
//! gradient leaves for pinned host memory on a copy stream the moment backward has accumulated
//! it (a post-accumulate hook), and its device memory is freed then, so the GPU holds at most
//! the gradients still in flight. A step thread steps each parameter as its gradient lands and
//! writes the updated weights in the parameter's dtype into a pinned upload buffer in the same
//! pass; an upload thread queues the uploads on a second copy stream (its driver calls wait
//! while the training thread's launches fill the driver's queue, and the passes go on), so the
//! link carries gradients down and weights up at once. Nothing waits on the host for an upload:
//! the next kernel that reads a parameter waits for its copy on the device (ferry-memory orders
//! every use of a buffer after the copies in flight into it).
//!
//! The key decision: the state lives in pageable memory and only what the link touches is
//! pinned (a gradient landing buffer and an upload buffer per parameter: 4 to 8 bytes per
//! parameter against the state's 12), so a model's state can take most of the host's memory
//! without pinning it.
//!
//! What a step means: the CPU steps a parameter during backward with the learning rate set
//! before that backward, and [`Optimizer::step`] waits for the step thread and the upload
//! thread to finish with the gradients backward produced, steps parameters whose `.grad` was
//! set without a backward, and counts the step. Gradients are consumed: after the step every
//! `.grad` is `None`.
//!
//! Another runtime's parameters (torch's, through ferry-py) use the same machinery without
//! ferry's hooks: [`OffloadAdamW::fed`] takes device tensors over their memory, the caller
//! copies each gradient into [`OffloadAdamW::landing`] on [`OffloadAdamW::gradient_stream`]
//! and says so with [`OffloadAdamW::gradient_queued`], and orders its next reads of the
//! parameters after [`OffloadAdamW::upload_stream`].

use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferry_memory::cuda::{Event, PinnedBuffer, PinnedPool, Stream};
use ferry_memory::{DType, Device, bf16, f16};
use ferry_tensor::{Buffer, HookHandle, Layout, Result, Storage, Tensor, TensorError};
use ferry_transfer::StateDict;
use parking_lot::{Condvar, Mutex};

use super::Optimizer;
use super::host::{self, AdamTensor, GradSlice, ParamSlice};
use crate::checkpoint::CheckpointError;
use crate::nn::check_state;

/// AdamW with its state in host memory; see the module docs.
pub struct OffloadAdamW {
    shared: Arc<Shared>,
    last_timeline: Mutex<StepTimeline>,
    hooks: Vec<HookHandle<Tensor>>,
    worker: Option<JoinHandle<()>>,
    /// Queues the uploads the worker hands it, so the worker's next pass need not wait for
    /// the driver (whose queue the training thread's launches keep full).
    uploader: Option<JoinHandle<()>>,
    /// The worker's queue; dropping it ends the worker, and then the uploader.
    queue: Option<Sender<Sent>>,
}

/// A gradient handed to the step thread.
struct Sent {
    /// The parameter's index.
    index: usize,
    /// The hyperparameters to step it with.
    adam: AdamHyper,
    /// Recorded after a copy into its landing buffer that ferry did not queue (see
    /// [`OffloadAdamW::gradient_queued`]); ferry's own copies are waited for by the buffer.
    landed: Option<Event>,
}

/// What the hooks, the worker and the optimizer share.
struct Shared {
    params: Vec<Tensor>,
    down: Stream,
    up: Stream,
    slots: Vec<Mutex<Slot>>,
    hyper: Mutex<Hyper>,
    /// Gradients sent to the worker and not yet stepped; `step` waits for zero.
    in_flight: Mutex<usize>,
    drained: Condvar,
    /// The first error of a hook or the worker, reported by the next `step`.
    error: Mutex<Option<String>>,
    /// When this step's gradients went down, landed and were stepped.
    timeline: Mutex<StepTimeline>,
}

/// When the parts of one optimizer step happened, on the host's clock: what overlaps what.
/// [`OffloadAdamW::last_timeline`] gives the last step's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepTimeline {
    /// The first and the last gradient handed to the copy stream (by backward's hooks).
    pub sent: Option<(Instant, Instant)>,
    /// The first and the last gradient found landed in host memory by the step thread.
    pub landed: Option<(Instant, Instant)>,
    /// When the last parameter's upload was queued.
    pub stepped: Option<Instant>,
    /// Time the step thread spent in AdamW passes (waiting for gradients excluded).
    pub busy: Duration,
    /// Time the upload thread spent taking parameters' storage and queuing their uploads.
    pub queuing: Duration,
    /// When `step()` returned.
    pub returned: Option<Instant>,
}

fn widen(span: &mut Option<(Instant, Instant)>, at: Instant) {
    *span = Some(span.map_or((at, at), |(first, _)| (first, at)));
}

/// The hyperparameters a parameter is stepped with (torch.optim.AdamW's, `amsgrad=False`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamHyper {
    /// Learning rate.
    pub lr: f64,
    /// Decay rates of the first and second moment estimates.
    pub betas: (f64, f64),
    /// Term added to the denominator for stability.
    pub eps: f64,
    /// Decoupled weight decay factor.
    pub weight_decay: f64,
}

#[derive(Debug, Clone, Copy)]
struct Hyper {
    adam: AdamHyper,
    /// Steps counted so far; the steps in progress are number `steps + 1`.
    steps: u64,
}

/// One parameter's host side.
struct Slot {
    master: Vec<f32>,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    /// Where its gradient lands: a pinned host tensor of the parameter's shape and dtype.
    landing: Tensor,
    /// Where the updated weights wait for their upload (the parameter's dtype).
    upload: PinnedBuffer,
    /// The step its state has taken, so a gradient seen twice in one step is not applied twice.
    stepped: u64,
}

impl OffloadAdamW {
    /// AdamW over `params` (leaves on one CUDA device that require grad, contiguous, in f32,
    /// bf16 or f16) with learning rate `lr`, betas (0.9, 0.999), eps 1e-8, weight decay 0.01
    /// (torch.optim.AdamW's defaults). Copies the parameters to host master weights and pins
    /// a landing and an upload buffer for each.
    pub fn new(params: impl IntoIterator<Item = Tensor>, lr: f64) -> Result<Self> {
        let params = super::leaf_parameters("OffloadAdamW::new", params)?;
        let mut this = Self::fed(params, lr)?;
        let shared = &this.shared;
        let queue = this.queue.as_ref().expect("present until drop");
        for (i, p) in shared.params.iter().enumerate() {
            let weak: Weak<Shared> = Arc::downgrade(shared);
            let queue = queue.clone();
            let hook = p.register_post_accumulate_grad_hook(move |grad| {
                let Some(shared) = weak.upgrade() else {
                    return Ok(());
                };
                shared.send_down(i, grad, &queue)
            })?;
            this.hooks.push(hook);
        }
        Ok(this)
    }

    /// The same optimizer over device tensors that another runtime computes gradients for
    /// (they need not require grad; ferry registers no hooks). For each gradient the caller
    /// queues its copy into [`landing`](Self::landing) on [`gradient_stream`](Self::gradient_stream),
    /// after the gradient's producers, then calls [`gradient_queued`](Self::gradient_queued); its
    /// next reads of the parameters wait on the device for [`upload_stream`](Self::upload_stream)
    /// after [`Optimizer::step`]. The parameters' memory is written by the uploads, during the
    /// caller's backward, once the parameter's gradient has landed (so after every read queued
    /// before its gradient was).
    pub fn fed(params: impl IntoIterator<Item = Tensor>, lr: f64) -> Result<Self> {
        const OP: &str = "OffloadAdamW::new";
        let params: Vec<Tensor> = params.into_iter().collect();
        let Some(first) = params.first() else {
            return Err(invalid(OP, "no parameters to optimize".into()));
        };
        let Device::Cuda(ordinal) = first.device() else {
            return Err(invalid(
                OP,
                format!(
                    "parameter 0 is on {}; optimizer offload keeps GPU parameters' state on the \
                     host, so move the model to a GPU first (`model.to(Device::Cuda(0))`), or \
                     use `AdamW` for a model on the CPU",
                    first.device()
                ),
            ));
        };
        let mut slots = Vec::with_capacity(params.len());
        for (i, p) in params.iter().enumerate() {
            if p.device() != first.device() {
                return Err(invalid(
                    OP,
                    format!(
                        "parameter {i} is on {} and parameter 0 on {}: one optimizer, one device",
                        p.device(),
                        first.device()
                    ),
                ));
            }
            if !matches!(p.dtype(), DType::F32 | DType::BF16 | DType::F16) || !p.is_contiguous() {
                return Err(invalid(
                    OP,
                    format!(
                        "parameter {i} is {:?} {}; offload steps contiguous f32, bf16 or f16 \
                         parameters",
                        p.dtype(),
                        if p.is_contiguous() {
                            ""
                        } else {
                            "and not contiguous"
                        }
                    ),
                ));
            }
            let master = ferry_tensor::with_no_grad(|| p.to_dtype(DType::F32)?.to_vec::<f32>())?;
            let n = p.numel();
            let pool = PinnedPool::global()?;
            let landing = Storage::new(
                Buffer::Pinned(pool.alloc(p.nbytes())?),
                p.dtype(),
                Device::Cpu,
            );
            slots.push(Mutex::new(Slot {
                master,
                exp_avg: vec![0.0; n],
                exp_avg_sq: vec![0.0; n],
                landing: Tensor::from_storage(Arc::new(landing), Layout::contiguous(p.shape()))?,
                upload: pool.alloc(p.nbytes())?,
                stepped: 0,
            }));
        }
        let device = ferry_memory::cuda::CudaDevice::get(ordinal)?;
        let shared = Arc::new(Shared {
            params,
            down: device.new_stream()?,
            up: device.new_stream()?,
            slots,
            hyper: Mutex::new(Hyper {
                adam: AdamHyper {
                    lr,
                    betas: (0.9, 0.999),
                    eps: 1e-8,
                    weight_decay: 0.01,
                },
                steps: 0,
            }),
            in_flight: Mutex::new(0),
            drained: Condvar::new(),
            error: Mutex::new(None),
            timeline: Mutex::new(StepTimeline::default()),
        });
        let (queue, landed) = channel();
        // One core fewer than the machine has: the thread that runs backward must keep
        // launching kernels while the steps stream memory on the rest.
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(cores.saturating_sub(1).max(1))
            .thread_name(|i| format!("ferry-offload-{i}"))
            .build()
            .map_err(|e| invalid(OP, format!("could not start the step threads: {e}")))?;
        let (stepped, to_upload) = channel();
        let uploader = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("ferry-offload-upload".into())
                .spawn(move || upload_each(&shared, &to_upload))
                .map_err(|e| invalid(OP, format!("could not start the upload thread: {e}")))?
        };
        let worker = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("ferry-offload".into())
                .spawn(move || work(&shared, &landed, &stepped, &pool))
                .map_err(|e| invalid(OP, format!("could not start the step thread: {e}")))?
        };
        Ok(Self {
            shared,
            last_timeline: Mutex::new(StepTimeline::default()),
            hooks: Vec::new(),
            worker: Some(worker),
            uploader: Some(uploader),
            queue: Some(queue),
        })
    }

    /// Decay rates of the first and second moment estimates.
    pub fn betas(self, beta1: f64, beta2: f64) -> Self {
        self.shared.hyper.lock().adam.betas = (beta1, beta2);
        self
    }

    /// Term added to the denominator for stability.
    pub fn eps(self, eps: f64) -> Self {
        self.shared.hyper.lock().adam.eps = eps;
        self
    }

    /// Decoupled weight decay factor.
    pub fn weight_decay(self, weight_decay: f64) -> Self {
        self.shared.hyper.lock().adam.weight_decay = weight_decay;
        self
    }

    /// The hyperparameters the hooks step with (those set by the builder methods and
    /// [`Optimizer::set_learning_rate`]).
    pub fn hyper(&self) -> AdamHyper {
        self.shared.hyper.lock().adam
    }

    /// Where parameter `i`'s gradient lands: a pinned host tensor of its shape and dtype (see
    /// [`OffloadAdamW::fed`]). `None` past the last parameter.
    pub fn landing(&self, i: usize) -> Option<Tensor> {
        self.shared.slots.get(i).map(|s| s.lock().landing.clone())
    }

    /// The copy stream the gradients go down on.
    pub fn gradient_stream(&self) -> &Stream {
        &self.shared.down
    }

    /// The copy stream the updated parameters go up on.
    pub fn upload_stream(&self) -> &Stream {
        &self.shared.up
    }

    /// Parameter `i`'s gradient copy into its [`landing`](Self::landing) tensor is queued on
    /// [`gradient_stream`](Self::gradient_stream): the step thread steps it with `adam` once
    /// the copy has landed (an event recorded there now says when).
    pub fn gradient_queued(&self, i: usize, adam: AdamHyper) -> Result<()> {
        if i >= self.shared.params.len() {
            return Err(invalid(
                "OffloadAdamW::gradient_queued",
                format!(
                    "parameter {i} does not exist: the optimizer has {}",
                    self.shared.params.len()
                ),
            ));
        }
        let landed = self.shared.down.record()?;
        let queue = self.queue.as_ref().expect("present until drop");
        self.shared.hand_over(i, adam, Some(landed), queue)
    }

    /// Pinned bytes this optimizer holds (landing and upload buffers).
    pub fn pinned_bytes(&self) -> usize {
        self.shared
            .slots
            .iter()
            .map(|s| {
                let s = s.lock();
                let landing = match &*s.landing.storage().read() {
                    Buffer::Pinned(b) => b.block_size(),
                    _ => 0,
                };
                landing + s.upload.block_size()
            })
            .sum()
    }

    /// When the last step's gradients went down, landed and were stepped, and when `step()`
    /// returned.
    pub fn last_timeline(&self) -> StepTimeline {
        *self.last_timeline.lock()
    }

    /// Host bytes of the optimizer state (master weights and both moments).
    pub fn state_bytes(&self) -> usize {
        12 * self.shared.params.iter().map(Tensor::numel).sum::<usize>()
    }
}

fn invalid(op: &'static str, message: String) -> TensorError {
    TensorError::InvalidArgument { op, message }
}

impl Shared {
    /// From the hook: queues parameter `i`'s gradient to its landing buffer, frees it on the
    /// device, and hands `i` to the worker.
    fn send_down(&self, i: usize, grad: &Tensor, queue: &Sender<Sent>) -> Result<()> {
        let param = &self.params[i];
        if grad.dtype() != param.dtype() || !grad.is_contiguous() {
            // Gradients of a parameter come in its dtype and layout; anything else is the
            // caller's doing, and is converted here rather than stepped wrong.
            let grad = ferry_tensor::with_no_grad(|| grad.to_dtype(param.dtype())?.contiguous())?;
            return self.send_down(i, &grad, queue);
        }
        {
            let slot = self.slots[i].lock();
            let guard = grad.storage().read();
            let Buffer::Cuda(from) = &*guard else {
                return Err(invalid(
                    "OffloadAdamW",
                    format!("the gradient of parameter {i} is on {}", grad.device()),
                ));
            };
            let offset = grad.layout().offset() * grad.dtype().size();
            let mut landing = slot.landing.storage().write();
            let Buffer::Pinned(landing) = &mut *landing else {
                unreachable!("landing tensors are pinned");
            };
            from.copy_to_pinned_async_at(offset, landing, &self.down)?;
        }
        // Its device memory goes back now (the free waits for the copy on the device).
        param.set_grad(None);
        let adam = self.hyper.lock().adam;
        self.hand_over(i, adam, None, queue)
    }

    /// Hands parameter `i`, whose gradient copy is queued, to the step thread.
    fn hand_over(
        &self,
        index: usize,
        adam: AdamHyper,
        landed: Option<Event>,
        queue: &Sender<Sent>,
    ) -> Result<()> {
        widen(&mut self.timeline.lock().sent, Instant::now());
        *self.in_flight.lock() += 1;
        let sent = Sent {
            index,
            adam,
            landed,
        };
        if queue.send(sent).is_err() {
            self.finish_one();
            return Err(invalid("OffloadAdamW", "the step thread has ended".into()));
        }
        Ok(())
    }

    fn finish_one(&self) {
        let mut in_flight = self.in_flight.lock();
        *in_flight -= 1;
        if *in_flight == 0 {
            self.drained.notify_all();
        }
    }

    /// Steps a parameter from its landed gradient into its upload buffer.
    fn step_one(&self, sent: &Sent) -> Result<()> {
        let i = sent.index;
        if let Some(landed) = &sent.landed {
            landed.synchronize()?;
        }
        let t = self.hyper.lock().steps + 1;
        let AdamHyper {
            lr,
            betas,
            eps,
            weight_decay,
        } = sent.adam;
        let step = host::adamw_step(t, lr, betas, eps, weight_decay);
        let param = &self.params[i];
        let mut slot = self.slots[i].lock();
        if slot.stepped == t {
            return Err(invalid(
                "OffloadAdamW",
                format!(
                    "parameter {i} got a second gradient in step {t}: call `step()` after each \
                     backward (accumulating gradients over several backward passes is not \
                     supported with offload yet)"
                ),
            ));
        }
        let Slot {
            master,
            exp_avg,
            exp_avg_sq,
            landing,
            upload,
            stepped,
        } = &mut *slot;
        let landing = landing.storage().read();
        let Buffer::Pinned(landing) = &*landing else {
            unreachable!("landing tensors are pinned");
        };
        let bytes = landing.as_bytes()?;
        let began = Instant::now();
        widen(&mut self.timeline.lock().landed, began);
        let grad = match param.dtype() {
            DType::BF16 => GradSlice::Bf16(bytemuck::cast_slice::<u8, bf16>(bytes)),
            DType::F16 => GradSlice::F16(bytemuck::cast_slice::<u8, f16>(bytes)),
            _ => GradSlice::F32(bytemuck::cast_slice::<u8, f32>(bytes)),
        };
        let out_bytes = upload.as_bytes_mut()?;
        let out = match param.dtype() {
            DType::BF16 => ParamSlice::Bf16(bytemuck::cast_slice_mut::<u8, bf16>(out_bytes)),
            DType::F16 => ParamSlice::F16(bytemuck::cast_slice_mut::<u8, f16>(out_bytes)),
            _ => ParamSlice::F32(bytemuck::cast_slice_mut::<u8, f32>(out_bytes)),
        };
        host::adamw(
            &step,
            [AdamTensor {
                master,
                exp_avg,
                exp_avg_sq,
                grad,
                out: Some(out),
            }],
        )?;
        *stepped = t;
        self.timeline.lock().busy += began.elapsed();
        Ok(())
    }

    /// Queues parameter `i`'s upload from its upload buffer, stepped just before.
    fn upload_one(&self, i: usize) -> Result<()> {
        let queuing = Instant::now();
        let param = &self.params[i];
        let mut slot = self.slots[i].lock();
        let offset = param.layout().offset() * param.dtype().size();
        let mut guard = param.storage().write();
        let Buffer::Cuda(to) = &mut *guard else {
            unreachable!("parameters were checked to be on a GPU");
        };
        to.copy_from_pinned_async_at(offset, &mut slot.upload, &self.up)?;
        let mut timeline = self.timeline.lock();
        let done = Instant::now();
        timeline.stepped = Some(done);
        timeline.queuing += done - queuing;
        Ok(())
    }

    fn note(&self, err: TensorError) {
        self.error.lock().get_or_insert_with(|| err.to_string());
    }
}

/// The worker: steps each parameter whose gradient was sent, in the order they were sent, on
/// the cores of `pool`, and hands it to the uploader.
fn work(
    shared: &Shared,
    landed: &Receiver<Sent>,
    stepped: &Sender<usize>,
    pool: &rayon::ThreadPool,
) {
    while let Ok(sent) = landed.recv() {
        let outcome = pool.install(|| shared.step_one(&sent)).and_then(|()| {
            stepped
                .send(sent.index)
                .map_err(|_| invalid("OffloadAdamW", "the upload thread has ended".into()))
        });
        if let Err(err) = outcome {
            shared.note(err);
            shared.finish_one();
        }
    }
}

/// The uploader: queues each stepped parameter's upload; the parameter's step is then done.
fn upload_each(shared: &Shared, stepped: &Receiver<usize>) {
    while let Ok(i) = stepped.recv() {
        if let Err(err) = shared.upload_one(i) {
            shared.note(err);
        }
        shared.finish_one();
    }
}

impl Optimizer for OffloadAdamW {
    fn step(&mut self) -> Result<()> {
        let shared = &self.shared;
        // Gradients set without a backward (no hook ran for them) go down now.
        let queue = self.queue.as_ref().expect("present until drop");
        for (i, p) in shared.params.iter().enumerate() {
            if let Some(grad) = p.grad() {
                shared.send_down(i, &grad, queue)?;
            }
        }
        {
            let mut in_flight = shared.in_flight.lock();
            while *in_flight > 0 {
                shared.drained.wait(&mut in_flight);
            }
        }
        shared.hyper.lock().steps += 1;
        let mut timeline = std::mem::take(&mut *shared.timeline.lock());
        timeline.returned = Some(Instant::now());
        *self.last_timeline.lock() = timeline;
        match shared.error.lock().take() {
            Some(message) => Err(invalid("OffloadAdamW::step", message)),
            None => Ok(()),
        }
    }

    fn parameters(&self) -> &[Tensor] {
        &self.shared.params
    }

    fn learning_rate(&self) -> f64 {
        self.shared.hyper.lock().adam.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.shared.hyper.lock().adam.lr = lr;
    }

    fn steps(&self) -> u64 {
        self.shared.hyper.lock().steps
    }

    /// AdamW's names (`step`, `lr`, `{i}.exp_avg`, `{i}.exp_avg_sq`) plus `{i}.master`, the
    /// fp32 master weights, as host tensors (copies: the state keeps changing).
    fn state_dict(&self) -> StateDict {
        let hyper = *self.shared.hyper.lock();
        let mut out = vec![
            ("step".to_string(), Tensor::scalar(hyper.steps as i64)),
            ("lr".to_string(), Tensor::scalar(hyper.adam.lr)),
        ];
        for (i, (slot, p)) in self
            .shared
            .slots
            .iter()
            .zip(&self.shared.params)
            .enumerate()
        {
            let slot = slot.lock();
            let tensor =
                |v: &[f32]| Tensor::from_slice(v, p.shape()).expect("the parameter's shape");
            if slot.stepped > 0 {
                out.push((format!("{i}.exp_avg"), tensor(&slot.exp_avg)));
                out.push((format!("{i}.exp_avg_sq"), tensor(&slot.exp_avg_sq)));
            }
            out.push((format!("{i}.master"), tensor(&slot.master)));
        }
        out
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<(), CheckpointError> {
        let f32_like = |p: &Tensor| Tensor::zeros(p.shape(), DType::F32, Device::Cpu);
        let mut expected = vec![
            ("step".to_string(), Tensor::scalar(0i64)),
            ("lr".to_string(), Tensor::scalar(0f64)),
        ];
        for (i, p) in self.shared.params.iter().enumerate() {
            let has = |name: &str| state.iter().any(|(k, _)| *k == format!("{i}.{name}"));
            let names: &[&str] = if has("exp_avg") {
                &["exp_avg", "exp_avg_sq", "master"]
            } else {
                &["master"]
            };
            for name in names {
                expected.push((format!("{i}.{name}"), f32_like(p)?));
            }
        }
        check_state("optimizer", &expected, state)?;
        let find = |key: &str| &state.iter().find(|(k, _)| k == key).expect("checked").1;
        for (i, slot) in self.shared.slots.iter().enumerate() {
            let mut slot = slot.lock();
            slot.master = find(&format!("{i}.master")).to_vec::<f32>()?;
            let key = format!("{i}.exp_avg");
            if state.iter().any(|(k, _)| *k == key) {
                slot.exp_avg = find(&key).to_vec::<f32>()?;
                slot.exp_avg_sq = find(&format!("{i}.exp_avg_sq")).to_vec::<f32>()?;
            } else {
                slot.exp_avg.fill(0.0);
                slot.exp_avg_sq.fill(0.0);
            }
            slot.stepped = 0;
        }
        let mut hyper = self.shared.hyper.lock();
        hyper.steps = find("step").item()? as u64;
        hyper.adam.lr = find("lr").item()?;
        Ok(())
    }
}

impl Drop for OffloadAdamW {
    fn drop(&mut self) {
        for hook in self.hooks.drain(..) {
            // false only when the parameter is gone, and its hook with it.
            let _ = hook.remove();
        }
        drop(self.queue.take());
        // The worker ends with its queue, and the uploader with the worker's.
        for thread in [self.worker.take(), self.uploader.take()]
            .into_iter()
            .flatten()
        {
            // A thread that panicked has nothing left to report: its error was noted.
            let _ = thread.join();
        }
        // A caller's copies into the landing tensors (see `fed`) may still be running; the
        // landing memory is returned only after them. An error here has nowhere to go.
        let _ = self.shared.down.synchronize();
    }
}

#[cfg(test)]
mod tests;
