//! Held gradients ([`OffloadAdamW::hold_gradients`]): what the step thread is handed, and the
//! optimizer's side of clipping, unscaling and dropping the gradients held for a step.

use ferry_tensor::Result;

use super::{OffloadAdamW, invalid};

/// What the step thread does with a parameter it is handed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Job {
    /// Steps it from the gradient in its landing buffer.
    Step,
    /// [`OffloadAdamW::hold_gradients`]: adds the gradient in its landing buffer to the one
    /// held for this step.
    Land,
    /// [`OffloadAdamW::hold_gradients`], a parameter's first gradient of a step: holds it
    /// where it landed, taking only its sum of squares (its landing buffer stays taken until
    /// the step, or until a second gradient has it copied out: [`Job::Spill`]).
    LandInPlace,
    /// Copies a gradient held in place into the parameter's held gradient, freeing its landing
    /// buffer for the next backward pass's gradient.
    Spill,
    /// [`OffloadAdamW::hold_gradients`], at `step()`: steps it from the held gradient times
    /// `scale` (the product of unscaling and clipping).
    StepHeld { scale: f32 },
}

impl Job {
    /// Whether it reads the landing buffer.
    pub(super) fn reads_landing(self) -> bool {
        matches!(self, Job::Step | Job::Land | Job::LandInPlace | Job::Spill)
    }

    /// Whether it takes a step of AdamW.
    pub(super) fn steps(self) -> bool {
        matches!(self, Job::Step | Job::StepHeld { .. })
    }
}

impl OffloadAdamW {
    /// Sends down the gradients set without a backward (no hook ran for them).
    pub(super) fn send_set_gradients(&self) -> Result<()> {
        let queue = self.queue.as_ref().expect("present until drop");
        for (i, p) in self.shared.params.iter().enumerate() {
            if let Some(grad) = p.grad() {
                self.shared.send_down(i, &grad, queue)?;
            }
        }
        Ok(())
    }

    /// With held gradients: waits until every gradient handed over has been added, and gives
    /// the sum of the squares of this step's held gradients as they will be stepped (times
    /// the scale so far). An error without held gradients, naming the fix.
    pub(super) fn held_sumsq(&self, op: &'static str) -> Result<f64> {
        if !self.shared.hyper.lock().hold {
            return Err(invalid(
                op,
                "OffloadAdamW steps each gradient as backward produces it, so by now the \
                 gradients are stepped and gone: build it with `.hold_gradients(true)` \
                 (Python: `hold_gradients=True`) to clip or unscale them, or to accumulate them \
                 over several backward passes"
                    .into(),
            ));
        }
        self.send_set_gradients()?;
        self.shared.wait(|f| f.stepping == 0);
        self.shared.take_error(op)?;
        let sumsq: f64 = self
            .shared
            .slots
            .iter()
            .map(|s| {
                let s = s.lock();
                if s.landed > 0 { s.sumsq } else { 0.0 }
            })
            .sum();
        let scale = self.shared.hyper.lock().held_scale;
        Ok(sumsq * scale * scale)
    }

    /// With held gradients, at `step()`: hands every parameter with a held gradient to the step
    /// thread, to be stepped with this step's scale.
    pub(super) fn step_held(&self) -> Result<()> {
        let shared = &self.shared;
        shared.wait(|f| f.stepping == 0);
        let scale = {
            let mut hyper = shared.hyper.lock();
            hyper.held_pending = false;
            std::mem::replace(&mut hyper.held_scale, 1.0)
        };
        let queue = self.queue.as_ref().expect("present until drop");
        let job = Job::StepHeld {
            scale: scale as f32,
        };
        // The next backward's gradients are the next step's.
        shared.flight.lock().lands.fill(0);
        for (i, slot) in shared.slots.iter().enumerate() {
            let adam = {
                let slot = slot.lock();
                slot.held_adam.filter(|_| slot.landed > 0)
            };
            if let Some(adam) = adam {
                shared.hand_over(i, adam, None, job, queue)?;
            }
        }
        Ok(())
    }

    /// Drops the gradients held since the last step, if any (so a `zero_grad` after a step
    /// does not wait for the delayed update's passes).
    pub(super) fn drop_held(&self) {
        if !self.shared.hyper.lock().held_pending {
            return;
        }
        self.shared.wait(|f| f.stepping == 0);
        self.shared.hyper.lock().held_pending = false;
        for (i, slot) in self.shared.slots.iter().enumerate() {
            let mut slot = slot.lock();
            slot.landed = 0;
            // A gradient held in place lets go of its landing buffer.
            let in_landing = std::mem::take(&mut slot.in_landing);
            drop(slot);
            if in_landing {
                self.shared.settle(|f| f.unread[i] = false);
            }
        }
        self.shared.flight.lock().lands.fill(0);
        self.shared.hyper.lock().held_scale = 1.0;
    }
}
