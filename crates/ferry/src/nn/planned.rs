//! A chain of blocks run under a memory plan ([`crate::autograd::MemoryPlan`]): each block kept,
//! offloaded (inside an offload scope of its own) or recomputed, and the profiled forward the
//! plan's costs come from.

use std::sync::Arc;
use std::time::Instant;

use ferry_tensor::autograd::{Choice, OffloadOptions, RegionCost, offload_saved};
use ferry_tensor::{Device, Result, Tensor, TensorError};

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
            // The region holds the block's own tensors (a clone of their handles).
            Choice::Recompute => recompute_forward(Arc::new(block.clone()), &x)?,
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
    Ok(())
}

/// One forward of `blocks` from `x` with every block kept, measuring each: its time (the
/// device synchronized around it, so only for profiling), the bytes its rules save beyond its
/// input, and its input's bytes. `x` must be part of a graph that records (a parameter's output,
/// or a tensor that requires grad), else nothing is saved and the costs say so.
pub(crate) fn profile_blocks<M: Module>(blocks: &[M], x: &Tensor) -> Result<Vec<RegionCost>> {
    let sync = |device: Device| match device {
        Device::Cpu => Ok(()),
        gpu => crate::cuda::synchronize(gpu),
    };
    let saved = |t: &Tensor| t.graph().map_or(0, |g| g.saved_bytes() as u64);
    let mut x = x.clone();
    let mut costs = Vec::with_capacity(blocks.len());
    for block in blocks {
        sync(x.device())?;
        let (before, start) = (saved(&x), Instant::now());
        let y = block.forward(&x)?;
        sync(y.device())?;
        let forward_ms = start.elapsed().as_secs_f64() * 1e3;
        let input_bytes = x.nbytes() as u64;
        // The block's rules saved its input too (a norm reads it): counted as the input's.
        let grown = saved(&y).saturating_sub(before);
        costs.push(RegionCost::new(
            forward_ms,
            grown.saturating_sub(input_bytes),
            input_bytes,
        ));
        x = y;
    }
    Ok(costs)
}
