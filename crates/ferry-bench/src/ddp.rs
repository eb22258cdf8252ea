//! `ferry bench ddp`: training steps of the wide MLP (1024-4096-4096-10, fp32, Adam) on one GPU,
//! with [`DataParallel`] on one and on two GPUs and, with --compare-pytorch, PyTorch's DDP
//! (python/ddp.py) the same three ways. Weak scaling (`--batch` per replica); a row's step is
//! the median over steps of the slowest replica; after the last step the replicas' weights are
//! compared with rank 0's. `--host` runs it on the CPU ([`ProcessGroup::host`], a small MLP).

use std::error::Error;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use ferry::distributed::{self, DataParallel, DdpOptions, DdpStats, ProcessGroup, run_replicas};
use ferry::memory::cuda::{self, CudaDevice};
use ferry::nn::{Sequential, cross_entropy};
use ferry::optim::Adam;
use ferry::prelude::*;
use serde_json::{Value, json};

use super::train::LR;
use crate::Measured;
use crate::harness;
use crate::harness::goal::{Bound, Goal, Judged};
use crate::harness::pytorch::{self, PyTorchArgs};
use crate::harness::report::{format_ratio, significant};
use crate::harness::table::{Cell, Report, Table};

#[cfg(test)]
mod tests;

/// The wide MLP of `ferry bench train`, input first.
const GPU_WIDTHS: &[usize] = &[1024, 4096, 4096, 10];
/// `--host`'s MLP: small enough for a CPU step in milliseconds.
const HOST_WIDTHS: &[usize] = &[32, 64, 64, 10];
const CLASSES: usize = 10;

/// The rows, as python/ddp.py names them: (id, replicas, wrapped in DataParallel).
const ROWS: [(&str, usize, bool); 3] = [
    ("plain_1", 1, false),
    ("ddp_1", 1, true),
    ("ddp_2", 2, true),
];

/// `ferry bench ddp`'s options.
#[derive(Args, Debug)]
pub struct DdpArgs {
    #[command(flatten)]
    pytorch: PyTorchArgs,
    /// Write every number, every step's time included, to this JSON file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Samples per replica per step [default: 1024 on GPUs, 32 with --host].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    batch: Option<u64>,
    /// Timed steps per row; the table shows their median.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..))]
    steps: u32,
    /// Untimed steps per row before the timed ones.
    #[arg(long, default_value_t = 10)]
    warmup: u32,
    /// Gradient bucket size in MiB (ferry's DdpOptions::bucket_bytes and PyTorch's
    /// bucket_cap_mb).
    #[arg(long, default_value_t = 25.0, value_name = "MIB")]
    bucket_mib: f64,
    /// Run on the CPU: ranks are threads (ProcessGroup::host) and the MLP is 32-64-64-10.
    #[arg(long, conflicts_with = "compare_pytorch")]
    host: bool,
}

/// What every row runs: the MLP's widths (input first), the batch per replica, the timed and
/// untimed steps, [`DdpOptions::bucket_bytes`], and whether ranks are host threads (`--host`).
#[derive(Debug, Clone, Copy)]
pub struct Config {
    pub widths: &'static [usize],
    pub batch: usize,
    pub steps: u32,
    pub warmup: u32,
    pub bucket_bytes: usize,
    pub host: bool,
}

/// One replica's run: per-step milliseconds, its last loss, its weights after the last step.
struct ReplicaOut {
    step_ms: Vec<f64>,
    loss: f64,
    weights: Vec<Vec<f32>>,
    /// The last step's [`DataParallel::finish`] report (DDP rows).
    stats: Option<DdpStats>,
}

/// One row of one side, as measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// `plain_1`, `ddp_1` or `ddp_2`, as python/ddp.py names them.
    pub id: &'static str,
    /// Replicas (GPUs, or host threads with `--host`).
    pub replicas: usize,
    /// Per timed step, the slowest replica's milliseconds; the error is why the row has no
    /// numbers (or why they mean nothing).
    pub steps: Measured,
    /// Rank 0's loss after the last step.
    pub final_loss: Option<f64>,
    /// The largest |w - w_rank0| over every weight of every other replica (`None` for one
    /// replica, where there is nothing to compare).
    pub max_weight_diff: Option<f64>,
    /// Rank 0's last step: buckets all-reduced, and how many of them backward started.
    pub buckets: Option<(usize, usize)>,
}

impl Row {
    fn failed(id: &'static str, replicas: usize, error: String) -> Self {
        Self {
            id,
            replicas,
            steps: Measured::failed(error),
            final_loss: None,
            max_weight_diff: None,
            buckets: None,
        }
    }

    /// The median step time; `None` without steps.
    pub fn median_ms(&self) -> Option<f64> {
        self.steps.median()
    }

    /// Samples a second over all replicas at the median step time.
    pub fn samples_per_s(&self, batch: usize) -> Option<f64> {
        self.median_ms()
            .map(|ms| (self.replicas * batch) as f64 / (ms / 1e3))
    }
}

/// The MLP on `device`, and this replica's batch, made with this thread's seed.
fn build(
    widths: &[usize],
    batch: usize,
    device: Device,
    seed: u64,
) -> ferry::Result<(Sequential, Tensor, Tensor)> {
    ferry::manual_seed(seed);
    let model = ferry::models::mlp(widths, 0.0, device)?;
    let x = Tensor::randn(&[batch, widths[0]], DType::F32, device)?;
    let y = Tensor::rand(&[batch], DType::F32, device)?
        .mul_scalar(CLASSES as f64)?
        .to_dtype(DType::I64)?;
    Ok((model, x, y))
}

/// Waits for every stream of the replica's GPU (the compute and the collectives' streams); on
/// the CPU there is nothing to wait for.
fn synchronize(cuda: Option<&CudaDevice>) -> ferry::Result<()> {
    match cuda {
        Some(dev) => Ok(dev.synchronize()?),
        None => Ok(()),
    }
}

/// One replica's steps: warm-up, then timed steps, each ending with a synchronize. `group` wraps
/// the parameters in [`DataParallel`]; without it the model trains alone. Every replica gets
/// its own seed, so its initial weights and batch differ from the others' (DataParallel's
/// broadcast and averaged gradients must make the weights equal).
fn replica(cfg: &Config, device: Device, group: Option<ProcessGroup>) -> ferry::Result<ReplicaOut> {
    let rank = group.as_ref().map_or(0, ProcessGroup::rank);
    let (model, x, y) = build(cfg.widths, cfg.batch, device, 1 + rank as u64)?;
    let ddp = match group {
        Some(group) => {
            let options = DdpOptions {
                bucket_bytes: cfg.bucket_bytes,
            };
            Some(DataParallel::new(model.parameters(), group, options)?)
        }
        None => None,
    };
    let mut opt = Adam::new(model.parameters(), LR)?;
    let cuda = match device {
        Device::Cuda(ordinal) => Some(crate::harness::cuda_device(ordinal)?),
        Device::Cpu => None,
    };
    let mut step_ms = Vec::with_capacity(cfg.steps as usize);
    let mut loss = None;
    let mut stats = None;
    synchronize(cuda.as_ref())?;
    for i in 0..cfg.warmup + cfg.steps {
        let start = Instant::now();
        opt.zero_grad();
        let l = cross_entropy(&model.forward(&x)?, &y)?;
        l.backward()?;
        if let Some(ddp) = &ddp {
            stats = Some(ddp.finish()?);
        }
        opt.step()?;
        synchronize(cuda.as_ref())?;
        if i >= cfg.warmup {
            step_ms.push(start.elapsed().as_secs_f64() * 1e3);
        }
        loss = Some(l.detach());
    }
    let loss = match loss {
        Some(l) => l.item()?,
        None => f64::NAN,
    };
    let weights = model
        .parameters()
        .iter()
        .map(|p| p.to_vec::<f32>())
        .collect::<ferry::Result<_>>()?;
    Ok(ReplicaOut {
        step_ms,
        loss,
        weights,
        stats,
    })
}

/// Per step, the slowest replica; rank 0's loss; the largest weight difference from rank 0.
fn combine(id: &'static str, outs: Vec<ReplicaOut>) -> Row {
    let replicas = outs.len();
    let steps = outs.iter().map(|o| o.step_ms.len()).min().unwrap_or(0);
    let step_ms = (0..steps)
        .map(|s| outs.iter().map(|o| o.step_ms[s]).fold(0.0, f64::max))
        .collect();
    let max_weight_diff = outs.first().filter(|_| replicas > 1).map(|first| {
        let mut diff = 0.0f64;
        for other in &outs[1..] {
            for (a, b) in first.weights.iter().zip(&other.weights) {
                if a.len() != b.len() {
                    return f64::INFINITY;
                }
                for (x, y) in a.iter().zip(b) {
                    diff = diff.max(f64::from((x - y).abs()));
                }
            }
        }
        diff
    });
    Row {
        id,
        replicas,
        steps: Measured::from_samples(step_ms),
        final_loss: outs.first().map(|o| o.loss),
        max_weight_diff,
        buckets: outs
            .first()
            .and_then(|o| o.stats)
            .map(|s| (s.buckets, s.started_in_backward)),
    }
}

/// The groups of a DDP row: NCCL over cuda:0..n, or n host threads.
fn groups(cfg: &Config, replicas: usize) -> ferry::Result<Vec<ProcessGroup>> {
    if cfg.host {
        return Ok(ProcessGroup::host(replicas));
    }
    let devices: Vec<Device> = (0..replicas).map(Device::Cuda).collect();
    ProcessGroup::nccl(&devices)
}

/// ferry's rows. `gpus` is how many devices the rows may use (`ddp_2` needs two); with
/// `cfg.host` they are threads.
pub fn measure(cfg: &Config, gpus: usize) -> Vec<Row> {
    let home = if cfg.host {
        Device::Cpu
    } else {
        Device::Cuda(0)
    };
    ROWS.iter()
        .map(|&(id, replicas, wrapped)| {
            if replicas > gpus {
                return Row::failed(
                    id,
                    replicas,
                    format!(
                        "needs {replicas} GPUs; this machine has {gpus} (run it on nvidia-h200-x2)"
                    ),
                );
            }
            eprintln!("measuring {id} ...");
            let outs = if wrapped {
                groups(cfg, replicas).and_then(|g| {
                    run_replicas(g, |group| {
                        let device = group.device();
                        replica(cfg, device, Some(group))
                    })
                })
            } else {
                replica(cfg, home, None).map(|out| vec![out])
            };
            match outs {
                Ok(outs) => {
                    let mut row = combine(id, outs);
                    if let Some(loss) = row.final_loss.filter(|l| !l.is_finite()) {
                        row.steps.fail(format!(
                            "the loss became {loss}: the step times mean nothing"
                        ));
                    }
                    row
                }
                Err(err) => Row::failed(id, replicas, err.to_string()),
            }
        })
        .collect()
}

/// Why the GPU rows cannot run here (no driver, no GPU, no libnccl), or how many GPUs there are.
fn gpus_available(found: Result<usize, String>, nccl: bool) -> Result<usize, String> {
    match found {
        Err(err) => Err(format!(
            "ferry bench ddp needs a CUDA device and libnccl: {err}. `--host` runs the same \
             loop on the CPU"
        )),
        Ok(0) => Err(
            "ferry bench ddp needs a CUDA device (none found). `--host` runs the same loop on \
             the CPU"
                .into(),
        ),
        Ok(_) if !nccl => Err(
            "ferry bench ddp needs NCCL: libnccl.so.2 was not found (install libnccl2, e.g. \
             `apt install libnccl2`, or add its directory to LD_LIBRARY_PATH)"
                .into(),
        ),
        Ok(n) => Ok(n),
    }
}

/// PyTorch's rows from python/ddp.py's one JSON line.
fn parse_pytorch(doc: &Value) -> Result<(String, Vec<Row>), String> {
    if let Some(err) = doc.get("error") {
        return Err(err.as_str().unwrap_or("unknown error").to_string());
    }
    let text = |key: &str| doc.get(key).and_then(Value::as_str).unwrap_or("?");
    let label = format!(
        "PyTorch {} (CUDA {}, NCCL {}) on {}",
        text("torch"),
        text("cuda"),
        text("nccl"),
        text("device")
    );
    let rows = ROWS
        .iter()
        .map(|&(id, replicas, _)| {
            let row = doc.get("rows").and_then(|r| r.get(id));
            let error = doc
                .get("errors")
                .and_then(|e| e.get(id))
                .and_then(Value::as_str);
            match (row, error) {
                (Some(row), _) => {
                    let step_ms: Vec<f64> = row
                        .get("step_ms")
                        .and_then(Value::as_array)
                        .map(|a| a.iter().filter_map(Value::as_f64).collect())
                        .unwrap_or_default();
                    if step_ms.is_empty() {
                        return Row::failed(id, replicas, "no step times in its answer".into());
                    }
                    Row {
                        id,
                        replicas,
                        steps: Measured::from_samples(step_ms),
                        final_loss: row.get("final_loss").and_then(Value::as_f64),
                        max_weight_diff: None,
                        buckets: None,
                    }
                }
                (None, Some(err)) => Row::failed(id, replicas, err.to_string()),
                (None, None) => Row::failed(id, replicas, "not in its answer".into()),
            }
        })
        .collect();
    Ok((label, rows))
}

/// The script's arguments for the same rows as ferry's.
fn pytorch_args(cfg: &Config, bucket_mib: f64) -> Vec<String> {
    let (batch, steps, warmup) = (cfg.batch, cfg.steps, cfg.warmup);
    format!("--batch {batch} --steps {steps} --warmup {warmup} --bucket-mib {bucket_mib}")
        .split(' ')
        .map(String::from)
        .collect()
}

/// Runs ddp.py once (it starts one process per GPU itself) and reads its rows.
/// NCCL_NVLS_ENABLE=0 unless set.
fn run_pytorch(
    python: &str,
    script: &std::path::Path,
    args: &[String],
) -> Result<(String, Vec<Row>), String> {
    pytorch::run_once(python, script, args, &[("NCCL_NVLS_ENABLE", "0")])
        .and_then(|doc| parse_pytorch(&doc))
}

fn config(args: &DdpArgs) -> Result<Config, String> {
    if !(args.bucket_mib.is_finite() && args.bucket_mib > 0.0) {
        return Err(format!(
            "--bucket-mib {} must be a positive number of MiB, e.g. --bucket-mib 25",
            args.bucket_mib
        ));
    }
    let default_batch = if args.host { 32 } else { 1024 };
    let batch = usize::try_from(args.batch.unwrap_or(default_batch))
        .map_err(|_| "--batch is larger than this machine can address".to_string())?;
    Ok(Config {
        widths: if args.host { HOST_WIDTHS } else { GPU_WIDTHS },
        batch,
        steps: args.steps,
        warmup: args.warmup,
        bucket_bytes: ((args.bucket_mib * 1024.0 * 1024.0) as usize).max(1),
        host: args.host,
    })
}

pub fn run(args: DdpArgs) -> Result<(), Box<dyn Error>> {
    let cfg = config(&args)?;
    let (device, gpus) = if cfg.host {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        (format!("cpu ({threads} threads), host process group"), 2)
    } else {
        let found = cuda::devices().map(|d| d.len()).map_err(|e| e.to_string());
        match gpus_available(found, distributed::nccl_present()) {
            Ok(n) => {
                let name = crate::harness::cuda_device(0)
                    .map_or_else(|e| e.to_string(), |d| d.info().name.clone());
                (format!("{n} x {name}"), n)
            }
            Err(why) => {
                let doc = json!({ "bench": "ddp", "skipped": why });
                return harness::skip(&why, args.json.as_deref(), &doc);
            }
        }
    };
    let ferry = measure(&cfg, gpus);
    let mut torch = Err(None);
    if args.pytorch.compare_pytorch {
        eprintln!("running {}/ddp.py ...", pytorch::SCRIPT_DIR);
        let (python, script) = (&args.pytorch.python, &args.pytorch.pytorch_script);
        torch = pytorch::locate_script(script.as_deref(), "ddp.py")
            .and_then(|script| run_pytorch(python, &script, &pytorch_args(&cfg, args.bucket_mib)))
            .map_err(Some);
    }
    let widths: Vec<String> = cfg.widths.iter().map(usize::to_string).collect();
    let mut title = format!(
        "ferry bench ddp: MLP {} (fp32, Adam), batch {} per replica, buckets {} MiB, on {device}",
        widths.join("-"),
        cfg.batch,
        significant(args.bucket_mib)
    );
    if let Ok((label, _)) = &torch {
        title = format!("{title}\n{label}");
    }
    let mut report = report(&cfg, &device, torch.as_ref().ok(), &ferry, title);
    if let Err(Some(err)) = &torch {
        report.note(format!("no PyTorch column: {err}"));
    }
    report.finish(args.json.as_deref())
}

/// The two goals: efficiency >= 0.9 and ferry's two-GPU step no slower than PyTorch's.
const GOALS: [Goal; 2] = [
    Goal {
        name: "scaling efficiency on 2 GPUs >= 0.9",
        metric: "ferry_scaling_efficiency",
        bound: Bound::AtLeast(0.9),
    },
    Goal {
        name: "2-GPU step time <= PyTorch DDP's",
        metric: "ddp_2 median_ms, ferry / PyTorch",
        bound: Bound::AtMost(1.0),
    },
];

/// Two-replica samples/s over twice the one-GPU (plain) samples/s.
fn scaling_efficiency(rows: &[Row], batch: usize) -> Option<f64> {
    let one = find(rows, "plain_1")?.samples_per_s(batch)?;
    let two = find(rows, "ddp_2")?.samples_per_s(batch)?;
    Some(two / (2.0 * one))
}

fn find<'a>(rows: &'a [Row], id: &str) -> Option<&'a Row> {
    rows.iter().find(|r| r.id == id)
}

/// [`GOALS`] judged on ferry's rows and PyTorch's.
fn goals(ferry: &[Row], torch: Option<&[Row]>, batch: usize) -> Vec<Judged> {
    let efficiency = scaling_efficiency(ferry, batch);
    let ours = find(ferry, "ddp_2").and_then(Row::median_ms);
    let theirs = torch.and_then(|rows| find(rows, "ddp_2")?.median_ms());
    let step = match (ours, theirs) {
        (Some(f), Some(t)) => format!(
            "{} ms vs {} ms ({})",
            significant(f),
            significant(t),
            format_ratio(f, t)
        ),
        (Some(f), None) => format!("{} ms vs -", significant(f)),
        _ => "-".into(),
    };
    vec![
        GOALS[0].judge(efficiency, efficiency.map_or("-".into(), significant)),
        GOALS[1].judge(ours.zip(theirs).map(|(f, t)| f / t), step),
    ]
}

/// A side's step time: the median shown, every step recorded.
fn step_cell(row: Option<&Row>) -> Cell {
    let median = row.and_then(Row::median_ms);
    Cell::ms(median).recorded(row.map_or(Value::Null, |r| {
        json!({ "samples_ms": r.steps.samples_ms, "median_ms": median, "error": r.steps.error })
    }))
}

/// ferry's rows, PyTorch's beside them.
fn table(ferry: &[Row], torch: Option<&[Row]>, batch: usize) -> Table {
    let mut table = Table::new(&[
        "row",
        "replicas",
        "ferry step",
        "samples/s",
        "PyTorch step",
        "samples/s",
        "ferry/PyTorch",
        "buckets (in backward)",
        "replicas equal",
    ]);
    for ours in ferry {
        let theirs = torch.and_then(|rows| find(rows, ours.id));
        let rates = [Some(ours), theirs].map(|r| r.and_then(|r| r.samples_per_s(batch)));
        let (f, t) = (ours.median_ms(), theirs.and_then(Row::median_ms));
        let equal = ours.max_weight_diff.map(|d| d == 0.0);
        table.push_with(
            vec![
                Cell::text(ours.id),
                Cell::count(ours.replicas as u64),
                step_cell(Some(ours)),
                Cell::number(rates[0]),
                step_cell(theirs),
                Cell::number(rates[1]),
                Cell::ratio(f, t),
                Cell::text(ours.buckets.map_or("-".into(), |(all, early)| {
                    format!("{all} ({early})")
                }))
                .recorded(json!(ours.buckets.map(|b| json!({ "all": b.0, "in_backward": b.1 })))),
                Cell::text(match ours.max_weight_diff {
                    Some(0.0) => "yes".into(),
                    Some(d) => format!("NO (max diff {d:e})"),
                    None => "-".into(),
                })
                .recorded(json!(equal)),
            ],
            json!({
                "samples_per_s": { "ferry": rates[0], "pytorch": rates[1] },
                "final_loss": { "ferry": ours.final_loss, "pytorch": theirs.and_then(|r| r.final_loss) },
                "max_weight_diff": ours.max_weight_diff,
            }),
        );
    }
    table
}

fn report(
    cfg: &Config,
    device: &str,
    torch: Option<&(String, Vec<Row>)>,
    ferry: &[Row],
    title: String,
) -> Report {
    let batch = cfg.batch;
    let torch_rows = torch.map(|(_, rows)| rows.as_slice());
    let torch_efficiency = torch_rows.and_then(|rows| scaling_efficiency(rows, batch));
    let mut report = Report::new("ddp", title).with_facts(json!({
        "device": device,
        "host": cfg.host,
        "widths": cfg.widths,
        "batch_per_replica": batch,
        "steps": cfg.steps,
        "warmup": cfg.warmup,
        "bucket_bytes": cfg.bucket_bytes,
        "pytorch": torch.map(|(label, _)| label),
        "ferry_scaling_efficiency": scaling_efficiency(ferry, batch),
        "pytorch_scaling_efficiency": torch_efficiency,
    }));
    report.table("rows", None, table(ferry, torch_rows, batch));
    report.note(format!(
        "medians over {} steps after {} warm-up steps, each step synchronized and timed alone, \
         the slowest replica's time per step; batch {batch} per replica; ratio below 1: ferry \
         faster; buckets: all-reduced in the last step (started by backward itself)",
        cfg.steps, cfg.warmup
    ));
    if let Some(e) = torch_efficiency {
        report.note(format!("PyTorch DDP scaling efficiency: {}", significant(e)));
    }
    // The goals are for GPUs; --host checks the path, not the speed.
    if cfg.host {
        report.note("goals: judged on GPUs only (--host checks the data-parallel path, not speed)");
    } else {
        report.goals(goals(ferry, torch_rows, batch));
    }
    for (side, rows) in [("ferry", Some(ferry)), ("PyTorch", torch_rows)] {
        for row in rows.unwrap_or_default() {
            if let Some(err) = &row.steps.error {
                report.note(format!("{} ({side}): {err}", row.id));
            }
        }
    }
    report
}
