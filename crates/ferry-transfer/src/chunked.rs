//! Chunked moves: the entry point that plans a move (see [`ChunkPlan`]) and picks a pipeline by
//! direction, recording one transfer node for the whole move.

use std::time::Instant;

use ferry_memory::Device;
use ferry_tensor::{Result, Tensor, with_no_grad};

use crate::copy::move_bytes;
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
            // Device to device needs no host staging: one peer copy.
            _ => {
                let (moved, path, _) = move_bytes(&detached, device, false)?;
                Ok((moved, TransferReport::new(path, src.nbytes())))
            }
        }
    })?;
    let out = record_transfer(moved, src, device, "to_chunked", &mut report);
    report.elapsed = start.elapsed();
    Ok((out, report))
}
