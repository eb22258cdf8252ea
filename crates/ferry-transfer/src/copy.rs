//! Raw byte moves between devices, with no autograd: the building blocks every method uses.

use ferry_memory::cuda::PinnedPool;
use ferry_memory::{Device, HostBuffer};
use ferry_tensor::{Buffer, Result, Tensor, TensorError};

use crate::pipeline;
use crate::plan::{ChunkPlan, ChunkSpec};
use crate::report::TransferPath;
use crate::staging::{cuda, dense, within_budget, wrap};

/// Device-to-host copies of at least this many bytes land in pooled pinned memory. Measured on
/// the H200 host, DMA into a cached pinned block beats the driver's pageable path at every size
/// tried, 4 KiB included (7.8 us against 9.9 us), so only empty tensors go pageable.
pub(crate) const PINNED_FROM_BYTES: usize = 1;

/// Moves `src`'s elements to `device`, returning the moved tensor, the path taken and the
/// staging it held at most (pinned staging and scratch, when it went through the pipeline).
///
/// `non_blocking` lets a GPU-to-host copy return before the bytes arrive: the result lives in
/// pinned memory whose reads wait for the copy. A result that does not fit the pinned budget
/// lands in pooled pageable memory through the staging pipeline instead, blocking (so
/// `non_blocking` is a request, not a promise; the path says which happened).
pub(crate) fn move_bytes(
    src: &Tensor,
    device: Device,
    non_blocking: bool,
) -> Result<(Tensor, TransferPath, usize)> {
    match (src.device(), device) {
        (from, to) if from == to => Ok((src.detach(), TransferPath::SameDevice, 0)),
        (Device::Cpu, Device::Cuda(ordinal)) => host_to_device(src, ordinal),
        (Device::Cuda(_), Device::Cpu) => device_to_host(src, non_blocking),
        (Device::Cuda(_), Device::Cuda(ordinal)) => Ok((
            device_to_device(src, ordinal)?,
            TransferPath::DeviceToDevice,
            0,
        )),
        (Device::Cpu, Device::Cpu) => unreachable!("equal devices handled above"),
    }
}

/// Pageable sources at least this large go through the pinned staging pipeline: the driver's
/// own pageable path reaches about 6 GB/s on the H200 host, the pipeline the link's ~55 GB/s
/// less the host copy into staging.
const PIPELINE_FROM_BYTES: usize = 16 << 20;
/// Pinned staging the pipeline may hold (two 32 MiB buffers); moves beyond the pinned budget
/// stage through this much too.
pub(crate) const PIPELINE_STAGING_BYTES: usize = 64 << 20;

fn host_to_device(src: &Tensor, ordinal: usize) -> Result<(Tensor, TransferPath, usize)> {
    let src = dense(src)?;
    let pageable = matches!(&*src.storage().read(), Buffer::Host(_));
    if pageable && src.nbytes() >= PIPELINE_FROM_BYTES {
        let spec = ChunkSpec::MaxStagingBytes(PIPELINE_STAGING_BYTES);
        if let Ok(plan) = ChunkPlan::new(src.shape(), src.dtype(), spec)
            && plan.len() > 1
        {
            let (moved, report) = pipeline::host_to_device(&src, ordinal, &plan)?;
            return Ok((moved, TransferPath::HostToDevice, report.staging_peak_bytes));
        }
    }
    let dev = cuda(ordinal)?;
    let stream = dev.default_stream();
    let mut out = dev.alloc(src.nbytes(), stream)?;
    let guard = src.storage().read();
    let bytes = guard.host_slice("to", src.device())?;
    out.copy_from_host(bytes, stream)?;
    drop(guard);
    Ok((
        wrap(Buffer::Cuda(out), &src, Device::Cuda(ordinal)),
        TransferPath::HostToDevice,
        0,
    ))
}

fn device_to_host(src: &Tensor, non_blocking: bool) -> Result<(Tensor, TransferPath, usize)> {
    let src = dense(src)?;
    let Device::Cuda(ordinal) = src.device() else {
        unreachable!("a CUDA source")
    };
    let dev = cuda(ordinal)?;
    let stream = dev.default_stream();
    let bytes = src.nbytes();
    if bytes >= PINNED_FROM_BYTES || non_blocking {
        let Some(mut pinned) = within_budget(PinnedPool::global()?.alloc(bytes))? else {
            return beyond_budget(&src, ordinal);
        };
        let guard = src.storage().read();
        let Buffer::Cuda(from) = &*guard else {
            return Err(TensorError::UnsupportedDevice {
                op: "to",
                device: src.device(),
            });
        };
        from.copy_to_pinned_async(&mut pinned, stream)?;
        if !non_blocking {
            pinned.wait()?;
        }
        drop(guard);
        return Ok((
            wrap(Buffer::Pinned(pinned), &src, Device::Cpu),
            TransferPath::DeviceToPinned,
            0,
        ));
    }
    let guard = src.storage().read();
    let Buffer::Cuda(from) = &*guard else {
        return Err(TensorError::UnsupportedDevice {
            op: "to",
            device: src.device(),
        });
    };
    let mut host = HostBuffer::zeroed(bytes)?;
    from.copy_to_host(host.as_bytes_mut(), stream)?;
    drop(guard);
    Ok((
        wrap(Buffer::Host(host), &src, Device::Cpu),
        TransferPath::DeviceToPageable,
        0,
    ))
}

/// A GPU-to-host move of a dense `src` whose result does not fit the pinned budget: through at
/// most [`PIPELINE_STAGING_BYTES`] of pinned staging (or one row's, if more) into pooled,
/// prefaulted pageable memory; when even the staging does not fit, through the driver's
/// pageable path. Blocking.
pub(crate) fn beyond_budget(src: &Tensor, ordinal: usize) -> Result<(Tensor, TransferPath, usize)> {
    let bound = PIPELINE_STAGING_BYTES.max(ChunkPlan::min_staging_bytes(src.shape(), src.dtype()));
    let plan = ChunkPlan::new(src.shape(), src.dtype(), ChunkSpec::MaxStagingBytes(bound))?;
    let (moved, report) = pipeline::device_to_host(src, ordinal, &plan)?;
    Ok((moved, report.path, report.staging_peak_bytes))
}

fn device_to_device(src: &Tensor, ordinal: usize) -> Result<Tensor> {
    let src = dense(src)?;
    let (target, guard) = (cuda(ordinal)?, src.storage().read());
    let Buffer::Cuda(from) = &*guard else {
        return Err(TensorError::UnsupportedDevice {
            op: "to",
            device: src.device(),
        });
    };
    let mut out = target.alloc(src.nbytes(), target.default_stream())?;
    // Peer access is an optimisation; without it the driver stages through the host.
    let _ = target.enable_peer_access(from.cuda_device());
    // The peer copy waits for the source's producers on its own device's stream.
    out.copy_from_peer(from, target.default_stream())?;
    target.default_stream().synchronize()?;
    drop(guard);
    Ok(wrap(Buffer::Cuda(out), &src, Device::Cuda(ordinal)))
}
