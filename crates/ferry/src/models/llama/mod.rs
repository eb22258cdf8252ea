//! Llama: transformers' `LlamaForCausalLM`, with its parameter names, so its checkpoints load
//! as they are ([`Llama::from_pretrained`]).

use ferry_tensor::{DType, Device, Result, Tensor, TensorError};

use crate::autograd::{Choice, MeasuredPeaks, RegionCost};
use crate::nn::planned::{check_choices, forward_planned, measure_peaks, profile_blocks};
use crate::nn::{Embedding, Linear, Module, RmsNorm, Rotary, scaled_dot_product_attention};

mod config;
mod pretrained;

pub use config::LlamaConfig;

/// What a parameter is, so a fresh model knows how to draw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A projection or embedding matrix: N(0, 0.02), transformers' `initializer_range`.
    Matrix,
    /// A projection's bias: zeros.
    Bias,
    /// An RMSNorm's scale: ones.
    Scale,
}

/// Where a model's parameters come from while it is built: drawn fresh, or taken from a
/// checkpoint by name.
type Source<'a> = dyn FnMut(&str, &[usize], Kind) -> Result<Tensor> + 'a;

/// One decoder layer: pre-norm grouped-query attention with rotary positions, then a pre-norm
/// SiLU-gated MLP, each added to the residual stream.
#[derive(Clone)]
struct Layer {
    input_layernorm: RmsNorm,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    post_attention_layernorm: RmsNorm,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

/// A Llama decoder with its language-model head: token embedding, `num_hidden_layers` layers
/// (RMSNorm, grouped-query causal attention with rotary embeddings, residual; RMSNorm,
/// `down(silu(gate(x)) * up(x))`, residual), a final RMSNorm and the head (the embedding
/// itself when `tie_word_embeddings`).
///
/// Parameter names are transformers' (`model.layers.0.self_attn.q_proj.weight`,
/// `lm_head.weight`), so [`Module::state_dict`] saves a file transformers loads and
/// [`Llama::from_pretrained`] reads a directory `save_pretrained` wrote.
///
/// ```
/// use ferry::models::{Llama, LlamaConfig};
/// use ferry::prelude::*;
///
/// let config = LlamaConfig::new(32, 16, 32, 2, 4, 2);
/// let llama = Llama::new(config, Device::Cpu)?;
/// let ids = Tensor::from_vec(vec![1i64, 5, 7], &[1, 3])?;
/// assert_eq!(llama.forward(&ids)?.shape(), &[1, 3, 32]);
/// # Ok::<(), ferry::TensorError>(())
/// ```
pub struct Llama {
    config: LlamaConfig,
    embed_tokens: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    rotary: Rotary,
    /// What each layer does with what it saves ([`Llama::set_plan`]): all kept by default.
    plan: Vec<Choice>,
}

/// A layer with what its forward reads beside its input (the configuration, the rotary tables
/// of this call): one module of one input, as the planned forward runs and recomputes it.
#[derive(Clone)]
struct Positioned {
    layer: Layer,
    config: LlamaConfig,
    rotary: Rotary,
    cos: Tensor,
    sin: Tensor,
}

impl Module for Positioned {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let Positioned {
            layer,
            config,
            rotary,
            cos,
            sin,
        } = self;
        layer.forward(x, config, rotary, cos, sin)
    }

    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        for (name, module) in self.layer.modules() {
            module.visit_parameters(&format!("{prefix}{name}."), f);
        }
    }
}

impl Llama {
    /// A freshly initialized `f32` model on `device`, drawn as transformers draws one (weights
    /// from N(0, 0.02), biases zero, norms one), in a fixed order, so a seed fixes it.
    pub fn new(config: LlamaConfig, device: Device) -> Result<Self> {
        Self::build(config, &mut |_, shape, kind| match kind {
            Kind::Matrix => Tensor::randn(shape, DType::F32, device)?.mul_scalar(0.02),
            Kind::Bias => Tensor::zeros(shape, DType::F32, device),
            Kind::Scale => Tensor::ones(shape, DType::F32, device),
        })
    }

    /// The model, each parameter from `source` by name, shape and kind, in a fixed order.
    fn build(config: LlamaConfig, source: &mut Source<'_>) -> Result<Self> {
        config
            .check()
            .map_err(|message| TensorError::InvalidArgument {
                op: "Llama",
                message,
            })?;
        let c = &config;
        let (h, hd, i) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (q, kv) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
        let (ab, mb) = (c.attention_bias, c.mlp_bias);
        let embed_tokens = Embedding::from_weight(source(
            "model.embed_tokens.weight",
            &[c.vocab_size, h],
            Kind::Matrix,
        )?)?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for n in 0..c.num_hidden_layers {
            let p = format!("model.layers.{n}");
            layers.push(Layer {
                input_layernorm: norm(source, &format!("{p}.input_layernorm"), c)?,
                q_proj: linear(source, &format!("{p}.self_attn.q_proj"), [h, q], ab)?,
                k_proj: linear(source, &format!("{p}.self_attn.k_proj"), [h, kv], ab)?,
                v_proj: linear(source, &format!("{p}.self_attn.v_proj"), [h, kv], ab)?,
                o_proj: linear(source, &format!("{p}.self_attn.o_proj"), [q, h], ab)?,
                post_attention_layernorm: norm(
                    source,
                    &format!("{p}.post_attention_layernorm"),
                    c,
                )?,
                gate_proj: linear(source, &format!("{p}.mlp.gate_proj"), [h, i], mb)?,
                up_proj: linear(source, &format!("{p}.mlp.up_proj"), [h, i], mb)?,
                down_proj: linear(source, &format!("{p}.mlp.down_proj"), [i, h], mb)?,
            });
        }
        let norm = norm(source, "model.norm", c)?;
        let lm_head = match c.tie_word_embeddings {
            true => None,
            false => Some(linear(source, "lm_head", [h, c.vocab_size], false)?),
        };
        let rotary = Rotary::new(hd, c.rope_theta, c.rope_scaling)?;
        Ok(Self {
            plan: vec![Choice::Keep; config.num_hidden_layers],
            config,
            embed_tokens,
            layers,
            norm,
            lm_head,
            rotary,
        })
    }

    /// The size it was built with.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// Where its parameters are.
    pub fn device(&self) -> Device {
        self.embed_tokens.weight().device()
    }

    /// Runs each layer as `choices` says (one per layer, in order; from
    /// [`MemoryPlan::choices`](crate::autograd::MemoryPlan::choices)): kept, offloaded (its
    /// saved activations to pinned host memory) or recomputed in backward. The gradients are the
    /// same whatever the choices.
    pub fn set_plan(&mut self, choices: &[Choice]) -> Result<()> {
        check_choices("Llama::set_plan", self.layers.len(), choices)?;
        self.plan = choices.to_vec();
        Ok(())
    }

    /// Runs every layer as a recomputed region (`true`) or keeps everything (`false`):
    /// PyTorch's `torch.utils.checkpoint` on every layer.
    pub fn set_recompute(&mut self, on: bool) {
        let choice = if on { Choice::Recompute } else { Choice::Keep };
        self.plan = vec![choice; self.layers.len()];
    }

    /// One forward of `ids` with every layer kept and timed on its own: each layer's forward
    /// time, the bytes its rules save beyond its input, its input's bytes and a selective
    /// recompute's held bytes and extra time, for
    /// [`MemoryPlan::new`](crate::autograd::MemoryPlan::new). Run it under the autocast the steps
    /// use. The device is synchronized around each layer: a profile, not a step.
    pub fn profile_blocks(&self, ids: &Tensor) -> Result<Vec<RegionCost>> {
        let (x, layers) = self.embedded(ids)?;
        profile_blocks(&layers, &x)
    }

    /// One step of `ids` without a plan, `backward` given the logits (a loss from them, and its
    /// backward), measuring the device memory it takes over the forward and over each layer's
    /// backward, for [`StepCost::measured`](crate::autograd::StepCost::measured); see
    /// [`PlannedChain::measure_peaks`](crate::nn::PlannedChain::measure_peaks). Clear the
    /// gradients before it, and run it under the autocast the steps use.
    pub fn measure_peaks(
        &self,
        ids: &Tensor,
        backward: impl FnOnce(&Tensor) -> Result<()>,
    ) -> Result<MeasuredPeaks> {
        measure_peaks(
            self.device(),
            || self.embedded(ids),
            |x| {
                let logits = self.logits(&self.norm.forward(&x)?)?;
                drop(x);
                backward(&logits)
            },
        )
    }

    /// The hidden states after the final norm, `[B, T, hidden_size]`, for `ids` (`i64`, `[B,
    /// T]`).
    pub fn hidden_states(&self, ids: &Tensor) -> Result<Tensor> {
        let (x, layers) = self.embedded(ids)?;
        self.norm
            .forward(&forward_planned(&layers, &self.plan, &x)?)
    }

    /// The logits of the hidden states after the final norm.
    fn logits(&self, x: &Tensor) -> Result<Tensor> {
        match &self.lm_head {
            Some(head) => head.forward(x),
            None => x.linear(self.embed_tokens.weight(), None),
        }
    }

    /// The embedded `ids` and the layers with this call's rotary tables.
    fn embedded(&self, ids: &Tensor) -> Result<(Tensor, Vec<Positioned>)> {
        let shape = ids.shape();
        let max = self.config.max_position_embeddings;
        if shape.len() != 2 || ids.dtype() != DType::I64 || shape[1] > max {
            return Err(TensorError::InvalidArgument {
                op: "Llama::forward",
                message: format!(
                    "the input must be i64 token ids [batch, positions] with at most {max} \
                     positions; got {} {shape:?}",
                    ids.dtype()
                ),
            });
        }
        let x = self.embed_tokens.forward(ids)?;
        // Under autocast the projections answer in its dtype, and so do the tables: the
        // rotation then runs in that dtype (PyTorch's would widen to f32 and cast back).
        let table_dtype = crate::amp::autocast_dtype()
            .filter(|_| x.dtype() == DType::F32)
            .unwrap_or(x.dtype());
        let (cos, sin) = self.rotary.tables(0, shape[1], table_dtype, x.device())?;
        let layers = self
            .layers
            .iter()
            .map(|layer| Positioned {
                layer: layer.clone(),
                config: self.config.clone(),
                rotary: self.rotary.clone(),
                cos: cos.clone(),
                sin: sin.clone(),
            })
            .collect();
        Ok((x, layers))
    }
}

impl Layer {
    fn forward(
        &self,
        x: &Tensor,
        c: &LlamaConfig,
        rotary: &Rotary,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<Tensor> {
        let (b, t) = (x.shape()[0], x.shape()[1]);
        let (heads, kv_heads, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let h = self.input_layernorm.forward(x)?;
        // Each projection as [B, T, heads, D]; rotated there (the tables as [T, 1, D]), where it
        // is dense, and its heads moved out as a view that attention reads in place.
        let project = |proj: &Linear, n: usize| proj.forward(&h)?.reshape(&[b, t, n, hd]);
        let heads_out = |x: Tensor| x.permute(&[0, 2, 1, 3]);
        let (cos, sin) = (cos.reshape(&[t, 1, hd])?, sin.reshape(&[t, 1, hd])?);
        let q = heads_out(rotary.apply(&project(&self.q_proj, heads)?, &cos, &sin)?)?;
        let k = heads_out(rotary.apply(&project(&self.k_proj, kv_heads)?, &cos, &sin)?)?;
        let v = heads_out(project(&self.v_proj, kv_heads)?)?;
        let y = scaled_dot_product_attention(&q, &k, &v, true)?;
        let y = y.permute(&[0, 2, 1, 3])?.reshape(&[b, t, heads * hd])?;
        let x = x.add(&self.o_proj.forward(&y)?)?;
        let h = self.post_attention_layernorm.forward(&x)?;
        let gated = self
            .gate_proj
            .forward(&h)?
            .silu()?
            .mul(&self.up_proj.forward(&h)?)?;
        x.add(&self.down_proj.forward(&gated)?)
    }

    fn modules(&self) -> [(&'static str, &dyn Module); 9] {
        [
            ("input_layernorm", &self.input_layernorm),
            ("self_attn.q_proj", &self.q_proj),
            ("self_attn.k_proj", &self.k_proj),
            ("self_attn.v_proj", &self.v_proj),
            ("self_attn.o_proj", &self.o_proj),
            ("post_attention_layernorm", &self.post_attention_layernorm),
            ("mlp.gate_proj", &self.gate_proj),
            ("mlp.up_proj", &self.up_proj),
            ("mlp.down_proj", &self.down_proj),
        ]
    }

    fn modules_mut(&mut self) -> [(&'static str, &mut dyn Module); 9] {
        [
            ("input_layernorm", &mut self.input_layernorm),
            ("self_attn.q_proj", &mut self.q_proj),
            ("self_attn.k_proj", &mut self.k_proj),
            ("self_attn.v_proj", &mut self.v_proj),
            ("self_attn.o_proj", &mut self.o_proj),
            (
                "post_attention_layernorm",
                &mut self.post_attention_layernorm,
            ),
            ("mlp.gate_proj", &mut self.gate_proj),
            ("mlp.up_proj", &mut self.up_proj),
            ("mlp.down_proj", &mut self.down_proj),
        ]
    }
}

/// A projection from `inp` to `out` features named `name` (`name.weight`, `name.bias`).
fn linear(
    source: &mut Source<'_>,
    name: &str,
    [inp, out]: [usize; 2],
    bias: bool,
) -> Result<Linear> {
    let weight = source(&format!("{name}.weight"), &[out, inp], Kind::Matrix)?;
    let bias = match bias {
        true => Some(source(&format!("{name}.bias"), &[out], Kind::Bias)?),
        false => None,
    };
    Linear::from_tensors(weight, bias)
}

/// An RMSNorm over the hidden size named `name` (`name.weight`).
fn norm(source: &mut Source<'_>, name: &str, c: &LlamaConfig) -> Result<RmsNorm> {
    let weight = source(&format!("{name}.weight"), &[c.hidden_size], Kind::Scale)?;
    RmsNorm::from_weight(weight, c.rms_norm_eps)
}

impl Module for Llama {
    /// `input`: `i64` token ids `[B, T]`; returns logits `[B, T, vocab_size]`.
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        self.logits(&self.hidden_states(input)?)
    }

    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        self.embed_tokens
            .visit_parameters(&format!("{prefix}model.embed_tokens."), f);
        for (i, layer) in self.layers.iter().enumerate() {
            for (name, module) in layer.modules() {
                module.visit_parameters(&format!("{prefix}model.layers.{i}.{name}."), f);
            }
        }
        self.norm
            .visit_parameters(&format!("{prefix}model.norm."), f);
        if let Some(head) = &self.lm_head {
            head.visit_parameters(&format!("{prefix}lm_head."), f);
        }
    }

    fn visit_parameters_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(String, &mut Tensor) -> Result<()>,
    ) -> Result<()> {
        self.embed_tokens
            .visit_parameters_mut(&format!("{prefix}model.embed_tokens."), f)?;
        for (i, layer) in self.layers.iter_mut().enumerate() {
            for (name, module) in layer.modules_mut() {
                module.visit_parameters_mut(&format!("{prefix}model.layers.{i}.{name}."), f)?;
            }
        }
        self.norm
            .visit_parameters_mut(&format!("{prefix}model.norm."), f)?;
        match &mut self.lm_head {
            Some(head) => head.visit_parameters_mut(&format!("{prefix}lm_head."), f),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests;
