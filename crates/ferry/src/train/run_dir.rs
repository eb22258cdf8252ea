//! A run's directory: one `epoch-NNN.safetensors` per epoch (model under `model.`, optimizer
//! under `optimizer.`, the moving average, if any, under `ema.`, the history in the metadata),
//! `model.safetensors` (the model alone, with the averaged weights when there is an average),
//! rotation of old epoch files, and resuming from the newest one that loads.
//!
//! A directory holds one run. A fresh run refuses a directory with another run's checkpoints
//! (or deletes them first, when asked), so rotation only ever sees the run's own files; and
//! rotation never deletes the file just written, nor counts files of later epochs against it.

use std::path::{Path, PathBuf};

use ferry_tensor::with_no_grad;
use ferry_transfer::StateDict;

use super::error::{Skipped, TrainError, Unusable};
use super::history::{self, EpochStats};
use crate::checkpoint::{AsyncSaveOptions, Checkpoint, PendingSave};
use crate::nn::Module;
use crate::optim::{Ema, Optimizer};

/// The file the model alone goes to, each epoch.
pub const MODEL_FILE: &str = "model.safetensors";

/// What an epoch file saves: the model, its optimizer and the moving average of the weights,
/// if the run keeps one.
#[derive(Clone, Copy)]
pub(super) struct RunState<'a> {
    pub model: &'a dyn Module,
    pub opt: &'a dyn Optimizer,
    pub ema: Option<&'a Ema>,
}

/// Where a resumed run starts.
#[derive(Debug, Clone)]
pub struct Resumed {
    /// The epoch file loaded.
    pub path: PathBuf,
    /// Every epoch so far, from its metadata.
    pub history: Vec<EpochStats>,
    /// Newer epoch files that could not be used.
    pub skipped: Vec<Skipped>,
}

/// An epoch's files being written (see [`RunDir::save_epoch`]).
#[must_use = "an epoch's files are only known to be in place once `RunDir::finish` returns"]
pub(super) struct EpochSave {
    epoch: usize,
    files: [PendingSave; 2],
}

/// The checkpoint directory of a run.
#[derive(Debug, Clone)]
pub(super) struct RunDir {
    dir: PathBuf,
}

fn io<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> TrainError + 'a {
    move |source| TrainError::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

impl RunDir {
    /// `dir`, created if it does not exist.
    pub fn create(dir: &Path) -> Result<Self, TrainError> {
        std::fs::create_dir_all(dir).map_err(io("create", dir))?;
        Ok(Self {
            dir: dir.to_path_buf(),
        })
    }

    pub fn epoch_file(&self, epoch: usize) -> PathBuf {
        self.dir.join(format!("epoch-{epoch:03}.safetensors"))
    }

    /// The `epoch-NNN.safetensors` files, newest first.
    pub fn epoch_files(&self) -> Result<Vec<(usize, PathBuf)>, TrainError> {
        let list = io("list", &self.dir);
        let mut found = Vec::new();
        for entry in std::fs::read_dir(&self.dir).map_err(list)? {
            let entry = entry.map_err(io("list", &self.dir))?;
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

    /// Refuses a directory holding another run (an epoch file or the exported model).
    pub fn check_empty(&self) -> Result<(), TrainError> {
        let newest = match self.epoch_files()?.into_iter().next() {
            Some((_, path)) => Some(path),
            None => Some(self.dir.join(MODEL_FILE)).filter(|p| p.exists()),
        };
        match newest {
            Some(newest) => Err(TrainError::RunExists {
                dir: self.dir.clone(),
                newest,
            }),
            None => Ok(()),
        }
    }

    /// Deletes another run's checkpoints: every epoch file and the exported model.
    pub fn clear(&self) -> Result<(), TrainError> {
        let model = self.dir.join(MODEL_FILE);
        let files = self.epoch_files()?.into_iter().map(|(_, p)| p);
        for path in files.chain(model.exists().then_some(model.clone())) {
            std::fs::remove_file(&path).map_err(io("delete", &path))?;
        }
        Ok(())
    }

    /// After epoch `written` was saved: deletes epoch files older than it beyond the newest
    /// `keep` up to it (none when `keep` is 0: every epoch is kept). Files of later epochs (a
    /// resume passed over them as damaged; the run writes them anew as it gets there) are left
    /// and do not count. Returns the files deleted.
    pub fn rotate(&self, written: usize, keep: usize) -> Result<Vec<PathBuf>, TrainError> {
        if keep == 0 {
            return Ok(Vec::new());
        }
        let mut deleted = Vec::new();
        let older = self
            .epoch_files()?
            .into_iter()
            .filter(|&(e, _)| e <= written);
        for (epoch, path) in older.skip(keep) {
            debug_assert!(epoch < written, "the file just written is the newest kept");
            std::fs::remove_file(&path).map_err(io("delete", &path))?;
            deleted.push(path);
        }
        Ok(deleted)
    }

    /// Starts writing the epoch file and the exported model (the model alone, PyTorch's key
    /// names, with the averaged weights when there is an `ema`: the weights the score was
    /// measured with) in the background, with `save_async`: training goes on at once, and an
    /// in-place write to a tensor not yet copied (the next step's update) waits for its copy.
    /// [`RunDir::finish`] waits for them.
    pub fn save_epoch(
        &self,
        epoch: usize,
        state: RunState<'_>,
        history: &[EpochStats],
    ) -> Result<EpochSave, TrainError> {
        let RunState { model, opt, ema } = state;
        let mut ck = Checkpoint::new();
        ck.insert_section("model", model.state_dict());
        ck.insert_section("optimizer", opt.state_dict());
        if let Some(ema) = ema {
            ck.insert_section("ema", ema.state_dict());
        }
        ck.set_metadata("epoch", epoch.to_string());
        ck.set_metadata("history", history::encode(history));
        let epoch_file = ck.save_async(self.epoch_file(epoch), AsyncSaveOptions::default())?;
        let model_file = Checkpoint::from_tensors(shipped_state(model, ema))
            .save_async(self.dir.join(MODEL_FILE), AsyncSaveOptions::default())?;
        Ok(EpochSave {
            epoch,
            files: [epoch_file, model_file],
        })
    }

    /// Waits until an epoch's files are in place, then deletes older epoch files beyond the
    /// newest `keep` (see [`RunDir::rotate`]).
    pub fn finish(&self, save: EpochSave, keep: usize) -> Result<(), TrainError> {
        let [epoch_file, model_file] = save.files;
        epoch_file.wait()?;
        model_file.wait()?;
        self.rotate(save.epoch, keep)?;
        Ok(())
    }

    /// Loads the newest epoch file that is whole and fits `model`, `opt` and `ema`; `None`
    /// when there is no epoch file. A file that fails leaves all three as they were, and the
    /// next older one is tried.
    pub fn resume(
        &self,
        model: &mut dyn Module,
        opt: &mut dyn Optimizer,
        mut ema: Option<&mut Ema>,
    ) -> Result<Option<Resumed>, TrainError> {
        let mut skipped = Vec::new();
        for (epoch, path) in self.epoch_files()? {
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
        Err(TrainError::NoUsableCheckpoint {
            dir: self.dir.clone(),
            skipped,
        })
    }
}

/// The model's state dict, with each parameter's average in its place when there is an `ema`
/// (built over `model.parameters()`, which follow `named_parameters()`'s order).
fn shipped_state(model: &dyn Module, ema: Option<&Ema>) -> StateDict {
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

/// Loads model, optimizer and average from an epoch file: the file is verified and all three
/// are checked before any changes.
fn restore(
    path: &Path,
    epoch: usize,
    model: &mut dyn Module,
    opt: &mut dyn Optimizer,
    ema: Option<&mut Ema>,
) -> Result<Vec<EpochStats>, Unusable> {
    let ck = Checkpoint::load(path).map_err(|e| {
        let text = e.to_string();
        let named = format!("{}: ", path.display());
        Unusable::Damaged(
            text.strip_prefix(&named)
                .map_or(text.clone(), str::to_string),
        )
    })?;
    let state = |e: &dyn std::fmt::Display| Unusable::State(e.to_string());
    let history = history::decode(ck.metadata("history").unwrap_or(""))
        .ok_or_else(|| Unusable::History("the history metadata is damaged".into()))?;
    if history.len() != epoch {
        return Err(Unusable::History(format!(
            "its history has {} epochs, its name says {epoch}",
            history.len()
        )));
    }
    let ema_state = ck.section("ema");
    match (&ema, ema_state.is_empty()) {
        (Some(_), true) => return Err(Unusable::AverageMissing),
        (None, false) => return Err(Unusable::AverageUnexpected),
        _ => {}
    }
    let model_state = ck.section("model");
    crate::nn::check_state("model", &model.named_parameters(), &model_state)
        .map_err(|e| state(&e))?;
    let before = model.state_dict();
    let snapshot = with_no_grad(|| {
        before
            .iter()
            .map(|(k, t)| Ok((k.clone(), t.copy()?)))
            .collect::<ferry_tensor::Result<Vec<_>>>()
    })
    .map_err(|e| state(&e))?;
    model.load_state_dict(&model_state).map_err(|e| state(&e))?;
    // The optimizer and the average check everything before changing anything; if either
    // fails, the model goes back, so a failed load changes nothing.
    let undo = |model: &mut dyn Module, e: &dyn std::fmt::Display| {
        model.load_state_dict(&snapshot).map_err(|e| state(&e))?;
        Err(state(e))
    };
    if let Some(ema) = &ema {
        let mut probe =
            Ema::new(ema.averages().iter().cloned(), ema.decay()).map_err(|e| state(&e))?;
        if let Err(e) = probe.load_state_dict(&ema_state) {
            return undo(model, &e);
        }
    }
    if let Err(e) = opt.load_state_dict(&ck.section("optimizer")) {
        return undo(model, &e);
    }
    if let Some(ema) = ema {
        ema.load_state_dict(&ema_state).map_err(|e| state(&e))?;
    }
    Ok(history)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with_epochs(epochs: impl IntoIterator<Item = usize>) -> (tempfile::TempDir, RunDir) {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunDir::create(tmp.path()).unwrap();
        for epoch in epochs {
            std::fs::write(run.epoch_file(epoch), b"x").unwrap();
        }
        (tmp, run)
    }

    fn left(run: &RunDir) -> Vec<usize> {
        run.epoch_files().unwrap().iter().map(|(e, _)| *e).collect()
    }

    #[test]
    fn rotation_keeps_the_newest_files_and_zero_keeps_all() {
        let (tmp, run) = dir_with_epochs(1..=5);
        std::fs::write(tmp.path().join(MODEL_FILE), b"x").unwrap();
        assert!(run.rotate(5, 0).unwrap().is_empty());
        assert_eq!(run.rotate(5, 2).unwrap().len(), 3);
        assert_eq!(left(&run), [5, 4]);
        assert!(tmp.path().join(MODEL_FILE).exists());
    }

    #[test]
    fn rotation_never_deletes_the_file_just_written() {
        // Epochs 6..10 are later files (passed over by a resume): epoch 3 was just written.
        let (_tmp, run) = dir_with_epochs([1, 2, 3, 6, 7, 8, 9, 10]);
        let deleted = run.rotate(3, 2).unwrap();
        assert_eq!(deleted, [run.epoch_file(1)]);
        assert_eq!(left(&run), [10, 9, 8, 7, 6, 3, 2]);
    }

    #[test]
    fn a_directory_holding_a_run_is_refused_until_cleared() {
        let (tmp, run) = dir_with_epochs([]);
        run.check_empty().unwrap();
        std::fs::write(tmp.path().join("notes.txt"), b"mine").unwrap();
        run.check_empty().unwrap();
        std::fs::write(tmp.path().join(MODEL_FILE), b"x").unwrap();
        assert!(matches!(
            run.check_empty(),
            Err(TrainError::RunExists { newest, .. }) if newest.ends_with(MODEL_FILE)
        ));
        std::fs::write(run.epoch_file(4), b"x").unwrap();
        std::fs::write(run.epoch_file(12), b"x").unwrap();
        let Err(TrainError::RunExists { newest, .. }) = run.check_empty() else {
            panic!("a directory with epoch files was taken as empty");
        };
        assert_eq!(newest, run.epoch_file(12));
        run.clear().unwrap();
        run.check_empty().unwrap();
        assert!(tmp.path().join("notes.txt").exists(), "only checkpoints go");
    }
}
