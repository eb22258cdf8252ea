//! `ferry bench offload --sweep`: activation offload across model sizes, each case judged
//! against the link bound on its step and the share of its saved activations taken off its
//! peak (`summary`). The link is timed first: ferry's copy of 1 GiB between a device and a
//! pinned buffer on a copy stream, each way alone and both at once. Then each case runs four
//! rows (`RowKind`), each from an empty device cache, `--warmup` untimed steps then `--samples`
//! timed ones; a split row synchronizes after the forward to time each phase alone. Every step
//! records the allocator's peak in each phase, and each row how far reserved memory grew.

use std::error::Error;
use std::sync::Arc;
use std::time::Instant;

use ferry::autograd::{OffloadOptions, OffloadStats, offload_saved};
use ferry::memory::cuda::{CudaDevice, PinnedPool};
use ferry::models::{Gpt, GptConfig};
use ferry::nn::Module;
use ferry::{DType, Device, Tensor};
use serde_json::{Map, Value, json};

use super::grid::{SweepCase, VOCAB};
use super::summary::{CaseRun, LinkRun, PEAK_GOAL, Row, RowKind, STEP_GOAL, Sample, Summary};
use super::{OffloadArgs, stats_json, stats_note};
use crate::harness::measure::Measured;
use crate::harness::report::significant;
use crate::harness::table::{Cell, Report, Table, gib};
use crate::harness::{self};

/// Bytes of the link copies.
const LINK_BYTES: usize = 1 << 30;

pub fn run(args: &OffloadArgs, grid: &[SweepCase]) -> Result<(), Box<dyn Error>> {
    let Some(dev) = harness::cuda_device_or_say(0, |err| {
        format!(
            "ferry bench offload --sweep needs a CUDA device (it times copies to pinned host \
             memory and measures device memory): {err}"
        )
    }) else {
        return Ok(());
    };
    let device = format!("{} ({})", dev.device(), dev.info().name);
    let pinned_budget = PinnedPool::global()?.budget() as u64;
    eprintln!("timing the link ({} GiB each way) ...", LINK_BYTES >> 30);
    let link = measure_link(&dev, args.samples)?;
    let offload = OffloadOptions {
        min_bytes: args.min_bytes,
    };
    let mut runs = Vec::with_capacity(grid.len());
    for (k, &case) in grid.iter().enumerate() {
        eprintln!("case {} of {}: {case} ...", k + 1, grid.len());
        runs.push(run_case(&dev, case, offload, args));
        // Each case starts from empty caches: its pinned blocks and device blocks are its own.
        dev.synchronize()?;
        dev.empty_cache()?;
        PinnedPool::global()?.empty_cache()?;
    }
    report(&device, pinned_budget, args, &link, &runs).finish(args.json.as_deref())
}

/// GiB with three significant digits, "-" when absent; recorded in bytes.
fn gib_cell(bytes: Option<u64>) -> Cell {
    Cell::shown(bytes.map(gib), significant).recorded(json!(bytes))
}

/// The header, both tables, each case's offload counters and errors, and the goals' tally.
fn report(
    device: &str,
    pinned_budget: u64,
    args: &OffloadArgs,
    link: &LinkRun,
    runs: &[CaseRun],
) -> Report {
    let speed = link.speed();
    let shown = |x: Option<f64>| x.map_or("-".into(), significant);
    let title = format!(
        "ferry bench offload --sweep on {device}: f32; a step = forward, loss, backward \
         (gradients cleared before it); min_bytes {}\n\
         link ({} GiB, ferry's copy on a copy stream, median of {}): D2H {} GB/s, H2D {} GB/s, \
         both at once {} GB/s (the two directions' sum); pinned budget {} GiB\n\
         each case: 4 rows (no offload; the same split by a sync after the forward; offload; \
         offload split), each from an empty device cache: {} warm-up + {} timed steps, medians",
        args.min_bytes,
        link.bytes >> 30,
        args.samples,
        shown(speed.map(|l| l.d2h_gb_s())),
        shown(speed.map(|l| l.h2d_gb_s())),
        shown(link.both_gb_s()),
        significant(gib(pinned_budget)),
        args.warmup,
        args.samples,
    );
    let mut report = Report::new("offload --sweep", title).with_facts(json!({
        "device": device,
        "pinned_budget_bytes": pinned_budget,
        "samples": args.samples,
        "warmup": args.warmup,
        "min_bytes": args.min_bytes,
        "link": {
            "bytes": link.bytes,
            "d2h_ms": link.d2h.samples_ms,
            "h2d_ms": link.h2d.samples_ms,
            "both_ms": link.both.samples_ms,
            "d2h_gb_s": speed.map(|l| l.d2h_gb_s()),
            "h2d_gb_s": speed.map(|l| l.h2d_gb_s()),
            "both_gb_s": link.both_gb_s(),
            "error": link.d2h.error.as_ref().or(link.h2d.error.as_ref()),
        },
    }));
    let summaries: Vec<Summary> = runs.iter().map(|r| Summary::of(r, speed)).collect();
    let (time, memory) = tables(runs, &summaries);
    report.table(
        "cases",
        Some(
            "time, ms: bound = max(fwd, out) + max(bwd, back), out/back = moved bytes over \
             D2H/H2D; fwd, bwd from the split row without offload"
                .into(),
        ),
        time,
    );
    report.table(
        "memory",
        Some(
            "memory, GiB: act = saved activations (moved, read in place or over the pinned \
             budget); peaks allocated over the step's start (max of the samples; fwd / bwd: in \
             each phase); drop % act = (peak - peak with offload) / act; reserved = growth of \
             the device's reserved memory over the row"
                .into(),
        ),
        memory,
    );
    for r in runs {
        if let Some(s) = r.row(RowKind::Offload).stats {
            report.note(format!("{}: {}", r.case, stats_note(&s)));
        }
        if let Some(e) = &r.error {
            report.note(format!("{}: {e}", r.case));
        }
        for kind in RowKind::ALL {
            if let Some(e) = r.row(kind).error() {
                report.note(format!("{} {}: {e}", r.case, kind.id()));
            }
        }
    }
    let tally = |met: fn(&Summary) -> Option<bool>| {
        let judged: Vec<bool> = summaries.iter().filter_map(met).collect();
        let passed = judged.iter().filter(|&&m| m).count();
        format!("{passed} of {} judged", judged.len())
    };
    report.note(format!(
        "goals: step <= {}x its bound in {}; peak lower by >= {}% of the saved activations in \
         {} ({} cases)",
        STEP_GOAL.bound.value(),
        tally(|s| s.step_met),
        100.0 * PEAK_GOAL.bound.value(),
        tally(|s| s.peak_met),
        runs.len(),
    ));
    report
}

/// The time table (with every sample of the case in its JSON row) and the memory table.
fn tables(runs: &[CaseRun], summaries: &[Summary]) -> (Table, Table) {
    let mut time = Table::new(&[
        "case", "step", "fwd", "bwd", "moved GiB", "out", "back", "bound", "offload", "/bound",
        "off fwd", "off bwd", "<=1.15x",
    ]);
    let mut memory = Table::new(&[
        "case", "act", "peak", "fwd", "bwd", "offload", "off fwd", "off bwd", "drop % act",
        ">=60%", "reserved", "off reserved",
    ]);
    for (r, s) in runs.iter().zip(summaries) {
        let ms = Cell::number;
        let bound = |part: fn(super::summary::Bound) -> f64| ms(s.bound.map(part));
        let link_bound = s
            .bound
            .zip(s.forward_ms.zip(s.backward_ms))
            .map(|(b, (f, bw))| b.link_bound(f, bw));
        let rows: Map<String, Value> = RowKind::ALL
            .iter()
            .map(|&k| (k.id().to_string(), row_json(r.row(k))))
            .collect();
        time.push_with(
            vec![
                Cell::text(r.case.to_string()),
                ms(s.step_ms),
                ms(s.forward_ms),
                ms(s.backward_ms),
                gib_cell(s.moved_bytes),
                bound(|b| b.out_ms),
                bound(|b| b.back_ms),
                bound(|b| b.ms),
                ms(s.offload_ms),
                Cell::shown(s.step_over_bound, |x| format!("{}x", significant(x))),
                ms(s.offload_forward_ms),
                ms(s.offload_backward_ms),
                Cell::verdict(STEP_GOAL.verdict(s.step_over_bound)),
            ],
            json!({
                "heads": r.case.heads(),
                "mlp_activation_bytes": r.case.mlp_activation_bytes(),
                "caller_bytes": r.caller_bytes,
                "saved_bytes_less_caller": r.row(RowKind::NoOffload).saved_bytes
                    .map(|s| s.saturating_sub(r.caller_bytes)),
                "link_bound": link_bound,
                "error": r.error,
                "rows": rows,
            }),
        );
        let peaks = |kind: RowKind| r.row(kind).phase_peaks().unzip();
        let ((nf, nb), (of, ob)) = (peaks(RowKind::NoOffload), peaks(RowKind::Offload));
        let reserved = |kind: RowKind| gib_cell(r.row(kind).reserved_growth_bytes);
        memory.push(vec![
            Cell::text(r.case.to_string()),
            gib_cell(s.activation_bytes),
            gib_cell(s.peak_without),
            gib_cell(nf),
            gib_cell(nb),
            gib_cell(s.peak_with),
            gib_cell(of),
            gib_cell(ob),
            Cell::shown(s.reduction, |x| format!("{}%", significant(100.0 * x))),
            Cell::verdict(PEAK_GOAL.verdict(s.reduction)),
            reserved(RowKind::NoOffload),
            reserved(RowKind::Offload),
        ]);
    }
    (time, memory)
}

/// A row's samples, counters and error.
fn row_json(row: &Row) -> Value {
    json!({
        "step_ms": row.step.samples_ms,
        "step_ms_median": row.step.complete_median(),
        "forward_ms": row.forward.samples_ms,
        "backward_ms": row.backward.samples_ms,
        "peak_forward_bytes": row.peak_forward,
        "peak_backward_bytes": row.peak_backward,
        "saved_bytes": row.saved_bytes,
        "reserved_growth_bytes": row.reserved_growth_bytes,
        "offload": row.stats.as_ref().map(stats_json),
        "error": row.error(),
    })
}

/// Times 1 GiB device -> pinned, pinned -> device, and both at once (two buffers each way),
/// on copy streams like offload's; one untimed round first.
pub(crate) fn measure_link(
    dev: &CudaDevice,
    samples: u32,
) -> Result<LinkRun, Box<dyn Error>> {
    let pool = PinnedPool::global()?;
    let (out_stream, in_stream) = (dev.new_stream()?, dev.new_stream()?);
    let home = dev.default_stream();
    let src = dev.alloc_zeroed(LINK_BYTES, home)?;
    let mut dst = dev.alloc_zeroed(LINK_BYTES, home)?;
    let mut landing = pool.alloc(LINK_BYTES)?;
    let mut source = pool.alloc(LINK_BYTES)?;
    let mut run = LinkRun {
        bytes: LINK_BYTES as u64,
        d2h: Measured::new(),
        h2d: Measured::new(),
        both: Measured::new(),
    };
    for round in 0..=samples {
        dev.synchronize()?;
        let started = Instant::now();
        src.copy_to_pinned_async(&mut landing, &out_stream)?;
        landing.wait()?;
        let d2h = ms_since(started);
        dev.synchronize()?;
        let started = Instant::now();
        dst.copy_from_pinned_async(&mut source, &in_stream)?;
        in_stream.synchronize()?;
        let h2d = ms_since(started);
        dev.synchronize()?;
        let started = Instant::now();
        src.copy_to_pinned_async(&mut landing, &out_stream)?;
        dst.copy_from_pinned_async(&mut source, &in_stream)?;
        landing.wait()?;
        in_stream.synchronize()?;
        let both = ms_since(started);
        if round > 0 {
            run.d2h.push(d2h);
            run.h2d.push(h2d);
            run.both.push(both);
        }
    }
    drop((landing, source));
    pool.empty_cache()?;
    Ok(run)
}

fn ms_since(started: Instant) -> f64 {
    started.elapsed().as_secs_f64() * 1e3
}

/// A case's model: its parameters (wanting gradients), its inputs, and the GPT, if it is one.
pub(super) struct Model {
    params: Vec<Tensor>,
    inputs: Vec<Tensor>,
    gpt: Option<Box<Gpt>>,
}

impl Model {
    pub(super) fn new(case: SweepCase, device: Device) -> ferry::Result<Self> {
        match case {
            SweepCase::Mlp {
                layers,
                width,
                batch,
            } => {
                // Square weights scaled by 1/sqrt(width) that want gradients; an input that
                // does not.
                let (batch, width) = (batch as usize, width as usize);
                let scale = 1.0 / (width as f64).sqrt();
                let params = (0..layers)
                    .map(|_| {
                        Tensor::randn(&[width, width], DType::F32, device)?
                            .mul_scalar(scale)?
                            .with_grad()
                    })
                    .collect::<ferry::Result<_>>()?;
                let x = Tensor::randn(&[batch, width], DType::F32, device)?;
                Ok(Model { params, inputs: vec![x], gpt: None })
            }
            SweepCase::Gpt {
                blocks,
                width,
                batch,
                seq,
            } => {
                let config = GptConfig {
                    vocab: VOCAB as usize,
                    context: seq as usize,
                    width: width as usize,
                    layers: blocks as usize,
                    heads: case.heads().unwrap_or(1) as usize,
                };
                let gpt = Gpt::new(config, device)?;
                let tokens = |shape: &[usize]| -> ferry::Result<Tensor> {
                    Tensor::rand(shape, DType::F32, device)?
                        .mul_scalar(VOCAB as f64)?
                        .to_dtype(DType::I64)
                };
                let (b, t) = (batch as usize, seq as usize);
                Ok(Model {
                    params: gpt.parameters(),
                    inputs: vec![tokens(&[b, t])?, tokens(&[b * t])?],
                    gpt: Some(Box::new(gpt)),
                })
            }
        }
    }

    /// The forward up to a scalar loss: `sum` of the MLP's output, the GPT's mean
    /// cross-entropy over every position.
    fn loss(&self) -> ferry::Result<Tensor> {
        let Some(gpt) = &self.gpt else {
            let mut h = self.inputs[0].clone();
            for w in &self.params {
                h = h.matmul(w)?.tanh()?;
            }
            return h.sum();
        };
        let (ids, targets) = (&self.inputs[0], &self.inputs[1]);
        let logits = gpt.forward(ids)?;
        let flat = logits.reshape(&[targets.shape()[0], VOCAB as usize])?;
        ferry::nn::cross_entropy(&flat, targets)
    }

    /// Bytes the caller holds whatever offload does: parameters and inputs, each buffer once.
    /// Rules save some of them (most weights, the MLP's input); offload leaves those in place.
    fn caller_bytes(&self) -> u64 {
        let mut seen = Vec::new();
        let mut bytes = 0;
        for t in self.params.iter().chain(&self.inputs) {
            let key = Arc::as_ptr(t.storage()) as usize;
            if !seen.contains(&key) {
                seen.push(key);
                bytes += t.storage().bytes() as u64;
            }
        }
        bytes
    }

    fn clear_grads(&self) {
        for p in &self.params {
            p.set_grad(None);
        }
    }
}

/// Runs a case's four rows; errors end the row they happen in (or the case, if the model
/// cannot be made) and are kept beside its numbers.
fn run_case(
    dev: &CudaDevice,
    case: SweepCase,
    offload: OffloadOptions,
    options: &OffloadArgs,
) -> CaseRun {
    let mut run = CaseRun::new(case);
    let model = match Model::new(case, dev.device()).and_then(|m| {
        dev.synchronize()?;
        Ok(m)
    }) {
        Ok(model) => model,
        Err(err) => {
            run.error = Some(err.to_string());
            return run;
        }
    };
    run.caller_bytes = model.caller_bytes();
    for kind in RowKind::ALL {
        let row = run.row_mut(kind);
        if let Err(err) = run_row(dev, &model, kind, offload, options, row) {
            row.fail(err.to_string());
        }
    }
    run
}

fn run_row(
    dev: &CudaDevice,
    model: &Model,
    kind: RowKind,
    offload: OffloadOptions,
    options: &OffloadArgs,
    row: &mut Row,
) -> Result<(), Box<dyn Error>> {
    dev.synchronize()?;
    dev.empty_cache()?;
    let reserved_before = dev.memory_stats().reserved_bytes;
    let scope = kind.offloads().then_some(offload);
    for round in 0..options.warmup + options.samples {
        let sample = step(dev, model, scope, kind.split())?;
        if round >= options.warmup {
            row.push(sample);
        }
    }
    let reserved = dev.memory_stats().reserved_bytes;
    row.reserved_growth_bytes = Some(reserved.saturating_sub(reserved_before) as u64);
    Ok(())
}

/// One step; with `split`, the device is synchronized after the forward too, so forward and
/// backward are timed alone.
pub(super) fn step(
    dev: &CudaDevice,
    model: &Model,
    offload: Option<OffloadOptions>,
    split: bool,
) -> ferry::Result<Sample> {
    model.clear_grads();
    dev.synchronize()?;
    let base = dev.memory_stats().allocated_bytes;
    // The bench owns this process's statistics: resetting the peak is its to do.
    dev.reset_peak();
    let started = Instant::now();
    let scope = offload.map(offload_saved);
    let loss = model.loss()?;
    let saved_bytes = loss.graph().map_or(0, |g| g.saved_bytes()) as u64;
    let peak_forward = peak_over(dev, base);
    let forward_ms = if split {
        dev.synchronize()?;
        Some(ms_since(started))
    } else {
        None
    };
    dev.reset_peak();
    let backward_started = Instant::now();
    loss.backward()?;
    drop(loss);
    dev.synchronize()?;
    let ms = ms_since(started);
    let backward_ms = split.then(|| ms_since(backward_started));
    let peak_backward = peak_over(dev, base);
    let stats: Option<OffloadStats> = scope.as_ref().map(|s| s.stats());
    drop(scope);
    Ok(Sample {
        ms,
        forward_ms,
        backward_ms,
        peak_forward,
        peak_backward,
        saved_bytes,
        stats,
    })
}

/// The allocator's peak since the last reset, over `base`.
fn peak_over(dev: &CudaDevice, base: usize) -> u64 {
    dev.memory_stats().peak_allocated_bytes.saturating_sub(base) as u64
}

#[cfg(test)]
mod tests {
    use super::super::summary::Link;
    use super::*;

    #[test]
    fn the_callers_bytes_are_the_weights_and_input_each_once() {
        let case = SweepCase::mlp(3, 8, 5);
        let model = Model::new(case, Device::Cpu).unwrap();
        // Three 8x8 f32 weights and a 5x8 input, as `ferry bench offload`'s caller_bytes.
        assert_eq!(model.caller_bytes(), 4 * (3 * 64 + 40));
        // The graph saves the input, one tanh output per layer and every weight but the
        // first (its matmul's input wants no gradient), so the saved bytes less the caller's
        // miss the activations by that weight: why the sweep counts activations from the
        // offload scope instead.
        let loss = model.loss().unwrap();
        let saved = loss.graph().unwrap().saved_bytes() as u64;
        assert_eq!(
            saved - model.caller_bytes() + 4 * 64,
            case.mlp_activation_bytes().unwrap()
        );
    }

    #[test]
    fn a_small_gpt_case_steps_on_the_cpu_and_its_parameters_get_gradients() {
        let case = SweepCase::gpt(1, 64, 2, 4);
        let model = Model::new(case, Device::Cpu).unwrap();
        let params = model.params.len();
        assert!(params > 10, "{params} parameters");
        let loss = model.loss().unwrap();
        assert_eq!(loss.shape(), &[] as &[usize]);
        loss.backward().unwrap();
        assert!(model.params.iter().all(|p| p.grad().is_some()));
        model.clear_grads();
        assert!(model.params.iter().all(|p| p.grad().is_none()));
    }

    #[test]
    fn a_failed_row_keeps_its_samples_beside_its_error_in_the_json() {
        let mut run = CaseRun::new(SweepCase::mlp(2, 64, 8));
        for kind in RowKind::ALL {
            for ms in [3.0, 1.0] {
                run.row_mut(kind).push(Sample {
                    ms,
                    forward_ms: kind.split().then_some(ms / 3.0),
                    backward_ms: kind.split().then_some(2.0 * ms / 3.0),
                    peak_forward: 100,
                    peak_backward: 200,
                    saved_bytes: 300,
                    stats: kind.offloads().then(OffloadStats::default),
                });
            }
        }
        run.row_mut(RowKind::Offload)
            .fail("CUDA out of memory".into());
        let summary = Summary::of(&run, Some(Link::from_copies(1, 1.0, 1.0)));
        let (time, memory) = tables(&[run], &[summary]);
        let (doc, peaks) = (&time.json()[0], &memory.json()[0]);
        assert_eq!(doc["case"], "2x64@8");
        let offload = &doc["rows"]["offload"];
        assert_eq!(offload["error"], "CUDA out of memory");
        assert_eq!(offload["step_ms"], json!([3.0, 1.0]));
        assert_eq!(offload["step_ms_median"], Value::Null);
        assert_eq!(
            doc["rows"]["no_offload_split"]["forward_ms"],
            json!([1.0, 1.0 / 3.0])
        );
        assert_eq!(doc["step"], 2.0);
        assert_eq!(doc["1_15x"], Value::Null);
        assert_eq!(peaks["peak"], 200);
        assert_eq!(time.texts()[0][12], "?");
        assert_eq!(memory.texts()[0][5..8], ["-", "-", "-"]);
    }
}
