//! What `ferry bench autograd` reports: its rows on both sides, the four tables and the JSON
//! file (every row as one object: both sides with every round, units, the goal, the verdict).

use std::collections::BTreeSet;

use serde_json::{Value, json};

use super::chains::{Chain, ChainBytes, SIDE};
use crate::RunInfo;
use crate::harness::goal::{Bound, Goal};
use crate::harness::measure::median;
use crate::harness::report::{Verdict, format_ratio, print_table, significant};

/// The goals, as data. ferry keeps no more after the forward than PyTorch does (bytes over
/// PyTorch's at most 0); throughput(N) >= 0.75 x N x throughput(1) ...
const MEMORY_GOAL: Goal = Goal {
    name: "<= PyTorch",
    metric: "retained_bytes over PyTorch's",
    bound: Bound::AtMost(0.0),
};
const SCALING_GOAL: Goal = Goal {
    name: "efficiency",
    metric: "steps/s(N) / (N x steps/s(1))",
    bound: Bound::AtLeast(0.75),
};
/// The per-op goal from issue 10, in µs per op on the H200 host.
const OVERHEAD_GOAL: Goal = Goal {
    name: "per-op",
    metric: "us/op",
    bound: Bound::AtMost(3.0),
};
/// ... for N up to this many threads.
pub const SCALING_GOAL_UP_TO: usize = 8;
/// Ops in the CPU step (mul, add, relu, sum).
pub const OPS_PER_STEP: f64 = 4.0;

/// One side of a row: its number(s), why it has none, or not run at all.
#[derive(Debug, Clone, PartialEq)]
pub enum Reading<T> {
    /// Not run on this side (no --compare-pytorch, section not selected): the header says why.
    Skipped,
    Failed(String),
    Got(T),
}

impl<T> Reading<T> {
    pub fn from_result<E: ToString>(result: Result<T, E>) -> Self {
        match result {
            Ok(value) => Reading::Got(value),
            Err(err) => Reading::Failed(err.to_string()),
        }
    }

    /// `f` of the value; a failure or a skip passes through.
    pub fn then<U>(self, f: impl FnOnce(T) -> Reading<U>) -> Reading<U> {
        match self {
            Reading::Got(value) => f(value),
            Reading::Failed(err) => Reading::Failed(err),
            Reading::Skipped => Reading::Skipped,
        }
    }

    pub fn get(&self) -> Option<&T> {
        match self {
            Reading::Got(value) => Some(value),
            _ => None,
        }
    }

    fn error(&self) -> Option<&str> {
        match self {
            Reading::Failed(err) => Some(err),
            _ => None,
        }
    }
}

impl Reading<Vec<f64>> {
    /// The median of the rounds.
    pub fn median(&self) -> Option<f64> {
        self.get().and_then(|samples| median(samples))
    }
}

/// A chain's device memory on both sides.
pub struct MemoryRow {
    pub chain: &'static Chain,
    pub ferry: Reading<ChainBytes>,
    pub pytorch: Reading<ChainBytes>,
}

impl MemoryRow {
    /// The goal: ferry keeps no more after the forward than PyTorch does.
    pub fn verdict(&self) -> Verdict {
        let over = |(f, p): (&ChainBytes, &ChainBytes)| (f.retained - p.retained) as f64;
        MEMORY_GOAL.verdict(self.ferry.get().zip(self.pytorch.get()).map(over))
    }
}

/// Aggregate steps per second of N threads, per round, on both sides.
pub struct ScalingRow {
    pub threads: usize,
    pub ferry: Reading<Vec<f64>>,
    pub pytorch: Reading<Vec<f64>>,
}

/// throughput(N) / (N x throughput(1)): 1 is perfect scaling, 1/N is none at all.
pub fn efficiency(throughput: f64, threads: usize, one_thread: f64) -> f64 {
    throughput / (threads as f64 * one_thread)
}

/// Each row's efficiency on one side, against the same side's one-thread row.
pub fn efficiencies(
    rows: &[ScalingRow],
    side: impl Fn(&ScalingRow) -> &Reading<Vec<f64>>,
) -> Vec<Option<f64>> {
    let one = rows
        .iter()
        .find(|r| r.threads == 1)
        .and_then(|r| side(r).median());
    rows.iter()
        .map(|r| Some(efficiency(side(r).median()?, r.threads, one?)))
        .collect()
}

/// Judged for 2..=8 threads, and only where the machine has a core for each thread.
pub fn scaling_verdict(threads: usize, efficiency: Option<f64>, cores: usize) -> Verdict {
    match threads {
        _ if threads == 1 || threads > SCALING_GOAL_UP_TO || threads > cores => Verdict::NoTarget,
        _ => SCALING_GOAL.verdict(efficiency),
    }
}

pub fn scaling_goal(threads: usize, cores: usize) -> String {
    match threads {
        1 => "reference".into(),
        n if n > SCALING_GOAL_UP_TO => "-".into(),
        n if n > cores => format!("not judged: {cores} cores"),
        _ => SCALING_GOAL.bound.to_string(),
    }
}

/// µs per op of the 64x64 step, per round: ferry, PyTorch on one intra-op thread and on its
/// default count.
pub struct OverheadRow {
    pub ferry: Reading<Vec<f64>>,
    pub pytorch_one: Reading<Vec<f64>>,
    pub pytorch_default: Reading<Vec<f64>>,
    /// PyTorch's default intra-op thread count, as it reported it.
    pub default_threads: Option<u64>,
}

impl OverheadRow {
    pub fn verdict(&self) -> Verdict {
        OVERHEAD_GOAL.verdict(self.ferry.median())
    }
}

/// Everything one run measured.
pub struct Report {
    /// "cuda:0 (NVIDIA H200)", or why there is no device.
    pub cuda: Result<String, String>,
    pub cores: usize,
    pub rounds: u32,
    pub warmup: u32,
    /// PyTorch's version and device, when it took part.
    pub pytorch: Option<String>,
    /// Why the PyTorch column is empty or stops part way.
    pub pytorch_note: Option<String>,
    pub memory: Vec<MemoryRow>,
    pub scaling: Vec<ScalingRow>,
    pub overhead: Option<OverheadRow>,
}

fn mib(bytes: i64) -> String {
    significant(bytes as f64 / f64::from(1 << 20))
}

/// A cell: the value, "error" (the message is listed under the tables) or "-".
fn cell<T>(reading: &Reading<T>, show: impl Fn(&T) -> String) -> String {
    match reading {
        Reading::Got(value) => show(value),
        Reading::Failed(_) => "error".into(),
        Reading::Skipped => "-".into(),
    }
}

fn ratio(ferry: Option<f64>, pytorch: Option<f64>) -> String {
    ferry
        .zip(pytorch)
        .map_or("-".into(), |(f, p)| format_ratio(f, p))
}

pub fn memory_rows(rows: &[MemoryRow]) -> Vec<Vec<String>> {
    rows.iter()
        .map(|r| {
            let retained = |b: &ChainBytes| b.retained as f64;
            vec![
                r.chain.id.to_string(),
                cell(&r.ferry, |b| mib(b.retained)),
                cell(&r.ferry, |b| b.saved.map_or("-".into(), |s| mib(s as i64))),
                cell(&r.pytorch, |b| mib(b.retained)),
                ratio(r.ferry.get().map(retained), r.pytorch.get().map(retained)),
                mib((r.chain.expected)(SIDE) as i64),
                "<= PyTorch".into(),
                r.verdict().label().to_string(),
            ]
        })
        .collect()
}

pub fn backward_rows(rows: &[MemoryRow]) -> Vec<Vec<String>> {
    rows.iter()
        .map(|r| {
            let peak = |b: &ChainBytes| b.backward_peak as f64;
            vec![
                r.chain.id.to_string(),
                cell(&r.ferry, |b| mib(b.backward_peak)),
                cell(&r.pytorch, |b| mib(b.backward_peak)),
                ratio(r.ferry.get().map(peak), r.pytorch.get().map(peak)),
            ]
        })
        .collect()
}

pub fn scaling_rows(rows: &[ScalingRow], cores: usize) -> Vec<Vec<String>> {
    let ferry_eff = efficiencies(rows, |r| &r.ferry);
    let torch_eff = efficiencies(rows, |r| &r.pytorch);
    let steps = |s: &Vec<f64>| median(s).map_or("-".into(), |m| format!("{m:.0}"));
    let eff = |e: Option<f64>| e.map_or("-".into(), |e| format!("{e:.2}"));
    rows.iter()
        .zip(ferry_eff.iter().zip(&torch_eff))
        .map(|(r, (&fe, &te))| {
            vec![
                r.threads.to_string(),
                cell(&r.ferry, steps),
                eff(fe),
                cell(&r.pytorch, steps),
                eff(te),
                scaling_goal(r.threads, cores),
                scaling_verdict(r.threads, fe, cores).label().to_string(),
            ]
        })
        .collect()
}

pub fn overhead_rows(row: &OverheadRow) -> Vec<Vec<String>> {
    let us = |s: &Vec<f64>| median(s).map_or("-".into(), significant);
    vec![vec![
        "mul_add_relu_sum".into(),
        cell(&row.ferry, us),
        cell(&row.pytorch_one, us),
        cell(&row.pytorch_default, us),
        ratio(row.ferry.median(), row.pytorch_one.median()),
        format!("{} µs", OVERHEAD_GOAL.bound),
        row.verdict().label().to_string(),
    ]]
}

pub fn print_header(report: &Report) {
    let memory = match &report.cuda {
        Ok(device) => format!("memory on {device}"),
        Err(_) => "no CUDA device for the memory rows".into(),
    };
    println!(
        "ferry bench autograd: {memory}; CPU rows on {} cores",
        report.cores
    );
    match &report.pytorch {
        Some(p) => println!("PyTorch {p}, requests interleaved with ferry's rounds"),
        None => println!(
            "{}",
            report
                .pytorch_note
                .as_deref()
                .unwrap_or("no PyTorch column: pass --compare-pytorch")
        ),
    }
}

pub fn print_results(report: &Report) {
    if !report.memory.is_empty() {
        println!();
        println!(
            "memory kept after the forward (MiB above the baseline taken before the inputs; the \
             user holds the leaves, inputs and output)"
        );
        match &report.cuda {
            Ok(_) => print_table(
                &[
                    "chain", "ferry", "saved", "PyTorch", "ratio", "expected", "goal", "met",
                ],
                &memory_rows(&report.memory),
            ),
            Err(why) => println!("  no CUDA device: {why}; these rows need cuda:0"),
        }
        if report.cuda.is_ok() {
            println!();
            println!("peak memory during output.sum().backward() (MiB above the same baseline)");
            print_table(
                &["chain", "ferry", "PyTorch", "ratio"],
                &backward_rows(&report.memory),
            );
        }
    }
    if !report.scaling.is_empty() {
        println!();
        println!(
            "thread scaling (CPU): N threads, each stepping its own 64x64 model (mul, add, relu, \
             sum, backward); aggregate steps/s, median of {} rounds",
            report.rounds
        );
        print_table(
            &[
                "threads",
                "ferry steps/s",
                "efficiency",
                "PyTorch steps/s",
                "efficiency",
                "goal",
                "met",
            ],
            &scaling_rows(&report.scaling, report.cores),
        );
    }
    if let Some(row) = &report.overhead {
        println!();
        println!(
            "per-op overhead (CPU, 64x64 f32 mul, add, relu, sum: forward + backward); µs per op, \
             median of {} rounds",
            report.rounds
        );
        let default = row
            .default_threads
            .map_or("PyTorch default".into(), |n| format!("PyTorch {n} threads"));
        print_table(
            &[
                "step",
                "ferry",
                "PyTorch 1 thread",
                &default,
                "ratio",
                "goal",
                "met",
            ],
            &overhead_rows(row),
        );
    }
    print_notes(report);
}

fn print_notes(report: &Report) {
    println!();
    println!("ratio: ferry / PyTorch (below 1, ferry keeps less or is faster).");
    if report.cuda.is_ok() && !report.memory.is_empty() {
        println!(
            "saved: ferry's graph.saved_bytes() (host bytes included); expected: what PyTorch's \
             derivative rules keep, tensor by tensor:"
        );
        for r in &report.memory {
            println!(
                "  {}: {}; keeps {}",
                r.chain.id, r.chain.forward, r.chain.keeps
            );
        }
    }
    if !report.scaling.is_empty() {
        println!(
            "efficiency: steps/s(N) / (N x steps/s(1)); goal {} up to {SCALING_GOAL_UP_TO} \
             threads, judged where the machine has a core per thread.",
            SCALING_GOAL.bound
        );
        if report.pytorch.is_some() {
            println!(
                "  PyTorch's threads are Python threads: the GIL serialises each op's Python-side \
                 dispatch, so its column is what a Python user gets, not a measure of its C++ \
                 core."
            );
        }
    }
    if report.overhead.is_some() {
        let pytorch = match report.pytorch {
            Some(_) => {
                "; PyTorch runs from Python (its dispatch included), ratio against its \
                        1-thread column"
            }
            None => "",
        };
        println!("per-op goal: the H200 host's{pytorch}.");
    }
    let mut errors = BTreeSet::new();
    // Without a device the memory section already said why, once.
    for r in report.memory.iter().filter(|_| report.cuda.is_ok()) {
        errors.extend(
            r.ferry
                .error()
                .map(|e| format!("{} (ferry): {e}", r.chain.id)),
        );
        errors.extend(r.pytorch.error().map(|e| format!("PyTorch: {e}")));
        let leaked = r.ferry.get().filter(|b| b.after_drop != 0);
        errors.extend(leaked.map(|b| {
            format!(
                "{}: ferry still had {} bytes allocated after dropping everything",
                r.chain.id, b.after_drop
            )
        }));
    }
    for r in &report.scaling {
        errors.extend(
            r.ferry
                .error()
                .map(|e| format!("{} threads (ferry): {e}", r.threads)),
        );
        errors.extend(r.pytorch.error().map(|e| format!("PyTorch threads: {e}")));
    }
    if let Some(r) = &report.overhead {
        errors.extend(r.ferry.error().map(|e| format!("overhead (ferry): {e}")));
        for side in [&r.pytorch_one, &r.pytorch_default] {
            errors.extend(side.error().map(|e| format!("PyTorch overhead: {e}")));
        }
    }
    for e in errors {
        println!("error: {e}");
    }
    if let (Some(note), Some(_)) = (&report.pytorch_note, &report.pytorch) {
        println!("note: {note}");
    }
}

fn side_json<T>(reading: &Reading<T>, value: impl Fn(&T) -> Value) -> Value {
    match reading {
        Reading::Got(v) => value(v),
        Reading::Failed(err) => json!({ "error": err }),
        Reading::Skipped => json!({ "skipped": true }),
    }
}

fn rounds_json(samples: &Vec<f64>, unit: &str) -> Value {
    json!({ "median": median(samples), "rounds": samples, "unit": unit })
}

/// Every row as one JSON object with a `section`, both sides, units, the goal and whether it
/// was met (null where it cannot be judged).
pub fn rows_json(report: &Report) -> Vec<Value> {
    let mut rows = Vec::new();
    for r in &report.memory {
        let expected = (r.chain.expected)(SIDE);
        let bytes = |b: &ChainBytes| {
            json!({
                "retained_bytes": b.retained,
                "backward_peak_bytes": b.backward_peak,
                "after_drop_bytes": b.after_drop,
                "saved_bytes": b.saved,
            })
        };
        rows.push(json!({
            "section": "memory",
            "id": r.chain.id,
            "forward": r.chain.forward,
            "unit": "bytes",
            "expected_bytes": expected,
            "ferry": side_json(&r.ferry, bytes),
            "pytorch": side_json(&r.pytorch, bytes),
            "ratio": r.ferry.get().zip(r.pytorch.get())
                .map(|(f, p)| f.retained as f64 / p.retained as f64),
            "goal": "retained_bytes <= PyTorch's",
            "met": r.verdict().as_bool(),
        }));
        rows.push(json!({
            "section": "backward_peak",
            "id": r.chain.id,
            "unit": "bytes",
            "ferry": side_json(&r.ferry, |b| json!({ "backward_peak_bytes": b.backward_peak })),
            "pytorch": side_json(&r.pytorch, |b| json!({ "backward_peak_bytes": b.backward_peak })),
            "ratio": r.ferry.get().zip(r.pytorch.get())
                .map(|(f, p)| f.backward_peak as f64 / p.backward_peak as f64),
            "goal": Value::Null,
            "met": Value::Null,
        }));
    }
    let ferry_eff = efficiencies(&report.scaling, |r| &r.ferry);
    let torch_eff = efficiencies(&report.scaling, |r| &r.pytorch);
    for (r, (fe, te)) in report
        .scaling
        .iter()
        .zip(ferry_eff.into_iter().zip(torch_eff))
    {
        let verdict = scaling_verdict(r.threads, fe, report.cores);
        let side = |reading: &Reading<Vec<f64>>, eff: Option<f64>| {
            side_json(reading, |s| {
                let mut v = rounds_json(s, "steps/s");
                v["efficiency"] = json!(eff);
                v
            })
        };
        rows.push(json!({
            "section": "thread_scaling",
            "id": format!("threads_{}", r.threads),
            "threads": r.threads,
            "unit": "steps/s",
            "ferry": side(&r.ferry, fe),
            "pytorch": side(&r.pytorch, te),
            "goal": (r.threads <= SCALING_GOAL_UP_TO).then(|| scaling_goal(r.threads, report.cores)),
            "met": verdict.as_bool(),
        }));
    }
    if let Some(r) = &report.overhead {
        let us = |s: &Vec<f64>| rounds_json(s, "us/op");
        rows.push(json!({
            "section": "op_overhead",
            "id": "mul_add_relu_sum",
            "unit": "us/op",
            "ferry": side_json(&r.ferry, us),
            "pytorch": side_json(&r.pytorch_one, us),
            "pytorch_default_threads": side_json(&r.pytorch_default, |s| {
                let mut v = us(s);
                v["threads"] = json!(r.default_threads);
                v
            }),
            "ratio": r.ferry.median().zip(r.pytorch_one.median()).map(|(f, p)| f / p),
            "goal": format!("{} us/op", OVERHEAD_GOAL.bound),
            "met": r.verdict().as_bool(),
        }));
    }
    rows
}

pub fn to_json(report: &Report) -> Value {
    RunInfo::stamp(json!({
        "benchmark": "ferry bench autograd",
        "cuda_device": report.cuda.as_ref().ok(),
        "cuda_error": report.cuda.as_ref().err(),
        "cpu_cores": report.cores,
        "rounds": report.rounds,
        "warmup": report.warmup,
        "pytorch": report.pytorch,
        "pytorch_note": report.pytorch_note,
        "rows": rows_json(report),
    }))
}
