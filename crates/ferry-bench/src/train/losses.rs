//! `ferry bench train --losses N`: the first N steps of the 1 B Llama on real text, ferry and
//! PyTorch from the same initial weights on the same batches, loss by loss.
//!
//! ferry draws the model, writes it with `save_pretrained` (transformers' names and
//! config.json) beside the batches (`batches.safetensors`, `i64 [steps, batch, context + 1]`:
//! windows of the bytes of Cicero's *De finibus*, book I, a token each), trains N steps
//! (bf16 autocast, AdamW at [`LARGE_LR`]) and reads each loss; then python/train.py loads the
//! directory with `LlamaForCausalLM.from_pretrained` and trains the same steps with its fused
//! AdamW. The goal (issue 40) is every loss within 1e-2 relative of PyTorch's.

use std::error::Error;
use std::path::Path;

use ferry::models::{Llama, LlamaConfig};
use ferry::nn::{Module, cross_entropy};
use ferry::optim::{AdamW, Optimizer};
use ferry::prelude::*;
use serde_json::Value;

use super::cases::{Case, LARGE_LR, Model};
use crate::harness::pytorch::PyTorch;

/// The text the batches are cut from.
const TEXT: &str = lipsum::LIBER_PRIMUS;

/// Relative gap the losses must stay within (issue 40).
pub const LOSS_GOAL: f64 = 1e-2;

/// Both sides' losses, step by step.
#[derive(Debug)]
pub struct LossCurves {
    pub ferry: Vec<f64>,
    pub pytorch: Result<Vec<f64>, String>,
}

impl LossCurves {
    /// The largest `|ferry - PyTorch| / |PyTorch|` over the steps both have, and its step.
    pub fn worst_gap(&self) -> Option<(usize, f64)> {
        let pytorch = self.pytorch.as_ref().ok()?;
        self.ferry
            .iter()
            .zip(pytorch)
            .map(|(f, p)| (f - p).abs() / p.abs().max(f64::MIN_POSITIVE))
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(&b.1))
    }
}

/// Step `step`'s batch: `batch` windows of `context + 1` consecutive bytes of the text,
/// consecutive windows over the steps, wrapping at its end.
fn windows(step: usize, batch: usize, context: usize) -> Vec<i64> {
    let text = TEXT.as_bytes();
    let span = text.len() - context - 1;
    let mut ids = Vec::with_capacity(batch * (context + 1));
    for row in 0..batch {
        let start = ((step * batch + row) * (context + 1)) % span;
        ids.extend(text[start..=start + context].iter().map(|&b| i64::from(b)));
    }
    ids
}

/// ferry's side: a Llama of `config` and the batches written to `dir`, then `steps` steps on
/// `device`.
fn ferry_losses(
    case: &Case,
    config: LlamaConfig,
    device: Device,
    steps: usize,
    dir: &Path,
) -> Result<Vec<f64>, Box<dyn Error>> {
    let (batch, context) = (case.batch, case.widths[0]);
    ferry::manual_seed(0);
    let model = Llama::new(config, device)?;
    model.save_pretrained(dir)?;
    let all: Vec<i64> = (0..steps).flat_map(|s| windows(s, batch, context)).collect();
    let batches = Tensor::from_vec(all, &[steps, batch, context + 1])?;
    ferry::checkpoint::save(dir.join("batches.safetensors"), &[("batches".into(), batches.clone())])?;
    let batches = batches.to(device)?;
    let mut opt = AdamW::new(model.parameters(), LARGE_LR)?;
    let mut losses = Vec::with_capacity(steps);
    for step in 0..steps {
        let window = batches.narrow(0, step, 1)?.reshape(&[batch, context + 1])?;
        let x = window.narrow(1, 0, context)?.contiguous()?;
        let y = window.narrow(1, 1, context)?.contiguous()?.reshape(&[batch * context])?;
        opt.zero_grad();
        let loss = ferry::amp::autocast(DType::BF16, || {
            let logits = model.forward(&x)?;
            cross_entropy(&logits.reshape(&[batch * context, logits.shape()[2]])?, &y)
        })?;
        loss.backward()?;
        opt.step()?;
        losses.push(loss.item()?);
    }
    Ok(losses)
}

/// The curves of `case` (a Llama case) over `steps` steps, the files in `dir`; PyTorch's side
/// is asked once ferry's is done and its memory given back.
pub(super) fn compare(
    case: &Case,
    device: Device,
    steps: usize,
    torch: Option<&mut PyTorch>,
    dir: &Path,
) -> Result<LossCurves, Box<dyn Error>> {
    if case.model != Model::Llama {
        return Err(format!(
            "{}: loss curves compare the Llama only (PyTorch loads its weights in transformers' \
             format)",
            case.id
        )
        .into());
    }
    let ferry = ferry_losses(case, LlamaConfig::llama_1b(), device, steps, dir)?;
    if let Device::Cuda(ordinal) = device {
        crate::harness::cuda_device(ordinal)?.empty_cache()?;
    }
    let pytorch = match torch {
        None => Err("no PyTorch side (--compare-pytorch)".to_string()),
        Some(torch) => torch
            .request(&format!("losses {} {steps} {}", case.id, dir.display()))
            .and_then(|reply| {
                let losses = reply.get("losses").and_then(Value::as_array);
                losses
                    .map(|l| l.iter().filter_map(Value::as_f64).collect())
                    .ok_or_else(|| format!("the PyTorch script answered {reply}"))
            }),
    };
    Ok(LossCurves { ferry, pytorch })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Consecutive windows of the text, each one longer than the context, wrapping.
    #[test]
    fn batches_are_consecutive_windows_of_the_text() {
        let ids = windows(0, 2, 4);
        let text: Vec<i64> = TEXT.as_bytes()[..10].iter().map(|&b| i64::from(b)).collect();
        assert_eq!(ids, text);
        assert_eq!(windows(1, 2, 4)[..5], windows(0, 4, 4)[10..15]);
        let far = windows(1_000_000, 1, 4);
        assert_eq!(far.len(), 5);
    }

    /// ferry's side on the CPU with a small Llama: what PyTorch's side loads is written, and
    /// the loss of text falls from about ln(vocabulary).
    #[test]
    fn ferry_writes_what_pytorch_loads_and_trains() {
        let dir = tempfile::tempdir().unwrap();
        let case = Case {
            widths: &[16],
            batch: 2,
            ..super::super::cases::CASES[10]
        };
        let config = LlamaConfig::new(256, 32, 64, 2, 4, 2);
        let losses = ferry_losses(&case, config, Device::Cpu, 40, dir.path()).unwrap();
        for file in ["config.json", "model.safetensors", "batches.safetensors"] {
            assert!(dir.path().join(file).exists(), "{file}");
        }
        assert_eq!(losses.len(), 40);
        assert!((losses[0] - 256f64.ln()).abs() < 0.5, "{losses:?}");
        assert!(losses[39] < losses[0] - 0.4, "{losses:?}");
        let batches = ferry::checkpoint::load(dir.path().join("batches.safetensors")).unwrap();
        assert_eq!(batches[0].1.shape(), [40, 2, 17]);
    }

    #[test]
    fn the_worst_gap_is_relative_to_pytorch() {
        let curves = LossCurves {
            ferry: vec![10.0, 5.05, 2.0],
            pytorch: Ok(vec![10.0, 5.0, 2.01]),
        };
        let (step, gap) = curves.worst_gap().unwrap();
        assert_eq!(step, 1);
        assert!((gap - 0.01).abs() < 1e-12);
        let failed = LossCurves {
            ferry: vec![1.0],
            pytorch: Err("no".into()),
        };
        assert!(failed.worst_gap().is_none());
    }
}
