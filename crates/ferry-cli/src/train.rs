//! `ferry train digits`: an MLP on the digits data, end to end through ferry's training surface
//! (nn, optim, safetensors checkpoints, the graph-leak check). Each task is a model, its data
//! (a [`ferry::train::Task`]) and its flags; [`ferry::train::Trainer`] runs the loop.
//!
//! Each epoch writes `epoch-NNN.safetensors` (model under `model.`, optimizer under
//! `optimizer.`, with `--ema` the moving average under `ema.`, the history so far in the
//! metadata) and `model.safetensors` (the model alone, PyTorch's key names; with `--ema`, the
//! averaged weights), in the background while the next epoch trains; with
//! `--checkpoint-every N`, also `epoch-NNN-step-KKKKK.safetensors` every N steps inside epochs.
//! Checkpoints beyond the newest `--keep` (3 by default) are deleted; the curves
//! (`curves.png`, `curves.svg`) are redrawn each epoch. A fresh run refuses an `--out` that
//! holds another run's checkpoints (`--overwrite` deletes them first). `--resume` loads the
//! newest checkpoint that is whole (a truncated or damaged one is skipped, with a warning
//! naming it and why) and continues up to `--epochs` in total. Shuffling and dropout are
//! seeded per epoch from `--seed`, and a checkpoint inside an epoch holds the generator's
//! state, so a resumed run repeats exactly what an uninterrupted one would have done.
//!
//! Batches are assembled on the host and reach the device through a [`DeviceLoader`], which
//! keeps `--prefetch` batches in flight on a copy stream while a step computes (on the CPU it
//! passes them through). The time the loop waited for data is reported at the end.
//!
//! The recipe (AdamW at 1e-2 with a cosine decay over 40 epochs, batch 32, dropout 0.5 after
//! the hidden layer) reaches 0.919 to 0.936 test accuracy over seeds 0 to 9 (mean 0.927, nine
//! of ten at 0.92 or more; scikit-learn's MLP with 128 hidden units: 0.916 to 0.923); without
//! dropout and the decay the same MLP overfits to about 0.91.

use std::error::Error;
use std::path::PathBuf;
use std::time::Instant;

use clap::{Args, ValueEnum};
use ferry::distributed::{ProcessGroup, run_replicas};
use ferry::nn::Module;
use ferry::optim::{AdamW, Constant, Cosine, Ema, LrSchedule};
use ferry::prelude::*;
use ferry::train::{EpochEnd, Every, Start, TrainSummary, Trainer};

mod digits;
pub(crate) mod gpt;
mod parallel;
mod report;
use digits::{DIGITS_CSV_GZ, Digits, Split, load_digits};
use report::{Report, explain};

/// What can be trained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Task {
    /// 8x8 handwritten digits (1,797 samples): first 1,500 train, last 297 test; MLP 64-128-10.
    Digits,
    /// The digits data through a small CNN: two 3x3 convolutions (16 and 32 channels), 2x2 max
    /// pooling, a 64-unit hidden layer; same split as digits.
    DigitsCnn,
    /// A character-level GPT on Cicero's De finibus, book I (Latin, public domain, 49 KB, from
    /// the lipsum crate); prints samples at the end.
    Gpt,
    /// A character-level Llama (RMSNorm, rotary positions, SwiGLU, grouped-query attention:
    /// `ferry::models::Llama`) on the same text, sized by the same flags and --kv-heads.
    Llama,
}

/// `ferry train`.
#[derive(Debug, Clone, Args)]
pub struct TrainArgs {
    /// What to train.
    #[arg(value_enum)]
    pub task: Task,
    /// Where to train: cpu or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// Total number of epochs (with --resume, counting the epochs already done).
    #[arg(long, default_value_t = 40)]
    pub epochs: usize,
    /// Directory for checkpoints and the curves [default: target/ferry-train/TASK].
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Continue from the newest checkpoint in --out.
    #[arg(long)]
    pub resume: bool,
    /// Start afresh in an --out that holds another run, deleting its checkpoints (without it,
    /// such an --out is refused).
    #[arg(long, conflicts_with = "resume")]
    pub overwrite: bool,
    /// Scale the gradients down to this global L2 norm before each update (none by default).
    #[arg(long)]
    pub clip_grad_norm: Option<f64>,
    /// Samples per batch [default: 32 for digits and gpt, 16 for digits-cnn].
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Peak learning rate of AdamW [default: 1e-2 for digits (a cosine to 0 over --epochs),
    /// 3e-3 for gpt (5% warmup, then a cosine to a tenth)].
    #[arg(long)]
    pub lr: Option<f64>,
    /// AdamW's decoupled weight decay.
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,
    /// Dropout probability after the hidden layer (0: none).
    #[arg(long, default_value_t = 0.5)]
    pub dropout: f64,
    /// digits tasks: test (and save as model.safetensors) an exponential moving average of
    /// the weights with this decay per step, e.g. 0.999 (0: the weights as trained). Meant for
    /// --constant-lr; the cosine decay settles the weights itself, and the average adds little.
    #[arg(long, default_value_t = 0.0)]
    pub ema: f64,
    /// Keep the learning rate constant instead of the cosine decay.
    #[arg(long)]
    pub constant_lr: bool,
    /// Seed of the initial weights and of every epoch's shuffle.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Read the data from this .csv.gz instead of the embedded copy.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// No progress bar and no per-epoch lines.
    #[arg(long)]
    pub quiet: bool,
    /// Batches kept in flight to the device while a step computes (0: each batch moves when
    /// the step asks for it, blocking).
    #[arg(long, default_value_t = ferry::DEFAULT_IN_FLIGHT)]
    pub prefetch: usize,
    /// Data-parallel over these devices, one replica each (e.g. cuda:0,cuda:1 over NCCL, or
    /// cpu,cpu for replicas on threads): each batch is split between the replicas and their
    /// gradients averaged, so the run follows the one-device run up to rounding. Overrides
    /// --device.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub devices: Vec<Device>,
    /// gpt, llama: characters of context.
    #[arg(long, default_value_t = 64)]
    pub context: usize,
    /// gpt, llama: width of the embeddings and blocks.
    #[arg(long, default_value_t = 128)]
    pub width: usize,
    /// gpt, llama: transformer blocks.
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// gpt, llama: attention heads per block.
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    /// llama: key/value heads per block, dividing --heads [default: half of --heads].
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// gpt, llama: training steps per epoch (each epoch ends with validation and a checkpoint).
    #[arg(long, default_value_t = 100)]
    pub steps_per_epoch: usize,
    /// Checkpoints to keep: after each one is written, older ones beyond the newest N are
    /// deleted (0 keeps them all), those inside epochs counted with the epoch files.
    /// `model.safetensors` is always the latest epoch's.
    #[arg(long, default_value_t = 3)]
    pub keep: usize,
    /// Also checkpoint inside epochs, every N optimizer steps of the run
    /// (`epoch-NNN-step-KKKKK.safetensors`, written in the background while training goes
    /// on); --resume continues from the newest, inside an epoch too, exactly as the run would
    /// have gone on. 0: at epoch ends only. Not with --devices yet.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 0,
        conflicts_with = "devices"
    )]
    pub checkpoint_every: usize,
    /// gpt: keep AdamW's master weights and moments in host memory and step them on the CPU
    /// while backward runs (ferry::optim::OffloadAdamW); needs a GPU --device. With
    /// --clip-grad-norm the gradients are held on the host until the step
    /// (OffloadAdamW::hold_gradients), where their global norm is taken.
    #[arg(long)]
    pub offload_optimizer: bool,
    /// gpt and llama: run each transformer block (layer) as a recomputed region
    /// (ferry::autograd::recompute): the forward keeps only each block's input, and backward
    /// runs the block again; the same gradients for the memory of the blocks' activations.
    #[arg(long)]
    pub recompute: bool,
    /// Cap ferry's device allocator, as FERRY_DEVICE_BUDGET does: bytes, or a size such as
    /// 6G. Beyond it allocations fail with the out-of-memory error.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub device_budget: Option<usize>,
}

fn parse_size(text: &str) -> Result<usize, String> {
    ferry::memory::size::parse_bytes(text)
        .ok_or_else(|| format!("{text:?} is not a size: bytes, or a number with K, M, G or T (6G)"))
}

impl TrainArgs {
    /// The output directory, `--out` or `target/ferry-train/TASK`.
    pub fn out_dir(&self) -> PathBuf {
        self.out.clone().unwrap_or_else(|| {
            let task = self
                .task
                .to_possible_value()
                .map_or("task".to_string(), |v| v.get_name().to_string());
            PathBuf::from("target/ferry-train").join(task)
        })
    }

    /// `--batch-size`, or the task's default.
    pub fn batch(&self) -> usize {
        self.batch_size.unwrap_or(match self.task {
            Task::DigitsCnn => 16,
            Task::Digits | Task::Gpt | Task::Llama => 32,
        })
    }

    fn start(&self) -> Start {
        match (self.resume, self.overwrite) {
            (true, _) => Start::Resume,
            (false, true) => Start::Overwrite,
            (false, false) => Start::Fresh,
        }
    }
}

/// `ferry train ...`: trains, then prints the final test accuracy as a number.
pub fn run(args: TrainArgs) -> Result<(), Box<dyn Error>> {
    let start = Instant::now();
    let summary = train(&args)?;
    if !args.quiet {
        let skipped = match summary.skipped.len() {
            0 => String::new(),
            n => format!(" (resumed past {n} unusable checkpoint(s), see the warnings above)"),
        };
        println!(
            "trained {} epoch(s) of {} on {} in {:.2} s{skipped}; checkpoints and curves (PNG, SVG) in {}",
            summary.trained_now,
            summary.history.len(),
            devices_label(&args),
            start.elapsed().as_secs_f64(),
            args.out_dir().display()
        );
        println!("{}", input_line(&summary, args.prefetch));
    }
    println!("test accuracy: {:.4}", summary.test_accuracy);
    Ok(())
}

/// Trains (or resumes), checkpointing and redrawing the curves each epoch; with `--devices`,
/// one replica per device, data-parallel.
pub fn train(args: &TrainArgs) -> Result<TrainSummary, Box<dyn Error>> {
    let args = &TrainArgs {
        out: Some(args.out_dir()),
        ..args.clone()
    };
    if args.batch() == 0 {
        return Err("--batch-size must be at least 1".into());
    }
    if matches!(args.task, Task::Gpt | Task::Llama) {
        return gpt::train(args);
    }
    if args.recompute {
        return Err(
            "--recompute runs the gpt's and the llama's transformer blocks as recomputed \
                    regions; the digits models have none"
                .into(),
        );
    }
    let gz = match &args.data {
        Some(path) => std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?,
        None => DIGITS_CSV_GZ.to_vec(),
    };
    let (train, test) = load_digits(&gz)?;
    if args.devices.len() <= 1 {
        let device = args.devices.first().copied().unwrap_or(args.device);
        return replica(args, &train, &test, device, None);
    }
    let groups = parallel::groups(&args.devices)?;
    let world = groups.len();
    if args.batch() < world {
        return Err(format!(
            "--batch-size {} is smaller than the {world} replicas; each needs at least one sample",
            args.batch()
        )
        .into());
    }
    let mut summaries = run_replicas(groups, |group| {
        let device = group.device();
        replica(args, &train, &test, device, Some(group)).map_err(|e| {
            ferry::TensorError::InvalidArgument {
                op: "ferry train",
                message: e.to_string(),
            }
        })
    })?;
    Ok(summaries.swap_remove(0))
}

/// One replica of a digits run (the only one without a `group`): its model, optimizer and
/// average, on `device`.
fn replica(
    args: &TrainArgs,
    train: &Split,
    test: &Split,
    device: Device,
    group: Option<ProcessGroup>,
) -> Result<TrainSummary, Box<dyn Error>> {
    // Drawn on the host and moved: a seed gives the same initial weights on every device (as it
    // gives the same shuffles and dropout masks), so a run on a GPU follows the CPU's.
    ferry::manual_seed(args.seed);
    let mut model = match args.task {
        Task::DigitsCnn => ferry::models::digits_cnn(Device::Cpu, args.dropout)?,
        _ => ferry::models::digits_mlp(Device::Cpu, args.dropout)?,
    };
    model.to(device)?;
    let lr = args.lr.unwrap_or(1e-2);
    let mut opt = AdamW::new(model.parameters(), lr)?.weight_decay(args.weight_decay);
    let mut ema = match args.ema {
        0.0 => None,
        decay => Some(Ema::new(model.parameters(), decay)?),
    };
    let task = Digits::new(train, test, device, args.batch())?;
    // A cosine from the peak to 0 over --epochs, one rate per epoch.
    let schedule: Box<dyn LrSchedule> = match args.epochs {
        0 => Box::new(Constant::new(lr)?),
        _ if args.constant_lr => Box::new(Constant::new(lr)?),
        epochs => Box::new(Cosine::new(lr, epochs as u64)?),
    };
    let mut trainer = trainer(args, device).schedule(schedule, Every::Epoch);
    if let Some(group) = group {
        trainer = trainer.data_parallel(group);
    }
    let line = |end: &EpochEnd<'_>| {
        format!(
            "epoch {}/{}: loss {:.4}, train accuracy {:.4}, test accuracy {:.4}",
            end.epoch,
            end.epochs,
            end.stats.loss,
            end.stats.train_accuracy,
            end.stats.test_accuracy
        )
    };
    let mut report = Report::new(args, &line);
    trainer
        .fit(&mut model, &mut opt, ema.as_mut(), &task, &mut report)
        .map_err(|e| explain(e).into())
}

/// The trainer every task shares: epochs, seed, prefetch, checkpoints, start, clipping.
fn trainer(args: &TrainArgs, device: Device) -> Trainer {
    let trainer = Trainer::new(args.epochs, device)
        .seed(args.seed)
        .prefetch(args.prefetch)
        .checkpoints(args.out_dir(), args.keep)
        .checkpoint_every(args.checkpoint_every)
        .start(args.start());
    match args.clip_grad_norm {
        Some(max_norm) => trainer.clip_grad_norm(max_norm),
        None => trainer,
    }
}

/// How long the loops waited for their batches, and what share of the loop time that was.
fn input_line(summary: &TrainSummary, prefetch: usize) -> String {
    let share = match summary.loop_time.as_secs_f64() {
        t if t > 0.0 => summary.data_wait.as_secs_f64() / t * 100.0,
        _ => 0.0,
    };
    format!(
        "waited {:.3} s for data ({share:.1}% of the training loops; --prefetch {prefetch})",
        summary.data_wait.as_secs_f64()
    )
}

/// Where `run` trained, for its last lines.
fn devices_label(args: &TrainArgs) -> String {
    match args.devices.as_slice() {
        [] => args.device.to_string(),
        devices => {
            let names: Vec<String> = devices.iter().map(Device::to_string).collect();
            format!("{} (data-parallel)", names.join(" + "))
        }
    }
}

fn say(args: &TrainArgs, line: &str) {
    if !args.quiet {
        println!("{line}");
    }
}

#[cfg(test)]
mod tests;
