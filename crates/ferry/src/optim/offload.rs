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
//! without pinning it. When the pinned budget (or the limit given to
//! [`OffloadAdamW::new_within`]) cannot hold those buffers either, they are staged: taken as
//! each gradient is sent and each parameter stepped, and given back once used, within the
//! limit ([`OffloadAdamW::staging`] reports it; see the `staging` module).
//!
//! What a step means: the CPU steps a parameter during backward with the learning rate set
//! before that backward, and [`Optimizer::step`] waits for the step thread and the upload
//! thread to finish with the gradients backward produced, steps parameters whose `.grad` was
//! set without a backward, and counts the step. Gradients are consumed: after the step every
//! `.grad` is `None`.
//!
//! With [`OffloadAdamW::hold_gradients`], the CPU adds each landed gradient (in f32) to one
//! held for the step instead of stepping it, taking its sum of squares on the way: backward
//! passes accumulate, and [`Optimizer::clip_grad_norm`] and [`Optimizer::scale_grads`] (what a
//! [`GradScaler`](crate::amp::GradScaler) unscales with) act on the whole step's gradients; the
//! AdamW passes run at `step()`.
//!
//! With [`OffloadAdamW::delayed_update`], `step()` does not wait for the CPU: step i's passes
//! run beside step i+1's forward and backward, and each parameter's new weights are uploaded
//! when its next gradient arrives (backward has let go of it then), so step i+1 computes with
//! the weights of step i-1, as ZeRO-Offload's delayed parameter update does. The host's memory
//! bus then has a whole step's time for the passes, not backward's alone.
//!
//! Another runtime's parameters (torch's, through ferry-py) use the same machinery without
//! ferry's hooks: [`OffloadAdamW::fed`] takes device tensors over their memory, the caller
//! copies each gradient into [`OffloadAdamW::landing`] on [`OffloadAdamW::gradient_stream`]
//! and says so with [`OffloadAdamW::gradient_queued`], and orders its next reads of the
//! parameters after [`OffloadAdamW::upload_stream`].

use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferry_memory::cuda::{Event, PinnedBuffer, PinnedPool, Stream};
use ferry_memory::{DType, Device};
use ferry_tensor::{Buffer, HookHandle, Layout, Result, Storage, Tensor, TensorError};
use parking_lot::{Condvar, Mutex};

use held::Job;
use pipeline::{step_threads, upload_each, work};
pub use staging::StagingReport;
use staging::{Plan, Staging};

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
    /// The step it belongs to (1 for the first).
    t: u64,
    /// The hyperparameters to step it with.
    adam: AdamHyper,
    /// Recorded after a copy into its landing buffer that ferry did not queue (see
    /// [`OffloadAdamW::gradient_queued`]); ferry's own copies are waited for by the buffer.
    landed: Option<Event>,
    /// What the step thread does with it.
    job: Job,
}

/// What the hooks, the worker and the optimizer share.
struct Shared {
    params: Vec<Tensor>,
    down: Stream,
    up: Stream,
    slots: Vec<Mutex<Slot>>,
    hyper: Mutex<Hyper>,
    /// What is still to happen; `step` waits for parts of it to be none.
    flight: Mutex<Flight>,
    drained: Condvar,
    /// Per parameter, what the delayed update tracks.
    pending: Vec<Mutex<Pending>>,
    /// The first error of a hook or the worker, reported by the next `step`.
    error: Mutex<Option<String>>,
    /// Bounded staging, when the pinned limit cannot hold a buffer pair per parameter.
    staging: Option<Staging>,
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
    /// Time backward's hooks were held because the step thread had not yet read a parameter's
    /// last gradient (the delayed update running more than a step behind: the CPU's passes
    /// take longer than forward and backward), or waited for room for a staged landing buffer
    /// ([`OffloadAdamW::staging`]).
    pub held: Duration,
    /// When `step()` returned.
    pub returned: Option<Instant>,
}

fn widen(span: &mut Option<(Instant, Instant)>, at: Instant) {
    *span = Some(span.map_or((at, at), |(first, _)| (first, at)));
}

/// Work handed out and not done.
#[derive(Debug, Default)]
struct Flight {
    /// Gradients sent to the step thread and not yet stepped (and, without the delayed update,
    /// not yet uploaded).
    stepping: usize,
    /// Delayed update: parameters let go of by backward whose previous step is still running,
    /// so their upload is owed; `step` waits for these (the next forward reads them).
    owed: usize,
    /// Per parameter: a gradient was handed over whose landing buffer the step thread has not
    /// read yet (or, held in place, not yet stepped), so the next gradient's copy into it must
    /// wait.
    unread: Vec<bool>,
    /// With held gradients, per parameter: gradients handed over for this step so far.
    lands: Vec<u32>,
}

/// One parameter's place in the delayed update.
#[derive(Default)]
struct Pending {
    /// The last step handed to the step thread, and the last it finished.
    sent: u64,
    done: u64,
    /// Its last step's weights wait in the upload buffer.
    ready: bool,
    /// Backward let go of it while its last step ran: upload when done, after this event (the
    /// caller's; `None` when ferry orders the upload itself).
    released: Option<Option<Event>>,
    /// Its held-back weights are with the upload thread, not yet queued.
    uploading: bool,
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
    /// [`OffloadAdamW::delayed_update`].
    delayed: bool,
    /// [`OffloadAdamW::hold_gradients`].
    hold: bool,
    /// With `hold`: what this step's held gradients are multiplied by when stepped
    /// (unscaling and clipping; 1 when neither).
    held_scale: f64,
    /// With `hold`: gradients were handed over since the last `step()`.
    held_pending: bool,
    /// Steps counted so far; the steps in progress are number `steps + 1`.
    steps: u64,
}

/// One parameter's host side.
struct Slot {
    master: Vec<f32>,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    /// Where its gradient lands: a pinned host tensor of the parameter's shape and dtype
    /// (staged: only from its gradient's copy until the step thread has read it).
    landing: Option<Tensor>,
    /// Where the updated weights wait for their upload, in the parameter's dtype (staged:
    /// only from its step until the upload is queued).
    upload: Option<PinnedBuffer>,
    /// The step its state has taken, so a gradient seen twice in one step is not applied twice.
    stepped: u64,
    /// With [`OffloadAdamW::hold_gradients`]: this step's gradient summed over its backward
    /// passes, in f32 (empty until first held), how many passes it sums, and the sum of its
    /// squares (for the global norm).
    held: Vec<f32>,
    landed: u32,
    sumsq: f64,
    /// The step's only gradient so far is held where it landed (its landing buffer), not in
    /// `held`: one pass fewer over memory when a step has one backward pass.
    in_landing: bool,
    /// The hyperparameters its last held gradient came with, to step it with.
    held_adam: Option<AdamHyper>,
}

impl OffloadAdamW {
    /// AdamW over `params` (leaves on one CUDA device that require grad, contiguous, in f32,
    /// bf16 or f16) with learning rate `lr`, betas (0.9, 0.999), eps 1e-8, weight decay 0.01
    /// (torch.optim.AdamW's defaults). Copies the parameters to host master weights and pins
    /// a landing and an upload buffer for each, or stages them when the pinned pool's budget
    /// has no room for that (see [`OffloadAdamW::new_within`]).
    pub fn new(params: impl IntoIterator<Item = Tensor>, lr: f64) -> Result<Self> {
        Self::hooked(params, lr, None)
    }

    /// [`OffloadAdamW::new`] holding at most `pinned_limit` bytes of pinned memory: when a
    /// landing and an upload buffer per parameter would take more, they are staged, taken as
    /// each gradient is sent down and each parameter stepped and given back once used, half
    /// the limit for each kind ([`OffloadAdamW::staging`] reports it). Staging needs room for
    /// the largest parameter's two buffers (an error says how much otherwise); it rules out
    /// the delayed update, which holds every parameter's new weights until the next backward,
    /// and backward waits for a landing buffer when the CPU's steps fall behind.
    pub fn new_within(
        params: impl IntoIterator<Item = Tensor>,
        lr: f64,
        pinned_limit: usize,
    ) -> Result<Self> {
        Self::hooked(params, lr, Some(pinned_limit))
    }

    fn hooked(
        params: impl IntoIterator<Item = Tensor>,
        lr: f64,
        pinned_limit: Option<usize>,
    ) -> Result<Self> {
        let params = super::leaf_parameters("OffloadAdamW::new", params)?;
        let mut this = Self::build(params, lr, pinned_limit)?;
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
    /// calls [`wait_landing`](Self::wait_landing), queues its copy into
    /// [`landing`](Self::landing) on [`gradient_stream`](Self::gradient_stream) after the
    /// gradient's producers, then calls [`gradient_queued`](Self::gradient_queued); its next
    /// reads of the parameters wait on the device for [`upload_stream`](Self::upload_stream)
    /// after [`Optimizer::step`](crate::optim::Optimizer::step). The parameters' memory is
    /// written by the uploads, during the caller's backward, once the parameter's gradient has
    /// landed (so after every read queued before its gradient was).
    pub fn fed(params: impl IntoIterator<Item = Tensor>, lr: f64) -> Result<Self> {
        Self::build(params, lr, None)
    }

    /// [`OffloadAdamW::fed`] within a pinned limit, as [`OffloadAdamW::new_within`].
    pub fn fed_within(
        params: impl IntoIterator<Item = Tensor>,
        lr: f64,
        pinned_limit: usize,
    ) -> Result<Self> {
        Self::build(params, lr, Some(pinned_limit))
    }

    fn build(
        params: impl IntoIterator<Item = Tensor>,
        lr: f64,
        pinned_limit: Option<usize>,
    ) -> Result<Self> {
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
        }
        let pool = PinnedPool::global()?;
        let blocks: Vec<usize> = params
            .iter()
            .map(|p| PinnedPool::block_size(p.nbytes()))
            .collect();
        // What the budget has left: cached blocks can be trimmed, live and registered ones not.
        let stats = pool.stats();
        let held = stats.reserved_bytes.saturating_sub(stats.cached_bytes);
        let room = stats.budget_bytes.saturating_sub(held);
        let staging = match staging::plan(&blocks, pinned_limit, room) {
            Ok(Plan::PerParameter) => None,
            Ok(Plan::Staged { limit }) => {
                Some(Staging::new(limit, 2 * blocks.iter().sum::<usize>()))
            }
            Err(message) => return Err(invalid(OP, message)),
        };
        let mut slots = Vec::with_capacity(params.len());
        for p in &params {
            let master = ferry_tensor::with_no_grad(|| p.to_dtype(DType::F32)?.to_vec::<f32>())?;
            let n = p.numel();
            let (landing, upload) = if staging.is_some() {
                (None, None)
            } else {
                let landing = Storage::new(
                    Buffer::Pinned(pool.alloc(p.nbytes())?),
                    p.dtype(),
                    Device::Cpu,
                );
                let landing =
                    Tensor::from_storage(Arc::new(landing), Layout::contiguous(p.shape()))?;
                (Some(landing), Some(pool.alloc(p.nbytes())?))
            };
            slots.push(Mutex::new(Slot {
                master,
                exp_avg: vec![0.0; n],
                exp_avg_sq: vec![0.0; n],
                landing,
                upload,
                stepped: 0,
                held: Vec::new(),
                landed: 0,
                sumsq: 0.0,
                in_landing: false,
                held_adam: None,
            }));
        }
        let device = ferry_memory::cuda::CudaDevice::get(ordinal)?;
        let pending = (0..params.len()).map(|_| Mutex::default()).collect();
        let unread = vec![false; params.len()];
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
                delayed: false,
                hold: false,
                held_scale: 1.0,
                held_pending: false,
                steps: 0,
            }),
            flight: Mutex::new(Flight {
                lands: vec![0; unread.len()],
                unread,
                ..Flight::default()
            }),
            drained: Condvar::new(),
            pending,
            error: Mutex::new(None),
            staging,
            timeline: Mutex::new(StepTimeline::default()),
        });
        let (queue, landed) = channel();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(step_threads()?)
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

    /// With `on`, the delayed parameter update (see the module docs): `step()` returns without
    /// waiting for the CPU's passes, and the forward and backward that follow compute with the
    /// weights from one step earlier. [`OffloadAdamW::flush`] brings the parameters up to date
    /// (before evaluating or saving the model).
    ///
    /// Not with staged buffers ([`OffloadAdamW::staging`]): it holds every parameter's new
    /// weights in pinned memory until the next backward, which the limit does not allow; the
    /// next `step()` then says so, and the update stays undelayed.
    pub fn delayed_update(self, on: bool) -> Self {
        match &self.shared.staging {
            Some(staging) if on => {
                self.shared.note(invalid(
                    "OffloadAdamW::delayed_update",
                    staging.report().delayed_refusal(),
                ));
            }
            _ => self.shared.hyper.lock().delayed = on,
        }
        self
    }

    /// With `on`, gradients are held in host memory until `step()` instead of being stepped
    /// as they land: each backward pass's gradient is added (in f32) to the one held for the
    /// step, so gradients accumulate over several backward passes, and
    /// [`Optimizer::clip_grad_norm`](crate::optim::Optimizer::clip_grad_norm) and a
    /// [`GradScaler`](crate::amp::GradScaler) see the whole step's gradients (the global norm
    /// and the check for infinities are computed on the host as the gradients land, so no
    /// gradient waits on the GPU for them). The AdamW passes run at `step()`: after backward,
    /// or beside the next step's forward and backward with the delayed update. Costs 4 bytes
    /// of host memory per parameter.
    pub fn hold_gradients(self, on: bool) -> Self {
        self.shared.hyper.lock().hold = on;
        self
    }

    /// Waits for every step handed to the CPU and uploads the weights still held back by the
    /// delayed update (nothing to do without it). `after`, when given, is what the uploads wait
    /// for on the device besides what ferry orders itself (the caller's own reads of the
    /// parameters: see [`OffloadAdamW::fed`]).
    pub fn flush(&mut self, after: Option<&Event>) -> Result<()> {
        let shared = &self.shared;
        shared.wait(|f| f.stepping == 0 && f.owed == 0);
        for i in 0..shared.params.len() {
            let ready = std::mem::take(&mut shared.pending[i].lock().ready);
            if ready {
                if let Some(after) = after {
                    shared.up.wait_event(after)?;
                }
                shared.upload_one(i)?;
            }
        }
        shared.take_error("OffloadAdamW::flush")
    }

    /// The hyperparameters the hooks step with (those set by the builder methods and
    /// [`Optimizer::set_learning_rate`](crate::optim::Optimizer::set_learning_rate)).
    pub fn hyper(&self) -> AdamHyper {
        self.shared.hyper.lock().adam
    }

    /// Where parameter `i`'s gradient lands: a pinned host tensor of its shape and dtype (see
    /// [`OffloadAdamW::fed`]). `None` past the last parameter, and with staged buffers, before
    /// [`wait_landing`](Self::wait_landing) has taken one for its next gradient.
    pub fn landing(&self, i: usize) -> Option<Tensor> {
        self.shared
            .slots
            .get(i)
            .and_then(|s| s.lock().landing.clone())
    }

    /// Blocks until parameter `i`'s [`landing`](Self::landing) tensor may be written again:
    /// the step thread has read the last gradient handed over for it (with staged buffers, it
    /// also takes the landing buffer, waiting for room). A caller of [`fed`](Self::fed) calls
    /// it before queuing each gradient's copy (with the delayed update the step thread may
    /// still be a step behind; otherwise it returns at once), and reads `landing(i)` after it
    /// when staged. Returns the time it waited.
    pub fn wait_landing(&self, i: usize) -> Result<Duration> {
        if i >= self.shared.params.len() {
            return Ok(Duration::ZERO);
        }
        let queue = self.queue.as_ref().expect("present until drop");
        self.shared.prepare_landing(i, queue)
    }

    /// `Some` when the pinned limit could not hold a landing and an upload buffer per
    /// parameter, so they are staged (see [`OffloadAdamW::new_within`]): what they would take,
    /// the limit, and the peak so far. Its `Display` says so in a sentence.
    pub fn staging(&self) -> Option<StagingReport> {
        self.shared.staging.as_ref().map(Staging::report)
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
        // The caller ordered its copy after its reads of the parameter: so is this event.
        self.shared.release(i, Some(self.shared.down.record()?))?;
        let queue = self.queue.as_ref().expect("present until drop");
        let job = self.shared.landing_job(i);
        self.shared.hand_over(i, adam, Some(landed), job, queue)
    }

    /// Pinned bytes this optimizer holds (landing and upload buffers; staged, those taken now
    /// and those given back whose copies have not finished).
    pub fn pinned_bytes(&self) -> usize {
        if let Some(staging) = &self.shared.staging {
            return staging.held();
        }
        self.shared
            .slots
            .iter()
            .map(|s| {
                let s = s.lock();
                let landing = s
                    .landing
                    .as_ref()
                    .map_or(0, |l| match &*l.storage().read() {
                        Buffer::Pinned(b) => b.block_size(),
                        _ => 0,
                    });
                landing + s.upload.as_ref().map_or(0, PinnedBuffer::block_size)
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

mod held;
mod optimizer;
mod pipeline;
mod staging;
#[cfg(test)]
mod tests;
