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
use serde_json::{Value, json};

use crate::Measured;
use crate::harness;
use crate::harness::SampledArgs;
use crate::harness::pytorch::PyTorch;
use crate::harness::report::{format_ratio, print_table, significant};

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

/// What one case measured: ferry's samples and PyTorch's per mode (in `TORCH_MODES` order;
/// an error of the script is recorded on both).
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
            match ferry_sample(&x, to, from) {
                Ok((ms, path)) => {
                    m.path = Some(path);
                    if timed {
                        m.ferry.push(ms);
                    }
                }
                Err(err) => m.ferry.fail(err.to_string()),
            }
        }
        for (i, mode) in TORCH_MODES.iter().enumerate() {
            let Some(t) = torch.as_deref_mut() else { break };
            if m.torch[0].is_failed() {
                break;
            }
            let failure = match t.request(&request(&m.case, mode)) {
                Ok(reply) => match reply.get("ms").and_then(Value::as_f64) {
                    Some(ms) if timed => {
                        m.torch[i].push(ms);
                        None
                    }
                    Some(_) => None,
                    None => Some(format!("the script answered {reply}")),
                },
                Err(err) => Some(err),
            };
            if let Some(err) = failure {
                m.torch.iter_mut().for_each(|side| side.fail(err.clone()));
            }
        }
    }
    Ok(m)
}

/// The table's cells for one case.
fn row(m: &CaseResult) -> Vec<String> {
    let time = |v: Option<f64>| v.map_or("-".into(), |ms| format!("{} ms", significant(ms)));
    let rate = |v: Option<f64>| v.map_or("-".into(), |ms| significant(gb_per_s(m.case.bytes, ms)));
    let ferry = m.ferry.median();
    let [to, nb] = [m.torch[0].median(), m.torch[1].median()];
    let ratio = |torch: Option<f64>| match (ferry, torch) {
        (Some(f), Some(t)) => format_ratio(f, t),
        _ => "-".into(),
    };
    vec![
        format!("{} MB", significant(m.case.bytes as f64 / 1e6)),
        format!("cuda:{} -> cuda:{}", m.case.from, m.case.to),
        time(ferry),
        rate(ferry),
        time(to),
        rate(to),
        time(nb),
        rate(nb),
        ratio(to),
        ratio(nb),
        match m.path {
            Some(TransferPath::Peer { direct: true, .. }) => "direct".into(),
            Some(TransferPath::Peer { direct: false, .. }) => "staged".into(),
            Some(other) => format!("{other:?}"),
            None => "-".into(),
        },
    ]
}

fn to_json(measured: &[CaseResult], torch: Option<&str>, notes: &[String]) -> Value {
    let cases: Vec<Value> = measured
        .iter()
        .map(|m| {
            json!({
                "bytes": m.case.bytes,
                "from": format!("cuda:{}", m.case.from),
                "to": format!("cuda:{}", m.case.to),
                "path": m.path.map(|p| format!("{p:?}")),
                "ferry_ms": m.ferry.samples_ms,
                "ferry_median_ms": m.ferry.median(),
                "ferry_error": m.ferry.error,
                "pytorch_to_ms": m.torch[0].samples_ms,
                "pytorch_to_median_ms": m.torch[0].median(),
                "pytorch_non_blocking_ms": m.torch[1].samples_ms,
                "pytorch_non_blocking_median_ms": m.torch[1].median(),
                "pytorch_error": m.torch[0].error,
            })
        })
        .collect();
    json!({ "bench": "peer", "pytorch": torch, "notes": notes, "cases": cases })
}

pub fn run(args: PeerArgs) -> Result<(), Box<dyn Error>> {
    let found = cuda::devices().map(|d| d.len()).map_err(|e| e.to_string());
    if let Some(why) = gpus_missing(found) {
        let doc = json!({ "bench": "peer", "skipped": why, "cases": [] });
        return harness::skip(&why, args.run.json.as_deref(), &doc);
    }
    let devs = [
        crate::harness::cuda_device(0)?,
        crate::harness::cuda_device(1)?,
    ];
    let mut torch = args.run.pytorch.side("peer.py", "columns");
    let mut notes: Vec<String> = torch.note.take().into_iter().collect();
    println!(
        "ferry bench peer: {} and {}, {} sample(s) after {} warm-up round(s) per case and side",
        devs[0].info().name,
        devs[1].info().name,
        args.run.samples,
        args.run.warmup
    );
    torch.print_label();
    let sizes = if args.sizes.is_empty() {
        SIZES.to_vec()
    } else {
        args.sizes.clone()
    };
    let mut measured = Vec::new();
    for &bytes in &sizes {
        if bytes < 4 {
            notes.push(format!("size {bytes} skipped: at least 4 bytes (one f32)"));
            continue;
        }
        for (from, to) in [(0, 1), (1, 0)] {
            eprintln!("measuring {bytes} bytes cuda:{from} -> cuda:{to} ...");
            let case = Case { bytes, from, to };
            let m = measure(
                case,
                &devs,
                torch.torch(),
                args.run.warmup,
                args.run.samples,
            )?;
            if let Some(err) = &m.torch[0].error
                && torch.forget_if_ended()
            {
                notes.push(format!("the PyTorch script ended: {err}"));
            }
            measured.push(m);
        }
    }
    let header = [
        "size",
        "direction",
        "ferry .to",
        "GB/s",
        "torch .to",
        "GB/s",
        "torch non_blocking",
        "GB/s",
        "ferry/torch",
        "ferry/nb",
        "ferry path",
    ];
    let rows: Vec<Vec<String>> = measured.iter().map(row).collect();
    print_table(&header, &rows);
    println!(
        "medians; ratios below 1: ferry faster. Each sample synchronizes both GPUs before and \
         after the move. path: direct = peer access (NVLink/PCIe), staged = through host memory"
    );
    for m in &measured {
        for (side, err) in [("ferry", &m.ferry.error), ("PyTorch", &m.torch[0].error)] {
            if let Some(err) = err {
                println!(
                    "{} bytes cuda:{} -> cuda:{}, {side}: {err}",
                    m.case.bytes, m.case.from, m.case.to
                );
            }
        }
    }
    for note in &notes {
        println!("{note}");
    }
    if let Some(path) = &args.run.json {
        let doc = to_json(&measured, torch.label.as_deref(), &notes);
        harness::write_json(path, &doc, "sample")?;
    }
    Ok(())
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
        let cells = row(&m);
        assert_eq!(cells[0], "400 MB");
        assert_eq!(cells[1], "cuda:1 -> cuda:0");
        assert_eq!(cells[2], "2.00 ms");
        assert_eq!(cells[3], "200"); // 400 MB in 2 ms
        assert_eq!(cells[8], "0.500");
        assert_eq!(cells[9], "-"); // no non_blocking samples
        assert_eq!(cells[10], "direct");
    }
}
