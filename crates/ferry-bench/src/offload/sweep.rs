//! `ferry bench offload --sweep`: ferry's activation offload across model sizes, each case
//! judged against the link bound on its step and the share of its saved activations taken off
//! its peak (the goals in `goals`).
//!
//! First the link is timed: ferry's own copy of 1 GiB between a device buffer and a pinned
//! buffer on a copy stream, each way alone and both ways at once, median of `--samples`. Then
//! for each case (`grid`), four rows, each from an empty device cache and each
//! `--warmup` untimed steps then `--samples` timed ones (a step: forward, loss, backward, the
//! gradients cleared before it):
//!
//! - no offload: the step, device-synchronized at its end;
//! - no offload, split: the same with a synchronization between forward and backward, so each
//!   is timed alone (the bound's forward and backward);
//! - offload: the step inside an `offload_saved` scope;
//! - offload, split: that step split the same way (where offload's time goes).
//!
//! Every step also records the allocator's peak over the step's start, in the forward and in
//! the backward (host-order counters: no synchronization), and each row how far the device's
//! reserved memory grew (what the caching allocator really took from the driver: a block freed
//! while a copy still reads it is not reused until the copy ends).

use std::error::Error;
use std::sync::Arc;
use std::time::Instant;

use ferry::autograd::{OffloadOptions, OffloadStats, offload_saved};
use ferry::memory::cuda::{CudaDevice, PinnedPool};
use ferry::models::{Gpt, GptConfig};
use ferry::nn::Module;
use ferry::{DType, Device, Tensor};

use super::grid::{SweepCase, SweepOptions, VOCAB};
use super::sweep_case::{CaseRun, LinkRun, Row, RowKind, Sample};
use super::sweep_output as output;
use crate::Measured;
use crate::harness;

/// Bytes of the link copies.
const LINK_BYTES: usize = 1 << 30;

pub fn run(options: SweepOptions) -> Result<(), Box<dyn Error>> {
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
    let link = measure_link(&dev, options.samples)?;
    output::print_header(&device, &link, pinned_budget, &options);
    let offload = OffloadOptions {
        min_bytes: options.min_bytes,
    };
    let mut runs = Vec::with_capacity(options.grid.len());
    for (k, &case) in options.grid.iter().enumerate() {
        eprintln!("case {} of {}: {case} ...", k + 1, options.grid.len());
        runs.push(run_case(&dev, case, offload, &options));
        // Each case starts from empty caches: its pinned blocks and device blocks are its own.
        dev.synchronize()?;
        dev.empty_cache()?;
        PinnedPool::global()?.empty_cache()?;
    }
    let link_speed = link.speed();
    output::print_results(&runs, link_speed);
    if let Some(path) = &options.json {
        let doc = output::json(&device, pinned_budget, &options, &link, &runs);
        harness::write_json(path, &doc, "sample")?;
    }
    Ok(())
}

/// Times 1 GiB device -> pinned, pinned -> device, and both at once (two buffers each way),
/// on copy streams like offload's; one untimed round first.
fn measure_link(dev: &CudaDevice, samples: u32) -> Result<LinkRun, Box<dyn Error>> {
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

/// A case's model: its parameters (wanting gradients) and its inputs.
enum Model {
    Mlp {
        x: Tensor,
        ws: Vec<Tensor>,
    },
    Gpt {
        gpt: Box<Gpt>,
        params: Vec<Tensor>,
        ids: Tensor,
        targets: Tensor,
    },
}

/// The MLP's input batch (`batch x width`, wanting no gradient) and `layers` square weights
/// scaled by `1/sqrt(width)` that want gradients.
pub(super) fn mlp(
    layers: u64,
    width: u64,
    batch: u64,
    device: Device,
) -> ferry::Result<(Tensor, Vec<Tensor>)> {
    let (batch, width) = (batch as usize, width as usize);
    let scale = 1.0 / (width as f64).sqrt();
    let ws = (0..layers)
        .map(|_| {
            Tensor::randn(&[width, width], DType::F32, device)?
                .mul_scalar(scale)?
                .with_grad()
        })
        .collect::<ferry::Result<_>>()?;
    let x = Tensor::randn(&[batch, width], DType::F32, device)?;
    Ok((x, ws))
}

impl Model {
    fn new(case: SweepCase, device: Device) -> ferry::Result<Self> {
        match case {
            SweepCase::Mlp {
                layers,
                width,
                batch,
            } => {
                let (x, ws) = mlp(layers, width, batch, device)?;
                Ok(Model::Mlp { x, ws })
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
                let params = gpt.parameters();
                let tokens = |shape: &[usize]| -> ferry::Result<Tensor> {
                    Tensor::rand(shape, DType::F32, device)?
                        .mul_scalar(VOCAB as f64)?
                        .to_dtype(DType::I64)
                };
                let (b, t) = (batch as usize, seq as usize);
                Ok(Model::Gpt {
                    gpt: Box::new(gpt),
                    params,
                    ids: tokens(&[b, t])?,
                    targets: tokens(&[b * t])?,
                })
            }
        }
    }

    /// The forward up to a scalar loss: `sum` of the MLP's output, the GPT's mean
    /// cross-entropy over every position.
    fn loss(&self) -> ferry::Result<Tensor> {
        match self {
            Model::Mlp { x, ws } => {
                let mut h = x.clone();
                for w in ws {
                    h = h.matmul(w)?.tanh()?;
                }
                h.sum()
            }
            Model::Gpt {
                gpt, ids, targets, ..
            } => {
                let logits = gpt.forward(ids)?;
                let rows = targets.shape()[0];
                let flat = logits.reshape(&[rows, VOCAB as usize])?;
                ferry::nn::cross_entropy(&flat, targets)
            }
        }
    }

    fn parameters(&self) -> &[Tensor] {
        match self {
            Model::Mlp { ws, .. } => ws,
            Model::Gpt { params, .. } => params,
        }
    }

    /// Bytes the caller holds whatever offload does: parameters and inputs, each buffer once.
    /// Rules save some of them (most weights, the MLP's input); offload leaves those in place.
    fn caller_bytes(&self) -> u64 {
        let inputs: Vec<&Tensor> = match self {
            Model::Mlp { x, .. } => vec![x],
            Model::Gpt { ids, targets, .. } => vec![ids, targets],
        };
        let mut seen = Vec::new();
        let mut bytes = 0;
        for t in self.parameters().iter().chain(inputs) {
            let key = Arc::as_ptr(t.storage()) as usize;
            if !seen.contains(&key) {
                seen.push(key);
                bytes += t.storage().bytes() as u64;
            }
        }
        bytes
    }

    fn clear_grads(&self) {
        for p in self.parameters() {
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
    options: &SweepOptions,
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
    options: &SweepOptions,
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
fn step(
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
    use super::*;

    #[test]
    fn the_callers_bytes_are_the_weights_and_input_each_once() {
        let case = SweepCase::Mlp {
            layers: 3,
            width: 8,
            batch: 5,
        };
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
        let case = SweepCase::Gpt {
            blocks: 1,
            width: 64,
            batch: 2,
            seq: 4,
        };
        let model = Model::new(case, Device::Cpu).unwrap();
        let params = model.parameters().len();
        assert!(params > 10, "{params} parameters");
        let loss = model.loss().unwrap();
        assert_eq!(loss.shape(), &[] as &[usize]);
        loss.backward().unwrap();
        assert!(model.parameters().iter().all(|p| p.grad().is_some()));
        model.clear_grads();
        assert!(model.parameters().iter().all(|p| p.grad().is_none()));
    }
}
