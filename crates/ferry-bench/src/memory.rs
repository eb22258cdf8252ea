//! `ferry bench memory`: activation memory against step time for ferry's GPT, Llama and an
//! MLP, each point a way to hold what backward needs: everything kept, every block recomputed
//! (PyTorch's `torch.utils.checkpoint` per block), every block offloaded (ferry's offload scope
//! alone), every block recomputed selectively (its products' outputs kept), and the memory plan ([`ferry::autograd::MemoryPlan`]) at five targets from 90% of the
//! plain activation bytes down to what recomputing every block keeps. The plan is made once per
//! target from one profiled step (each block's forward time and saved bytes) and the link's
//! rates measured in the same run; each point is the median step over `--samples` and the most
//! bytes the allocator held above the model and its batch. A model the planner refuses (the
//! MLP, whose blocks save only their inputs and outputs) is measured against the rivals alone.
//!
//! On a machine without a GPU it profiles and plans the smallest case and prints the plans (the
//! curve needs a GPU: the link, the device's peak).

use std::error::Error;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use ferry::autograd::{Choice, Link, MeasuredPeaks, MemoryPlan, RegionCost, StepCost};
use ferry::memory::cuda::CudaDevice;
use ferry::models::{Gpt, GptConfig, Llama, LlamaConfig};
use ferry::nn::{Activation, Dense, PlannedChain};
use ferry::prelude::*;
use serde_json::json;

use crate::harness;
use crate::harness::goal::{Bound, Goal};
use crate::harness::measure::Measured;
use crate::harness::table::{Cell, Report, Table, gib};
use crate::offload::measure_link;

#[derive(Args, Debug)]
pub struct MemoryArgs {
    /// Write every number to this JSON file (`ferry plot memory FILE` draws its curves).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Timed steps per point; the table shows their median.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    samples: u32,
    /// Untimed steps per point before the samples.
    #[arg(long, default_value_t = 1)]
    warmup: u32,
    /// Only these cases (ids joined by commas: gpt2_small, gpt_1b_b8, llama_1b_b4,
    /// mlp_2048x4_b4096).
    #[arg(long, value_delimiter = ',', value_name = "IDS")]
    cases: Vec<String>,
}

/// A model and batch to draw the curve of.
#[derive(Debug, Clone)]
struct Case {
    id: &'static str,
    arch: Arch,
    batch: usize,
    /// Positions a sample.
    context: usize,
    /// bf16 autocast (weights in f32).
    bf16: bool,
}

/// Which of ferry's models, at which size.
#[derive(Debug, Clone)]
enum Arch {
    Gpt(GptConfig),
    Llama(LlamaConfig),
    /// `blocks` x (Linear(`width`) + Tanh): a batch of rows, no tokens.
    Mlp { width: usize, blocks: usize },
}

fn cases() -> Vec<Case> {
    let gpt = |width, layers, heads| {
        Arch::Gpt(GptConfig {
            vocab: 256,
            context: 1024,
            width,
            layers,
            heads,
        })
    };
    vec![
        // nanoGPT's GPT-2 small shape in f32, batch 12 x 1024 (issue 41's anchor), bytes as
        // tokens.
        Case {
            id: "gpt2_small",
            arch: gpt(768, 12, 12),
            batch: 12,
            context: 1024,
            bf16: false,
        },
        // The 1 B GPT of `ferry bench train`, bf16 autocast, batch 8 x 1024.
        Case {
            id: "gpt_1b_b8",
            arch: gpt(2048, 20, 16),
            batch: 8,
            context: 1024,
            bf16: true,
        },
        // The Llama of `ferry bench train` (0.97 B), bf16 autocast, batch 4 x 1024 (issue
        // 41's batch for the 0.95 B Llama).
        Case {
            id: "llama_1b_b4",
            arch: Arch::Llama(LlamaConfig::llama_1b()),
            batch: 4,
            context: 1024,
            bf16: true,
        },
        // The small model of the offload scope's finding: 4 x (Linear(2048) + Tanh) at batch
        // 4096, f32, 256 MiB saved (`context` is the rows per sample: one).
        Case {
            id: "mlp_2048x4_b4096",
            arch: Arch::Mlp {
                width: 2048,
                blocks: 4,
            },
            batch: 4096,
            context: 1,
            bf16: false,
        },
    ]
}

/// The plan's targets, as fractions of the way from the plain activation bytes (0) to what
/// recomputing every block keeps (1): 90% of plain first, full recompute's bytes last.
const TARGETS: [f64; 5] = [0.0, 0.25, 0.5, 0.75, 1.0];

/// The labels the goals and notes look points up by.
const NO_PLAN: &str = "no plan";
const RECOMPUTE_ALL: &str = "recompute every block";
const OFFLOAD_ALL: &str = "offload every block";
const SELECTIVE_ALL: &str = "selective recompute of every block";
const PLAN_AT_RECOMPUTE: &str = "plan at full recomputation's bytes";
const PLAN_AT_HALF: &str = "plan with the saved bytes halved";

const AT_FULL_RECOMPUTE: Goal = Goal {
    name: "the plan at full recomputation's activation bytes: step / no plan",
    metric: "plan_at_recompute_peak_step_ratio",
    bound: Bound::AtMost(1.05),
};

const AT_HALF: Goal = Goal {
    name: "the plan with the saved activations halved: step / no plan",
    metric: "plan_at_half_step_ratio",
    bound: Bound::AtMost(1.03),
};

/// One way of running the step and what it measured.
struct Point {
    label: String,
    choices: Vec<Choice>,
    /// The plan's prediction, when it is a plan.
    plan: Option<MemoryPlan>,
    ms: Measured,
    peak: u64,
}

/// One of ferry's models, as the bench drives it.
enum Model {
    Gpt(Gpt),
    Llama(Llama),
    Mlp(PlannedChain<Dense>),
}

impl Model {
    fn as_module(&self) -> &dyn Module {
        match self {
            Model::Gpt(m) => m,
            Model::Llama(m) => m,
            Model::Mlp(m) => m,
        }
    }

    fn profile_blocks(&self, ids: &Tensor) -> ferry::Result<Vec<ferry::autograd::RegionCost>> {
        match self {
            Model::Gpt(m) => m.profile_blocks(ids),
            Model::Llama(m) => m.profile_blocks(ids),
            Model::Mlp(m) => m.profile_blocks(ids),
        }
    }

    fn set_plan(&mut self, choices: &[Choice]) -> ferry::Result<()> {
        match self {
            Model::Gpt(m) => m.set_plan(choices),
            Model::Llama(m) => m.set_plan(choices),
            Model::Mlp(m) => m.set_plan(choices),
        }
    }
}

/// A case's model, batch and step.
struct Run {
    model: Model,
    vocab: usize,
    /// Token ids `[batch, context]`, or the MLP's rows `[batch, width]`.
    input: Tensor,
    /// The next tokens, for a language model's cross-entropy; the MLP's loss is the mean
    /// square of its output.
    targets: Option<Tensor>,
    bf16: bool,
}

impl Run {
    fn new(case: &Case, device: Device) -> ferry::Result<Self> {
        let (model, vocab) = match &case.arch {
            Arch::Gpt(c) => (Model::Gpt(Gpt::new(*c, device)?), c.vocab),
            Arch::Llama(c) => (Model::Llama(Llama::new(c.clone(), device)?), c.vocab_size),
            &Arch::Mlp { width, blocks } => {
                let dense = (0..blocks)
                    .map(|_| Dense::new(width, width, Activation::Tanh, device))
                    .collect::<ferry::Result<Vec<_>>>()?;
                let input = Tensor::randn(&[case.batch, width], DType::F32, device)?;
                return Ok(Self {
                    model: Model::Mlp(PlannedChain::new(dense)),
                    vocab: 0,
                    input,
                    targets: None,
                    bf16: case.bf16,
                });
            }
        };
        let tokens = case.batch * case.context;
        let ids = |n: usize| -> ferry::Result<Tensor> {
            Tensor::rand(&[n], DType::F32, device)?
                .mul_scalar(vocab as f64)?
                .to_dtype(DType::I64)
        };
        Ok(Self {
            model,
            vocab,
            input: ids(tokens)?.reshape(&[case.batch, case.context])?,
            targets: Some(ids(tokens)?),
            bf16: case.bf16,
        })
    }

    fn loss(&self) -> ferry::Result<Tensor> {
        let forward = || self.loss_of(&self.model.as_module().forward(&self.input)?);
        match self.bf16 {
            true => ferry::amp::autocast(DType::BF16, forward),
            false => forward(),
        }
    }

    /// The loss of the model's output: cross-entropy of the logits, or the MLP's mean square.
    fn loss_of(&self, out: &Tensor) -> ferry::Result<Tensor> {
        match &self.targets {
            Some(targets) => {
                let flat = out.reshape(&[targets.shape()[0], self.vocab])?;
                ferry::nn::cross_entropy(&flat, targets)
            }
            None => out.mul(out)?.mean(),
        }
    }

    /// One plain step measuring its memory per phase, for the plans' predicted peaks.
    fn measure_peaks(&self) -> ferry::Result<MeasuredPeaks> {
        self.clear_grads();
        let backward = |out: &Tensor| -> ferry::Result<()> {
            self.loss_of(out)?.backward()?;
            Ok(())
        };
        let measure = || match &self.model {
            Model::Gpt(m) => m.measure_peaks(&self.input, backward),
            Model::Llama(m) => m.measure_peaks(&self.input, backward),
            Model::Mlp(m) => m.measure_peaks(&self.input, backward),
        };
        let peaks = match self.bf16 {
            true => ferry::amp::autocast(DType::BF16, measure),
            false => measure(),
        };
        self.clear_grads();
        peaks
    }

    /// The blocks' costs from one profiled forward (autocast as the step runs).
    fn profile(&self) -> ferry::Result<Vec<ferry::autograd::RegionCost>> {
        let profile = || self.model.profile_blocks(&self.input);
        match self.bf16 {
            true => ferry::amp::autocast(DType::BF16, profile),
            false => profile(),
        }
    }

    fn clear_grads(&self) {
        for p in self.model.as_module().parameters() {
            p.set_grad(None);
        }
    }

    /// One step with `choices`: its milliseconds and the allocator's peak above what it held
    /// before.
    fn step(&mut self, dev: &CudaDevice, choices: &[Choice]) -> ferry::Result<(f64, u64)> {
        self.model.set_plan(choices)?;
        self.clear_grads();
        dev.synchronize()?;
        let base = dev.memory_stats().allocated_bytes;
        dev.reset_peak();
        let started = Instant::now();
        self.loss()?.backward()?;
        dev.synchronize()?;
        let ms = started.elapsed().as_secs_f64() * 1e3;
        let peak = dev.memory_stats().peak_allocated_bytes.saturating_sub(base) as u64;
        Ok((ms, peak))
    }
}

pub fn run(args: MemoryArgs) -> Result<(), Box<dyn Error>> {
    let all = cases();
    let cases = harness::select(&all, &args.cases, "case", |c| c.id)?;
    let dev = match harness::cuda_device(0) {
        Ok(dev) => dev,
        Err(err) => return plans_on_the_cpu(&err.to_string()),
    };
    eprintln!("measuring the link ...");
    let link = measure_link(&dev, 3)?
        .speed()
        .map(|s| Link {
            to_host_bytes_per_ms: s.d2h_bytes_per_ms,
            to_device_bytes_per_ms: s.h2d_bytes_per_ms,
        })
        .ok_or("the link's copies gave no time")?;
    let title = format!(
        "ferry bench memory on {}: activation bytes against step time, ferry's GPT; median of {} \
         steps after {} per point; the link measured in this run: {:.1} GB/s to the host, {:.1} \
         GB/s back",
        dev.device(),
        args.samples,
        args.warmup,
        link.to_host_bytes_per_ms / 1e6,
        link.to_device_bytes_per_ms / 1e6
    );
    let mut report = Report::new("memory", title);
    let mut judged = Vec::new();
    let mut all = Vec::new();
    for case in cases {
        eprintln!("measuring {} ...", case.id);
        let (points, refused) = curve(&dev, case, link, &args)?;
        if let Some(why) = refused {
            report.note(format!("{}: {why}", case.id));
        }
        let plain_ms = points[0].ms.median();
        let plain_peak = points[0].peak;
        let mut table = Table::new(&[
            "way",
            "step ms",
            "vs no plan",
            "peak GiB",
            "peak vs no plan",
            "predicted extra ms",
            "choices (k keep, o offload, r recompute)",
        ]);
        for p in &points {
            let ratio = |v: Option<f64>| plain_ms.zip(v).map(|(a, b)| b / a);
            table.push(vec![
                Cell::text(p.label.clone()),
                Cell::median(&p.ms),
                Cell::shown(ratio(p.ms.median()), |r| format!("{r:.3}x")),
                Cell::text(format!("{:.2}", gib(p.peak))),
                Cell::text(format!("{:.2}", p.peak as f64 / plain_peak.max(1) as f64)),
                Cell::shown(p.plan.as_ref().map(MemoryPlan::extra_ms), |v| {
                    format!("{v:.2}")
                }),
                Cell::text(letters(&p.choices)),
            ]);
        }
        report.table("curve", Some(format!("{} ({})", case.id, describe(case))), table);
        let step_ratio = |label: &str| {
            let p = points.iter().find(|p| p.label == label)?;
            Some(p.ms.median()? / plain_ms?)
        };
        judged.push(AT_FULL_RECOMPUTE.judge(
            step_ratio(PLAN_AT_RECOMPUTE),
            format!("{} ({RECOMPUTE_ALL}: {:?})", case.id, step_ratio(RECOMPUTE_ALL)),
        ));
        judged.push(AT_HALF.judge(step_ratio(PLAN_AT_HALF), case.id.to_string()));
        for rival in [RECOMPUTE_ALL, OFFLOAD_ALL, SELECTIVE_ALL] {
            let dominated = dominates(&points, rival);
            report.note(format!(
                "{}: the plan's curve {} {rival} (a plan point at or below its peak and its step)",
                case.id,
                match dominated {
                    Some(true) => "meets or beats",
                    Some(false) => "does NOT meet",
                    None => "could not be compared with",
                }
            ));
        }
        all.push(json!({
            "case": case.id,
            "points": points.iter().map(|p| json!({
                "way": p.label,
                "median_ms": p.ms.median(),
                "samples_ms": p.ms.samples_ms,
                "peak_bytes": p.peak,
                "choices": letters(&p.choices),
                "predicted_extra_ms": p.plan.as_ref().map(MemoryPlan::extra_ms),
                "predicted_peak_bytes": p.plan.as_ref().map(MemoryPlan::peak_bytes),
            })).collect::<Vec<_>>(),
        }));
        for p in points.iter().filter_map(|p| p.plan.as_ref()) {
            if !p.reached() {
                report.note(format!("{}: {}", case.id, p.to_string().lines().next().unwrap_or("")));
            }
        }
    }
    report.goals(judged);
    report.print();
    if let Some(path) = &args.json {
        let mut doc = report.json();
        doc["cases"] = json!(all);
        harness::write_json(path, &doc, "memory")?;
    }
    Ok(())
}

/// The points of a step of `costs` (one per block), none measured yet: no plan, every block
/// recomputed, every block offloaded, every block recomputed selectively, then the plan at each target and with the blocks' own
/// bytes halved, or, where the planner refuses the costs, why (the rivals are measured still).
fn planned_points(
    costs: &[RegionCost],
    measured: Option<MeasuredPeaks>,
    link: Link,
) -> (Vec<Point>, Option<String>) {
    let layers = costs.len();
    let mut points = vec![
        point(NO_PLAN, vec![Choice::Keep; layers], None),
        point(RECOMPUTE_ALL, vec![Choice::Recompute; layers], None),
        point(OFFLOAD_ALL, vec![Choice::Offload; layers], None),
        point(SELECTIVE_ALL, vec![Choice::Selective; layers], None),
    ];
    let step = StepCost {
        regions: costs.to_vec(),
        link: Some(link),
        measured,
        ..StepCost::default()
    };
    match plans(&step) {
        Ok(plans) => {
            points.extend(plans);
            (points, None)
        }
        Err(e) => (points, Some(format!("no plan points: {e}"))),
    }
}

/// The plan's points of [`planned_points`]; with measured peaks, their bytes are the device's.
fn plans(step: &StepCost) -> ferry::Result<Vec<Point>> {
    let keep = vec![Choice::Keep; step.regions.len()];
    let plain_bytes = MemoryPlan::with_choices(step, &keep)?.peak_bytes();
    let no_link = StepCost {
        link: None,
        ..step.clone()
    };
    let recompute_bytes = MemoryPlan::for_step(&no_link, 1)?.peak_bytes();
    let mut points = Vec::new();
    for fraction in TARGETS {
        // 90% of plain at the first target, recompute's bytes at the last.
        let start = plain_bytes as f64 * 0.9;
        let target = start - fraction * (start - recompute_bytes as f64);
        let plan = MemoryPlan::for_step(step, target.max(1.0) as u64)?;
        points.push(point(&target_label(fraction), plan.choices(), Some(plan)));
    }
    // The halved point of the goal: half the blocks' own bytes.
    let saved: u64 = step.regions.iter().map(|c| c.saved_bytes).sum();
    let half = MemoryPlan::for_step(step, plain_bytes.saturating_sub(saved / 2).max(1))?;
    points.push(point(PLAN_AT_HALF, half.choices(), Some(half)));
    Ok(points)
}

/// The case's points: no plan, every block recomputed, every block offloaded, the plan at each
/// target.
fn curve(
    dev: &CudaDevice,
    case: &Case,
    link: Link,
    args: &MemoryArgs,
) -> Result<(Vec<Point>, Option<String>), Box<dyn Error>> {
    let mut run = Run::new(case, dev.device())?;
    let costs = run.profile()?;
    let (mut points, refused) = planned_points(&costs, Some(run.measure_peaks()?), link);
    for p in &mut points {
        for round in 0..args.warmup + args.samples {
            match run.step(dev, &p.choices) {
                Ok((ms, peak)) if round >= args.warmup => {
                    p.ms.push(ms);
                    p.peak = p.peak.max(peak);
                }
                Ok(_) => {}
                Err(err) => {
                    p.ms.fail(err.to_string());
                    break;
                }
            }
        }
        dev.empty_cache()?;
    }
    Ok((points, refused))
}

/// The label of the plan's point at `fraction` of [`TARGETS`].
fn target_label(fraction: f64) -> String {
    match fraction {
        0.0 => "plan at 90% of no plan's bytes".to_string(),
        1.0 => PLAN_AT_RECOMPUTE.to_string(),
        f => format!("plan {:.0}% of the way to full recomputation", 100.0 * f),
    }
}

fn point(label: &str, choices: Vec<Choice>, plan: Option<MemoryPlan>) -> Point {
    Point {
        label: label.to_string(),
        choices,
        plan,
        ms: Measured::new(),
        peak: 0,
    }
}

fn describe(case: &Case) -> String {
    let model = match &case.arch {
        Arch::Gpt(c) => format!("GPT {}x{}, {} heads", c.layers, c.width, c.heads),
        Arch::Llama(c) => format!(
            "Llama {}x{}, {} heads, {} for keys and values",
            c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads
        ),
        Arch::Mlp { width, blocks } => {
            let precision = if case.bf16 { "bf16 autocast" } else { "f32" };
            let batch = case.batch;
            return format!("MLP {blocks} x (Linear({width}) + Tanh), batch {batch}, {precision}");
        }
    };
    let precision = if case.bf16 { "bf16 autocast" } else { "f32" };
    format!("{model}, batch {} x {}, {precision}", case.batch, case.context)
}

/// `choices` as one letter each.
fn letters(choices: &[Choice]) -> String {
    choices
        .iter()
        .map(|c| match c {
            Choice::Keep => 'k',
            Choice::Offload => 'o',
            Choice::Recompute => 'r',
            Choice::Selective => 's',
            Choice::SelectiveOffload => 'x',
        })
        .collect()
}

/// Whether some plan point has a peak at or below `rival`'s and a step at or below its step;
/// `None` when either was not measured.
fn dominates(points: &[Point], rival: &str) -> Option<bool> {
    let r = points.iter().find(|p| p.label == rival)?;
    let r_ms = r.ms.median()?;
    let plans: Vec<_> = points.iter().filter(|p| p.plan.is_some()).collect();
    if plans.iter().any(|p| p.ms.median().is_none()) {
        return None;
    }
    Some(plans.iter().any(|p| p.peak <= r.peak && p.ms.median().unwrap_or(f64::MAX) <= r_ms))
}

/// Without a GPU: the plans of the smallest case at a tiny batch, from a profile on the CPU
/// (no link: keep or recompute only).
fn plans_on_the_cpu(why: &str) -> Result<(), Box<dyn Error>> {
    println!("ferry bench memory: {}", harness::without_cuda(&why, "the plans a CPU profile gives"));
    let mut case = cases().swap_remove(0);
    case.batch = 1;
    case.context = 128;
    let run = Run::new(&case, Device::Cpu)?;
    let costs = run.profile()?;
    let plain: u64 = costs.iter().map(|c| c.input_bytes + c.saved_bytes).sum();
    for fraction in [0.75, 0.5] {
        let plan = MemoryPlan::new(&costs, None, (plain as f64 * fraction) as u64)?;
        println!("\n{} at batch 1 x 128, target {:.0}% of its activations:", case.id, 100.0 * fraction);
        print!("{plan}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measured(label: &str, ms: f64, peak: u64, plan: bool) -> Point {
        let costs = [ferry::autograd::RegionCost::new(1.0, 1, 1)];
        let mut p = point(
            label,
            vec![Choice::Keep],
            plan.then(|| MemoryPlan::new(&costs, None, 2).unwrap()),
        );
        p.ms.push(ms);
        p.peak = peak;
        p
    }

    /// The MLP case on the CPU, small: its profile finds nothing a recompute frees (each block
    /// saves its input and its output, the next block's input).
    #[test]
    fn the_mlp_case_profiles_and_plans_on_the_cpu() {
        let case = Case {
            id: "mlp_small",
            arch: Arch::Mlp {
                width: 64,
                blocks: 4,
            },
            batch: 32,
            context: 1,
            bf16: false,
        };
        let run = Run::new(&case, Device::Cpu).unwrap();
        let costs = run.profile().unwrap();
        assert_eq!(costs.len(), 4);
        assert!(costs.iter().all(|c| c.saved_bytes == 0), "{costs:?}");
        assert!(!costs[0].recomputable, "the first block is fed the batch");
        let link = Link {
            to_host_bytes_per_ms: 5e7,
            to_device_bytes_per_ms: 5e7,
        };
        // The planner keeps region inputs whatever it chooses, and these blocks save nothing
        // else: it refuses, saying so, and the rivals are measured still.
        let measured = run.measure_peaks().unwrap();
        assert_eq!(measured.backward_bytes.len(), 4);
        assert!(measured.forward_bytes > 0, "{measured:?}");
        let (points, refused) = planned_points(&costs, Some(measured), link);
        let labels: Vec<&str> = points.iter().map(|p| p.label.as_str()).collect();
        assert_eq!(labels, [NO_PLAN, RECOMPUTE_ALL, OFFLOAD_ALL, SELECTIVE_ALL]);
        let why = refused.expect("the planner refuses");
        assert!(why.contains("save no tensors"), "{why}");
        assert!(run.loss().unwrap().to_vec::<f32>().unwrap()[0].is_finite());
    }

    #[test]
    fn a_rival_is_met_only_by_a_plan_point_at_or_below_it_in_both() {
        let points = [
            measured("recompute every block", 120.0, 10, false),
            measured("plan at 50%", 110.0, 12, true),
            measured("plan at 100%", 118.0, 10, true),
        ];
        assert_eq!(dominates(&points, "recompute every block"), Some(true));
        let slower = [
            measured("recompute every block", 120.0, 10, false),
            measured("plan at 50%", 110.0, 12, true),
            measured("plan at 100%", 121.0, 10, true),
        ];
        assert_eq!(dominates(&slower, "recompute every block"), Some(false));
        assert_eq!(dominates(&slower, "offload every block"), None);
    }

    #[test]
    fn the_cases_are_named_once_and_described() {
        let all = cases();
        let mut ids: Vec<&str> = all.iter().map(|c| c.id).collect();
        ids.dedup();
        assert_eq!(ids.len(), all.len());
        let llama = all.iter().find(|c| c.id == "llama_1b_b4").unwrap();
        assert_eq!(
            describe(llama),
            "Llama 19x2048, 32 heads, 4 for keys and values, batch 4 x 1024, bf16 autocast"
        );
    }

    /// The goals find their points by label: no two points of a curve share one (the halved
    /// point once shared the middle target's and was dropped).
    #[test]
    fn every_point_of_a_curve_has_its_own_label() {
        let mut labels: Vec<String> = TARGETS.iter().map(|&f| target_label(f)).collect();
        labels.extend([NO_PLAN, RECOMPUTE_ALL, OFFLOAD_ALL, PLAN_AT_HALF].map(String::from));
        let count = labels.len();
        labels.sort();
        labels.dedup();
        assert_eq!(labels.len(), count, "{labels:?}");
        assert!(labels.iter().any(|l| l == PLAN_AT_RECOMPUTE));
    }

    #[test]
    fn choices_print_one_letter_each() {
        use Choice::{Keep, Offload, Recompute};
        assert_eq!(letters(&[Keep, Offload, Recompute, Keep]), "kork");
    }
}
