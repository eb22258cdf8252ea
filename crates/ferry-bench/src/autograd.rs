//! `ferry bench autograd`: what the autograd core costs, ferry and PyTorch side by side in one
//! run.
//!
//! Three sections, each selectable with `--sections`:
//! - memory: for each standard chain on cuda:0, the bytes still allocated after the forward
//!   (the user holding leaves, inputs and output) and the peak during `output.sum().backward()`,
//!   both above what was allocated before the inputs; PyTorch's are `torch.cuda` statistics for
//!   the same chain written the PyTorch way. One untimed run of each chain on each side first,
//!   so one-off allocations (cuBLAS workspaces, kernel modules) are in the baseline.
//! - threads: N threads on the CPU, each stepping its own 64x64 model; aggregate steps/s.
//! - overhead: the same step on one thread, in µs per op (the method of ferry-tensor's
//!   `autograd_overhead` example: rounds of many steps, their median).
//!
//! PyTorch's side is python/autograd.py in `--serve` mode; each ferry round is followed by the
//! matching PyTorch request, so both see the same machine state.

use std::error::Error;
use std::path::PathBuf;
use std::sync::Barrier;
use std::time::Instant;

use clap::{Args, ValueEnum};
use ferry::prelude::*;
use serde_json::Value;

use crate::harness;
use crate::harness::pytorch::{PyTorchArgs, PyTorchSide};
use chains::{Chain, ChainBytes};
use output::{
    MemoryRow, OPS_PER_STEP, OverheadRow, Reading, Report, ScalingRow, print_header, print_results,
    to_json,
};

mod chains;
mod output;
#[cfg(test)]
mod tests;

/// Steps per round of the per-op row: ferry's (as in `autograd_overhead`), PyTorch's.
const FERRY_OVERHEAD_STEPS: u32 = 5_000;
const TORCH_OVERHEAD_STEPS: u32 = 1_000;
/// Steps per thread per round of the thread-scaling rows.
const FERRY_SCALING_STEPS: u32 = 1_000;
const TORCH_SCALING_STEPS: u32 = 200;
/// Side of the per-op and thread-scaling model's leaves.
const SMALL: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Section {
    /// Device memory after the forward and during backward, per chain (needs cuda:0).
    Memory,
    /// CPU thread scaling, each thread its own model.
    Threads,
    /// CPU per-op overhead on one thread.
    Overhead,
}

#[derive(Args, Debug)]
pub struct AutogradArgs {
    #[command(flatten)]
    pytorch: PyTorchArgs,
    /// Write every row (both sides, every round, units, goals, verdicts) to this JSON file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Which sections to run.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_values_t = [Section::Memory, Section::Threads, Section::Overhead]
    )]
    sections: Vec<Section>,
    /// Only these chains in the memory section (ids joined by commas, listed under its table).
    #[arg(long, value_delimiter = ',', value_name = "IDS")]
    chains: Vec<String>,
    /// Thread counts of the scaling section (1 is always run: efficiency is relative to it).
    #[arg(
        long,
        value_delimiter = ',',
        default_values_t = [1, 2, 4, 8, 16],
        value_parser = clap::value_parser!(u16).range(1..=1024)
    )]
    threads: Vec<u16>,
    /// Timed rounds of the CPU rows; tables show their median.
    #[arg(long, default_value_t = 9, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Untimed rounds of the CPU rows before the timed ones.
    #[arg(long, default_value_t = 2)]
    warmup: u32,
}

impl AutogradArgs {
    /// The thread counts to run: sorted, without repeats, 1 first.
    fn thread_counts(&self) -> Vec<usize> {
        let mut counts: Vec<usize> = self.threads.iter().map(|&n| usize::from(n)).collect();
        counts.push(1);
        counts.sort_unstable();
        counts.dedup();
        counts
    }
}

/// PyTorch's reply to `line`: one request at a time, a script that died is dropped and noted.
fn ask(side: &mut PyTorchSide, line: &str) -> Reading<Value> {
    let Some(torch) = side.torch() else {
        return Reading::Skipped;
    };
    match torch.request(line) {
        Ok(reply) => Reading::Got(reply),
        Err(err) => {
            if side.forget_if_ended() {
                side.note = Some(format!("the PyTorch script ended at `{line}`: {err}"));
            }
            Reading::Failed(err)
        }
    }
}

/// A number from PyTorch's reply to `line`.
fn number(side: &mut PyTorchSide, line: &str, key: &str) -> Reading<f64> {
    ask(side, line).then(|reply| field(&reply, key, line))
}

/// `key` of a reply to `line`, as a number.
fn field(reply: &Value, key: &str, line: &str) -> Reading<f64> {
    match reply.get(key).and_then(Value::as_f64) {
        Some(x) => Reading::Got(x),
        None => Reading::Failed(format!("the PyTorch script answered {reply} to `{line}`")),
    }
}

/// Adds one round to a side's rounds; the first failure ends the side.
fn record(rounds: &mut Reading<Vec<f64>>, sample: Reading<f64>, timed: bool) {
    let Reading::Got(samples) = rounds else {
        return;
    };
    match sample {
        Reading::Got(x) if timed => samples.push(x),
        Reading::Got(_) => {}
        Reading::Failed(err) => *rounds = Reading::Failed(err),
        Reading::Skipped => *rounds = Reading::Skipped,
    }
}

/// The empty rounds a side starts with: nothing, when PyTorch is not there.
fn start_rounds(on: bool) -> Reading<Vec<f64>> {
    if on {
        Reading::Got(Vec::new())
    } else {
        Reading::Skipped
    }
}

/// PyTorch's answer to `memory CHAIN`.
fn chain_bytes(reply: &Value, line: &str) -> Reading<ChainBytes> {
    let get = |key: &str| reply.get(key).and_then(Value::as_i64);
    match (
        get("retained_bytes"),
        get("backward_peak_bytes"),
        get("after_drop_bytes"),
    ) {
        (Some(retained), Some(backward_peak), Some(after_drop)) => Reading::Got(ChainBytes {
            retained,
            backward_peak,
            after_drop,
            saved: None,
        }),
        _ => Reading::Failed(format!("the PyTorch script answered {reply} to `{line}`")),
    }
}

/// One untimed run, then the measured one, on each side.
fn measure_memory(chain: &'static Chain, device: Device, torch: &mut PyTorchSide) -> MemoryRow {
    let ferry = chains::measure(chain, device).and_then(|_| chains::measure(chain, device));
    let line = format!("memory {}", chain.id);
    let pytorch = ask(torch, &line)
        .then(|_| ask(torch, &line))
        .then(|reply| chain_bytes(&reply, &line));
    MemoryRow {
        chain,
        ferry: Reading::from_result(ferry),
        pytorch,
    }
}

/// The CPU step's model: two 64x64 f32 leaves.
struct SmallModel {
    x: Tensor,
    y: Tensor,
}

impl SmallModel {
    fn new() -> ferry::Result<Self> {
        let leaf = || Tensor::randn(&[SMALL, SMALL], DType::F32, Device::Cpu)?.with_grad();
        Ok(Self {
            x: leaf()?,
            y: leaf()?,
        })
    }

    /// `steps` times mul, add, relu, sum and backward; gradients accumulate (no zeroing), on
    /// both sides.
    fn run(&self, steps: u32) -> ferry::Result<()> {
        for _ in 0..steps {
            let loss = self.x.mul(&self.y)?.add(&self.x)?.relu()?.sum()?;
            loss.backward()?;
        }
        Ok(())
    }

    /// One round of the per-op row: µs per op.
    fn round_us_per_op(&self, steps: u32) -> ferry::Result<f64> {
        let start = Instant::now();
        self.run(steps)?;
        Ok(start.elapsed().as_secs_f64() * 1e6 / f64::from(steps) / OPS_PER_STEP)
    }
}

fn measure_overhead(torch: &mut PyTorchSide, warmup: u32, rounds: u32) -> OverheadRow {
    let on = torch.torch.is_some();
    let mut row = OverheadRow {
        ferry: start_rounds(true),
        pytorch_one: start_rounds(on),
        pytorch_default: start_rounds(on),
        default_threads: None,
    };
    let model = SmallModel::new();
    let us_per_op = |ms: Reading<f64>| ms.then(|ms| Reading::Got(ms * 1e3 / OPS_PER_STEP));
    for round in 0..warmup + rounds {
        let timed = round >= warmup;
        let ferry = match &model {
            Ok(model) => Reading::from_result(model.round_us_per_op(FERRY_OVERHEAD_STEPS)),
            Err(err) => Reading::Failed(err.to_string()),
        };
        record(&mut row.ferry, ferry, timed);
        if row.pytorch_one.get().is_some() {
            let ms = number(torch, &format!("overhead 1 {TORCH_OVERHEAD_STEPS}"), "ms");
            record(&mut row.pytorch_one, us_per_op(ms), timed);
        }
        if row.pytorch_default.get().is_some() {
            let line = format!("overhead 0 {TORCH_OVERHEAD_STEPS}");
            let ms = ask(torch, &line).then(|reply| {
                row.default_threads = reply.get("threads").and_then(Value::as_u64);
                field(&reply, "ms", &line)
            });
            record(&mut row.pytorch_default, us_per_op(ms), timed);
        }
    }
    row
}

/// ferry's side of one thread count: `threads` threads each step their own model; each round
/// starts them together and ends when the last is done, and gives all their steps per second.
/// `between` runs after each round (PyTorch's turn) while ferry's threads wait.
fn ferry_scaling(
    threads: usize,
    steps: u32,
    warmup: u32,
    rounds: u32,
    mut between: impl FnMut(u32),
) -> Result<Vec<f64>, String> {
    let (start, end) = (Barrier::new(threads + 1), Barrier::new(threads + 1));
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    // A failed thread keeps meeting the barriers so the others never hang.
                    let mut model = SmallModel::new();
                    for _ in 0..warmup + rounds {
                        start.wait();
                        if let Ok(m) = &model
                            && let Err(err) = m.run(steps)
                        {
                            model = Err(err);
                        }
                        end.wait();
                    }
                    model.map(|_| ())
                })
            })
            .collect();
        let mut samples = Vec::new();
        for round in 0..warmup + rounds {
            start.wait();
            let clock = Instant::now();
            end.wait();
            let seconds = clock.elapsed().as_secs_f64();
            if round >= warmup {
                samples.push(threads as f64 * f64::from(steps) / seconds);
            }
            between(round);
        }
        for worker in workers {
            match worker.join() {
                Ok(Ok(())) => {}
                Ok(Err(err)) => return Err(err.to_string()),
                Err(_) => return Err("a ferry thread panicked".into()),
            }
        }
        Ok(samples)
    })
}

fn measure_scaling(
    threads: usize,
    torch: &mut PyTorchSide,
    warmup: u32,
    rounds: u32,
) -> ScalingRow {
    let mut pytorch = start_rounds(torch.torch.is_some());
    let line = format!("threads {threads} {TORCH_SCALING_STEPS}");
    let ferry = ferry_scaling(threads, FERRY_SCALING_STEPS, warmup, rounds, |round| {
        if pytorch.get().is_some() {
            let sample = number(torch, &line, "steps_per_s");
            record(&mut pytorch, sample, round >= warmup);
        }
    });
    ScalingRow {
        threads,
        ferry: Reading::from_result(ferry),
        pytorch,
    }
}

pub fn run(args: AutogradArgs) -> Result<(), Box<dyn Error>> {
    let selected = chains::select(&args.chains)?;
    let wants = |s: Section| args.sections.contains(&s);
    let device = Device::Cuda(0);
    let cuda = crate::harness::cuda_device(0)
        .map(|dev| format!("{} ({})", dev.device(), dev.info().name))
        .map_err(|e| e.to_string());
    let mut torch = args.pytorch.side("autograd.py", "column");
    let mut report = Report {
        cuda,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        rounds: args.rounds,
        warmup: args.warmup,
        pytorch: torch.label.clone(),
        pytorch_note: torch.note.clone(),
        memory: Vec::new(),
        scaling: Vec::new(),
        overhead: None,
    };
    print_header(&report);
    if wants(Section::Memory) {
        for chain in selected {
            report.memory.push(match &report.cuda {
                Ok(_) => {
                    eprintln!("measuring memory of {} ...", chain.id);
                    measure_memory(chain, device, &mut torch)
                }
                Err(why) => MemoryRow {
                    chain,
                    ferry: Reading::Failed(format!("no CUDA device: {why}")),
                    pytorch: Reading::Skipped,
                },
            });
        }
    }
    if wants(Section::Threads) {
        for threads in args.thread_counts() {
            eprintln!("measuring {threads} thread(s) ...");
            let row = measure_scaling(threads, &mut torch, args.warmup, args.rounds);
            report.scaling.push(row);
        }
    }
    if wants(Section::Overhead) {
        eprintln!("measuring per-op overhead ...");
        report.overhead = Some(measure_overhead(&mut torch, args.warmup, args.rounds));
    }
    report.pytorch_note = torch.note.clone().or(report.pytorch_note);
    print_results(&report);
    if let Some(path) = &args.json {
        let doc = to_json(&report);
        harness::write_json(path, &doc, "row")?;
    }
    Ok(())
}
