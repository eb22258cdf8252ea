//! `ferry bench offload`: activation offload on an MLP whose saved activations are several
//! GB, against the same step without offload and, with --compare-pytorch, PyTorch with and
//! without `torch.autograd.graph.save_on_cpu(pin_memory=True)` (python/offload.py), in
//! alternating rounds. The MLP: `layers` bias-free Linear + tanh layers of `width` at `batch`
//! rows, each tanh output saved (`layers x batch x width x 4` bytes, 4 GiB by default). A step
//! is forward, `sum`, backward, gradients cleared before it. `--sweep` runs `sweep` instead.

use std::error::Error;
use std::path::PathBuf;

use clap::Args;
use ferry::autograd::{OffloadOptions, OffloadStats};
use ferry::memory::cuda::PinnedPool;
use serde_json::{Value, json};

use crate::harness;
use crate::harness::goal::{Bound, Goal};
use crate::harness::pytorch::{PyTorch, PyTorchArgs};
use crate::harness::report::significant;
use crate::harness::table::{Cell, Report, Table, gib};
use grid::{DEFAULT_GRID, SweepCase};
use summary::{Row, Sample};
use sweep::Model;

mod grid;
mod summary;
mod sweep;

pub(crate) use sweep::measure_link;

#[derive(Args, Debug)]
pub struct OffloadArgs {
    #[command(flatten)]
    pytorch: PyTorchArgs,
    /// Write every number, all samples included, to this JSON file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Timed steps per row; the table shows their median.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    samples: u32,
    /// Untimed steps per row before the samples.
    #[arg(long, default_value_t = 1)]
    warmup: u32,
    /// Rows of the input batch.
    #[arg(long, default_value_t = 16_384, value_parser = clap::value_parser!(u64).range(1..))]
    batch: u64,
    /// Width of every layer.
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..))]
    width: u64,
    /// Linear + tanh layers.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..))]
    layers: u64,
    /// Saved buffers below this many bytes stay on the GPU (OffloadOptions::min_bytes).
    #[arg(long, default_value_t = 1 << 20)]
    min_bytes: usize,
    /// Run the sweep instead: MLPs over layers x width x batch and transformer blocks, each
    /// against the link bound and the peak goal (--batch, --width and --layers do not apply).
    #[arg(long, conflicts_with = "compare_pytorch")]
    sweep: bool,
    /// The sweep's cases, comma-separated: LAYERSxWIDTH@BATCH for an MLP,
    /// gpt:BLOCKSxWIDTH@BATCHxTOKENS for ferry's GPT [default: DEFAULT_GRID in
    /// crates/ferry-bench/src/offload/grid.rs].
    #[arg(long, requires = "sweep", value_parser = parse_grid)]
    grid: Option<Grid>,
}

/// `--grid`'s cases (a type of its own: clap would take a `Vec` for a repeated flag).
#[derive(Debug, Clone)]
struct Grid(Vec<SweepCase>);

fn parse_grid(spec: &str) -> Result<Grid, String> {
    grid::parse_grid(spec).map(Grid)
}

impl OffloadArgs {
    /// The sweep's cases: `--grid`'s, else the default grid.
    fn grid(&self) -> Vec<SweepCase> {
        match &self.grid {
            Some(Grid(cases)) => cases.clone(),
            None => grid::parse_grid(DEFAULT_GRID).expect("the default grid parses"),
        }
    }
}
/// Peak lower by at least 70% of what offload can free.
const PEAK_GOAL: Goal = Goal {
    name: "peak lower by >= 70% of the saved activations",
    metric: "peak_lower_fraction",
    bound: Bound::AtLeast(0.7),
};

const STEP_GOAL: Goal = Goal {
    name: "step time <= 1.2x no offload",
    metric: "step_vs_no_offload",
    bound: Bound::AtMost(1.2),
};

const TORCH_GOAL: Goal = Goal {
    name: "faster than PyTorch's save_on_cpu: ferry offload / PyTorch save_on_cpu",
    metric: "step_vs_pytorch_save_on_cpu",
    bound: Bound::AtMost(1.0),
};

/// PyTorch's step in `mode`: (ms, peak bytes, saved bytes).
fn pytorch_step(torch: &mut PyTorch, mode: &str, args: &OffloadArgs) -> Result<Sample, String> {
    let (batch, width, layers) = (args.batch, args.width, args.layers);
    let reply = torch.request(&format!("step {mode} {batch} {width} {layers}"))?;
    let num = |key: &str| {
        reply.get(key).and_then(Value::as_f64).ok_or_else(|| {
            format!("crates/ferry-bench/python/offload.py answered {reply} without `{key}`")
        })
    };
    let peak = num("peak_bytes")? as u64;
    Ok(Sample::whole(num("ms")?, peak, peak, num("saved_bytes")? as u64))
}

fn gib_text(bytes: u64) -> String {
    format!("{} GiB", significant(gib(bytes)))
}

/// The offload scope's counters, as both `ferry bench offload` and its sweep record them.
fn stats_json(s: &OffloadStats) -> Value {
    json!({
        "offloaded": s.offloaded,
        "offloaded_bytes": s.offloaded_bytes,
        "read_in_place": s.read_in_place,
        "read_in_place_bytes": s.read_in_place_bytes,
        "shared": s.shared,
        "kept_small": s.kept_small,
        "kept_not_activation": s.kept_not_activation,
        "kept_over_budget": s.kept_over_budget,
        "kept_over_budget_bytes": s.kept_over_budget_bytes,
        "kept_on_error": s.kept_on_error,
        "prefetched": s.prefetched,
        "fetched_on_demand": s.fetched_on_demand,
    })
}

/// The offload scope's counters, as both benches print them.
fn stats_note(s: &OffloadStats) -> String {
    format!(
        "moved {} buffers ({} GiB), {} read in place ({} GiB), {} shared, {} kept as the \
         caller's, {} small, {} over the pinned budget ({} GiB), {} on error; prefetched {}, on \
         demand {}",
        s.offloaded,
        significant(gib(s.offloaded_bytes)),
        s.read_in_place,
        significant(gib(s.read_in_place_bytes)),
        s.shared,
        s.kept_not_activation,
        s.kept_small,
        s.kept_over_budget,
        significant(gib(s.kept_over_budget_bytes)),
        s.kept_on_error,
        s.prefetched,
        s.fetched_on_demand,
    )
}

/// The four rows, ferry's then PyTorch's, each without and with offload.
const NAMES: [&str; 4] = [
    "ferry, no offload",
    "ferry, offload_saved",
    "PyTorch, no offload",
    "PyTorch, save_on_cpu(pin_memory=True)",
];

/// The rows that ran, each against its side's step without offload; all samples in the JSON.
fn table(rows: &[Row; 4]) -> Table {
    let mut table = Table::new(&[
        "row",
        "step",
        "vs no offload",
        "peak device memory",
        "saved bytes",
    ]);
    let median = |k: usize| rows[k].step.complete_median();
    for (k, row) in rows.iter().enumerate() {
        if row.error().is_none() && row.step.samples_ms.is_empty() {
            continue;
        }
        let reference = median(if k < 2 { 0 } else { 2 });
        let failed = row.error().is_some();
        let cell = |x: Option<String>, value: Value| match failed {
            true => Cell::text("error").recorded(value),
            false => Cell::text(x.unwrap_or_else(|| "-".into())).recorded(value),
        };
        let ratio = median(k).zip(reference).map(|(a, b)| a / b);
        let peaks: Vec<u64> = (row.peak_forward.iter().zip(&row.peak_backward))
            .map(|(f, b)| *f.max(b))
            .collect();
        table.push_with(
            vec![
                Cell::text(NAMES[k]),
                cell(median(k).map(|ms| format!("{} ms", significant(ms))), json!(median(k))),
                cell(ratio.map(|r| format!("{}x", significant(r))), json!(ratio)),
                cell(row.peak().map(gib_text), json!(row.peak())),
                cell(row.saved_bytes.map(gib_text), json!(row.saved_bytes)),
            ],
            json!({
                "step_ms": row.step.samples_ms,
                "peak_bytes": peaks,
                "offload": row.stats.as_ref().map(stats_json),
                "error": row.error(),
            }),
        );
    }
    table
}

pub fn run(args: OffloadArgs) -> Result<(), Box<dyn Error>> {
    if args.sweep {
        return sweep::run(&args, &args.grid());
    }
    let Some(dev) = harness::cuda_device_or_say(0, |err| {
        format!(
            "ferry bench offload needs a CUDA device (it measures device memory and copies to \
             pinned host memory): {err}"
        )
    }) else {
        return Ok(());
    };
    let activation_bytes = args.layers * args.batch * args.width * 4;
    let options = OffloadOptions {
        min_bytes: args.min_bytes,
    };
    let mut torch = args.pytorch.side("offload.py", "rows");
    let mut title = format!(
        "ferry bench offload on {} ({}): {} layers of Linear({w}, {w}) + tanh at batch {}, \
         f32; saved activations {}; pinned budget {}",
        dev.device(),
        dev.info().name,
        args.layers,
        args.batch,
        gib_text(activation_bytes),
        gib_text(PinnedPool::global().map_or(0, |p| p.budget()) as u64),
        w = args.width,
    );
    if let Some(label) = &torch.label {
        title += &format!("\nPyTorch {label}");
    }
    let case = SweepCase::mlp(args.layers, args.width, args.batch);
    let model = Model::new(case, dev.device())?;
    let mut rows: [Row; 4] = Default::default();
    for round in 0..args.warmup + args.samples {
        eprintln!("round {} of {} ...", round + 1, args.warmup + args.samples);
        for k in 0..4 {
            if rows[k].error().is_some() {
                continue;
            }
            let sample = match (k, torch.torch()) {
                (0 | 1, _) => sweep::step(&dev, &model, (k == 1).then_some(options), false)
                    .map_err(|e| e.to_string()),
                (_, Some(t)) => pytorch_step(t, ["none", "save_on_cpu"][k - 2], &args),
                (_, None) => continue,
            };
            match sample {
                Ok(sample) if round >= args.warmup => rows[k].push(sample),
                Ok(_) => {}
                Err(err) => rows[k].fail(err),
            }
        }
    }
    drop(model);

    let median = |k: usize| rows[k].step.complete_median();
    let mut report = Report::new("offload", title).with_facts(json!({
        "device": format!("{} ({})", dev.device(), dev.info().name),
        "pytorch": torch.label,
        "pytorch_note": torch.note,
        "batch": args.batch,
        "width": args.width,
        "layers": args.layers,
        "min_bytes": args.min_bytes,
        "samples": args.samples,
        "warmup": args.warmup,
        "activation_bytes": activation_bytes,
    }));
    report.table("rows", None, table(&rows));
    for (name, row) in NAMES.iter().zip(&rows) {
        if let Some(err) = row.error() {
            report.note(format!("{name}: {err}"));
        }
    }
    if let Some(note) = &torch.note {
        report.note(note.clone());
    }
    if let Some(s) = rows[1].stats {
        report.note(format!("ferry offload: {}", stats_note(&s)));
    }

    // The saved activations (saved bytes less what the caller holds anyway) are what offload
    // can free.
    let freeable = rows[1]
        .saved_bytes
        .map(|s| s.saturating_sub(caller_bytes(&args)))
        .unwrap_or(activation_bytes);
    let lower = rows[0]
        .peak()
        .zip(rows[1].peak())
        .map(|(a, b)| a as f64 - b as f64);
    let fraction = lower.map(|l| l / freeable.max(1) as f64);
    report = report.with_facts(json!({ "freeable_bytes": freeable }));
    let shown = lower.zip(fraction).map_or("-".into(), |(l, f)| {
        let l = gib_text(l.max(0.0) as u64);
        format!("lower by {l} ({}%) of {}", significant(100.0 * f), gib_text(freeable))
    });
    let times = |r: Option<f64>| (r, r.map_or("-".into(), |r| format!("{}x", significant(r))));
    let (slower, slower_text) = times(median(1).zip(median(0)).map(|(a, b)| a / b));
    let (vs_torch, vs_torch_text) = times(median(1).zip(median(3)).map(|(a, b)| a / b));
    report.goals([
        PEAK_GOAL.judge(fraction, shown),
        STEP_GOAL.judge(slower, slower_text),
        TORCH_GOAL.judge(vs_torch, vs_torch_text),
    ]);
    report.finish(args.json.as_deref())
}

/// Bytes the caller holds that rules save too (f32): the input and every weight but the
/// first, whose matmul saves no weight since its input, `x`, wants no gradient.
fn caller_bytes(args: &OffloadArgs) -> u64 {
    4 * (args.batch * args.width + (args.layers - 1) * args.width * args.width)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use grid::parse_grid;

    #[derive(Parser, Debug)]
    struct Command {
        #[command(flatten)]
        args: OffloadArgs,
    }

    fn parse(args: &str) -> Result<OffloadArgs, clap::Error> {
        let argv = std::iter::once("offload").chain(args.split_whitespace());
        Command::try_parse_from(argv).map(|c| c.args)
    }

    #[test]
    fn the_default_model_saves_4_gib_of_activations_and_bad_sizes_are_refused() {
        let args = parse("--compare-pytorch --json offload.json").unwrap();
        assert!(args.pytorch.compare_pytorch);
        assert_eq!((args.batch, args.width, args.layers), (16_384, 4096, 16));
        // The ">= 4 GB of saved activations": 16 layers x 16384 x 4096 f32.
        assert_eq!(args.layers * args.batch * args.width * 4, 4 << 30);
        // The input and 15 of the 16 weights of 64 MiB: saved too, but the caller's.
        assert_eq!(caller_bytes(&args), (256 << 20) + 15 * (64 << 20));
        for bad in ["--layers 0", "--batch 0", "--width -1", "--samples 0"] {
            assert!(parse(bad).is_err(), "`{bad}` was accepted");
        }
        assert!(!args.sweep, "no --sweep, no sweep");
    }

    #[test]
    fn sweep_takes_the_default_grid_or_the_given_one_and_the_shared_flags() {
        let args = parse("--sweep --samples 3 --json sweep.json").unwrap();
        assert!(args.sweep);
        assert_eq!(args.grid(), parse_grid(DEFAULT_GRID).unwrap());
        assert_eq!((args.samples, args.warmup), (3, 1));
        assert_eq!(args.min_bytes, 1 << 20);
        assert_eq!(args.json.unwrap().to_str(), Some("sweep.json"));
        let given = parse("--sweep --grid 2x64@32,gpt:1x64@2x8").unwrap().grid();
        assert_eq!(
            given.iter().map(ToString::to_string).collect::<Vec<_>>(),
            ["2x64@32", "gpt:1x64@2x8"]
        );
        // A grid without --sweep, a bad grid, and PyTorch rows (the sweep has none) are refused.
        for bad in [
            "--grid 2x64@32",
            "--sweep --grid 2x64",
            "--sweep --compare-pytorch",
        ] {
            assert!(parse(bad).is_err(), "`{bad}` was accepted");
        }
        let err = parse("--sweep --grid 2x64").unwrap_err().to_string();
        assert!(err.contains("LAYERSxWIDTH@BATCH"), "{err}");
    }

    /// The offload row records the scope's counters as the sweep does, every one of them.
    #[test]
    fn a_row_records_the_scope_counters_like_the_sweep() {
        let mut rows: [Row; 4] = Default::default();
        for (k, ms) in [(0, 1.0), (1, 3.0), (1, 1.0), (1, 2.0)] {
            rows[k].push(Sample {
                stats: (k == 1).then_some(OffloadStats {
                    offloaded: 16,
                    read_in_place: 2,
                    prefetched: 15,
                    ..OffloadStats::default()
                }),
                ..Sample::whole(ms, 1 << 30, 2 << 30, 3 << 30)
            });
        }
        let shown = table(&rows);
        assert_eq!(
            shown.texts()[1],
            ["ferry, offload_saved", "2.00 ms", "2.00x", "2.00 GiB", "3.00 GiB"]
        );
        let doc = &shown.json()[1];
        assert_eq!(doc["step"], 2.0);
        assert_eq!(doc["offload"]["offloaded"], 16);
        assert_eq!(doc["offload"]["read_in_place"], 2);
        assert_eq!(doc["offload"]["prefetched"], 15);
        assert_eq!(shown.json()[0]["offload"], Value::Null);
        // A failed row shows "error" in every column; rows that did not run are left out.
        rows[1].fail("out of memory".into());
        let texts = table(&rows).texts();
        assert_eq!(texts.len(), 2);
        assert_eq!(texts[1][1..], ["error", "error", "error", "error"]);
    }
}
