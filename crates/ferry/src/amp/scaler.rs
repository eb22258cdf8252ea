//! Dynamic loss scaling for `f16` training.

use std::borrow::Borrow;

use ferry_tensor::{DType, Result, Tensor, TensorError};
use ferry_transfer::StateDict;

use crate::checkpoint::CheckpointError;
use crate::nn::check_state;
use crate::optim::{Optimizer, scale_grads};

/// Dynamic loss scaling: backward from `loss · scale` so that small `f16` gradients do not
/// flush to zero, gradients divided by `scale` before the step, steps with an infinity or a
/// NaN in any gradient skipped, and `scale` adapted: multiplied by `backoff_factor` (0.5)
/// after an overflow, by `growth_factor` (2) after `growth_interval` (2000) steps in a row
/// without one. It starts at 2¹⁶.
///
/// One iteration is [`scale`](Self::scale) the loss, backward, optionally
/// [`unscale`](Self::unscale) (to clip the true gradients), [`step`](Self::step), then
/// [`update`](Self::update):
///
/// ```
/// use ferry::amp::{GradScaler, autocast};
/// use ferry::nn::{Linear, Module};
/// use ferry::optim::{Optimizer, Sgd, clip_grad_norm};
/// use ferry::prelude::*;
///
/// let layer = Linear::new(4, 1, Device::Cpu)?;
/// let mut opt = Sgd::new(layer.parameters(), 0.1)?;
/// let mut scaler = GradScaler::new();
/// let x = Tensor::randn(&[8, 4], DType::F32, Device::Cpu)?;
/// for _ in 0..3 {
///     opt.zero_grad();
///     let loss = autocast(DType::F16, || layer.forward(&x)?.powf(2.0)?.mean())?;
///     scaler.scale(&loss)?.backward()?;
///     scaler.unscale(&opt)?; // the gradients are now the true ones
///     clip_grad_norm(opt.parameters(), 1.0)?;
///     scaler.step(&mut opt)?; // skipped if a gradient overflowed
///     scaler.update()?;
/// }
/// // The first f16 gradients, 2^16 times the true ones, may overflow: each such step is
/// // skipped and halves the scale.
/// let skipped = 3 - opt.steps() as i32;
/// assert_eq!(scaler.scale_factor(), 65536.0 * 0.5f64.powi(skipped));
/// # Ok::<(), ferry::TensorError>(())
/// ```
///
/// Finiteness is checked with one sum per gradient, gathered into one number per device and
/// read back once per device (once for a model on one device). A gradient whose finite
/// elements sum beyond the `f32` range counts as an overflow too.
#[derive(Debug, Clone, PartialEq)]
pub struct GradScaler {
    scale: f64,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: u64,
    /// Steps in a row without an overflow since the scale last changed.
    growth_tracker: u64,
    /// This iteration's finding, once the gradients were unscaled: `Some(true)` on overflow.
    found_inf: Option<bool>,
    /// Whether `step` ran this iteration.
    stepped: bool,
}

impl Default for GradScaler {
    fn default() -> Self {
        Self::new()
    }
}

fn invalid(message: String) -> TensorError {
    TensorError::InvalidArgument {
        op: "GradScaler",
        message,
    }
}

impl GradScaler {
    /// Scale 2¹⁶, growth factor 2, backoff factor 0.5, growth interval 2000.
    pub fn new() -> Self {
        Self {
            scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            growth_tracker: 0,
            found_inf: None,
            stepped: false,
        }
    }

    /// Starts from `scale` (finite, above 0) instead of 2¹⁶.
    pub fn init_scale(mut self, scale: f64) -> Result<Self> {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(invalid(format!(
                "the initial scale is {scale}; give a finite number above 0 (2^16 = 65536 is the default)"
            )));
        }
        self.scale = scale;
        Ok(self)
    }

    /// Multiplies the scale by `factor` (above 1) after `growth_interval` clean steps.
    pub fn growth_factor(mut self, factor: f64) -> Result<Self> {
        if !(factor.is_finite() && factor > 1.0) {
            return Err(invalid(format!(
                "the growth factor is {factor}; it raises the scale, so give a finite number above 1 (2 is the default)"
            )));
        }
        self.growth_factor = factor;
        Ok(self)
    }

    /// Multiplies the scale by `factor` (in `(0, 1)`) after an overflow.
    pub fn backoff_factor(mut self, factor: f64) -> Result<Self> {
        if !(factor > 0.0 && factor < 1.0) {
            return Err(invalid(format!(
                "the backoff factor is {factor}; it lowers the scale, so give a number strictly between 0 and 1 (0.5 is the default)"
            )));
        }
        self.backoff_factor = factor;
        Ok(self)
    }

    /// Grows the scale after `steps` (at least 1) steps in a row without an overflow.
    pub fn growth_interval(mut self, steps: u64) -> Result<Self> {
        if steps == 0 {
            return Err(invalid(
                "the growth interval is 0 steps; give at least 1 (2000 is the default)".into(),
            ));
        }
        self.growth_interval = steps;
        Ok(self)
    }

    /// The current scale.
    pub fn scale_factor(&self) -> f64 {
        self.scale
    }

    /// Steps in a row without an overflow since the scale last changed.
    pub fn growth_tracker(&self) -> u64 {
        self.growth_tracker
    }

    /// Whether this iteration's gradients held an infinity or a NaN (`None` before
    /// [`unscale`](Self::unscale) or [`step`](Self::step) looked at them).
    pub fn found_inf(&self) -> Option<bool> {
        self.found_inf
    }

    /// `loss · scale`, recorded, in `f32` (a low-precision loss is cast up first: 2¹⁶ does
    /// not fit in `f16`), to call `backward` on.
    pub fn scale(&self, loss: &Tensor) -> Result<Tensor> {
        let loss = match loss.dtype() {
            DType::F16 | DType::BF16 => loss.to_dtype(DType::F32)?,
            _ => loss.clone(),
        };
        loss.mul_scalar(self.scale)
    }

    /// Divides this step's gradients by the scale ([`Optimizer::scale_grads`]: each
    /// parameter's `.grad()` is replaced by the divided copy, or the optimizer divides the
    /// gradients it holds) and records whether any of them holds an infinity or a NaN, which
    /// it returns. At most once per iteration: [`step`](Self::step) calls it when it was not
    /// called.
    pub fn unscale(&mut self, optimizer: &dyn Optimizer) -> Result<bool> {
        self.check_not_unscaled()?;
        let found = optimizer.scale_grads(1.0 / self.scale)?;
        self.found_inf = Some(found);
        Ok(found)
    }

    /// [`unscale`](Self::unscale) for parameters given directly.
    pub fn unscale_params<T: Borrow<Tensor>>(
        &mut self,
        params: impl IntoIterator<Item = T>,
    ) -> Result<bool> {
        self.check_not_unscaled()?;
        let found = scale_grads(params, 1.0 / self.scale)?;
        self.found_inf = Some(found);
        Ok(found)
    }

    fn check_not_unscaled(&self) -> Result<()> {
        if self.found_inf.is_some() {
            return Err(invalid(
                "the gradients were already unscaled in this iteration; call update() after step() before unscaling again".into(),
            ));
        }
        Ok(())
    }

    /// Unscales the gradients unless [`unscale`](Self::unscale) already did in this iteration,
    /// then steps the optimizer if they are all finite; returns whether it stepped. A skipped
    /// step leaves the parameters and the optimizer's state (its step count included)
    /// untouched.
    pub fn step(&mut self, optimizer: &mut dyn Optimizer) -> Result<bool> {
        if self.stepped {
            return Err(invalid(
                "step() was already called in this iteration; call update() after each step()"
                    .into(),
            ));
        }
        let found = match self.found_inf {
            Some(found) => found,
            None => self.unscale(optimizer)?,
        };
        self.stepped = true;
        if found {
            return Ok(false);
        }
        optimizer.step()?;
        Ok(true)
    }

    /// Adapts the scale to this iteration and starts the next: after an overflow the scale is
    /// multiplied by the backoff factor, after `growth_interval` clean steps in a row by the
    /// growth factor. An error if the gradients were not looked at since the last update
    /// (call [`step`](Self::step) first).
    pub fn update(&mut self) -> Result<()> {
        let Some(found) = self.found_inf else {
            return Err(invalid(
                "update() found no unscaled gradients in this iteration; call step(optimizer) (or unscale) after backward and before update()".into(),
            ));
        };
        if found {
            self.scale *= self.backoff_factor;
            self.growth_tracker = 0;
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker >= self.growth_interval {
                self.scale *= self.growth_factor;
                self.growth_tracker = 0;
            }
        }
        self.found_inf = None;
        self.stepped = false;
        Ok(())
    }

    /// The scale (`f64`) and the growth tracker (`i64`), to save beside the optimizer's.
    pub fn state_dict(&self) -> StateDict {
        vec![
            ("scale".to_string(), Tensor::scalar(self.scale)),
            (
                "growth_tracker".to_string(),
                Tensor::scalar(self.growth_tracker as i64),
            ),
        ]
    }

    /// Restores [`state_dict`](Self::state_dict)'s entries; on error nothing changes.
    pub fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<(), CheckpointError> {
        let expected = self.state_dict();
        check_state("GradScaler", &expected, state)?;
        let find = |key: &str| &state.iter().find(|(k, _)| k == key).expect("checked").1;
        let scale = find("scale").item()?;
        let tracker = find("growth_tracker").item()?;
        if !(scale.is_finite() && scale > 0.0) || tracker < 0.0 {
            return Err(CheckpointError::from(invalid(format!(
                "the saved scale is {scale} and growth tracker {tracker}; a scale is finite and above 0 and the tracker at least 0, so this state is not a GradScaler's"
            ))));
        }
        self.scale = scale;
        self.growth_tracker = tracker as u64;
        self.found_inf = None;
        self.stepped = false;
        Ok(())
    }
}
