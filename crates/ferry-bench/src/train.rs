//! `ferry bench train`: training steps of two MLPs, the digits CNN and the character-level GPT,
//! ferry and PyTorch side by side in one run.
//!
//! A step is zero_grad, forward, cross-entropy, backward and an Adam (lr 1e-3) step, the same on
//! both sides; PyTorch's is python/train.py, eager with TF32 off. A round synchronizes the device,
//! runs many steps, synchronizes again and gives the mean time per step; rounds alternate ferry
//! then PyTorch, and the table shows medians. No loss is read inside a round (`item()` would
//! synchronize every step); it stays on the device until the rounds are over.
//!
//! The `_bf16` cases run the same step with forward and loss inside a bf16 autocast scope
//! (fp32 master weights; PyTorch's `torch.autocast("cuda", torch.bfloat16)`). `mlp_4096_gemms`
//! is no training step: it times only the eight fp32 matrix products of `mlp_4096`'s step
//! (three forward, five backward), with nothing recorded, on each side. It is the floor that
//! both frameworks' steps stand on (the same cuBLAS kernels), so it says how much of a step is
//! left to win.
//!
//! `ferry train`'s step also counts correct predictions (argmax, compare, sum), which
//! PyTorch's step would not do, so the step timed here is its loss-only core.

use std::error::Error;
use std::path::PathBuf;
use std::time::Instant;

use super::pytorch::{self, PyTorch, PyTorchArgs};
use super::report::Target;
use super::train_output::{CaseResult, RunSetup, print_header, print_results, to_json};
use super::train_profile;
use crate::Measured;
use clap::Args;
use ferry::memory::cuda::CudaDevice;
use ferry::nn::{Module, cross_entropy};
use ferry::optim::Adam;
use ferry::prelude::*;

pub const LR: f64 = 1e-3;
const CLASSES: usize = 10;

/// Which model a case trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Model {
    /// Linear layers between neighbouring `widths`, ReLU between them.
    Mlp,
    /// `ferry train digits-cnn`'s CNN (without dropout); `widths` = [features, classes].
    DigitsCnn,
    /// `ferry train gpt`'s character-level GPT (4 blocks of width 128, 4 heads); `widths` =
    /// [context, vocabulary].
    Gpt,
    /// Only the matrix products of an MLP step with these `widths` (no autograd, no optimizer).
    MlpGemms,
}

/// The precision a case computes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    F32,
    /// Forward and loss inside a bf16 autocast scope, weights and optimizer in f32.
    Bf16Autocast,
}

/// A model and batch to time; python/train.py's `CASES` has the same ids, widths and batches.
#[derive(Debug)]
pub struct Case {
    pub id: &'static str,
    pub model: Model,
    pub precision: Precision,
    /// Layer widths, input first (see [`Model`] for the other models).
    pub widths: &'static [usize],
    pub batch: usize,
    /// Steps per round on a GPU.
    pub steps: u32,
    /// Steps per round on the CPU, where a step can take a second.
    pub cpu_steps: u32,
    /// The goal (issue 13), for cuda:0 on the H200.
    pub target: Target,
}

pub const CASES: [Case; 8] = [
    Case {
        id: "digits_mlp",
        model: Model::Mlp,
        precision: Precision::F32,
        widths: &[64, 128, CLASSES],
        batch: 64,
        steps: 200,
        cpu_steps: 50,
        // Issue 13's goal. On the H200 (2026-12-01): ferry 0.462 ms, PyTorch 1.38 ms.
        target: Target::AtMostMs(0.3),
    },
    Case {
        id: "mlp_4096",
        model: Model::Mlp,
        precision: Precision::F32,
        widths: &[1024, 4096, 4096, CLASSES],
        batch: 1024,
        steps: 50,
        cpu_steps: 1,
        // Issue 13's goal. On the H200 (2026-12-01): ferry 3.24 ms, PyTorch 3.10 ms, and the
        // step's eight GEMMs alone 2.44 ms on either side (`mlp_4096_gemms`).
        target: Target::AtMostTimesPyTorch(0.9),
    },
    Case {
        id: "digits_cnn",
        model: Model::DigitsCnn,
        precision: Precision::F32,
        widths: &[64, CLASSES],
        batch: 64,
        steps: 100,
        cpu_steps: 10,
        target: Target::AtMostTimesPyTorch(0.9),
    },
    Case {
        id: "gpt",
        model: Model::Gpt,
        precision: Precision::F32,
        widths: &[64, 57],
        batch: 32,
        steps: 50,
        cpu_steps: 2,
        target: Target::AtMostTimesPyTorch(0.9),
    },
    Case {
        id: "mlp_4096_gemms",
        model: Model::MlpGemms,
        precision: Precision::F32,
        widths: &[1024, 4096, 4096, CLASSES],
        batch: 1024,
        steps: 50,
        cpu_steps: 1,
        target: Target::None,
    },
    Case {
        id: "mlp_4096_bf16",
        model: Model::Mlp,
        precision: Precision::Bf16Autocast,
        widths: &[1024, 4096, 4096, CLASSES],
        batch: 1024,
        steps: 50,
        cpu_steps: 1,
        target: Target::AtMostTimesPyTorch(0.9),
    },
    Case {
        id: "digits_cnn_bf16",
        model: Model::DigitsCnn,
        precision: Precision::Bf16Autocast,
        widths: &[64, CLASSES],
        batch: 64,
        steps: 100,
        cpu_steps: 10,
        target: Target::AtMostTimesPyTorch(0.9),
    },
    Case {
        id: "gpt_bf16",
        model: Model::Gpt,
        precision: Precision::Bf16Autocast,
        widths: &[64, 57],
        batch: 32,
        steps: 50,
        cpu_steps: 2,
        target: Target::AtMostTimesPyTorch(0.9),
    },
];

impl Case {
    /// "MLP 64-128-10, batch 64".
    pub fn describe(&self) -> String {
        let widths: Vec<String> = self.widths.iter().map(usize::to_string).collect();
        let model = match self.model {
            Model::Mlp => format!("MLP {}, batch {}", widths.join("-"), self.batch),
            Model::MlpGemms => format!(
                "its 8 GEMMs alone (MLP {}, batch {})",
                widths.join("-"),
                self.batch
            ),
            Model::DigitsCnn => format!("digits CNN (no dropout), batch {}", self.batch),
            Model::Gpt => format!(
                "char GPT 4x128, context {}, vocabulary {}, batch {}",
                self.widths[0], self.widths[1], self.batch
            ),
        };
        match self.precision {
            Precision::F32 => model,
            Precision::Bf16Autocast => format!("{model}, bf16 autocast"),
        }
    }
}

#[derive(Args, Debug)]
pub struct TrainBenchArgs {
    #[command(flatten)]
    pytorch: PyTorchArgs,
    /// Write every number, all rounds included, to this JSON file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Where ferry trains: cuda:N or cpu (PyTorch's column is for the GPU only).
    #[arg(long, default_value = "cuda:0")]
    device: Device,
    /// Timed rounds per case and side; the table shows their median (claims need 9 or more).
    #[arg(long, default_value_t = 9, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Untimed rounds per case and side before the timed ones.
    #[arg(long, default_value_t = 2)]
    warmup: u32,
    /// Steps per round for every case [default: each case's own, fewer on the CPU].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    steps: Option<u32>,
    /// Only these cases (ids joined by commas: digits_mlp, mlp_4096, digits_cnn, gpt).
    #[arg(long, value_delimiter = ',', value_name = "IDS")]
    cases: Vec<String>,
    /// After each case's rounds, show where ferry's step spends its time on the GPU: per phase,
    /// as run and with the host ahead, and per kernel.
    #[arg(long)]
    profile: bool,
}

/// The parts of a training step, in order; each ends where the next begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    ZeroGrad,
    Forward,
    Loss,
    Backward,
    Optimizer,
}

pub const PHASES: [Phase; 5] = [
    Phase::ZeroGrad,
    Phase::Forward,
    Phase::Loss,
    Phase::Backward,
    Phase::Optimizer,
];

impl Phase {
    pub fn label(self) -> &'static str {
        match self {
            Phase::ZeroGrad => "zero_grad",
            Phase::Forward => "forward",
            Phase::Loss => "loss",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer step",
        }
    }
}

/// What one of ferry's steps runs.
enum Work {
    /// A training step of `model` on the batch `(x, y)`.
    Train {
        model: Box<dyn Module>,
        opt: Adam,
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
    loss: Option<Tensor>,
    pub(crate) cuda: Option<CudaDevice>,
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
            Device::Cuda(ordinal) => Some(CudaDevice::get(ordinal)?),
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
        };
        let opt = Adam::new(model.parameters(), LR)?;
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

/// The line python/train.py answers with one round: `CASE STEPS`.
fn request(case: &Case, steps: u32) -> String {
    format!("{} {steps}", case.id)
}

/// Warm-up rounds, then timed rounds; each round runs ferry's, then PyTorch's.
fn measure<'a>(
    case: &'a Case,
    device: Device,
    steps: u32,
    mut torch: Option<&mut PyTorch>,
    warmup: u32,
    rounds: u32,
    profile: bool,
) -> CaseResult<'a> {
    let mut m = CaseResult {
        case,
        steps,
        ferry: Measured::new(),
        final_loss: None,
        pytorch: Measured::new(),
    };
    let mut ferry = FerryRun::new(case, device)
        .map_err(|e| m.ferry.fail(e.to_string()))
        .ok();
    for round in 0..warmup + rounds {
        let timed = round >= warmup;
        if let Some(run) = ferry.as_mut() {
            match run.round_ms_per_step(steps) {
                Ok(ms) if timed => m.ferry.push(ms),
                Ok(_) => {}
                Err(err) => {
                    m.ferry.fail(err.to_string());
                    ferry = None;
                }
            }
        }
        if let (Some(torch), false) = (torch.as_deref_mut(), m.pytorch.is_failed()) {
            match torch.sample(&request(case, steps)) {
                Ok(ms) if timed => m.pytorch.push(ms),
                Ok(_) => {}
                Err(err) => m.pytorch.fail(err),
            }
        }
        if ferry.is_none() && (torch.is_none() || m.pytorch.is_failed()) {
            break;
        }
    }
    if let (true, Some(run)) = (profile, ferry.as_mut())
        && let Err(err) = train_profile::profile(case, run, steps.min(20))
    {
        println!("profile of {}: {err}", case.id);
    }
    if let Some(loss) = ferry.as_ref().and_then(|run| run.loss.as_ref()) {
        match loss.item() {
            Ok(v) if v.is_finite() => m.final_loss = Some(v),
            Ok(v) => m
                .ferry
                .fail(format!("the loss became {v}: the timings mean nothing")),
            Err(err) => m.ferry.fail(err.to_string()),
        }
    }
    m
}

fn select(ids: &[String]) -> Result<Vec<&'static Case>, String> {
    if let Some(unknown) = ids.iter().find(|id| !CASES.iter().any(|c| c.id == *id)) {
        let known: Vec<&str> = CASES.iter().map(|c| c.id).collect();
        return Err(format!(
            "no case `{unknown}`; the cases are {}",
            known.join(", ")
        ));
    }
    Ok(CASES
        .iter()
        .filter(|c| ids.is_empty() || ids.iter().any(|i| i == c.id))
        .collect())
}

pub fn run(args: TrainBenchArgs) -> Result<(), Box<dyn Error>> {
    let selected = select(&args.cases)?;
    let device_name = match args.device {
        Device::Cpu => {
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            format!("cpu ({threads} threads)")
        }
        Device::Cuda(ordinal) => match CudaDevice::get(ordinal) {
            Ok(dev) => format!("{} ({})", dev.device(), dev.info().name),
            Err(err) => {
                println!("no CUDA device: {err}");
                return Ok(());
            }
        },
    };
    let on_gpu = args.device != Device::Cpu;
    let mut info = RunSetup {
        device: device_name,
        on_gpu,
        rounds: args.rounds,
        warmup: args.warmup,
        pytorch: None,
        pytorch_note: None,
    };
    let mut torch = None;
    if args.pytorch.compare_pytorch && !on_gpu {
        info.pytorch_note = Some("no PyTorch column: it is compared on the GPU only".into());
    } else if args.pytorch.compare_pytorch {
        match args.pytorch.start("train.py") {
            Ok(t) => {
                info.pytorch = Some(t.label());
                torch = Some(t);
            }
            Err(err) => info.pytorch_note = Some(format!("no PyTorch column: {err}")),
        }
    }
    print_header(&info);
    let mut measured = Vec::new();
    for case in selected {
        let steps = args
            .steps
            .unwrap_or(if on_gpu { case.steps } else { case.cpu_steps });
        eprintln!("measuring {} ({steps} step(s) a round) ...", case.id);
        let m = measure(
            case,
            args.device,
            steps,
            torch.as_mut(),
            args.warmup,
            args.rounds,
            args.profile,
        );
        if let Some(err) = &m.pytorch.error
            && pytorch::forget_if_ended(&mut torch)
        {
            info.pytorch_note = Some(format!(
                "the PyTorch script ended during {}: {err}",
                case.id
            ));
        }
        measured.push(m);
    }
    print_results(&measured, &info);
    if let Some(path) = &args.json {
        let doc = to_json(&info, &measured);
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")?;
        println!("wrote every round to {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    const TINY: Case = Case {
        id: "tiny",
        model: Model::Mlp,
        precision: Precision::F32,
        widths: &[8, 16, CLASSES],
        batch: 32,
        steps: 3,
        cpu_steps: 3,
        target: Target::AtMostMs(1.0),
    };

    /// python/train.py must time the same models as this table.
    #[test]
    fn the_cases_match_train_py() {
        let script = include_str!("../python/train.py");
        for case in &CASES {
            let entry = format!(
                "\"{}\": ({:?}, {}, {}),",
                case.id, case.widths, case.batch, case.steps
            );
            assert!(script.contains(&entry), "train.py lacks `{entry}`");
        }
        let bf16: Vec<&str> = CASES
            .iter()
            .filter(|c| c.precision == Precision::Bf16Autocast)
            .map(|c| c.id)
            .collect();
        assert!(
            script.contains(
                &format!("BF16 = {bf16:?}")
                    .replace('[', "{")
                    .replace(']', "}")
            ),
            "train.py's BF16 must be {bf16:?}"
        );
        assert!(script.contains("allow_tf32 = False"));
        assert!(
            script.contains(&format!("LR = {LR:e}")),
            "train.py must use lr {LR}"
        );
        assert_eq!(request(&CASES[1], 50), "mlp_4096 50");
        assert!(select(&["mlp_4096".into()]).unwrap()[0].id == "mlp_4096");
        assert_eq!(select(&[]).unwrap().len(), CASES.len());
        let err = select(&["resnet".into()]).unwrap_err();
        assert_eq!(
            err,
            "no case `resnet`; the cases are digits_mlp, mlp_4096, digits_cnn, gpt, \
             mlp_4096_gemms, mlp_4096_bf16, digits_cnn_bf16, gpt_bf16"
        );
    }

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

    /// A stand-in for train.py (`sh -u script --serve` runs it): its round takes STEPS ms a step,
    /// and `broken` fails.
    fn fake_server(dir: &Path) -> PathBuf {
        pytorch::fake_script(
            dir,
            r#"echo '{"ready": true, "torch": "2.11.0", "cuda": "13.0", "device": "Fake GPU"}'
while read case steps; do
  case "$case" in
    quit) exit 0 ;;
    broken) echo '{"error": "CUDA out of memory"}' ;;
    *) echo "{\"case\": \"$case\", \"ms\": $steps}" ;;
  esac
done
"#,
        )
    }

    #[test]
    fn rounds_alternate_and_each_side_keeps_its_own_errors() {
        let dir = tempfile::tempdir().unwrap();
        let mut torch = PyTorch::start("sh", &fake_server(dir.path())).unwrap();
        let m = measure(&TINY, Device::Cpu, 3, Some(&mut torch), 1, 4, false);
        assert_eq!(m.pytorch.samples_ms, [3.0; 4]);
        assert_eq!(m.ferry.samples_ms.len(), 4);
        assert!(!m.ferry.is_failed() && !m.pytorch.is_failed());
        assert!(m.final_loss.is_some_and(f64::is_finite));

        let broken = Case {
            id: "broken",
            ..TINY
        };
        let m = measure(&broken, Device::Cpu, 2, Some(&mut torch), 0, 3, false);
        assert_eq!(m.ferry.samples_ms.len(), 3);
        assert_eq!(m.pytorch.error.as_deref(), Some("CUDA out of memory"));
        assert!(torch.is_alive());
    }
}
