//! Where in a run a checkpoint was taken, and how that reads in its file name and metadata.
//!
//! At an epoch's end: `epoch-003.safetensors` (the epoch measured, in the history). Inside an
//! epoch, with [`Trainer::checkpoint_every`](super::Trainer::checkpoint_every):
//! `epoch-003-step-00050.safetensors`, after 50 steps of epoch 3, whose metadata also carries
//! the epoch's running sums and the tensor generator's state ([`MidEpoch`]), so a resume from
//! it repeats what an uninterrupted run does.

use std::cmp::Ordering;

use ferry_tensor::RngState;

use crate::checkpoint::Checkpoint;

/// A checkpoint's place in its run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mark {
    /// The epoch (from 1).
    pub epoch: usize,
    /// Steps of the epoch taken, for a checkpoint inside it; `None` at its end.
    pub step: Option<usize>,
}

impl Mark {
    /// At the end of `epoch`.
    pub fn end_of(epoch: usize) -> Self {
        Self { epoch, step: None }
    }

    /// Epochs finished before it.
    pub fn epochs_done(self) -> usize {
        match self.step {
            None => self.epoch,
            Some(_) => self.epoch - 1,
        }
    }

    /// Its file's name.
    pub fn file_name(self) -> String {
        match self.step {
            None => format!("epoch-{:03}.safetensors", self.epoch),
            Some(step) => format!("epoch-{:03}-step-{step:05}.safetensors", self.epoch),
        }
    }

    /// The mark a checkpoint's file name says, `None` for any other file.
    pub fn parse(name: &str) -> Option<Self> {
        let stem = name.strip_prefix("epoch-")?.strip_suffix(".safetensors")?;
        let number = |s: &str| {
            s.bytes()
                .all(|b| b.is_ascii_digit())
                .then(|| s.parse().ok())?
        };
        let (epoch, step) = match stem.split_once("-step-") {
            Some((epoch, step)) => (epoch, Some(number(step)?)),
            None => (stem, None),
        };
        Some(Self {
            epoch: number(epoch).filter(|&e| e > 0)?,
            step,
        })
    }
}

impl Ord for Mark {
    /// Earlier in the run first: inside an epoch, its end, the next epoch.
    fn cmp(&self, other: &Self) -> Ordering {
        let key = |m: &Mark| (m.epoch, m.step.unwrap_or(usize::MAX));
        key(self).cmp(&key(other))
    }
}

impl PartialOrd for Mark {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl std::fmt::Display for Mark {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.step {
            None => write!(f, "the end of epoch {}", self.epoch),
            Some(step) => write!(f, "epoch {}, step {step}", self.epoch),
        }
    }
}

/// Where a run stood inside an epoch when a checkpoint was taken there: what the checkpoint
/// holds beyond the model, the optimizer and the finished epochs' history.
#[derive(Debug, Clone, PartialEq)]
pub struct MidEpoch {
    /// The epoch (from 1).
    pub epoch: usize,
    /// Its steps taken.
    pub steps: usize,
    /// Its running sums: loss times predictions, correct predictions, predictions.
    pub sums: [f64; 3],
    /// The tensor generator's state after the last step taken: the next dropout mask.
    pub rng: RngState,
}

impl MidEpoch {
    /// Its checkpoint's place in the run.
    pub fn mark(&self) -> Mark {
        Mark {
            epoch: self.epoch,
            step: Some(self.steps),
        }
    }

    /// Writes itself into a checkpoint's metadata.
    pub(super) fn record(&self, ck: &mut Checkpoint) {
        ck.set_metadata("step", self.steps.to_string());
        let [loss, correct, seen] = self.sums;
        // f64's Display reads back to the same value.
        ck.set_metadata("sums", format!("{loss} {correct} {seen}"));
        ck.set_metadata("rng", self.rng.to_string());
    }

    /// Reads what [`MidEpoch::record`] wrote into the checkpoint of `mark`; why not, if
    /// anything is missing, damaged or disagrees with the mark.
    pub(super) fn read(ck: &Checkpoint, mark: Mark) -> Result<Self, String> {
        let Some(steps) = mark.step else {
            return Err("an epoch's end holds no mid-epoch state".into());
        };
        let field = |key: &str| {
            ck.metadata(key)
                .ok_or_else(|| format!("its metadata has no `{key}`"))
        };
        let written: usize = field("step")?
            .parse()
            .map_err(|_| "its `step` metadata is not a number".to_string())?;
        if written != steps {
            return Err(format!(
                "its metadata says step {written}, its name {steps}"
            ));
        }
        let sums: Vec<f64> = field("sums")?
            .split(' ')
            .map(str::parse)
            .collect::<Result<_, _>>()
            .map_err(|_| "its `sums` metadata is damaged".to_string())?;
        let sums: [f64; 3] = sums
            .try_into()
            .map_err(|_| "its `sums` metadata is damaged".to_string())?;
        let rng = field("rng")?
            .parse()
            .map_err(|_| "its `rng` metadata is damaged".to_string())?;
        Ok(Self {
            epoch: mark.epoch,
            steps,
            sums,
            rng,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_order_by_place_in_the_run() {
        let marks = [
            Mark::end_of(2),
            Mark {
                epoch: 3,
                step: Some(50),
            },
            Mark {
                epoch: 3,
                step: Some(5),
            },
            Mark::end_of(3),
            Mark::end_of(12),
        ];
        for mark in marks {
            assert_eq!(Mark::parse(&mark.file_name()), Some(mark));
        }
        let mut sorted = marks;
        sorted.sort();
        assert_eq!(sorted, [marks[0], marks[2], marks[1], marks[3], marks[4]]);
        assert_eq!(marks[1].file_name(), "epoch-003-step-00050.safetensors");
        assert_eq!((marks[1].epochs_done(), marks[3].epochs_done()), (2, 3));
    }

    #[test]
    fn other_names_are_not_checkpoints() {
        for name in [
            "model.safetensors",
            "epoch-.safetensors",
            "epoch-000.safetensors",
            "epoch-+3.safetensors",
            "epoch-003-step-.safetensors",
            "epoch-003-step-7.tmp",
            ".epoch-003.safetensors.1.tmp",
        ] {
            assert_eq!(Mark::parse(name), None, "{name}");
        }
    }

    #[test]
    fn mid_epoch_state_round_trips_through_metadata() {
        ferry_tensor::manual_seed(5);
        let at = MidEpoch {
            epoch: 4,
            steps: 17,
            sums: [0.1 + 0.2, 1e-300, 3.0],
            rng: ferry_tensor::rng_state(),
        };
        let mut ck = Checkpoint::new();
        at.record(&mut ck);
        assert_eq!(MidEpoch::read(&ck, at.mark()), Ok(at.clone()));
        let elsewhere = Mark {
            epoch: 4,
            step: Some(18),
        };
        let err = MidEpoch::read(&ck, elsewhere).unwrap_err();
        assert!(err.contains("step 17, its name 18"), "{err}");
        ck.set_metadata("sums", "1 2");
        let err = MidEpoch::read(&ck, at.mark()).unwrap_err();
        assert!(err.contains("`sums`"), "{err}");
    }
}
