//! `ferry bench optim`: ferry's CPU AdamW ([`ferry::optim::host`]) in parameters per second on
//! one large tensor and on a real model's list of tensors, beside the host's copy bandwidth
//! measured in the same run and, with --compare-pytorch, torch's fused CPU AdamW
//! (python/optim.py) on the same tensors, sampled alternately. Needs no GPU.
//!
//! Bytes moved are counted as STREAM counts them, every byte read and every byte written once:
//! a copy of N bytes moves 2N; an AdamW step from f32 gradients moves 28 bytes per parameter
//! (master weight, gradient and both moments read; weight and moments written), from bf16
//! gradients with a bf16 copy of the weights written too, 28 as well (16-bit gradient, 16-bit
//! copy). What the bus moves is the larger of a parallel copy and AdamW's access pattern without
//! its arithmetic (`BusPass`), both measured in the same run. The goals (issue 26, on the
//! H200's host): at least 1.25x torch's fused step, and at least 80% of the bus.

use std::error::Error;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use ferry::memory::bf16;
use ferry::memory::simd::{self, Level};
use ferry::optim::host::{self, AdamTensor, GradSlice, ParamSlice};
use rayon::prelude::*;
use serde_json::{Value, json};

use crate::harness::measure::Measured;
use crate::harness::pytorch::PyTorchArgs;
use crate::harness::report::{format_ratio, print_table, significant};
use crate::harness::{self, run_info::RunInfo};

#[derive(Args, Debug)]
pub struct OptimArgs {
    #[command(flatten)]
    pytorch: PyTorchArgs,
    /// Write every sample of both sides to this JSON file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Parameters of the one-tensor case, in millions.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=16384))]
    million: u64,
    /// Timed steps per case and side; the table shows their median.
    #[arg(long, default_value_t = 9, value_parser = clap::value_parser!(u32).range(1..))]
    samples: u32,
    /// Untimed steps before them (the first touches every page).
    #[arg(long, default_value_t = 2)]
    warmup: u32,
    /// MiB of the copy that measures the host's bandwidth (large enough to leave every cache).
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..=65536))]
    copy_mib: u64,
    /// Run only these cases (one, model, model-bf16).
    #[arg(long, value_delimiter = ',')]
    cases: Vec<String>,
}

/// The Llama that `python -m ferry.bench` trains (crates/ferry-py/python/ferry/bench_models.py):
/// hidden 2048, intermediate 5632, 32 heads of which 4 for keys and values, vocab 32000, 19
/// layers; python/optim.py builds it from transformers and reports its counts, which must agree.
fn llama_shapes() -> Vec<usize> {
    let (hidden, inter, kv, vocab, layers) = (2048, 5632, 4 * 64, 32000, 19);
    let mut sizes = vec![vocab * hidden];
    for _ in 0..layers {
        sizes.extend([
            hidden * hidden, // q
            kv * hidden,     // k
            kv * hidden,     // v
            hidden * hidden, // o
            inter * hidden,  // gate
            inter * hidden,  // up
            hidden * inter,  // down
            hidden,          // input norm
            hidden,          // post-attention norm
        ]);
    }
    sizes.extend([hidden, vocab * hidden]);
    sizes
}

struct Case {
    id: &'static str,
    what: String,
    sizes: Vec<usize>,
    /// bf16 gradients in, a bf16 copy of the weights out (offload's step); else f32 in, none out.
    bf16: bool,
    /// torch's fused AdamW has a row (it takes no mixed dtypes).
    with_torch: bool,
}

fn cases(args: &OptimArgs) -> Vec<Case> {
    let one = (args.million * 1_000_000) as usize;
    let llama = llama_shapes();
    let what =
        |n: usize, list: &[usize]| format!("Llama {:.2} B, {} tensors", n as f64 / 1e9, list.len());
    let params: usize = llama.iter().sum();
    vec![
        Case {
            id: "one",
            what: format!("one tensor, {}M", args.million),
            sizes: vec![one],
            bf16: false,
            with_torch: true,
        },
        Case {
            id: "model",
            what: what(params, &llama),
            sizes: llama.clone(),
            bf16: false,
            with_torch: true,
        },
        Case {
            id: "model-bf16",
            what: format!("{}, bf16 grads and copy", what(params, &llama)),
            sizes: llama,
            bf16: true,
            with_torch: false,
        },
    ]
}

/// A case's host state: master weights, moments, gradients and (bf16 cases) the weights' copy.
struct State {
    master: Vec<Vec<f32>>,
    exp_avg: Vec<Vec<f32>>,
    exp_avg_sq: Vec<Vec<f32>>,
    grad: Vec<Vec<f32>>,
    grad_bf16: Vec<Vec<bf16>>,
    out_bf16: Vec<Vec<bf16>>,
}

impl State {
    fn new(case: &Case) -> Self {
        let filled = |v: f32| case.sizes.iter().map(|&n| vec![v; n]).collect::<Vec<_>>();
        let half = |v: f32| {
            if case.bf16 {
                case.sizes
                    .iter()
                    .map(|&n| vec![bf16::from_f32(v); n])
                    .collect()
            } else {
                Vec::new()
            }
        };
        Self {
            master: filled(0.5),
            exp_avg: filled(0.0),
            exp_avg_sq: filled(0.0),
            grad: if case.bf16 { Vec::new() } else { filled(0.01) },
            grad_bf16: half(0.01),
            out_bf16: half(0.0),
        }
    }

    fn step(&mut self, t: u64) -> ferry::Result<()> {
        let step = host::adamw_step(t, 1e-3, (0.9, 0.999), 1e-8, 0.01);
        let n = self.master.len();
        let mut outs = self.out_bf16.iter_mut().map(|o| Some(ParamSlice::Bf16(o)));
        let tensors = self
            .master
            .iter_mut()
            .zip(&mut self.exp_avg)
            .zip(&mut self.exp_avg_sq)
            .enumerate()
            .map(|(i, ((master, exp_avg), exp_avg_sq))| AdamTensor {
                master,
                exp_avg,
                exp_avg_sq,
                grad: match self.grad.get(i) {
                    Some(g) => GradSlice::F32(g),
                    None => GradSlice::Bf16(&self.grad_bf16[i]),
                },
                out: outs.next().flatten(),
            })
            .collect::<Vec<_>>();
        debug_assert_eq!(tensors.len(), n);
        host::adamw(&step, tensors)
    }
}

/// Bytes of host memory one case needs: 16 per parameter (weight, moments, f32 gradient; or a
/// bf16 gradient and a bf16 copy).
fn case_bytes(case: &Case) -> usize {
    16 * case.sizes.iter().sum::<usize>()
}

/// MemAvailable from /proc/meminfo, where there is one.
fn available_bytes() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// One parallel copy of `src` into `dst` on all cores, in milliseconds.
fn copy_ms(src: &[u8], dst: &mut [u8]) -> f64 {
    let start = Instant::now();
    dst.par_chunks_mut(1 << 20)
        .zip(src.par_chunks(1 << 20))
        .for_each(|(d, s)| d.copy_from_slice(s));
    start.elapsed().as_secs_f64() * 1e3
}

/// AdamW's traffic without its arithmetic: four f32 streams read, three written back in place
/// (`p += g`, `m += g`, `v += g`), in the same blocks on the same cores. What the bus moves for
/// this access pattern, the ceiling AdamW is judged against (a plain copy pays for reading each
/// destination line before writing it, which this pattern does not, so it understates the bus).
struct BusPass {
    p: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
}

impl BusPass {
    fn new(bytes: usize) -> Self {
        let n = bytes / 4;
        Self {
            p: vec![0.5; n],
            m: vec![0.0; n],
            v: vec![0.0; n],
            g: vec![1e-3; n],
        }
    }

    /// Bytes one pass moves.
    fn bytes(&self) -> f64 {
        28.0 * self.p.len() as f64
    }

    fn run_ms(&mut self) -> f64 {
        let start = Instant::now();
        let state = self
            .m
            .par_chunks_mut(host::BLOCK)
            .zip(self.v.par_chunks_mut(host::BLOCK));
        self.p
            .par_chunks_mut(host::BLOCK)
            .zip(state)
            .zip(self.g.par_chunks(host::BLOCK))
            .for_each(|((p, (m, v)), g)| {
                simd::vectorized_wide(|| {
                    let n = p.len();
                    let (m, v, g) = (&mut m[..n], &mut v[..n], &g[..n]);
                    for i in 0..n {
                        p[i] += g[i];
                        m[i] += g[i];
                        v[i] += g[i];
                    }
                })
            });
        start.elapsed().as_secs_f64() * 1e3
    }
}

pub fn run(args: OptimArgs) -> Result<(), Box<dyn Error>> {
    let table = cases(&args);
    let picked = harness::select(&table, &args.cases, "case", |c| c.id)?;
    let mut side = args.pytorch.side("optim.py", "column");
    let threads = rayon::current_num_threads();
    println!(
        "ferry bench optim: AdamW over host memory, {threads} threads, {} vectors; median of {} \
         steps after {} untimed",
        Level::detect().name(),
        args.samples,
        args.warmup
    );
    side.print_label();
    if let Some(note) = &side.note {
        println!("{note}");
    }

    // The bus: a copy (both sides, alternately) and AdamW's traffic without its arithmetic.
    let copy_bytes = (args.copy_mib as usize) << 20;
    let src = vec![1u8; copy_bytes];
    let mut dst = vec![0u8; copy_bytes];
    let mut pass = BusPass::new(copy_bytes);
    let (mut copy, mut torch_copy, mut passes) =
        (Measured::new(), Measured::new(), Measured::new());
    for round in 0..args.warmup + args.samples {
        let ms = copy_ms(&src, &mut dst);
        let pass_ms = pass.run_ms();
        let theirs = side
            .torch()
            .map(|t| t.request(&format!("copy {copy_bytes}")));
        if round >= args.warmup {
            copy.push(ms);
            passes.push(pass_ms);
            match theirs {
                Some(Ok(reply)) => torch_copy.push(reply["ms"].as_f64().unwrap_or(f64::NAN)),
                Some(Err(err)) => torch_copy.fail(err),
                None => {}
            }
        }
    }
    let pass_bytes = pass.bytes();
    drop((src, dst, pass));
    let gbs = |bytes: f64, ms: f64| bytes / ms / 1e6;
    let copied = gbs(copy_bytes as f64, copy.median().unwrap_or(f64::NAN));
    let pattern = gbs(pass_bytes, passes.median().unwrap_or(f64::NAN));
    let bus = pattern.max(2.0 * copied);
    println!(
        "host memory, {} MiB a stream, all cores: a copy {} GB/s copied ({} GB/s read and \
         written{}); AdamW's pattern without arithmetic {} GB/s read and written",
        args.copy_mib,
        significant(copied),
        significant(2.0 * copied),
        torch_copy.median().map_or(String::new(), |ms| format!(
            "; torch's copy_ {} GB/s copied",
            significant(gbs(copy_bytes as f64, ms))
        )),
        significant(pattern),
    );

    let mut rows = Vec::new();
    let mut json_cases = Vec::new();
    for case in picked {
        let params: usize = case.sizes.iter().sum();
        let need = case_bytes(case)
            * if case.with_torch && side.torch.is_some() {
                2
            } else {
                1
            };
        if available_bytes().is_some_and(|free| need > free * 9 / 10) {
            println!(
                "{}: skipped, needs {:.1} GB of host memory and {:.1} GB is available",
                case.id,
                need as f64 / 1e9,
                available_bytes().unwrap_or(0) as f64 / 1e9
            );
            continue;
        }
        let mut state = State::new(case);
        let mut torch = Measured::new();
        let torch_ready = match side.torch().filter(|_| case.with_torch) {
            Some(t) => match t.request(&format!("case {} {params}", case.id)) {
                Ok(reply) => {
                    let theirs = (reply["tensors"].as_u64(), reply["params"].as_u64());
                    if theirs == (Some(case.sizes.len() as u64), Some(params as u64)) {
                        true
                    } else {
                        torch.fail(format!(
                            "PyTorch's case has {theirs:?} (tensors, params), ferry's ({}, {params})",
                            case.sizes.len()
                        ));
                        false
                    }
                }
                Err(err) => {
                    torch.fail(err);
                    false
                }
            },
            None => false,
        };
        let mut ferry = Measured::new();
        for round in 0..args.warmup + args.samples {
            let start = Instant::now();
            state.step(u64::from(round) + 1)?;
            let ms = start.elapsed().as_secs_f64() * 1e3;
            let theirs = side
                .torch()
                .filter(|_| torch_ready)
                .map(|t| t.sample("step"));
            if round >= args.warmup {
                ferry.push(ms);
                match theirs {
                    Some(Ok(ms)) => torch.push(ms),
                    Some(Err(err)) => torch.fail(err),
                    None => {}
                }
            }
        }
        drop(state);
        let ms = ferry.median().unwrap_or(f64::NAN);
        let moved = gbs(28.0 * params as f64, ms);
        let theirs = torch.median();
        rows.push(vec![
            case.what.clone(),
            format!("{} ms", significant(ms)),
            significant(params as f64 / ms / 1e6),
            significant(moved),
            format!("{}%", significant(100.0 * moved / bus)),
            theirs.map_or("-".into(), |t| format!("{} ms", significant(t))),
            theirs.map_or("-".into(), |t| significant(params as f64 / t / 1e6)),
            theirs.map_or("-".into(), |t| format_ratio(t, ms)),
        ]);
        if let Some(err) = &torch.error {
            println!("{}: PyTorch: {err}", case.id);
        }
        json_cases.push(json!({
            "case": case.id, "what": case.what, "tensors": case.sizes.len(), "params": params,
            "bf16": case.bf16, "ferry_ms": ferry.samples_ms, "torch_ms": torch.samples_ms,
            "torch_error": torch.error,
        }));
    }
    print_table(
        &[
            "case",
            "ferry",
            "G params/s",
            "GB/s moved",
            "of the bus",
            "torch fused",
            "G params/s",
            "ferry speed-up",
        ],
        &rows,
    );
    println!(
        "goals (H200 host): speed-up >= 1.25 over torch fused; GB/s moved >= 80% of the bus, the \
         larger of the two read+written figures above ({} GB/s here)",
        significant(bus)
    );
    if let Some(path) = &args.json {
        let doc = RunInfo::stamp(json!({
            "bench": "optim",
            "threads": threads,
            "vectors": Level::detect().name(),
            "pytorch": side.label,
            "copy_bytes": copy_bytes,
            "copy_ms": copy.samples_ms,
            "pattern_bytes": pass_bytes,
            "pattern_ms": passes.samples_ms,
            "torch_copy_ms": torch_copy.samples_ms,
            "cases": Value::Array(json_cases),
        }));
        harness::write_json(path, &doc, "sample")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_llama_list_has_the_python_models_counts() {
        let sizes = llama_shapes();
        assert_eq!(sizes.len(), 19 * 9 + 3);
        // 0.97 B, as bench_models.py says of its 19 layers.
        let params: usize = sizes.iter().sum();
        assert_eq!(params, 967_915_520);
    }

    #[test]
    fn a_small_run_steps_and_writes_its_json() {
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("optim.json");
        let crate::BenchCommand::Optim(args) = crate::parse_bench(&format!(
            "ferry bench optim --million 1 --copy-mib 8 --cases one --samples 2 --warmup 1 --json {}",
            json.display()
        ))
        .unwrap() else {
            panic!("not the optim bench")
        };
        run(args).unwrap();
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert_eq!(doc["cases"][0]["params"], 1_000_000);
        assert_eq!(doc["cases"][0]["ferry_ms"].as_array().unwrap().len(), 2);
        assert_eq!(doc["copy_ms"].as_array().unwrap().len(), 2);
        assert_eq!(doc["pattern_ms"].as_array().unwrap().len(), 2);
    }
}
