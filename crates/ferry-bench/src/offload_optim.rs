//! `ferry bench offload-optim`: ferry's GPT at about a billion parameters trained with AdamW
//! on the GPU, then with [`OffloadAdamW`] (state in host memory, stepped on the CPU while
//! backward runs), from the same weights on the same batches: step time, throughput, device
//! peak, where the optimizer state lives, and both runs' losses. With --compare-pytorch,
//! python/offload_optim.py's rows follow. Goals (H200): throughput with offload >= 90% of the
//! all-GPU run's; no optimizer state in the device's peak; losses within 1e-3 relative.

use std::error::Error;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use ferry::amp::autocast;
use ferry::memory::cuda::CudaDevice;
use ferry::models::{Gpt, GptConfig};
use ferry::nn::{Module, cross_entropy};
use ferry::optim::{AdamW, OffloadAdamW, Optimizer, StepTimeline};
use ferry::{DType, Device, Tensor};
use serde_json::{Map, Value, json};

use crate::harness::measure::{Measured, median};
use crate::harness::pytorch::{self, PyTorchArgs};
use crate::harness::report::significant;
use crate::harness::table::{Cell, Report, Table};
use crate::harness::{self, NO_CUDA_DEVICE};

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
    /// The offloaded run keeps bf16 weights on the GPU (fp32 masters on the host).
    #[arg(long)]
    offload_bf16: bool,
    /// The offloaded run updates its parameters a step late (OffloadAdamW::delayed_update).
    #[arg(long)]
    delayed_update: bool,
    /// Cap ferry's device allocator at this many GiB (as FERRY_DEVICE_BUDGET does).
    #[arg(long, value_name = "GIB")]
    device_budget_gib: Option<f64>,
    /// Train on this file's bytes (a token each) instead of synthetic ids a model learns in a
    /// few steps, so the compared losses say whether the runs agree.
    #[arg(long, value_name = "FILE")]
    text: Option<PathBuf>,
    /// Clip the gradients to this global L2 norm in both runs (holds the offloaded gradients).
    #[arg(long, value_name = "NORM")]
    clip_grad_norm: Option<f64>,
    /// The offloaded run holds its gradients until `step()` even without clipping.
    #[arg(long)]
    hold_gradients: bool,
    /// Hold the offloaded run's pinned buffers within this many GiB (OffloadAdamW::new_within).
    #[arg(long, value_name = "GIB")]
    pinned_limit_gib: Option<f64>,
    /// Write every number to this JSON file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// PyTorch's rows (python/offload_optim.py), after ferry's runs.
    #[command(flatten)]
    pytorch: PyTorchArgs,
}

const VOCAB: usize = 256;

/// One offloaded step on the host's clock, ms from the start of its forward: backward queued,
/// gradients sent and landed (first, last), the last upload queued, the CPU passes' and the
/// upload thread's busy time, `step()` returned, the GPU done.
const TIMELINE: [&str; 10] = [
    "backward", "sent", "sent_end", "landed", "landed_end", "stepped", "busy", "queuing",
    "returned", "synced",
];

fn timeline(start: Instant, backward: Instant, t: &StepTimeline, synced: f64) -> [f64; 10] {
    let ms = |at: Instant| at.saturating_duration_since(start).as_secs_f64() * 1e3;
    let span = |s: Option<(Instant, Instant)>| {
        s.map_or((f64::NAN, f64::NAN), |(a, b)| (ms(a), ms(b)))
    };
    let (sent, landed) = (span(t.sent), span(t.landed));
    let at = |i: Option<Instant>| i.map_or(f64::NAN, ms);
    let (busy, queuing) = (t.busy.as_secs_f64() * 1e3, t.queuing.as_secs_f64() * 1e3);
    [
        ms(backward), sent.0, sent.1, landed.0, landed.1, at(t.stepped), busy, queuing,
        at(t.returned), synced,
    ]
}

struct Run {
    steps: Measured,
    /// How long `step()` held the training thread (for offload: waiting for the CPU's steps).
    step_calls: Measured,
    timelines: Vec<[f64; 10]>,
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
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for row in 0..rows {
        // A window of seq + 1 tokens: the input is its first seq, the targets its last seq.
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
                timelines.push(timeline(start, stepping, &offload.last_timeline(), ms));
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

fn gib_cell(bytes: usize) -> Cell {
    Cell::text(gib_text(bytes)).recorded(json!(bytes))
}

fn ms_text(ms: f64) -> String {
    format!("{} ms", significant(ms))
}

/// `--text`'s bytes, long enough for two sequences.
fn read_text(path: &Path, seq: usize) -> Result<Vec<u8>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("--text {}: {e}", path.display()))?;
    match bytes.len() > 2 * (seq + 1) {
        true => Ok(bytes),
        false => Err(format!(
            "--text {}: {} bytes, too short for sequences of {seq} tokens",
            path.display(),
            bytes.len(),
        )),
    }
}

pub fn run(args: OffloadOptimArgs) -> Result<(), Box<dyn Error>> {
    let Some(dev) = harness::cuda_device_or_say(0, |err| {
        format!(
            "{NO_CUDA_DEVICE} ({err}): ferry bench offload-optim trains on a GPU; nothing to measure here"
        )
    }) else {
        return Ok(());
    };
    let mut title = vec![format!(
        "ferry bench offload-optim: GPT {} layers x {} wide, batch {} x {} tokens, bf16 autocast, \
         fp32 weights; median of {} steps after {} untimed",
        args.layers, args.width, args.batch, args.seq, args.samples, args.warmup
    )];
    if let Some(gib) = args.device_budget_gib {
        dev.set_budget(Some(gib_bytes(gib)));
        title.push(format!("device budget: {gib} GiB"));
    }
    let text = args.text.as_deref().map(|p| read_text(p, args.seq)).transpose()?;
    if let (Some(path), Some(text)) = (&args.text, &text) {
        let (path, size) = (path.display(), gib_text(text.len()));
        title.push(format!("tokens: the bytes of {path} ({size}), consecutive windows"));
    }
    if let Some(max_norm) = args.clip_grad_norm {
        title.push(format!("gradients clipped to a global norm of {max_norm} in both runs"));
    }
    let offloaded = match args.delayed_update {
        true => "OffloadAdamW, delayed update",
        false => "OffloadAdamW",
    };
    let mut notes = Vec::new();
    let mut outcome = |offload: bool| match train(&args, text.as_deref(), &dev, offload) {
        Ok(run) => Some(run),
        Err(err) => {
            let name = if offload { "OffloadAdamW" } else { "AdamW on the GPU" };
            notes.push(format!("{name}: {err}"));
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
    title.push(format!(
        "{:.3} B parameters: fp32 training state (weights, gradients, Adam's moments) {}",
        params as f64 / 1e9,
        gib_text(16 * params)
    ));

    let tokens = (args.batch * args.seq) as f64;
    let mut runs = Table::new(&[
        "run", "step", "step() call", "tokens/s", "device peak", "pinned", "host state",
    ]);
    for (name, r) in [("AdamW on the GPU", &gpu), (offloaded, &off)] {
        let Some(r) = r else { continue };
        let timelines: Vec<Map<String, Value>> = r
            .timelines
            .iter()
            .map(|t| TIMELINE.iter().map(|k| k.to_string()).zip(t.map(|x| json!(x))).collect())
            .collect();
        runs.push_with(
            vec![
                Cell::text(name),
                Cell::median_shown(&r.steps, ms_text),
                Cell::median_shown(&r.step_calls, ms_text),
                Cell::number(r.steps.median().map(|ms| tokens / ms * 1e3)),
                gib_cell(r.peak),
                gib_cell(r.pinned),
                gib_cell(r.host_state),
            ],
            json!({ "losses": r.losses, "timelines": timelines, "staging": r.staging }),
        );
    }
    let mut report = Report::new("offload-optim", title.join("\n")).with_facts(json!({
        "layers": args.layers, "width": args.width, "batch": args.batch, "seq": args.seq,
        "params": params, "device_budget_gib": args.device_budget_gib,
    }));
    report.table("runs", None, runs);
    notes.extend(off.as_ref().and_then(|r| r.staging.clone()));
    if let Some(off) = &off.as_ref().filter(|r| !r.timelines.is_empty()) {
        let field = |i: usize| off.timelines.iter().map(|t| t[i]).collect::<Vec<_>>();
        let t: Vec<String> = (0..TIMELINE.len())
            .map(|i| significant(median(&field(i)).unwrap_or(f64::NAN)))
            .collect();
        notes.push(format!(
            "one offloaded step on the host's clock, ms from the start of forward (medians): \
             forward and backward queued by {}; gradients sent {}-{}; landed {}-{}; the CPU \
             passes {} ms, the upload thread's {} ms, the last upload queued at {}; step() \
             returned at {}; the GPU done at {}",
            t[0], t[1], t[2], t[3], t[4], t[6], t[7], t[5], t[8], t[9]
        ));
    }
    if let (Some(gpu), Some(off)) = (&gpu, &off) {
        notes.extend(compare_runs(gpu, off));
    }
    for note in notes {
        report.note(note);
    }
    if args.pytorch.compare_pytorch {
        let medians = |r: &Option<Run>| r.as_ref().and_then(|r| r.steps.median());
        let ferry_ms = medians(&gpu).zip(medians(&off));
        match run_pytorch(&args) {
            Ok(doc) => {
                report = report.with_facts(json!({ "pytorch": doc }));
                pytorch_rows(&mut report, &doc, ferry_ms);
            }
            Err(err) => {
                report = report.with_facts(json!({ "pytorch": { "error": err } }));
                report.note(format!("no PyTorch rows: {err}"));
            }
        }
    }
    report.finish(args.json.as_deref())
}

/// The throughput with offload, the device peak it saved and how far the two runs' losses
/// differ, over the whole run and its first steps.
fn compare_runs(gpu: &Run, off: &Run) -> Vec<String> {
    let (a, b) = (
        gpu.steps.median().unwrap_or(f64::NAN),
        off.steps.median().unwrap_or(f64::NAN),
    );
    let relative: Vec<f64> = (gpu.losses.iter().zip(&off.losses))
        .map(|(x, y)| ((x - y) / x).abs())
        .collect();
    let worst = |n: usize| relative[..n].iter().copied().fold(0.0f64, f64::max);
    let last = |r: &Run| r.losses.last().map_or("-".into(), |l| format!("{l:.4}"));
    let mut lines = vec![format!(
        "throughput with offload: {}% of the all-GPU run's (goal >= 90%); device peak {} \
         lower; losses over {} steps within {:.2e} relative (goal <= 1e-3), last {} and {}",
        significant(100.0 * a / b),
        gib_text(gpu.peak.saturating_sub(off.peak)),
        gpu.losses.len().min(off.losses.len()),
        worst(relative.len()),
        last(gpu),
        last(off),
    )];
    if !relative.is_empty() {
        let windows: Vec<String> = [10, 50, 100, 200, 500]
            .into_iter()
            .filter(|&n| n < relative.len())
            .chain([relative.len()])
            .map(|n| {
                let at = |r: &Run| r.losses.get(n - 1).map_or(f64::NAN, |l| *l);
                format!("steps 1-{n}: {:.2e} (losses {:.4} / {:.4})", worst(n), at(gpu), at(off))
            })
            .collect();
        lines.push(format!("worst relative loss difference, {}", windows.join("; ")));
    }
    lines
}

/// Runs python/offload_optim.py once: the same GPT at the same batch with torch's fused AdamW
/// on the GPU, the simple offload and torchao's CPUOffloadOptimizer; its document, or why none.
fn run_pytorch(args: &OffloadOptimArgs) -> Result<Value, String> {
    eprintln!("running {}/offload_optim.py ...", pytorch::SCRIPT_DIR);
    let script =
        pytorch::locate_script(args.pytorch.pytorch_script.as_deref(), "offload_optim.py")?;
    let (layers, width, batch, seq) = (args.layers, args.width, args.batch, args.seq);
    let (samples, warmup) = (args.samples, args.warmup);
    let argv = format!(
        "--layers {layers} --width {width} --batch {batch} --seq {seq} \
         --samples {samples} --warmup {warmup}"
    );
    let argv: Vec<String> = argv.split(' ').map(String::from).collect();
    pytorch::run_once(&args.pytorch.python, &script, &argv, &[])
}

/// A row's median step in ms, when it ran.
fn median_ms(row: &Value) -> Option<f64> {
    let samples: Vec<f64> = row.get("ms")?.as_array()?.iter().filter_map(Value::as_f64).collect();
    median(&samples)
}

/// PyTorch's rows, each against torch's AdamW on the GPU, then ferry's offloaded step
/// (`ferry_ms`: ferry's all-GPU and offloaded medians) against PyTorch's fastest offload. The
/// two all-GPU steps differ (their kernels), so each offload is judged against its own.
fn pytorch_rows(report: &mut Report, doc: &Value, ferry_ms: Option<(f64, f64)>) {
    let rows = doc.get("rows").and_then(Value::as_array).cloned().unwrap_or_default();
    let name = |row: &Value| row.get("name").and_then(Value::as_str).unwrap_or("?").to_string();
    let base = rows.first().and_then(median_ms);
    let mut table = Table::new(&[
        "run",
        "step",
        "of torch's AdamW on the GPU (throughput)",
        "added to its step",
        "device peak",
    ]);
    for row in &rows {
        let ms = median_ms(row);
        let error = row.get("error").and_then(Value::as_str).unwrap_or("no samples");
        let against = |f: fn(f64, f64) -> String| {
            Cell::text(ms.zip(base).map_or("-".into(), |(ms, b)| f(ms, b)))
        };
        let peak = row.get("peak_bytes").and_then(Value::as_u64).filter(|_| ms.is_some());
        table.push_with(
            vec![
                Cell::text(name(row)),
                ms.map_or_else(|| Cell::text(error), |ms| Cell::ms(Some(ms))),
                against(|ms, b| format!("{}%", significant(100.0 * b / ms))),
                against(|ms, b| ms_text(ms - b)),
                peak.map_or_else(|| Cell::number(None), |b| gib_cell(b as usize)),
            ],
            row.clone(),
        );
    }
    let torch = doc.get("torch").and_then(Value::as_str).unwrap_or("?");
    let heading = format!("PyTorch {torch}, the same GPT (tests/torch/gpt.py) at the same batch:");
    report.table("pytorch_runs", Some(heading), table);
    if let Some(note) = doc.get("note").and_then(Value::as_str) {
        report.note(note);
    }
    let fastest = rows
        .iter()
        .skip(1)
        .filter_map(|row| Some((name(row), median_ms(row)?)))
        .min_by(|a, b| a.1.total_cmp(&b.1));
    let compared = (ferry_ms, fastest, base);
    if let (Some((gpu, off)), Some((torch_name, torch_ms)), Some(base)) = compared {
        report.note(format!(
            "ferry's offload keeps {}% of ferry's all-GPU throughput and adds {} ms to its step; \
             PyTorch's fastest offload ({torch_name}) keeps {}% of torch's and adds {} ms; the \
             all-GPU steps: ferry {} ms, torch {} ms",
            significant(100.0 * gpu / off),
            significant(off - gpu),
            significant(100.0 * base / torch_ms),
            significant(torch_ms - base),
            significant(gpu),
            significant(base)
        ));
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_machine_without_a_gpu_says_so_and_succeeds() {
        let crate::BenchCommand::OffloadOptim(args) =
            crate::parse_bench("ferry bench offload-optim --layers 1 --width 64 --batch 1 --seq 8")
                .unwrap()
        else {
            panic!("not the offload-optim bench")
        };
        if crate::harness::cuda_device(0).is_err() {
            run(args).unwrap();
        }
    }

    #[test]
    fn pytorch_rows_without_samples_have_no_median() {
        assert_eq!(median_ms(&json!({ "ms": [3.0, 1.0, 2.0] })), Some(2.0));
        assert_eq!(median_ms(&json!({ "error": "out of GPU memory" })), None);
        assert_eq!(median_ms(&json!({ "ms": [] })), None);
        // A document missing what it should hold shows its rows as far as they go.
        let mut report = Report::new("offload-optim", "t");
        let doc = json!({ "rows": [
            { "name": "AdamW", "ms": [2.0], "peak_bytes": 1u64 << 30 },
            { "ms": "?" },
            { "name": "torchao", "ms": [4.0], "error": "x" },
        ] });
        pytorch_rows(&mut report, &doc, Some((1.0, 2.0)));
        let rows = &report.json()["pytorch_runs"];
        assert_eq!(rows[1]["step"], "no samples");
        assert_eq!(rows[2]["of_torch_s_adamw_on_the_gpu_throughput"], "50.0%");
        assert_eq!(rows[0]["device_peak"], 1u64 << 30);
        assert_eq!(report.json()["notes"][0].as_str().unwrap().split(';').count(), 3);
    }
}
