//! `ferry bench train`: training steps of two MLPs, the digits CNN and the character-level GPT,
//! ferry and PyTorch side by side in one run.
//!
//! A step is zero_grad, forward, cross-entropy, backward and an Adam (lr 1e-3) step, the same on
//! both sides; PyTorch's is python/train.py, eager with TF32 off. A round synchronizes the device,
//! runs many steps, synchronizes again and gives the mean time per step; rounds alternate ferry
//! then PyTorch, and the table shows medians. No loss is read inside a round (`item()` would
//! synchronize every step); it stays on the device until the rounds are over.
//!
//! The `_bf16` cases run the same step with forward and loss inside a bf16 autocast scope
//! (fp32 master weights; PyTorch's `torch.autocast("cuda", torch.bfloat16)`). `mlp_4096_gemms`
//! is no training step: it times only the eight fp32 matrix products of `mlp_4096`'s step
//! (three forward, five backward), with nothing recorded, on each side. It is the floor that
//! both frameworks' steps stand on (the same cuBLAS kernels), so it says how much of a step is
//! left to win.
//!
//! `ferry train`'s step also counts correct predictions, which PyTorch's would not do, so the
//! step timed here is its loss-only core. Modules: `cases` (the cases and a step's phases),
//! `step` (ferry's side of a case), `profile` (where a step's time goes).

mod cases;
mod profile;
mod step;

pub use cases::LR;

use std::error::Error;
use std::path::PathBuf;

use clap::Args;
use ferry::prelude::*;
use serde_json::json;

use crate::Measured;
use crate::harness::pytorch::{PyTorch, PyTorchArgs, PyTorchSide};
use crate::harness::table::{Cell, Report, Table};
use crate::harness::{self, NO_CUDA_DEVICE};
use cases::{CASES, Case};
use step::FerryRun;

#[derive(Args, Debug)]
pub struct TrainBenchArgs {
    #[command(flatten)]
    pytorch: PyTorchArgs,
    /// Write every number, all rounds included, to this JSON file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Where ferry trains: cuda:N or cpu (PyTorch's column is for the GPU only).
    #[arg(long, default_value = "cuda:0")]
    device: Device,
    /// Timed rounds per case and side; the table shows their median (claims need 9 or more).
    #[arg(long, default_value_t = 9, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Untimed rounds per case and side before the timed ones.
    #[arg(long, default_value_t = 2)]
    warmup: u32,
    /// Steps per round for every case [default: each case's own, fewer on the CPU].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    steps: Option<u32>,
    /// Only these cases (ids joined by commas: digits_mlp, mlp_4096, digits_cnn, gpt).
    #[arg(long, value_delimiter = ',', value_name = "IDS")]
    cases: Vec<String>,
    /// After each case's rounds, show where ferry's step spends its time on the GPU: per phase,
    /// as run and with the host ahead, and per kernel.
    #[arg(long)]
    profile: bool,
}

/// The line python/train.py answers with one round: `CASE STEPS`.
fn request(case: &Case, steps: u32) -> String {
    format!("{} {steps}", case.id)
}

/// A case's rounds on each side (ms per step, a round a sample), or why a side has none.
#[derive(Debug)]
struct CaseResult<'a> {
    case: &'a Case,
    steps: u32,
    ferry: Measured,
    /// ferry's loss after its last round: finite if the steps computed something sane.
    final_loss: Option<f64>,
    pytorch: Measured,
}

/// Warm-up rounds, then timed rounds; each round runs ferry's, then PyTorch's.
fn measure<'a>(
    case: &'a Case,
    device: Device,
    steps: u32,
    mut torch: Option<&mut PyTorch>,
    (warmup, rounds): (u32, u32),
    profile: bool,
) -> CaseResult<'a> {
    let mut m = CaseResult {
        case,
        steps,
        ferry: Measured::new(),
        final_loss: None,
        pytorch: Measured::new(),
    };
    let mut ferry = FerryRun::new(case, device)
        .map_err(|e| m.ferry.fail(e.to_string()))
        .ok();
    for round in 0..warmup + rounds {
        let timed = round >= warmup;
        if let Some(run) = ferry.as_mut()
            && !m.ferry.record(run.round_ms_per_step(steps), timed)
        {
            ferry = None;
        }
        if let (Some(torch), false) = (torch.as_deref_mut(), m.pytorch.is_failed()) {
            m.pytorch.record(torch.sample(&request(case, steps)), timed);
        }
        if ferry.is_none() && (torch.is_none() || m.pytorch.is_failed()) {
            break;
        }
    }
    if let (true, Some(run)) = (profile, ferry.as_mut())
        && let Err(err) = profile::profile(case, run, steps.min(20))
    {
        println!("profile of {}: {err}", case.id);
    }
    if let Some(loss) = ferry.as_ref().and_then(|run| run.loss.as_ref()) {
        match loss.item() {
            Ok(v) if v.is_finite() => m.final_loss = Some(v),
            Ok(v) => m
                .ferry
                .fail(format!("the loss became {v}: the timings mean nothing")),
            Err(err) => m.ferry.fail(err.to_string()),
        }
    }
    m
}

/// `--cases`: the cases with these ids, in table order (all of them for none).
fn select(ids: &[String]) -> Result<Vec<&'static Case>, String> {
    harness::select(&CASES, ids, "case", |c| c.id)
}

pub fn run(args: TrainBenchArgs) -> Result<(), Box<dyn Error>> {
    let selected = select(&args.cases)?;
    let device = match args.device {
        Device::Cpu => {
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            format!("cpu ({threads} threads)")
        }
        Device::Cuda(ordinal) => {
            let why_not = |err: &dyn std::fmt::Display| format!("{NO_CUDA_DEVICE}: {err}");
            let Some(dev) = harness::cuda_device_or_say(ordinal, why_not) else {
                return Ok(());
            };
            format!("{} ({})", dev.device(), dev.info().name)
        }
    };
    let on_gpu = args.device != Device::Cpu;
    let mut torch = if args.pytorch.compare_pytorch && !on_gpu {
        PyTorchSide::absent("no PyTorch column: it is compared on the GPU only")
    } else {
        args.pytorch.side("train.py", "column")
    };
    let mut measured = Vec::new();
    for case in selected {
        let steps = args
            .steps
            .unwrap_or(if on_gpu { case.steps } else { case.cpu_steps });
        eprintln!("measuring {} ({steps} step(s) a round) ...", case.id);
        let rounds = (args.warmup, args.rounds);
        let m = measure(case, args.device, steps, torch.torch(), rounds, args.profile);
        if let Some(note) = torch.ended_during(case.id, &m.pytorch) {
            torch.note = Some(note);
        }
        measured.push(m);
    }
    let pytorch = torch.label.as_ref().map_or(String::new(), |p| {
        format!("; PyTorch {p}, eager, rounds alternating with ferry's")
    });
    let (rounds, warmup) = (args.rounds, args.warmup);
    let title = format!(
        "ferry bench train on {device}: fp32; a step = zero_grad, forward, cross-entropy, \
         backward, Adam (lr {LR}) step\nmedian ms/step of {rounds} rounds after {warmup} warm-up \
         rounds per case{pytorch}{}",
        torch.note.as_ref().map_or(String::new(), |n| format!("\n{n}"))
    );
    let report = Report::new("train", title).with_facts(json!({
        "device": device,
        "optimizer": format!("Adam lr {LR}"),
        "rounds": rounds,
        "warmup": warmup,
        "pytorch": torch.label,
        "pytorch_note": torch.note,
    }));
    report_cases(report, &measured, on_gpu).finish(args.json.as_deref())
}

/// A row per case: medians, ratio, target and verdict, judged only on a GPU (the targets are
/// the H200's).
fn cases_table(measured: &[CaseResult<'_>], on_gpu: bool) -> Table {
    let mut table = Table::new(&[
        "case",
        "ferry ms/step",
        "PyTorch ms/step",
        "ratio",
        "target",
        "met",
    ]);
    for m in measured {
        let (ferry, pytorch) = (m.ferry.complete_median(), m.pytorch.complete_median());
        let verdict = ferry.filter(|_| on_gpu).map(|f| m.case.target.verdict(f, None, pytorch));
        let cells = vec![
            Cell::text(m.case.id),
            Cell::median(&m.ferry),
            Cell::median(&m.pytorch),
            Cell::ratio(ferry, pytorch),
            Cell::text(m.case.target.describe()),
            verdict.map_or(Cell::number(None), Cell::verdict),
        ];
        let (widths, batch) = (m.case.widths, m.case.batch);
        let extra = json!({ "widths": widths, "batch": batch, "steps_per_round": m.steps,
                            "final_loss": m.final_loss });
        table.push_with(cells, extra);
    }
    table
}

/// The table of cases and the notes under it.
fn report_cases(mut report: Report, measured: &[CaseResult<'_>], on_gpu: bool) -> Report {
    report.table("cases", None, cases_table(measured, on_gpu));
    report.note("ratio: ferry / PyTorch (below 1, ferry is faster).");
    if !on_gpu {
        report.note(
            "targets: the issues' (6 for the MLPs, 13 for the CNN and the GPT), for cuda:0 on \
             the H200; not judged on the CPU.",
        );
    }
    report.note("what ran:");
    for m in measured {
        let loss = m.final_loss.map_or(String::new(), |l| {
            format!("; ferry's loss after: {l:.4}")
        });
        let plural = if m.steps == 1 { "" } else { "s" };
        let (id, what, steps) = (m.case.id, m.case.describe(), m.steps);
        report.note(format!("  {id}: {what}, {steps} step{plural} a round{loss}"));
    }
    for m in measured {
        for (side, error) in [("ferry", &m.ferry.error), ("PyTorch", &m.pytorch.error)] {
            if let Some(e) = error {
                report.note(format!("error: {} ({side}): {e}", m.case.id));
            }
        }
    }
    report
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::cases::{Precision, TINY};
    use super::*;

    /// python/train.py must time the same models as this table.
    #[test]
    fn the_cases_match_train_py() {
        let script = include_str!("../../python/train.py");
        for case in &CASES {
            let entry = format!(
                "\"{}\": ({:?}, {}, {}),",
                case.id, case.widths, case.batch, case.steps
            );
            assert!(script.contains(&entry), "train.py lacks `{entry}`");
        }
        let bf16: Vec<&str> = CASES
            .iter()
            .filter(|c| c.precision == Precision::Bf16Autocast)
            .map(|c| c.id)
            .collect();
        assert!(
            script.contains(
                &format!("BF16 = {bf16:?}")
                    .replace('[', "{")
                    .replace(']', "}")
            ),
            "train.py's BF16 must be {bf16:?}"
        );
        assert!(script.contains("allow_tf32 = False"));
        assert!(
            script.contains(&format!("LR = {LR:e}")),
            "train.py must use lr {LR}"
        );
        assert_eq!(request(&CASES[1], 50), "mlp_4096 50");
        assert!(select(&["mlp_4096".into()]).unwrap()[0].id == "mlp_4096");
        assert_eq!(select(&[]).unwrap().len(), CASES.len());
        let err = select(&["resnet".into()]).unwrap_err();
        assert_eq!(
            err,
            "no case `resnet`; the cases are digits_mlp, mlp_4096, digits_cnn, gpt, \
             mlp_4096_gemms, mlp_4096_bf16, digits_cnn_bf16, gpt_bf16"
        );
    }

    /// A stand-in for train.py (`sh -u script --serve` runs it): its round takes STEPS ms a step,
    /// and `broken` fails.
    fn fake_server(dir: &Path) -> PathBuf {
        crate::harness::pytorch::fake_script(
            dir,
            r#"echo '{"ready": true, "torch": "2.11.0", "cuda": "13.0", "device": "Fake GPU"}'
while read case steps; do
  case "$case" in
    quit) exit 0 ;;
    broken) echo '{"error": "CUDA out of memory"}' ;;
    *) echo "{\"case\": \"$case\", \"ms\": $steps}" ;;
  esac
done
"#,
        )
    }

    #[test]
    fn rounds_alternate_and_each_side_keeps_its_own_errors() {
        let dir = tempfile::tempdir().unwrap();
        let mut torch = PyTorch::start("sh", &fake_server(dir.path())).unwrap();
        let m = measure(&TINY, Device::Cpu, 3, Some(&mut torch), (1, 4), false);
        assert_eq!(m.pytorch.samples_ms, [3.0; 4]);
        assert_eq!(m.ferry.samples_ms.len(), 4);
        assert!(!m.ferry.is_failed() && !m.pytorch.is_failed());
        assert!(m.final_loss.is_some_and(f64::is_finite));

        let broken = Case {
            id: "broken",
            ..TINY
        };
        let m = measure(&broken, Device::Cpu, 2, Some(&mut torch), (0, 3), false);
        assert_eq!(m.ferry.samples_ms.len(), 3);
        assert_eq!(m.pytorch.error.as_deref(), Some("CUDA out of memory"));
        assert!(torch.is_alive());
    }

    fn result(case: &'static Case, ferry: &[f64], pytorch: &[f64]) -> CaseResult<'static> {
        CaseResult {
            case,
            steps: case.steps,
            ferry: Measured::from_samples(ferry.to_vec()),
            final_loss: Some(2.3),
            pytorch: Measured::from_samples(pytorch.to_vec()),
        }
    }

    /// What the H200 run will print and save, from made-up rounds.
    #[test]
    fn rows_and_json_carry_medians_ratios_and_verdicts() {
        let mut runs = vec![
            result(&CASES[0], &[0.25, 0.31, 0.28], &[0.9, 0.95, 0.935]),
            result(&CASES[1], &[3.0, 2.9, 3.1], &[2.82, 2.8, 2.9]),
        ];
        let rows = cases_table(&runs, true).texts();
        let row = ["digits_mlp", "0.280", "0.935", "0.299", "<= 0.3 ms", "met"];
        assert_eq!(rows[0], row);
        // 3.0 > 0.9 x 2.82 = 2.538.
        let row = ["3.00", "2.82", "1.06", "<= 0.9x PyTorch", "MISSED"];
        assert_eq!(rows[1][1..], row);
        // On the CPU nothing is judged.
        assert_eq!(cases_table(&runs, false).texts()[0][5], "-");
        let report = |runs: &[CaseResult<'_>]| {
            report_cases(Report::new("train", "test"), runs, true).json()
        };
        let doc = report(&runs);
        let small = &doc["cases"][0];
        assert_eq!(small["case"], "digits_mlp");
        assert_eq!(small["ferry_ms_per_step"]["samples_ms"], json!([0.25, 0.31, 0.28]));
        assert_eq!(small["ferry_ms_per_step"]["median_ms"], json!(0.28));
        assert_eq!(small["pytorch_ms_per_step"]["median_ms"], json!(0.935));
        assert_eq!((&small["target"], &small["met"]), (&json!("<= 0.3 ms"), &json!(true)));
        assert_eq!(small["steps_per_round"], json!(200));
        assert!((small["ratio"].as_f64().unwrap() - 0.28 / 0.935).abs() < 1e-12);
        assert_eq!(doc["cases"][1]["widths"], json!([1024, 4096, 4096, 10]));
        assert_eq!(doc["cases"][1]["met"], json!(false));
        assert_eq!(doc["notes"][2], "  digits_mlp: MLP 64-128-10, batch 64, 200 steps a round; ferry's loss after: 2.3000");

        runs[1].pytorch.fail("the PyTorch script exited without answering");
        let rows = cases_table(&runs, true).texts();
        assert_eq!(rows[1][1..], ["3.00", "error", "-", "<= 0.9x PyTorch", "?"]);
        let doc = report(&runs);
        assert_eq!(doc["cases"][1]["met"], serde_json::Value::Null);
    }
}
