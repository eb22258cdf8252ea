//! What `ferry train` shows of a run: the progress bar, a line per epoch, the curves redrawn
//! after each checkpoint, warnings; and the trainer's errors in terms of the command's flags.

use ferry::debug::GraphLeak;
use ferry::train::{
    EpochEnd, Observer, ObserverError, Progress, Skipped, Started, TrainError, TrainSummary,
    Unusable,
};
use indicatif::{ProgressBar, ProgressStyle};

use super::TrainArgs;
use crate::plot;

/// The observer `ferry train` runs with; `line` formats an epoch's log line.
pub(super) struct Report<'a> {
    args: &'a TrainArgs,
    line: &'a dyn Fn(&EpochEnd<'_>) -> String,
    bar: ProgressBar,
}

impl<'a> Report<'a> {
    pub fn new(args: &'a TrainArgs, line: &'a dyn Fn(&EpochEnd<'_>) -> String) -> Self {
        Self {
            args,
            line,
            bar: ProgressBar::hidden(),
        }
    }

    fn curves(&self, history: &[ferry::train::EpochStats]) -> Result<(), ObserverError> {
        plot::curves(&self.args.out_dir().join("curves.png"), history)
            .map_err(|e| e.to_string().into())
    }
}

impl Observer for Report<'_> {
    fn started(&mut self, start: &Started<'_>) {
        match start.resumed {
            Some(resumed) => {
                warn_skipped(&resumed.skipped);
                let place = match &resumed.within {
                    Some(at) => format!("epoch {}, after step {}", at.epoch, at.steps),
                    None => format!("epoch {}", resumed.history.len()),
                };
                super::say(
                    self.args,
                    &format!("resuming from {} ({place})", resumed.path.display()),
                );
            }
            None if start.resume_asked => {
                super::say(self.args, "no checkpoint to resume from: starting fresh")
            }
            None => {}
        }
        let steps = (start.epochs.saturating_sub(start.done) * start.steps_per_epoch)
            .saturating_sub(start.steps_done);
        self.bar = progress_bar(self.args, steps as u64);
    }

    fn epoch_started(&mut self, epoch: usize, epochs: usize) {
        self.bar.set_prefix(format!("epoch {epoch}/{epochs}"));
    }

    fn stepped(&mut self, p: &Progress) {
        self.bar
            .set_message(format!("loss {:.4}  accuracy {:.4}", p.loss, p.accuracy));
        self.bar.inc(1);
    }

    fn epoch_ended(&mut self, end: &EpochEnd<'_>) -> Result<(), ObserverError> {
        self.curves(end.history)?;
        if !self.args.quiet {
            let line = (self.line)(end);
            self.bar.suspend(|| println!("{line}"));
        }
        Ok(())
    }

    fn leaked(&mut self, leak: &GraphLeak) {
        eprintln!("warning: {leak}");
    }

    fn finished(&mut self, summary: &TrainSummary) -> Result<(), ObserverError> {
        self.bar.finish_and_clear();
        if summary.history.is_empty() {
            return Ok(());
        }
        self.curves(&summary.history)
    }
}

fn progress_bar(args: &TrainArgs, len: u64) -> ProgressBar {
    if args.quiet {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    let style = ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed})")
        .expect("the template is valid")
        .progress_chars("=> ");
    bar.set_style(style);
    bar
}

/// Warns of each checkpoint `--resume` passed over: said even with `--quiet`, since a
/// checkpoint passed over is news the user needs.
fn warn_skipped(skipped: &[Skipped]) {
    for s in skipped {
        eprintln!(
            "warning: --resume skipped {} ({}): {}",
            s.path.display(),
            s.mark,
            reason(&s.reason)
        );
    }
}

/// Why a file could not be resumed from, with the flag that fixes it.
fn reason(unusable: &Unusable) -> String {
    match unusable {
        Unusable::AverageMissing => "it has no moving average of the weights (`ema.`), which --ema asks for; resume with --ema 0, or start afresh".into(),
        Unusable::AverageUnexpected => "it holds a moving average of the weights (`ema.`); resume with the --ema it was trained with".into(),
        other => other.to_string(),
    }
}

/// The trainer's error, its fix said with `ferry train`'s flags.
pub(super) fn explain(e: TrainError) -> String {
    match e {
        TrainError::RunExists { dir, newest } => format!(
            "{} holds another run (its newest checkpoint is {}); a fresh run would mix with it: continue it with --resume, train into another directory with --out DIR, or add --overwrite to delete its checkpoints and start afresh",
            dir.display(),
            newest.display()
        ),
        TrainError::NoUsableCheckpoint { dir, skipped } => format!(
            "no usable checkpoint in {} to resume from; tried, newest first:{}\nremove or repair these files, or run without --resume but with --overwrite to start afresh",
            dir.display(),
            skipped
                .iter()
                .map(|s| format!("\n  - {}: {}", s.path.display(), reason(&s.reason)))
                .collect::<String>()
        ),
        other => other.to_string(),
    }
}
