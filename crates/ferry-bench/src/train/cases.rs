//! The cases `ferry bench train` times, as a table, and the phases a step is made of.

use crate::harness::report::Target;

pub const LR: f64 = 1e-3;
/// The large models' learning rate.
pub const LARGE_LR: f64 = 3e-4;
pub(super) const CLASSES: usize = 10;

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
    /// `ferry bench offload-optim`'s byte-level GPT (heads of 128); `widths` = [context,
    /// vocabulary, width, blocks]. At 20 x 2048: 1.01 B parameters.
    LargeGpt,
    /// [`LlamaConfig::llama_1b`](ferry::models::LlamaConfig::llama_1b), the Llama of the
    /// project's optimizer benches (0.97 B parameters); `widths` = [context].
    Llama,
}

/// The optimizer a case steps with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Optimizer {
    /// Adam, lr [`LR`].
    Adam,
    /// AdamW, lr [`LARGE_LR`], weight decay 0.01 (PyTorch's side: `fused=True`, what its users
    /// pick for a large model).
    AdamW,
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
    pub optimizer: Optimizer,
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

use Model::{DigitsCnn, Gpt, LargeGpt, Llama, Mlp, MlpGemms};
use Precision::{Bf16Autocast, F32};
const WIDE: &[usize] = &[1024, 4096, 4096, CLASSES];
const CNN: &[usize] = &[64, CLASSES];
const GPT: &[usize] = &[64, 57];
const FASTER: Target = Target::AtMostTimesPyTorch(0.9);
const GPT_1B: &[usize] = &[1024, 256, 2048, 20];
const LLAMA_1B: &[usize] = &[1024];
const EVEN: Target = Target::NoSlowerThanPyTorch;

/// The goals are issue 13's. On the H200 (2026-12-01): digits_mlp ferry 0.462 ms, PyTorch
/// 1.38 ms; mlp_4096 ferry 3.24 ms, PyTorch 3.10 ms, its eight GEMMs alone 2.44 ms on either side.
/// The 1 B models' goal is issue 40's: no slower than PyTorch eager with its fused attention.
pub const CASES: [Case; 12] = [
    case("digits_mlp", Mlp, F32, &[64, 128, CLASSES], 64, (200, 50), Target::AtMostMs(0.3)),
    case("mlp_4096", Mlp, F32, WIDE, 1024, (50, 1), FASTER),
    case("digits_cnn", DigitsCnn, F32, CNN, 64, (100, 10), FASTER),
    case("gpt", Gpt, F32, GPT, 32, (50, 2), FASTER),
    case("mlp_4096_gemms", MlpGemms, F32, WIDE, 1024, (50, 1), Target::None),
    case("mlp_4096_bf16", Mlp, Bf16Autocast, WIDE, 1024, (50, 1), FASTER),
    case("digits_cnn_bf16", DigitsCnn, Bf16Autocast, CNN, 64, (100, 10), FASTER),
    case("gpt_bf16", Gpt, Bf16Autocast, GPT, 32, (50, 2), FASTER),
    large("gpt_1b_b8", LargeGpt, GPT_1B, 8),
    large("gpt_1b_b16", LargeGpt, GPT_1B, 16),
    large("llama_1b_b8", Llama, LLAMA_1B, 8),
    large("llama_1b_b16", Llama, LLAMA_1B, 16),
];

/// A row of [`CASES`]: `(steps, cpu_steps)` a round.
const fn case(
    id: &'static str,
    model: Model,
    precision: Precision,
    widths: &'static [usize],
    batch: usize,
    (steps, cpu_steps): (u32, u32),
    target: Target,
) -> Case {
    Case {
        id,
        model,
        precision,
        optimizer: Optimizer::Adam,
        widths,
        batch,
        steps,
        cpu_steps,
        target,
    }
}

/// A 1 B model's case: bf16 autocast, AdamW, 5 steps a round (1 on the CPU, which runs it only
/// when asked by name).
const fn large(id: &'static str, model: Model, widths: &'static [usize], batch: usize) -> Case {
    Case {
        optimizer: Optimizer::AdamW,
        ..case(id, model, Bf16Autocast, widths, batch, (5, 1), EVEN)
    }
}

impl Case {
    /// Whether this is a 1 B model, run on the CPU only when named.
    pub fn is_large(&self) -> bool {
        matches!(self.model, Model::LargeGpt | Model::Llama)
    }

    /// Tokens a step trains on, for the language models.
    pub fn tokens(&self) -> Option<usize> {
        match self.model {
            Model::Gpt | Model::LargeGpt | Model::Llama => Some(self.batch * self.widths[0]),
            Model::Mlp | Model::DigitsCnn | Model::MlpGemms => None,
        }
    }

    /// The attention's layers and width (heads x head dim), for the language models.
    pub fn attention(&self) -> Option<(usize, usize)> {
        match self.model {
            Model::Gpt => Some((4, 128)),
            Model::LargeGpt => Some((self.widths[3], self.widths[2])),
            Model::Llama => {
                let c = ferry::models::LlamaConfig::llama_1b();
                Some((c.num_hidden_layers, c.num_attention_heads * c.head_dim))
            }
            Model::Mlp | Model::DigitsCnn | Model::MlpGemms => None,
        }
    }

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
            Model::LargeGpt => format!(
                "byte GPT {}x{} (heads of 128), context {}, batch {}, AdamW",
                self.widths[3], self.widths[2], self.widths[0], self.batch
            ),
            Model::Llama => format!(
                "Llama 1B (19x2048, 32 heads, 4 for keys and values, vocabulary 32000), \
                 context {}, batch {}, AdamW",
                self.widths[0], self.batch
            ),
        };
        match self.precision {
            Precision::F32 => model,
            Precision::Bf16Autocast => format!("{model}, bf16 autocast"),
        }
    }
}

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

/// A case small enough for a test.
#[cfg(test)]
pub(super) const TINY: Case = Case {
    id: "tiny",
    model: Model::Mlp,
    precision: Precision::F32,
    optimizer: Optimizer::Adam,
    widths: &[8, 16, CLASSES],
    batch: 32,
    steps: 3,
    cpu_steps: 3,
    target: Target::AtMostMs(1.0),
};
