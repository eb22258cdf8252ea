//! A chain of blocks run under a memory plan ([`crate::autograd::MemoryPlan`]): each block kept,
//! offloaded (inside an offload scope of its own) or recomputed, and the profiled forward the
//! plan's costs come from.

use std::sync::Arc;
use std::time::Instant;

use ferry_graph::{enable_grad, no_grad};
use ferry_tensor::autograd::{
    Choice, MeasuredPeaks, OffloadOptions, RegionCost, Selective, offload_saved,
};
use ferry_tensor::{Device, Result, Tensor, TensorError};
use ferry_tensor::{keep_products, reuse_products};

use super::Module;
use super::recomputed::recompute_forward;

/// `x` through `blocks` in order, block `i` as `choices[i]` says (`choices` as long as
/// `blocks`).
pub(crate) fn forward_planned<M: Module + Clone + Send + Sync + 'static>(
    blocks: &[M],
    choices: &[Choice],
    x: &Tensor,
) -> Result<Tensor> {
    let mut x = x.clone();
    for (block, choice) in blocks.iter().zip(choices) {
        x = match choice {
            Choice::Keep => block.forward(&x)?,
            Choice::Offload => {
                let _scope = offload_saved(OffloadOptions::default());
                block.forward(&x)?
            }
            // The region holds the block's own tensors (a clone of their handles). A block fed
            // the batch (nothing before it requires grad) has no graph to hang a region on: it
            // is kept, as its profile says (not recomputable).
            Choice::Recompute | Choice::Selective if x.requires_grad() => {
                recompute_forward(Arc::new(block.clone()), &x, *choice == Choice::Selective)?
            }
            Choice::Recompute | Choice::Selective => block.forward(&x)?,
            Choice::SelectiveOffload => return Err(no_selective_offload("memory plan")),
        };
    }
    Ok(x)
}

/// Checks a plan's choices against the blocks they are for.
pub(crate) fn check_choices(op: &'static str, blocks: usize, choices: &[Choice]) -> Result<()> {
    if choices.len() != blocks {
        return Err(TensorError::InvalidArgument {
            op,
            message: format!(
                "{} choices for {blocks} blocks: a plan has one choice per block, in order (plan \
                 the model's own regions: `MemoryPlan::new(&model.profile_blocks(..)?, ..)`)",
                choices.len()
            ),
        });
    }
    if choices.contains(&Choice::SelectiveOffload) {
        return Err(no_selective_offload(op));
    }
    Ok(())
}

/// ferry's own blocks keep a selective recompute's outputs on the device: their profile gives
/// them no offloadable bytes, so the planner never chooses to offload them.
fn no_selective_offload(op: &'static str) -> TensorError {
    TensorError::InvalidArgument {
        op,
        message: "a selective offload was chosen for one of ferry's own blocks, whose selective \
                  recompute keeps its outputs on the device: choose keep, offload, recompute \
                  or selective"
            .into(),
    }
}

/// The key a saved tensor's buffer is counted under in its graph: its storage's address.
fn storage_key(t: &Tensor) -> usize {
    Arc::as_ptr(t.storage()) as usize
}

/// One forward of `blocks` from `x` with every block kept, measuring each: its time (the
/// device synchronized around it, so only for profiling), the bytes its rules save beyond its
/// input, its output and its own parameters, its input's bytes, whether it can be recomputed
/// (its input requires grad: the batch does not) and, where it can, what a selective recompute
/// of it holds and adds (two more runs of it: one keeping its products, one taking them back;
/// they draw from the generator as any forward does). `x` must be part of a graph that records
/// (a parameter's output, or a tensor that requires grad), else nothing is saved and the costs
/// say so.
pub(crate) fn profile_blocks<M: Module>(blocks: &[M], x: &Tensor) -> Result<Vec<RegionCost>> {
    let sync = |device: Device| match device {
        Device::Cpu => Ok(()),
        gpu => crate::cuda::synchronize(gpu),
    };
    let saved = |t: &Tensor| t.graph().map_or(0, |g| g.saved_bytes() as u64);
    let mut x = x.clone();
    let mut costs = Vec::with_capacity(blocks.len());
    for block in blocks {
        // Of what the block's rules save, three kinds stay alive whatever the plan, so are not
        // bytes a plan frees: its parameters (a product saves its weight), its input (counted
        // as the region's input) and its output (the next block's input).
        let params: Vec<usize> = block.parameters().iter().map(storage_key).collect();
        let input = [storage_key(&x)];
        let among =
            |t: &Tensor, keys: &[usize]| t.graph().map_or(0, |g| g.saved_bytes_of(keys) as u64);
        sync(x.device())?;
        let before = (saved(&x), among(&x, &params), among(&x, &input));
        let start = Instant::now();
        let y = block.forward(&x)?;
        sync(y.device())?;
        let forward_ms = start.elapsed().as_secs_f64() * 1e3;
        let kept_anyway = among(&y, &params).saturating_sub(before.1)
            + among(&y, &input).saturating_sub(before.2)
            + among(&y, &[storage_key(&y)]);
        let own = saved(&y)
            .saturating_sub(before.0)
            .saturating_sub(kept_anyway);
        let mut cost = RegionCost::new(forward_ms, own, x.nbytes() as u64);
        cost.recomputable = x.requires_grad();
        if cost.recomputable {
            cost.selective = Some(selective_cost(block, &x, &sync)?);
        }
        costs.push(cost);
        x = y;
    }
    Ok(costs)
}

/// A selective recompute of `block` from `x`: the bytes of the products' outputs its first run
/// keeps (bar its own output, the next block's input), and the time of its second run taking
/// them back, which is what it adds to the backward. Its outputs stay on the device.
fn selective_cost<M: Module>(
    block: &M,
    x: &Tensor,
    sync: &impl Fn(Device) -> Result<()>,
) -> Result<Selective> {
    let (first, kept) = keep_products(|| {
        let _nothing_saved = no_grad();
        block.forward(x)
    });
    let held_bytes = kept.bytes_apart_from(&[&first?]);
    let leaf = x.detach().with_grad()?;
    sync(x.device())?;
    let start = Instant::now();
    let (again, _) = reuse_products(kept, || {
        let _recorded = enable_grad();
        block.forward(&leaf)
    });
    sync(again?.device())?;
    Ok(Selective {
        held_bytes,
        extra_ms: start.elapsed().as_secs_f64() * 1e3,
        offloadable_bytes: 0,
        offload_extra_ms: None,
    })
}

/// Blocks applied one after the other, each block's saved activations kept, offloaded or
/// recomputed as a [`MemoryPlan`](crate::autograd::MemoryPlan) chose: what [`Gpt`] and
/// [`Llama`] do with their layers, for any chain of blocks (an MLP's, a custom model's). Its
/// parameters are named by position (`"0.weight"`, as [`Sequential`](super::Sequential) does).
///
/// ```
/// use ferry::autograd::MemoryPlan;
/// use ferry::nn::{Activation, Dense, Module, PlannedChain};
/// use ferry::{DType, Device, Tensor};
///
/// // Four blocks of two layers: each keeps its hidden activation for backward.
/// let block = || -> ferry::Result<PlannedChain<Dense>> {
///     Ok(PlannedChain::new(vec![
///         Dense::new(64, 256, Activation::Tanh, Device::Cpu)?,
///         Dense::new(256, 64, Activation::Identity, Device::Cpu)?,
///     ]))
/// };
/// let mut mlp = PlannedChain::new((0..4).map(|_| block()).collect::<ferry::Result<Vec<_>>>()?);
/// let x = Tensor::randn(&[32, 64], DType::F32, Device::Cpu)?;
/// // A target below what any plan reaches: the plan at the least peak it can.
/// let plan = MemoryPlan::new(&mlp.profile_blocks(&x)?, None, 1)?;
/// mlp.set_plan(&plan.choices())?;
/// let y = mlp.forward(&x)?;
/// y.mul(&y)?.mean()?.backward()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// [`Gpt`]: crate::models::Gpt
/// [`Llama`]: crate::models::Llama
#[derive(Debug, Clone)]
pub struct PlannedChain<M> {
    blocks: Vec<M>,
    plan: Vec<Choice>,
}

impl<M: Module + Clone + Send + Sync + 'static> PlannedChain<M> {
    /// `blocks` in order, every block's saved activations kept.
    pub fn new(blocks: Vec<M>) -> Self {
        let plan = vec![Choice::Keep; blocks.len()];
        Self { blocks, plan }
    }

    /// The blocks, in order.
    pub fn blocks(&self) -> &[M] {
        &self.blocks
    }

    /// Runs each block as `choices` says (one per block, in order; from
    /// [`MemoryPlan::choices`](crate::autograd::MemoryPlan::choices)). The gradients are the
    /// same whatever the choices.
    pub fn set_plan(&mut self, choices: &[Choice]) -> Result<()> {
        check_choices("PlannedChain::set_plan", self.blocks.len(), choices)?;
        self.plan = choices.to_vec();
        Ok(())
    }

    /// Recomputes every block in backward (`true`) or keeps what each saves (`false`).
    pub fn set_recompute(&mut self, on: bool) {
        let choice = if on { Choice::Recompute } else { Choice::Keep };
        self.plan = vec![choice; self.blocks.len()];
    }

    /// One forward of `input` with every block kept and timed on its own, for
    /// [`MemoryPlan::new`](crate::autograd::MemoryPlan::new) (see
    /// [`Gpt::profile_blocks`](crate::models::Gpt::profile_blocks)).
    pub fn profile_blocks(&self, input: &Tensor) -> Result<Vec<RegionCost>> {
        profile_blocks(&self.blocks, input)
    }

    /// One step without a plan, measuring the memory of `input`'s device (the host allocator
    /// on the CPU) it takes above what was allocated at its start: the chain's forward with
    /// every block kept, then `backward` with the chain's output (what follows the chain, the
    /// loss, and its backward). For [`StepCost::measured`](crate::autograd::StepCost), from
    /// which the plan predicts its peaks. Clear the gradients before it, as a step starts.
    /// Counters are process-wide: other threads' work in the same step moves them.
    pub fn measure_peaks(
        &self,
        input: &Tensor,
        backward: impl FnOnce(&Tensor) -> Result<()>,
    ) -> Result<MeasuredPeaks> {
        measure_peaks(
            input.device(),
            || Ok((input.clone(), self.blocks.clone())),
            |y| backward(&y),
        )
    }
}

/// Per phase of a step, the most above its start: the forward (index 0), then block `i`'s
/// backward (index `i + 1`).
struct Phases {
    device: Device,
    base: u64,
    current: usize,
    peaks: Vec<Option<u64>>,
}

impl Phases {
    fn close(&mut self) -> Result<()> {
        let peak = (crate::allocated::peak(self.device)? as u64).saturating_sub(self.base);
        let slot = &mut self.peaks[self.current];
        *slot = Some(slot.map_or(peak, |p| p.max(peak)));
        Ok(())
    }

    fn enter(&mut self, phase: usize) -> Result<()> {
        self.close()?;
        crate::allocated::reset_peak(self.device)?;
        self.current = phase;
        Ok(())
    }
}

/// [`PlannedChain::measure_peaks`] of the input and blocks that `start` makes inside the
/// measured step (so a model's embedding counts in its forward), on `device`, from before
/// `start` runs.
pub(crate) fn measure_peaks<M: Module>(
    device: Device,
    start: impl FnOnce() -> Result<(Tensor, Vec<M>)>,
    backward: impl FnOnce(Tensor) -> Result<()>,
) -> Result<MeasuredPeaks> {
    let base = crate::allocated::current(device)? as u64;
    crate::allocated::reset_peak(device)?;
    let (input, blocks) = start()?;
    let phases = Arc::new(parking_lot::Mutex::new(Phases {
        device,
        base,
        current: 0,
        peaks: vec![None; blocks.len() + 1],
    }));
    // Only what the step itself holds: the input and each block's output go once used.
    let mut x = input;
    let mut hooks = Vec::with_capacity(blocks.len());
    for (i, block) in blocks.iter().enumerate() {
        x = block.forward(&x)?;
        if x.requires_grad() {
            let phases = phases.clone();
            // The gradient of block i's output: its backward starts.
            hooks.push(x.register_hook(move |_| {
                phases.lock().enter(i + 1)?;
                Ok(None)
            })?);
        }
    }
    let ran = backward(x);
    for hook in hooks {
        hook.remove();
    }
    ran?;
    if let Device::Cuda(_) = device {
        crate::cuda::synchronize(device)?;
    }
    let mut phases = phases.lock();
    phases.close()?;
    let peaks: Option<Vec<u64>> = phases.peaks.iter().copied().collect();
    let Some(peaks) = peaks else {
        return Err(TensorError::InvalidArgument {
            op: "PlannedChain::measure_peaks",
            message: "a block's backward never ran: `backward` must run the backward of the \
                      chain's output (a loss made from it), and its blocks must require grad"
                .into(),
        });
    };
    Ok(MeasuredPeaks {
        forward_bytes: peaks[0],
        backward_bytes: peaks[1..].to_vec(),
    })
}

impl<M: Module + Clone + Send + Sync + 'static> Module for PlannedChain<M> {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        forward_planned(&self.blocks, &self.plan, input)
    }

    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        for (i, block) in self.blocks.iter().enumerate() {
            block.visit_parameters(&format!("{prefix}{i}."), f);
        }
    }

    fn visit_parameters_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(String, &mut Tensor) -> Result<()>,
    ) -> Result<()> {
        for (i, block) in self.blocks.iter_mut().enumerate() {
            block.visit_parameters_mut(&format!("{prefix}{i}."), f)?;
        }
        Ok(())
    }

    fn set_training(&mut self, training: bool) {
        for block in &mut self.blocks {
            block.set_training(training);
        }
    }
}
