//! `ferry bench pipeline`: a video pipeline. Frames are produced by GPU work (elementwise kernels
//! over a 1080p RGB f32 frame), moved to the host, and post-processed by CPU work (a reduction of
//! the frame, `--host-passes` times).
//!
//! First each stage is timed alone, per frame: GPU, link, host. Full overlap would run at one
//! frame per max(GPU, link, host), the ideal. Then whole runs of `--frames` frames: serial (each
//! frame produced, moved, processed in turn); ferry's pipeline (frames moved by `to_async` on a
//! copy stream, `--depth` in flight, the host working on the oldest); ferry's `stream_to` (a batch
//! produced first, then streamed a frame per chunk while the host works: link and host overlap,
//! the GPU does not). With --compare-pytorch, python/pipeline.py runs the same stages and rows in
//! PyTorch, its pipeline written with a side stream, pinned buffers and events. Medians of
//! `--samples` runs, ms per frame; per row, ferry's runs and then PyTorch's, each block after a
//! pause and an untimed run, since each side's idle worker threads slow the other's host work
//! for a while (`--trace` shows it). `--trace` also times one run frame by frame.

use std::error::Error;
use std::path::PathBuf;

use clap::Args;
use ferry::{DType, Device, Result, Tensor};
use serde_json::{Value, json};

use crate::Measured;
use crate::harness;
use crate::harness::pytorch::{PyTorch, PyTorchArgs};
use crate::harness::report::{print_table, significant};
use stages::{FRAME, Fixture};

mod stages;
mod trace;

/// The speedup over serial the reference article reports for its pipeline.
const ARTICLE_SPEEDUP: f64 = 0.30;
/// Goal: ferry's pipeline at this fraction of the ideal throughput, or better.
const IDEAL_GOAL: f64 = 0.95;

#[derive(Args, Debug)]
pub struct PipelineArgs {
    #[command(flatten)]
    pytorch: PyTorchArgs,
    /// Write every number, all samples included, to this JSON file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Frames per run.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(2..))]
    frames: u32,
    /// Reductions of each frame on the host: more makes the host the slowest stage.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    host_passes: u32,
    /// Frames in flight in the pipelines (produced or moving while the host works on one).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(2..))]
    depth: u32,
    /// Timed runs per row and side; the table shows their median.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    samples: u32,
    /// Also trace one run of ferry's pipeline: each frame's kernels and copy on the device, the
    /// host's steps, and runs that leave a stage out.
    #[arg(long)]
    trace: bool,
}

/// What is measured, in order; PyTorch's script answers the same ids.
const STAGES: [&str; 3] = ["gpu", "link", "host"];
const ROWS: [(&str, &str); 4] = [
    ("serial", "serial: produce, move, process in turn"),
    ("pipelined", "pipeline: to_async ring on a copy stream"),
    (
        "pipelined_slots",
        "pipeline: the same, frames written into slots",
    ),
    ("streamed", "stream_to: batch produced, then link || host"),
];
/// Indices in `ROWS` of the pipelines judged against the goals.
const PIPELINES: [usize; 2] = [1, 2];
/// Pause before each side's block of runs, so it starts on a quieter host: after a parallel
/// region PyTorch's OpenMP workers keep spinning on every core for a while, and a ferry run
/// started in that window had its first frame's host work take 6.7 to 9.4 ms instead of 0.2
/// (traced on the H200, `--trace`); rayon's workers do the same to PyTorch, for less long.
const SETTLE: std::time::Duration = std::time::Duration::from_millis(200);

/// Samples of one id (ms per frame), ferry's block, then PyTorch's (one warm-up run each first).
struct Sampled {
    id: &'static str,
    ferry: Measured,
    pytorch: Measured,
}

impl Sampled {
    fn ferry_ms(&self) -> Option<f64> {
        self.ferry.median()
    }

    fn pytorch_ms(&self) -> Option<f64> {
        self.pytorch.median()
    }
}

fn measure(id: &'static str, fx: &Fixture, torch: Option<&mut PyTorch>, samples: u32) -> Sampled {
    let mut m = Sampled {
        id,
        ferry: Measured::new(),
        pytorch: Measured::new(),
    };
    let request = format!("{id} {} {} {}", fx.frames, fx.passes, fx.depth);
    // Each side's runs in one block, a warm-up run first: the other side's threads are still
    // spinning when a block starts, and the warm-up run takes that (see SETTLE).
    for round in 0..=samples {
        if m.ferry.is_failed() {
            break;
        }
        if round == 0 {
            std::thread::sleep(SETTLE);
        }
        match fx.run(id) {
            Ok(ms) if round > 0 => m.ferry.push(ms),
            Ok(_) => {}
            Err(err) => m.ferry.fail(err.to_string()),
        }
    }
    if let Some(torch) = torch {
        std::thread::sleep(SETTLE);
        for round in 0..=samples {
            match torch.sample(&request) {
                Ok(ms) if round > 0 => m.pytorch.push(ms),
                Ok(_) => {}
                Err(err) => {
                    m.pytorch.fail(err);
                    break;
                }
            }
        }
    }
    m
}

/// The ideal ms per frame: the slowest stage alone.
fn ideal(stages: &[Sampled], side: impl Fn(&Sampled) -> Option<f64>) -> Option<f64> {
    stages
        .iter()
        .map(side)
        .try_fold(0.0f64, |worst, ms| Some(worst.max(ms?)))
}

fn cell(ms: Option<f64>) -> String {
    ms.map_or_else(|| "-".into(), significant)
}

fn fps(ms: Option<f64>) -> String {
    ms.map_or_else(|| "-".into(), |ms| format!("{:.0}", 1e3 / ms))
}

/// `ideal / ms` (the fraction of full overlap reached).
fn of_ideal(ideal: Option<f64>, ms: Option<f64>) -> Option<f64> {
    Some(ideal? / ms?)
}

/// Speedup over serial as a percentage gain: 0.30 is 30% more frames per second.
fn gain(serial: Option<f64>, ms: Option<f64>) -> Option<f64> {
    Some(serial? / ms? - 1.0)
}

fn percent(x: Option<f64>) -> String {
    x.map_or_else(|| "-".into(), |x| format!("{:+.0}%", x * 100.0))
}

fn ratio(x: Option<f64>) -> String {
    x.map_or_else(|| "-".into(), |x| format!("{x:.2}"))
}

pub fn run(args: PipelineArgs) -> Result<(), Box<dyn Error>> {
    let Some(dev) = harness::cuda_device_or_say(0, |err| {
        format!("ferry bench pipeline needs a CUDA device (frames are produced on the GPU): {err}")
    }) else {
        return Ok(());
    };
    let (frames, depth) = (args.frames as usize, args.depth as usize);
    let gpu = Device::Cuda(dev.ordinal());
    let mut batch_shape = vec![frames];
    batch_shape.extend(FRAME);
    let fx = Fixture {
        base: Tensor::rand(&FRAME, DType::F32, gpu)?,
        batch_base: Tensor::rand(&batch_shape, DType::F32, gpu)?,
        copy: dev.new_stream()?,
        slots: (0..depth)
            .map(|_| Tensor::zeros(&FRAME, DType::F32, gpu))
            .collect::<Result<_>>()?,
        dev,
        frames,
        passes: args.host_passes,
        depth,
    };
    let mut torch = args.pytorch.side("pipeline.py", "column");
    println!(
        "ferry bench pipeline on {} ({}): {frames} frames of {FRAME:?} f32 ({:.1} MB), {} host pass(es), {depth} in flight, median of {} runs",
        fx.dev.device(),
        fx.dev.info().name,
        FRAME.iter().product::<usize>() as f64 * 4.0 / 1e6,
        args.host_passes,
        args.samples
    );
    torch.print_label();
    let mut stages = Vec::new();
    for id in STAGES {
        eprintln!("measuring {id} ...");
        stages.push(measure(id, &fx, torch.torch(), args.samples));
    }
    let mut rows = Vec::new();
    for (id, _) in ROWS {
        eprintln!("measuring {id} ...");
        rows.push(measure(id, &fx, torch.torch(), args.samples));
    }
    if args.trace {
        // Once right after a PyTorch sample (if any), once on a quiet host.
        if let Some(torch) = torch.torch() {
            torch.sample(&format!("pipelined {frames} {} {depth}", args.host_passes))?;
            trace::trace(&fx, "right after a PyTorch sample")?;
        }
        std::thread::sleep(SETTLE);
        trace::trace(&fx, "after a pause")?;
    }
    drop(fx);

    println!("\nper frame, each stage alone (ms)");
    let stage_rows: Vec<Vec<String>> = stages
        .iter()
        .map(|m| vec![m.id.into(), cell(m.ferry_ms()), cell(m.pytorch_ms())])
        .collect();
    print_table(&["stage", "ferry", "PyTorch"], &stage_rows);
    let ideal_ferry = ideal(&stages, Sampled::ferry_ms);
    let ideal_torch = ideal(&stages, Sampled::pytorch_ms);
    println!(
        "ideal (full overlap, 1/max of the stages): ferry {} ms/frame ({} frames/s), PyTorch {} ms/frame ({} frames/s)",
        cell(ideal_ferry),
        fps(ideal_ferry),
        cell(ideal_torch),
        fps(ideal_torch)
    );

    let serial = |m: &[Sampled], side: fn(&Sampled) -> Option<f64>| side(&m[0]);
    let torch_best = rows.iter().filter_map(Sampled::pytorch_ms).reduce(f64::min);
    println!("\nwhole runs (ms per frame; of ideal = ideal / ms, goal >= {IDEAL_GOAL})");
    let mut table = Vec::new();
    for ((_, label), m) in ROWS.iter().zip(&rows) {
        let (f, p) = (m.ferry_ms(), m.pytorch_ms());
        table.push(vec![
            (*label).to_string(),
            cell(f),
            fps(f),
            ratio(of_ideal(ideal_ferry, f)),
            percent(gain(serial(&rows, Sampled::ferry_ms), f)),
            cell(p),
            fps(p),
            ratio(of_ideal(ideal_torch, p)),
            percent(gain(serial(&rows, Sampled::pytorch_ms), p)),
            ratio(torch_best.and_then(|best| Some(best / f?))),
        ]);
    }
    print_table(
        &[
            "row",
            "ferry ms",
            "frames/s",
            "of ideal",
            "vs serial",
            "PyTorch ms",
            "frames/s",
            "of ideal",
            "vs serial",
            "PyTorch best / ferry",
        ],
        &table,
    );
    let verdict = |g: Option<bool>| match g {
        Some(true) => "met",
        Some(false) => "MISSED",
        None => "? (not measured)",
    };
    println!();
    for row in PIPELINES {
        let f = rows[row].ferry_ms();
        let goal_ideal = of_ideal(ideal_ferry, f).map(|r| r >= IDEAL_GOAL);
        let goal_torch = torch_best.zip(f).map(|(best, f)| f <= best);
        println!(
            "{}: {} of ideal (goal >= {IDEAL_GOAL}: {}); PyTorch best / ferry {} (goal >= 1: {}); \
             {} over serial, next to the article's {:+.0}%",
            ROWS[row].1,
            ratio(of_ideal(ideal_ferry, f)),
            verdict(goal_ideal),
            ratio(torch_best.zip(f).map(|(b, f)| b / f)),
            verdict(goal_torch),
            percent(gain(rows[0].ferry_ms(), f)),
            ARTICLE_SPEEDUP * 100.0
        );
    }
    for m in stages.iter().chain(&rows) {
        if let Some(err) = &m.ferry.error {
            println!("ferry {}: {err}", m.id);
        }
        if let Some(err) = &m.pytorch.error {
            println!("PyTorch {}: {err}", m.id);
        }
    }
    if let Some(note) = &torch.note {
        println!("{note}");
    }
    if let Some(path) = &args.json {
        let doc = to_json(&args, &stages, &rows, ideal_ferry, ideal_torch);
        harness::write_json(path, &doc, "sample")?;
    }
    Ok(())
}

fn to_json(
    args: &PipelineArgs,
    stages: &[Sampled],
    rows: &[Sampled],
    ideal_ferry: Option<f64>,
    ideal_torch: Option<f64>,
) -> Value {
    let entry = |m: &Sampled| {
        json!({
            "id": m.id,
            "ferry_ms_per_frame": m.ferry.samples_ms,
            "ferry_median": m.ferry_ms(),
            "ferry_error": m.ferry.error,
            "pytorch_ms_per_frame": m.pytorch.samples_ms,
            "pytorch_median": m.pytorch_ms(),
            "pytorch_error": m.pytorch.error,
        })
    };
    json!({
        "frame": FRAME,
        "dtype": "f32",
        "frames": args.frames,
        "host_passes": args.host_passes,
        "depth": args.depth,
        "samples": args.samples,
        "stages": stages.iter().map(entry).collect::<Vec<_>>(),
        "rows": rows.iter().map(entry).collect::<Vec<_>>(),
        "ideal_ms_per_frame": { "ferry": ideal_ferry, "pytorch": ideal_torch },
        "goal_of_ideal": IDEAL_GOAL,
        "article_speedup": ARTICLE_SPEEDUP,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measured(ferry: &[f64], pytorch: &[f64]) -> Sampled {
        Sampled {
            id: "x",
            ferry: Measured::from_samples(ferry.to_vec()),
            pytorch: Measured::from_samples(pytorch.to_vec()),
        }
    }

    #[test]
    fn the_ideal_is_the_slowest_stage_and_missing_numbers_stay_missing() {
        let stages = [
            measured(&[0.2, 0.3, 0.25], &[0.3]),
            measured(&[0.5], &[]),
            measured(&[0.4], &[0.6]),
        ];
        assert_eq!(ideal(&stages, Sampled::ferry_ms), Some(0.5));
        assert_eq!(ideal(&stages, Sampled::pytorch_ms), None);
        assert_eq!(of_ideal(Some(0.5), Some(0.625)), Some(0.8));
        assert_eq!(percent(gain(Some(1.3), Some(1.0))), "+30%");
    }

    #[test]
    fn the_rows_are_the_ids_the_python_script_answers() {
        let script = include_str!("../python/pipeline.py");
        for id in STAGES.iter().chain(ROWS.iter().map(|(id, _)| id)) {
            assert!(
                script.contains(&format!("\"{id}\"")),
                "crates/ferry-bench/python/pipeline.py has no case \"{id}\""
            );
        }
    }
}
