//! What a run trains on: a [`Task`] gives each epoch's batches, the loss of a batch and the
//! score after an epoch. The model and the optimizer are the caller's.

use std::ops::Range;

use ferry_tensor::{DType, Result, Tensor};

use crate::nn::Module;

/// A batch as the host assembled it: inputs and targets.
pub type HostBatch = (Tensor, Tensor);

/// The data and the objective of a run.
pub trait Task {
    /// Optimizer steps (batches) in one epoch.
    fn steps_per_epoch(&self) -> usize;

    /// The batches of epoch `epoch` (from 1), whole, on the host, in the order they train.
    /// Draw every random choice (a shuffle, random windows) from `seed`, the epoch's seed
    /// ([`epoch_seed`]): a resumed run then repeats what an uninterrupted one would have done.
    /// A data-parallel replica trains its share of each batch (see [`share`]).
    fn batches(&self, epoch: usize, seed: u64) -> Box<dyn Iterator<Item = Result<HostBatch>> + '_>;

    /// The loss of `model` on inputs `x` with targets `y` (on the run's device), recorded for
    /// backward.
    fn loss(&self, model: &dyn Module, x: &Tensor, y: &Tensor) -> Result<Scored> {
        Scored::cross_entropy(&model.forward(x)?, y)
    }

    /// The score after an epoch, e.g. accuracy on held-out data: the run records it as
    /// [`EpochStats::test_accuracy`](super::EpochStats::test_accuracy). With a moving average
    /// of the weights, the model holds the averages while this runs.
    fn evaluate(&self, model: &mut dyn Module) -> Result<f64>;
}

/// A batch's mean loss (recorded), and how many of its predictions were right.
pub struct Scored {
    /// Mean loss over the batch's predictions, with its graph.
    pub loss: Tensor,
    /// Right predictions (an f32 scalar, detached, still on the device: nothing synchronizes).
    pub correct: Tensor,
    /// Predictions the loss averages over: rows, or rows times positions for a sequence.
    pub predictions: usize,
}

impl Scored {
    /// Cross-entropy of `logits` (`[N, C]`, or `[.., C]`, flattened to rows) against class
    /// indices `targets` (`[N]`, or the leading shape of `logits`), and the count of rows whose
    /// largest logit is the target.
    pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Self> {
        let (logits, targets) = if logits.ndim() > 2 {
            let classes = *logits.shape().last().expect("ndim > 2");
            let rows = logits.numel() / classes.max(1);
            (logits.reshape(&[rows, classes])?, targets.reshape(&[rows])?)
        } else {
            (logits.clone(), targets.clone())
        };
        let loss = crate::nn::cross_entropy(&logits, &targets)?;
        let correct = logits
            .detach()
            .argmax(1, false)?
            .eq(&targets)?
            .to_dtype(DType::F32)?
            .sum()?;
        Ok(Self {
            loss,
            correct,
            predictions: targets.shape()[0],
        })
    }
}

/// The seed of epoch `epoch` of a run seeded `seed`: shuffles, random windows and dropout
/// masks depend on (seed, epoch) only.
pub fn epoch_seed(seed: u64, epoch: usize) -> u64 {
    seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Rows of a batch of `len` that replica `rank` of `world` takes: contiguous, sizes differing
/// by at most one.
pub fn share(len: usize, rank: usize, world: usize) -> Range<usize> {
    let at = |r: usize| r * len / world;
    at(rank)..at(rank + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_the_batch_once() {
        for (len, world) in [(32, 2), (28, 3), (5, 4), (1, 1)] {
            let mut next = 0;
            for rank in 0..world {
                let r = share(len, rank, world);
                assert_eq!(r.start, next);
                assert!(r.len().abs_diff(len / world) <= 1);
                next = r.end;
            }
            assert_eq!(next, len);
        }
    }
}
