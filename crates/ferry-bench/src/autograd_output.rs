//! What `ferry bench autograd` reports: its rows on both sides and the four tables.

use std::collections::BTreeSet;

use super::autograd_chains::{Chain, ChainBytes, SIDE};
use crate::harness::measure::median;
use crate::harness::report::{Verdict, format_ratio, print_table, significant};

/// The per-op goal from issue 10, in µs per op on the H200 host.
pub const OVERHEAD_GOAL_US: f64 = 3.0;
/// The thread-scaling goal: throughput(N) >= this x N x throughput(1) ...
pub const SCALING_GOAL: f64 = 0.75;
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
        match (self.ferry.get(), self.pytorch.get()) {
            (Some(f), Some(p)) if f.retained <= p.retained => Verdict::Met,
            (Some(_), Some(_)) => Verdict::Missed,
            _ => Verdict::Unknown,
        }
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
    match efficiency {
        _ if threads == 1 || threads > SCALING_GOAL_UP_TO || threads > cores => Verdict::NoTarget,
        Some(e) if e >= SCALING_GOAL => Verdict::Met,
        Some(_) => Verdict::Missed,
        None => Verdict::Unknown,
    }
}

pub fn scaling_goal(threads: usize, cores: usize) -> String {
    match threads {
        1 => "reference".into(),
        n if n > SCALING_GOAL_UP_TO => "-".into(),
        n if n > cores => format!("not judged: {cores} cores"),
        _ => format!(">= {SCALING_GOAL}"),
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
        match self.ferry.median() {
            Some(us) if us <= OVERHEAD_GOAL_US => Verdict::Met,
            Some(_) => Verdict::Missed,
            None => Verdict::Unknown,
        }
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
        format!("<= {OVERHEAD_GOAL_US} µs"),
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
            "efficiency: steps/s(N) / (N x steps/s(1)); goal >= {SCALING_GOAL} up to \
             {SCALING_GOAL_UP_TO} threads, judged where the machine has a core per thread."
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

#[cfg(test)]
pub mod tests {
    use super::*;
    use crate::autograd_chains::CHAINS;

    const MIB: i64 = 1 << 20;

    fn bytes(retained: i64, backward_peak: i64, saved: Option<usize>) -> ChainBytes {
        ChainBytes {
            retained,
            backward_peak,
            after_drop: 0,
            saved,
        }
    }

    fn scaling(threads: usize, ferry: &[f64], pytorch: Reading<Vec<f64>>) -> ScalingRow {
        ScalingRow {
            threads,
            ferry: Reading::Got(ferry.to_vec()),
            pytorch,
        }
    }

    /// A made-up H200 run: every section, both sides, one failure of each kind.
    pub fn report() -> Report {
        let memory = vec![
            MemoryRow {
                chain: &CHAINS[0],
                ferry: Reading::Got(bytes(800 * MIB, 2000 * MIB, Some(400 << 20))),
                pytorch: Reading::Got(bytes(800 * MIB, 1600 * MIB, None)),
            },
            MemoryRow {
                chain: &CHAINS[2],
                ferry: Reading::Got(bytes(1300 * MIB, 3200 * MIB, Some(800 << 20))),
                pytorch: Reading::Got(bytes(1200 * MIB, 2000 * MIB, None)),
            },
            MemoryRow {
                chain: &CHAINS[4],
                ferry: Reading::Failed("out of memory".into()),
                pytorch: Reading::Got(bytes(800 * MIB, 1600 * MIB, None)),
            },
        ];
        Report {
            cuda: Ok("cuda:0 (test)".into()),
            cores: 16,
            rounds: 3,
            warmup: 1,
            pytorch: Some("2.11.0 (CUDA 13.0) on Fake GPU".into()),
            pytorch_note: None,
            memory,
            scaling: vec![
                scaling(1, &[1e4, 1.1e4, 0.9e4], Reading::Got(vec![5e3; 3])),
                scaling(4, &[3e4; 3], Reading::Failed("RuntimeError: boom".into())),
                scaling(8, &[5e4; 3], Reading::Got(vec![5e3; 3])),
                scaling(16, &[6e4; 3], Reading::Skipped),
            ],
            overhead: Some(OverheadRow {
                ferry: Reading::Got(vec![2.5, 2.0, 3.5]),
                pytorch_one: Reading::Got(vec![20.0, 22.5, 25.0]),
                pytorch_default: Reading::Failed("killed".into()),
                default_threads: Some(16),
            }),
        }
    }

    #[test]
    fn efficiency_is_throughput_over_n_times_one_thread() {
        assert_eq!(efficiency(30_000.0, 4, 10_000.0), 0.75);
        assert_eq!(efficiency(10_000.0, 1, 10_000.0), 1.0);
        // Sixteen threads doing one thread's work: 1/16.
        assert_eq!(efficiency(10_000.0, 16, 10_000.0), 0.0625);
        let rows = report().scaling;
        let eff = efficiencies(&rows, |r| &r.ferry);
        assert_eq!(eff, [Some(1.0), Some(0.75), Some(0.625), Some(0.375)]);
        // PyTorch failed at 4 threads and was not asked at 16.
        let eff = efficiencies(&rows, |r| &r.pytorch);
        assert_eq!(eff, [Some(1.0), None, Some(0.125), None]);
        // Without a one-thread row nothing can be said.
        assert!(
            efficiencies(&rows[1..], |r| &r.ferry)
                .iter()
                .all(Option::is_none)
        );
    }

    #[test]
    fn scaling_is_judged_from_two_to_eight_threads_on_enough_cores() {
        assert_eq!(scaling_verdict(1, Some(1.0), 16), Verdict::NoTarget);
        assert_eq!(scaling_verdict(2, Some(0.75), 16), Verdict::Met);
        assert_eq!(scaling_verdict(8, Some(0.74), 16), Verdict::Missed);
        assert_eq!(scaling_verdict(8, None, 16), Verdict::Unknown);
        assert_eq!(scaling_verdict(16, Some(0.1), 16), Verdict::NoTarget);
        // A 2-core machine cannot show 4 threads scaling.
        assert_eq!(scaling_verdict(4, Some(0.3), 2), Verdict::NoTarget);
        assert_eq!(scaling_goal(4, 2), "not judged: 2 cores");
        assert_eq!(scaling_goal(4, 16), ">= 0.75");
    }

    #[test]
    fn tables_show_mib_ratios_goals_and_verdicts() {
        let r = report();
        let memory = memory_rows(&r.memory);
        assert_eq!(
            memory[0],
            [
                "elementwise",
                "800",
                "400",
                "800",
                "1.00",
                "800",
                "<= PyTorch",
                "met"
            ]
        );
        assert_eq!(memory[1][..5], ["tanh", "1300", "800", "1200", "1.08"]);
        assert_eq!(memory[1][7], "MISSED");
        assert_eq!(
            memory[2],
            [
                "softmax",
                "error",
                "error",
                "800",
                "-",
                "800",
                "<= PyTorch",
                "?"
            ]
        );
        let backward = backward_rows(&r.memory);
        assert_eq!(backward[0], ["elementwise", "2000", "1600", "1.25"]);
        assert_eq!(backward[2], ["softmax", "error", "1600", "-"]);

        let threads = scaling_rows(&r.scaling, r.cores);
        assert_eq!(
            threads[0],
            ["1", "10000", "1.00", "5000", "1.00", "reference", ""]
        );
        assert_eq!(
            threads[1],
            ["4", "30000", "0.75", "error", "-", ">= 0.75", "met"]
        );
        assert_eq!(
            threads[2][1..],
            ["50000", "0.62", "5000", "0.12", ">= 0.75", "MISSED"]
        );
        assert_eq!(threads[3][3..], ["-", "-", "-", ""]);

        let overhead = overhead_rows(r.overhead.as_ref().unwrap());
        assert_eq!(
            overhead[0],
            [
                "mul_add_relu_sum",
                "2.50",
                "22.5",
                "error",
                "0.111",
                "<= 3 µs",
                "met"
            ]
        );
    }
}
