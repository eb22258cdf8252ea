//! A run's directory: one `epoch-NNN.safetensors` per epoch (model under `model.`, optimizer
//! under `optimizer.`, the moving average, if any, under `ema.`, the history in the metadata),
//! with `checkpoint_every` also `epoch-NNN-step-KKKKK.safetensors` inside epochs (the same, and
//! the epoch's place: [`MidEpoch`]), `model.safetensors` (the model alone, with the averaged
//! weights when there is an average, each epoch), rotation of old checkpoints, and resuming
//! from the newest one that loads.
//!
//! A directory holds one run. A fresh run refuses a directory with another run's checkpoints
//! (or deletes them first, when asked), so rotation only ever sees the run's own files; and
//! rotation never deletes the file just written, nor counts later checkpoints against it.

use std::path::{Path, PathBuf};

use ferry_tensor::with_no_grad;
use ferry_transfer::StateDict;

use super::error::{Skipped, TrainError, Unusable};
use super::history::{self, EpochStats};
use super::mark::{Mark, MidEpoch};
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

impl<'a> RunState<'a> {
    pub fn new(model: &'a dyn Module, opt: &'a dyn Optimizer, ema: Option<&'a Ema>) -> Self {
        Self { model, opt, ema }
    }
}

/// Where a resumed run starts.
#[derive(Debug, Clone)]
pub struct Resumed {
    /// The checkpoint loaded.
    pub path: PathBuf,
    /// Every epoch finished so far, from its metadata.
    pub history: Vec<EpochStats>,
    /// Where inside an epoch, when the checkpoint was taken inside one.
    pub within: Option<MidEpoch>,
    /// Newer checkpoints that could not be used.
    pub skipped: Vec<Skipped>,
}

/// A checkpoint's files being written (see [`RunDir::save_epoch`]).
#[must_use = "a checkpoint's files are only known to be in place once `RunDir::finish` returns"]
pub(super) struct RunSave {
    mark: Mark,
    files: Vec<PendingSave>,
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

    pub fn file(&self, mark: Mark) -> PathBuf {
        self.dir.join(mark.file_name())
    }

    /// The run's checkpoints, at epoch ends and inside epochs, newest first.
    pub fn checkpoints(&self) -> Result<Vec<(Mark, PathBuf)>, TrainError> {
        let list = io("list", &self.dir);
        let mut found = Vec::new();
        for entry in std::fs::read_dir(&self.dir).map_err(list)? {
            let entry = entry.map_err(io("list", &self.dir))?;
            if let Some(mark) = entry.file_name().to_str().and_then(Mark::parse) {
                found.push((mark, entry.path()));
            }
        }
        found.sort_by_key(|(mark, _)| std::cmp::Reverse(*mark));
        Ok(found)
    }

    /// Refuses a directory holding another run (a checkpoint or the exported model).
    pub fn check_empty(&self) -> Result<(), TrainError> {
        let newest = match self.checkpoints()?.into_iter().next() {
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

    /// Deletes another run's checkpoints and its exported model.
    pub fn clear(&self) -> Result<(), TrainError> {
        let model = self.dir.join(MODEL_FILE);
        let files = self.checkpoints()?.into_iter().map(|(_, p)| p);
        for path in files.chain(model.exists().then_some(model.clone())) {
            std::fs::remove_file(&path).map_err(io("delete", &path))?;
        }
        Ok(())
    }

    /// After the checkpoint at `written` was saved: deletes older checkpoints (at epoch ends
    /// and inside epochs alike) beyond the newest `keep` up to it (none when `keep` is 0:
    /// every one is kept). Later checkpoints (a resume passed over them as damaged; the run
    /// writes them anew as it gets there) are left and do not count. Returns the files deleted.
    pub fn rotate(&self, written: Mark, keep: usize) -> Result<Vec<PathBuf>, TrainError> {
        if keep == 0 {
            return Ok(Vec::new());
        }
        let mut deleted = Vec::new();
        let older = self
            .checkpoints()?
            .into_iter()
            .filter(|&(m, _)| m <= written);
        for (mark, path) in older.skip(keep) {
            debug_assert!(mark < written, "the file just written is the newest kept");
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
    ) -> Result<RunSave, TrainError> {
        let mark = Mark::end_of(epoch);
        let epoch_file = run_checkpoint(mark, state, history)
            .save_async(self.file(mark), AsyncSaveOptions::default())?;
        let model_file = exported(state.model, state.ema, epoch)
            .save_async(self.dir.join(MODEL_FILE), AsyncSaveOptions::default())?;
        Ok(RunSave {
            mark,
            files: vec![epoch_file, model_file],
        })
    }

    /// Starts writing a checkpoint inside an epoch, `at` its place, in the background as
    /// [`RunDir::save_epoch`] does (the model is exported at epoch ends only).
    pub fn save_within(
        &self,
        at: &MidEpoch,
        state: RunState<'_>,
        history: &[EpochStats],
    ) -> Result<RunSave, TrainError> {
        let mut ck = run_checkpoint(at.mark(), state, history);
        at.record(&mut ck);
        let file = ck.save_async(self.file(at.mark()), AsyncSaveOptions::default())?;
        Ok(RunSave {
            mark: at.mark(),
            files: vec![file],
        })
    }

    /// Whether the exported model is the one of the end of `epoch` (its metadata says so; a
    /// file that cannot be read is not).
    pub fn export_is_of(&self, epoch: usize) -> bool {
        crate::checkpoint::read_metadata(self.dir.join(MODEL_FILE))
            .is_ok_and(|meta| meta.get("epoch") == Some(&epoch.to_string()))
    }

    /// Writes the exported model anew (and waits for it), from `model` and `ema` as a resume
    /// from the end of `epoch` restored them: the two files of an epoch land one after the
    /// other, so a run killed between them left the export of an earlier epoch.
    pub fn export(
        &self,
        model: &dyn Module,
        ema: Option<&Ema>,
        epoch: usize,
    ) -> Result<(), TrainError> {
        exported(model, ema, epoch).save(self.dir.join(MODEL_FILE))?;
        Ok(())
    }

    /// Waits for the checkpoint being written, if any (see [`RunDir::finish`]), then starts
    /// the next one with `save`: one checkpoint of the run is written at a time.
    pub fn next(
        &self,
        writing: &mut Option<RunSave>,
        keep: usize,
        save: impl FnOnce(&Self) -> Result<RunSave, TrainError>,
    ) -> Result<(), TrainError> {
        if let Some(previous) = writing.take() {
            self.finish(previous, keep)?;
        }
        *writing = Some(save(self)?);
        Ok(())
    }

    /// Waits until a checkpoint's files are in place, then deletes older checkpoints beyond
    /// the newest `keep` (see [`RunDir::rotate`]).
    pub fn finish(&self, save: RunSave, keep: usize) -> Result<(), TrainError> {
        for file in save.files {
            file.wait()?;
        }
        self.rotate(save.mark, keep)?;
        Ok(())
    }

    /// Loads the newest checkpoint that is whole and fits `model`, `opt` and `ema`; `None`
    /// when there is none. A file that fails leaves all three as they were, and the next
    /// older one is tried.
    pub fn resume(
        &self,
        model: &mut dyn Module,
        opt: &mut dyn Optimizer,
        mut ema: Option<&mut Ema>,
    ) -> Result<Option<Resumed>, TrainError> {
        let mut skipped = Vec::new();
        for (mark, path) in self.checkpoints()? {
            match restore(&path, mark, model, opt, ema.as_deref_mut()) {
                Ok((history, within)) => {
                    return Ok(Some(Resumed {
                        path,
                        history,
                        within,
                        skipped,
                    }));
                }
                Err(reason) => skipped.push(Skipped { path, mark, reason }),
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

/// What every checkpoint of a run holds: the model, the optimizer and the average in their
/// sections, its epoch and the finished epochs' history in the metadata.
fn run_checkpoint(mark: Mark, state: RunState<'_>, history: &[EpochStats]) -> Checkpoint {
    let RunState { model, opt, ema } = state;
    let mut ck = Checkpoint::new();
    ck.insert_section("model", model.state_dict());
    ck.insert_section("optimizer", opt.state_dict());
    if let Some(ema) = ema {
        ck.insert_section("ema", ema.state_dict());
    }
    ck.set_metadata("epoch", mark.epoch.to_string());
    ck.set_metadata("history", history::encode(history));
    ck
}

/// The exported model of the end of `epoch` (its number in the metadata).
fn exported(model: &dyn Module, ema: Option<&Ema>, epoch: usize) -> Checkpoint {
    let mut ck = Checkpoint::from_tensors(shipped_state(model, ema));
    ck.set_metadata("epoch", epoch.to_string());
    ck
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

/// Loads model, optimizer and average from the checkpoint at `mark`: the file is verified and
/// all three are checked before any changes. Returns the history, and the place inside an
/// epoch for a checkpoint taken inside one.
fn restore(
    path: &Path,
    mark: Mark,
    model: &mut dyn Module,
    opt: &mut dyn Optimizer,
    ema: Option<&mut Ema>,
) -> Result<(Vec<EpochStats>, Option<MidEpoch>), Unusable> {
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
    if history.len() != mark.epochs_done() {
        return Err(Unusable::History(format!(
            "its history has {} epochs, its name says {} were done",
            history.len(),
            mark.epochs_done()
        )));
    }
    let within = match mark.step {
        Some(_) => Some(MidEpoch::read(&ck, mark).map_err(Unusable::History)?),
        None => None,
    };
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
    Ok((history, within))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with_epochs(epochs: impl IntoIterator<Item = usize>) -> (tempfile::TempDir, RunDir) {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunDir::create(tmp.path()).unwrap();
        for epoch in epochs {
            std::fs::write(run.file(Mark::end_of(epoch)), b"x").unwrap();
        }
        (tmp, run)
    }

    fn left(run: &RunDir) -> Vec<usize> {
        let ends = run.checkpoints().unwrap().into_iter();
        ends.map(|(m, _)| m.epoch).collect()
    }

    #[test]
    fn rotation_keeps_the_newest_files_and_zero_keeps_all() {
        let (tmp, run) = dir_with_epochs(1..=5);
        std::fs::write(tmp.path().join(MODEL_FILE), b"x").unwrap();
        assert!(run.rotate(Mark::end_of(5), 0).unwrap().is_empty());
        assert_eq!(run.rotate(Mark::end_of(5), 2).unwrap().len(), 3);
        assert_eq!(left(&run), [5, 4]);
        assert!(tmp.path().join(MODEL_FILE).exists());
    }

    #[test]
    fn rotation_never_deletes_the_file_just_written() {
        // Epochs 6..10 are later files (passed over by a resume): epoch 3 was just written.
        let (_tmp, run) = dir_with_epochs([1, 2, 3, 6, 7, 8, 9, 10]);
        let deleted = run.rotate(Mark::end_of(3), 2).unwrap();
        assert_eq!(deleted, [run.file(Mark::end_of(1))]);
        assert_eq!(left(&run), [10, 9, 8, 7, 6, 3, 2]);
    }

    #[test]
    fn rotation_counts_checkpoints_inside_epochs_in_their_place() {
        let (tmp, run) = dir_with_epochs([1, 2]);
        let within = |epoch, step| Mark {
            epoch,
            step: Some(step),
        };
        for mark in [within(2, 10), within(3, 10), within(3, 20)] {
            std::fs::write(run.file(mark), b"x").unwrap();
        }
        std::fs::write(tmp.path().join("epoch-003-step-x.safetensors"), b"x").unwrap();
        let deleted = run.rotate(within(3, 10), 2).unwrap();
        let names: Vec<_> = deleted.iter().map(|p| p.file_name().unwrap()).collect();
        assert_eq!(
            names,
            ["epoch-002-step-00010.safetensors", "epoch-001.safetensors"]
        );
        let left: Vec<Mark> = run
            .checkpoints()
            .unwrap()
            .into_iter()
            .map(|(m, _)| m)
            .collect();
        assert_eq!(left, [within(3, 20), within(3, 10), Mark::end_of(2)]);
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
        std::fs::write(run.file(Mark::end_of(4)), b"x").unwrap();
        std::fs::write(run.file(Mark::end_of(12)), b"x").unwrap();
        let Err(TrainError::RunExists { newest, .. }) = run.check_empty() else {
            panic!("a directory with epoch files was taken as empty");
        };
        assert_eq!(newest, run.file(Mark::end_of(12)));
        run.clear().unwrap();
        run.check_empty().unwrap();
        assert!(tmp.path().join("notes.txt").exists(), "only checkpoints go");
    }
}
