//! `ferry bench transfer`: the device moves of the performance issue against the link (a pinned
//! DMA of the same 400 MB, measured first) and, with --compare-pytorch, against PyTorch, sampled
//! alternately in one run. ferry's side of a case is a function in `ferry_cases`, PyTorch's the
//! function of the same id in python/transfer.py.

use std::error::Error;

use clap::Args;

use serde_json::json;

use crate::Measured;
use crate::harness::pytorch::PyTorch;
use crate::harness::report::{Verdict, significant};
use crate::harness::table::{Cell, Report, Table};
use crate::harness::{self, NO_CUDA_DEVICE, RunSetup, SampledArgs};
use cases::{Case, LINK_IDS, Link, cases, select};
use ferry_cases::{self as ferry_side, BIG_BYTES, BenchResult, Fixture, SIDE, SMALL_REPS};

mod cases;
mod ferry_cases;
mod resnet50;

#[derive(Args, Debug)]
pub struct TransferArgs {
    #[command(flatten)]
    run: SampledArgs,
    /// Only these cases (ids joined by commas, listed under the table); the link always runs.
    #[arg(long, value_delimiter = ',', value_name = "IDS")]
    cases: Vec<String>,
    /// Internal: time one cpu() in this fresh process and print its milliseconds.
    #[arg(long, hide = true)]
    first_cpu_sample: bool,
}

/// Warm-up rounds, then timed rounds; each round runs ferry's sample, then PyTorch's.
fn measure<'a>(
    case: &'a Case,
    fx: &mut Fixture,
    mut torch: Option<&mut PyTorch>,
    warmup: u32,
    samples: u32,
) -> BenchResult<CaseResult<'a>> {
    let mut m = CaseResult {
        case,
        ferry: Measured::new(),
        staging_peak: None,
        pytorch: Measured::new(),
    };
    for round in 0..warmup + samples {
        let timed = round >= warmup;
        if !m.ferry.is_failed() {
            fx.dev.synchronize()?;
            match (case.run)(fx) {
                Ok(sample) if timed => {
                    m.ferry.push(sample.ms);
                    m.staging_peak = m.staging_peak.max(sample.staging_peak_bytes);
                }
                Ok(_) => {}
                Err(err) => m.ferry.fail(err.to_string()),
            }
        }
        if let (Some(torch), false) = (torch.as_deref_mut(), m.pytorch.is_failed()) {
            match torch.sample(case.id) {
                Ok(ms) if timed => m.pytorch.push(ms),
                Ok(_) => {}
                Err(err) => m.pytorch.fail(err),
            }
        }
        if m.ferry.is_failed() && (torch.is_none() || m.pytorch.is_failed()) {
            break;
        }
    }
    Ok(m)
}

pub fn run(args: TransferArgs) -> Result<(), Box<dyn Error>> {
    if args.first_cpu_sample {
        println!("{}", ferry_side::first_cpu_in_this_process()?);
        return Ok(());
    }
    let all = cases();
    let selected = select(&all, &args.cases)?;
    let Some(dev) = harness::cuda_device_or_say(0, |err| format!("{NO_CUDA_DEVICE}: {err}")) else {
        return Ok(());
    };
    let mut torch = args.run.pytorch.side("transfer.py", "column");
    let mut info = RunSetup {
        device: format!("{} ({})", dev.device(), dev.info().name),
        on_gpu: true,
        samples: args.run.samples,
        warmup: args.run.warmup,
        pytorch: torch.label.clone(),
        pytorch_note: torch.note.clone(),
    };
    let mut fx = Fixture::new(dev)?;
    let mut measured = Vec::new();
    for case in &selected {
        eprintln!("measuring {} ...", case.id);
        let m = measure(
            case,
            &mut fx,
            torch.torch(),
            args.run.warmup,
            args.run.samples,
        )?;
        if let Some(note) = torch.ended_during(case.id, &m.pytorch) {
            info.pytorch_note = Some(note);
        }
        measured.push(m);
    }
    drop(fx);
    report(&info, &measured).finish(args.run.json.as_deref())
}

/// A case's samples on each side, or why a side has none.
struct CaseResult<'a> {
    case: &'a Case,
    ferry: Measured,
    staging_peak: Option<usize>,
    pytorch: Measured,
}

impl CaseResult<'_> {
    fn gbps(&self) -> Option<f64> {
        let ms = self.ferry.complete_median()?;
        Some(self.case.bytes as f64 / ms / 1e6)
    }
}

/// The link's speed in each direction (ferry's pinned DMA medians), GB/s.
fn link_gbps(measured: &[CaseResult<'_>]) -> [Option<f64>; 2] {
    LINK_IDS.map(|id| measured.iter().find(|m| m.case.id == id)?.gbps())
}

fn table(measured: &[CaseResult<'_>]) -> Table {
    let link = link_gbps(measured);
    let mut table = Table::new(&[
        "case", "ferry", "PyTorch", "ratio", "GB/s", "% link", "staging", "target", "met",
    ]);
    for m in measured {
        let (unit, target) = (m.case.unit, m.case.target);
        let (ferry, pytorch) = (m.ferry.complete_median(), m.pytorch.complete_median());
        let verdict = ferry.map_or(Verdict::NoTarget, |f| {
            target.verdict(f, m.staging_peak, pytorch)
        });
        let link = match m.case.link {
            Link::DeviceToHost => link[0],
            Link::HostToDevice => link[1],
            Link::None => None,
        };
        let staging = m.staging_peak.map(|b| b as f64);
        table.push_with(
            vec![
                Cell::text(m.case.name),
                Cell::median_shown(&m.ferry, |ms| unit.format(ms)),
                Cell::median_shown(&m.pytorch, |ms| unit.format(ms)),
                Cell::ratio(ferry, pytorch),
                Cell::number(m.gbps()),
                Cell::shown(m.gbps().zip(link).map(|(g, l)| g / l * 100.0), |p| {
                    format!("{p:.0}%")
                }),
                Cell::text(staging.map_or(String::new(), |b| {
                    format!("{} MB", significant(b / 1e6))
                }))
                .recorded(json!(m.staging_peak)),
                Cell::text(target.describe()),
                Cell::verdict(verdict),
            ],
            json!({
                "id": m.case.id,
                "ferry_code": m.case.ferry,
                "pytorch_code": m.case.pytorch,
                "unit": unit.name(),
                "bytes": m.case.bytes,
            }),
        );
    }
    table
}

fn report(info: &RunSetup, measured: &[CaseResult<'_>]) -> Report {
    let link = link_gbps(measured);
    let title = format!(
        "ferry bench transfer on {}: {SIDE}x{SIDE} f32 = {} MB; resnet50 state dict: {} \
         tensors, {} MB of f32\n{}",
        info.device,
        BIG_BYTES / 1_000_000,
        resnet50::state_dict().len(),
        significant(resnet50::float_bytes() as f64 / 1e6),
        info.sampling_line(
            &format!("median of {} samples", info.samples),
            "sampled alternately with ferry",
        ),
    );
    let mut report = Report::new("transfer", title).with_facts(json!({
        "device": info.device,
        "host_threads": std::thread::available_parallelism().map_or(1, |n| n.get()),
        "samples": info.samples,
        "warmup": info.warmup,
        "pytorch": info.pytorch,
        "pytorch_note": info.pytorch_note,
        "link_gbps": { "device_to_host": link[0], "host_to_device": link[1] },
        "resnet50_state_dict": {
            "tensors": resnet50::state_dict().len(),
            "float_bytes": resnet50::float_bytes(),
            "total_bytes": resnet50::total_bytes(),
        },
    }));
    report.table("cases", None, table(measured));
    report.note(format!(
        "ratio: ferry / PyTorch (below 1, ferry is faster). GB/s: source bytes over ferry's \
         median. % link: that over the pinned DMA in the same direction. Small cases: the mean \
         of {SMALL_REPS} moves per sample. staging: ferry's pinned staging peak."
    ));
    report.note("what ran (id: ferry | PyTorch):");
    for m in measured {
        report.note(format!("  {}: {} | {}", m.case.id, m.case.ferry, m.case.pytorch));
    }
    let errors = measured.iter().flat_map(|m| {
        let side = |name: &str, side: &Measured| {
            let err = side.error.as_ref()?;
            Some(format!("  {} ({name}): {err}", m.case.id))
        };
        side("ferry", &m.ferry).into_iter().chain(side("PyTorch", &m.pytorch))
    });
    let errors: Vec<String> = errors.collect();
    if !errors.is_empty() {
        report.note("errors:");
        errors.into_iter().for_each(|e| report.note(e));
    }
    if let Some(note) = &info.pytorch_note {
        report.note(format!("note: {note}"));
    }
    report
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    /// crates/ferry-bench/README.md's commands are the ones a reader copies: they must parse.
    #[test]
    fn the_readme_commands_parse() {
        let readme = include_str!("../README.md");
        let commands: Vec<&str> = readme
            .lines()
            .filter_map(|l| l.strip_prefix("cargo run --release -p ferry-cli -- "))
            .collect();
        assert!(!commands.is_empty());
        for command in commands {
            if let Err(err) = crate::parse_bench(&format!("ferry {command}")) {
                panic!("`{command}` does not parse: {err}");
            }
        }
    }

    fn result<'a>(case: &'a Case, ferry: &[f64], pytorch: &[f64]) -> CaseResult<'a> {
        CaseResult {
            case,
            ferry: Measured::from_samples(ferry.to_vec()),
            staging_peak: None,
            pytorch: Measured::from_samples(pytorch.to_vec()),
        }
    }

    /// The numbers a run reports, from made-up samples: what the H200 run will print and save.
    #[test]
    fn rows_and_json_carry_medians_ratios_and_verdicts() {
        let all = cases();
        let by_id = |id: &str| all.iter().find(|c| c.id == id).unwrap();
        let mut runs = vec![
            result(by_id("link_d2h"), &[8.0, 7.0, 7.5], &[7.6, 7.4, 7.5]),
            result(
                by_id("cpu_repeated"),
                &[9.0, 15.0, 9.5],
                &[287.0, 290.0, 280.0],
            ),
            result(by_id("small_4k"), &[0.02, 0.03, 0.025], &[]),
        ];
        runs[2]
            .pytorch
            .fail("the PyTorch script exited without answering");
        let link = link_gbps(&runs);
        // 400 MB in 7.5 ms.
        assert!((link[0].unwrap() - 53.333).abs() < 1e-2);
        assert_eq!(link[1], None);

        let info = RunSetup {
            device: "cuda:0 (test)".into(),
            on_gpu: true,
            samples: 3,
            warmup: 0,
            pytorch: None,
            pytorch_note: None,
        };
        let rows = table(&runs).texts();
        assert_eq!(rows[0][5], "100%");
        assert_eq!(
            rows[1][1..],
            [
                "9.50 ms", "287 ms", "0.0331", "42.1", "79%", "", "<= 10 ms", "met"
            ]
        );
        assert_eq!(rows[2][1..5], ["25.0 µs", "error", "-", "0.164"]);
        assert_eq!(rows[2][8], "?");

        let doc = report(&info, &runs).json();
        let cpu = &doc["cases"][1];
        assert_eq!(cpu["ferry"]["samples_ms"], json!([9.0, 15.0, 9.5]));
        assert_eq!(cpu["ferry"]["median_ms"], json!(9.5));
        assert_eq!(cpu["pytorch"]["median_ms"], json!(287.0));
        assert_eq!(cpu["met"], json!(true));
        assert!((cpu["ratio"].as_f64().unwrap() - 9.5 / 287.0).abs() < 1e-12);
        assert_eq!(doc["cases"][2]["met"], Value::Null);
        assert_eq!(doc["resnet50_state_dict"]["tensors"], json!(320));
    }
}
