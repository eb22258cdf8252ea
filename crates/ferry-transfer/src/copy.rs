//! Raw byte moves between devices, with no autograd: the building blocks every method uses.

use std::collections::HashMap;
use std::sync::OnceLock;

use ferry_memory::cuda::{CudaDevice, PinnedPool, Stream};
use ferry_memory::{Device, HostBuffer, MemoryError};
use ferry_tensor::{Buffer, Result, Tensor, TensorError};
use parking_lot::Mutex;

use crate::pipeline;
use crate::plan::{ChunkPlan, ChunkSpec};
use crate::report::{TransferPath, TransferReport};
use crate::staging::{StagingMeter, cuda, dense, dense_copies, within_budget, wrap};

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
        (Device::Cuda(_), Device::Cuda(ordinal)) => device_to_device(src, ordinal),
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
    let dev = cuda(ordinal)?;
    // Page-locked host memory (pinned in place, or another runtime's pinned tensor) is read by
    // DMA directly, at the link; only pageable memory needs the staging pipeline.
    let pageable = src.nbytes() >= PIPELINE_FROM_BYTES
        && matches!(&*src.storage().read(), Buffer::Host(b) if !PinnedPool::is_page_locked(b));
    if pageable {
        let spec = ChunkSpec::MaxStagingBytes(PIPELINE_STAGING_BYTES);
        if let Ok(plan) = ChunkPlan::new(src.shape(), src.dtype(), spec)
            && plan.len() > 1
        {
            let (moved, report) = pipeline::host_to_device(&src, ordinal, &plan)?;
            return Ok((moved, TransferPath::HostToDevice, report.staging_peak_bytes));
        }
    }
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

/// [`crate::DeviceMove::pin_in_place`]: a host tensor's storage page-locked where it is.
pub(crate) fn pin_in_place(t: &Tensor) -> Result<bool> {
    let storage = t.storage().read();
    match &*storage {
        Buffer::Host(b) => Ok(PinnedPool::global()?.pin_in_place(b)?),
        Buffer::Pinned(_) => Ok(false),
        _ => Err(TensorError::UnsupportedDevice {
            op: "pin_in_place",
            device: t.device(),
        }),
    }
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

/// A whole move between two GPUs, queued on the target's default stream: the result is ordered
/// there for every later use, and the host does not wait. Scratch is a dense copy of a
/// non-dense source, on the source's device.
fn device_to_device(src: &Tensor, ordinal: usize) -> Result<(Tensor, TransferPath, usize)> {
    let scratch = if dense_copies(src) { src.nbytes() } else { 0 };
    let src = dense(src)?;
    let target = cuda(ordinal)?;
    let (moved, direct) = peer_copy(&src, &target, target.default_stream())?;
    let path = TransferPath::Peer { direct, chunks: 1 };
    Ok((moved, path, scratch))
}

/// Queues a copy of the dense CUDA tensor `src` into a fresh buffer on `target` (another GPU) on
/// `stream`, of either device, and returns at once with the result and whether the copy is
/// direct (peer access enabled).
///
/// The copy waits, on the device, for the work queued so far on the source's own stream (its
/// producers); the source's buffer records the copy, so its block is not reused, and no later
/// in-place write of it runs, before the copy has read it, even when the caller drops the
/// source right away. The result lives on the target's default stream, which waits for the
/// copy before any later use of it.
pub(crate) fn peer_copy(
    src: &Tensor,
    target: &CudaDevice,
    stream: &Stream,
) -> Result<(Tensor, bool)> {
    let guard = src.storage().read();
    let Buffer::Cuda(from) = &*guard else {
        return Err(TensorError::UnsupportedDevice {
            op: "to",
            device: src.device(),
        });
    };
    // The device whose copy engine runs the copy reads or writes the other's memory.
    let direct = if stream.device() == target.device() {
        peer_access(target, from.cuda_device())
    } else {
        peer_access(from.cuda_device(), target)
    };
    let mut out = target.alloc(src.nbytes(), target.default_stream())?;
    out.copy_from_peer(from, stream)?;
    drop(guard);
    Ok((wrap(Buffer::Cuda(out), src, target.device()), direct))
}

/// Whether `reader` may access `peer`'s memory directly, enabling it on first use. Peer access
/// is an optimisation: without it the driver stages the copy through host memory, still
/// correct. The answer is kept per ordered pair (enabling is a driver call each time
/// otherwise); a failure other than "unsupported" is not kept, so a later move retries.
pub(crate) fn peer_access(reader: &CudaDevice, peer: &CudaDevice) -> bool {
    static KNOWN: OnceLock<Mutex<HashMap<(usize, usize), bool>>> = OnceLock::new();
    let known = KNOWN.get_or_init(Default::default);
    let pair = (reader.ordinal(), peer.ordinal());
    if let Some(&direct) = known.lock().get(&pair) {
        return direct;
    }
    // Outside the lock: the driver call may take a while the first time.
    let direct = match reader.enable_peer_access(peer) {
        Ok(()) => true,
        Err(MemoryError::PeerAccessUnsupported { .. }) => false,
        Err(_) => return false,
    };
    known.lock().insert(pair, direct);
    direct
}

/// Scratch buffers a chunked peer move keeps on each device: the plan's staging buffers (two
/// when two pieces fit its bound, so one piece is written while the other travels), at least
/// one. Each holds one piece, so each device holds at most the plan's bound.
pub(crate) fn peer_ring(plan: &ChunkPlan) -> usize {
    plan.staging_buffers().max(1)
}

/// A move between two GPUs in the pieces of `plan` (along axis 0), through scratch rings of at
/// most two pieces on each device: a piece is written into a source-side scratch buffer (which
/// also makes a non-contiguous source contiguous a piece at a time), copied peer to peer into a
/// target-side one, and from there into its place in the result. All of it is queued on the two
/// devices' default streams; the rings are reused in order on the device (a scratch buffer's
/// next write waits for the peer copy that read it), so the host does not wait and each device
/// holds at most `plan.staging_buffers()` (at least one) pieces of scratch.
pub(crate) fn device_to_device_chunked(
    src: &Tensor,
    ordinal: usize,
    plan: &ChunkPlan,
) -> Result<(Tensor, TransferReport)> {
    if plan.len() <= 1 || src.shape().is_empty() {
        let (moved, path, scratch) = device_to_device(src, ordinal)?;
        let mut report = TransferReport::new(path, src.nbytes());
        report.staging_peak_bytes = scratch;
        return Ok((moved, report));
    }
    let (from, target) = (src.device(), cuda(ordinal)?);
    let Device::Cuda(source) = from else {
        unreachable!("a CUDA source")
    };
    let direct = peer_access(&target, &cuda(source)?);
    let stream = target.default_stream();
    let piece_rows = plan.pieces().iter().map(|p| p.len()).max().unwrap_or(0);
    let mut piece_shape = src.shape().to_vec();
    piece_shape[0] = piece_rows;
    let ring = peer_ring(plan);
    let mut meter = StagingMeter::default();
    let mut sources = Vec::with_capacity(ring);
    let mut landings = Vec::with_capacity(ring);
    for _ in 0..ring {
        sources.push(Tensor::zeros(&piece_shape, src.dtype(), from)?);
        landings.push(target.alloc(plan.piece_bytes(), stream)?);
        meter.hold(2 * plan.piece_bytes());
    }
    let mut out = target.alloc(src.nbytes(), stream)?;
    for (i, rows) in plan.pieces().iter().enumerate() {
        let slot = i % ring;
        // The scratch's earlier peer copy is in flight on the target's stream: this write
        // waits for it on the device (the buffer recorded the copy).
        sources[slot].narrow(0, 0, rows.len())?.assign(&src.narrow(
            0,
            rows.start,
            rows.len(),
        )?)?;
        let guard = sources[slot].storage().read();
        let Buffer::Cuda(piece) = &*guard else {
            return Err(TensorError::UnsupportedDevice {
                op: "to_chunked",
                device: from,
            });
        };
        landings[slot].copy_from_peer(piece, stream)?;
        drop(guard);
        let bytes = plan.byte_range(i);
        out.copy_region(bytes.start, &landings[slot], 0, bytes.len(), stream)?;
    }
    let moved = wrap(Buffer::Cuda(out), src, Device::Cuda(ordinal));
    let path = TransferPath::Peer {
        direct,
        chunks: plan.len(),
    };
    let mut report = TransferReport::new(path, src.nbytes());
    report.staging_peak_bytes = meter.peak();
    Ok((moved, report))
}

#[cfg(test)]
mod tests {
    use ferry_memory::DType;

    use super::*;

    #[test]
    fn a_chunked_peer_move_holds_at_most_its_bound_on_each_device() {
        for (shape, bound) in [
            (vec![1000, 1000], 1 << 20),
            (vec![1000, 1000], 3 << 20),
            (vec![7, 5000], 64 << 10),
            (vec![3, 3], 1 << 30),
        ] {
            let spec = ChunkSpec::MaxStagingBytes(bound);
            let plan = ChunkPlan::new(&shape, DType::F32, spec).unwrap();
            let per_device = peer_ring(&plan) * plan.piece_bytes();
            assert!(
                per_device <= bound,
                "{shape:?} in {bound}: {per_device} bytes"
            );
            assert!(peer_ring(&plan) >= 1 && peer_ring(&plan) <= 2);
        }
        // Two pieces fit: one is written while the other travels.
        let plan = ChunkPlan::new(
            &[1000, 1000],
            DType::F32,
            ChunkSpec::MaxStagingBytes(1 << 20),
        )
        .unwrap();
        assert_eq!(peer_ring(&plan), 2);
        assert!(plan.len() >= 8, "{} pieces", plan.len());
    }
}
