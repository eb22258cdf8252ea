//! Layers, initialisers and losses: the [`Module`] trait and the blocks an MLP is made of.
//!
//! A module owns its parameters as leaf tensors that require grad. Everything that walks them
//! (the optimizer's list, `state_dict`, device moves) goes through one visitor pair,
//! [`Module::visit_parameters`] and [`Module::visit_parameters_mut`], so a layer implements two
//! short functions and gets the rest.
//!
//! Key decision: [`Module::to`] moves each parameter's *data* (`detach()`, then the move) and
//! makes the result a fresh leaf with `with_grad()`, replacing the field. A plain
//! `param.to(device)` would record a transfer node and leave the model holding non-leaf copies
//! whose gradients never reach an optimizer: the classic trap this avoids.
//!
//! ```
//! use ferry::nn::{self, Linear, Module, ReLU, Sequential};
//! use ferry::prelude::*;
//!
//! ferry::manual_seed(0);
//! let mut model = Sequential::new()
//!     .push(Linear::new(4, 8, Device::Cpu)?)
//!     .push(ReLU)
//!     .push(Linear::new(8, 3, Device::Cpu)?);
//! model.to(Device::Cpu)?;
//! let x = Tensor::rand(&[5, 4], DType::F32, Device::Cpu)?;
//! let labels = Tensor::from_slice(&[0i64, 1, 2, 1, 0], &[5])?;
//! nn::cross_entropy(&model.forward(&x)?, &labels)?.backward()?;
//! assert!(model.parameters().iter().all(|p| p.is_leaf() && p.grad().is_some()));
//! let names: Vec<String> = model.named_parameters().into_iter().map(|(n, _)| n).collect();
//! assert_eq!(names, ["0.weight", "0.bias", "2.weight", "2.bias"]);
//! # Ok::<(), ferry::TensorError>(())
//! ```

mod activation;
mod attention;
mod conv;
mod dropout;
mod embedding;
pub mod init;
mod layer_norm;
mod linear;
mod loss;
pub(crate) mod planned;
mod pool;
mod recomputed;
mod rms_norm;
mod rotary;
mod sequential;
mod state;

pub use activation::{ReLU, Tanh};
pub use attention::scaled_dot_product_attention;
pub use conv::Conv2d;
pub use dropout::Dropout;
pub use ferry_tensor::Conv2dOptions;
pub use init::Init;
pub use linear::{Activation, Dense, Linear};
pub use loss::{cross_entropy, mse};
pub use planned::PlannedChain;
pub use pool::{AvgPool2d, Flatten, MaxPool2d};
pub use recomputed::Recomputed;
pub use rms_norm::RmsNorm;
pub use rotary::{RopeScaling, Rotary};
pub use sequential::Sequential;
pub use state::{assign_state, check_state};
pub use {embedding::Embedding, layer_norm::LayerNorm};

use ferry_tensor::{Device, Result, Tensor, with_no_grad};
use ferry_transfer::{DeviceMove, StateDict};

use crate::checkpoint::CheckpointError;

/// A layer or a model: a forward function over parameters it owns.
///
/// Implement [`Module::forward`] and, for layers with parameters, the two visitors; every other
/// method is provided.
pub trait Module {
    /// The output for `input`.
    fn forward(&self, input: &Tensor) -> Result<Tensor>;

    /// Calls `f` with each parameter and its name under `prefix` (`"0."` inside a
    /// [`Sequential`]), in a fixed order.
    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        let _ = (prefix, f);
    }

    /// Like [`Module::visit_parameters`], with the fields themselves, so they can be replaced.
    fn visit_parameters_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(String, &mut Tensor) -> Result<()>,
    ) -> Result<()> {
        let _ = (prefix, f);
        Ok(())
    }

    /// Whether this module is `max(x, 0)` and nothing else, so that a [`Sequential`] may fuse
    /// it into the layer before it.
    fn is_relu(&self) -> bool {
        false
    }

    /// `relu(self.forward(input))`. Layers that can fold the ReLU into their own work override
    /// it: a [`Linear`] on a GPU applies it in its product's epilogue.
    fn forward_relu(&self, input: &Tensor) -> Result<Tensor> {
        self.forward(input)?.relu()
    }

    /// Switches training behaviour (dropout) on or off; layers without any ignore it.
    fn set_training(&mut self, training: bool) {
        let _ = training;
    }

    /// Training mode: dropout drops.
    fn train(&mut self) {
        self.set_training(true);
    }

    /// Evaluation mode: dropout passes its input through.
    fn eval(&mut self) {
        self.set_training(false);
    }

    /// The parameters with their dotted names, in visiting order (the same tensors, not copies).
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        self.visit_parameters("", &mut |name, p| out.push((name, p.clone())));
        out
    }

    /// The parameters, for an optimizer (the same tensors, not copies).
    fn parameters(&self) -> Vec<Tensor> {
        self.named_parameters()
            .into_iter()
            .map(|(_, p)| p)
            .collect()
    }

    /// Number of scalar parameters.
    fn num_parameters(&self) -> usize {
        self.parameters().iter().map(Tensor::numel).sum()
    }

    /// Moves every parameter to `device`, keeping each one a leaf that requires grad: the data
    /// is moved with `detach()` and the result marked `with_grad()` again, replacing the field
    /// (an existing `.grad` moves along). Parameters already on `device` are kept as they are.
    ///
    /// Optimizers hold the parameter tensors, so build the optimizer after moving the model.
    fn to(&mut self, device: Device) -> Result<()> {
        self.visit_parameters_mut("", &mut |_, p| {
            if p.device() == device {
                return Ok(());
            }
            let data = with_no_grad(|| p.detach().to(device))?;
            let grad = p.grad().map(|g| g.to(device)).transpose()?;
            let moved = if p.requires_grad() {
                data.with_grad()?
            } else {
                data
            };
            moved.set_grad(grad);
            *p = moved;
            Ok(())
        })
    }

    /// Drops every parameter's gradient (`set_to_none`): the next backward starts fresh and
    /// no memory is kept between steps.
    fn zero_grad(&self) {
        self.visit_parameters("", &mut |_, p| p.set_grad(None));
    }

    /// The parameters by name, detached: they share the parameters' storage (no copy), so save
    /// or copy them before the next optimizer step if a snapshot is meant.
    fn state_dict(&self) -> StateDict {
        let mut out = Vec::new();
        self.visit_parameters("", &mut |name, p| out.push((name, p.detach())));
        out
    }

    /// Copies `state` into the parameters, in place (they stay the same leaves, so an
    /// optimizer holding them keeps working). Every key, shape and dtype is checked before
    /// anything is written: on error the model is unchanged, and the error lists each missing
    /// or unexpected key and each shape or dtype mismatch. Tensors on another device are moved
    /// to the parameters' device.
    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<(), CheckpointError> {
        let params = self.named_parameters();
        check_state("model", &params, state)?;
        assign_state(&params, state)
    }
}

impl<M: Module + ?Sized> Module for Box<M> {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        (**self).forward(input)
    }

    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        (**self).visit_parameters(prefix, f);
    }

    fn visit_parameters_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(String, &mut Tensor) -> Result<()>,
    ) -> Result<()> {
        (**self).visit_parameters_mut(prefix, f)
    }

    fn set_training(&mut self, training: bool) {
        (**self).set_training(training);
    }
}
