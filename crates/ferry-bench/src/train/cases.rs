//! The cases `ferry bench train` times, as a table, and the phases a step is made of.

use crate::harness::report::Target;

pub const LR: f64 = 1e-3;
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

use Model::{DigitsCnn, Gpt, Mlp, MlpGemms};
use Precision::{Bf16Autocast, F32};
const WIDE: &[usize] = &[1024, 4096, 4096, CLASSES];
const CNN: &[usize] = &[64, CLASSES];
const GPT: &[usize] = &[64, 57];
const FASTER: Target = Target::AtMostTimesPyTorch(0.9);

/// The goals are issue 13's. On the H200 (2026-12-01): digits_mlp ferry 0.462 ms, PyTorch
/// 1.38 ms; mlp_4096 ferry 3.24 ms, PyTorch 3.10 ms, its eight GEMMs alone 2.44 ms on either side.
pub const CASES: [Case; 8] = [
    case("digits_mlp", Mlp, F32, &[64, 128, CLASSES], 64, (200, 50), Target::AtMostMs(0.3)),
    case("mlp_4096", Mlp, F32, WIDE, 1024, (50, 1), FASTER),
    case("digits_cnn", DigitsCnn, F32, CNN, 64, (100, 10), FASTER),
    case("gpt", Gpt, F32, GPT, 32, (50, 2), FASTER),
    case("mlp_4096_gemms", MlpGemms, F32, WIDE, 1024, (50, 1), Target::None),
    case("mlp_4096_bf16", Mlp, Bf16Autocast, WIDE, 1024, (50, 1), FASTER),
    case("digits_cnn_bf16", DigitsCnn, Bf16Autocast, CNN, 64, (100, 10), FASTER),
    case("gpt_bf16", Gpt, Bf16Autocast, GPT, 32, (50, 2), FASTER),
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
        widths,
        batch,
        steps,
        cpu_steps,
        target,
    }
}

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
    widths: &[8, 16, CLASSES],
    batch: 32,
    steps: 3,
    cpu_steps: 3,
    target: Target::AtMostMs(1.0),
};
