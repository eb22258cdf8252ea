//! Data parallelism: one replica of a model per device, gradients averaged across the replicas
//! while backward still runs, identical weights on every replica after every step.
//!
//! - [`ProcessGroup`]: one rank's handle on a group of replicas and the collectives between
//!   them (all-reduce, broadcast, all-gather, barrier) on tensors. [`ProcessGroup::nccl`] makes
//!   one rank per GPU of this process over NCCL; [`ProcessGroup::nccl_rank`] joins a group of
//!   one process per GPU (or per host); [`ProcessGroup::host`] makes ranks that are threads of
//!   this process with CPU tensors, for running the same code without a GPU.
//! - [`DataParallel`]: wraps one replica's parameters. It broadcasts them from rank 0, then, in
//!   each backward, packs the gradients into buckets (in reverse parameter order, the order
//!   backward produces them) from post-accumulate hooks and starts each bucket's all-reduce as
//!   soon as it is full, in bucket order on every rank. [`DataParallel::finish`] waits for the
//!   buckets and leaves the averaged gradient in each parameter's `.grad`.
//! - [`run_replicas`]: one thread per rank, each running the same closure.
//!
//! ```no_run
//! use ferry::distributed::{DataParallel, DdpOptions, ProcessGroup, run_replicas};
//! use ferry::nn::{Linear, Module, ReLU, Sequential};
//! use ferry::optim::{Adam, Optimizer};
//! use ferry::{DType, Device, Tensor};
//!
//! let groups = ProcessGroup::nccl(&[Device::Cuda(0), Device::Cuda(1)])?;
//! let losses = run_replicas(groups, |group| {
//!     let device = group.device();
//!     let model = Sequential::new()
//!         .push(Linear::new(64, 128, device)?)
//!         .push(ReLU)
//!         .push(Linear::new(128, 10, device)?);
//!     let ddp = DataParallel::new(model.parameters(), group, DdpOptions::default())?;
//!     let mut opt = Adam::new(model.parameters(), 1e-3)?;
//!     let x = Tensor::randn(&[256, 64], DType::F32, device)?; // this rank's share of a batch
//!     let y = Tensor::zeros(&[256], DType::I64, device)?;
//!     model.zero_grad();
//!     let loss = ferry::nn::cross_entropy(&model.forward(&x)?, &y)?;
//!     loss.backward()?;
//!     ddp.finish()?; // averaged gradients, the same on every rank
//!     opt.step()?;
//!     loss.item()
//! })?;
//! # Ok::<(), ferry::TensorError>(())
//! ```

mod ddp;
mod group;
mod host;
#[cfg(test)]
mod tests;

pub use ddp::{DataParallel, DdpOptions, DdpStats};
pub use ferry_cuda::{ReduceOp, UniqueId, nccl_present, nccl_version};
pub use group::ProcessGroup;

use ferry_tensor::{Result, TensorError};

/// Runs `f` once per group, each on its own thread (rank order), and returns the results in
/// rank order. If a rank fails, the host ranks still waiting in a collective are released with
/// an error, and the first error (by rank) is returned. Ranks of an NCCL group that wait for a
/// failed rank on the device cannot be released from the host: give every rank the same work.
pub fn run_replicas<R: Send>(
    groups: Vec<ProcessGroup>,
    f: impl Fn(ProcessGroup) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    let f = &f;
    let results: Vec<Result<R>> = std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|group| {
                let abort = group.abort_handle();
                scope.spawn(move || {
                    let rank = group.rank();
                    let out = f(group);
                    if out.is_err() {
                        abort.abort(rank);
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join().unwrap_or_else(|_| {
                    Err(TensorError::InvalidArgument {
                        op: "run_replicas",
                        message: format!("rank {rank} panicked"),
                    })
                })
            })
            .collect()
    });
    results.into_iter().collect()
}
