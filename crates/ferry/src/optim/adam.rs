//! Adam and AdamW.

use ferry_tensor::ops::optim::AdamStep;
use ferry_tensor::{Result, Tensor, with_no_grad};
use ferry_transfer::StateDict;

use super::{BufferState, Optimizer, grad_of, leaf_parameters};
use crate::checkpoint::CheckpointError;

/// Adam (Kingma and Ba, 2015): `m = β₁m + (1-β₁)g`, `v = β₂v + (1-β₂)g²`,
/// `p -= lr · m̂ / (√v̂ + ε)` with bias-corrected `m̂ = m/(1-β₁ᵗ)`, `v̂ = v/(1-β₂ᵗ)`. Weight decay
/// here is the L2 penalty added to the gradient; for decoupled decay use [`AdamW`].
#[derive(Debug, Clone)]
pub struct Adam {
    params: Vec<Tensor>,
    lr: f64,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
    decoupled: bool,
    state: BufferState,
}

impl Adam {
    /// Adam with learning rate `lr`, betas (0.9, 0.999), eps 1e-8, no weight decay.
    pub fn new(params: impl IntoIterator<Item = Tensor>, lr: f64) -> Result<Self> {
        let params = leaf_parameters("Adam::new", params)?;
        let state = BufferState::new(&["exp_avg", "exp_avg_sq"], params.len());
        Ok(Self {
            params,
            lr,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: false,
            state,
        })
    }

    /// Decay rates of the first and second moment estimates.
    pub fn betas(mut self, beta1: f64, beta2: f64) -> Self {
        self.betas = (beta1, beta2);
        self
    }

    /// Term added to the denominator for stability.
    pub fn eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }

    /// L2 penalty added to the gradient.
    pub fn weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    fn update(&mut self) -> Result<()> {
        let (b1, b2) = self.betas;
        let t = self.state.step as i32 + 1;
        let step = AdamStep {
            lr: self.lr,
            beta1: b1,
            beta2: b2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            bias_correction1: 1.0 - b1.powi(t),
            bias_correction2: 1.0 - b2.powi(t),
            decoupled: u32::from(self.decoupled),
            pad: 0,
        };
        with_no_grad(|| {
            for (p, bufs) in self.params.iter().zip(&mut self.state.buffers) {
                let Some(g) = grad_of(p)? else { continue };
                if bufs.is_none() {
                    *bufs = Some(vec![p.zeros_like()?, p.zeros_like()?]);
                }
                let moments = bufs.as_ref().expect("set above");
                // One fused pass: decay, both moments and the bias-corrected step, in place.
                p.adam_update(&g, &moments[0], &moments[1], &step)?;
            }
            Ok::<_, ferry_tensor::TensorError>(())
        })?;
        self.state.step += 1;
        Ok(())
    }
}

impl Optimizer for Adam {
    fn step(&mut self) -> Result<()> {
        self.update()
    }

    fn parameters(&self) -> &[Tensor] {
        &self.params
    }

    fn learning_rate(&self) -> f64 {
        self.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn steps(&self) -> u64 {
        self.state.step
    }

    fn state_dict(&self) -> StateDict {
        self.state.state_dict(self.lr)
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<(), CheckpointError> {
        self.lr = self.state.load(&self.params, state)?;
        Ok(())
    }
}

/// AdamW (Loshchilov and Hutter, 2019): Adam with decoupled weight decay, `p -= lr·wd·p`
/// before the Adam update, instead of an L2 term in the gradient. Default decay 0.01.
#[derive(Debug, Clone)]
pub struct AdamW(Adam);

impl AdamW {
    /// AdamW with learning rate `lr`, betas (0.9, 0.999), eps 1e-8, weight decay 0.01.
    pub fn new(params: impl IntoIterator<Item = Tensor>, lr: f64) -> Result<Self> {
        let mut adam = Adam::new(params, lr)?.weight_decay(0.01);
        adam.decoupled = true;
        Ok(Self(adam))
    }

    /// Decay rates of the first and second moment estimates.
    pub fn betas(self, beta1: f64, beta2: f64) -> Self {
        Self(self.0.betas(beta1, beta2))
    }

    /// Term added to the denominator for stability.
    pub fn eps(self, eps: f64) -> Self {
        Self(self.0.eps(eps))
    }

    /// Decoupled weight decay factor.
    pub fn weight_decay(self, weight_decay: f64) -> Self {
        Self(self.0.weight_decay(weight_decay))
    }
}

impl Optimizer for AdamW {
    fn step(&mut self) -> Result<()> {
        self.0.update()
    }

    fn parameters(&self) -> &[Tensor] {
        self.0.parameters()
    }

    fn learning_rate(&self) -> f64 {
        self.0.learning_rate()
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.0.set_learning_rate(lr);
    }

    fn steps(&self) -> u64 {
        self.0.steps()
    }

    fn state_dict(&self) -> StateDict {
        self.0.state_dict()
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<(), CheckpointError> {
        self.0.load_state_dict(state)
    }
}
