//! [`OffloadAdamW`] as an [`Optimizer`]: the step, clipping and unscaling of held gradients,
//! and the state dict.

use std::time::Instant;

use ferry_memory::{DType, Device};
use ferry_tensor::{Result, Tensor};
use ferry_transfer::StateDict;

use super::{OffloadAdamW, Pending, invalid};
use crate::checkpoint::CheckpointError;
use crate::nn::check_state;
use crate::optim::Optimizer;

impl Optimizer for OffloadAdamW {
    fn step(&mut self) -> Result<()> {
        let shared = &self.shared;
        self.send_set_gradients()?;
        let (delayed, hold) = {
            let hyper = shared.hyper.lock();
            (hyper.delayed, hyper.hold)
        };
        if hold {
            self.step_held()?;
        }
        if delayed {
            // The CPU's passes go on beside the next forward; the weights it reads are uploaded.
            shared.wait(|f| f.owed == 0);
        } else {
            shared.wait(|f| f.stepping == 0);
        }
        shared.hyper.lock().steps += 1;
        let mut timeline = std::mem::take(&mut *shared.timeline.lock());
        timeline.returned = Some(Instant::now());
        *self.last_timeline.lock() = timeline;
        shared.take_error("OffloadAdamW::step")
    }

    fn parameters(&self) -> &[Tensor] {
        &self.shared.params
    }

    /// Clips the held gradients (see [`OffloadAdamW::hold_gradients`]; an error without
    /// them): their global norm comes from the sums of squares taken as they landed, and the
    /// scaling is applied in the step's pass. A norm that is not finite leaves them as they
    /// are, as [`clip_grad_norm`](crate::optim::clip_grad_norm) does.
    fn clip_grad_norm(&self, max_norm: f64) -> Result<f64> {
        const OP: &str = "OffloadAdamW::clip_grad_norm";
        if !(max_norm.is_finite() && max_norm > 0.0) {
            return Err(invalid(
                OP,
                format!("max_norm is {max_norm}; give a finite number above 0 (1.0 is common)"),
            ));
        }
        let norm = self.held_sumsq(OP)?.sqrt();
        if norm.is_finite() && norm > max_norm {
            self.shared.hyper.lock().held_scale *= max_norm / (norm + 1e-6);
        }
        Ok(norm)
    }

    /// Scales the held gradients (see [`OffloadAdamW::hold_gradients`]; an error without
    /// them) in the step's pass; whether any holds an infinity or a NaN.
    fn scale_grads(&self, factor: f64) -> Result<bool> {
        let sumsq = self.held_sumsq("OffloadAdamW::scale_grads")?;
        self.shared.hyper.lock().held_scale *= factor;
        Ok(!(sumsq * factor * factor).is_finite())
    }

    /// Drops the gradients: those on the parameters and, with held gradients, those held for
    /// this step (after a step skipped for an overflow, say).
    fn zero_grad(&self) {
        for p in &self.shared.params {
            p.set_grad(None);
        }
        self.drop_held();
    }

    /// Held gradients cannot be zeros on the GPU: both forms drop them.
    fn zero_grad_with(&self, _set_to_none: bool) -> Result<()> {
        self.zero_grad();
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.shared.hyper.lock().adam.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.shared.hyper.lock().adam.lr = lr;
    }

    fn steps(&self) -> u64 {
        self.shared.hyper.lock().steps
    }

    /// AdamW's names (`step`, `lr`, `{i}.exp_avg`, `{i}.exp_avg_sq`) plus `{i}.master`, the
    /// fp32 master weights, as host tensors (copies: the state keeps changing).
    fn state_dict(&self) -> StateDict {
        // The steps counted so far, whole (the delayed update's may still be running).
        self.shared.wait(|f| f.stepping == 0);
        let hyper = *self.shared.hyper.lock();
        let mut out = vec![
            ("step".to_string(), Tensor::scalar(hyper.steps as i64)),
            ("lr".to_string(), Tensor::scalar(hyper.adam.lr)),
        ];
        for (i, (slot, p)) in self
            .shared
            .slots
            .iter()
            .zip(&self.shared.params)
            .enumerate()
        {
            let slot = slot.lock();
            let tensor =
                |v: &[f32]| Tensor::from_slice(v, p.shape()).expect("the parameter's shape");
            if slot.stepped > 0 {
                out.push((format!("{i}.exp_avg"), tensor(&slot.exp_avg)));
                out.push((format!("{i}.exp_avg_sq"), tensor(&slot.exp_avg_sq)));
            }
            out.push((format!("{i}.master"), tensor(&slot.master)));
        }
        out
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<(), CheckpointError> {
        self.shared.wait(|f| f.stepping == 0 && f.owed == 0);
        let f32_like = |p: &Tensor| Tensor::zeros(p.shape(), DType::F32, Device::Cpu);
        let mut expected = vec![
            ("step".to_string(), Tensor::scalar(0i64)),
            ("lr".to_string(), Tensor::scalar(0f64)),
        ];
        for (i, p) in self.shared.params.iter().enumerate() {
            let has = |name: &str| state.iter().any(|(k, _)| *k == format!("{i}.{name}"));
            let names: &[&str] = if has("exp_avg") {
                &["exp_avg", "exp_avg_sq", "master"]
            } else {
                &["master"]
            };
            for name in names {
                expected.push((format!("{i}.{name}"), f32_like(p)?));
            }
        }
        check_state("optimizer", &expected, state)?;
        let find = |key: &str| &state.iter().find(|(k, _)| k == key).expect("checked").1;
        for (i, slot) in self.shared.slots.iter().enumerate() {
            let mut slot = slot.lock();
            slot.master = find(&format!("{i}.master")).to_vec::<f32>()?;
            let key = format!("{i}.exp_avg");
            if state.iter().any(|(k, _)| *k == key) {
                slot.exp_avg = find(&key).to_vec::<f32>()?;
                slot.exp_avg_sq = find(&format!("{i}.exp_avg_sq")).to_vec::<f32>()?;
            } else {
                slot.exp_avg.fill(0.0);
                slot.exp_avg_sq.fill(0.0);
            }
            slot.stepped = 0;
            slot.landed = 0;
            // Weights held back by the delayed update belong to the replaced state.
            *self.shared.pending[i].lock() = Pending::default();
        }
        let mut hyper = self.shared.hyper.lock();
        hyper.steps = find("step").item()? as u64;
        hyper.adam.lr = find("lr").item()?;
        Ok(())
    }
}
