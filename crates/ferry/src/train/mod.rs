//! A training loop: [`Trainer`] runs epochs of a [`Task`] (its batches, loss and score) on a
//! model and an optimizer the caller builds, with what a run needs around the steps:
//!
//! - **seeding**: epoch `e` of a run seeded `s` draws its batches from [`epoch_seed`]`(s, e)`
//!   and seeds the tensor generator (dropout masks) with it, so a resumed run repeats what an
//!   uninterrupted one would have done;
//! - **input**: host batches reach the device through a [`DeviceLoader`] keeping
//!   [`Trainer::prefetch`] batches in flight while a step computes;
//! - **learning rate**: any [`LrSchedule`], counted in epochs or in steps ([`Every`]);
//! - **clipping** of the gradients' global norm, and a **moving average** of the weights
//!   ([`Ema`]) that the score is measured with;
//! - **checkpoints**: each epoch `epoch-NNN.safetensors` and `model.safetensors` in the run's
//!   directory (with [`Trainer::checkpoint_every`], also `epoch-NNN-step-KKKKK.safetensors`
//!   inside epochs), written in the background while training goes on, older ones rotated
//!   beyond [`Trainer::checkpoints`]' `keep`, and a **resume** from the newest one that loads
//!   ([`Start`]), inside an epoch too; a fresh run refuses a directory holding another run;
//! - **the leak watch**: after each epoch the graph must be back to its size before the first
//!   step (a [`GraphWatch`]);
//! - **data parallelism** over a [`ProcessGroup`]: each replica trains its share of every
//!   batch, gradients averaged; rank 0 measures, checkpoints and reports.
//!
//! Key decision: the trainer prints and draws nothing. Progress bars, log lines and curves
//! belong to the caller, through an [`Observer`]; the history they are drawn from is the
//! trainer's ([`EpochStats`], kept in every checkpoint).
//!
//! ```
//! use ferry::nn::{Linear, Module};
//! use ferry::optim::{Adam, Constant};
//! use ferry::prelude::*;
//! use ferry::train::{Every, HostBatch, Task, Trainer};
//!
//! /// y = 2x + 1 from 64 points, in batches of 16.
//! struct Line;
//! impl Task for Line {
//!     fn steps_per_epoch(&self) -> usize {
//!         4
//!     }
//!     fn batches(&self, _epoch: usize, _seed: u64) -> Box<dyn Iterator<Item = ferry::Result<HostBatch>> + '_> {
//!         Box::new((0..4).map(|b| {
//!             let x: Vec<f32> = (0..16).map(|i| (b * 16 + i) as f32 / 64.0).collect();
//!             let y: Vec<f32> = x.iter().map(|x| 2.0 * x + 1.0).collect();
//!             Ok((Tensor::from_vec(x, &[16, 1])?, Tensor::from_vec(y, &[16, 1])?))
//!         }))
//!     }
//!     fn loss(&self, model: &dyn Module, x: &Tensor, y: &Tensor) -> ferry::Result<ferry::train::Scored> {
//!         let loss = model.forward(x)?.sub(y)?.powf(2.0)?.mean()?;
//!         let correct = Tensor::scalar(0.0f32);
//!         Ok(ferry::train::Scored { loss, correct, predictions: x.shape()[0] })
//!     }
//!     fn evaluate(&self, model: &mut dyn Module) -> ferry::Result<f64> {
//!         let x = Tensor::from_vec(vec![0.5f32], &[1, 1])?;
//!         with_no_grad(|| model.forward(&x)?.item())
//!     }
//! }
//!
//! ferry::manual_seed(0);
//! let mut model = Linear::new(1, 1, Device::Cpu)?;
//! let mut opt = Adam::new(model.parameters(), 0.05)?;
//! let summary = Trainer::new(60, Device::Cpu)
//!     .schedule(Constant::new(0.05)?, Every::Epoch)
//!     .fit(&mut model, &mut opt, None, &Line, &mut ())?;
//! assert_eq!(summary.history.len(), 60);
//! assert!(summary.history[59].loss < summary.history[0].loss / 10.0);
//! assert!((summary.test_accuracy - 2.0).abs() < 0.1, "f(0.5) = {}", summary.test_accuracy);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod checkpointing;
mod error;
mod history;
mod mark;
mod observe;
mod run_dir;
mod summary;
mod task;

pub use error::{Skipped, TrainError, Unusable};
pub use history::EpochStats;
pub use mark::{Mark, MidEpoch};
pub use observe::{EpochEnd, Observer, ObserverError, Progress, Started};
pub use run_dir::{MODEL_FILE, Resumed};
pub use summary::TrainSummary;
pub use task::{HostBatch, Scored, Task, epoch_seed, share};

use std::cell::RefCell;
use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::Duration;

use ferry_tensor::{Device, Tensor, set_rng_state};
use ferry_transfer::{DEFAULT_IN_FLIGHT, DeviceLoader, DeviceMove};

use crate::debug::GraphWatch;
use crate::distributed::{DataParallel, DdpOptions, ProcessGroup, ReduceOp};
use crate::nn::Module;
use crate::optim::{Ema, LrSchedule, Optimizer};
use checkpointing::Checkpointing;
use run_dir::RunState;

/// How a run with a checkpoint directory begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Start {
    /// A new run: refused ([`TrainError::RunExists`]) if the directory holds another run.
    #[default]
    Fresh,
    /// Continue from the newest epoch file that loads (a new run if there is none), up to the
    /// trainer's epochs in total.
    Resume,
    /// A new run, after deleting the checkpoints of any run in the directory.
    Overwrite,
}

/// What a learning-rate schedule's step counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Every {
    /// Epochs: epoch `e` (from 1) trains at `lr(e - 1)`.
    Epoch,
    /// Optimizer steps of the whole run: step `k` of epoch `e` trains at
    /// `lr((e - 1) · steps_per_epoch + k)`.
    Step,
}

/// A training run's settings; [`Trainer::fit`] runs it.
pub struct Trainer {
    epochs: usize,
    device: Device,
    seed: u64,
    prefetch: usize,
    dir: Option<PathBuf>,
    keep: usize,
    every: usize,
    start: Start,
    schedule: Option<(Box<dyn LrSchedule>, Every)>,
    clip: Option<f64>,
    group: Option<ProcessGroup>,
}

impl Trainer {
    /// `epochs` epochs in all (counting those a resume finds done) on `device`, where the model
    /// is: seed 0, [`DEFAULT_IN_FLIGHT`] batches prefetched, no checkpoints, the optimizer's
    /// own learning rate, no clipping.
    pub fn new(epochs: usize, device: Device) -> Self {
        Self {
            epochs,
            device,
            seed: 0,
            prefetch: DEFAULT_IN_FLIGHT,
            dir: None,
            keep: 0,
            every: 0,
            start: Start::Fresh,
            schedule: None,
            clip: None,
            group: None,
        }
    }

    /// The run's seed (see the module docs; the model's initial weights are the caller's).
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Batches kept in flight to the device while a step computes (0: each batch moves when
    /// the step asks for it, blocking).
    pub fn prefetch(mut self, batches: usize) -> Self {
        self.prefetch = batches;
        self
    }

    /// Checkpoints each epoch into `dir` (created if missing), keeping the newest `keep` epoch
    /// files (0 keeps them all); `model.safetensors` is always the latest.
    pub fn checkpoints(mut self, dir: impl Into<PathBuf>, keep: usize) -> Self {
        self.dir = Some(dir.into());
        self.keep = keep;
        self
    }

    /// Also checkpoints inside epochs, after every `steps` optimizer steps of the run (counted
    /// from its first step; 0, the default: at epoch ends only), rotated with the epoch files.
    /// Such a checkpoint also holds the epoch's running figures and the tensor generator's
    /// state, and a resume from it skips the epoch's batches already taken: the run goes on
    /// exactly as an uninterrupted one does. Each is written in the background while training
    /// goes on; the next one waits for it. Needs [`Trainer::checkpoints`]; not with
    /// [`Trainer::data_parallel`] yet.
    pub fn checkpoint_every(mut self, steps: usize) -> Self {
        self.every = steps;
        self
    }

    /// How the run begins in its checkpoint directory.
    pub fn start(mut self, start: Start) -> Self {
        self.start = start;
        self
    }

    /// Sets the learning rate from `schedule` before each epoch or each step.
    pub fn schedule(mut self, schedule: impl LrSchedule + 'static, every: Every) -> Self {
        self.schedule = Some((Box::new(schedule), every));
        self
    }

    /// Scales the gradients down to a global L2 norm of at most `max_norm` before each update
    /// ([`Optimizer::clip_grad_norm`]).
    pub fn clip_grad_norm(mut self, max_norm: f64) -> Self {
        self.clip = Some(max_norm);
        self
    }

    /// Trains as one replica of `group` (on its device): each batch is split between the
    /// replicas ([`share`]) and their gradients averaged.
    pub fn data_parallel(mut self, group: ProcessGroup) -> Self {
        self.device = group.device();
        self.group = Some(group);
        self
    }

    /// Trains `model` with `opt` (and `ema`, updated after each step and measured with) on
    /// `task`, telling `observer` as it goes. Build the optimizer and the average after moving
    /// the model to the trainer's device.
    pub fn fit(
        mut self,
        model: &mut dyn Module,
        opt: &mut dyn Optimizer,
        mut ema: Option<&mut Ema>,
        task: &dyn Task,
        observer: &mut dyn Observer,
    ) -> Result<TrainSummary, TrainError> {
        let (rank, world) = self
            .group
            .as_ref()
            .map_or((0, 1), |g| (g.rank(), g.world_size()));
        let lead = rank == 0;
        if self.every > 0 && world > 1 {
            return Err(TrainError::Settings(
                "checkpoints inside epochs (checkpoint_every) do not combine with data parallelism yet: each replica's dropout stream would have to be saved too; checkpoint at epoch ends, or train on one device".into(),
            ));
        }
        let (mut checkpoints, resumed) = Checkpointing::open(
            self.dir.as_deref(),
            self.keep,
            self.every,
            self.start,
            lead,
            model,
            opt,
            ema.as_deref_mut(),
        )?;
        let (mut history, skipped, mut within) = resumed
            .as_ref()
            .map_or((Vec::new(), Vec::new(), None), |r: &Resumed| {
                (r.history.clone(), r.skipped.clone(), r.within.clone())
            });
        let ddp = match self.group.take() {
            Some(group) => Some(DataParallel::new(
                model.parameters(),
                group,
                DdpOptions::default(),
            )?),
            None => None,
        };
        let done = history.len();
        let steps = task.steps_per_epoch();
        if lead {
            observer.started(&Started {
                resumed: resumed.as_ref(),
                resume_asked: self.start == Start::Resume,
                done,
                steps_done: within.as_ref().map_or(0, |w| w.steps),
                epochs: self.epochs,
                steps_per_epoch: steps,
            });
        }
        let (mut data_wait, mut loop_time) = (Duration::ZERO, Duration::ZERO);
        // Parameters and their leaves are in the baseline; every step must give back what it made.
        let watch = GraphWatch::new(&model.parameters());
        for epoch in done + 1..=self.epochs {
            if lead {
                observer.epoch_started(epoch, self.epochs);
            }
            if let Some((schedule, Every::Epoch)) = &self.schedule {
                opt.set_learning_rate(schedule.lr((epoch - 1) as u64));
            }
            let seed = epoch_seed(self.seed, epoch);
            ferry_tensor::manual_seed(seed ^ rank as u64);
            // Resumed inside this epoch: its first steps were taken, and their figures and
            // the generator's state after them were saved.
            let resume_here = within.take_if(|w| w.epoch == epoch);
            let skip = resume_here.as_ref().map_or(0, |w| w.steps);
            let [mut loss_sum, mut correct, mut seen] = [0.0; 3];
            if let Some(at) = &resume_here {
                set_rng_state(&at.rng);
                [loss_sum, correct, seen] = at.sums;
            }
            let wholes = RefCell::new(VecDeque::new());
            let host = replica_batches(task.batches(epoch, seed).skip(skip), rank, world, &wholes);
            let mut loader = DeviceLoader::from_results(host, self.device).in_flight(self.prefetch);
            for (k, batch) in (skip..).zip(loader.by_ref()) {
                let (x, y) = batch?;
                let whole = wholes.borrow_mut().pop_front().expect("one size per batch");
                if let Some((schedule, Every::Step)) = &self.schedule {
                    opt.set_learning_rate(schedule.lr(((epoch - 1) * steps + k) as u64));
                }
                let scored = self.step(model, opt, task, ddp.as_ref(), &x, &y, whole)?;
                if let Some(ema) = ema.as_deref_mut() {
                    ema.update()?;
                }
                let n = scored.predictions as f64;
                loss_sum += scored.loss.item()? * n;
                correct += scored.correct.item()?;
                seen += n;
                if lead {
                    observer.stepped(&Progress {
                        epoch,
                        step: k + 1,
                        loss: loss_sum / seen,
                        accuracy: correct / seen,
                    });
                }
                let state = RunState::new(&*model, &*opt, ema.as_deref());
                let sums = [loss_sum, correct, seen];
                checkpoints.on_step_end(epoch, k + 1, steps, sums, state, &history)?;
            }
            if let Some(ddp) = &ddp {
                [loss_sum, correct, seen] = totals(ddp.group(), [loss_sum, correct, seen])?;
            }
            let loaded = loader.stats();
            (data_wait, loop_time) = (data_wait + loaded.waited, loop_time + loaded.elapsed);
            if let Err(leak) = watch.check() {
                observer.leaked(&leak);
            }
            if !lead {
                continue;
            }
            let stats = EpochStats {
                loss: loss_sum / seen,
                train_accuracy: correct / seen,
                test_accuracy: evaluate(model, ema.as_deref_mut(), task)?,
            };
            history.push(stats);
            let state = RunState::new(&*model, &*opt, ema.as_deref());
            checkpoints.on_epoch_end(epoch, state, &history)?;
            observer
                .epoch_ended(&EpochEnd {
                    epoch,
                    epochs: self.epochs,
                    stats,
                    history: &history,
                    dir: self.dir.as_deref(),
                })
                .map_err(TrainError::Observer)?;
        }
        checkpoints.finish()?;
        let summary = TrainSummary {
            trained_now: history.len().saturating_sub(done),
            test_accuracy: evaluate(model, ema, task)?,
            history,
            skipped,
            data_wait,
            loop_time,
        };
        if lead {
            observer.finished(&summary).map_err(TrainError::Observer)?;
        }
        Ok(summary)
    }

    /// One step on this replica's `x`, `y` of a batch of `whole` rows: forward, loss, backward,
    /// (gradients averaged, clipped), update. Nothing of its graph outlives it.
    #[allow(clippy::too_many_arguments)]
    fn step(
        &self,
        model: &dyn Module,
        opt: &mut dyn Optimizer,
        task: &dyn Task,
        ddp: Option<&DataParallel>,
        x: &Tensor,
        y: &Tensor,
        whole: usize,
    ) -> Result<Scored, TrainError> {
        opt.zero_grad();
        let scored = task.loss(model, x, y)?;
        match ddp {
            None => {
                scored.loss.backward()?;
            }
            Some(ddp) => {
                // Scaled by rows · world / whole, so that averaging the replicas' gradients
                // gives the gradient of the whole batch's mean loss even when shares differ.
                let weight = (x.shape()[0] * ddp.group().world_size()) as f64 / whole as f64;
                scored.loss.mul_scalar(weight)?.backward()?;
                ddp.finish()?;
            }
        }
        if let Some(max_norm) = self.clip {
            // The optimizer's own: an offloaded one holds the gradients in host memory.
            opt.clip_grad_norm(max_norm)?;
        }
        opt.step()?;
        Ok(Scored {
            loss: scored.loss.detach(),
            ..scored
        })
    }
}

/// The task's score of `model`, with the averaged weights when there is an `ema`.
fn evaluate(
    model: &mut dyn Module,
    ema: Option<&mut Ema>,
    task: &dyn Task,
) -> Result<f64, TrainError> {
    Ok(match ema {
        Some(ema) => ema.with_averages(|| task.evaluate(model))??,
        None => task.evaluate(model)?,
    })
}

/// This replica's share of each of `batches` (the whole of each on one device), each whole
/// batch's rows pushed to `wholes` in order: a replica's loss is weighted by its share of each.
fn replica_batches<'a>(
    batches: impl Iterator<Item = ferry_tensor::Result<HostBatch>> + 'a,
    rank: usize,
    world: usize,
    wholes: &'a RefCell<VecDeque<usize>>,
) -> impl Iterator<Item = ferry_tensor::Result<HostBatch>> + 'a {
    batches.map(move |batch| {
        let (x, y) = batch?;
        let rows = x.shape()[0];
        wholes.borrow_mut().push_back(rows);
        if world == 1 {
            return Ok((x, y));
        }
        let r = share(rows, rank, world);
        Ok((
            x.narrow(0, r.start, r.len())?,
            y.narrow(0, r.start, r.len())?,
        ))
    })
}

/// The sums over every replica of an epoch's figures.
fn totals(group: &ProcessGroup, figures: [f64; 3]) -> Result<[f64; 3], TrainError> {
    let t = Tensor::from_vec(figures.to_vec(), &[3])?.to(group.device())?;
    group.all_reduce(&t, ReduceOp::Sum)?;
    let v = t.to_vec_f64()?;
    Ok([v[0], v[1], v[2]])
}

#[cfg(test)]
mod tests;
