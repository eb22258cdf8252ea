use std::path::Path;
use std::time::Duration;

use ferry::DeviceLoader;
use ferry::optim::Optimizer;
use rand::SeedableRng;
use rand::seq::SliceRandom;

use super::*;

mod within_epoch;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferry-train-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn args(out: &Path, epochs: usize) -> TrainArgs {
    TrainArgs {
        task: Task::Digits,
        device: Device::Cpu,
        epochs,
        out: Some(out.to_path_buf()),
        resume: false,
        overwrite: false,
        clip_grad_norm: None,
        batch_size: None,
        lr: None,
        seed: 0,
        weight_decay: 0.0,
        dropout: 0.5,
        constant_lr: false,
        ema: 0.0,
        data: None,
        quiet: true,
        prefetch: ferry::DEFAULT_IN_FLIGHT,
        devices: Vec::new(),
        keep: 0,
        checkpoint_every: 0,
        context: 64,
        width: 128,
        layers: 4,
        heads: 4,
        kv_heads: None,
        steps_per_epoch: 100,
        offload_optimizer: false,
        recompute: false,
        device_budget: None,
    }
}

/// A tiny GPT run of one epoch of two steps on `device`, optimizer offloaded.
fn offloaded_gpt(out: &Path, device: Device) -> TrainArgs {
    TrainArgs {
        task: Task::Gpt,
        device,
        context: 16,
        width: 32,
        layers: 1,
        heads: 4,
        steps_per_epoch: 2,
        offload_optimizer: true,
        ..args(out, 1)
    }
}

#[test]
fn offloading_the_optimizer_of_a_cpu_model_is_refused_naming_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let err = train(&offloaded_gpt(dir.path(), Device::Cpu))
        .unwrap_err()
        .to_string();
    assert!(err.contains("move the model to a GPU"), "{err}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_gpt_trains_with_its_optimizer_offloaded_and_clipped() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = offloaded_gpt(dir.path(), Device::Cuda(0));
    args.epochs = 2;
    let summary = train(&args).unwrap();
    assert_eq!(summary.trained_now, 2);
    let losses: Vec<f64> = summary.history.iter().map(|e| e.loss).collect();
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    // Clipping holds the gradients on the host until the step.
    let dir = tempfile::tempdir().unwrap();
    let mut args = offloaded_gpt(dir.path(), Device::Cuda(0));
    args.clip_grad_norm = Some(0.5);
    let summary = train(&args).unwrap();
    assert!(summary.history.iter().all(|e| e.loss.is_finite()));
}

/// `ferry train llama` at a tiny size on the CPU: three epochs of 25 steps lower the loss
/// from about ln(vocabulary) and lift the held-out next-character accuracy; a head count its
/// key/value heads do not divide is refused naming both.
#[test]
fn a_tiny_llama_learns_the_text_on_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let args = TrainArgs {
        task: Task::Llama,
        context: 16,
        width: 32,
        layers: 2,
        heads: 4,
        steps_per_epoch: 25,
        ..args(dir.path(), 3)
    };
    let summary = train(&args).unwrap();
    let losses: Vec<f64> = summary.history.iter().map(|e| e.loss).collect();
    assert_eq!(losses.len(), 3);
    assert!(losses[2] < losses[0] - 0.3, "{losses:?}");
    assert!(summary.test_accuracy > 0.15, "{}", summary.test_accuracy);
    let err = train(&TrainArgs {
        kv_heads: Some(3),
        ..args
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("--kv-heads 3") && err.contains("must divide"),
        "{err}"
    );
}

#[test]
fn embedded_digits_split_1500_297() {
    let (train, test) = load_digits(DIGITS_CSV_GZ).unwrap();
    assert_eq!((train.rows(), test.rows()), (1500, 297));
    assert!(train.x.iter().all(|v| (0.0..=1.0).contains(v)));
    assert_eq!(train.x.len(), 1500 * 64);
}

#[test]
fn digits_reaches_092_test_accuracy_on_cpu() {
    let out = scratch("accuracy");
    let summary = train(&args(&out, 40)).unwrap();
    assert!(
        summary.test_accuracy >= 0.92,
        "test accuracy {:.4} < 0.92; history {:?}",
        summary.test_accuracy,
        summary.history
    );
    assert_eq!(summary.history.len(), 40);
    assert!(out.join("epoch-040.safetensors").is_file());
    let png = std::fs::read(out.join("curves.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "curves.png is a PNG");
    std::fs::remove_dir_all(&out).ok();
}

#[test]
fn digits_cnn_reaches_097_test_accuracy_on_cpu() {
    let out = scratch("cnn-accuracy");
    let summary = train(&TrainArgs {
        task: Task::DigitsCnn,
        ..args(&out, 40)
    })
    .unwrap();
    assert!(summary.test_accuracy >= 0.97, "{:?}", summary.history);
    std::fs::remove_dir_all(&out).ok();
}

/// The default run (seed 0) on the GPU: weights drawn on the host as on the CPU, the same
/// shuffles and masks; rounding differs, so the runs part ways over 40 epochs and land at
/// other accuracies of the same spread (docs/training.md: the H200's seeds 0 to 7 gave 0.9529 to
/// 0.9798, and any change of a kernel's rounding moves seed 0 within it: 0.9764 before the fused
/// cross-entropy, 0.9697 after). So the GPU run is held to that spread, and to having reached
/// the goal on the way; that the GPU computes what the CPU does is
/// `models::the_digits_cnn_trains_alike_on_both_devices`'s to show.
#[test]
#[ignore = "needs a CUDA device"]
fn digits_cnn_trains_into_the_seeds_spread_on_cuda() {
    let out = scratch("cnn-accuracy-cuda");
    let summary = train(&TrainArgs {
        task: Task::DigitsCnn,
        device: Device::Cuda(0),
        ..args(&out, 40)
    })
    .unwrap();
    let best = summary
        .history
        .iter()
        .map(|e| e.test_accuracy)
        .fold(0.0, f64::max);
    assert!(summary.test_accuracy >= 0.95, "{:?}", summary.history);
    assert!(best >= 0.97, "{:?}", summary.history);
    std::fs::remove_dir_all(&out).ok();
}

#[test]
#[ignore = "needs a CUDA device"]
fn digits_reaches_092_test_accuracy_on_cuda() {
    let out = scratch("accuracy-cuda");
    let summary = train(&TrainArgs {
        device: Device::Cuda(0),
        ..args(&out, 40)
    })
    .unwrap();
    assert!(summary.test_accuracy >= 0.92, "{:?}", summary.history);
    std::fs::remove_dir_all(&out).ok();
}

/// Two replicas, each on half of every batch, averaging gradients: the run one device
/// makes, up to rounding (without dropout, whose masks differ per replica).
fn data_parallel_follows_the_one_device_run(devices: Vec<Device>, name: &str) {
    let single = train(&TrainArgs {
        device: devices[0],
        dropout: 0.0,
        ..args(&scratch(&format!("{name}-one")), 3)
    })
    .unwrap();
    let out = scratch(name);
    let parallel = train(&TrainArgs {
        devices,
        dropout: 0.0,
        ..args(&out, 3)
    })
    .unwrap();
    assert_eq!(parallel.history.len(), 3);
    for (p, s) in parallel.history.iter().zip(&single.history) {
        assert!((p.loss - s.loss).abs() <= 1e-3 * s.loss, "{p:?} vs {s:?}");
        assert!(
            (p.test_accuracy - s.test_accuracy).abs() <= 0.01,
            "{p:?} vs {s:?}"
        );
    }
    assert!(out.join("epoch-003.safetensors").exists());
    std::fs::remove_dir_all(&out).ok();
}

#[test]
fn data_parallel_on_two_cpu_replicas_follows_the_one_device_run() {
    data_parallel_follows_the_one_device_run(vec![Device::Cpu, Device::Cpu], "ddp-cpu");
}

#[test]
#[ignore = "needs a CUDA device"]
fn data_parallel_on_two_gpus_follows_the_one_device_run() {
    if ferry::memory::cuda::devices().map_or(0, |d| d.len()) < 2 {
        eprintln!("skipped: data-parallel training over two GPUs needs two CUDA devices");
        return;
    }
    data_parallel_follows_the_one_device_run(vec![Device::Cuda(0), Device::Cuda(1)], "ddp-cuda");
}

fn epoch_files(out: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("epoch-"))
        .collect();
    names.sort();
    names
}

/// A fresh run into an --out holding another run is refused, naming the ways on, and changes
/// nothing; with --overwrite it starts clean, rotation keeps its own newest files, and a later
/// --resume continues it rather than the run before.
#[test]
fn a_fresh_run_does_not_mix_with_another_run_in_its_out() {
    let out = scratch("another-run");
    train(&args(&out, 3)).unwrap();
    let first = epoch_files(&out);
    assert_eq!(first.len(), 3, "{first:?}");
    let second = |overwrite| TrainArgs {
        keep: 1,
        overwrite,
        ..args(&out, 2)
    };
    let err = train(&second(false))
        .expect_err("a fresh run went into a directory holding another")
        .to_string();
    for needed in [
        out.display().to_string(),
        "--resume".into(),
        "--out".into(),
        "--overwrite".into(),
    ] {
        assert!(err.contains(&needed), "{needed:?} not in: {err}");
    }
    assert_eq!(
        epoch_files(&out),
        first,
        "the refused run changed the directory"
    );
    let fresh = train(&second(true)).unwrap();
    assert_eq!(fresh.history.len(), 2);
    assert_eq!(epoch_files(&out), ["epoch-002.safetensors"]);
    let resumed = train(&TrainArgs {
        resume: true,
        ..args(&out, 2)
    })
    .unwrap();
    assert_eq!((resumed.trained_now, resumed.history.len()), (0, 2));
    assert_eq!(resumed.test_accuracy, fresh.test_accuracy);
    std::fs::remove_dir_all(&out).ok();
}

#[test]
fn resume_continues_where_the_run_stopped() {
    let out = scratch("resume");
    resume_follows_the_straight_run(args(&out, 4));
    std::fs::remove_dir_all(&out).ok();
}

#[test]
fn resume_continues_the_moving_average() {
    let out = scratch("resume-ema");
    let a = TrainArgs {
        ema: 0.9,
        ..args(&out, 4)
    };
    resume_follows_the_straight_run(a.clone());
    // The average is the model that was tested and shipped: model.safetensors holds it,
    // the epoch file the trained weights for resuming.
    let ck = ferry::checkpoint::Checkpoint::load(out.join("epoch-004.safetensors")).unwrap();
    let shipped = ferry::checkpoint::load(out.join("model.safetensors")).unwrap();
    let values = |state: &[(String, Tensor)], key: &str| {
        let (_, t) = state.iter().find(|(k, _)| k == key).expect(key);
        t.to_vec::<f32>().unwrap()
    };
    let shipped_weight = values(&shipped, "0.weight");
    assert_eq!(shipped_weight, values(&ck.section("ema"), "0.average"));
    assert_ne!(shipped_weight, values(&ck.section("model"), "0.weight"));
    // A run without the average cannot pick up one made with it, and the error says so.
    let err = train(&TrainArgs {
        resume: true,
        ema: 0.0,
        ..args(&out, 5)
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("--ema"), "{err}");
    std::fs::remove_dir_all(&out).ok();
}

/// Trains `a` straight, deletes its last two epoch files, resumes, and checks the resumed
/// run repeats the straight one.
fn resume_follows_the_straight_run(a: TrainArgs) {
    let out = a.out_dir();
    let args = |out: &Path, epochs| TrainArgs {
        out: Some(out.to_path_buf()),
        epochs,
        ..a.clone()
    };
    let straight = train(&args(&out, 4)).unwrap();
    // An interruption after epoch 2: the later checkpoints never got written.
    std::fs::remove_file(out.join("epoch-003.safetensors")).unwrap();
    std::fs::remove_file(out.join("epoch-004.safetensors")).unwrap();
    let resumed = train(&TrainArgs {
        resume: true,
        ..args(&out, 4)
    })
    .unwrap();
    assert_eq!(resumed.trained_now, 2, "epochs 3 and 4 only");
    assert_eq!(resumed.history.len(), 4);
    assert!(out.join("epoch-004.safetensors").is_file());
    // Same shuffles, masks, weights and Adam moments: the run as if never interrupted.
    for (a, b) in resumed.history.iter().zip(&straight.history) {
        assert!((a.loss - b.loss).abs() < 1e-6, "{a:?} vs {b:?}");
    }
    assert_eq!(resumed.test_accuracy, straight.test_accuracy);
    let again = train(&TrainArgs {
        resume: true,
        ..args(&out, 4)
    })
    .unwrap();
    assert_eq!(again.trained_now, 0, "nothing left to train");
    assert_eq!(again.test_accuracy, resumed.test_accuracy);
}

/// Per-step losses of one epoch (seed 0, shuffled as `train` does), batches taken either
/// as views of one epoch tensor moved whole (how `train` did it before the loader) or
/// through a `DeviceLoader` keeping `prefetch` in flight.
fn epoch_losses(device: Device, prefetch: Option<usize>) -> Vec<f32> {
    let (train_split, _) = load_digits(DIGITS_CSV_GZ).unwrap();
    ferry::manual_seed(0);
    let model = ferry::models::digits_mlp(device, 0.5).unwrap();
    let mut opt = AdamW::new(model.parameters(), 1e-2).unwrap();
    ferry::manual_seed(7);
    let mut order: Vec<usize> = (0..train_split.rows()).collect();
    order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(7));
    let mut losses = Vec::new();
    let mut step = |x: &Tensor, y: &Tensor| {
        opt.zero_grad();
        let loss = ferry::nn::cross_entropy(&model.forward(x).unwrap(), y).unwrap();
        loss.backward().unwrap();
        opt.step().unwrap();
        losses.push(loss.item().unwrap() as f32);
    };
    match prefetch {
        None => {
            let (x, y) = train_split.tensors(&order, device).unwrap();
            for at in (0..order.len()).step_by(32) {
                let len = 32.min(order.len() - at);
                step(
                    &x.narrow(0, at, len).unwrap(),
                    &y.narrow(0, at, len).unwrap(),
                );
            }
        }
        Some(k) => {
            let host = order
                .chunks(32)
                .map(|rows| train_split.tensors(rows, Device::Cpu));
            for batch in DeviceLoader::from_results(host, device).in_flight(k) {
                let (x, y) = batch.unwrap();
                assert_eq!(x.device(), device);
                step(&x, &y);
            }
        }
    }
    losses
}

fn the_loader_repeats_the_whole_epoch_losses(device: Device) {
    let whole = epoch_losses(device, None);
    assert_eq!(whole.len(), 47, "1,500 rows in batches of 32");
    for k in [0, 1, 2, 4] {
        // Bit for bit: the same rows, the same kernels, only the way the bytes arrive differs.
        assert_eq!(
            epoch_losses(device, Some(k)),
            whole,
            "--prefetch {k} on {device}"
        );
    }
}

#[test]
fn the_loader_repeats_the_whole_epoch_losses_on_cpu() {
    the_loader_repeats_the_whole_epoch_losses(Device::Cpu);
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_loader_repeats_the_whole_epoch_losses_on_cuda() {
    the_loader_repeats_the_whole_epoch_losses(Device::Cuda(0));
}

#[test]
fn the_summary_says_how_long_the_loop_waited_for_data() {
    let out = scratch("wait");
    let summary = train(&TrainArgs {
        prefetch: 0,
        ..args(&out, 1)
    })
    .unwrap();
    assert!(summary.loop_time >= summary.data_wait, "{summary:?}");
    assert!(summary.loop_time > Duration::ZERO, "{summary:?}");
    let line = input_line(&summary, 0);
    assert!(
        line.starts_with("waited ") && line.ends_with("--prefetch 0)"),
        "{line}"
    );
    std::fs::remove_dir_all(&out).ok();
}

/// Flips one bit in the data section of `file` (its last byte, part of the last tensor).
fn flip_last_byte(file: &Path) {
    let mut bytes = std::fs::read(file).unwrap();
    *bytes.last_mut().unwrap() ^= 0x10;
    std::fs::write(file, bytes).unwrap();
}

#[test]
fn resume_falls_back_past_a_damaged_newest_epoch() {
    let out = scratch("fallback");
    let straight = train(&args(&out, 3)).unwrap();
    flip_last_byte(&out.join("epoch-003.safetensors"));
    let resumed = train(&TrainArgs {
        resume: true,
        ..args(&out, 3)
    })
    .unwrap();
    assert_eq!(resumed.skipped.len(), 1, "{:?}", resumed.skipped);
    let skipped = &resumed.skipped[0];
    assert!(skipped.path.ends_with("epoch-003.safetensors"));
    let reason = skipped.reason.to_string();
    assert!(
        reason.contains("is corrupted") && reason.contains("tensor \""),
        "{reason}"
    );
    assert_eq!(resumed.trained_now, 1, "epoch 3 again, from epoch 2");
    for (a, b) in resumed.history.iter().zip(&straight.history) {
        assert!((a.loss - b.loss).abs() < 1e-6, "{a:?} vs {b:?}");
    }
    assert_eq!(resumed.test_accuracy, straight.test_accuracy);
    // Epoch 3 was written anew, whole: the next resume skips nothing.
    let again = train(&TrainArgs {
        resume: true,
        ..args(&out, 3)
    })
    .unwrap();
    assert!(again.skipped.is_empty() && again.trained_now == 0);
    std::fs::remove_dir_all(&out).ok();
}

#[test]
fn resume_with_no_good_epoch_names_the_directory_and_every_file() {
    let out = scratch("all-bad");
    train(&args(&out, 3)).unwrap();
    let file = |e| out.join(format!("epoch-00{e}.safetensors"));
    flip_last_byte(&file(3));
    let whole = std::fs::read(file(2)).unwrap();
    std::fs::write(file(2), &whole[..whole.len() / 2]).unwrap();
    std::fs::write(file(1), b"not a checkpoint").unwrap();
    let err = train(&TrainArgs {
        resume: true,
        ..args(&out, 3)
    })
    .expect_err("resumed from damaged files")
    .to_string();
    for needed in [
        format!("no usable checkpoint in {}", out.display()),
        format!("{}: ", file(3).display()),
        "is corrupted".into(),
        format!("{}: ", file(2).display()),
        "truncated".into(),
        format!("{}: ", file(1).display()),
        "without --resume".into(),
    ] {
        assert!(err.contains(&needed), "{needed:?} not in: {err}");
    }
    std::fs::remove_dir_all(&out).ok();
}

/// `--recompute` trains the GPT as without it (the same loss after the same steps: recomputed
/// blocks give the plain gradients bit for bit on the CPU); the other tasks refuse it.
#[test]
fn recomputed_blocks_train_the_gpt_as_plain_ones() {
    let out = scratch("gpt-recompute");
    let gpt = |recompute: bool| TrainArgs {
        task: Task::Gpt,
        steps_per_epoch: 3,
        recompute,
        ..args(&out.join(if recompute { "again" } else { "plain" }), 1)
    };
    let plain = train(&gpt(false)).unwrap();
    let again = train(&gpt(true)).unwrap();
    assert_eq!(plain.history[0].loss, again.history[0].loss);
    let err = train(&TrainArgs {
        recompute: true,
        ..args(&out, 1)
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("digits models have none"), "{err}");
    std::fs::remove_dir_all(&out).ok();
}
