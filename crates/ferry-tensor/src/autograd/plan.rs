//! A memory plan for a step's saved activations: each region of the forward (a model's blocks,
//! run one after another) keeps what its rules save on the device, offloads it to host memory, or
//! recomputes it in backward, chosen from costs measured in one profiled step so that the
//! activation bytes at the step's peak fit a target at the least predicted extra time. This is
//! ferry's one planner: ferry's own models use it, and so does `ferry.plan` for PyTorch models
//! (through `ferry._ferry.plan_memory`), which only measures and applies.
//!
//! # The cost model
//!
//! A step ([`StepCost`]) is its regions in forward order ([`RegionCost`]), the bytes alive through
//! the regions' backward that no single region owns (`shared_bytes`, plus every region's
//! `input_bytes`), the bytes saved after the last region and freed before the regions' backward
//! (`head_bytes`: the loss's), the gradients of the parameters outside the regions
//! (`outside_grad_bytes`), the link to host memory (none: nothing is offloaded) and the host
//! memory offload may take (`host_bytes`, none: no bound).
//!
//! A region holds on the device from its forward until its backward: kept, its `saved_bytes`;
//! offloaded, the part of them offload cannot move (`saved_bytes - offloadable_bytes`);
//! recomputed, the input bytes nothing else saves (`unsaved_input_bytes`); recomputed
//! selectively, what [`Selective::held_bytes`] measured (its expensive ops' outputs and its
//! unsaved input), or with those outputs offloaded, its unsaved input. The currency is the
//! activation bytes at the step's peak, the larger of
//!
//! - the end of the forward: shared + head + what every region holds (and, for a region not
//!   kept, its `cached_bytes`: autocast's casts of its parameters, cached for the forward), and
//! - each region `k`'s backward: shared + what the regions before `k` hold + `k`'s saved bytes
//!   (back: kept, uploaded or rebuilt; plus its unsaved input if recomputed, selectively or
//!   whole) + region `k-1`'s moved bytes if it is offloaded (its offloadable bytes, or a
//!   selective recompute's kept outputs; uploaded while `k`'s backward runs) + the gradients of
//!   the regions after `k` and of the parameters outside the regions.
//!
//! So recomputing the last region frees nothing when nothing follows it (its bytes come back
//! while every earlier region still holds its own).
//!
//! Where the profile measured the step's device memory without a plan ([`MeasuredPeaks`]: the
//! most over the forward, and over each region's backward), the peak is predicted from those
//! figures instead, which count what the sums above leave out (a backward's temporaries, the
//! loss's logits, inputs freed once their region is through backward): the forward's peak less
//! the bytes every region's choice frees (all but its `cached_bytes` until the forward ends), and
//! each region `k`'s backward peak less what the regions before `k` free, plus its unsaved input
//! if recomputed and region `k-1`'s moved bytes. The target and the peaks are then device bytes
//! above the step's start, as the profile measured them.
//!
//! - **Recompute** costs the region's forward milliseconds again; a region that writes its input
//!   in place (`recomputable: false`) is never recomputed.
//! - **Selective** recompute costs its measured [`Selective::extra_ms`]: the cheap ops run again,
//!   the expensive ones' outputs kept. Only where the profile measured it, never where the
//!   region writes its input in place. With its kept outputs offloaded
//!   ([`Choice::SelectiveOffload`]), it holds what a whole recompute holds at a selective
//!   recompute's cost, where the link moves those outputs as an offload's.
//! - **Offload** is free where the link hides it, and only chosen there: the copies out queue on
//!   the link in forward order from the end of each offloaded region and must all be done by the
//!   end of the forward (from each offloaded region on, their bytes over the rate to host fit the
//!   forward milliseconds after it); region `i`'s copy back starts when region `i+1`'s backward
//!   starts and must land before region `i`'s (its bytes over the rate to device fit `i+1`'s
//!   backward milliseconds, plus what a recompute of `i+1` adds). The last region, with no
//!   compute after it, is never offloaded; the offloaded bytes fit `host_bytes`. A backward not
//!   measured is taken as twice the forward.
//! - **Keep** costs nothing.
//!
//! The choice: from keeping everything, offload the earliest regions first (they have the widest
//! windows) while each fits and does not raise the peak, until the target is met; then
//! recompute, each time the move (a kept region recomputed selectively or whole, a selective one
//! whole) that lowers the peak at the least milliseconds per byte, except that the last pick is
//! the cheapest move that alone reaches the target where that costs less (where no move lowers
//! the peak, the one freeing the most bytes per millisecond of its own); then drop the recomputes
//! the target no longer needs, turn them into offloads that now fit (a recompute lengthens the
//! window of the region before it), or whole ones into selective ones, the most expensive first.
//! The least reachable peak comes from recomputing every region that frees bytes so, offloading
//! instead where that fits and does not raise the peak, keeping where that does not raise it
//! either, and recomputing selectively where that does not. A target below it plans that least peak and says so
//! ([`MemoryPlan::reached`], [`MemoryPlan::least_bytes`]); a target of 0, above the plain step's
//! peak, or a step whose regions save nothing is an error.

use std::fmt;

use crate::{Result, TensorError};

mod cost;
#[cfg(test)]
mod tests;

const OP: &str = "memory plan";

/// What one region of the forward costs, from a profiled step. [`RegionCost::new`] gives the
/// three figures every profile has; the rest default to: backward twice the forward, all saved
/// bytes offloadable, no unsaved input, recomputable, no gradients.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RegionCost {
    /// Milliseconds of its forward: what recomputing it costs again in backward.
    pub forward_ms: f64,
    /// Bytes only its rules save, not the input of any region (each buffer once): what keeping it
    /// holds and offloading or recomputing it frees.
    pub saved_bytes: u64,
    /// Bytes of its input that stay on the device whatever the plan chooses (its rules save it,
    /// or the region before keeps it): counted with the step's shared bytes.
    pub input_bytes: u64,
    /// Milliseconds of its backward, as measured; `None`: twice the forward.
    pub backward_ms: Option<f64>,
    /// The part of `saved_bytes` offload can move; `None`: all of it.
    pub offloadable_bytes: Option<u64>,
    /// Bytes of its input that nothing saves: held from the forward to the backward only when the
    /// region is recomputed (the recompute starts from them).
    pub unsaved_input_bytes: u64,
    /// False where the region writes its input in place: a recompute would read the new values.
    pub recomputable: bool,
    /// Bytes of the gradients its backward gives its parameters.
    pub grad_bytes: u64,
    /// What a selective recompute of the region holds and costs, where one was measured: its
    /// expensive ops' outputs kept (matrix products, attention), the rest rebuilt in backward.
    pub selective: Option<Selective>,
    /// The part of `saved_bytes` alive until the end of the forward whatever is chosen: casts of
    /// the parameters that an autocast scope caches for the whole forward (offloading or
    /// recomputing the region frees them only once the forward is over).
    pub cached_bytes: u64,
    /// Milliseconds offloading the region adds to the step, where a step with it offloaded was
    /// measured (the runtime's waits for its copies); `None`: none, the copies hidden in compute.
    pub offload_extra_ms: Option<f64>,
}

/// A region run with its expensive ops' outputs kept and its cheap ops (norms, activations,
/// element-wise) run again in backward, as measured in a profiled step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Selective {
    /// Bytes held from the forward to the backward: the kept outputs and the unsaved input.
    pub held_bytes: u64,
    /// Milliseconds the recompute of the cheap ops adds to the step.
    pub extra_ms: f64,
    /// The part of `held_bytes` a selective offload sends to host memory (the kept outputs);
    /// 0 where the region cannot offload them, so the plan never chooses it.
    pub offloadable_bytes: u64,
    /// Milliseconds a selective recompute with its kept outputs offloaded adds to the step,
    /// where measured; `None`: `extra_ms`, the copies hidden in compute.
    pub offload_extra_ms: Option<f64>,
}

impl RegionCost {
    /// A region of `forward_ms`, `saved_bytes` beyond its input and `input_bytes` of input, the
    /// other figures at their defaults.
    pub fn new(forward_ms: f64, saved_bytes: u64, input_bytes: u64) -> Self {
        Self {
            forward_ms,
            saved_bytes,
            input_bytes,
            ..Self::default()
        }
    }

    /// Milliseconds of its backward: as measured, else twice the forward.
    pub fn backward(&self) -> f64 {
        self.backward_ms.unwrap_or(2.0 * self.forward_ms)
    }

    /// Bytes offload moves: `offloadable_bytes`, else all saved bytes.
    pub fn offloadable(&self) -> u64 {
        self.offloadable_bytes.unwrap_or(self.saved_bytes)
    }
}

impl Default for RegionCost {
    fn default() -> Self {
        Self {
            forward_ms: 0.0,
            saved_bytes: 0,
            input_bytes: 0,
            backward_ms: None,
            offloadable_bytes: None,
            unsaved_input_bytes: 0,
            recomputable: true,
            grad_bytes: 0,
            selective: None,
            cached_bytes: 0,
            offload_extra_ms: None,
        }
    }
}

/// A profiled step: its regions and what lies outside them; see the module docs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepCost {
    /// The regions, in forward order.
    pub regions: Vec<RegionCost>,
    /// Saved bytes no single region owns (what several regions or the code before them save),
    /// alive through the regions' backward.
    pub shared_bytes: u64,
    /// Bytes saved after the last region (the loss's), freed before the regions' backward.
    pub head_bytes: u64,
    /// Gradients of the parameters outside the regions, counted from the regions' backward on.
    pub outside_grad_bytes: u64,
    /// The link to host memory; `None` where nothing can be offloaded (a CPU).
    pub link: Option<Link>,
    /// The host memory offload may take; `None`: no bound.
    pub host_bytes: Option<u64>,
    /// The device memory the profiled step took without a plan, where it was measured: the peak
    /// is then predicted from it (see the module docs) and counts everything the step allocates.
    pub measured: Option<MeasuredPeaks>,
}

/// What a profiled step without a plan was seen to take on the device, in bytes above what was
/// allocated when it started (its gradients set to none before it, as `zero_grad` leaves them):
/// the most over each phase of the step, whatever held it (saved tensors, gradients, the
/// loss's logits, a backward's temporaries).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MeasuredPeaks {
    /// From the step's start until the last region's backward starts: the forward and the
    /// backward of what follows the regions (the loss's).
    pub forward_bytes: u64,
    /// Per region, in forward order: from the start of its backward until the start of the
    /// backward of the region before it (the first region's: until the step's end).
    pub backward_bytes: Vec<u64>,
}

impl StepCost {
    /// A step of `regions` alone over `link`.
    pub fn new(regions: &[RegionCost], link: Option<Link>) -> Self {
        Self {
            regions: regions.to_vec(),
            link,
            ..Self::default()
        }
    }
}

/// The link between the device and host memory, as measured: bytes per millisecond each way
/// (1 GB/s is 1e6 bytes per millisecond).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Device to host.
    pub to_host_bytes_per_ms: f64,
    /// Host to device.
    pub to_device_bytes_per_ms: f64,
}

impl Link {
    /// A link of `to_host` and `to_device` GB/s.
    pub fn gb_per_s(to_host: f64, to_device: f64) -> Self {
        Self {
            to_host_bytes_per_ms: to_host * 1e6,
            to_device_bytes_per_ms: to_device * 1e6,
        }
    }
}

/// What a region does with what its rules save.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Choice {
    /// Left on the device.
    Keep,
    /// Moved to host memory during the forward, brought back ahead of backward.
    Offload,
    /// Dropped, and the region's forward run again in backward from its input.
    Recompute,
    /// Its expensive ops' outputs kept, the rest dropped and rebuilt in backward from them and
    /// the region's input (only where [`RegionCost::selective`] was measured).
    Selective,
    /// Selective, with the kept outputs moved to host memory in the forward and brought back
    /// ahead of the region's backward, as an offload's.
    SelectiveOffload,
}

impl fmt::Display for Choice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Choice::Keep => "keep",
            Choice::Offload => "offload",
            Choice::Recompute => "recompute",
            Choice::Selective => "selective",
            Choice::SelectiveOffload => "selective_offload",
        })
    }
}

/// One region's place in a plan.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlannedRegion {
    /// What the plan does with the region's saved bytes.
    pub choice: Choice,
    /// Its measured cost.
    pub cost: RegionCost,
    /// Milliseconds the choice is predicted to add to the step (a recompute's forward; an
    /// offload the planner chooses adds none).
    pub extra_ms: f64,
}

/// A choice for every region and what it is predicted to cost; see the module docs.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryPlan {
    regions: Vec<PlannedRegion>,
    target_bytes: u64,
    peak_bytes: u64,
    plain_bytes: u64,
    least_bytes: u64,
    extra_ms: f64,
    step_ms: f64,
    offload_fits: bool,
}

impl MemoryPlan {
    /// Plans `regions` (in forward order, nothing outside them) for at most `target_bytes` of
    /// activations at the peak; `link` is `None` where nothing can be offloaded (a CPU). See
    /// [`MemoryPlan::for_step`].
    pub fn new(regions: &[RegionCost], link: Option<Link>, target_bytes: u64) -> Result<Self> {
        Self::for_step(&StepCost::new(regions, link), target_bytes)
    }

    /// Plans `step` for at most `target_bytes` of activations at the peak. A target at the plain
    /// step's peak keeps everything; a target below the least the regions can reach plans that
    /// least and says so ([`MemoryPlan::reached`]). A target of 0 or above the plain peak, regions
    /// that save nothing, no regions, or a cost that is not finite and non-negative is an error.
    pub fn for_step(step: &StepCost, target_bytes: u64) -> Result<Self> {
        check(step)?;
        let least = step.least_choices();
        let least_bytes = step.peak_bytes(&least);
        check_target(step, target_bytes, least_bytes)?;
        let choices = step.choose(target_bytes, least);
        Ok(Self::from_choices(step, choices, target_bytes, least_bytes))
    }

    /// What `choices` (one per region, as forced by a caller) are predicted to give, with the
    /// target at their peak. Offloads that do not fit the link are predicted at no extra time;
    /// [`MemoryPlan::offload_fits`] tells.
    pub fn with_choices(step: &StepCost, choices: &[Choice]) -> Result<Self> {
        check(step)?;
        if choices.len() != step.regions.len() {
            return Err(TensorError::InvalidArgument {
                op: OP,
                message: format!(
                    "{} choices for {} regions: give one choice per region, in forward order",
                    choices.len(),
                    step.regions.len()
                ),
            });
        }
        if let Some(i) = (0..choices.len()).find(|&i| {
            matches!(choices[i], Choice::Selective | Choice::SelectiveOffload)
                && step.regions[i].selective.is_none()
        }) {
            return invalid(format!(
                "region {i} is chosen selective but has no measured selective cost: give its \
                 `selective` figures, or choose keep, offload or recompute"
            ));
        }
        let least_bytes = step.peak_bytes(&step.least_choices());
        let peak = step.peak_bytes(choices);
        Ok(Self::from_choices(
            step,
            choices.to_vec(),
            peak,
            least_bytes,
        ))
    }

    fn from_choices(step: &StepCost, choices: Vec<Choice>, target: u64, least: u64) -> Self {
        Self {
            regions: step
                .regions
                .iter()
                .zip(&choices)
                .map(|(&cost, &choice)| PlannedRegion {
                    choice,
                    cost,
                    extra_ms: cost::extra(&cost, choice),
                })
                .collect(),
            target_bytes: target,
            peak_bytes: step.peak_bytes(&choices),
            plain_bytes: step.plain_bytes(),
            least_bytes: least,
            extra_ms: step.extra_ms(&choices),
            step_ms: step
                .regions
                .iter()
                .map(|r| r.forward_ms + r.backward())
                .sum(),
            offload_fits: step.offload_fits(&choices),
        }
    }

    /// Every region's choice, in forward order.
    pub fn choices(&self) -> Vec<Choice> {
        self.regions.iter().map(|r| r.choice).collect()
    }

    /// Every region with its choice, cost and predicted extra time.
    pub fn regions(&self) -> &[PlannedRegion] {
        &self.regions
    }

    /// Whether the predicted peak fits the target (a target at or above the least peak).
    pub fn reached(&self) -> bool {
        self.peak_bytes <= self.target_bytes
    }

    /// The target asked for.
    pub fn target_bytes(&self) -> u64 {
        self.target_bytes
    }

    /// The predicted most activation bytes on the device (at the end of the forward, or during
    /// some region's backward).
    pub fn peak_bytes(&self) -> u64 {
        self.peak_bytes
    }

    /// The same with every region kept.
    pub fn plain_bytes(&self) -> u64 {
        self.plain_bytes
    }

    /// The least peak any plan of these regions reaches.
    pub fn least_bytes(&self) -> u64 {
        self.least_bytes
    }

    /// Predicted milliseconds the plan adds to the step: a forward per recomputed region.
    pub fn extra_ms(&self) -> f64 {
        self.extra_ms
    }

    /// Whether the link moves every offloaded region out and back inside the compute around it,
    /// within the host memory (always true for a plan the planner chose).
    pub fn offload_fits(&self) -> bool {
        self.offload_fits
    }

    /// The predicted step without a plan: every region's forward and backward.
    pub fn step_ms(&self) -> f64 {
        self.step_ms
    }
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        writeln!(
            f,
            "memory plan: peak {:.1} MiB of activations (target {:.1}, everything kept {:.1}, \
             least {:.1}){}, predicted step {:.2} ms + {:.2} ms ({:.3}x)",
            mib(self.peak_bytes),
            mib(self.target_bytes),
            mib(self.plain_bytes),
            mib(self.least_bytes),
            if self.reached() {
                String::new()
            } else {
                format!(
                    "; the target is below the least this plan reaches: it runs at {:.1} MiB",
                    mib(self.peak_bytes)
                )
            },
            self.step_ms,
            self.extra_ms,
            (self.step_ms + self.extra_ms) / self.step_ms.max(f64::MIN_POSITIVE),
        )?;
        writeln!(
            f,
            "{:>6}  {:<17}  {:>10}  {:>10}  {:>10}  {:>11}  {:>20}  {:>9}",
            "region",
            "choice",
            "saved MiB",
            "input MiB",
            "forward ms",
            "backward ms",
            "selective MiB, ms",
            "extra ms"
        )?;
        for (i, r) in self.regions.iter().enumerate() {
            let selective = r.cost.selective.map_or("-".to_string(), |s| {
                format!("{:.1}, +{:.3}", mib(s.held_bytes), s.extra_ms)
            });
            writeln!(
                f,
                "{i:>6}  {:<17}  {:>10.1}  {:>10.1}  {:>10.3}  {:>11.3}  {:>20}  {:>9.3}",
                r.choice.to_string(),
                mib(r.cost.saved_bytes),
                mib(r.cost.input_bytes),
                r.cost.forward_ms,
                r.cost.backward(),
                selective,
                r.extra_ms
            )?;
        }
        Ok(())
    }
}

fn invalid<T>(message: String) -> Result<T> {
    Err(TensorError::InvalidArgument { op: OP, message })
}

/// Refuses costs no plan can be made of, naming the fix.
fn check(step: &StepCost) -> Result<()> {
    if step.regions.is_empty() {
        return invalid(
            "no regions to plan: give one cost per block of the forward (its time, the bytes \
             its rules save, its input's bytes)"
                .into(),
        );
    }
    let time = |ms: f64| ms.is_finite() && ms >= 0.0;
    for (i, r) in step.regions.iter().enumerate() {
        if !time(r.forward_ms) {
            return invalid(format!(
                "region {i}'s forward time is {} ms; it must be finite and >= 0",
                r.forward_ms
            ));
        }
        if let Some(ms) = r.backward_ms.filter(|ms| !time(*ms)) {
            return invalid(format!(
                "region {i}'s backward time is {ms} ms; it must be finite and >= 0 (or not given: \
                 twice the forward)"
            ));
        }
        if let Some(ms) = r.selective.map(|s| s.extra_ms).filter(|ms| !time(*ms)) {
            return invalid(format!(
                "region {i}'s selective recompute time is {ms} ms; it must be finite and >= 0"
            ));
        }
        if r.cached_bytes > r.saved_bytes {
            return invalid(format!(
                "region {i}'s cached_bytes ({}) exceed its saved_bytes ({}); they are a part of \
                 what the region saves",
                r.cached_bytes, r.saved_bytes
            ));
        }
        if r.offloadable() > r.saved_bytes {
            return invalid(format!(
                "region {i}'s offloadable_bytes ({}) exceed its saved_bytes ({}); offload moves \
                 a part of what the region saves",
                r.offloadable(),
                r.saved_bytes
            ));
        }
    }
    let total = || -> Option<u64> {
        let outside = step
            .shared_bytes
            .checked_add(step.head_bytes)?
            .checked_add(step.outside_grad_bytes)?;
        step.regions.iter().try_fold(outside, |sum, r| {
            sum.checked_add(r.saved_bytes)?
                .checked_add(r.input_bytes)?
                .checked_add(r.unsaved_input_bytes)?
                .checked_add(r.grad_bytes)?
                .checked_add(r.selective.map_or(0, |s| s.held_bytes))
        })
    };
    if let Some(m) = &step.measured
        && m.backward_bytes.len() != step.regions.len()
    {
        return invalid(format!(
            "{} measured backward peaks for {} regions: give one per region, in forward order",
            m.backward_bytes.len(),
            step.regions.len()
        ));
    }
    if total().is_none() {
        return invalid("the step's bytes add up past 2^64; give them in bytes, not bits".into());
    }
    if let Some(link) = step.link {
        let rates = [link.to_host_bytes_per_ms, link.to_device_bytes_per_ms];
        if rates.iter().any(|r| !(r.is_finite() && *r > 0.0)) {
            return invalid(format!(
                "the link's rates must be finite and > 0, got {rates:?} bytes/ms; pass no link \
                 where nothing can be offloaded"
            ));
        }
    }
    Ok(())
}

/// Refuses a target no plan can mean, naming the fix.
fn check_target(step: &StepCost, target_bytes: u64, least_bytes: u64) -> Result<()> {
    if step.regions.iter().all(|r| r.saved_bytes == 0) {
        return invalid(
            "the regions save no tensors for backward: there is nothing to keep, offload or \
             recompute; profile a step that runs them with grad enabled, or pass regions that do"
                .into(),
        );
    }
    if target_bytes == 0 {
        return invalid(format!(
            "a target of 0 bytes: the target is the activation bytes the step may hold at its \
             peak and must be > 0 (the least this step reaches is {least_bytes})"
        ));
    }
    let plain = step.plain_bytes();
    if target_bytes > plain {
        return invalid(format!(
            "target_bytes={target_bytes} is above what the step saves without a plan ({plain}): \
             there is nothing to free; run without a plan, or pass a lower target"
        ));
    }
    Ok(())
}
