//! `ferry bench offload`: activation offload on a model whose saved activations are several GB,
//! against the same step without offload and, with --compare-pytorch, against PyTorch with and
//! without `torch.autograd.graph.save_on_cpu(pin_memory=True)` (python/offload.py).
//!
//! The model is an MLP of `layers` bias-free Linear + tanh layers of `width`, at `batch` rows:
//! each tanh output (`batch × width` f32) is saved for backward, so the saved activations are
//! `layers × batch × width × 4` bytes (4 GiB by default); the weights and the input are saved
//! too but belong to the caller. Backward brings the saved activations back two nodes ahead of
//! their use, so a few layers' worth are back on the device at any time: the deeper the model,
//! the larger the share of its activations offload frees (16 layers by default). One step is
//! forward, `sum`, backward, with the gradients cleared before each step (so every row
//! allocates them alike). Rounds alternate ferry's rows and PyTorch's; the table shows medians
//! of step time and the largest peak seen.
//!
//! `--sweep` runs `sweep` instead: many such MLPs and ferry's GPT blocks, each judged
//! against the link bound and the peak goal.

use std::error::Error;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use ferry::autograd::{OffloadOptions, OffloadStats, offload_saved};
use ferry::memory::cuda::{CudaDevice, PinnedPool};
use ferry::{Device, Tensor};
use serde_json::{Value, json};

use crate::harness;
use crate::harness::measure::median;
use crate::harness::pytorch::{PyTorch, PyTorchArgs};
use crate::harness::report::{print_table, significant};
use grid::{DEFAULT_GRID, SweepCase, SweepOptions};
use sweep_output::stats_json;

mod goals;
mod grid;
mod sweep;
mod sweep_case;
mod sweep_output;

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
    /// crates/ferry-bench/src/offload/grid.rs, six MLPs from 4x1024@8192 to 16x4096@16384 and
    /// two GPTs].
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
    fn sweep_options(&self) -> Option<SweepOptions> {
        self.sweep.then(|| SweepOptions {
            grid: match &self.grid {
                Some(Grid(cases)) => cases.clone(),
                None => grid::parse_grid(DEFAULT_GRID).expect("the default grid parses"),
            },
            samples: self.samples,
            warmup: self.warmup,
            min_bytes: self.min_bytes,
            json: self.json.clone(),
        })
    }
}

/// The model: weights that want gradients and an input batch that does not.
struct Model {
    x: Tensor,
    ws: Vec<Tensor>,
}

impl Model {
    fn new(args: &OffloadArgs, device: Device) -> ferry::Result<Self> {
        let (x, ws) = sweep::mlp(args.layers, args.width, args.batch, device)?;
        Ok(Self { x, ws })
    }
}

/// One row of the table.
#[derive(Default)]
struct Row {
    name: &'static str,
    step_ms: Vec<f64>,
    peak_bytes: Vec<u64>,
    saved_bytes: Option<u64>,
    stats: Option<OffloadStats>,
    error: Option<String>,
}

impl Row {
    fn new(name: &'static str) -> Self {
        Self {
            name,
            ..Self::default()
        }
    }

    fn step_ms(&self) -> Option<f64> {
        median(&self.step_ms)
    }

    fn peak(&self) -> Option<u64> {
        self.peak_bytes.iter().copied().max()
    }

    fn json(&self) -> Value {
        json!({
            "row": self.name,
            "step_ms": self.step_ms,
            "step_ms_median": self.step_ms(),
            "peak_bytes": self.peak_bytes,
            "saved_bytes": self.saved_bytes,
            "offload": self.stats.as_ref().map(stats_json),
            "error": self.error,
        })
    }
}

/// One ferry step: (ms, peak allocated bytes over what was allocated before, saved bytes after
/// the forward, the scope's stats).
fn ferry_step(
    dev: &CudaDevice,
    model: &Model,
    offload: Option<OffloadOptions>,
) -> ferry::Result<(f64, u64, u64, Option<OffloadStats>)> {
    for w in &model.ws {
        w.set_grad(None);
    }
    dev.synchronize()?;
    let base = dev.memory_stats().allocated_bytes;
    // The bench owns this process's statistics: resetting the peak is its to do.
    dev.reset_peak();
    let started = Instant::now();
    let scope = offload.map(offload_saved);
    let mut h = model.x.clone();
    for w in &model.ws {
        h = h.matmul(w)?.tanh()?;
    }
    let loss = h.sum()?;
    drop(h);
    let saved = loss.graph().map_or(0, |g| g.saved_bytes()) as u64;
    loss.backward()?;
    dev.synchronize()?;
    let ms = started.elapsed().as_secs_f64() * 1e3;
    let peak = dev.memory_stats().peak_allocated_bytes.saturating_sub(base) as u64;
    let stats = scope.as_ref().map(|s| s.stats());
    drop(scope);
    Ok((ms, peak, saved, stats))
}

fn pytorch_step(
    torch: &mut PyTorch,
    mode: &str,
    args: &OffloadArgs,
) -> Result<(f64, u64, u64), String> {
    let reply = torch.request(&format!(
        "step {mode} {} {} {}",
        args.batch, args.width, args.layers
    ))?;
    let num = |key: &str| {
        reply.get(key).and_then(Value::as_f64).ok_or_else(|| {
            format!("crates/ferry-bench/python/offload.py answered {reply} without `{key}`")
        })
    };
    Ok((
        num("ms")?,
        num("peak_bytes")? as u64,
        num("saved_bytes")? as u64,
    ))
}

fn gib(bytes: u64) -> String {
    format!("{} GiB", significant(bytes as f64 / (1u64 << 30) as f64))
}

fn cell(value: Option<String>, row: &Row) -> String {
    match (&row.error, value) {
        (Some(_), _) => "error".into(),
        (None, Some(v)) => v,
        (None, None) => "-".into(),
    }
}

pub fn run(args: OffloadArgs) -> Result<(), Box<dyn Error>> {
    if let Some(options) = args.sweep_options() {
        return sweep::run(options);
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
    println!(
        "ferry bench offload on {} ({}): {} layers of Linear({w}, {w}) + tanh at batch {}, \
         f32; saved activations {}; pinned budget {}",
        dev.device(),
        dev.info().name,
        args.layers,
        args.batch,
        gib(activation_bytes),
        gib(PinnedPool::global().map_or(0, |p| p.budget()) as u64),
        w = args.width,
    );
    torch.print_label();
    let model = Model::new(&args, dev.device())?;
    let mut rows = [
        Row::new("ferry, no offload"),
        Row::new("ferry, offload_saved"),
        Row::new("PyTorch, no offload"),
        Row::new("PyTorch, save_on_cpu(pin_memory=True)"),
    ];
    for round in 0..args.warmup + args.samples {
        let timed = round >= args.warmup;
        eprintln!("round {} of {} ...", round + 1, args.warmup + args.samples);
        for (k, offload) in [(0, None), (1, Some(options))] {
            if rows[k].error.is_some() {
                continue;
            }
            match ferry_step(&dev, &model, offload) {
                Ok((ms, peak, saved, stats)) if timed => {
                    let row = &mut rows[k];
                    row.step_ms.push(ms);
                    row.peak_bytes.push(peak);
                    row.saved_bytes = Some(saved);
                    row.stats = stats;
                }
                Ok(_) => {}
                Err(err) => rows[k].error = Some(err.to_string()),
            }
        }
        if let Some(t) = torch.torch() {
            for (k, mode) in [(2, "none"), (3, "save_on_cpu")] {
                if rows[k].error.is_some() {
                    continue;
                }
                match pytorch_step(t, mode, &args) {
                    Ok((ms, peak, saved)) if timed => {
                        let row = &mut rows[k];
                        row.step_ms.push(ms);
                        row.peak_bytes.push(peak);
                        row.saved_bytes = Some(saved);
                    }
                    Ok(_) => {}
                    Err(err) => rows[k].error = Some(err),
                }
            }
        }
    }
    drop(model);

    let base_ms = rows[0].step_ms();
    let header = [
        "row",
        "step",
        "vs no offload",
        "peak device memory",
        "saved bytes",
    ];
    let table: Vec<Vec<String>> = rows
        .iter()
        .filter(|r| r.error.is_some() || !r.step_ms.is_empty())
        .map(|r| {
            let reference = if r.name.starts_with("PyTorch") {
                rows[2].step_ms()
            } else {
                base_ms
            };
            vec![
                r.name.to_string(),
                cell(r.step_ms().map(|ms| format!("{} ms", significant(ms))), r),
                cell(
                    r.step_ms()
                        .zip(reference)
                        .map(|(a, b)| format!("{}x", significant(a / b))),
                    r,
                ),
                cell(r.peak().map(gib), r),
                cell(r.saved_bytes.map(gib), r),
            ]
        })
        .collect();
    println!();
    print_table(&header, &table);
    for r in rows.iter().filter(|r| r.error.is_some()) {
        println!("{}: {}", r.name, r.error.as_deref().unwrap_or_default());
    }
    if let Some(note) = &torch.note {
        println!("{note}");
    }
    if let Some(s) = rows[1].stats {
        println!(
            "ferry offload: {} buffers ({}) moved to pinned memory, {} shared by two rules, {} \
             kept as the caller's, {} kept small, {} over the pinned budget ({}), {} on error; \
             backward prefetched {} and fetched {} on demand",
            s.offloaded,
            gib(s.offloaded_bytes),
            s.shared,
            s.kept_not_activation,
            s.kept_small,
            s.kept_over_budget,
            gib(s.kept_over_budget_bytes),
            s.kept_on_error,
            s.prefetched,
            s.fetched_on_demand,
        );
    }

    // Goals: the saved activations (saved bytes less what the caller holds anyway) are what
    // offload can free.
    let caller = caller_bytes(&args);
    let freeable = rows[1]
        .saved_bytes
        .map(|s| s.saturating_sub(caller))
        .unwrap_or(activation_bytes);
    let lower = rows[0]
        .peak()
        .zip(rows[1].peak())
        .map(|(a, b)| a as f64 - b as f64);
    let slower = rows[1].step_ms().zip(base_ms).map(|(a, b)| a / b);
    let vs_torch = rows[1].step_ms().zip(rows[3].step_ms()).map(|(a, b)| a / b);
    let verdict = |ok: Option<bool>| match ok {
        Some(true) => "met",
        Some(false) => "MISSED",
        None => "not measured",
    };
    println!();
    println!(
        "goal: peak lower by >= 70% of the saved activations ({}): lower by {} ({}) -> {}",
        gib(freeable),
        lower.map_or("-".into(), |l| gib(l.max(0.0) as u64)),
        lower.map_or("-".into(), |l| format!(
            "{}%",
            significant(100.0 * l / freeable.max(1) as f64)
        )),
        verdict(lower.map(|l| l >= 0.7 * freeable as f64)),
    );
    println!(
        "goal: step time <= 1.2x no offload: {} -> {}",
        slower.map_or("-".into(), |r| format!("{}x", significant(r))),
        verdict(slower.map(|r| r <= 1.2)),
    );
    println!(
        "goal: faster than PyTorch's save_on_cpu: ferry offload / PyTorch save_on_cpu = {} -> {}",
        vs_torch.map_or("-".into(), |r| format!("{}x", significant(r))),
        verdict(vs_torch.map(|r| r < 1.0)),
    );

    if let Some(path) = &args.json {
        let doc = json!({
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
            "freeable_bytes": freeable,
            "rows": rows.iter().map(Row::json).collect::<Vec<_>>(),
            "goals": {
                "peak_lower_bytes": lower,
                "peak_lower_fraction": lower.map(|l| l / freeable.max(1) as f64),
                "step_vs_no_offload": slower,
                "step_vs_pytorch_save_on_cpu": vs_torch,
            },
        });
        harness::write_json(path, &doc, "sample")?;
    }
    Ok(())
}

/// Bytes the caller holds that rules save too (f32): the input and every weight but the
/// first, whose matmul saves no weight since its input, `x`, wants no gradient.
fn caller_bytes(args: &OffloadArgs) -> u64 {
    4 * (args.batch * args.width + (args.layers - 1) * args.width * args.width)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{DEFAULT_GRID, OffloadArgs, OffloadStats, Row, caller_bytes, parse_grid};

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
        assert!(args.sweep_options().is_none(), "no --sweep, no sweep");
    }

    #[test]
    fn sweep_takes_the_default_grid_or_the_given_one_and_the_shared_flags() {
        let options = parse("--sweep --samples 3 --json sweep.json")
            .unwrap()
            .sweep_options()
            .unwrap();
        assert_eq!(options.grid, parse_grid(DEFAULT_GRID).unwrap().0);
        assert_eq!((options.samples, options.warmup), (3, 1));
        assert_eq!(options.min_bytes, 1 << 20);
        assert_eq!(options.json.unwrap().to_str(), Some("sweep.json"));
        let given = parse("--sweep --grid 2x64@32,gpt:1x64@2x8")
            .unwrap()
            .sweep_options()
            .unwrap();
        assert_eq!(
            given
                .grid
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>(),
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
        let mut row = Row::new("ferry, offload_saved");
        row.step_ms = vec![3.0, 1.0, 2.0];
        row.stats = Some(OffloadStats {
            offloaded: 16,
            read_in_place: 2,
            prefetched: 15,
            ..OffloadStats::default()
        });
        let doc = row.json();
        assert_eq!(doc["step_ms_median"], 2.0);
        assert_eq!(doc["offload"]["offloaded"], 16);
        assert_eq!(doc["offload"]["read_in_place"], 2);
        assert_eq!(doc["offload"]["prefetched"], 15);
        assert_eq!(
            Row::new("ferry, no offload").json()["offload"],
            serde_json::Value::Null
        );
    }
}
