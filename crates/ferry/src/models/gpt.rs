//! A small character-level GPT: GPT-2's shape at a small size.

use crate::autograd::{Choice, MeasuredPeaks, RegionCost};
use crate::nn::planned::measure_peaks;
use crate::nn::{Embedding, LayerNorm, Linear, Module, PlannedChain, scaled_dot_product_attention};
use crate::{DType, Device, Result, Tensor, TensorError};

/// The size of a [`Gpt`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptConfig {
    /// Distinct tokens (characters).
    pub vocab: usize,
    /// The most positions the model sees at once.
    pub context: usize,
    /// Embedding width, a multiple of `heads`.
    pub width: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads per block.
    pub heads: usize,
}

/// One pre-norm transformer block.
#[derive(Clone)]
struct Block {
    ln1: LayerNorm,
    qkv: Linear,
    proj: Linear,
    ln2: LayerNorm,
    fc: Linear,
    out: Linear,
    heads: usize,
}

/// A character-level GPT: token and position embeddings, `layers` pre-norm blocks (layer norm,
/// causal multi-head self-attention, residual; layer norm, a 4x-wide GELU MLP, residual), a
/// final layer norm and a linear head.
///
/// Weights are drawn from N(0, 0.02), the residual projections from N(0, 0.02 / sqrt(2 layers)),
/// biases zero, in a fixed order (embeddings, then each block, then the head), so a seed fixes
/// the model. Parameter names follow GPT-2's (`blocks.0.attn.qkv.weight`, `ln_f.bias`).
///
/// ```
/// use ferry::models::{Gpt, GptConfig};
/// use ferry::prelude::*;
///
/// let config = GptConfig { vocab: 10, context: 8, width: 16, layers: 1, heads: 2 };
/// let gpt = Gpt::new(config, Device::Cpu)?;
/// let ids = Tensor::from_vec(vec![1i64, 2, 3], &[1, 3])?;
/// assert_eq!(gpt.forward(&ids)?.shape(), &[1, 3, 10]);
/// # Ok::<(), ferry::TensorError>(())
/// ```
pub struct Gpt {
    config: GptConfig,
    tok: Embedding,
    pos: Embedding,
    /// The blocks, each kept, offloaded or recomputed as [`Gpt::set_plan`] says (all kept by
    /// default).
    blocks: PlannedChain<Block>,
    ln_f: LayerNorm,
    head: Linear,
}

fn normal(shape: &[usize], std: f64, device: Device) -> Result<Tensor> {
    Tensor::randn(shape, DType::F32, device)?.mul_scalar(std)
}

fn linear(inp: usize, out: usize, std: f64, device: Device) -> Result<Linear> {
    Linear::from_tensors(
        normal(&[out, inp], std, device)?,
        Some(Tensor::zeros(&[out], DType::F32, device)?),
    )
}

impl Gpt {
    /// A freshly initialized model on `device`; an error when `width` is not a multiple of
    /// `heads`.
    pub fn new(config: GptConfig, device: Device) -> Result<Self> {
        let GptConfig {
            vocab,
            context,
            width,
            layers,
            heads,
        } = config;
        if heads == 0 || width % heads != 0 {
            return Err(TensorError::InvalidArgument {
                op: "Gpt::new",
                message: format!("width {width} must be a multiple of heads {heads}"),
            });
        }
        let residual = 0.02 / ((2 * layers.max(1)) as f64).sqrt();
        let blocks = (0..layers)
            .map(|_| {
                Ok(Block {
                    ln1: LayerNorm::new(width, device)?,
                    qkv: linear(width, 3 * width, 0.02, device)?,
                    proj: linear(width, width, residual, device)?,
                    ln2: LayerNorm::new(width, device)?,
                    fc: linear(width, 4 * width, 0.02, device)?,
                    out: linear(4 * width, width, residual, device)?,
                    heads,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            config,
            tok: Embedding::from_weight(normal(&[vocab, width], 0.02, device)?)?,
            pos: Embedding::from_weight(normal(&[context, width], 0.02, device)?)?,
            blocks: PlannedChain::new(blocks),
            ln_f: LayerNorm::new(width, device)?,
            head: linear(width, vocab, 0.02, device)?,
        })
    }

    /// The size it was built with.
    pub fn config(&self) -> GptConfig {
        self.config
    }

    /// Where its parameters are.
    pub fn device(&self) -> Device {
        self.tok.weight().device()
    }

    /// Runs each block as a recomputed region ([`autograd::recompute`](crate::autograd::recompute)):
    /// the forward keeps only each block's input for backward, which runs the block again (with
    /// the same dropout masks and autocast dtype) to rebuild the rest. The same gradients, for
    /// the memory of every block's activations but its input; PyTorch's
    /// `torch.utils.checkpoint` on every block.
    pub fn set_recompute(&mut self, on: bool) {
        self.blocks.set_recompute(on);
    }

    /// Runs each block as `choices` says (one per block, in order; from
    /// [`MemoryPlan::choices`](crate::autograd::MemoryPlan::choices)): kept, offloaded (its
    /// saved activations to pinned host memory, inside an offload scope of its own), or
    /// recomputed in backward. The gradients are the same whatever the choices.
    pub fn set_plan(&mut self, choices: &[Choice]) -> Result<()> {
        self.blocks.set_plan(choices)
    }

    /// One forward of `input` (i64 ids `[B, T]`) with every block kept and timed on its own:
    /// each block's forward time, the bytes its rules save beyond its input, its input's bytes
    /// and a selective recompute's held bytes and extra time, for
    /// [`MemoryPlan::new`](crate::autograd::MemoryPlan::new). The device is synchronized around
    /// each block: a profile, not a step.
    pub fn profile_blocks(&self, input: &Tensor) -> Result<Vec<RegionCost>> {
        self.blocks.profile_blocks(&self.embed(input)?)
    }

    /// One step of `input` without a plan, `backward` given the logits (a loss from them, and
    /// its backward), measuring the device memory it takes over the forward and over each
    /// block's backward, for [`StepCost::measured`](crate::autograd::StepCost::measured); see
    /// [`PlannedChain::measure_peaks`]. Clear the gradients before it, and run it under the
    /// autocast the steps use.
    pub fn measure_peaks(
        &self,
        input: &Tensor,
        backward: impl FnOnce(&Tensor) -> Result<()>,
    ) -> Result<MeasuredPeaks> {
        measure_peaks(
            input.device(),
            || Ok((self.embed(input)?, self.blocks.blocks().to_vec())),
            |x| {
                let logits = self.head.forward(&self.ln_f.forward(&x)?)?;
                drop(x);
                backward(&logits)
            },
        )
    }

    /// The token and position embeddings of `input`, checked against the context.
    fn embed(&self, input: &Tensor) -> Result<Tensor> {
        let t = input.shape()[1];
        if t > self.config.context {
            return Err(TensorError::InvalidArgument {
                op: "Gpt::forward",
                message: format!(
                    "{t} positions but the model has {}; crop the input to the last {}",
                    self.config.context, self.config.context
                ),
            });
        }
        let positions = Tensor::arange(0.0, t as f64, DType::I64, input.device())?;
        self.tok.forward(input)?.add(&self.pos.forward(&positions)?)
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Block::forward(self, x)
    }

    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        self.visit(prefix, f);
    }

    fn visit_parameters_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(String, &mut Tensor) -> Result<()>,
    ) -> Result<()> {
        self.visit_mut(prefix, f)
    }
}

impl Block {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = x.add(&self.attention(&self.ln1.forward(x)?)?)?;
        let mlp = self
            .out
            .forward(&self.fc.forward(&self.ln2.forward(&h)?)?.gelu()?)?;
        h.add(&mlp)
    }

    /// Causal multi-head self-attention over `x`, `[B, T, C]`.
    fn attention(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, c) = (x.shape()[0], x.shape()[1], x.shape()[2]);
        let hd = c / self.heads;
        let qkv = self.qkv.forward(x)?;
        let split = |i: usize| -> Result<Tensor> {
            qkv.narrow(2, i * c, c)?
                .reshape(&[b, t, self.heads, hd])?
                .permute(&[0, 2, 1, 3])
        };
        let y = scaled_dot_product_attention(&split(0)?, &split(1)?, &split(2)?, true)?;
        self.proj
            .forward(&y.permute(&[0, 2, 1, 3])?.reshape(&[b, t, c])?)
    }

    fn visit(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        self.ln1.visit_parameters(&format!("{prefix}ln1."), f);
        self.qkv.visit_parameters(&format!("{prefix}attn.qkv."), f);
        self.proj
            .visit_parameters(&format!("{prefix}attn.proj."), f);
        self.ln2.visit_parameters(&format!("{prefix}ln2."), f);
        self.fc.visit_parameters(&format!("{prefix}mlp.fc."), f);
        self.out.visit_parameters(&format!("{prefix}mlp.proj."), f);
    }

    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(String, &mut Tensor) -> Result<()>,
    ) -> Result<()> {
        self.ln1.visit_parameters_mut(&format!("{prefix}ln1."), f)?;
        self.qkv
            .visit_parameters_mut(&format!("{prefix}attn.qkv."), f)?;
        self.proj
            .visit_parameters_mut(&format!("{prefix}attn.proj."), f)?;
        self.ln2.visit_parameters_mut(&format!("{prefix}ln2."), f)?;
        self.fc
            .visit_parameters_mut(&format!("{prefix}mlp.fc."), f)?;
        self.out
            .visit_parameters_mut(&format!("{prefix}mlp.proj."), f)
    }
}

impl Module for Gpt {
    /// `input`: i64 ids `[B, T]` (T <= context); returns logits `[B, T, vocab]`.
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        let x = self.blocks.forward(&self.embed(input)?)?;
        self.head.forward(&self.ln_f.forward(&x)?)
    }

    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        self.tok.visit_parameters(&format!("{prefix}tok."), f);
        self.pos.visit_parameters(&format!("{prefix}pos."), f);
        self.blocks.visit_parameters(&format!("{prefix}blocks."), f);
        self.ln_f.visit_parameters(&format!("{prefix}ln_f."), f);
        self.head.visit_parameters(&format!("{prefix}head."), f);
    }

    fn visit_parameters_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(String, &mut Tensor) -> Result<()>,
    ) -> Result<()> {
        self.tok.visit_parameters_mut(&format!("{prefix}tok."), f)?;
        self.pos.visit_parameters_mut(&format!("{prefix}pos."), f)?;
        self.blocks
            .visit_parameters_mut(&format!("{prefix}blocks."), f)?;
        self.ln_f
            .visit_parameters_mut(&format!("{prefix}ln_f."), f)?;
        self.head.visit_parameters_mut(&format!("{prefix}head."), f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_gpt2_and_bad_sizes_are_errors() {
        let config = GptConfig {
            vocab: 7,
            context: 4,
            width: 8,
            layers: 2,
            heads: 2,
        };
        let gpt = Gpt::new(config, Device::Cpu).unwrap();
        assert_eq!(gpt.config(), config);
        assert_eq!(gpt.device(), Device::Cpu);
        let names: Vec<String> = gpt.named_parameters().into_iter().map(|(n, _)| n).collect();
        assert!(
            names.contains(&"blocks.1.attn.qkv.weight".to_string()),
            "{names:?}"
        );
        assert_eq!(names.last().map(String::as_str), Some("head.bias"));
        let too_long = Tensor::from_vec(vec![0i64; 5], &[1, 5]).unwrap();
        let err = gpt.forward(&too_long).unwrap_err().to_string();
        assert!(err.contains("crop the input"), "{err}");
        let odd = GptConfig { heads: 3, ..config };
        let err = Gpt::new(odd, Device::Cpu).err().unwrap().to_string();
        assert!(err.contains("multiple of heads 3"), "{err}");
    }
}
