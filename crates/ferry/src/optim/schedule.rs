//! Learning-rate schedules: the learning rate as a function of the step, and a way to put it
//! into any [`Optimizer`].
//!
//! A schedule is a pure function of the step count ([`LrSchedule::lr`]), so a run resumed from
//! a checkpoint picks up where it stopped from the optimizer's own step count, with no
//! scheduler state to save. Steps count from 0: `lr(0)` is the rate of the first update.
//!
//! Key decision: [`Scheduled`] and [`LrSchedule::apply`] read the step from
//! [`Optimizer::steps`], which counts updates actually taken. A step skipped by a
//! [`GradScaler`](crate::amp::GradScaler) after an overflow does not advance the schedule.
//!
//! ```
//! use ferry::nn::{Linear, Module};
//! use ferry::optim::{Adam, Cosine, LrSchedule, Optimizer, Scheduled};
//! use ferry::prelude::*;
//!
//! let layer = Linear::new(3, 1, Device::Cpu)?;
//! // 10 steps of linear warmup from 0, then a cosine from 1e-2 down to 1e-4 over 90 steps.
//! let schedule = Cosine::new(1e-2, 90)?.floor(1e-4)?.with_warmup(10);
//! assert_eq!(schedule.lr(0), 0.0);
//! assert_eq!(schedule.lr(5), 5e-3);
//! assert_eq!(schedule.lr(10), 1e-2);
//! let mut opt = Scheduled::new(Adam::new(layer.parameters(), 1e-2)?, schedule);
//! let x = Tensor::rand(&[8, 3], DType::F32, Device::Cpu)?;
//! for _ in 0..3 {
//!     opt.zero_grad();
//!     layer.forward(&x)?.powf(2.0)?.mean()?.backward()?;
//!     opt.step()?; // sets lr(steps()) first, then updates
//! }
//! // The rate of the third update, lr(2) = 1e-2 · 2/10.
//! assert!((opt.learning_rate() - 2e-3).abs() < 1e-15);
//! # Ok::<(), ferry::TensorError>(())
//! ```

use std::f64::consts::PI;

use ferry_tensor::{Result, Tensor, TensorError};
use ferry_transfer::StateDict;

use super::Optimizer;
use crate::checkpoint::CheckpointError;

/// A learning rate for each step.
pub trait LrSchedule {
    /// The learning rate of update number `step` (0 for the first).
    fn lr(&self, step: u64) -> f64;

    /// Sets the optimizer's learning rate to the rate of its next update,
    /// `self.lr(optimizer.steps())`, and returns it. Call it before each
    /// [`Optimizer::step`], or wrap the optimizer in [`Scheduled`], which does.
    fn apply(&self, optimizer: &mut dyn Optimizer) -> f64 {
        let lr = self.lr(optimizer.steps());
        optimizer.set_learning_rate(lr);
        lr
    }

    /// This schedule after `steps` steps of linear warmup from 0 to its first rate (see
    /// [`Warmup`] for a warmup from a fraction instead).
    fn with_warmup(self, steps: u64) -> Warmup<Self>
    where
        Self: Sized,
    {
        Warmup::new(steps, self)
    }
}

impl<S: LrSchedule + ?Sized> LrSchedule for Box<S> {
    fn lr(&self, step: u64) -> f64 {
        (**self).lr(step)
    }
}

impl<S: LrSchedule + ?Sized> LrSchedule for &S {
    fn lr(&self, step: u64) -> f64 {
        (**self).lr(step)
    }
}

fn invalid(op: &'static str, message: String) -> TensorError {
    TensorError::InvalidArgument { op, message }
}

/// A learning rate must be a finite number at least 0.
fn check_lr(op: &'static str, what: &str, lr: f64) -> Result<f64> {
    if lr.is_finite() && lr >= 0.0 {
        Ok(lr)
    } else {
        Err(invalid(
            op,
            format!("the {what} is {lr}; a learning rate must be finite and at least 0"),
        ))
    }
}

/// One rate for every step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Constant {
    lr: f64,
}

impl Constant {
    /// The rate `lr` at every step.
    pub fn new(lr: f64) -> Result<Self> {
        Ok(Self {
            lr: check_lr("Constant", "learning rate", lr)?,
        })
    }
}

impl LrSchedule for Constant {
    fn lr(&self, _step: u64) -> f64 {
        self.lr
    }
}

/// Half a cosine from `base` down to a floor over `steps` steps, then the floor:
/// `lr(t) = floor + (base − floor)·(1 + cos(π·t/steps))/2` for `t ≤ steps`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cosine {
    base: f64,
    floor: f64,
    steps: u64,
}

impl Cosine {
    /// From `base` at step 0 down to 0 at step `steps` (at least 1).
    pub fn new(base: f64, steps: u64) -> Result<Self> {
        if steps == 0 {
            return Err(invalid(
                "Cosine",
                "the decay lasts 0 steps; give it at least 1 (use Constant for a fixed rate)"
                    .into(),
            ));
        }
        Ok(Self {
            base: check_lr("Cosine", "base rate", base)?,
            floor: 0.0,
            steps,
        })
    }

    /// Decays to `floor` (at most the base rate) instead of 0.
    pub fn floor(mut self, floor: f64) -> Result<Self> {
        check_lr("Cosine", "floor", floor)?;
        if floor > self.base {
            return Err(invalid(
                "Cosine",
                format!(
                    "the floor {floor} is above the base rate {}; a cosine decays, so give a floor at most the base rate",
                    self.base
                ),
            ));
        }
        self.floor = floor;
        Ok(self)
    }
}

impl LrSchedule for Cosine {
    fn lr(&self, step: u64) -> f64 {
        if step >= self.steps {
            return self.floor;
        }
        let progress = step as f64 / self.steps as f64;
        self.floor + (self.base - self.floor) * (1.0 + (PI * progress).cos()) / 2.0
    }
}

/// `base · gammaᵏ` where `k = ⌊t / every⌋`: the rate multiplied by `gamma` every `every` steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepDecay {
    base: f64,
    every: u64,
    gamma: f64,
}

impl StepDecay {
    /// `base` for the first `every` steps (at least 1), then times `gamma` (in `[0, 1]`) every
    /// `every` steps.
    pub fn new(base: f64, every: u64, gamma: f64) -> Result<Self> {
        if every == 0 {
            return Err(invalid(
                "StepDecay",
                "the rate would change every 0 steps; give a period of at least 1".into(),
            ));
        }
        if !(0.0..=1.0).contains(&gamma) {
            return Err(invalid(
                "StepDecay",
                format!(
                    "gamma is {gamma}; it multiplies the rate at each decay, so give a factor in [0, 1] (0.1 divides by ten)"
                ),
            ));
        }
        Ok(Self {
            base: check_lr("StepDecay", "base rate", base)?,
            every,
            gamma,
        })
    }
}

impl LrSchedule for StepDecay {
    fn lr(&self, step: u64) -> f64 {
        let k = step / self.every;
        // Repeated products, as a rate multiplied at each decay would be (exact for 0.5, 0.1·…).
        let mut lr = self.base;
        for _ in 0..k.min(i32::MAX as u64) {
            lr *= self.gamma;
            if lr == 0.0 {
                break;
            }
        }
        lr
    }
}

/// `steps` steps of linear warmup, then `after` with its step count starting at 0:
/// `lr(t) = after.lr(0)·(f + (1 − f)·t/steps)` for `t < steps` (`f` the start factor, 0
/// unless set), and `after.lr(t − steps)` from then on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Warmup<S> {
    steps: u64,
    start_factor: f64,
    after: S,
}

impl<S: LrSchedule> Warmup<S> {
    /// Warmup from 0 over `steps` steps (0 means none) into `after`.
    pub fn new(steps: u64, after: S) -> Self {
        Self {
            steps,
            start_factor: 0.0,
            after,
        }
    }

    /// Starts the warmup at `factor` (in `[0, 1]`) times the target rate instead of at 0, so
    /// the first update is not a no-op.
    pub fn start_factor(mut self, factor: f64) -> Result<Self> {
        if !(0.0..=1.0).contains(&factor) {
            return Err(invalid(
                "Warmup",
                format!(
                    "the start factor is {factor}; the warmup starts at that fraction of the target rate, so give one in [0, 1]"
                ),
            ));
        }
        self.start_factor = factor;
        Ok(self)
    }

    /// The schedule that follows the warmup.
    pub fn after(&self) -> &S {
        &self.after
    }
}

impl<S: LrSchedule> LrSchedule for Warmup<S> {
    fn lr(&self, step: u64) -> f64 {
        if step >= self.steps {
            return self.after.lr(step - self.steps);
        }
        let f = self.start_factor;
        self.after.lr(0) * (f + (1.0 - f) * step as f64 / self.steps as f64)
    }
}

/// An optimizer whose learning rate follows a schedule: each [`Optimizer::step`] first sets
/// `schedule.lr(steps())`, then updates. Everything else passes through, state dicts included
/// (the step count in them is what the schedule resumes from).
#[derive(Debug, Clone)]
pub struct Scheduled<O, S> {
    optimizer: O,
    schedule: S,
}

impl<O: Optimizer, S: LrSchedule> Scheduled<O, S> {
    /// `optimizer` driven by `schedule`. Its learning rate is set at once to the rate of its
    /// next update.
    pub fn new(mut optimizer: O, schedule: S) -> Self {
        schedule.apply(&mut optimizer);
        Self {
            optimizer,
            schedule,
        }
    }

    /// The optimizer.
    pub fn optimizer(&self) -> &O {
        &self.optimizer
    }

    /// The optimizer, mutably.
    pub fn optimizer_mut(&mut self) -> &mut O {
        &mut self.optimizer
    }

    /// The schedule.
    pub fn schedule(&self) -> &S {
        &self.schedule
    }

    /// The optimizer back, with the learning rate it last had.
    pub fn into_inner(self) -> O {
        self.optimizer
    }
}

impl<O: Optimizer, S: LrSchedule> Optimizer for Scheduled<O, S> {
    fn step(&mut self) -> Result<()> {
        self.schedule.apply(&mut self.optimizer);
        self.optimizer.step()
    }

    fn parameters(&self) -> &[Tensor] {
        self.optimizer.parameters()
    }

    fn learning_rate(&self) -> f64 {
        self.optimizer.learning_rate()
    }

    /// Sets the rate until the next step, which sets the schedule's rate again.
    fn set_learning_rate(&mut self, lr: f64) {
        self.optimizer.set_learning_rate(lr);
    }

    fn steps(&self) -> u64 {
        self.optimizer.steps()
    }

    fn state_dict(&self) -> StateDict {
        self.optimizer.state_dict()
    }

    fn clip_grad_norm(&self, max_norm: f64) -> Result<f64> {
        self.optimizer.clip_grad_norm(max_norm)
    }

    fn scale_grads(&self, factor: f64) -> Result<bool> {
        self.optimizer.scale_grads(factor)
    }

    fn zero_grad(&self) {
        self.optimizer.zero_grad();
    }

    fn zero_grad_with(&self, set_to_none: bool) -> Result<()> {
        self.optimizer.zero_grad_with(set_to_none)
    }

    /// Restores the optimizer, then sets the rate of its next update from the restored step
    /// count.
    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<(), CheckpointError> {
        self.optimizer.load_state_dict(state)?;
        self.schedule.apply(&mut self.optimizer);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_and_step_decay() -> Result<()> {
        let c = Constant::new(0.3)?;
        assert_eq!((c.lr(0), c.lr(1_000_000)), (0.3, 0.3));
        let s = StepDecay::new(1.0, 3, 0.5)?;
        let got: Vec<f64> = (0..10).map(|t| s.lr(t)).collect();
        assert_eq!(got, [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.125]);
        assert_eq!(StepDecay::new(2.0, 1, 0.0)?.lr(5), 0.0);
        Ok(())
    }

    #[test]
    fn cosine_ends_at_its_floor_and_stays() -> Result<()> {
        let c = Cosine::new(1.0, 4)?.floor(0.2)?;
        assert_eq!(c.lr(0), 1.0);
        assert_eq!(c.lr(4), 0.2);
        assert_eq!(c.lr(100), 0.2);
        // t = 2 of 4: cos(π/2) ≈ 6e-17, so the midpoint within one rounding of 0.6.
        assert!((c.lr(2) - 0.6).abs() < 1e-15, "{}", c.lr(2));
        // t = 1 of 4: 0.2 + 0.8·(1 + √2/2)/2.
        let want = 0.2 + 0.8 * (1.0 + std::f64::consts::FRAC_1_SQRT_2) / 2.0;
        assert!((c.lr(1) - want).abs() < 1e-15);
        assert!(
            (c.lr(3) - (0.2 + 0.8 * (1.0 - std::f64::consts::FRAC_1_SQRT_2) / 2.0)).abs() < 1e-15
        );
        Ok(())
    }

    #[test]
    fn warmup_then_step_decay_counts_from_the_end_of_the_warmup() -> Result<()> {
        let s = StepDecay::new(1.0, 2, 0.5)?.with_warmup(4);
        let got: Vec<f64> = (0..9).map(|t| s.lr(t)).collect();
        assert_eq!(got, [0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 0.5, 0.5, 0.25]);
        let from = Warmup::new(4, Constant::new(1.0)?).start_factor(0.5)?;
        let got: Vec<f64> = (0..6).map(|t| from.lr(t)).collect();
        assert_eq!(got, [0.5, 0.625, 0.75, 0.875, 1.0, 1.0]);
        // No warmup: the schedule itself.
        let none = Constant::new(0.1)?.with_warmup(0);
        assert_eq!(none.lr(0), 0.1);
        Ok(())
    }

    #[test]
    fn bad_arguments_are_errors_that_name_the_fix() {
        let msg = |e: TensorError| e.to_string();
        assert!(msg(Cosine::new(1.0, 0).unwrap_err()).contains("at least 1"));
        assert!(msg(Cosine::new(-1.0, 5).unwrap_err()).contains("at least 0"));
        assert!(msg(Cosine::new(1.0, 5).unwrap().floor(2.0).unwrap_err()).contains("floor"));
        assert!(msg(StepDecay::new(1.0, 0, 0.5).unwrap_err()).contains("at least 1"));
        assert!(msg(StepDecay::new(1.0, 2, 1.5).unwrap_err()).contains("[0, 1]"));
        assert!(msg(Constant::new(f64::NAN).unwrap_err()).contains("finite"));
        let w = Warmup::new(3, Constant::new(1.0).unwrap());
        assert!(msg(w.start_factor(-0.1).unwrap_err()).contains("[0, 1]"));
    }
}
