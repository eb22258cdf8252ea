//! `ferry train --devices ...`: the pieces of data-parallel training the loop in `train.rs`
//! uses (groups, each replica's share of a batch, the step, the epoch's totals).

use std::ops::Range;

use ferry::distributed::{DataParallel, ProcessGroup, ReduceOp};
use ferry::nn::Module;
use ferry::optim::Optimizer;
use ferry::prelude::*;

use super::{StepOutput, correct_count};

/// One group rank per device: host ranks for `cpu,cpu,...`, NCCL for CUDA devices.
pub(super) fn groups(devices: &[Device]) -> Result<Vec<ProcessGroup>, String> {
    if devices.iter().all(|d| *d == Device::Cpu) {
        return Ok(ProcessGroup::host(devices.len()));
    }
    if devices.contains(&Device::Cpu) {
        return Err(format!(
            "--devices mixes the CPU and GPUs ({}); list only CUDA devices, or only cpu",
            devices
                .iter()
                .map(Device::to_string)
                .collect::<Vec<_>>()
                .join(",")
        ));
    }
    ProcessGroup::nccl(devices).map_err(|e| e.to_string())
}

/// Rows of a batch of `len` that replica `rank` of `world` takes: contiguous, sizes differing
/// by at most one.
pub(super) fn share(len: usize, rank: usize, world: usize) -> Range<usize> {
    let at = |r: usize| r * len / world;
    at(rank)..at(rank + 1)
}

/// One data-parallel step on this replica's share `x`, `y` of a batch of `whole` rows. The loss
/// that backward sees is scaled by `rows * world / whole`, so that averaging the replicas'
/// gradients gives the gradient of the whole batch's mean loss even when shares differ in size.
pub(super) fn step(
    model: &dyn Module,
    opt: &mut dyn Optimizer,
    ddp: &DataParallel,
    x: &Tensor,
    y: &Tensor,
    whole: usize,
) -> ferry::Result<StepOutput> {
    opt.zero_grad();
    let logits = model.forward(x)?;
    let loss = ferry::nn::cross_entropy(&logits, y)?;
    let weight = (x.shape()[0] * ddp.group().world_size()) as f64 / whole as f64;
    loss.mul_scalar(weight)?.backward()?;
    ddp.finish()?;
    opt.step()?;
    Ok(StepOutput {
        loss: loss.detach(),
        correct: correct_count(&logits.detach(), y)?,
    })
}

/// The sums of every replica's epoch loss (weighted by rows) and correct count.
pub(super) fn epoch_totals(
    group: &ProcessGroup,
    loss_sum: f64,
    correct: f64,
) -> ferry::Result<(f64, f64)> {
    let totals = Tensor::from_vec(vec![loss_sum, correct], &[2])?.to(group.device())?;
    group.all_reduce(&totals, ReduceOp::Sum)?;
    let v = totals.to_vec_f64()?;
    Ok((v[0], v[1]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_the_batch_once() {
        for (len, world) in [(32, 2), (28, 3), (5, 4), (1, 1)] {
            let mut next = 0;
            for rank in 0..world {
                let r = share(len, rank, world);
                assert_eq!(r.start, next);
                assert!(r.len().abs_diff(len / world) <= 1);
                next = r.end;
            }
            assert_eq!(next, len);
        }
    }

    #[test]
    fn mixed_devices_are_refused_with_the_fix() {
        let err = groups(&[Device::Cpu, Device::Cuda(0)]).unwrap_err();
        assert!(err.contains("only CUDA devices"), "{err}");
        assert_eq!(groups(&[Device::Cpu, Device::Cpu]).unwrap().len(), 2);
    }
}
