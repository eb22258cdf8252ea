//! Optimizers: SGD (momentum, weight decay, Nesterov), Adam and AdamW, with state dicts, and
//! their steps over host slices at the memory bus's speed ([`host`]);
//! learning-rate schedules ([`LrSchedule`], [`Scheduled`]), gradient clipping
//! ([`clip_grad_norm`], [`clip_grad_value`]) and a moving average of the weights ([`Ema`]).
//!
//! An optimizer holds the parameter tensors themselves (clones of a tensor are the same
//! tensor) and updates them in place under `no_grad`, so they stay the leaves the model owns.
//! Build it after moving the model to its device: [`crate::nn::Module::to`] replaces the
//! parameters.
//!
//! State dicts are tensors, so they go into the same safetensors file as the model: `step`
//! (`i64`), `lr` (`f64`) and one entry per buffer and parameter, `"{index}.{buffer}"`
//! (`"0.exp_avg"`, `"3.momentum_buffer"`), on the parameters' device.
//!
//! ```
//! use ferry::nn::{Linear, Module};
//! use ferry::optim::{Adam, Optimizer};
//! use ferry::prelude::*;
//!
//! let layer = Linear::new(3, 1, Device::Cpu)?;
//! let mut opt = Adam::new(layer.parameters(), 1e-2)?;
//! let x = Tensor::rand(&[8, 3], DType::F32, Device::Cpu)?;
//! for _ in 0..3 {
//!     opt.zero_grad();
//!     layer.forward(&x)?.powf(2.0)?.mean()?.backward()?;
//!     opt.step()?;
//! }
//! assert_eq!(opt.steps(), 3);
//! # Ok::<(), ferry::TensorError>(())
//! ```

mod adam;
mod clip;
mod ema;
pub mod host;
mod offload;
mod schedule;
mod sgd;

pub use adam::{Adam, AdamW};
pub use clip::{
    ClipOptions, clip_grad_norm, clip_grad_norm_with, clip_grad_value, grad_norm, scale_grads,
};
pub use ema::Ema;
pub use ferry_tensor::ops::optim::AdamStep;
pub use offload::{AdamHyper, OffloadAdamW, StagingReport, StepTimeline};
pub use schedule::{Constant, Cosine, LrSchedule, Scheduled, StepDecay, Warmup};
pub use sgd::Sgd;

use std::collections::BTreeSet;

use ferry_tensor::{Device, Result, Tensor, TensorError, with_no_grad};
use ferry_transfer::{DeviceMove, StateDict};

use crate::checkpoint::CheckpointError;
use crate::nn::check_state;

/// What every optimizer offers.
pub trait Optimizer {
    /// Updates every parameter that has a gradient, in place; parameters without one are
    /// skipped (their state does not advance).
    fn step(&mut self) -> Result<()>;

    /// The parameters being optimized.
    fn parameters(&self) -> &[Tensor];

    /// The learning rate.
    fn learning_rate(&self) -> f64;

    /// Changes the learning rate (for schedules).
    fn set_learning_rate(&mut self, lr: f64);

    /// Steps taken so far.
    fn steps(&self) -> u64;

    /// Step count, learning rate and every buffer, detached (see the module docs for names).
    fn state_dict(&self) -> StateDict;

    /// Restores a state dict: everything is checked first (keys, shapes, dtypes), and on error
    /// the optimizer is unchanged. Buffers are moved to their parameter's device.
    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<(), CheckpointError>;

    /// Scales this step's gradients together so that their global L2 norm is at most
    /// `max_norm`, and returns the norm they had (see [`clip_grad_norm`]). An optimizer that
    /// keeps its parameters' gradients elsewhere (optimizer offload holds them in host memory)
    /// clips them there; the default clips each parameter's `.grad()`.
    fn clip_grad_norm(&self, max_norm: f64) -> Result<f64> {
        clip_grad_norm(self.parameters(), max_norm)
    }

    /// Multiplies this step's gradients by `factor` (a [`GradScaler`](crate::amp::GradScaler)
    /// unscales with `1 / scale`) and returns whether any of them holds an infinity or a NaN.
    /// The default replaces each parameter's `.grad()` by the scaled copy; an optimizer that
    /// keeps the gradients elsewhere scales them there.
    fn scale_grads(&self, factor: f64) -> Result<bool> {
        scale_grads(self.parameters(), factor)
    }

    /// Drops every parameter's gradient (`set_to_none`): no memory is held between steps and
    /// the next backward writes fresh gradients.
    fn zero_grad(&self) {
        for p in self.parameters() {
            p.set_grad(None);
        }
    }

    /// [`Optimizer::zero_grad`], or with `set_to_none = false` gradients of zeros instead.
    fn zero_grad_with(&self, set_to_none: bool) -> Result<()> {
        for p in self.parameters() {
            let zeros = match p.grad() {
                Some(g) if !set_to_none => Some(g.zeros_like()?),
                _ => None,
            };
            p.set_grad(zeros);
        }
        Ok(())
    }
}

/// Checks that every parameter is a leaf that requires grad: anything else never receives a
/// gradient, and the optimizer would silently do nothing.
fn leaf_parameters(
    op: &'static str,
    params: impl IntoIterator<Item = Tensor>,
) -> Result<Vec<Tensor>> {
    let params: Vec<Tensor> = params.into_iter().collect();
    for (i, p) in params.iter().enumerate() {
        if !p.requires_grad() || !p.is_leaf() {
            return Err(TensorError::InvalidArgument {
                op,
                message: format!(
                    "parameter {i} ({p:?}) is not a leaf that requires grad, so it would never get a gradient; pass `model.parameters()` (after `model.to(device)`), or mark tensors with `.with_grad()?` after moving them"
                ),
            });
        }
    }
    Ok(params)
}

/// Per-parameter buffers and the step count, shared by the optimizers.
#[derive(Debug, Clone)]
struct BufferState {
    /// Buffer names, in order (`["exp_avg", "exp_avg_sq"]`).
    names: &'static [&'static str],
    /// For each parameter, its buffers once it has had a gradient.
    buffers: Vec<Option<Vec<Tensor>>>,
    step: u64,
}

impl BufferState {
    fn new(names: &'static [&'static str], params: usize) -> Self {
        Self {
            names,
            buffers: vec![None; params],
            step: 0,
        }
    }

    fn state_dict(&self, lr: f64) -> StateDict {
        let mut out = vec![
            ("step".to_string(), Tensor::scalar(self.step as i64)),
            ("lr".to_string(), Tensor::scalar(lr)),
        ];
        for (i, bufs) in self.buffers.iter().enumerate() {
            for (name, b) in self.names.iter().zip(bufs.iter().flatten()) {
                // The live buffers, as PyTorch hands them out: later steps update them in place,
                // so save (or copy) the dict before stepping on.
                out.push((format!("{i}.{name}"), b.detach()));
            }
        }
        out
    }

    /// Checks `state` against `params`, then replaces this state with it; returns the saved
    /// learning rate.
    fn load(
        &mut self,
        params: &[Tensor],
        state: &[(String, Tensor)],
    ) -> Result<f64, CheckpointError> {
        // Which parameters have buffers in the file: each of those must have all of them.
        let with_state: BTreeSet<usize> = state
            .iter()
            .filter_map(|(k, _)| k.split_once('.')?.0.parse().ok())
            .filter(|&i| i < params.len())
            .collect();
        let mut expected = vec![
            ("step".to_string(), Tensor::scalar(0i64)),
            ("lr".to_string(), Tensor::scalar(0f64)),
        ];
        for &i in &with_state {
            for name in self.names {
                expected.push((format!("{i}.{name}"), params[i].detach()));
            }
        }
        check_state("optimizer", &expected, state)?;
        let find = |key: &str| &state.iter().find(|(k, _)| k == key).expect("checked").1;
        let step = find("step").item()? as u64;
        let lr = find("lr").item()?;
        let mut buffers = vec![None; params.len()];
        for &i in &with_state {
            let device: Device = params[i].device();
            let bufs = self
                .names
                .iter()
                .map(|name| {
                    // Buffers of their own: steps update them in place, and the state passed
                    // in may be another optimizer's live buffers.
                    let saved = find(&format!("{i}.{name}")).detach();
                    with_no_grad(|| {
                        if saved.device() == device {
                            saved.copy()
                        } else {
                            saved.to(device)
                        }
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            buffers[i] = Some(bufs);
        }
        self.buffers = buffers;
        self.step = step;
        Ok(lr)
    }
}

/// `p + c·q` for the update rules (all under `no_grad`).
fn axpy(p: &Tensor, c: f64, q: &Tensor) -> Result<Tensor> {
    p.add(&q.mul_scalar(c)?)
}

/// The gradient in the parameter's dtype (a bf16 model may accumulate in another).
fn grad_of(p: &Tensor) -> Result<Option<Tensor>> {
    p.grad()
        .map(|g| {
            if g.dtype() == p.dtype() {
                Ok(g)
            } else {
                g.to_dtype(p.dtype())
            }
        })
        .transpose()
}
