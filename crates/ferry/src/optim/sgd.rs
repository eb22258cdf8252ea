//! Stochastic gradient descent with momentum and weight decay.

use ferry_tensor::{Result, Tensor, with_no_grad};
use ferry_transfer::StateDict;

use super::{BufferState, Optimizer, axpy, grad_of, leaf_parameters};
use crate::checkpoint::CheckpointError;

/// SGD as PyTorch defines it: `g = grad + wd·p`; with momentum `b = μ·b + g` (the first step
/// sets `b = g`) and `g = b` (or `g + μ·b` with Nesterov); then `p -= lr·g`.
#[derive(Debug, Clone)]
pub struct Sgd {
    params: Vec<Tensor>,
    lr: f64,
    momentum: f64,
    weight_decay: f64,
    nesterov: bool,
    state: BufferState,
}

impl Sgd {
    /// Plain SGD with learning rate `lr` over `params` (leaves that require grad).
    pub fn new(params: impl IntoIterator<Item = Tensor>, lr: f64) -> Result<Self> {
        let params = leaf_parameters("Sgd::new", params)?;
        let state = BufferState::new(&["momentum_buffer"], params.len());
        Ok(Self {
            params,
            lr,
            momentum: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            state,
        })
    }

    /// Momentum factor `μ` (0 turns it off).
    pub fn momentum(mut self, momentum: f64) -> Self {
        self.momentum = momentum;
        self
    }

    /// L2 penalty added to the gradient.
    pub fn weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    /// Nesterov momentum.
    pub fn nesterov(mut self, nesterov: bool) -> Self {
        self.nesterov = nesterov;
        self
    }
}

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<()> {
        with_no_grad(|| {
            for (p, bufs) in self.params.iter().zip(&mut self.state.buffers) {
                let Some(mut g) = grad_of(p)? else { continue };
                if self.weight_decay != 0.0 {
                    g = axpy(&g, self.weight_decay, p)?;
                }
                if self.momentum != 0.0 {
                    let b = match bufs.take() {
                        Some(mut b) => axpy(&g, self.momentum, &b.remove(0))?,
                        None => g.copy()?,
                    };
                    g = if self.nesterov {
                        axpy(&g, self.momentum, &b)?
                    } else {
                        b.clone()
                    };
                    *bufs = Some(vec![b]);
                }
                p.assign(&axpy(p, -self.lr, &g)?)?;
            }
            Ok::<_, ferry_tensor::TensorError>(())
        })?;
        self.state.step += 1;
        Ok(())
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
