//! `ferry bench peer`: float32 moves between two GPUs, both directions, at several sizes: ferry's
//! `.to(cuda:N)` against, with --compare-pytorch, PyTorch's `x.to('cuda:N')` and
//! `x.to('cuda:N', non_blocking=True)` (python/peer.py), their samples interleaved in one run.
//!
//! Every sample synchronizes both GPUs before the clock starts and after the move, before it
//! stops: a peer move returns once it is queued, so the sample is the whole copy. Sources are
//! made once per case outside the timed region; results are dropped after the clock stops.

use std::error::Error;
use std::time::Instant;

use clap::Args;
use ferry::memory::cuda::{self, CudaDevice};
use ferry::{DType, DeviceMove, MoveOptions, Tensor, TransferPath};
use serde_json::json;

use crate::Measured;
use crate::harness::pytorch::PyTorch;
use crate::harness::report::significant;
use crate::harness::table::{Cell, Report, Table};
use crate::harness::{self, SampledArgs};

/// Sizes moved by default, in bytes: 4 MiB, 64 MiB, 400 MB (the transfer bench's tensor), 1 GiB.
const SIZES: [usize; 4] = [4 << 20, 64 << 20, 400_000_000, 1 << 30];

/// PyTorch's two ways, as python/peer.py names them.
const TORCH_MODES: [&str; 2] = ["to", "non_blocking"];

#[derive(Args, Debug)]
pub struct PeerArgs {
    #[command(flatten)]
    run: SampledArgs,
    /// Sizes in bytes, joined by commas [default: 4 MiB, 64 MiB, 400 MB, 1 GiB].
    #[arg(long, value_delimiter = ',', value_name = "BYTES")]
    sizes: Vec<usize>,
}

/// One size in one direction.
struct Case {
    bytes: usize,
    from: usize,
    to: usize,
}

/// What one case measured: ferry's samples and PyTorch's per mode (in `TORCH_MODES` order).
struct CaseResult {
    case: Case,
    path: Option<TransferPath>,
    ferry: Measured,
    torch: [Measured; 2],
}

/// Why the bench cannot run with `found` GPUs (it needs two), or `None`.
fn gpus_missing(found: Result<usize, String>) -> Option<String> {
    match found {
        Ok(n) if n >= 2 => None,
        Ok(n) => Some(format!(
            "ferry bench peer needs two GPUs; this machine has {n} (run it on nvidia-h200-x2)"
        )),
        Err(err) => Some(format!("ferry bench peer needs two GPUs: {err}")),
    }
}

/// The request python/peer.py answers for one PyTorch sample.
fn request(case: &Case, mode: &str) -> String {
    format!("move {} {} {} {mode}", case.from, case.to, case.bytes)
}

/// Gigabytes per second for `bytes` in `ms`.
fn gb_per_s(bytes: usize, ms: f64) -> f64 {
    bytes as f64 / (ms / 1e3) / 1e9
}

/// One ferry sample: both GPUs idle, the move, both GPUs idle again.
fn ferry_sample(
    x: &Tensor,
    to: &CudaDevice,
    from: &CudaDevice,
) -> ferry::Result<(f64, TransferPath)> {
    from.synchronize()?;
    to.synchronize()?;
    let start = Instant::now();
    let (y, report) = x.to_with(to.device(), MoveOptions::default())?;
    to.synchronize()?;
    from.synchronize()?;
    let ms = start.elapsed().as_secs_f64() * 1e3;
    drop(y);
    Ok((ms, report.path))
}

fn measure(
    case: Case,
    devs: &[CudaDevice; 2],
    mut torch: Option<&mut PyTorch>,
    warmup: u32,
    samples: u32,
) -> ferry::Result<CaseResult> {
    let (from, to) = (&devs[case.from], &devs[case.to]);
    let x = Tensor::randn(&[case.bytes / 4], DType::F32, from.device())?;
    let mut m = CaseResult {
        case,
        path: None,
        ferry: Measured::new(),
        torch: [Measured::new(), Measured::new()],
    };
    for round in 0..warmup + samples {
        let timed = round >= warmup;
        if !m.ferry.is_failed() {
            let sample = ferry_sample(&x, to, from).map(|(ms, path)| {
                m.path = Some(path);
                ms
            });
            m.ferry.record(sample, timed);
        }
        for (i, mode) in TORCH_MODES.iter().enumerate() {
            let failed = m.torch[0].is_failed();
            let Some(t) = torch.as_deref_mut().filter(|_| !failed) else {
                break;
            };
            match t.sample(&request(&m.case, mode)) {
                Ok(ms) => _ = m.torch[i].record(Ok::<_, String>(ms), timed),
                // An error of the script is recorded on both modes.
                Err(err) => m.torch.iter_mut().for_each(|side| side.fail(err.clone())),
            }
        }
    }
    Ok(m)
}

const HEADER: [&str; 11] = [
    "size",
    "direction",
    "ferry .to",
    "ferry GB/s",
    "torch .to",
    "torch GB/s",
    "torch non_blocking",
    "non_blocking GB/s",
    "ferry/torch",
    "ferry/nb",
    "ferry path",
];

/// The table's row for one case: medians (of the samples taken), rates, ratios and the path.
fn push_row(table: &mut Table, m: &CaseResult) {
    let time = |side: &Measured| {
        let (samples_ms, median_ms, error) = (&side.samples_ms, side.median(), &side.error);
        Cell::ms(median_ms).recorded(json!({ "samples_ms": samples_ms, "median_ms": median_ms, "error": error }))
    };
    let rate = |ms: Option<f64>| Cell::number(ms.map(|ms| gb_per_s(m.case.bytes, ms)));
    let (ferry, to, nb) = (m.ferry.median(), m.torch[0].median(), m.torch[1].median());
    let path = match m.path {
        Some(TransferPath::Peer { direct: true, .. }) => "direct".into(),
        Some(TransferPath::Peer { direct: false, .. }) => "staged".into(),
        Some(other) => format!("{other:?}"),
        None => "-".into(),
    };
    let size = Cell::text(format!("{} MB", significant(m.case.bytes as f64 / 1e6)));
    table.push_with(
        vec![
            size.recorded(json!(m.case.bytes)),
            Cell::text(format!("cuda:{} -> cuda:{}", m.case.from, m.case.to)),
            time(&m.ferry),
            rate(ferry),
            time(&m.torch[0]),
            rate(to),
            time(&m.torch[1]),
            rate(nb),
            Cell::ratio(ferry, to),
            Cell::ratio(ferry, nb),
            Cell::text(path),
        ],
        json!({ "path_taken": m.path.map(|p| format!("{p:?}")) }),
    );
}

pub fn run(args: PeerArgs) -> Result<(), Box<dyn Error>> {
    let found = cuda::devices().map(|d| d.len()).map_err(|e| e.to_string());
    if let Some(why) = gpus_missing(found) {
        let doc = json!({ "bench": "peer", "skipped": why, "cases": [] });
        return harness::skip(&why, args.run.json.as_deref(), &doc);
    }
    let devs = [harness::cuda_device(0)?, harness::cuda_device(1)?];
    let mut torch = args.run.pytorch.side("peer.py", "columns");
    let mut notes: Vec<String> = torch.note.take().into_iter().collect();
    let sizes = if args.sizes.is_empty() {
        SIZES.to_vec()
    } else {
        args.sizes.clone()
    };
    let mut table = Table::new(&HEADER);
    let mut errors = Vec::new();
    for &bytes in &sizes {
        if bytes < 4 {
            notes.push(format!("size {bytes} skipped: at least 4 bytes (one f32)"));
            continue;
        }
        for (from, to) in [(0, 1), (1, 0)] {
            eprintln!("measuring {bytes} bytes cuda:{from} -> cuda:{to} ...");
            let case = Case { bytes, from, to };
            let (warmup, samples) = (args.run.warmup, args.run.samples);
            let m = measure(case, &devs, torch.torch(), warmup, samples)?;
            if let Some(err) = &m.torch[0].error
                && torch.forget_if_ended()
            {
                notes.push(format!("the PyTorch script ended: {err}"));
            }
            for (side, err) in [("ferry", &m.ferry.error), ("PyTorch", &m.torch[0].error)] {
                if let Some(err) = err {
                    errors.push(format!("{bytes} bytes cuda:{from} -> cuda:{to}, {side}: {err}"));
                }
            }
            push_row(&mut table, &m);
        }
    }
    let (a, b) = (&devs[0].info().name, &devs[1].info().name);
    let (samples, warmup) = (args.run.samples, args.run.warmup);
    let label = torch.label.as_ref().map_or(String::new(), |l| format!("\nPyTorch {l}"));
    let title = format!(
        "ferry bench peer: {a} and {b}, {samples} sample(s) after {warmup} warm-up round(s) per \
         case and side{label}"
    );
    let mut report = Report::new("peer", title).with_facts(json!({ "pytorch": torch.label }));
    report.table("cases", None, table);
    report.note(
        "medians; ratios below 1: ferry faster. Each sample synchronizes both GPUs before and \
         after the move. path: direct = peer access (NVLink/PCIe), staged = through host memory",
    );
    errors.into_iter().chain(notes).for_each(|n| report.note(n));
    report.finish(args.run.json.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::pytorch::PyTorchArgs;

    #[test]
    fn fewer_than_two_gpus_is_a_message_not_a_failure() {
        assert!(gpus_missing(Ok(2)).is_none());
        assert!(gpus_missing(Ok(8)).is_none());
        let one = gpus_missing(Ok(1)).unwrap();
        assert!(
            one.contains("needs two GPUs") && one.contains("has 1"),
            "{one}"
        );
        let none = gpus_missing(Err("no CUDA driver found".into())).unwrap();
        assert!(none.contains("no CUDA driver found"), "{none}");
        // On this machine, whatever it has, the command returns Ok unless it has two GPUs.
        if cuda::devices().map_or(true, |d| d.len() < 2) {
            let args = PeerArgs {
                run: SampledArgs {
                    pytorch: PyTorchArgs {
                        compare_pytorch: true,
                        ..PyTorchArgs::default()
                    },
                    json: None,
                    samples: 1,
                    warmup: 0,
                },
                sizes: vec![],
            };
            assert!(run(args).is_ok());
        }
    }

    #[test]
    fn the_documented_peer_commands_parse() {
        for command in [
            "ferry bench peer --compare-pytorch --json peer.json",
            "ferry bench peer --sizes 4194304,1073741824 --samples 3",
        ] {
            if let Err(err) = crate::parse_bench(command) {
                panic!("`{command}` does not parse: {err}");
            }
        }
        let bad = crate::parse_bench("ferry bench peer --samples 0");
        assert!(bad.is_err(), "zero samples accepted");
    }

    #[test]
    fn requests_match_what_peer_py_parses_and_rows_compute_rates() {
        let case = Case {
            bytes: 400_000_000,
            from: 1,
            to: 0,
        };
        assert_eq!(
            request(&case, "non_blocking"),
            "move 1 0 400000000 non_blocking"
        );
        let script = include_str!("../python/peer.py");
        for mode in TORCH_MODES {
            assert!(
                script.contains(&format!("\"{mode}\"")),
                "peer.py lacks mode {mode}"
            );
        }
        assert!(script.contains("move SRC DST BYTES MODE"));
        let m = CaseResult {
            case,
            path: Some(TransferPath::Peer {
                direct: true,
                chunks: 1,
            }),
            ferry: Measured::from_samples(vec![1.0, 2.0, 9.0]),
            torch: [Measured::from_samples(vec![4.0]), Measured::new()],
        };
        let mut table = Table::new(&HEADER);
        push_row(&mut table, &m);
        let cells = &table.texts()[0];
        // 400 MB in 2 ms; no non_blocking samples.
        assert_eq!(cells[..4], ["400 MB", "cuda:1 -> cuda:0", "2.00 ms", "200"]);
        assert_eq!(cells[8..], ["0.500", "-", "direct"]);
        let doc = &table.json()[0];
        assert_eq!(doc["size"], 400_000_000);
        assert_eq!(doc["ferry_to"]["samples_ms"], json!([1.0, 2.0, 9.0]));
        assert_eq!(doc["torch_to"]["median_ms"], 4.0);
        assert_eq!(doc["ferry_gb_per_s"], 200.0);
        assert_eq!(doc["ferry_per_torch"], 0.5);
    }
}
