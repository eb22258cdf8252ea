//! The run directory's part in a run, apart from the loop: where the run starts (fresh,
//! cleared or resumed, the exported model put right), a checkpoint after the steps that
//! [`Trainer::checkpoint_every`](super::Trainer::checkpoint_every) names, one at each epoch's
//! end, and waiting for the last one. The loop tells it where it is; it decides what to write.

use std::path::Path;

use ferry_tensor::rng_state;

use super::Start;
use super::error::TrainError;
use super::history::EpochStats;
use super::mark::MidEpoch;
use super::run_dir::{Resumed, RunDir, RunSave, RunState};
use crate::nn::Module;
use crate::optim::{Ema, Optimizer};

/// A run's checkpoints: none without a directory.
pub(super) struct Checkpointing {
    dir: Option<RunDir>,
    keep: usize,
    every: usize,
    /// The last checkpoint's files, written while training goes on.
    writing: Option<RunSave>,
}

impl Checkpointing {
    /// Opens `dir` (if any) as `start` asks, keeping the newest `keep` checkpoints and writing
    /// one every `every` steps of the run too (0: at epoch ends only); returns it with the
    /// checkpoint resumed from. Every replica resumes, so models and optimizers start equal;
    /// only the `lead` one deletes or writes files.
    #[allow(clippy::too_many_arguments)]
    pub fn open(
        dir: Option<&Path>,
        keep: usize,
        every: usize,
        start: Start,
        lead: bool,
        model: &mut dyn Module,
        opt: &mut dyn Optimizer,
        mut ema: Option<&mut Ema>,
    ) -> Result<(Self, Option<Resumed>), TrainError> {
        let dir = dir.map(RunDir::create).transpose()?;
        let mut resumed = None;
        match (&dir, start) {
            (None, _) => {}
            (Some(dir), Start::Fresh) => dir.check_empty()?,
            (Some(dir), Start::Overwrite) if lead => dir.clear()?,
            (Some(_), Start::Overwrite) => {}
            (Some(dir), Start::Resume) => resumed = dir.resume(model, opt, ema.as_deref_mut())?,
        }
        // Resumed from an epoch's end: its export may be an earlier epoch's (a kill between
        // the epoch's two files), and nothing else rewrites it if no epoch is left to train.
        // Its header says which epoch it holds: rewritten only when that is not this one.
        if let (Some(dir), Some(r), true) = (&dir, &resumed, lead)
            && r.within.is_none()
            && !r.history.is_empty()
            && !dir.export_is_of(r.history.len())
        {
            dir.export(&*model, ema.as_deref(), r.history.len())?;
        }
        let checkpointing = Self {
            dir,
            keep,
            every,
            writing: None,
        };
        Ok((checkpointing, resumed))
    }

    /// After step `step` (from 1) of `epoch`, of `steps` per epoch, with the epoch's running
    /// `sums` so far: a checkpoint inside the epoch when the run's step count is a multiple of
    /// `every` (the epoch's last step is followed by the epoch's own checkpoint instead).
    #[allow(clippy::too_many_arguments)]
    pub fn on_step_end(
        &mut self,
        epoch: usize,
        step: usize,
        steps: usize,
        sums: [f64; 3],
        state: RunState<'_>,
        history: &[EpochStats],
    ) -> Result<(), TrainError> {
        let taken = (epoch - 1) * steps + step;
        let due = self.every > 0 && taken.is_multiple_of(self.every) && step < steps;
        let Some(dir) = self.dir.as_ref().filter(|_| due) else {
            return Ok(());
        };
        let at = MidEpoch {
            epoch,
            steps: step,
            sums,
            rng: rng_state(),
        };
        dir.next(&mut self.writing, self.keep, |d| {
            d.save_within(&at, state, history)
        })
    }

    /// After `epoch` was measured (`history` ends with it): its checkpoint and the exported
    /// model, written in the background once the previous checkpoint is in place.
    pub fn on_epoch_end(
        &mut self,
        epoch: usize,
        state: RunState<'_>,
        history: &[EpochStats],
    ) -> Result<(), TrainError> {
        let Some(dir) = &self.dir else {
            return Ok(());
        };
        dir.next(&mut self.writing, self.keep, |d| {
            d.save_epoch(epoch, state, history)
        })
    }

    /// Waits until the last checkpoint's files are in place and older ones rotated.
    pub fn finish(self) -> Result<(), TrainError> {
        match (&self.dir, self.writing) {
            (Some(dir), Some(last)) => dir.finish(last, self.keep),
            _ => Ok(()),
        }
    }
}
