//! Chunked moves: the entry point that plans a move (see [`ChunkPlan`]) and picks a pipeline by
//! direction (host staging to or from a GPU, device scratch between two GPUs), recording one
//! transfer node for the whole move.

use std::time::Instant;

use ferry_memory::Device;
use ferry_tensor::{Result, Tensor, with_no_grad};

use crate::copy::device_to_device_chunked;
use crate::pipeline;
use crate::plan::{ChunkPlan, ChunkSpec};
use crate::record::record_transfer;
use crate::report::{TransferPath, TransferReport};

/// [`crate::DeviceMove::to_chunked`]: plans, moves through the direction's pipeline, records
/// one transfer node for the whole move.
pub(crate) fn to_chunked(
    src: &Tensor,
    device: Device,
    spec: ChunkSpec,
) -> Result<(Tensor, TransferReport)> {
    let start = Instant::now();
    let plan = ChunkPlan::new(src.shape(), src.dtype(), spec)?;
    let (moved, mut report) = with_no_grad(|| -> Result<_> {
        let detached = src.detach();
        match (src.device(), device) {
            (from, to) if from == to => {
                Ok((detached, TransferReport::new(TransferPath::SameDevice, 0)))
            }
            (Device::Cuda(ordinal), Device::Cpu) => {
                pipeline::device_to_host(&detached, ordinal, &plan)
            }
            (Device::Cpu, Device::Cuda(ordinal)) => {
                pipeline::host_to_device(&detached, ordinal, &plan)
            }
            // Between GPUs: peer copies of the pieces, through device scratch (no host
            // staging).
            (Device::Cuda(_), Device::Cuda(ordinal)) => {
                device_to_device_chunked(&detached, ordinal, &plan)
            }
            (Device::Cpu, Device::Cpu) => unreachable!("equal devices handled above"),
        }
    })?;
    let out = record_transfer(moved, src, device, "to_chunked", &mut report);
    report.elapsed = start.elapsed();
    Ok((out, report))
}
