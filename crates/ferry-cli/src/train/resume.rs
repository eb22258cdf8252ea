//! Epoch checkpoints: writing them, and finding the newest one that loads for `--resume`.
//!
//! A bad newest file (truncated by a crash, damaged on disk, unreadable) does not end the run:
//! `--resume` falls back to the newest good one and says which files it skipped and why. Only
//! when none is good is it an error, naming the directory and every file tried.

use std::error::Error;
use std::path::{Path, PathBuf};

use ferry::checkpoint::Checkpoint;
use ferry::nn::Module;
use ferry::optim::{Ema, Optimizer};
use ferry::with_no_grad;

use super::EpochStats;

/// An epoch file `--resume` passed over, and why.
#[derive(Debug, Clone)]
pub struct Skipped {
    /// The file.
    pub path: PathBuf,
    /// Its epoch.
    pub epoch: usize,
    /// Why it could not be used.
    pub reason: String,
}

/// What an epoch file saves: the model, its optimizer and the moving average of the weights,
/// if the run keeps one.
#[derive(Clone, Copy)]
pub(super) struct RunState<'a> {
    pub model: &'a dyn Module,
    pub opt: &'a dyn Optimizer,
    pub ema: Option<&'a Ema>,
}

/// Where a resumed run starts.
#[derive(Debug)]
pub struct Resumed {
    /// The epoch file loaded.
    pub path: PathBuf,
    /// Every epoch so far, from its metadata.
    pub history: Vec<EpochStats>,
    /// Newer epoch files that could not be used.
    pub skipped: Vec<Skipped>,
}

pub(super) fn epoch_file(dir: &Path, epoch: usize) -> PathBuf {
    dir.join(format!("epoch-{epoch:03}.safetensors"))
}

/// The `epoch-NNN.safetensors` files in `dir`, newest first.
fn epoch_files(dir: &Path) -> Result<Vec<(usize, PathBuf)>, Box<dyn Error>> {
    let entries =
        std::fs::read_dir(dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
        let name = entry.file_name();
        let epoch = name.to_str().and_then(|n| {
            n.strip_prefix("epoch-")?
                .strip_suffix(".safetensors")?
                .parse::<usize>()
                .ok()
        });
        if let Some(epoch) = epoch {
            found.push((epoch, entry.path()));
        }
    }
    found.sort_by(|a, b| b.cmp(a));
    Ok(found)
}

/// Deletes all but the newest `keep` epoch files of `dir` (none when `keep` is 0: every epoch
/// is kept). Files newer than `epoch` (left by a longer run into the same directory) count as
/// newer and are kept too. Returns the files deleted.
pub(super) fn prune_epochs(dir: &Path, keep: usize) -> Result<Vec<PathBuf>, Box<dyn Error>> {
    if keep == 0 {
        return Ok(Vec::new());
    }
    let mut deleted = Vec::new();
    for (_, path) in epoch_files(dir)?.into_iter().skip(keep) {
        std::fs::remove_file(&path)
            .map_err(|e| format!("cannot delete the old checkpoint {}: {e}", path.display()))?;
        deleted.push(path);
    }
    Ok(deleted)
}

/// Loads the newest epoch file of `dir` that is whole and fits `model`, `opt` and `ema`; `None`
/// when `dir` has no epoch file. A file that fails leaves all three as they were, and the next
/// older one is tried.
pub fn resume(
    dir: &Path,
    model: &mut dyn Module,
    opt: &mut dyn Optimizer,
    mut ema: Option<&mut Ema>,
) -> Result<Option<Resumed>, Box<dyn Error>> {
    let mut skipped = Vec::new();
    for (epoch, path) in epoch_files(dir)? {
        match restore(&path, epoch, model, opt, ema.as_deref_mut()) {
            Ok(history) => {
                return Ok(Some(Resumed {
                    path,
                    history,
                    skipped,
                }));
            }
            Err(reason) => skipped.push(Skipped {
                path,
                epoch,
                reason,
            }),
        }
    }
    if skipped.is_empty() {
        return Ok(None);
    }
    Err(format!(
        "no usable checkpoint in {} to resume from; tried, newest first:{}\nremove or repair these files, or run without --resume to start afresh",
        dir.display(),
        skipped
            .iter()
            .map(|s| format!("\n  - {}: {}", s.path.display(), s.reason))
            .collect::<String>()
    )
    .into())
}

/// Writes the epoch file (model under `model.`, optimizer under `optimizer.`, the moving
/// average, if any, under `ema.`, the history in the metadata) and `model.safetensors`: the
/// model alone, PyTorch's key names, with the averaged weights when there is an `ema` (the
/// weights the test accuracy was measured with).
pub(super) fn save_epoch(
    dir: &Path,
    epoch: usize,
    state: RunState<'_>,
    history: &[EpochStats],
) -> Result<(), Box<dyn Error>> {
    let RunState { model, opt, ema } = state;
    let mut ck = Checkpoint::new();
    ck.insert_section("model", model.state_dict());
    ck.insert_section("optimizer", opt.state_dict());
    if let Some(ema) = ema {
        ck.insert_section("ema", ema.state_dict());
    }
    ck.set_metadata("epoch", epoch.to_string());
    ck.set_metadata("history", encode_history(history));
    ck.save(epoch_file(dir, epoch))?;
    ferry::checkpoint::save(dir.join("model.safetensors"), &shipped_state(model, ema))?;
    Ok(())
}

/// The model's state dict, with each parameter's average in its place when there is an `ema`
/// (built over `model.parameters()`, which follow `named_parameters()`'s order).
fn shipped_state(model: &dyn Module, ema: Option<&Ema>) -> ferry::StateDict {
    let mut state = model.state_dict();
    if let Some(ema) = ema {
        for ((name, _), average) in model.named_parameters().iter().zip(ema.averages()) {
            if let Some(entry) = state.iter_mut().find(|(k, _)| k == name) {
                entry.1 = average.detach();
            }
        }
    }
    state
}

#[cfg(test)]
mod prune_tests {
    use super::*;

    #[test]
    fn pruning_keeps_the_newest_files_and_zero_keeps_all() {
        let dir = tempfile::tempdir().unwrap();
        for epoch in 1..=5 {
            std::fs::write(epoch_file(dir.path(), epoch), b"x").unwrap();
        }
        std::fs::write(dir.path().join("model.safetensors"), b"x").unwrap();
        assert!(prune_epochs(dir.path(), 0).unwrap().is_empty());
        let deleted = prune_epochs(dir.path(), 2).unwrap();
        assert_eq!(deleted.len(), 3);
        let left: Vec<usize> = epoch_files(dir.path())
            .unwrap()
            .iter()
            .map(|(e, _)| *e)
            .collect();
        assert_eq!(left, vec![5, 4]);
        assert!(dir.path().join("model.safetensors").exists());
    }
}

/// Loads model and optimizer state from an epoch file: the file is verified and both are
/// checked before either changes. The error leaves out the file's name, which the caller gives.
fn restore(
    path: &Path,
    epoch: usize,
    model: &mut dyn Module,
    opt: &mut dyn Optimizer,
    ema: Option<&mut Ema>,
) -> Result<Vec<EpochStats>, String> {
    let ck = Checkpoint::load(path).map_err(|e| {
        let text = e.to_string();
        let named = format!("{}: ", path.display());
        text.strip_prefix(&named)
            .map_or(text.clone(), str::to_string)
    })?;
    let text = |e: &dyn std::fmt::Display| e.to_string();
    let history = decode_history(ck.metadata("history").unwrap_or(""))
        .ok_or("the history metadata is damaged")?;
    if history.len() != epoch {
        return Err(format!(
            "its history has {} epochs, its name says {epoch}",
            history.len()
        ));
    }
    let ema_state = ck.section("ema");
    match (&ema, ema_state.is_empty()) {
        (Some(_), true) => {
            return Err("it has no moving average of the weights (`ema.`), which --ema asks for; resume with --ema 0, or start afresh".into());
        }
        (None, false) => {
            return Err("it holds a moving average of the weights (`ema.`); resume with the --ema it was trained with".into());
        }
        _ => {}
    }
    let model_state = ck.section("model");
    ferry::nn::check_state("model", &model.named_parameters(), &model_state)
        .map_err(|e| text(&e))?;
    let before = model.state_dict();
    let snapshot = with_no_grad(|| {
        before
            .iter()
            .map(|(k, t)| Ok((k.clone(), t.copy()?)))
            .collect::<ferry::Result<Vec<_>>>()
    })
    .map_err(|e| text(&e))?;
    model.load_state_dict(&model_state).map_err(|e| text(&e))?;
    // The optimizer and the average check everything before changing anything; if either
    // fails, the model goes back, so a failed load changes nothing.
    let undo = |model: &mut dyn Module, e: &dyn std::fmt::Display| {
        model.load_state_dict(&snapshot).map_err(|e| text(&e))?;
        Err(text(e))
    };
    if let Some(ema) = &ema {
        let mut probe =
            Ema::new(ema.averages().iter().cloned(), ema.decay()).map_err(|e| text(&e))?;
        if let Err(e) = probe.load_state_dict(&ema_state) {
            return undo(model, &e);
        }
    }
    if let Err(e) = opt.load_state_dict(&ck.section("optimizer")) {
        return undo(model, &e);
    }
    if let Some(ema) = ema {
        ema.load_state_dict(&ema_state).map_err(|e| text(&e))?;
    }
    Ok(history)
}

fn encode_history(history: &[EpochStats]) -> String {
    history
        .iter()
        .map(|s| format!("{}:{}:{}", s.loss, s.train_accuracy, s.test_accuracy))
        .collect::<Vec<_>>()
        .join(";")
}

fn decode_history(text: &str) -> Option<Vec<EpochStats>> {
    if text.is_empty() {
        return Some(Vec::new());
    }
    text.split(';')
        .map(|e| {
            let mut parts = e.split(':').map(str::parse::<f64>);
            let stats = EpochStats {
                loss: parts.next()?.ok()?,
                train_accuracy: parts.next()?.ok()?,
                test_accuracy: parts.next()?.ok()?,
            };
            parts.next().is_none().then_some(stats)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_round_trips_through_metadata() {
        let h = vec![
            EpochStats {
                loss: 0.5,
                train_accuracy: 0.8,
                test_accuracy: 0.75,
            };
            3
        ];
        assert_eq!(decode_history(&encode_history(&h)).unwrap(), h);
        assert!(decode_history("0.5:0.1").is_none());
    }
}
