//! What can stop a run: its directory holds another run, no checkpoint can be resumed from,
//! a file operation, a tensor op or a checkpoint failed.

use std::fmt;
use std::path::PathBuf;

use ferry_tensor::TensorError;

use super::mark::Mark;
use crate::checkpoint::CheckpointError;

/// Why a [`Trainer`](super::Trainer) run stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// A fresh run was asked for in a directory that holds another run's checkpoints. Nothing
    /// was changed: a fresh run there would write over them, and rotation would delete its own
    /// files in favour of the other run's.
    #[error(
        "{} holds another run (its newest checkpoint is {}); a fresh run would mix with it: resume it (`Start::Resume`), train into another directory, or start afresh and delete its checkpoints (`Start::Overwrite`)",
        dir.display(),
        newest.display()
    )]
    RunExists {
        /// The directory.
        dir: PathBuf,
        /// Its newest checkpoint (an epoch file, or the exported model).
        newest: PathBuf,
    },
    /// A resume found checkpoints, and none of them could be used.
    #[error(
        "no usable checkpoint in {} to resume from; tried, newest first:{}\nremove or repair these files, or start afresh (`Start::Overwrite`)",
        dir.display(),
        skipped.iter().map(|s| format!("\n  - {}: {}", s.path.display(), s.reason)).collect::<String>()
    )]
    NoUsableCheckpoint {
        /// The directory.
        dir: PathBuf,
        /// Every checkpoint tried, newest first, and why it failed.
        skipped: Vec<Skipped>,
    },
    /// A file or directory of the run could not be created, listed or deleted.
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        /// What was being done: "create", "list", "delete".
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Saving a checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// A step, an evaluation or a collective failed.
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// Settings that do not go together; the message names them.
    #[error("{0}")]
    Settings(String),
    /// The [`Observer`](super::Observer) stopped the run (drawing curves, say, failed).
    #[error("{0}")]
    Observer(Box<dyn std::error::Error + Send + Sync>),
}

/// A checkpoint a resume passed over, and why.
#[derive(Debug, Clone)]
pub struct Skipped {
    /// The file.
    pub path: PathBuf,
    /// Its place in the run.
    pub mark: Mark,
    /// Why it could not be used.
    pub reason: Unusable,
}

/// Why a checkpoint could not be resumed from. Nothing was changed by trying it.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Unusable {
    /// The file did not load (truncated, damaged, unreadable): the loader's message, without
    /// the file's name.
    Damaged(String),
    /// Its history (or, inside an epoch, its place there) is missing, unreadable, or
    /// disagrees with its name.
    History(String),
    /// The run keeps a moving average of the weights, and the file has none.
    AverageMissing,
    /// The file holds a moving average of the weights, and the run keeps none.
    AverageUnexpected,
    /// The model's, the optimizer's or the average's state does not fit.
    State(String),
}

impl fmt::Display for Unusable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unusable::Damaged(text) | Unusable::History(text) | Unusable::State(text) => {
                f.write_str(text)
            }
            Unusable::AverageMissing => f.write_str(
                "it has no moving average of the weights (`ema.`), which this run keeps; resume without one, or start afresh",
            ),
            Unusable::AverageUnexpected => f.write_str(
                "it holds a moving average of the weights (`ema.`), which this run does not keep; resume with the average it was trained with",
            ),
        }
    }
}
