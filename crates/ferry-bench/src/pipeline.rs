//! `ferry bench pipeline`: a video pipeline. Frames are produced on the GPU (elementwise kernels
//! over a 1080p RGB f32 frame), moved to the host and reduced there. Each stage is timed alone
//! (the ideal is one frame per slowest stage), then whole runs: serial, ferry's pipeline
//! (`to_async` on a copy stream, `--depth` in flight) and `stream_to`; with --compare-pytorch,
//! python/pipeline.py's same stages and rows (side stream, pinned buffers, events). Per row,
//! ferry's runs and then PyTorch's, each block after a pause and an untimed run (see SETTLE).

use std::error::Error;
use std::path::PathBuf;

use clap::Args;
use ferry::{DType, Device, Result, Tensor};
use serde_json::json;

use crate::Measured;
use crate::harness;
use crate::harness::goal::{Bound, Goal};
use crate::harness::pytorch::{PyTorch, PyTorchArgs};
use crate::harness::table::{Cell, Report, Table};
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
/// Indices in `ROWS` of the pipelines judged against the goals, and their goals: ferry at
/// IDEAL_GOAL of the ideal or better, and no slower than PyTorch's best row.
const PIPELINES: [usize; 2] = [1, 2];
const GOALS: [[Goal; 2]; 2] = [
    [
        goal("pipelined: of ideal >= 0.95", "rows[pipelined].of_ideal.ferry", IDEAL_GOAL),
        goal("pipelined: PyTorch best / ferry >= 1", "pytorch_best_per_ferry", 1.0),
    ],
    [
        goal("pipelined_slots: of ideal >= 0.95", "rows[pipelined_slots].of_ideal.ferry", IDEAL_GOAL),
        goal("pipelined_slots: PyTorch best / ferry >= 1", "pytorch_best_per_ferry", 1.0),
    ],
];

const fn goal(name: &'static str, metric: &'static str, at_least: f64) -> Goal {
    let bound = Bound::AtLeast(at_least);
    Goal { name, metric, bound }
}
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
        self.ferry.complete_median()
    }

    fn pytorch_ms(&self) -> Option<f64> {
        self.pytorch.complete_median()
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

/// `ideal / ms` (the fraction of full overlap reached).
fn of_ideal(ideal: Option<f64>, ms: Option<f64>) -> Option<f64> {
    Some(ideal? / ms?)
}

/// Speedup over serial as a percentage gain: 0.30 is 30% more frames per second.
fn gain(serial: Option<f64>, ms: Option<f64>) -> Option<f64> {
    Some(serial? / ms? - 1.0)
}

fn fps(ms: Option<f64>) -> Cell {
    Cell::shown(ms.map(|ms| 1e3 / ms), |f| format!("{f:.0}"))
}

fn percent(x: Option<f64>) -> Cell {
    Cell::shown(x, |x| format!("{:+.0}%", x * 100.0))
}

fn two_places(x: Option<f64>) -> Cell {
    Cell::shown(x, |x| format!("{x:.2}"))
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
    let mut title = format!(
        "ferry bench pipeline on {} ({}): {frames} frames of {FRAME:?} f32 ({:.1} MB), {} host \
         pass(es), {depth} in flight, median of {} runs",
        fx.dev.device(),
        fx.dev.info().name,
        FRAME.iter().product::<usize>() as f64 * 4.0 / 1e6,
        args.host_passes,
        args.samples
    );
    if let Some(label) = &torch.label {
        title += &format!("\nPyTorch {label}");
    }
    let mut measured = |ids: &[&'static str]| -> Vec<Sampled> {
        ids.iter()
            .map(|&id| {
                eprintln!("measuring {id} ...");
                measure(id, &fx, torch.torch(), args.samples)
            })
            .collect()
    };
    let stages = measured(&STAGES);
    let rows = measured(&ROWS.map(|(id, _)| id));
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
    report(&args, title, &stages, &rows, torch.note.as_deref()).finish(args.json.as_deref())
}

fn report(
    args: &PipelineArgs,
    title: String,
    stages: &[Sampled],
    rows: &[Sampled],
    pytorch_note: Option<&str>,
) -> Report {
    let mut stage_table = Table::new(&["stage", "ferry", "PyTorch"]);
    for m in stages {
        stage_table.push(vec![
            Cell::text(m.id),
            Cell::median(&m.ferry),
            Cell::median(&m.pytorch),
        ]);
    }
    let ideal_ferry = ideal(stages, Sampled::ferry_ms);
    let ideal_torch = ideal(stages, Sampled::pytorch_ms);
    let ms = |x: Option<f64>| Cell::number(x).as_text().to_string();
    let fps_text = |x: Option<f64>| fps(x).as_text().to_string();
    let whole_runs = format!(
        "ideal (full overlap, 1/max of the stages): ferry {} ms/frame ({} frames/s), PyTorch {} \
         ms/frame ({} frames/s)\n\nwhole runs (ms per frame; of ideal = ideal / ms, goal >= \
         {IDEAL_GOAL})",
        ms(ideal_ferry),
        fps_text(ideal_ferry),
        ms(ideal_torch),
        fps_text(ideal_torch),
    );

    let (serial_ferry, serial_torch) = (rows[0].ferry_ms(), rows[0].pytorch_ms());
    let torch_best = rows.iter().filter_map(Sampled::pytorch_ms).reduce(f64::min);
    let best_over = |f: Option<f64>| Some(torch_best? / f?);
    let mut table = Table::new(&[
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
    ]);
    for ((id, label), m) in ROWS.iter().zip(rows) {
        let (f, p) = (m.ferry_ms(), m.pytorch_ms());
        let both = |ferry: Option<f64>, pytorch: Option<f64>| json!({ "ferry": ferry, "pytorch": pytorch });
        table.push_with(
            vec![
                Cell::text(*label),
                Cell::median(&m.ferry),
                fps(f),
                two_places(of_ideal(ideal_ferry, f)),
                percent(gain(serial_ferry, f)),
                Cell::median(&m.pytorch),
                fps(p),
                two_places(of_ideal(ideal_torch, p)),
                percent(gain(serial_torch, p)),
                two_places(best_over(f)),
            ],
            // Both sides have these columns; the file keeps both.
            json!({
                "id": id,
                "frames_per_s": both(f.map(|f| 1e3 / f), p.map(|p| 1e3 / p)),
                "of_ideal": both(of_ideal(ideal_ferry, f), of_ideal(ideal_torch, p)),
                "vs_serial": both(gain(serial_ferry, f), gain(serial_torch, p)),
            }),
        );
    }
    let mut report = Report::new("pipeline", title).with_facts(json!({
        "frame": FRAME,
        "dtype": "f32",
        "frames": args.frames,
        "host_passes": args.host_passes,
        "depth": args.depth,
        "samples": args.samples,
        "ideal_ms_per_frame": { "ferry": ideal_ferry, "pytorch": ideal_torch },
        "article_speedup": ARTICLE_SPEEDUP,
    }));
    report.table(
        "stages",
        Some("per frame, each stage alone (ms)".into()),
        stage_table,
    );
    report.table("rows", Some(whole_runs), table);
    for (row, [to_ideal, to_torch]) in PIPELINES.iter().zip(&GOALS) {
        let f = rows[*row].ferry_ms();
        let (of, best) = (of_ideal(ideal_ferry, f), best_over(f));
        report.goals([
            to_ideal.judge(of, two_places(of).as_text().into()),
            to_torch.judge(best, two_places(best).as_text().into()),
        ]);
        report.note(format!(
            "{}: {} over serial, next to the article's {:+.0}%",
            ROWS[*row].1,
            percent(gain(serial_ferry, f)).as_text(),
            ARTICLE_SPEEDUP * 100.0
        ));
    }
    for m in stages.iter().chain(rows) {
        for (side, error) in [("ferry", &m.ferry.error), ("PyTorch", &m.pytorch.error)] {
            if let Some(err) = error {
                report.note(format!("{side} {}: {err}", m.id));
            }
        }
    }
    if let Some(note) = pytorch_note {
        report.note(note);
    }
    report
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

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
        assert_eq!(percent(gain(Some(1.3), Some(1.0))).as_text(), "+30%");
    }

    #[test]
    fn rows_goals_and_json_come_from_one_report() {
        let args = PipelineArgs {
            pytorch: PyTorchArgs::default(),
            json: None,
            frames: 8,
            host_passes: 1,
            depth: 3,
            samples: 1,
            trace: false,
        };
        let stages = [
            measured(&[0.2], &[0.3]),
            measured(&[0.5], &[0.6]),
            measured(&[0.4], &[0.5]),
        ];
        let rows = [
            measured(&[1.0], &[1.2]),
            measured(&[0.5], &[0.6]),
            measured(&[0.625], &[]),
            measured(&[0.9], &[1.0]),
        ];
        let report = report(&args, "t".into(), &stages, &rows, None);
        let lines: Vec<String> = report.judged().iter().map(|j| j.line()).collect();
        assert_eq!(
            lines,
            [
                "goal: pipelined: of ideal >= 0.95: 1.00 met",
                "goal: pipelined: PyTorch best / ferry >= 1: 1.20 met",
                "goal: pipelined_slots: of ideal >= 0.95: 0.80 MISSED",
                "goal: pipelined_slots: PyTorch best / ferry >= 1: 0.96 MISSED",
            ]
        );
        let doc = report.json();
        assert_eq!(doc["ideal_ms_per_frame"]["ferry"], json!(0.5));
        let slots = &doc["rows"][2];
        assert_eq!(slots["ferry_ms"]["median_ms"], json!(0.625));
        assert_eq!(slots["frames_per_s"]["ferry"], json!(1600.0));
        assert_eq!(slots["of_ideal"]["ferry"], json!(0.8));
        assert!((slots["vs_serial"]["ferry"].as_f64().unwrap() - 0.6).abs() < 1e-12);
        assert_eq!(slots["of_ideal"]["pytorch"], Value::Null);
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
