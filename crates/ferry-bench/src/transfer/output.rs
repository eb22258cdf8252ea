//! What `ferry bench transfer` reports: the samples of each case, the link's speed, the table
//! and the JSON file.

use serde_json::{Value, json};

use crate::harness::RunSetup;
use crate::{Measured, RunInfo};

use super::cases::{Case, LINK_IDS, Link};
use super::ferry_cases::{BIG_BYTES, SIDE, SMALL_REPS};
use super::resnet50;
use crate::harness::report::{format_ratio, print_table, significant};

/// A case's samples on each side, or why a side has none.
pub struct CaseResult<'a> {
    pub case: &'a Case,
    pub ferry: Measured,
    pub staging_peak: Option<usize>,
    pub pytorch: Measured,
}

impl CaseResult<'_> {
    fn gbps(&self) -> Option<f64> {
        self.ferry
            .complete_median()
            .map(|ms| self.case.bytes as f64 / ms / 1e6)
    }
}

/// The link's speed in each direction (ferry's pinned DMA medians), in GB/s.
#[derive(Debug, Clone, Copy, Default)]
pub struct LinkSpeed {
    device_to_host: Option<f64>,
    host_to_device: Option<f64>,
}

impl LinkSpeed {
    pub fn from_measured(measured: &[CaseResult<'_>]) -> Self {
        let gbps = |id: &str| measured.iter().find(|m| m.case.id == id)?.gbps();
        Self {
            device_to_host: gbps(LINK_IDS[0]),
            host_to_device: gbps(LINK_IDS[1]),
        }
    }

    /// A case's throughput as a percentage of the link in its direction.
    fn percent(self, m: &CaseResult<'_>) -> Option<f64> {
        let link = match m.case.link {
            Link::DeviceToHost => self.device_to_host,
            Link::HostToDevice => self.host_to_device,
            Link::None => None,
        };
        Some(m.gbps()? / link? * 100.0)
    }
}

pub fn print_header(info: &RunSetup) {
    println!(
        "ferry bench transfer on {}: {SIDE}x{SIDE} f32 = {} MB; resnet50 state dict: {} \
         tensors, {} MB of f32",
        info.device,
        BIG_BYTES / 1_000_000,
        resnet50::state_dict().len(),
        significant(resnet50::float_bytes() as f64 / 1e6),
    );
    info.print_sampling(
        &format!("median of {} samples", info.samples),
        "sampled alternately with ferry",
    );
}

fn table_rows(measured: &[CaseResult<'_>], link: LinkSpeed) -> Vec<Vec<String>> {
    measured
        .iter()
        .map(|m| {
            let unit = m.case.unit;
            let ferry = m.ferry.complete_median();
            let pytorch = m.pytorch.complete_median();
            let time = |side: &Measured| side.median_cell(|ms| unit.format(ms));
            let verdict = ferry.map(|f| m.case.target.verdict(f, m.staging_peak, pytorch));
            vec![
                m.case.name.to_string(),
                time(&m.ferry),
                time(&m.pytorch),
                match (ferry, pytorch) {
                    (Some(f), Some(p)) => format_ratio(f, p),
                    _ => "-".into(),
                },
                m.gbps().map_or("-".into(), significant),
                link.percent(m).map_or("-".into(), |p| format!("{p:.0}%")),
                m.staging_peak.map_or(String::new(), |b| {
                    format!("{} MB", significant(b as f64 / 1e6))
                }),
                m.case.target.describe(),
                verdict.map_or("", |v| v.label()).to_string(),
            ]
        })
        .collect()
}

pub fn print_results(measured: &[CaseResult<'_>], link: LinkSpeed, info: &RunSetup) {
    let header = [
        "case", "ferry", "PyTorch", "ratio", "GB/s", "% link", "staging", "target", "",
    ];
    println!();
    print_table(&header, &table_rows(measured, link));
    println!();
    println!(
        "ratio: ferry / PyTorch (below 1, ferry is faster). GB/s: source bytes over ferry's \
         median. % link: that over the pinned DMA in the same direction. Small cases: the mean \
         of {SMALL_REPS} moves per sample. staging: ferry's pinned staging peak."
    );
    println!("what ran (id: ferry | PyTorch):");
    for m in measured {
        println!("  {}: {} | {}", m.case.id, m.case.ferry, m.case.pytorch);
    }
    let errors: Vec<String> = measured
        .iter()
        .flat_map(|m| {
            let ferry = m
                .ferry
                .error
                .as_ref()
                .map(|e| format!("  {} (ferry): {e}", m.case.id));
            let torch = m
                .pytorch
                .error
                .as_ref()
                .map(|e| format!("  {} (PyTorch): {e}", m.case.id));
            ferry.into_iter().chain(torch)
        })
        .collect();
    if !errors.is_empty() {
        println!("errors:");
        errors.iter().for_each(|e| println!("{e}"));
    }
    if let Some(note) = &info.pytorch_note {
        println!("note: {note}");
    }
}

pub fn to_json(info: &RunSetup, measured: &[CaseResult<'_>], link: LinkSpeed) -> Value {
    let cases: Vec<Value> = measured
        .iter()
        .map(|m| {
            let (ferry, pytorch) = (m.ferry.complete_median(), m.pytorch.complete_median());
            let verdict = ferry.map(|f| m.case.target.verdict(f, m.staging_peak, pytorch));
            json!({
                "id": m.case.id,
                "name": m.case.name,
                "ferry_code": m.case.ferry,
                "pytorch_code": m.case.pytorch,
                "unit": m.case.unit.name(),
                "bytes": m.case.bytes,
                "target": m.case.target.describe(),
                "met": verdict.and_then(|v| v.as_bool()),
                "ferry": {
                    "samples_ms": m.ferry.samples_ms,
                    "median_ms": ferry,
                    "staging_peak_bytes": m.staging_peak,
                    "error": m.ferry.error,
                },
                "pytorch": {
                    "samples_ms": m.pytorch.samples_ms,
                    "median_ms": pytorch,
                    "error": m.pytorch.error,
                },
                "ratio": ferry.zip(pytorch).map(|(f, p)| f / p),
                "gbps": m.gbps(),
                "link_percent": link.percent(m),
            })
        })
        .collect();
    RunInfo::stamp(json!({
        "benchmark": "ferry bench transfer",
        "device": info.device,
        "host_threads": std::thread::available_parallelism().map_or(1, |n| n.get()),
        "samples": info.samples,
        "warmup": info.warmup,
        "pytorch": info.pytorch,
        "pytorch_note": info.pytorch_note,
        "link_gbps": {
            "device_to_host": link.device_to_host,
            "host_to_device": link.host_to_device,
        },
        "resnet50_state_dict": {
            "tensors": resnet50::state_dict().len(),
            "float_bytes": resnet50::float_bytes(),
            "total_bytes": resnet50::total_bytes(),
        },
        "cases": cases,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::cases::cases;
    use serde_json::json;

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
        let link = LinkSpeed::from_measured(&runs);
        // 400 MB in 7.5 ms.
        assert!((link.device_to_host.unwrap() - 53.333).abs() < 1e-2);
        assert_eq!(link.host_to_device, None);

        let rows = table_rows(&runs, link);
        assert_eq!(rows[0][5], "100%");
        assert_eq!(
            rows[1][1..],
            [
                "9.50 ms", "287 ms", "0.0331", "42.1", "79%", "", "<= 10 ms", "met"
            ]
        );
        assert_eq!(rows[2][1..5], ["25.0 µs", "error", "-", "0.164"]);
        assert_eq!(rows[2][8], "?");

        let info = RunSetup {
            device: "cuda:0 (test)".into(),
            on_gpu: true,
            samples: 3,
            warmup: 0,
            pytorch: None,
            pytorch_note: None,
        };
        let doc = to_json(&info, &runs, link);
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
