//! `ferry bench autograd`: what the autograd core costs, ferry and PyTorch side by side in one
//! run. Three sections (`--sections`):
//! - memory: per chain on cuda:0, the bytes still allocated after the forward (the user holding
//!   leaves, inputs and output) and the peak during `output.sum().backward()`, above what was
//!   allocated before the inputs; PyTorch's from `torch.cuda` statistics. One untimed run of
//!   each chain on each side first, so one-off allocations are in the baseline.
//! - threads: N CPU threads, each stepping its own 64x64 model; aggregate steps/s.
//! - overhead: the same step on one thread, in µs per op (rounds of many steps, their median).
//!
//! PyTorch's side is python/autograd.py `--serve`; each ferry round is followed by the matching
//! request, so both see the same machine state.

use std::collections::BTreeSet;
use std::error::Error;
use std::path::PathBuf;
use std::sync::Barrier;
use std::time::Instant;

use clap::{Args, ValueEnum};
use ferry::prelude::*;
use serde_json::{Value, json};

use crate::Measured;
use crate::harness;
use crate::harness::goal::{Bound, Goal};
use crate::harness::pytorch::{PyTorchArgs, PyTorchSide};
use crate::harness::report::{Verdict, significant};
use crate::harness::table::{Cell, Report, Table};
use chains::{Chain, ChainBytes, SIDE};

mod chains;
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
/// Ops in the CPU step (mul, add, relu, sum).
const OPS_PER_STEP: f64 = 4.0;

/// ferry keeps no more after the forward than PyTorch does.
const MEMORY_GOAL: Goal = Goal {
    name: "<= PyTorch",
    metric: "retained_bytes over PyTorch's",
    bound: Bound::AtMost(0.0),
};
/// Judged from 2 up to [`SCALING_GOAL_UP_TO`] threads.
const SCALING_GOAL: Goal = Goal {
    name: "efficiency",
    metric: "steps/s(N) / (N x steps/s(1))",
    bound: Bound::AtLeast(0.75),
};
const SCALING_GOAL_UP_TO: usize = 8;
/// In µs per op on the H200 host.
const OVERHEAD_GOAL: Goal = Goal {
    name: "per-op",
    metric: "us/op",
    bound: Bound::AtMost(3.0),
};

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
    /// Write every row (both sides, every round, goals, verdicts) to this JSON file.
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

/// One side of a chain's memory row: `None` when that side did not run.
type Bytes = Option<Result<ChainBytes, String>>;

struct MemoryRow {
    chain: &'static Chain,
    ferry: Bytes,
    pytorch: Bytes,
}

/// Aggregate steps per second of N threads, a sample per round.
struct ScalingRow {
    threads: usize,
    ferry: Measured,
    pytorch: Measured,
}

/// µs per op of the 64x64 step, a sample per round.
#[derive(Default)]
struct OverheadRow {
    ferry: Measured,
    /// PyTorch on one intra-op thread, and on its default count.
    pytorch: [Measured; 2],
    /// PyTorch's default intra-op thread count, as it reported it.
    default_threads: Option<u64>,
}

/// Everything one run measured.
struct Run {
    /// "cuda:0 (NVIDIA H200)", or why there is no device.
    cuda: Result<String, String>,
    memory_asked: bool,
    cores: usize,
    rounds: u32,
    warmup: u32,
    pytorch: Option<String>,
    pytorch_note: Option<String>,
    memory: Vec<MemoryRow>,
    scaling: Vec<ScalingRow>,
    overhead: Option<OverheadRow>,
}

/// PyTorch's reply to `line`, `None` without PyTorch; a script that died is dropped and noted.
fn ask(side: &mut PyTorchSide, line: &str) -> Option<Result<Value, String>> {
    let reply = side.torch()?.request(line);
    if let Err(err) = &reply
        && side.forget_if_ended()
    {
        side.note = Some(format!("the PyTorch script ended at `{line}`: {err}"));
    }
    Some(reply)
}

/// `key` of a reply to `line`, as a number.
fn field(reply: &Value, key: &str, line: &str) -> Result<f64, String> {
    reply
        .get(key)
        .and_then(Value::as_f64)
        .ok_or_else(|| format!("the PyTorch script answered {reply} to `{line}`"))
}

/// One untimed run, then the measured one, on each side.
fn measure_memory(chain: &'static Chain, device: Device, torch: &mut PyTorchSide) -> MemoryRow {
    let ferry = chains::measure(chain, device).and_then(|_| chains::measure(chain, device));
    let line = format!("memory {}", chain.id);
    let pytorch = ask(torch, &line).map(|first| {
        first?;
        let reply = ask(torch, &line).unwrap_or_else(|| Err("the PyTorch script ended".into()))?;
        let get = |key| field(&reply, key, &line).map(|x| x as i64);
        Ok(ChainBytes {
            retained: get("retained_bytes")?,
            backward_peak: get("backward_peak_bytes")?,
            after_drop: get("after_drop_bytes")?,
            saved: None,
        })
    });
    MemoryRow {
        chain,
        ferry: Some(ferry.map_err(|e| e.to_string())),
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

    /// `steps` times mul, add, relu, sum and backward; gradients accumulate, on both sides.
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
    let mut row = OverheadRow::default();
    let model = SmallModel::new().map_err(|e| e.to_string());
    for round in 0..warmup + rounds {
        let timed = round >= warmup;
        let ferry = model.as_ref().map_err(Clone::clone).and_then(|m| {
            m.round_us_per_op(FERRY_OVERHEAD_STEPS)
                .map_err(|e| e.to_string())
        });
        row.ferry.record(ferry, timed);
        // 1 intra-op thread, then PyTorch's default (0).
        for (i, threads) in [1, 0].into_iter().enumerate() {
            let line = format!("overhead {threads} {TORCH_OVERHEAD_STEPS}");
            if row.pytorch[i].is_failed() {
                continue;
            }
            let Some(reply) = ask(torch, &line) else {
                continue;
            };
            if let (0, Ok(reply)) = (threads, &reply) {
                row.default_threads = reply.get("threads").and_then(Value::as_u64);
            }
            let ms = reply.and_then(|reply| field(&reply, "ms", &line));
            row.pytorch[i].record(ms.map(|ms| ms * 1e3 / OPS_PER_STEP), timed);
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
    let mut pytorch = Measured::new();
    let line = format!("threads {threads} {TORCH_SCALING_STEPS}");
    let ferry = ferry_scaling(threads, FERRY_SCALING_STEPS, warmup, rounds, |round| {
        if !pytorch.is_failed()
            && let Some(reply) = ask(torch, &line)
        {
            let sample = reply.and_then(|reply| field(&reply, "steps_per_s", &line));
            pytorch.record(sample, round >= warmup);
        }
    });
    ScalingRow {
        threads,
        ferry: ferry.map_or_else(Measured::failed, Measured::from_samples),
        pytorch,
    }
}

pub fn run(args: AutogradArgs) -> Result<(), Box<dyn Error>> {
    let selected = chains::select(&args.chains)?;
    let wants = |s: Section| args.sections.contains(&s);
    let cuda = harness::cuda_device(0)
        .map(|dev| format!("{} ({})", dev.device(), dev.info().name))
        .map_err(|e| e.to_string());
    let mut torch = args.pytorch.side("autograd.py", "column");
    let mut memory = Vec::new();
    if wants(Section::Memory) && cuda.is_ok() {
        for chain in selected {
            eprintln!("measuring memory of {} ...", chain.id);
            memory.push(measure_memory(chain, Device::Cuda(0), &mut torch));
        }
    }
    let mut scaling = Vec::new();
    for threads in args.thread_counts().into_iter().filter(|_| wants(Section::Threads)) {
        eprintln!("measuring {threads} thread(s) ...");
        scaling.push(measure_scaling(threads, &mut torch, args.warmup, args.rounds));
    }
    let overhead = wants(Section::Overhead).then(|| {
        eprintln!("measuring per-op overhead ...");
        measure_overhead(&mut torch, args.warmup, args.rounds)
    });
    let report = report(&Run {
        memory_asked: wants(Section::Memory),
        cuda,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        rounds: args.rounds,
        warmup: args.warmup,
        pytorch: torch.label.clone(),
        pytorch_note: torch.note.clone(),
        memory,
        scaling,
        overhead,
    });
    report.finish(args.json.as_deref())
}

// What the run reports: four tables, their notes, the facts.

fn mib(bytes: i64) -> String {
    significant(bytes as f64 / f64::from(1 << 20))
}

/// A side's bytes picked by `pick` in MiB, recorded in bytes; "error" or "-" without them.
fn bytes_cell(side: &Bytes, pick: impl Fn(&ChainBytes) -> Option<i64>) -> Cell {
    match side {
        Some(Ok(b)) => Cell::shown(pick(b).map(|x| x as f64), |x| mib(x as i64))
            .recorded(json!(pick(b))),
        Some(Err(err)) => Cell::text("error").recorded(json!({ "error": err })),
        None => Cell::number(None),
    }
}

/// The ratio of ferry's bytes to PyTorch's, picked by `pick`.
fn bytes_ratio(r: &MemoryRow, pick: impl Fn(&ChainBytes) -> i64) -> Cell {
    let side = |b: &Bytes| b.as_ref()?.as_ref().ok().map(|b| pick(b) as f64);
    Cell::ratio(side(&r.ferry), side(&r.pytorch))
}

fn memory_verdict(r: &MemoryRow) -> Verdict {
    let retained = |b: &Bytes| Some(b.as_ref()?.as_ref().ok()?.retained);
    let over = retained(&r.ferry).zip(retained(&r.pytorch));
    MEMORY_GOAL.verdict(over.map(|(f, p)| (f - p) as f64))
}

fn memory_table(rows: &[MemoryRow]) -> Table {
    let mut table = Table::new(&[
        "chain", "ferry", "saved", "PyTorch", "ratio", "expected", "goal", "met",
    ]);
    for r in rows {
        let expected = (r.chain.expected)(SIDE) as i64;
        let after_drop = |b: &Bytes| Some(b.as_ref()?.as_ref().ok()?.after_drop);
        table.push_with(
            vec![
                Cell::text(r.chain.id),
                bytes_cell(&r.ferry, |b| Some(b.retained)),
                bytes_cell(&r.ferry, |b| b.saved.map(|s| s as i64)),
                bytes_cell(&r.pytorch, |b| Some(b.retained)),
                bytes_ratio(r, |b| b.retained),
                Cell::text(mib(expected)).recorded(json!(expected)),
                Cell::text(MEMORY_GOAL.name),
                Cell::verdict(memory_verdict(r)),
            ],
            json!({
                "forward": r.chain.forward,
                "unit": "bytes",
                "ferry_after_drop": after_drop(&r.ferry),
                "pytorch_after_drop": after_drop(&r.pytorch),
            }),
        );
    }
    table
}

fn backward_table(rows: &[MemoryRow]) -> Table {
    let mut table = Table::new(&["chain", "ferry", "PyTorch", "ratio"]);
    for r in rows {
        table.push(vec![
            Cell::text(r.chain.id),
            bytes_cell(&r.ferry, |b| Some(b.backward_peak)),
            bytes_cell(&r.pytorch, |b| Some(b.backward_peak)),
            bytes_ratio(r, |b| b.backward_peak),
        ]);
    }
    table
}

/// A side's rounds (not milliseconds: steps/s or µs/op): the median shown by `format`.
fn rounds(side: &Measured, format: impl Fn(f64) -> String) -> Cell {
    let (median, rounds, error) = (side.complete_median(), &side.samples_ms, &side.error);
    let value = json!({ "median": median, "rounds": rounds, "error": error });
    Cell::text(side.median_cell(format)).recorded(value)
}

/// throughput(N) / (N x throughput(1)): 1 is perfect scaling, 1/N is none at all.
fn efficiency(throughput: f64, threads: usize, one_thread: f64) -> f64 {
    throughput / (threads as f64 * one_thread)
}

/// Each row's efficiency on one side, against the same side's one-thread row.
fn efficiencies(rows: &[ScalingRow], side: fn(&ScalingRow) -> &Measured) -> Vec<Option<f64>> {
    let one = rows.iter().find(|r| r.threads == 1);
    let one = one.and_then(|r| side(r).complete_median());
    let eff = |r: &ScalingRow| Some(efficiency(side(r).complete_median()?, r.threads, one?));
    rows.iter().map(eff).collect()
}

/// Judged for 2..=8 threads, and only where the machine has a core for each thread.
fn scaling_verdict(threads: usize, efficiency: Option<f64>, cores: usize) -> Verdict {
    match threads {
        _ if threads == 1 || threads > SCALING_GOAL_UP_TO || threads > cores => Verdict::NoTarget,
        _ => SCALING_GOAL.verdict(efficiency),
    }
}

fn scaling_goal(threads: usize, cores: usize) -> String {
    match threads {
        1 => "reference".into(),
        n if n > SCALING_GOAL_UP_TO => "-".into(),
        n if n > cores => format!("not judged: {cores} cores"),
        _ => SCALING_GOAL.bound.to_string(),
    }
}

fn scaling_table(rows: &[ScalingRow], cores: usize) -> Table {
    let mut table = Table::new(&[
        "threads",
        "ferry steps/s",
        "ferry efficiency",
        "PyTorch steps/s",
        "PyTorch efficiency",
        "goal",
        "met",
    ]);
    let ferry = efficiencies(rows, |r| &r.ferry);
    let torch = efficiencies(rows, |r| &r.pytorch);
    let steps = |m: &Measured| rounds(m, |s| format!("{s:.0}"));
    let eff = |e: Option<f64>| Cell::shown(e, |e| format!("{e:.2}"));
    for (r, (&fe, &te)) in rows.iter().zip(ferry.iter().zip(&torch)) {
        let cells = vec![
            Cell::count(r.threads as u64),
            steps(&r.ferry),
            eff(fe),
            steps(&r.pytorch),
            eff(te),
            Cell::text(scaling_goal(r.threads, cores)),
            Cell::verdict(scaling_verdict(r.threads, fe, cores)),
        ];
        table.push_with(cells, json!({ "unit": "steps/s" }));
    }
    table
}

fn overhead_table(row: &OverheadRow) -> Table {
    let mut table = Table::new(&[
        "step",
        "ferry",
        "PyTorch 1 thread",
        "PyTorch default",
        "ratio",
        "goal",
        "met",
    ]);
    let [one, default] = &row.pytorch;
    table.push_with(
        vec![
            Cell::text("mul_add_relu_sum"),
            rounds(&row.ferry, significant),
            rounds(one, significant),
            rounds(default, significant),
            Cell::ratio(row.ferry.complete_median(), one.complete_median()),
            Cell::text(format!("{} µs", OVERHEAD_GOAL.bound)),
            Cell::verdict(OVERHEAD_GOAL.verdict(row.ferry.complete_median())),
        ],
        json!({ "unit": "us/op", "pytorch_default_threads": row.default_threads }),
    );
    table
}

fn report(run: &Run) -> Report {
    let memory = match &run.cuda {
        Ok(device) => format!("memory on {device}"),
        Err(_) => "no CUDA device for the memory rows".into(),
    };
    let pytorch = match (&run.pytorch, &run.pytorch_note) {
        (Some(p), _) => format!("PyTorch {p}, requests interleaved with ferry's rounds"),
        (None, Some(note)) => note.clone(),
        (None, None) => "no PyTorch column: pass --compare-pytorch".into(),
    };
    let title = format!(
        "ferry bench autograd: {memory}; CPU rows on {} cores\n{pytorch}",
        run.cores
    );
    let mut report = Report::new("autograd", title).with_facts(json!({
        "cuda_device": run.cuda.as_ref().ok(),
        "cuda_error": run.cuda.as_ref().err(),
        "cpu_cores": run.cores,
        "rounds": run.rounds,
        "warmup": run.warmup,
        "pytorch": run.pytorch,
        "pytorch_note": run.pytorch_note,
    }));
    let rounds = run.rounds;
    let mut notes = vec!["ratio: ferry / PyTorch (below 1, ferry keeps less or is faster).".into()];
    if let (true, Err(why)) = (run.memory_asked, &run.cuda) {
        notes.push(format!("memory: no CUDA device: {why}; these rows need cuda:0"));
    }
    let mut errors = BTreeSet::new();
    if !run.memory.is_empty() {
        let heading = "memory kept after the forward (MiB above the baseline taken before the \
                       inputs; the user holds the leaves, inputs and output)";
        report.table("memory", Some(heading.into()), memory_table(&run.memory));
        let heading = "peak memory during output.sum().backward() (MiB above the same baseline)";
        report.table("backward_peak", Some(heading.into()), backward_table(&run.memory));
        notes.push(
            "saved: ferry's graph.saved_bytes() (host bytes included); expected: what \
             PyTorch's derivative rules keep, tensor by tensor:"
                .into(),
        );
        for r in &run.memory {
            let chain = r.chain;
            notes.push(format!("  {}: {}; keeps {}", chain.id, chain.forward, chain.keeps));
            let id = chain.id;
            match &r.ferry {
                Some(Err(e)) => errors.insert(format!("{id} (ferry): {e}")),
                Some(Ok(b)) if b.after_drop != 0 => errors.insert(format!(
                    "{id}: ferry still had {} bytes allocated after dropping everything",
                    b.after_drop
                )),
                _ => false,
            };
            if let Some(Err(e)) = &r.pytorch {
                errors.insert(format!("PyTorch: {e}"));
            }
        }
    }
    if !run.scaling.is_empty() {
        let heading = format!(
            "thread scaling (CPU): N threads, each stepping its own 64x64 model (mul, add, relu, \
             sum, backward); aggregate steps/s, median of {rounds} rounds"
        );
        let table = scaling_table(&run.scaling, run.cores);
        report.table("thread_scaling", Some(heading), table);
        notes.push(format!(
            "efficiency: steps/s(N) / (N x steps/s(1)); goal {} up to {SCALING_GOAL_UP_TO} \
             threads, judged where the machine has a core per thread.",
            SCALING_GOAL.bound
        ));
        if run.pytorch.is_some() {
            notes.push(
                "  PyTorch's threads are Python threads: the GIL serialises each op's \
                 Python-side dispatch, so its column is what a Python user gets, not a measure \
                 of its C++ core."
                    .into(),
            );
        }
        for r in &run.scaling {
            let threads = r.threads;
            errors.extend(r.ferry.error.as_ref().map(|e| format!("{threads} threads (ferry): {e}")));
            errors.extend(r.pytorch.error.as_ref().map(|e| format!("PyTorch threads: {e}")));
        }
    }
    if let Some(row) = &run.overhead {
        let heading = format!(
            "per-op overhead (CPU, 64x64 f32 mul, add, relu, sum: forward + backward); µs per \
             op, median of {rounds} rounds"
        );
        report.table("op_overhead", Some(heading), overhead_table(row));
        let default = row.default_threads.map_or(String::new(), |n| {
            format!("; its default is {n} threads")
        });
        let pytorch = run.pytorch.as_ref().map_or(String::new(), |_| {
            format!(
                "; PyTorch runs from Python (its dispatch included), ratio against its 1-thread \
                 column{default}"
            )
        });
        notes.push(format!("per-op goal: the H200 host's{pytorch}."));
        errors.extend(row.ferry.error.as_ref().map(|e| format!("overhead (ferry): {e}")));
        for side in &row.pytorch {
            errors.extend(side.error.as_ref().map(|e| format!("PyTorch overhead: {e}")));
        }
    }
    notes.extend(errors.into_iter().map(|e| format!("error: {e}")));
    if let (Some(note), Some(_)) = (&run.pytorch_note, &run.pytorch) {
        notes.push(format!("note: {note}"));
    }
    notes.into_iter().for_each(|n| report.note(n));
    report
}
