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
//! step timed here is its loss-only core.
//!
//! The 1 B cases (`gpt_1b_*`, `llama_1b_*`) are the sizes people train: `ferry bench
//! offload-optim`'s GPT at 20 x 2048 and the project's Llama (0.97 B), bf16 autocast, AdamW, at
//! batch 8 and 16 x 1024 tokens; PyTorch's side is eager with SDPA (its fused attention) and a
//! fused AdamW, the Llama transformers' own. Their second table gives tokens/s, model FLOP
//! utilization against the bf16 matrix rate measured in the same run, and each side's peak
//! allocated bytes. On the CPU they run only when named. Modules: `cases` (the cases and a step's phases),
//! `step` (ferry's side of a case), `profile` (where a step's time goes).

mod cases;
mod losses;
mod profile;
mod step;

pub use cases::{LARGE_LR, LR};

use std::error::Error;
use std::path::PathBuf;

use clap::Args;
use ferry::prelude::*;
use serde_json::json;

use crate::Measured;
use crate::harness::pytorch::{PyTorch, PyTorchArgs, PyTorchSide};
use crate::harness::report::significant;
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
    /// Only these cases (ids joined by commas: digits_mlp, mlp_4096, digits_cnn, gpt, ...,
    /// llama_1b_b16).
    #[arg(long, value_delimiter = ',', value_name = "IDS")]
    cases: Vec<String>,
    /// After each case's rounds, show where ferry's step spends its time on the GPU: per phase,
    /// as run and with the host ahead, and per kernel; with --compare-pytorch, PyTorch's kernels
    /// too (torch.profiler) and both sides summed by category.
    #[arg(long)]
    profile: bool,
    /// Instead of timing, train each selected Llama case this many steps on real text, ferry and
    /// PyTorch from the same initial weights on the same batches, and compare the losses.
    #[arg(long, value_name = "STEPS", value_parser = clap::value_parser!(u32).range(1..))]
    losses: Option<u32>,
    /// Where --losses writes the initial weights and the batches [default: a folder in the
    /// system's temporary directory].
    #[arg(long, value_name = "DIR")]
    losses_dir: Option<PathBuf>,
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
    /// The model's parameters (ferry's count; PyTorch's model is the same architecture).
    parameters: usize,
    /// The most bytes each side's allocator held during a timed round (GPU only).
    ferry_peak: Option<u64>,
    pytorch_peak: Option<u64>,
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
        parameters: 0,
        ferry_peak: None,
        pytorch_peak: None,
        final_loss: None,
        pytorch: Measured::new(),
    };
    let mut ferry = FerryRun::new(case, device)
        .map_err(|e| m.ferry.fail(e.to_string()))
        .ok();
    m.parameters = ferry.as_ref().map_or(0, |run| run.parameters);
    let cuda = ferry.as_ref().and_then(|run| run.cuda.clone());
    for round in 0..warmup + rounds {
        let timed = round >= warmup;
        if let Some(run) = ferry.as_mut() {
            if let Some(dev) = &cuda {
                dev.reset_peak();
            }
            if !m.ferry.record(run.round_ms_per_step(steps), timed) {
                ferry = None;
            } else if let (true, Some(dev)) = (timed, &cuda) {
                let peak = dev.memory_stats().peak_allocated_bytes as u64;
                m.ferry_peak = m.ferry_peak.max(Some(peak));
            }
        }
        if let (Some(torch), false) = (torch.as_deref_mut(), m.pytorch.is_failed()) {
            let (ms, peak) = match torch.sample_with_reply(&request(case, steps)) {
                Ok((ms, reply)) => (Ok(ms), reply.get("peak_bytes").and_then(|p| p.as_u64())),
                Err(err) => (Err(err), None),
            };
            if m.pytorch.record(ms, timed) && timed {
                m.pytorch_peak = m.pytorch_peak.max(peak);
            }
        }
        if ferry.is_none() && (torch.is_none() || m.pytorch.is_failed()) {
            break;
        }
    }
    if let (true, Some(run)) = (profile, ferry.as_mut()) {
        let profiled = steps.min(20);
        match profile::profile(case, run, profiled) {
            Ok(kernels) if !kernels.is_empty() => {
                if let (Some(torch), false) = (torch, m.pytorch.is_failed())
                    && let Err(err) = profile::compare_with_pytorch(case, &kernels, torch, profiled)
                {
                    println!("PyTorch's profile of {}: {err}", case.id);
                }
            }
            Ok(_) => {}
            Err(err) => println!("profile of {}: {err}", case.id),
        }
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
    drop(ferry);
    if let Some(dev) = cuda
        && let Err(err) = dev.empty_cache()
    {
        m.ferry.fail(format!("after the rounds: {err}"));
    }
    m
}

/// Model FLOPs of a training step per token, for a model with `parameters` whose attention has
/// `layers` layers of `width` (heads x head dim) over `context` positions: 6 per parameter
/// (forward 2, backward 4) plus causal attention's two products, 6 x context x width per layer
/// (half of the full T x T, forward and backward).
fn flops_per_token(parameters: usize, (layers, width): (usize, usize), context: usize) -> f64 {
    6.0 * parameters as f64 + 6.0 * (layers * context * width) as f64
}

/// The bf16 matrix rate of `device` in TFLOP/s: cuBLAS's best of a few 8192-cubed products, the
/// denominator of model FLOP utilization.
fn bf16_matrix_rate(device: Device) -> Result<f64, Box<dyn Error>> {
    const N: usize = 8192;
    const REPEAT: u32 = 20;
    let Device::Cuda(ordinal) = device else {
        return Err("the matrix rate is measured on a GPU".into());
    };
    let dev = harness::cuda_device(ordinal)?;
    let _no_grad = ferry::no_grad();
    let a = Tensor::randn(&[N, N], DType::BF16, device)?;
    let b = Tensor::randn(&[N, N], DType::BF16, device)?;
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        dev.synchronize()?;
        let start = std::time::Instant::now();
        for _ in 0..REPEAT {
            a.matmul(&b)?;
        }
        dev.synchronize()?;
        best = best.min(start.elapsed().as_secs_f64() / f64::from(REPEAT));
    }
    Ok(2.0 * (N as f64).powi(3) / best / 1e12)
}

/// `--cases`: the cases with these ids, in table order (all of them for none).
fn select(ids: &[String]) -> Result<Vec<&'static Case>, String> {
    harness::select(&CASES, ids, "case", |c| c.id)
}

pub fn run(args: TrainBenchArgs) -> Result<(), Box<dyn Error>> {
    let mut selected = select(&args.cases)?;
    let on_gpu = args.device != Device::Cpu;
    let mut skipped = Vec::new();
    if !on_gpu && args.cases.is_empty() {
        skipped = selected.iter().filter(|c| c.is_large()).map(|c| c.id).collect();
        selected.retain(|c| !c.is_large());
    }
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
    let mut torch = if args.pytorch.compare_pytorch && !on_gpu {
        PyTorchSide::absent("no PyTorch column: it is compared on the GPU only")
    } else {
        args.pytorch.side("train.py", "column")
    };
    if let Some(steps) = args.losses {
        return run_losses(&args, &selected, steps, &mut torch, &device);
    }
    let rate = match on_gpu && selected.iter().any(|c| c.tokens().is_some()) {
        true => Some(bf16_matrix_rate(args.device).map_err(|e| e.to_string())),
        false => None,
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
        "ferry bench train on {device}: fp32 (the _bf16 and 1 B cases in bf16 autocast); a step \
         = zero_grad, forward, cross-entropy, backward, Adam (lr {LR}) step (the 1 B cases: \
         AdamW, lr {LARGE_LR}; PyTorch's fused)\nmedian ms/step of {rounds} rounds after {warmup} warm-up \
         rounds per case{pytorch}{}",
        torch.note.as_ref().map_or(String::new(), |n| format!("\n{n}"))
    );
    let report = Report::new("train", title).with_facts(json!({
        "device": device,
        "optimizer": format!("Adam lr {LR}; the 1 B cases AdamW lr {LARGE_LR}"),
        "rounds": rounds,
        "warmup": warmup,
        "pytorch": torch.label,
        "pytorch_note": torch.note,
        "bf16_matrix_tflops": rate.as_ref().and_then(|r| r.as_ref().ok()),
    }));
    let mut report = report_cases(report, &measured, on_gpu);
    if measured.iter().any(|m| m.case.tokens().is_some()) {
        let tflops = rate.as_ref().and_then(|r| r.as_ref().ok().copied());
        report.table("language models", None, throughput_table(&measured, tflops));
        match &rate {
            Some(Ok(tflops)) => report.note(format!(
                "MFU: model FLOPs (6 per parameter and token, plus causal attention's \
                 6 x context x width per layer and token) per second over the bf16 matrix \
                 rate measured in this run, {} TFLOP/s (cuBLAS, 8192-cubed).",
                significant(*tflops)
            )),
            Some(Err(err)) => report.note(format!("no MFU: the matrix rate failed: {err}")),
            None => {}
        }
        report.note("peak: the most bytes each side's allocator held in a timed round.");
    }
    if !skipped.is_empty() {
        report.note(format!(
            "not run on the CPU unless named with --cases: {}",
            skipped.join(", ")
        ));
    }
    report.finish(args.json.as_deref())
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

/// `--losses`: each selected Llama case's loss curves on both sides, in a table.
fn run_losses(
    args: &TrainBenchArgs,
    selected: &[&Case],
    steps: u32,
    torch: &mut PyTorchSide,
    device: &str,
) -> Result<(), Box<dyn Error>> {
    let dir = args
        .losses_dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join("ferry-train-losses"));
    let mut table = Table::new(&[
        "case",
        "steps",
        "ferry first",
        "PyTorch first",
        "ferry last",
        "PyTorch last",
        "worst gap",
        "at step",
        "goal",
        "met",
    ]);
    let mut errors = Vec::new();
    for case in selected.iter().filter(|c| c.model == cases::Model::Llama) {
        eprintln!("training {} for {steps} steps on each side ...", case.id);
        let curves = match losses::compare(case, args.device, steps as usize, torch.torch(), &dir) {
            Ok(curves) => curves,
            Err(err) => {
                errors.push(format!("{}: {err}", case.id));
                continue;
            }
        };
        if let Err(err) = &curves.pytorch {
            errors.push(format!("{} (PyTorch): {err}", case.id));
        }
        let pytorch = curves.pytorch.as_deref().ok();
        let worst = curves.worst_gap();
        let cell = |x: Option<&f64>| Cell::shown(x.copied(), |v| format!("{v:.4}"));
        table.push_with(
            vec![
                Cell::text(case.id),
                Cell::count(steps),
                cell(curves.ferry.first()),
                cell(pytorch.and_then(<[f64]>::first)),
                cell(curves.ferry.last()),
                cell(pytorch.and_then(<[f64]>::last)),
                Cell::shown(worst.map(|w| w.1), |g| format!("{g:.2e}")),
                Cell::text(worst.map_or(String::new(), |w| w.0.to_string())),
                Cell::text(format!("<= {:.0e}", losses::LOSS_GOAL)),
                Cell::text(match worst {
                    Some((_, g)) if g <= losses::LOSS_GOAL => "met",
                    Some(_) => "MISSED",
                    None => "?",
                }),
            ],
            json!({ "ferry_losses": curves.ferry, "pytorch_losses": pytorch }),
        );
    }
    let title = format!(
        "ferry bench train --losses {steps} on {device}: the Llama from the same initial weights \
         on the same batches of text (bf16 autocast, AdamW lr {LARGE_LR}); PyTorch: \
         transformers' LlamaForCausalLM with SDPA and fused AdamW"
    );
    let mut report = Report::new("train_losses", title);
    report.table("losses", None, table);
    report.note("worst gap: the largest |ferry - PyTorch| / PyTorch over the steps.");
    if selected.iter().all(|c| c.model != cases::Model::Llama) {
        report.note("no Llama case selected: --losses compares llama_1b_b8 or llama_1b_b16.");
    }
    for error in errors {
        report.note(format!("error: {error}"));
    }
    report.finish(args.json.as_deref())
}

/// Tokens per second, model FLOP utilization and peak memory of each language-model case.
fn throughput_table(measured: &[CaseResult<'_>], rate: Option<f64>) -> Table {
    let mut table = Table::new(&[
        "case",
        "ferry tokens/s",
        "PyTorch tokens/s",
        "ferry MFU",
        "PyTorch MFU",
        "ferry peak GiB",
        "PyTorch peak GiB",
    ]);
    for m in measured {
        let (Some(tokens), Some(attention)) = (m.case.tokens(), m.case.attention()) else {
            continue;
        };
        let per_s = |ms: Option<f64>| ms.map(|ms| tokens as f64 / ms * 1e3);
        let flops = flops_per_token(m.parameters, attention, m.case.widths[0]);
        let mfu = |ms: Option<f64>| {
            let (tokens_s, rate) = (per_s(ms)?, rate?);
            Some(tokens_s * flops / (rate * 1e12))
        };
        let percent = |x: f64| format!("{:.1}%", 100.0 * x);
        let gib = |b: Option<u64>| b.map(crate::harness::table::gib);
        let (ferry, pytorch) = (m.ferry.complete_median(), m.pytorch.complete_median());
        table.push_with(
            vec![
                Cell::text(m.case.id),
                Cell::number(per_s(ferry)),
                Cell::number(per_s(pytorch)),
                Cell::shown(mfu(ferry), percent),
                Cell::shown(mfu(pytorch), percent),
                Cell::number(gib(m.ferry_peak)),
                Cell::number(gib(m.pytorch_peak)),
            ],
            json!({ "parameters": m.parameters, "tokens_per_step": tokens,
                    "model_flops_per_token": flops }),
        );
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
        let large: Vec<&str> = CASES.iter().filter(|c| c.is_large()).map(|c| c.id).collect();
        let large = format!("LARGE = {large:?}").replace('[', "{").replace(']', "}");
        assert!(script.contains(&large), "train.py's must say `{large}`");
        assert!(script.contains(&format!("LARGE_LR = {LARGE_LR:e}")));
        let llama = ferry::models::LlamaConfig::llama_1b();
        let size = format!(
            "vocab_size={}, hidden_size={}, intermediate_size={}, num_hidden_layers={},",
            llama.vocab_size, llama.hidden_size, llama.intermediate_size, llama.num_hidden_layers
        );
        assert!(script.contains(&size), "train.py's Llama must be {size}");
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
             mlp_4096_gemms, mlp_4096_bf16, digits_cnn_bf16, gpt_bf16, gpt_1b_b8, gpt_1b_b16, \
             llama_1b_b8, llama_1b_b16"
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
            parameters: 0,
            ferry_peak: None,
            pytorch_peak: None,
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

    /// A language model's row: tokens per second from the median step, MFU against the rate
    /// given, peaks in GiB; the other models have none.
    #[test]
    fn language_models_show_tokens_mfu_and_peaks() {
        let gpt = CASES.iter().find(|c| c.id == "gpt_1b_b8").unwrap();
        let mut runs = vec![
            result(&CASES[0], &[0.25], &[0.9]),
            result(gpt, &[200.0, 100.0, 300.0], &[250.0]),
        ];
        runs[1].parameters = 1_000_000_000;
        runs[1].ferry_peak = Some(3 << 30);
        let rows = throughput_table(&runs, Some(1000.0)).texts();
        assert_eq!(rows.len(), 1);
        // 8 x 1024 tokens in 200 ms; 6e9 + 6 x 20 x 1024 x 2048 FLOPs a token.
        let tokens_s = 8.0 * 1024.0 / 0.2;
        let mfu = tokens_s * (6e9 + 6.0 * 20.0 * 1024.0 * 2048.0) / 1e15;
        assert_eq!(rows[0][..3], ["gpt_1b_b8", "40960", "32768"]);
        assert_eq!(rows[0][3], format!("{:.1}%", 100.0 * mfu));
        assert_eq!(rows[0][5..], ["3.00", "-"]);
        assert_eq!(throughput_table(&runs, None).texts()[0][3], "-");
        assert_eq!(gpt.tokens(), Some(8192));
        assert!(CASES.iter().filter(|c| c.is_large()).all(|c| c.target.describe() == "<= PyTorch"));
    }
}
