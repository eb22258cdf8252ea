//! `ferry bench offload-optim`: ferry's GPT at about a billion parameters trained with AdamW
//! on the GPU, then with [`OffloadAdamW`] (state in host memory, stepped on the CPU while
//! backward runs), from the same weights on the same batches: step time, throughput, peak
//! device memory, where the optimizer state lives, and the losses of both runs side by side.
//!
//! The goals (issue 26, on the H200): throughput with offload >= 90% of the all-GPU run's at a
//! batch where forward and backward take at least as long as the CPU step; the device's peak
//! holds no optimizer state; losses within 1e-3 relative over the compared steps.

use std::error::Error;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use ferry::amp::autocast;
use ferry::memory::cuda::CudaDevice;
use ferry::models::{Gpt, GptConfig};
use ferry::nn::{Module, cross_entropy};
use ferry::optim::{AdamW, OffloadAdamW, Optimizer, StepTimeline};
use ferry::{DType, Device, Tensor};
use serde_json::json;

use crate::harness::measure::Measured;
use crate::harness::pytorch::PyTorchArgs;
use crate::harness::report::{print_table, significant};
use crate::harness::{self, NO_CUDA_DEVICE, run_info::RunInfo};

mod pytorch;

#[derive(Args, Debug)]
pub struct OffloadOptimArgs {
    /// Transformer blocks (20 x 2048 wide: 1.0 B parameters).
    #[arg(long, default_value_t = 20)]
    layers: usize,
    /// Width of the model.
    #[arg(long, default_value_t = 2048)]
    width: usize,
    /// Sequences per batch.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 1024)]
    seq: usize,
    /// Timed steps per run; the table shows their median.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    samples: u32,
    /// Untimed steps before them.
    #[arg(long, default_value_t = 2)]
    warmup: u32,
    /// Steps whose losses are compared between the runs (the first of each run's steps).
    #[arg(long, default_value_t = 20)]
    loss_steps: u32,
    /// Peak learning rate, reached by a linear warm-up over the first 20 steps (both runs).
    #[arg(long, default_value_t = 1e-4)]
    lr: f64,
    /// The offloaded run keeps bf16 weights on the GPU (fp32 master weights on the host), as a
    /// model that does not fit otherwise would; the all-GPU run stays fp32.
    #[arg(long)]
    offload_bf16: bool,
    /// The offloaded run uses the delayed parameter update (OffloadAdamW::delayed_update): the
    /// CPU's passes of a step run beside the next step's forward and backward.
    #[arg(long)]
    delayed_update: bool,
    /// Cap ferry's device allocator at this many GiB (as FERRY_DEVICE_BUDGET does): a model
    /// whose training state passes it fails on the GPU with the out-of-memory error and trains
    /// with offload.
    #[arg(long, value_name = "GIB")]
    device_budget_gib: Option<f64>,
    /// Train on this file's bytes (a token per byte, consecutive windows, the same in both
    /// runs) instead of synthetic ids a model learns in a few steps: text the model cannot
    /// memorize within the compared steps, so their losses say whether the runs agree.
    #[arg(long, value_name = "FILE")]
    text: Option<PathBuf>,
    /// Clip the gradients to this global L2 norm in both runs (the offloaded run holds its
    /// gradients until `step()` for it: OffloadAdamW::hold_gradients).
    #[arg(long, value_name = "NORM")]
    clip_grad_norm: Option<f64>,
    /// The offloaded run holds its gradients until `step()` (the mode clipping, loss scaling
    /// and accumulation use) even without clipping.
    #[arg(long)]
    hold_gradients: bool,
    /// Hold the offloaded run's pinned buffers within this many GiB
    /// (OffloadAdamW::new_within): below a landing and an upload buffer per parameter, they
    /// are staged.
    #[arg(long, value_name = "GIB")]
    pinned_limit_gib: Option<f64>,
    /// Write every number to this JSON file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// PyTorch's rows (python/offload_optim.py): the same GPT with torch's AdamW on the GPU,
    /// the simple offload and torchao's CPUOffloadOptimizer, after ferry's runs.
    #[command(flatten)]
    pytorch: PyTorchArgs,
}

const VOCAB: usize = 256;

/// One offloaded step on the host's clock, milliseconds from the start of its forward.
#[derive(Debug, Clone, Copy, Default)]
struct Timeline {
    /// Backward queued (its call returned).
    backward: f64,
    sent: (f64, f64),
    landed: (f64, f64),
    stepped: f64,
    busy: f64,
    queuing: f64,
    returned: f64,
    /// The GPU done (after a synchronize).
    synced: f64,
}

impl Timeline {
    fn of(start: Instant, backward: Instant, t: &StepTimeline, synced: f64) -> Self {
        let ms = |at: Instant| at.saturating_duration_since(start).as_secs_f64() * 1e3;
        let span =
            |s: Option<(Instant, Instant)>| s.map_or((f64::NAN, f64::NAN), |(a, b)| (ms(a), ms(b)));
        Self {
            backward: ms(backward),
            sent: span(t.sent),
            landed: span(t.landed),
            stepped: t.stepped.map_or(f64::NAN, ms),
            busy: t.busy.as_secs_f64() * 1e3,
            queuing: t.queuing.as_secs_f64() * 1e3,
            returned: t.returned.map_or(f64::NAN, ms),
            synced,
        }
    }

    /// The median of each field over `all`.
    fn median(all: &[Self]) -> Option<Self> {
        let m = |f: fn(&Self) -> f64| {
            let v: Vec<f64> = all.iter().map(f).collect();
            crate::harness::measure::median(&v).unwrap_or(f64::NAN)
        };
        (!all.is_empty()).then(|| Self {
            backward: m(|t| t.backward),
            sent: (m(|t| t.sent.0), m(|t| t.sent.1)),
            landed: (m(|t| t.landed.0), m(|t| t.landed.1)),
            stepped: m(|t| t.stepped),
            busy: m(|t| t.busy),
            queuing: m(|t| t.queuing),
            returned: m(|t| t.returned),
            synced: m(|t| t.synced),
        })
    }
}

struct Run {
    steps: Measured,
    timelines: Vec<Timeline>,
    step_calls: Measured,
    losses: Vec<f64>,
    peak: usize,
    params: usize,
    pinned: usize,
    host_state: usize,
    /// The offloaded run's staging report, when its pinned buffers were staged.
    staging: Option<String>,
}

fn batch(
    args: &OffloadOptimArgs,
    text: Option<&[u8]>,
    step: u32,
    device: Device,
) -> ferry::Result<(Tensor, Tensor)> {
    let (rows, seq) = (args.batch, args.seq);
    let (mut x, mut y) = (
        Vec::with_capacity(rows * seq),
        Vec::with_capacity(rows * seq),
    );
    for row in 0..rows {
        // Each row a window of seq + 1 tokens: its first seq are the input, its last seq the
        // targets.
        let window: Vec<i64> = match text {
            // Consecutive windows of the text, wrapping at its end.
            Some(text) => {
                let start = ((step as usize * rows + row) * (seq + 1)) % (text.len() - seq);
                text[start..start + seq + 1]
                    .iter()
                    .map(|&b| i64::from(b))
                    .collect()
            }
            // Deterministic ids, different each step, the same in both runs.
            None => (0..seq + 1)
                .map(|i| {
                    let i = (row * seq + i) as u64;
                    ((i * 2_654_435_761 + u64::from(step) * 40_503) % VOCAB as u64) as i64
                })
                .collect(),
        };
        x.extend_from_slice(&window[..seq]);
        y.extend_from_slice(&window[1..]);
    }
    let x = Tensor::from_vec(x, &[rows, seq])?;
    let y = Tensor::from_vec(y, &[rows, seq])?;
    use ferry::DeviceMove;
    Ok((x.to(device)?, y.to(device)?))
}

fn train(
    args: &OffloadOptimArgs,
    text: Option<&[u8]>,
    dev: &CudaDevice,
    offload: bool,
) -> Result<Run, Box<dyn Error>> {
    let device = dev.device();
    ferry::manual_seed(0);
    let config = GptConfig {
        vocab: VOCAB,
        context: args.seq,
        width: args.width,
        layers: args.layers,
        heads: args.width / 128,
    };
    let mut model = Gpt::new(config, device)?;
    if offload && args.offload_bf16 {
        model.visit_parameters_mut("", &mut |_, p| {
            *p = ferry::with_no_grad(|| p.detach().to_dtype(DType::BF16))?.with_grad()?;
            Ok(())
        })?;
    }
    let params: usize = model.parameters().iter().map(Tensor::numel).sum();
    let (mut gpu_opt, mut offload_opt) = if offload {
        let opt = match args.pinned_limit_gib {
            Some(gib) => OffloadAdamW::new_within(model.parameters(), args.lr, gib_bytes(gib))?,
            None => OffloadAdamW::new(model.parameters(), args.lr)?,
        };
        let opt = opt
            .delayed_update(args.delayed_update)
            .hold_gradients(args.hold_gradients || args.clip_grad_norm.is_some());
        (None, Some(opt))
    } else {
        (Some(AdamW::new(model.parameters(), args.lr)?), None)
    };
    // What the optimizer itself holds: its pinned blocks as the pool counts them, its state.
    let (pinned, host_state) = offload_opt
        .as_ref()
        .map_or((0, 0), |o| (o.pinned_bytes(), o.state_bytes()));
    dev.synchronize()?;
    dev.reset_peak();
    let mut steps = Measured::new();
    // How long `step()` held the training thread (for offload: waiting for the CPU's steps).
    let mut step_calls = Measured::new();
    let mut losses = Vec::new();
    let mut timelines = Vec::new();
    let total = (args.warmup + args.samples).max(args.loss_steps);
    for step in 0..total {
        let (x, y) = batch(args, text, step, device)?;
        dev.synchronize()?;
        let opt: &mut dyn Optimizer = match (&mut gpu_opt, &mut offload_opt) {
            (Some(adamw), _) => adamw,
            (_, Some(offload)) => offload,
            (None, None) => unreachable!("one of the two was made"),
        };
        opt.set_learning_rate(args.lr * f64::from(step + 1).min(20.0) / 20.0);
        let start = Instant::now();
        opt.zero_grad();
        let loss = autocast(DType::BF16, || {
            let logits = model.forward(&x)?;
            cross_entropy(
                &logits.reshape(&[args.batch * args.seq, VOCAB])?,
                &y.reshape(&[args.batch * args.seq])?,
            )
        })?;
        loss.backward()?;
        if let Some(max_norm) = args.clip_grad_norm {
            opt.clip_grad_norm(max_norm)?;
        }
        let stepping = Instant::now();
        opt.step()?;
        let step_ms = stepping.elapsed().as_secs_f64() * 1e3;
        dev.synchronize()?;
        let ms = start.elapsed().as_secs_f64() * 1e3;
        if step < args.loss_steps {
            losses.push(loss.item()?);
        }
        if (args.warmup..args.warmup + args.samples).contains(&step) {
            steps.push(ms);
            step_calls.push(step_ms);
            if let Some(offload) = &offload_opt {
                timelines.push(Timeline::of(start, stepping, &offload.last_timeline(), ms));
            }
        }
    }
    let peak = dev.memory_stats().peak_allocated_bytes;
    let staging = offload_opt.as_ref().and_then(OffloadAdamW::staging);
    // Staged, what the pinned buffers held at most.
    let pinned = staging.map_or(pinned, |s| s.peak);
    let staging = staging.map(|s| s.to_string());
    drop((gpu_opt, offload_opt));
    drop(model);
    dev.synchronize()?;
    dev.empty_cache()?;
    Ok(Run {
        steps,
        timelines,
        step_calls,
        losses,
        peak,
        params,
        pinned,
        host_state,
        staging,
    })
}

fn gib_bytes(gib: f64) -> usize {
    (gib * (1u64 << 30) as f64) as usize
}

fn gib_text(bytes: usize) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn to_json(r: &Run) -> serde_json::Value {
    let timelines: Vec<_> = r
        .timelines
        .iter()
        .map(|t| {
            json!({ "backward": t.backward, "sent": [t.sent.0, t.sent.1],
                    "landed": [t.landed.0, t.landed.1], "stepped": t.stepped, "busy": t.busy, "queuing": t.queuing,
                    "returned": t.returned, "synced": t.synced })
        })
        .collect();
    json!({ "ms": r.steps.samples_ms, "step_call_ms": r.step_calls.samples_ms,
            "timelines": timelines, "peak": r.peak, "losses": r.losses, "pinned": r.pinned,
            "host_state": r.host_state, "staging": r.staging })
}

pub fn run(args: OffloadOptimArgs) -> Result<(), Box<dyn Error>> {
    let Some(dev) = harness::cuda_device_or_say(0, |err| {
        format!(
            "{NO_CUDA_DEVICE} ({err}): ferry bench offload-optim trains on a GPU; nothing to measure here"
        )
    }) else {
        return Ok(());
    };
    let tokens = (args.batch * args.seq) as f64;
    println!(
        "ferry bench offload-optim: GPT {} layers x {} wide, batch {} x {} tokens, bf16 autocast, \
         fp32 weights; median of {} steps after {} untimed",
        args.layers, args.width, args.batch, args.seq, args.samples, args.warmup
    );
    if let Some(gib) = args.device_budget_gib {
        dev.set_budget(Some(gib_bytes(gib)));
        println!("device budget: {gib} GiB");
    }
    let text = match &args.text {
        Some(path) => {
            let bytes =
                std::fs::read(path).map_err(|e| format!("--text {}: {e}", path.display()))?;
            if bytes.len() <= 2 * (args.seq + 1) {
                return Err(format!(
                    "--text {}: {} bytes, too short for sequences of {} tokens",
                    path.display(),
                    bytes.len(),
                    args.seq
                )
                .into());
            }
            println!(
                "tokens: the bytes of {} ({}), consecutive windows",
                path.display(),
                gib_text(bytes.len())
            );
            Some(bytes)
        }
        None => None,
    };
    if let Some(max_norm) = args.clip_grad_norm {
        println!("gradients clipped to a global norm of {max_norm} in both runs");
    }
    let outcome = |offload: bool| match train(&args, text.as_deref(), &dev, offload) {
        Ok(run) => Some(run),
        Err(err) => {
            let name = if offload {
                "OffloadAdamW"
            } else {
                "AdamW on the GPU"
            };
            println!("{name}: {err}");
            // What the failed run left cached goes back, for the next run.
            let _ = dev.synchronize().and_then(|()| dev.empty_cache());
            None
        }
    };
    let (gpu, off) = (outcome(false), outcome(true));
    if args.device_budget_gib.is_some() {
        dev.set_budget(None);
    }
    let params = gpu.as_ref().or(off.as_ref()).map_or(0, |r| r.params);
    println!(
        "{:.3} B parameters: fp32 training state (weights, gradients, Adam's moments) {}",
        params as f64 / 1e9,
        gib_text(16 * params)
    );
    let row = |name: &str, r: &Run| {
        let ms = r.steps.median().unwrap_or(f64::NAN);
        vec![
            name.to_string(),
            format!("{} ms", significant(ms)),
            format!(
                "{} ms",
                significant(r.step_calls.median().unwrap_or(f64::NAN))
            ),
            significant(tokens / ms * 1e3),
            gib_text(r.peak),
            gib_text(r.pinned),
            gib_text(r.host_state),
        ]
    };
    let offloaded = if args.delayed_update {
        "OffloadAdamW, delayed update"
    } else {
        "OffloadAdamW"
    };
    let rows: Vec<Vec<String>> = [("AdamW on the GPU", &gpu), (offloaded, &off)]
        .into_iter()
        .filter_map(|(name, r)| r.as_ref().map(|r| row(name, r)))
        .collect();
    print_table(
        &[
            "run",
            "step",
            "step() call",
            "tokens/s",
            "device peak",
            "pinned",
            "host state",
        ],
        &rows,
    );
    if let Some(staging) = off.as_ref().and_then(|r| r.staging.as_ref()) {
        println!("{staging}");
    }
    if let Some(t) = off.as_ref().and_then(|r| Timeline::median(&r.timelines)) {
        println!(
            "one offloaded step on the host's clock, ms from the start of forward (medians): \
             forward and backward queued by {}; gradients sent {}-{}; landed {}-{}; the CPU \
             passes {} ms, the upload thread's {} ms, the last upload queued at {}; step() returned \
             at {}; the GPU done at {}",
            significant(t.backward),
            significant(t.sent.0),
            significant(t.sent.1),
            significant(t.landed.0),
            significant(t.landed.1),
            significant(t.busy),
            significant(t.queuing),
            significant(t.stepped),
            significant(t.returned),
            significant(t.synced),
        );
    }
    if let (Some(gpu), Some(off)) = (&gpu, &off) {
        let (a, b) = (
            gpu.steps.median().unwrap_or(f64::NAN),
            off.steps.median().unwrap_or(f64::NAN),
        );
        let relative: Vec<f64> = gpu
            .losses
            .iter()
            .zip(&off.losses)
            .map(|(x, y)| ((x - y) / x).abs())
            .collect();
        let worst = relative.iter().copied().fold(0.0f64, f64::max);
        println!(
            "throughput with offload: {}% of the all-GPU run's (goal >= 90%); device peak {} \
             lower; losses over {} steps within {:.2e} relative (goal <= 1e-3), last {} and {}",
            significant(100.0 * a / b),
            gib_text(gpu.peak.saturating_sub(off.peak)),
            gpu.losses.len().min(off.losses.len()),
            worst,
            gpu.losses.last().map_or("-".into(), |l| format!("{l:.4}")),
            off.losses.last().map_or("-".into(), |l| format!("{l:.4}")),
        );
        if !relative.is_empty() {
            let windows: Vec<String> = [10, 50, 100, 200, 500]
                .into_iter()
                .filter(|&n| n < relative.len())
                .chain([relative.len()])
                .map(|n| {
                    let w = relative[..n].iter().copied().fold(0.0f64, f64::max);
                    let at = |r: &Run| r.losses.get(n - 1).map_or(f64::NAN, |l| *l);
                    format!(
                        "steps 1-{n}: {w:.2e} (losses {:.4} / {:.4})",
                        at(gpu),
                        at(off)
                    )
                })
                .collect();
            println!("worst relative loss difference, {}", windows.join("; "));
        }
    }
    let torch = args.pytorch.compare_pytorch.then(|| pytorch::run(&args));
    match &torch {
        Some(Ok(doc)) => {
            let medians = gpu
                .as_ref()
                .zip(off.as_ref())
                .and_then(|(g, o)| Some((g.steps.median()?, o.steps.median()?)));
            pytorch::print(doc, medians);
        }
        Some(Err(err)) => println!("no PyTorch rows: {err}"),
        None => {}
    }
    if let Some(path) = &args.json {
        let doc = RunInfo::stamp(json!({
            "bench": "offload-optim",
            "layers": args.layers, "width": args.width, "batch": args.batch, "seq": args.seq,
            "params": params, "device_budget_gib": args.device_budget_gib,
            "gpu": gpu.as_ref().map(to_json),
            "offload": off.as_ref().map(to_json),
            "pytorch": match &torch {
                Some(Ok(doc)) => doc.clone(),
                Some(Err(err)) => json!({ "error": err }),
                None => serde_json::Value::Null,
            },
        }));
        harness::write_json(path, &doc, "step")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_machine_without_a_gpu_says_so_and_succeeds() {
        let crate::BenchCommand::OffloadOptim(args) =
            crate::parse_bench("ferry bench offload-optim --layers 1 --width 64 --batch 1 --seq 8")
                .unwrap()
        else {
            panic!("not the offload-optim bench")
        };
        if crate::harness::cuda_device(0).is_err() {
            super::run(args).unwrap();
        }
    }
}
