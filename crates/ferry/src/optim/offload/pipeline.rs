//! The pipeline behind [`super::OffloadAdamW`]: what the hooks hand over, the step thread's
//! passes, the uploads, and the bookkeeping `step` waits on.

use std::sync::mpsc::{Receiver, Sender};
use std::time::{Duration, Instant};

use ferry_memory::cuda::Event;
use ferry_memory::{DType, bf16, f16};
use ferry_tensor::{Buffer, Result, Tensor, TensorError};

use super::staging::Retired;
use super::{AdamHyper, Flight, Job, Sent, Shared, Slot, invalid, widen};
use crate::optim::host::{self, AdamTensor, GradSlice, ParamSlice};

/// The step threads: `FERRY_OFFLOAD_THREADS` when set, else one core fewer than the machine
/// has (the thread that runs backward must keep launching kernels while the steps stream
/// memory on the rest).
pub(super) fn step_threads() -> Result<usize> {
    const VARIABLE: &str = "FERRY_OFFLOAD_THREADS";
    match std::env::var(VARIABLE) {
        Ok(text) => text
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                invalid(
                    "OffloadAdamW::new",
                    format!("{VARIABLE}={text:?} is not a number of threads (a whole number >= 1)"),
                )
            }),
        Err(_) => {
            let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
            Ok(cores.saturating_sub(1).max(1))
        }
    }
}

impl Shared {
    /// From the hook: queues parameter `i`'s gradient to its landing buffer, frees it on the
    /// device, and hands `i` to the worker.
    pub(super) fn send_down(&self, i: usize, grad: &Tensor, queue: &Sender<Sent>) -> Result<()> {
        let param = &self.params[i];
        if grad.dtype() != param.dtype() || !grad.is_contiguous() {
            // Gradients of a parameter come in its dtype and layout; anything else is the
            // caller's doing, and is converted here rather than stepped wrong.
            let grad = ferry_tensor::with_no_grad(|| grad.to_dtype(param.dtype())?.contiguous())?;
            return self.send_down(i, &grad, queue);
        }
        // The step thread may not have read this parameter's last gradient yet (with the
        // delayed update it may run a step behind): its landing buffer is written after.
        self.prepare_landing(i, queue)?;
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
            let landing = slot.landing.as_ref().expect("attached above");
            let mut landing = landing.storage().write();
            let Buffer::Pinned(landing) = &mut *landing else {
                unreachable!("landing tensors are pinned");
            };
            from.copy_to_pinned_async_at(offset, landing, &self.down)?;
        }
        // Its device memory goes back now (the free waits for the copy on the device).
        param.set_grad(None);
        // The parameter's upload orders itself after the kernels queued so far.
        self.release(i, None)?;
        let adam = self.hyper.lock().adam;
        let job = self.landing_job(i);
        self.hand_over(i, adam, None, job, queue)
    }

    /// Makes parameter `i`'s landing buffer ready for its next gradient: a first gradient held
    /// in it is copied out, the step thread has read what it holds, and (staged) one is taken.
    /// Returns the time it waited.
    pub(super) fn prepare_landing(&self, i: usize, queue: &Sender<Sent>) -> Result<Duration> {
        let began = Instant::now();
        self.spill_if_held_in_place(i, queue)?;
        self.wait_unread(i);
        self.attach_landing(i)?;
        Ok(began.elapsed())
    }

    /// Held gradients: when parameter `i`'s first gradient of this step is held in its landing
    /// buffer ([`Job::LandInPlace`]), a second one is coming (accumulation): the step thread
    /// copies the first out ([`Job::Spill`]), after which the landing buffer is free.
    pub(super) fn spill_if_held_in_place(&self, i: usize, queue: &Sender<Sent>) -> Result<()> {
        if self.staging.is_some() || !self.hyper.lock().hold || self.flight.lock().lands[i] != 1 {
            return Ok(());
        }
        let adam = self.hyper.lock().adam;
        self.hand_over(i, adam, None, Job::Spill, queue)
    }

    /// Staged buffers: takes a landing buffer for parameter `i`'s next gradient, waiting for
    /// room (the step thread gives them back as it reads them), unless it has one.
    pub(super) fn attach_landing(&self, i: usize) -> Result<()> {
        let Some(staging) = &self.staging else {
            return Ok(());
        };
        if self.slots[i].lock().landing.is_some() {
            return Ok(());
        }
        let param = &self.params[i];
        let began = Instant::now();
        let landing = staging
            .landings
            .take_landing(param.shape(), param.dtype())?;
        self.timeline.lock().held += began.elapsed();
        self.slots[i].lock().landing = Some(landing);
        Ok(())
    }

    /// Staged buffers: gives back the landing buffer of a slot whose gradient was read.
    fn retire_landing(&self, slot: &mut Slot) {
        let Some(staging) = &self.staging else {
            return;
        };
        if let Some(landing) = slot.landing.take() {
            staging.landings.give_back(Retired::Landing(landing));
        }
    }

    /// What the step thread does with parameter `i`'s gradient that lands: steps it, or holds
    /// it for the step (noting that one is held): in place when it is the step's first, the
    /// landing buffer is the parameter's own (a staged one must go back before the step), and
    /// the update is not delayed (its step runs during the next backward, whose gradient would
    /// wait for the buffer).
    pub(super) fn landing_job(&self, i: usize) -> Job {
        let delayed = {
            let mut hyper = self.hyper.lock();
            if !hyper.hold {
                return Job::Step;
            }
            hyper.held_pending = true;
            hyper.delayed
        };
        let mut flight = self.flight.lock();
        flight.lands[i] += 1;
        if flight.lands[i] == 1 && self.staging.is_none() && !delayed {
            Job::LandInPlace
        } else {
            Job::Land
        }
    }

    /// Hands parameter `i` to the step thread for `job` (for the jobs that read it, its
    /// gradient's copy into the landing buffer is queued).
    pub(super) fn hand_over(
        &self,
        index: usize,
        adam: AdamHyper,
        landed: Option<Event>,
        job: Job,
        queue: &Sender<Sent>,
    ) -> Result<()> {
        let reads = job.reads_landing();
        if reads && job != Job::Spill {
            widen(&mut self.timeline.lock().sent, Instant::now());
        }
        {
            let mut flight = self.flight.lock();
            flight.stepping += 1;
            flight.unread[index] |= reads;
        }
        let t = self.hyper.lock().steps + 1;
        if job.steps() {
            self.pending[index].lock().sent = t;
        }
        let sent = Sent {
            index,
            t,
            adam,
            landed,
            job,
        };
        if queue.send(sent).is_err() {
            self.settle(|f| {
                f.stepping -= 1;
                f.unread[index] = false;
            });
            return Err(invalid("OffloadAdamW", "the step thread has ended".into()));
        }
        Ok(())
    }

    pub(super) fn finish_one(&self) {
        self.settle(|f| f.stepping -= 1);
    }

    /// Changes the flight under its lock and wakes whoever waits for it.
    pub(super) fn settle(&self, change: impl FnOnce(&mut Flight)) {
        change(&mut self.flight.lock());
        self.drained.notify_all();
    }

    /// Blocks until the step thread has read parameter `i`'s landing buffer (at once when it
    /// holds no unread gradient); the time waited is counted in the timeline.
    pub(super) fn wait_unread(&self, i: usize) -> Duration {
        if !self.flight.lock().unread[i] {
            return Duration::ZERO;
        }
        let began = Instant::now();
        self.wait(|f| !f.unread[i]);
        let held = began.elapsed();
        self.timeline.lock().held += held;
        held
    }

    /// Blocks until `done` holds of the flight.
    pub(super) fn wait(&self, done: impl Fn(&Flight) -> bool) {
        let mut flight = self.flight.lock();
        while !done(&flight) {
            self.drained.wait(&mut flight);
        }
    }

    /// The first error a hook or a thread noted, as `op`'s.
    pub(super) fn take_error(&self, op: &'static str) -> Result<()> {
        match self.error.lock().take() {
            Some(message) => Err(invalid(op, message)),
            None => Ok(()),
        }
    }

    /// Delayed update: backward has let go of parameter `i` (its next gradient arrived), so
    /// its last step's weights may be uploaded now, after `after` on the device when given; if
    /// that step is still running, the step thread hands them to the upload thread when done.
    pub(super) fn release(&self, i: usize, after: Option<Event>) -> Result<()> {
        if !self.hyper.lock().delayed {
            return Ok(());
        }
        let mut pending = self.pending[i].lock();
        if pending.ready {
            pending.ready = false;
            drop(pending);
            if let Some(after) = &after {
                self.up.wait_event(after)?;
            }
            return self.upload_one(i);
        }
        if pending.sent > pending.done {
            pending.released = Some(after);
            self.flight.lock().owed += 1;
        }
        Ok(())
    }

    /// A step that failed (its error is noted): nothing of it is uploaded or waited for.
    pub(super) fn abandon(&self, i: usize, t: u64) {
        let mut pending = self.pending[i].lock();
        pending.done = t;
        let owed = pending.released.take().is_some();
        drop(pending);
        self.settle(|f| {
            f.stepping -= 1;
            f.owed -= usize::from(owed);
        });
    }

    /// Delayed update, from the step thread: parameter `i`'s step is done; its weights go up
    /// now if backward already let go of it, else they wait for that.
    pub(super) fn stepped_delayed(&self, i: usize, t: u64, uploads: &Sender<Upload>) -> Result<()> {
        let mut pending = self.pending[i].lock();
        pending.done = t;
        let Some(after) = pending.released.take() else {
            pending.ready = true;
            return Ok(());
        };
        // The upload thread queues it (driver calls wait while backward's launches fill the
        // driver's queue); this parameter's next pass waits until it has.
        pending.uploading = true;
        drop(pending);
        if uploads.send(Upload::Released(i, after)).is_err() {
            self.pending[i].lock().uploading = false;
            self.settle(|f| f.owed -= 1);
            return Err(invalid(
                "OffloadAdamW",
                "the upload thread has ended".into(),
            ));
        }
        Ok(())
    }

    /// Delayed update, from the upload thread: queues parameter `i`'s held-back weights after
    /// `after`; the owed upload is then paid.
    fn upload_released(&self, i: usize, after: Option<Event>) -> Result<()> {
        let uploaded = after
            .as_ref()
            .map_or(Ok(()), |after| self.up.wait_event(after))
            .map_err(TensorError::from)
            .and_then(|()| self.upload_one(i));
        self.pending[i].lock().uploading = false;
        self.settle(|f| f.owed -= 1);
        uploaded
    }

    /// [`Job::Land`]: adds parameter `i`'s landed gradient to the one held for this step (the
    /// first pass of a step copies it), in f32, and takes the sum of squares of the result on
    /// the way.
    pub(super) fn land_one(&self, sent: &Sent) -> Result<()> {
        if let Some(landed) = &sent.landed {
            landed.synchronize()?;
        }
        let param = &self.params[sent.index];
        let mut slot = self.slots[sent.index].lock();
        let Slot {
            landing,
            held,
            landed,
            sumsq,
            held_adam,
            in_landing,
            ..
        } = &mut *slot;
        let landing = landing.as_ref().ok_or_else(|| unlanded(sent.index))?;
        let guard = landing.storage().read();
        let Buffer::Pinned(landing) = &*guard else {
            unreachable!("landing tensors are pinned");
        };
        // Waits for the gradient's copy; the pass's time starts once it has landed.
        let bytes = landing.as_bytes()?;
        let began = Instant::now();
        let grad = landed_grad(param.dtype(), bytes);
        match sent.job {
            Job::LandInPlace => {
                widen(&mut self.timeline.lock().landed, began);
                *sumsq = host::sum_squares(grad);
                *landed = 1;
                *in_landing = true;
                *held_adam = Some(sent.adam);
            }
            job => {
                // A spilled gradient is the step's first; a landed one may follow others.
                let first = job == Job::Spill || *landed == 0;
                if held.len() != param.numel() {
                    *held = vec![0.0; param.numel()];
                }
                *sumsq = host::accumulate(held, grad, first);
                if job == Job::Spill {
                    *in_landing = false;
                } else {
                    widen(&mut self.timeline.lock().landed, began);
                    *landed += 1;
                    *held_adam = Some(sent.adam);
                }
            }
        }
        drop(guard);
        if sent.job != Job::LandInPlace {
            self.retire_landing(&mut slot);
        }
        self.timeline.lock().busy += began.elapsed();
        Ok(())
    }

    /// Steps a parameter from its landed gradient (or, for [`Job::StepHeld`], from the one
    /// held for the step, which may be in its landing buffer) into its upload buffer. Says
    /// whether it read the landing buffer (which the next gradient may take now).
    pub(super) fn step_one(&self, sent: &Sent) -> Result<bool> {
        let i = sent.index;
        if let Some(landed) = &sent.landed {
            landed.synchronize()?;
        }
        // Delayed update: the last step's weights must be queued for upload before this pass
        // rewrites them (their buffer then waits for the copy itself). Rarely waits: a step
        // comes a whole training step after the last.
        while self.pending[i].lock().uploading {
            std::thread::sleep(Duration::from_micros(50));
        }
        let t = sent.t;
        let AdamHyper {
            lr,
            betas,
            eps,
            weight_decay,
        } = sent.adam;
        let step = host::adamw_step(t, lr, betas, eps, weight_decay);
        let param = &self.params[i];
        // Staged: an upload buffer, taken before the slot is locked (taking may wait for the
        // GPU's uploads).
        let staged_upload = match &self.staging {
            Some(staging) => Some(staging.uploads.take(param.nbytes())?),
            None => None,
        };
        let mut slot = self.slots[i].lock();
        if let Some(upload) = staged_upload {
            // One a failed step left behind goes back.
            if let (Some(staging), Some(old)) = (&self.staging, slot.upload.replace(upload)) {
                staging.uploads.give_back(Retired::Upload(old));
            }
        }
        if slot.stepped == t {
            return Err(invalid(
                "OffloadAdamW",
                format!(
                    "parameter {i} got a second gradient in step {t}: call `step()` after each \
                     backward, or build the optimizer with `.hold_gradients(true)` to \
                     accumulate gradients over several backward passes"
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
            held,
            landed,
            in_landing,
            ..
        } = &mut *slot;
        let (grad_scale, from_landing) = match sent.job {
            Job::StepHeld { scale } => {
                *landed = 0;
                (scale, std::mem::take(in_landing))
            }
            _ => (1.0, true),
        };
        let landing = match from_landing {
            true => Some(
                landing
                    .as_ref()
                    .ok_or_else(|| unlanded(i))?
                    .storage()
                    .read(),
            ),
            false => None,
        };
        let grad = match &landing {
            None => GradSlice::F32(held),
            Some(landing) => {
                let Buffer::Pinned(landing) = &**landing else {
                    unreachable!("landing tensors are pinned");
                };
                // Waits for the gradient's copy; the pass's time starts once it has landed.
                let bytes = landing.as_bytes()?;
                if sent.job == Job::Step {
                    widen(&mut self.timeline.lock().landed, Instant::now());
                }
                landed_grad(param.dtype(), bytes)
            }
        };
        let began = Instant::now();
        let upload = upload.as_mut().expect("per parameter, or taken above");
        let out_bytes = upload.as_bytes_mut()?;
        let out = match param.dtype() {
            DType::BF16 => ParamSlice::Bf16(bytemuck::cast_slice_mut::<u8, bf16>(out_bytes)),
            DType::F16 => ParamSlice::F16(bytemuck::cast_slice_mut::<u8, f16>(out_bytes)),
            _ => ParamSlice::F32(bytemuck::cast_slice_mut::<u8, f32>(out_bytes)),
        };
        host::adamw_scaled(
            &step,
            grad_scale,
            [AdamTensor {
                master,
                exp_avg,
                exp_avg_sq,
                grad,
                out: Some(out),
            }],
        )?;
        *stepped = t;
        drop(landing);
        if from_landing {
            self.retire_landing(&mut slot);
        }
        self.timeline.lock().busy += began.elapsed();
        Ok(from_landing)
    }

    /// Queues parameter `i`'s upload from its upload buffer, stepped just before.
    pub(super) fn upload_one(&self, i: usize) -> Result<()> {
        let queuing = Instant::now();
        let param = &self.params[i];
        let mut slot = self.slots[i].lock();
        let offset = param.layout().offset() * param.dtype().size();
        let mut guard = param.storage().write();
        let Buffer::Cuda(to) = &mut *guard else {
            unreachable!("parameters were checked to be on a GPU");
        };
        let Some(upload) = slot.upload.as_mut() else {
            return Err(invalid(
                "OffloadAdamW",
                format!("parameter {i} has no stepped weights to upload"),
            ));
        };
        to.copy_from_pinned_async_at(offset, upload, &self.up)?;
        if let Some(staging) = &self.staging {
            // Free once the copy queued just now has finished.
            if let Some(upload) = slot.upload.take() {
                staging.uploads.give_back(Retired::Upload(upload));
            }
        }
        let mut timeline = self.timeline.lock();
        let done = Instant::now();
        timeline.stepped = Some(done);
        timeline.queuing += done - queuing;
        Ok(())
    }

    pub(super) fn note(&self, err: TensorError) {
        self.error.lock().get_or_insert_with(|| err.to_string());
    }
}

fn unlanded(i: usize) -> TensorError {
    invalid(
        "OffloadAdamW",
        format!(
            "parameter {i} was handed over with no landing buffer: call `wait_landing({i})` \
             before copying its gradient into `landing({i})`"
        ),
    )
}

/// A landing buffer's bytes as the gradient of a parameter of `dtype` (f32, bf16 or f16).
fn landed_grad(dtype: DType, bytes: &[u8]) -> GradSlice<'_> {
    match dtype {
        DType::BF16 => GradSlice::Bf16(bytemuck::cast_slice::<u8, bf16>(bytes)),
        DType::F16 => GradSlice::F16(bytemuck::cast_slice::<u8, f16>(bytes)),
        _ => GradSlice::F32(bytemuck::cast_slice::<u8, f32>(bytes)),
    }
}

/// The worker: steps each parameter whose gradient was sent, in the order they were sent, on
/// the cores of `pool`, and hands it to the uploader.
pub(super) fn work(
    shared: &Shared,
    landed: &Receiver<Sent>,
    stepped: &Sender<Upload>,
    pool: &rayon::ThreadPool,
) {
    while let Ok(sent) = landed.recv() {
        let i = sent.index;
        if matches!(sent.job, Job::Land | Job::LandInPlace | Job::Spill) {
            let landed = pool.install(|| shared.land_one(&sent));
            // Its landing buffer is read, unless the gradient is held there until the step.
            let kept = sent.job == Job::LandInPlace && landed.is_ok();
            shared.settle(|f| {
                f.unread[i] &= kept;
                f.stepping -= 1;
            });
            if let Err(err) = landed {
                shared.note(err);
            }
            continue;
        }
        let delayed = shared.hyper.lock().delayed;
        let stepped_one = pool.install(|| shared.step_one(&sent));
        // Its landing buffer is read (or, after an error, never will be): the next gradient
        // may land in it.
        let read = match &stepped_one {
            Ok(read) => *read,
            Err(_) => {
                shared.slots[i].lock().in_landing = false;
                true
            }
        };
        if read {
            shared.settle(|f| f.unread[i] = false);
        }
        let outcome = match stepped_one {
            Err(err) => {
                shared.abandon(i, sent.t);
                Err(err)
            }
            Ok(_) if delayed => {
                let uploaded = shared.stepped_delayed(i, sent.t, stepped);
                shared.finish_one();
                uploaded
            }
            Ok(_) => stepped.send(Upload::Stepped(i)).map_err(|_| {
                shared.finish_one();
                invalid("OffloadAdamW", "the upload thread has ended".into())
            }),
        };
        if let Err(err) = outcome {
            shared.note(err);
        }
    }
}

/// What the upload thread is handed.
pub(super) enum Upload {
    /// A parameter just stepped (without the delayed update): its step is done once queued.
    Stepped(usize),
    /// Delayed update: a parameter's held-back weights, released by backward, to go up after
    /// the event when there is one.
    Released(usize, Option<Event>),
}

/// The uploader: queues each upload it is handed.
pub(super) fn upload_each(shared: &Shared, uploads: &Receiver<Upload>) {
    while let Ok(upload) = uploads.recv() {
        let outcome = match upload {
            Upload::Stepped(i) => {
                let uploaded = shared.upload_one(i);
                shared.finish_one();
                uploaded
            }
            Upload::Released(i, after) => shared.upload_released(i, after),
        };
        if let Err(err) = outcome {
            shared.note(err);
        }
    }
}
