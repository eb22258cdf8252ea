//! `ferry bench checkpoint`: a GPU state dict saved (durably) and loaded by ferry through bounded
//! staging and, with --compare-pytorch, by torch.save/load and safetensors (python/checkpoint.py),
//! round by round, one file on disk at a time, loads from the page cache on both sides. Memory
//! per sample: ferry's own counters, the pools' peaks and the resident set's growth over a
//! baseline, as PyTorch's side measures it; loaded tensors are the result, not extra.

use std::error::Error;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use ferry::checkpoint::{self, CheckpointReport, LoadOptions, SaveOptions};
use ferry::memory::cuda::{CudaDevice, PinnedPool};
use ferry::{DType, Device, Tensor};
use serde_json::{Value, json};

use crate::harness;
use crate::harness::goal::{Bound, Goal};
use crate::harness::measure::median;
use crate::harness::pytorch::{PyTorch, PyTorchArgs};
use crate::harness::report::significant;
use crate::harness::table::{Cell, Report, Table};

mod asynchronous;

#[derive(Args, Debug)]
pub struct CheckpointArgs {
    #[command(flatten)]
    pytorch: PyTorchArgs,
    /// Write every sample of both sides to this JSON file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// GiB of the state dict: this many x 4 weights of 256 MiB, plus a few small tensors.
    #[arg(long, default_value_t = 10.0, value_parser = parse_gb)]
    gb: f64,
    /// ferry's staging bound, MiB (the goal: extra device and host memory each within it).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    staging_mib: u64,
    /// Timed rounds; the table shows medians of times and the largest memory figures.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    samples: u32,
    /// Untimed rounds before them.
    #[arg(long, default_value_t = 1)]
    warmup: u32,
    /// Where the files go (one of the dict's size at a time) [default: the temp dir].
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Checkpoint a GPT training with AdamW on the GPU with `save_async`, once per snapshot
    /// memory mode, instead: stall, steps during the save, snapshot and write rates.
    #[arg(long = "async")]
    asynchronous: bool,
    /// --async: the GPT's layers.
    #[arg(long, default_value_t = 16)]
    layers: usize,
    /// --async: the GPT's width (heads of 128).
    #[arg(long, default_value_t = 2048)]
    width: usize,
    /// --async: sequences per batch.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// --async: tokens per sequence.
    #[arg(long, default_value_t = 1024)]
    seq: usize,
    /// --async: the bounded mode's cap on snapshot memory, MiB.
    #[arg(long, default_value_t = 2048)]
    bound_mib: u64,
}

fn parse_gb(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(gb) if gb.is_finite() && gb > 0.0 && gb <= 4096.0 => Ok(gb),
        _ => Err(format!(
            "{text:?} is not a size in GiB between 0 and 4096 (e.g. 10 or 0.5)"
        )),
    }
}

/// Side length of the large weights: 8192 x 8192 f32 = 256 MiB.
const SIDE: usize = 8192;

/// The dict python/checkpoint.py builds too: `round(gb * 4)` weights of 256 MiB, four biases, an
/// f16 embedding and an i64 step.
fn build_dict(gb: f64, gpu: Device) -> ferry::Result<Vec<(String, Tensor)>> {
    let large = ((gb * 4.0 + 0.5).floor() as usize).max(1);
    let mut dict = Vec::with_capacity(large + 6);
    for i in 0..large {
        let w = Tensor::randn(&[SIDE, SIDE], DType::F32, gpu)?;
        dict.push((format!("layers.{i}.weight"), w));
    }
    for i in 0..4 {
        let b = Tensor::randn(&[SIDE], DType::F32, gpu)?;
        dict.push((format!("layers.{i}.bias"), b));
    }
    let embed = Tensor::randn(&[4096, 4096], DType::F32, gpu)?.to_dtype(DType::F16)?;
    dict.push(("embed.weight".into(), embed));
    dict.push(("step".into(), Tensor::full(&[], 7.0, DType::I64, gpu)?));
    Ok(dict)
}

/// One sample of one row.
#[derive(Debug, Clone, Default)]
struct Sample {
    ms: f64,
    /// Extra device memory: ferry's counter, or PyTorch's allocator peak over its baseline.
    extra_device: Option<f64>,
    /// Extra host memory: ferry's counter, or PyTorch's resident growth.
    extra_host: Option<f64>,
    /// Growth of the resident set (both sides).
    resident: Option<f64>,
    /// ferry only: the device allocator's and the pinned pool's peaks over their baseline.
    allocator: Option<f64>,
    pinned: Option<f64>,
}

impl Sample {
    fn json(&self) -> Value {
        json!({
            "ms": self.ms,
            "extra_device_bytes": self.extra_device,
            "extra_host_bytes": self.extra_host,
            "resident_growth_bytes": self.resident,
            "device_allocator_growth_bytes": self.allocator,
            "pinned_pool_growth_bytes": self.pinned,
        })
    }
}

/// A row of the table: its samples, or why it has none.
struct Row {
    id: &'static str,
    name: &'static str,
    /// Whether the row is a save (compared with ferry's save) or a load.
    save: bool,
    samples: Vec<Sample>,
    error: Option<String>,
}

impl Row {
    fn new(id: &'static str, name: &'static str, save: bool) -> Self {
        Self {
            id,
            name,
            save,
            samples: Vec::new(),
            error: None,
        }
    }

    fn median_ms(&self) -> Option<f64> {
        median(&self.samples.iter().map(|s| s.ms).collect::<Vec<_>>())
    }

    /// The largest value of a memory figure over the samples.
    fn most(&self, figure: impl Fn(&Sample) -> Option<f64>) -> Option<f64> {
        self.samples.iter().filter_map(figure).reduce(f64::max)
    }
}

/// `VmRSS:` / `VmHWM:` of this process in bytes.
fn status(field: &str) -> Option<f64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix(field))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb * 1024.0)
}

/// The process-wide baselines a ferry sample is measured from. This is the bench's own
/// process, so it may restart the peaks (library code never does).
struct Baseline {
    device: usize,
    pinned: usize,
    resident: Option<f64>,
}

impl Baseline {
    fn take(dev: &CudaDevice, pool: &PinnedPool) -> Result<Self, Box<dyn Error>> {
        dev.synchronize()?;
        dev.reset_peak();
        pool.reset_peak();
        let resident = std::fs::write("/proc/self/clear_refs", "5")
            .ok()
            .and_then(|()| status("VmRSS:"));
        Ok(Self {
            device: dev.memory_stats().allocated_bytes,
            pinned: pool.stats().allocated_bytes,
            resident,
        })
    }

    /// The sample of a call that took `ms` and reported `report`; `results` bytes of the
    /// device allocator's growth are the call's result, not extra.
    fn sample(
        &self,
        ms: f64,
        report: &CheckpointReport,
        results: usize,
        dev: &CudaDevice,
        pool: &PinnedPool,
    ) -> Sample {
        let (allocator, pinned, resident) = self.growth(dev, pool);
        Sample {
            ms,
            extra_device: Some(report.peak_extra_device_bytes as f64),
            extra_host: Some(report.peak_extra_host_bytes as f64),
            resident,
            allocator: Some((allocator - results as f64).max(0.0)),
            pinned: Some(pinned),
        }
    }

    /// (device allocator, pinned pool, resident) growth since the baseline.
    fn growth(&self, dev: &CudaDevice, pool: &PinnedPool) -> (f64, f64, Option<f64>) {
        let device = dev
            .memory_stats()
            .peak_allocated_bytes
            .saturating_sub(self.device);
        let pinned = pool
            .stats()
            .peak_allocated_bytes
            .saturating_sub(self.pinned);
        let resident = self
            .resident
            .zip(status("VmHWM:"))
            .map(|(before, hwm)| (hwm - before).max(0.0));
        (device as f64, pinned as f64, resident)
    }
}

/// ferry's side of one round: a durable save, then a load onto the GPU; the file is deleted.
fn ferry_round(
    dict: &[(String, Tensor)],
    path: &Path,
    staging: usize,
    dev: &CudaDevice,
    pool: &PinnedPool,
) -> Result<(Sample, Sample), Box<dyn Error>> {
    let gpu = dev.device();
    let _ = std::fs::remove_file(path);
    let base = Baseline::take(dev, pool)?;
    let t0 = Instant::now();
    let report = checkpoint::save_with(
        path,
        dict,
        SaveOptions {
            staging_bytes: staging,
        },
    )?;
    let save = base.sample(t0.elapsed().as_secs_f64() * 1e3, &report, 0, dev, pool);

    let base = Baseline::take(dev, pool)?;
    let t0 = Instant::now();
    let (loaded, report) = checkpoint::load_to(
        path,
        gpu,
        LoadOptions {
            staging_bytes: staging,
        },
    )?;
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    let results: usize = loaded
        .iter()
        .map(|(_, t)| CudaDevice::block_size(t.nbytes()))
        .sum();
    let load = base.sample(ms, &report, results, dev, pool);
    check_loaded(dict, &loaded)?;
    drop(loaded);
    std::fs::remove_file(path)?;
    Ok((save, load))
}

/// The loaded dict has every name and shape, on the GPU, and the first weight's first rows.
fn check_loaded(dict: &[(String, Tensor)], loaded: &[(String, Tensor)]) -> ferry::Result<()> {
    let wrong = |what: String| ferry::TensorError::InvalidArgument {
        op: "bench checkpoint",
        message: format!("the loaded state dict differs from the saved one: {what}"),
    };
    if loaded.len() != dict.len() {
        return Err(wrong(format!(
            "{} tensors, {} saved",
            loaded.len(),
            dict.len()
        )));
    }
    for (name, t) in dict {
        let Some((_, got)) = loaded.iter().find(|(k, _)| k == name) else {
            return Err(wrong(format!("{name} is missing")));
        };
        if got.shape() != t.shape() || got.device() != t.device() {
            return Err(wrong(format!("{name} has another shape or device")));
        }
    }
    let (name, first) = &dict[0];
    let got = &loaded.iter().find(|(k, _)| k == name).expect("checked").1;
    if got.narrow(0, 0, 2)?.to_vec_f64()? != first.narrow(0, 0, 2)?.to_vec_f64()? {
        return Err(wrong(format!("{name} has other values")));
    }
    Ok(())
}

/// PyTorch's side: rows in the order they are requested each round.
const PYTORCH_ROWS: [(&str, &str, bool); 7] = [
    ("torch_save", "torch.save", true),
    ("torch_save_fsync", "torch.save + fsync", true),
    ("torch_load", "torch.load(map_location=cuda)", false),
    ("torch_load_mmap", "torch.load(.., mmap=True)", false),
    ("st_save", "safetensors save_file", true),
    ("st_save_fsync", "save_file + fsync", true),
    ("st_load", "safetensors load_file(cuda)", false),
];

fn pytorch_sample(reply: &Value, with_fsync: bool) -> Sample {
    let num = |k: &str| reply.get(k).and_then(Value::as_f64);
    let ms = num("ms").unwrap_or(f64::NAN)
        + if with_fsync {
            num("fsync_ms").unwrap_or(0.0)
        } else {
            0.0
        };
    Sample {
        ms,
        extra_device: num("extra_device"),
        extra_host: num("extra_host"),
        resident: num("extra_host"),
        ..Sample::default()
    }
}

/// PyTorch's side of one round; each case's reply fills its row(s), `plus_fsync` the durable one.
fn pytorch_round(torch: &mut PyTorch, rows: &mut [Row], timed: bool) {
    for (case, cleanup_after) in [
        ("torch_save", false),
        ("torch_load", false),
        ("torch_load_mmap", true),
        ("st_save", false),
        ("st_load", true),
    ] {
        let reply = torch.request(case);
        for row in rows.iter_mut() {
            let with_fsync = match row.id.strip_suffix("_fsync") {
                Some(plain) if plain == case => true,
                _ if row.id == case => false,
                _ => continue,
            };
            match &reply {
                Ok(v) if timed => row.samples.push(pytorch_sample(v, with_fsync)),
                Ok(_) => {}
                Err(e) => row.error = Some(e.clone()),
            }
        }
        if cleanup_after {
            let _ = torch.request("cleanup");
        }
    }
}

pub fn run(args: CheckpointArgs) -> Result<(), Box<dyn Error>> {
    let Some(dev) = harness::cuda_device_or_say(0, |err| {
        harness::without_cuda(
            err,
            "`ferry bench checkpoint` saves and loads a GPU state dict, so it needs a GPU; \
             nothing was measured",
        )
    }) else {
        return Ok(());
    };
    if args.asynchronous {
        return asynchronous::run(&args, &dev);
    }
    let pool = PinnedPool::global()?;
    let staging = usize::try_from(args.staging_mib << 20)?;
    let dir = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let path = dir.join(format!("ferry-bench-{}.safetensors", std::process::id()));
    let dict = build_dict(args.gb, dev.device())?;
    dev.synchronize()?;
    let bytes: usize = dict.iter().map(|(_, t)| t.nbytes()).sum();

    let mut torch = args.pytorch.side_with("checkpoint.py", "rows", |t| {
        let reply = t.request(&format!("setup {} {}", args.gb, dir.display()))?;
        match reply.get("bytes").and_then(Value::as_u64) {
            Some(b) if b as usize == bytes => Ok(()),
            other => Err(format!(
                "checkpoint.py built a dict of {other:?} bytes, ferry one of {bytes}: the two \
                 sides disagree"
            )),
        }
    });
    let mut title = format!(
        "checkpoint of {:.2} GiB ({} tensors) on {} ({}); ferry's staging bound {} MiB; files in {}",
        bytes as f64 / f64::from(1 << 30),
        dict.len(),
        dev.device(),
        dev.info().name,
        args.staging_mib,
        dir.display()
    );
    if let Some(label) = &torch.label {
        title += &format!("\nPyTorch {label}");
    }
    title += &format!(
        "\n{} round(s) after {} warm-up; times are medians, memory the largest of the samples",
        args.samples, args.warmup
    );

    let mut rows = vec![
        Row::new("ferry_save", "ferry save_with (durable)", true),
        Row::new("ferry_load", "ferry load_to(cuda)", false),
    ];
    if torch.torch.is_some() {
        rows.extend(
            PYTORCH_ROWS
                .iter()
                .map(|&(id, name, save)| Row::new(id, name, save)),
        );
    }
    for round in 0..args.warmup + args.samples {
        let timed = round >= args.warmup;
        eprintln!("round {} of {} ...", round + 1, args.warmup + args.samples);
        if rows[0].error.is_none() {
            match ferry_round(&dict, &path, staging, &dev, pool) {
                Ok((save, load)) if timed => {
                    rows[0].samples.push(save);
                    rows[1].samples.push(load);
                }
                Ok(_) => {}
                Err(err) => {
                    let _ = std::fs::remove_file(&path);
                    rows[0].error = Some(err.to_string());
                    rows[1].error = Some(err.to_string());
                }
            }
        }
        if let Some(t) = torch.torch() {
            pytorch_round(t, &mut rows[2..], timed);
        }
    }
    drop(torch.torch.take());
    let mut report = report(title, &rows, bytes, staging, torch.note.as_deref());
    report = report.with_facts(json!({
        "device": format!("{} ({})", dev.device(), dev.info().name),
        "gb": args.gb,
        "bytes": bytes,
        "tensors": dict.len(),
        "staging_bytes": staging,
        "samples": args.samples,
        "warmup": args.warmup,
        "pytorch": torch.label,
    }));
    report.finish(args.json.as_deref())
}

fn mb(bytes: Option<f64>) -> Cell {
    Cell::shown(bytes, |b| significant(b / 1e6))
}

/// ferry's save and load (the first two rows) are held to the staging bound: extra device and
/// host memory each within it.
const MEMORY_GOALS: [(&str, &str); 2] = [
    (
        "ferry save: extra device and host memory each <= the staging bound",
        "rows[ferry_save]: the larger of extra device and host bytes",
    ),
    (
        "ferry load: extra device and host memory each <= the staging bound",
        "rows[ferry_load]: the larger of extra device and host bytes",
    ),
];

fn report(title: String, rows: &[Row], bytes: usize, staging: usize, note: Option<&str>) -> Report {
    let ferry_ms = |save: bool| rows[usize::from(!save)].median_ms();
    let mut table = Table::new(&[
        "case",
        "ms",
        "GB/s",
        "extra device MB",
        "extra host MB",
        "resident growth MB",
        "ferry / this",
    ]);
    for r in rows {
        let ms = r.median_ms();
        let versus = match r.id.starts_with("ferry") {
            true => None,
            false => ferry_ms(r.save).zip(ms).map(|(f, p)| f / p),
        };
        let samples: Vec<Value> = r.samples.iter().map(Sample::json).collect();
        table.push_with(
            vec![
                Cell::text(r.name),
                Cell::number(ms),
                Cell::number(ms.map(|ms| bytes as f64 / ms / 1e6)),
                mb(r.most(|s| s.extra_device)),
                mb(r.most(|s| s.extra_host)),
                mb(r.most(|s| s.resident)),
                Cell::number(versus),
            ],
            json!({
                "id": r.id,
                "kind": if r.save { "save" } else { "load" },
                "samples": samples,
                "error": r.error,
            }),
        );
    }
    let mut report = Report::new("checkpoint", title);
    report.table("rows", None, table);
    let bound = staging as f64;
    for (r, (name, metric)) in rows.iter().zip(MEMORY_GOALS) {
        let (dev, host) = (r.most(|s| s.extra_device), r.most(|s| s.extra_host));
        let bound = Bound::AtMost(bound);
        let goal = Goal { name, metric, bound };
        let shown = format!(
            "device {} MB, host {} MB (bound {} MB)",
            mb(dev).as_text(),
            mb(host).as_text(),
            significant(staging as f64 / 1e6)
        );
        report.goals([goal.judge(dev.zip(host).map(|(d, h)| d.max(h)), shown)]);
        report.note(format!(
            "{}: measured by the pools: device allocator +{} MB, pinned pool +{} MB",
            r.name,
            mb(r.most(|s| s.allocator)).as_text(),
            mb(r.most(|s| s.pinned)).as_text(),
        ));
    }
    for r in rows {
        if let Some(e) = &r.error {
            report.note(format!("{}: error: {e}", r.name));
        }
    }
    report.note(
        "ferry's save includes fsync of the file and its directory and the rename; compare it \
         with the `+ fsync` rows. Loads read files just written (page cache) on both sides.",
    );
    if let Some(note) = note {
        report.note(format!("note: {note}"));
    }
    report
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn sizes_parse_and_bad_ones_say_why() {
        assert_eq!(parse_gb("10"), Ok(10.0));
        assert_eq!(parse_gb("0.5"), Ok(0.5));
        for bad in ["0", "-1", "nan", "inf", "ten", "5000"] {
            let err = parse_gb(bad).unwrap_err();
            assert!(err.contains("GiB"), "{bad}: {err}");
        }
    }

    #[test]
    fn pytorch_rows_add_the_fsync_to_the_durable_ones() {
        let reply = json!({"ms": 100.0, "fsync_ms": 20.0, "extra_device": 0.0, "extra_host": 5e6});
        assert_eq!(pytorch_sample(&reply, false).ms, 100.0);
        assert_eq!(pytorch_sample(&reply, true).ms, 120.0);
        assert_eq!(pytorch_sample(&reply, true).extra_host, Some(5e6));
        // Every durable row has its plain case, and every case a row.
        for (id, _, _) in PYTORCH_ROWS {
            let case = id.strip_suffix("_fsync").unwrap_or(id);
            assert!(PYTORCH_ROWS.iter().any(|(i, _, _)| *i == case), "{id}");
        }
    }

    /// The Python script builds the same dict: same count rule, same side, same extra tensors.
    #[test]
    fn rows_memory_goals_and_json_come_from_one_report() {
        let sample = |ms, device, host| Sample {
            ms,
            extra_device: Some(device),
            extra_host: Some(host),
            ..Sample::default()
        };
        let mut rows = vec![
            Row::new("ferry_save", "ferry save_with (durable)", true),
            Row::new("ferry_load", "ferry load_to(cuda)", false),
            Row::new("torch_save", "torch.save", true),
        ];
        rows[0].samples = vec![sample(2000.0, 1e8, 2e8), sample(1000.0, 1e8, 2.5e8)];
        rows[1].samples = vec![sample(500.0, 3e8, 0.0)];
        rows[2].samples = vec![sample(3000.0, 0.0, 4e9)];
        let report = report("t".into(), &rows, 10_000_000_000, 256 << 20, None);
        let table = report.json();
        assert_eq!(table["rows"][0]["gb_per_s"], json!(6.666666666666667));
        assert_eq!(table["rows"][2]["ferry_per_this"], json!(0.5));
        assert_eq!(table["rows"][0]["samples"][1]["extra_host_bytes"], json!(2.5e8));
        let goals: Vec<String> = report.judged().iter().map(|j| j.line()).collect();
        assert_eq!(
            goals[0],
            "goal: ferry save: extra device and host memory each <= the staging bound: \
             device 100 MB, host 250 MB (bound 268 MB) met"
        );
        assert!(goals[1].ends_with("device 300 MB, host 0 MB (bound 268 MB) MISSED"));
    }

    #[test]
    fn the_python_script_builds_the_same_dict() {
        let script = include_str!("../python/checkpoint.py");
        for needle in [
            "SIDE = 8192",
            "math.floor(gb * 4 + 0.5)",
            "layers.{i}.weight",
            "layers.{i}.bias",
            "torch.randn(4096, 4096, device=\"cuda\").half()",
            "\"step\"",
        ] {
            assert!(
                script.contains(needle),
                "crates/ferry-bench/python/checkpoint.py lacks {needle}"
            );
        }
        for (id, _, _) in PYTORCH_ROWS {
            let case = id.strip_suffix("_fsync").unwrap_or(id);
            assert!(script.contains(&format!("\"{case}\"")), "{case}");
        }
    }

    #[test]
    fn without_a_gpu_it_says_so_and_succeeds() {
        if crate::harness::cuda_device(0).is_ok() {
            return; // the GPU machine runs the real thing
        }
        let command = "ferry bench checkpoint --compare-pytorch --gb 0.25 --samples 1 --warmup 0";
        let Ok(crate::BenchCommand::Checkpoint(args)) = crate::parse_bench(command) else {
            panic!("`{command}` does not parse");
        };
        assert!(run(args).is_ok());
    }
}
