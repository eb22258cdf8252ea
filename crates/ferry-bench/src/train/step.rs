//! ferry's side of a case: its model, optimizer and batch made before any clock starts, rounds
//! of steps timed, and one step split into its phases.

use std::error::Error;
use std::time::Instant;

use ferry::memory::cuda::CudaDevice;
use ferry::nn::{Module, cross_entropy};
use ferry::optim::{Adam, AdamW};
use ferry::prelude::*;

use super::cases::{CLASSES, Case, LARGE_LR, LR, Model, Optimizer, Phase, Precision};

/// What one of ferry's steps runs.
enum Work {
    /// A training step of `model` on the batch `(x, y)`.
    Train {
        model: Box<dyn Module>,
        opt: Box<dyn ferry::optim::Optimizer>,
        x: Tensor,
        y: Tensor,
        precision: Precision,
    },
    /// The matrix products of an MLP step: `(left, right, transpose_left)` for each.
    Gemms(Vec<(Tensor, Tensor, bool)>),
}

/// ferry's side of a case: model, optimizer and batch, made before any clock starts.
pub(crate) struct FerryRun {
    work: Work,
    /// The last step's loss, detached, still on the device.
    pub(super) loss: Option<Tensor>,
    pub(crate) cuda: Option<CudaDevice>,
    /// The model's parameters, all of them counted.
    pub(crate) parameters: usize,
}

/// The eight products of an MLP step with `widths` and `batch`: for each layer (fan_in ->
/// fan_out) forward `a · Wᵀ`, backward `gᵀ · a` (the weight gradient) and, past the first
/// layer, `g · W` (the input gradient). Operands are standard normal; only their shapes matter.
fn mlp_gemms(
    widths: &[usize],
    batch: usize,
    device: Device,
) -> ferry::Result<Vec<(Tensor, Tensor, bool)>> {
    let randn = |shape: &[usize]| Tensor::randn(shape, DType::F32, device);
    let mut products = Vec::new();
    for (layer, pair) in widths.windows(2).enumerate() {
        let (fan_in, fan_out) = (pair[0], pair[1]);
        let activation = randn(&[batch, fan_in])?;
        let weight = randn(&[fan_out, fan_in])?;
        let grad = randn(&[batch, fan_out])?;
        products.push((activation.clone(), weight.t()?, false));
        products.push((grad.clone(), activation, true));
        if layer > 0 {
            products.push((grad, weight, false));
        }
    }
    Ok(products)
}

impl FerryRun {
    pub(crate) fn new(case: &Case, device: Device) -> Result<Self, Box<dyn Error>> {
        let (widths, batch) = (case.widths, case.batch);
        let cuda = match device {
            Device::Cuda(ordinal) => Some(crate::harness::cuda_device(ordinal)?),
            Device::Cpu => None,
        };
        ferry::manual_seed(0);
        let labels = |shape: &[usize], classes: usize| -> ferry::Result<Tensor> {
            Tensor::rand(shape, DType::F32, device)?
                .mul_scalar(classes as f64)?
                .to_dtype(DType::I64)
        };
        let (model, x, y): (Box<dyn Module>, Tensor, Tensor) = match case.model {
            Model::MlpGemms => {
                let run = Self {
                    work: Work::Gemms(mlp_gemms(widths, batch, device)?),
                    loss: None,
                    cuda,
                    parameters: 0,
                };
                run.synchronize()?;
                return Ok(run);
            }
            Model::Mlp => {
                let model = ferry::models::mlp(widths, 0.0, device)?;
                let x = Tensor::randn(&[batch, widths[0]], DType::F32, device)?;
                (Box::new(model), x, labels(&[batch], CLASSES)?)
            }
            Model::DigitsCnn => {
                let x = Tensor::randn(&[batch, widths[0]], DType::F32, device)?;
                let model = ferry::models::digits_cnn(device, 0.0)?;
                (Box::new(model), x, labels(&[batch], widths[1])?)
            }
            Model::Gpt => {
                let (context, vocab) = (widths[0], widths[1]);
                let config = ferry::models::GptConfig {
                    vocab,
                    context,
                    width: 128,
                    layers: 4,
                    heads: 4,
                };
                let model = ferry::models::Gpt::new(config, device)?;
                let x = labels(&[batch, context], vocab)?;
                (Box::new(model), x, labels(&[batch * context], vocab)?)
            }
            Model::LargeGpt => {
                let [context, vocab, width, layers] = widths else {
                    return Err(format!("{}: a large GPT's widths are 4 numbers", case.id).into());
                };
                let config = ferry::models::GptConfig {
                    vocab: *vocab,
                    context: *context,
                    width: *width,
                    layers: *layers,
                    heads: width / 128,
                };
                let model = ferry::models::Gpt::new(config, device)?;
                let x = labels(&[batch, *context], *vocab)?;
                (Box::new(model), x, labels(&[batch * context], *vocab)?)
            }
            Model::Llama => {
                let config = ferry::models::LlamaConfig::llama_1b();
                let (context, vocab) = (widths[0], config.vocab_size);
                let model = ferry::models::Llama::new(config, device)?;
                let x = labels(&[batch, context], vocab)?;
                (Box::new(model), x, labels(&[batch * context], vocab)?)
            }
        };
        let parameters = model.parameters().iter().map(Tensor::numel).sum();
        let opt: Box<dyn ferry::optim::Optimizer> = match case.optimizer {
            Optimizer::Adam => Box::new(Adam::new(model.parameters(), LR)?),
            Optimizer::AdamW => Box::new(AdamW::new(model.parameters(), LARGE_LR)?),
        };
        let run = Self {
            work: Work::Train {
                model,
                opt,
                x,
                y,
                precision: case.precision,
            },
            loss: None,
            cuda,
            parameters,
        };
        run.synchronize()?;
        Ok(run)
    }

    pub(crate) fn synchronize(&self) -> Result<(), Box<dyn Error>> {
        match &self.cuda {
            Some(dev) => Ok(dev.synchronize()?),
            None => Ok(()),
        }
    }

    fn step(&mut self) -> ferry::Result<()> {
        self.step_marked(&mut |_| Ok(()))
    }

    /// A step that calls `mark` after each of its phases ([`PHASES`]; a GEMM-only case marks
    /// nothing).
    pub(crate) fn step_marked(
        &mut self,
        mark: &mut dyn FnMut(Phase) -> ferry::Result<()>,
    ) -> ferry::Result<()> {
        let (model, opt, x, y, precision) = match &mut self.work {
            Work::Gemms(products) => {
                let _no_grad = ferry::no_grad();
                for (left, right, transpose_left) in products.iter() {
                    let left = if *transpose_left {
                        left.t()?
                    } else {
                        left.clone()
                    };
                    left.matmul(right)?;
                }
                return Ok(());
            }
            Work::Train {
                model,
                opt,
                x,
                y,
                precision,
            } => (model, opt, x, y, *precision),
        };
        opt.zero_grad();
        mark(Phase::ZeroGrad)?;
        let mut forward = || {
            let logits = model.forward(x)?;
            mark(Phase::Forward)?;
            // The GPT's logits are [batch, context, vocabulary]: one prediction per position.
            let rows = y.numel();
            cross_entropy(&logits.reshape(&[rows, logits.numel() / rows])?, y)
        };
        let loss = match precision {
            Precision::F32 => forward()?,
            Precision::Bf16Autocast => ferry::amp::autocast(DType::BF16, forward)?,
        };
        mark(Phase::Loss)?;
        loss.backward()?;
        mark(Phase::Backward)?;
        opt.step()?;
        mark(Phase::Optimizer)?;
        self.loss = Some(loss.detach());
        Ok(())
    }

    /// One round: mean milliseconds per step over `steps` steps, device synchronized both ends.
    pub(crate) fn round_ms_per_step(&mut self, steps: u32) -> Result<f64, Box<dyn Error>> {
        self.synchronize()?;
        let start = Instant::now();
        for _ in 0..steps {
            self.step()?;
        }
        self.synchronize()?;
        Ok(start.elapsed().as_secs_f64() * 1e3 / f64::from(steps))
    }
}

#[cfg(test)]
mod tests {
    use super::super::cases::TINY;
    use super::*;

    /// The timed step really trains: Adam brings a fixed batch's loss down.
    #[test]
    fn ferry_steps_lower_the_loss_on_the_cpu() {
        let mut run = FerryRun::new(&TINY, Device::Cpu).unwrap();
        let Work::Train { y, .. } = &run.work else {
            unreachable!("an MLP case trains")
        };
        assert_eq!(y.dtype(), DType::I64);
        let labels: Vec<i64> = y.to_vec().unwrap();
        assert!(labels.iter().all(|l| (0..CLASSES as i64).contains(l)));
        run.step().unwrap();
        let first = run.loss.as_ref().unwrap().item().unwrap();
        let ms = run.round_ms_per_step(200).unwrap();
        let last = run.loss.as_ref().unwrap().item().unwrap();
        assert!(ms > 0.0 && ms.is_finite());
        assert!(last < first - 0.1, "loss {first} -> {last}");
        let Work::Train { opt, .. } = &run.work else {
            unreachable!("an MLP case trains")
        };
        assert_eq!(opt.steps(), 201);
    }

    /// An MLP step has three products per layer but the first (whose input needs no
    /// gradient), shaped as the layer's forward and backward are.
    #[test]
    fn the_gemm_floor_has_the_step_s_products() {
        let products = mlp_gemms(&[1024, 4096, 4096, 10], 8, Device::Cpu).unwrap();
        assert_eq!(products.len(), 8);
        let shapes: Vec<(Vec<usize>, Vec<usize>)> = products
            .iter()
            .map(|(l, r, t)| {
                let l = if *t { l.t().unwrap() } else { l.clone() };
                (l.shape().to_vec(), r.shape().to_vec())
            })
            .collect();
        assert_eq!(shapes[0], (vec![8, 1024], vec![1024, 4096]));
        assert_eq!(shapes[1], (vec![4096, 8], vec![8, 1024]));
        assert_eq!(shapes[3], (vec![4096, 8], vec![8, 4096]));
        assert_eq!(shapes[4], (vec![8, 4096], vec![4096, 4096]));
        assert_eq!(shapes[7], (vec![8, 10], vec![10, 4096]));
        let mut run = FerryRun::new(
            &Case {
                id: "gemms",
                model: Model::MlpGemms,
                widths: &[8, 16, CLASSES],
                ..TINY
            },
            Device::Cpu,
        )
        .unwrap();
        assert!(run.round_ms_per_step(3).unwrap() > 0.0);
        assert!(run.loss.is_none());
    }

    /// A bf16 autocast step trains as well (on the CPU too).
    #[test]
    fn bf16_autocast_steps_lower_the_loss() {
        let case = Case {
            precision: Precision::Bf16Autocast,
            ..TINY
        };
        let mut run = FerryRun::new(&case, Device::Cpu).unwrap();
        run.step().unwrap();
        let first = run.loss.as_ref().unwrap().item().unwrap();
        run.round_ms_per_step(100).unwrap();
        let last = run.loss.as_ref().unwrap().item().unwrap();
        assert!(last < first - 0.1, "loss {first} -> {last}");
    }
}
