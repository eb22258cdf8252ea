//! Checkpoints inside epochs (`--checkpoint-every`): a resume from one repeats the run that
//! never stopped, and a run killed at any moment leaves only checkpoints that verify and ends,
//! resumed after each kill, where the uninterrupted run ends.

use std::path::Path;

use ferry::checkpoint;

use super::{Device, Task, TrainArgs, args, epoch_files, scratch, train};

/// The digits run of these tests: 3 epochs of 47 steps, a checkpoint every 10 steps.
fn every_ten(out: &Path) -> TrainArgs {
    TrainArgs {
        checkpoint_every: 10,
        ..args(out, 3)
    }
}

/// A tiny GPT's run on `device` (a GPU): 2 epochs of 12 steps, a checkpoint every 5 (after
/// steps 5 and 10 of epoch 1, 3 and 8 of epoch 2), the optimizer offloaded to the host (its
/// state saved from there).
fn gpt_every_five(out: &Path, device: Device) -> TrainArgs {
    TrainArgs {
        task: Task::Gpt,
        device,
        context: 16,
        width: 32,
        layers: 1,
        heads: 4,
        steps_per_epoch: 12,
        offload_optimizer: true,
        checkpoint_every: 5,
        ..args(out, 2)
    }
}

/// The tensors of a checkpoint file, by name, as f32 values.
fn weights(path: &Path) -> Vec<(String, Vec<f32>)> {
    let state = checkpoint::load(path).unwrap();
    let mut out: Vec<_> = state
        .into_iter()
        .map(|(k, t)| {
            (
                k,
                t.to_dtype(ferry::DType::F32)
                    .unwrap()
                    .to_vec::<f32>()
                    .unwrap(),
            )
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[test]
fn checkpoints_inside_epochs_are_written_and_rotated_with_the_epoch_files() {
    let out = scratch("every-keep");
    train(&TrainArgs {
        keep: 3,
        ..every_ten(&out)
    })
    .unwrap();
    // Steps 130 and 140 of the run are steps 36 and 46 of epoch 3; then its end.
    assert_eq!(
        epoch_files(&out),
        [
            "epoch-003-step-00036.safetensors",
            "epoch-003-step-00046.safetensors",
            "epoch-003.safetensors"
        ]
    );
    let verified = checkpoint::verify(out.join("epoch-003-step-00046.safetensors")).unwrap();
    assert!(verified.checksummed);
    std::fs::remove_dir_all(&out).ok();
}

/// How closely a resumed run must follow the straight one.
#[derive(Clone, Copy, PartialEq)]
enum Follows {
    /// Bit for bit.
    Exactly,
    /// To rounding: the run is not bit-reproducible itself (the GPT's embedding gradients are
    /// summed with atomics on the GPU, in whatever order the threads come).
    ToRounding,
}

/// Trains `run` straight, deletes every checkpoint after `stop` (as if the run had been
/// stopped there), resumes, and checks the resumed run ends as the straight one did.
fn a_resume_from(run: TrainArgs, stop: &str, last: &str, trained_now: usize, follows: Follows) {
    let out = run.out_dir();
    let straight = train(&run).unwrap();
    let finished = weights(&out.join(last));
    for name in epoch_files(&out).into_iter().filter(|n| n.as_str() > stop) {
        std::fs::remove_file(out.join(name)).unwrap();
    }
    let resumed = train(&TrainArgs {
        resume: true,
        ..run
    })
    .unwrap();
    assert_eq!(resumed.trained_now, trained_now);
    let resumed_weights = weights(&out.join(last));
    std::fs::remove_dir_all(&out).ok();
    if follows == Follows::Exactly {
        // The stopped epoch's figures join the steps before the stop (from the checkpoint)
        // with those after.
        assert_eq!(resumed.history, straight.history);
        assert_eq!(resumed.test_accuracy, straight.test_accuracy);
        // Same batches, dropout masks, weights and moments: the same model and optimizer.
        assert_eq!(resumed_weights, finished);
        return;
    }
    for (a, b) in resumed.history.iter().zip(&straight.history) {
        assert!((a.loss - b.loss).abs() < 1e-4, "{a:?} vs {b:?}");
        assert!(
            (a.test_accuracy - b.test_accuracy).abs() < 0.02,
            "{a:?} vs {b:?}"
        );
    }
    for ((name, a), (other, b)) in resumed_weights.iter().zip(&finished) {
        assert_eq!(name, other);
        let worst = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max);
        assert!(worst < 1e-4, "{name}: {worst}");
    }
}

#[test]
fn a_resume_inside_an_epoch_repeats_the_run_that_never_stopped() {
    // Stopped after step 60 of the run, step 13 of epoch 2: the rest of it, and epoch 3.
    let run = every_ten(&scratch("every-resume"));
    let (stop, last) = ("epoch-002-step-00013.safetensors", "epoch-003.safetensors");
    a_resume_from(run, stop, last, 2, Follows::Exactly);
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_resume_inside_an_epoch_repeats_the_run_that_never_stopped_on_cuda() {
    let run = TrainArgs {
        device: Device::Cuda(0),
        ..every_ten(&scratch("every-resume-cuda"))
    };
    let (stop, last) = ("epoch-002-step-00013.safetensors", "epoch-003.safetensors");
    a_resume_from(run, stop, last, 2, Follows::Exactly);
    // A GPT whose optimizer lives on the host: stopped after step 3 of epoch 2.
    let run = gpt_every_five(&scratch("every-resume-gpt"), Device::Cuda(0));
    let (stop, last) = ("epoch-002-step-00003.safetensors", "epoch-002.safetensors");
    a_resume_from(run, stop, last, 1, Follows::ToRounding);
}

/// A kill between an epoch's file and its export leaves the export of the epoch before: a
/// resume from that epoch's end writes it anew, even with nothing left to train.
#[test]
fn a_resume_rewrites_the_export_a_kill_left_behind() {
    let (out, earlier) = (scratch("export-behind"), scratch("export-behind-1"));
    train(&args(&out, 2)).unwrap();
    let exported = weights(&out.join("model.safetensors"));
    train(&args(&earlier, 1)).unwrap();
    std::fs::copy(
        earlier.join("model.safetensors"),
        out.join("model.safetensors"),
    )
    .unwrap();
    assert_ne!(weights(&out.join("model.safetensors")), exported);
    let resumed = train(&TrainArgs {
        resume: true,
        ..args(&out, 2)
    })
    .unwrap();
    assert_eq!(resumed.trained_now, 0);
    assert_eq!(weights(&out.join("model.safetensors")), exported);
    // The export now holds the last epoch (its header says so): a resume leaves it as it is.
    let meta = ferry::checkpoint::read_metadata(out.join("model.safetensors")).unwrap();
    assert_eq!(meta.get("epoch").map(String::as_str), Some("2"));
    let written = std::fs::metadata(out.join("model.safetensors"))
        .and_then(|m| m.modified())
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    train(&TrainArgs {
        resume: true,
        ..args(&out, 2)
    })
    .unwrap();
    let after = std::fs::metadata(out.join("model.safetensors"))
        .and_then(|m| m.modified())
        .unwrap();
    assert_eq!(after, written, "a current export was written again");
    std::fs::remove_dir_all(&out).ok();
    std::fs::remove_dir_all(&earlier).ok();
}

#[test]
fn checkpoints_inside_epochs_and_data_parallel_are_refused_together() {
    let out = scratch("every-ddp");
    let err = train(&TrainArgs {
        devices: vec![ferry::Device::Cpu, ferry::Device::Cpu],
        ..every_ten(&out)
    })
    .expect_err("mid-epoch checkpoints with replicas");
    assert!(err.to_string().contains("data parallelism"), "{err}");
    std::fs::remove_dir_all(&out).ok();
}

/// The run the kill test kills: 8 epochs of 47 steps, a checkpoint every 5, the newest 4 kept,
/// resumed if there is anything to resume.
fn killed_run(out: &Path) -> TrainArgs {
    TrainArgs {
        resume: true,
        checkpoint_every: 5,
        keep: 4,
        ..args(out, 8)
    }
}

/// Run in a child process by `a_run_killed_at_any_moment_resumes_to_the_uninterrupted_end`:
/// resumes the run in FERRY_TRAIN_KILL_DIR (or starts it) and trains it to its end, unless
/// killed first.
#[test]
#[ignore = "run by the kill test in a child process, which it kills"]
fn train_kill_child() {
    let Some(dir) = std::env::var_os("FERRY_TRAIN_KILL_DIR") else {
        return;
    };
    println!("FERRY_TRAINING");
    train(&killed_run(Path::new(&dir))).unwrap();
    println!("FERRY_TRAINED");
}

/// SIGKILL at many moments of `ferry train digits --checkpoint-every 5`, resumed after each
/// kill: every checkpoint left verifies, and the run ends with the weights, history and test
/// accuracy of the run that was never killed.
#[test]
#[cfg(unix)]
fn a_run_killed_at_any_moment_resumes_to_the_uninterrupted_end() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let straight_dir = scratch("kill-straight");
    let straight = train(&killed_run(&straight_dir)).unwrap();
    let dir = scratch("kill-resume");
    std::fs::create_dir_all(&dir).unwrap();
    let (mut kills, mut checked) = (0, 0);
    // Each one left by a save a kill cut short.
    let mut temporaries = std::collections::BTreeSet::new();
    let mut finished = false;
    // Starts in a row that left no newer checkpoint: on a loaded machine a child may need
    // longer than the shortest delays to get anywhere, so those grow until it does.
    let (mut newest, mut stuck) = (None, 0u64);
    for k in 0..400u64 {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--ignored", "--exact", "--nocapture"])
            .arg("train::tests::within_epoch::train_kill_child")
            .args(["--test-threads", "1"])
            .env("FERRY_TRAIN_KILL_DIR", &dir)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        assert!(lines.any(|l| l.is_ok_and(|l| l.contains("FERRY_TRAINING"))));
        // 0 to 40 ms after it starts (while it resumes, steps, or saves), and 20 ms more for
        // each start in a row that got nowhere.
        std::thread::sleep(std::time::Duration::from_millis(k * 7 % 41 + stuck * 20));
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap();
            kills += 1;
        }
        let status = child.wait().unwrap();
        for name in std::fs::read_dir(&dir).unwrap() {
            let name = name.unwrap().file_name().to_string_lossy().into_owned();
            if name.ends_with(".tmp") {
                temporaries.insert(name.clone());
            }
            if !name.ends_with(".safetensors") {
                continue; // a temporary, or the curves
            }
            checkpoint::verify(dir.join(&name))
                .unwrap_or_else(|e| panic!("after kill {k}: {name} does not verify: {e}"));
            checked += 1;
        }
        if status.success() {
            finished = true;
            break;
        }
        // Names sort as the run's places: `epoch-003-step-...` before `epoch-003.`.
        let now = epoch_files(&dir).pop();
        stuck = if now == newest { stuck + 1 } else { 0 };
        newest = now;
    }
    assert!(finished, "the run never got to its end in 400 starts");
    let resumed = train(&killed_run(&dir)).unwrap();
    assert_eq!(resumed.trained_now, 0);
    assert_eq!(resumed.history, straight.history);
    assert_eq!(resumed.test_accuracy, straight.test_accuracy);
    for file in ["epoch-008.safetensors", "model.safetensors"] {
        assert_eq!(
            weights(&dir.join(file)),
            weights(&straight_dir.join(file)),
            "{file}"
        );
    }
    println!(
        "{kills} kills, {checked} checkpoint files checked after them (all verified), {} \
         temporaries left by saves cut short; the resumed run ends as the uninterrupted one",
        temporaries.len()
    );
    assert!(kills >= 10, "{kills} kills");
    std::fs::remove_dir_all(&dir).ok();
    std::fs::remove_dir_all(&straight_dir).ok();
}
