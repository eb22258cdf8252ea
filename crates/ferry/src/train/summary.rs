//! What a run did.

use std::time::Duration;

use super::error::Skipped;
use super::history::EpochStats;

/// What a run did.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    /// Every epoch so far, including those of the run resumed from.
    pub history: Vec<EpochStats>,
    /// Epochs trained by this run.
    pub trained_now: usize,
    /// The task's score of the final model ([`Task::evaluate`](super::Task::evaluate), with
    /// the averaged weights when the run keeps an average).
    pub test_accuracy: f64,
    /// Epoch files a resume passed over because they could not be used, newest first.
    pub skipped: Vec<Skipped>,
    /// Time the training loop spent waiting for its batches (in the loader's `next()`).
    pub data_wait: Duration,
    /// Time of the training loops themselves (batches and steps, not checkpoints or tests).
    pub loop_time: Duration,
}
