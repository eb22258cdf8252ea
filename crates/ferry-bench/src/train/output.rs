//! What `ferry bench train` reports: each case's rounds on both sides, the table and the JSON.

use serde_json::{Value, json};

use crate::harness::RunSetup;
use crate::{Measured, RunInfo};

use super::cases::{Case, LR};
use crate::harness::report::{Verdict, format_ratio, print_table};

/// A case's rounds on each side (ms per step, a round a sample), or why a side has none.
#[derive(Debug)]
pub struct CaseResult<'a> {
    pub case: &'a Case,
    pub steps: u32,
    pub ferry: Measured,
    /// ferry's loss after its last round: finite if the steps computed something sane.
    pub final_loss: Option<f64>,
    pub pytorch: Measured,
}

impl CaseResult<'_> {
    /// Met or missed, judged only on a GPU (the targets are the H200's); `None` on the CPU.
    fn verdict(&self, on_gpu: bool) -> Option<Verdict> {
        let ferry = self.ferry.complete_median()?;
        on_gpu.then(|| {
            self.case
                .target
                .verdict(ferry, None, self.pytorch.complete_median())
        })
    }
}

pub fn print_header(info: &RunSetup) {
    println!(
        "ferry bench train on {}: fp32; a step = zero_grad, forward, cross-entropy, backward, \
         Adam (lr {LR}) step",
        info.device
    );
    info.print_sampling(
        &format!("median ms/step of {} rounds", info.samples),
        "eager, rounds alternating with ferry's",
    );
}

fn table_rows(measured: &[CaseResult<'_>], on_gpu: bool) -> Vec<Vec<String>> {
    measured
        .iter()
        .map(|m| {
            let (ferry, pytorch) = (m.ferry.complete_median(), m.pytorch.complete_median());
            vec![
                m.case.id.to_string(),
                m.ferry.median_text(),
                m.pytorch.median_text(),
                ferry
                    .zip(pytorch)
                    .map_or("-".into(), |(f, p)| format_ratio(f, p)),
                m.case.target.describe(),
                m.verdict(on_gpu).map_or("-", Verdict::label).to_string(),
            ]
        })
        .collect()
}

pub fn print_results(measured: &[CaseResult<'_>], info: &RunSetup) {
    let header = [
        "case",
        "ferry ms/step",
        "PyTorch ms/step",
        "ratio",
        "target",
        "met",
    ];
    println!();
    print_table(&header, &table_rows(measured, info.on_gpu));
    println!();
    println!("ratio: ferry / PyTorch (below 1, ferry is faster).");
    if !info.on_gpu {
        println!(
            "targets: the issues' (6 for the MLPs, 13 for the CNN and the GPT), for cuda:0 on the H200; not judged on the CPU."
        );
    }
    println!("what ran:");
    for m in measured {
        let loss = m
            .final_loss
            .map_or(String::new(), |l| format!("; ferry's loss after: {l:.4}"));
        let plural = if m.steps == 1 { "" } else { "s" };
        println!(
            "  {}: {}, {} step{plural} a round{loss}",
            m.case.id,
            m.case.describe(),
            m.steps
        );
    }
    for m in measured {
        if let Some(e) = &m.ferry.error {
            println!("error: {} (ferry): {e}", m.case.id);
        }
        if let Some(e) = &m.pytorch.error {
            println!("error: {} (PyTorch): {e}", m.case.id);
        }
    }
    if let Some(note) = &info.pytorch_note {
        println!("note: {note}");
    }
}

pub fn to_json(info: &RunSetup, measured: &[CaseResult<'_>]) -> Value {
    let cases: Vec<Value> = measured
        .iter()
        .map(|m| {
            let (ferry, pytorch) = (m.ferry.complete_median(), m.pytorch.complete_median());
            let met = m.verdict(info.on_gpu).and_then(Verdict::as_bool);
            json!({
                "id": m.case.id,
                "widths": m.case.widths,
                "batch": m.case.batch,
                "steps_per_round": m.steps,
                "target": m.case.target.describe(),
                "met": met,
                "ferry": {
                    "ms_per_step": m.ferry.samples_ms,
                    "median_ms_per_step": ferry,
                    "final_loss": m.final_loss,
                    "error": m.ferry.error,
                },
                "pytorch": {
                    "ms_per_step": m.pytorch.samples_ms,
                    "median_ms_per_step": pytorch,
                    "error": m.pytorch.error,
                },
                "ratio": ferry.zip(pytorch).map(|(f, p)| f / p),
            })
        })
        .collect();
    RunInfo::stamp(json!({
        "benchmark": "ferry bench train",
        "device": info.device,
        "optimizer": format!("Adam lr {LR}"),
        "rounds": info.samples,
        "warmup": info.warmup,
        "pytorch": info.pytorch,
        "pytorch_note": info.pytorch_note,
        "cases": cases,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::CASES;

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
        let rows = table_rows(&runs, true);
        assert_eq!(
            rows[0],
            ["digits_mlp", "0.280", "0.935", "0.299", "<= 0.3 ms", "met"]
        );
        // 3.0 > 0.9 x 2.82 = 2.538.
        assert_eq!(
            rows[1][1..],
            ["3.00", "2.82", "1.06", "<= 0.9x PyTorch", "MISSED"]
        );
        // On the CPU nothing is judged.
        assert_eq!(table_rows(&runs, false)[0][5], "-");

        runs[1]
            .pytorch
            .fail("the PyTorch script exited without answering");
        let rows = table_rows(&runs, true);
        assert_eq!(rows[1][1..], ["3.00", "error", "-", "<= 0.9x PyTorch", "?"]);

        let info = RunSetup {
            device: "cuda:0 (test)".into(),
            on_gpu: true,
            samples: 3,
            warmup: 2,
            pytorch: None,
            pytorch_note: None,
        };
        let doc = to_json(&info, &runs);
        let small = &doc["cases"][0];
        assert_eq!(small["ferry"]["ms_per_step"], json!([0.25, 0.31, 0.28]));
        assert_eq!(small["ferry"]["median_ms_per_step"], json!(0.28));
        assert_eq!(small["pytorch"]["median_ms_per_step"], json!(0.935));
        assert_eq!(small["met"], json!(true));
        assert_eq!(small["steps_per_round"], json!(200));
        assert!((small["ratio"].as_f64().unwrap() - 0.28 / 0.935).abs() < 1e-12);
        assert_eq!(doc["cases"][1]["met"], Value::Null);
        assert_eq!(doc["cases"][1]["widths"], json!([1024, 4096, 4096, 10]));
    }
}
