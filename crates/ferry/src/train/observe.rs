//! What a run tells its caller as it goes: where it starts, each step's running figures, each
//! epoch's end (after its checkpoint), graph leaks, and its end. A progress bar, log lines and
//! curves are drawn by an [`Observer`]; the trainer itself prints nothing.

use std::error::Error;
use std::path::Path;

use super::history::EpochStats;
use super::run_dir::Resumed;
use super::summary::TrainSummary;
use crate::debug::GraphLeak;

/// An error an observer stops the run with.
pub type ObserverError = Box<dyn Error + Send + Sync>;

/// Where a run starts.
#[derive(Debug, Clone, Copy)]
pub struct Started<'a> {
    /// The checkpoint resumed from, if the run resumed from one.
    pub resumed: Option<&'a Resumed>,
    /// Whether a resume was asked for (`resumed` is `None` when there was nothing to resume).
    pub resume_asked: bool,
    /// Epochs done before this run (0 unless resumed).
    pub done: usize,
    /// Steps of epoch `done + 1` taken before this run (a resume from inside it).
    pub steps_done: usize,
    /// Epochs in all.
    pub epochs: usize,
    /// Steps per epoch.
    pub steps_per_epoch: usize,
}

/// The running figures of an epoch, after a step.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    /// The epoch (from 1).
    pub epoch: usize,
    /// Steps of the epoch taken so far (from 1).
    pub step: usize,
    /// Mean loss over the epoch's predictions so far (this replica's).
    pub loss: f64,
    /// Accuracy over the epoch's predictions so far (this replica's).
    pub accuracy: f64,
}

/// An epoch just ended: measured; its checkpoint is being written in the background (in place,
/// and older ones rotated, by the next epoch's end or when `fit` returns).
#[derive(Debug, Clone, Copy)]
pub struct EpochEnd<'a> {
    /// The epoch (from 1).
    pub epoch: usize,
    /// Epochs in all.
    pub epochs: usize,
    /// Its figures.
    pub stats: EpochStats,
    /// Every epoch so far, this one last.
    pub history: &'a [EpochStats],
    /// The run's checkpoint directory, if it keeps checkpoints.
    pub dir: Option<&'a Path>,
}

/// Hooks into a run. Every method does nothing unless implemented; `()` is an observer that
/// ignores everything. In a data-parallel run only rank 0 hears of starts, steps and epochs
/// (it measures, checkpoints and reports); every rank hears of its graph leaks.
pub trait Observer {
    /// Before the first epoch, after any resume.
    fn started(&mut self, _start: &Started<'_>) {}

    /// Before each epoch's first step.
    fn epoch_started(&mut self, _epoch: usize, _epochs: usize) {}

    /// After each step.
    fn stepped(&mut self, _progress: &Progress) {}

    /// After each epoch's checkpoint; an error stops the run.
    fn epoch_ended(&mut self, _end: &EpochEnd<'_>) -> Result<(), ObserverError> {
        Ok(())
    }

    /// After an epoch whose steps left nodes or saved tensors in the graph. A warning, not
    /// an error: the graph is process-wide, and other threads may be using it.
    fn leaked(&mut self, _leak: &GraphLeak) {}

    /// After the final evaluation; an error fails the run.
    fn finished(&mut self, _summary: &TrainSummary) -> Result<(), ObserverError> {
        Ok(())
    }
}

impl Observer for () {}
