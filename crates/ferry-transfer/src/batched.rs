//! Batched moves of many tensors (a state dict): one pinned arena per source device and dtype,
//! every copy queued on one stream per device, one synchronization at the end.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use ferry_memory::cuda::{CudaDevice, PinnedBuffer, PinnedPool, Stream};
use ferry_memory::{DType, Device};
use ferry_tensor::{Buffer, Layout, Result, Storage, Tensor, TensorError, with_no_grad};

use crate::copy::move_bytes;
use crate::report::{TransferPath, TransferReport};
use crate::staging::{StagingMeter, copy_bytes, cuda, dense, within_budget};

/// Named tensors, in order: a model's parameters and buffers.
pub type StateDict = Vec<(String, Tensor)>;

/// Every arena offset is a multiple of this: any dtype's elements stay aligned for SIMD.
const ALIGN: usize = 64;

/// Tensors under this size are gathered on the device into one buffer and cross in one DMA
/// (a copy costs a few microseconds however small it is); larger ones go straight from where
/// they are into their place in the arena, so the link starts at once and no device scratch of
/// their size is needed.
const DIRECT_FROM: usize = 4 << 20;

/// Moves every tensor of `tensors` to `device` in one batch and returns them under the same
/// names, in the same order.
///
/// GPU to host: the tensors of each dtype land in one pinned arena, all copies queued on the
/// source device's default stream (so they follow the tensors' producers) with one event, and
/// the host waits once at the end. The results are views into the arena (no further copy), so
/// the arena is freed when the last of them drops. Host to GPU is symmetric: one pinned staging
/// arena per dtype, uploaded in one copy into one device arena per dtype.
///
/// A group whose arena would not fit the pinned budget (`ferry::cuda::pinned::set_budget`)
/// moves tensor by tensor instead, each landing pinned while it fits and in pageable memory
/// beyond. `report.staging_peak_bytes` is what the move itself held (staging arenas and device
/// scratch), counted by the move; the pools' statistics are left alone.
///
/// A state dict is data: the results carry no gradient history (the move detaches, and
/// records nothing). Tensors already on `device` are returned detached, without a copy.
///
/// [`queue_state_dict`] is the same move without the wait at the end.
pub fn move_state_dict(
    tensors: &[(String, Tensor)],
    device: Device,
) -> Result<(StateDict, TransferReport)> {
    let mut queued = queue_state_dict(tensors, device)?;
    let report = queued.wait()?;
    Ok((queued.into_tensors(), report))
}

/// The copies of [`move_state_dict`], queued: the results exist at once and the host goes on
/// while the bytes cross (a caller hands them on, or queues more work, meanwhile).
///
/// Reading a result before [`QueuedStateDict::wait`] is safe, as for any move: a host result
/// waits for its copy when its bytes are read, a device result is ordered on the device.
/// What the copies read stays held until the wait, or until the queued move is dropped, which
/// waits too.
pub fn queue_state_dict(tensors: &[(String, Tensor)], device: Device) -> Result<QueuedStateDict> {
    let start = Instant::now();
    let mut moved: Vec<Option<Tensor>> = vec![None; tensors.len()];
    // Indices by (source device, dtype); BTreeMap keeps the batches in a stable order.
    let mut groups: BTreeMap<(String, &str), (Device, DType, Vec<usize>)> = BTreeMap::new();
    for (i, (_, t)) in tensors.iter().enumerate() {
        if t.device() == device {
            moved[i] = Some(t.detach());
        } else {
            groups
                .entry((t.device().to_string(), t.dtype().name()))
                .or_insert_with(|| (t.device(), t.dtype(), Vec::new()))
                .2
                .push(i);
        }
    }
    let mut queued = QueuedStateDict {
        tensors: Vec::new(),
        report: TransferReport::new(TransferPath::Batched { tensors: 0 }, 0),
        start,
        to_sync: Vec::new(),
        keep: Scratch::default(),
        meter: StagingMeter::default(),
    };
    let report = &mut queued.report;
    with_no_grad(|| -> Result<()> {
        for (from, dtype, indices) in groups.values() {
            let group: Vec<&Tensor> = indices.iter().map(|&i| &tensors[i].1).collect();
            let (to_sync, keep, meter) = (&mut queued.to_sync, &mut queued.keep, &mut queued.meter);
            let outs = match (*from, device) {
                (Device::Cuda(ordinal), Device::Cpu) => {
                    download_group(&group, *dtype, ordinal, to_sync, keep, meter)?
                }
                (Device::Cpu, Device::Cuda(ordinal)) => {
                    upload_group(&group, *dtype, ordinal, to_sync, keep, meter)?
                }
                _ => group
                    .iter()
                    .map(|t| Ok(move_bytes(t, device, false)?.0))
                    .collect::<Result<Vec<_>>>()?,
            };
            for (&i, out) in indices.iter().zip(outs) {
                report.bytes_moved += tensors[i].1.nbytes();
                moved[i] = Some(out);
            }
        }
        Ok(())
    })?;
    report.path = TransferPath::Batched {
        tensors: groups.values().map(|(_, _, ix)| ix.len()).sum(),
    };
    queued.to_sync.dedup();
    queued.tensors = tensors
        .iter()
        .zip(moved)
        .map(|((name, _), t)| (name.clone(), t.expect("every tensor was moved or kept")))
        .collect();
    Ok(queued)
}

/// A [`queue_state_dict`] whose copies may still be crossing.
pub struct QueuedStateDict {
    tensors: StateDict,
    report: TransferReport,
    start: Instant,
    /// Every copy of every dtype is on these streams.
    to_sync: Vec<Stream>,
    keep: Scratch,
    /// Staging (pinned arenas, device scratch) counted by this move, not read from the pools.
    meter: StagingMeter,
}

impl QueuedStateDict {
    /// The results, under their names, in order; their copies may still be crossing.
    pub fn tensors(&self) -> &StateDict {
        &self.tensors
    }

    /// Waits for every copy (one synchronization per stream), lets go of what they read, and
    /// returns the move's report, timed from the call that queued it.
    pub fn wait(&mut self) -> Result<TransferReport> {
        for stream in &self.to_sync {
            stream.synchronize()?;
        }
        self.to_sync.clear();
        self.keep = Scratch::default();
        let mut report = self.report.clone();
        report.staging_peak_bytes = self.meter.peak();
        report.elapsed = self.start.elapsed();
        Ok(report)
    }

    /// The results, once waited for.
    pub fn into_tensors(mut self) -> StateDict {
        std::mem::take(&mut self.tensors)
    }
}

impl Drop for QueuedStateDict {
    fn drop(&mut self) {
        // What the copies read must outlive them (a device scratch reused under a DMA would be
        // read as another tensor's bytes).
        for stream in &self.to_sync {
            let _ = stream.synchronize();
        }
    }
}

/// What the copies read, kept until the one synchronization.
#[derive(Default)]
struct Scratch {
    tensors: Vec<Tensor>,
    staging: Vec<PinnedBuffer>,
}

/// Byte offsets of each tensor in an arena, aligned, and the arena's length; an arena too
/// large to address is an error naming the group's element count.
fn arena_offsets(group: &[&Tensor], dtype: DType) -> Result<(Vec<usize>, usize)> {
    let mut end = 0usize;
    let mut offsets = Vec::with_capacity(group.len());
    for t in group {
        let placed = end
            .checked_next_multiple_of(ALIGN)
            .and_then(|at| Some((at, at.checked_add(t.nbytes())?)))
            .filter(|&(_, next)| next <= ferry_memory::size::MAX_BYTES);
        let Some((at, next)) = placed else {
            let elements = group
                .iter()
                .map(|t| t.numel())
                .fold(0, usize::saturating_add);
            return Err(TensorError::TooLarge {
                op: "move_state_dict",
                shape: [elements].as_slice().into(),
                dtype,
            });
        };
        offsets.push(at);
        end = next;
    }
    Ok((offsets, end))
}

/// Views of `storage` at the arena offsets, shaped like the sources (the arena was sized by
/// `arena_offsets`, so each fits; `from_storage` checks it all the same).
fn views(
    storage: Arc<Storage>,
    group: &[&Tensor],
    offsets: &[usize],
    dtype: DType,
) -> Result<Vec<Tensor>> {
    group
        .iter()
        .zip(offsets)
        .map(|(t, &at)| {
            let contiguous = Layout::contiguous(t.shape());
            let layout = Layout::new(
                contiguous.shape().into(),
                contiguous.strides().into(),
                at / dtype.size(),
            )?;
            Tensor::from_storage(Arc::clone(&storage), layout)
        })
        .collect()
}

fn download_group(
    group: &[&Tensor],
    dtype: DType,
    ordinal: usize,
    to_sync: &mut Vec<Stream>,
    keep: &mut Scratch,
    meter: &mut StagingMeter,
) -> Result<Vec<Tensor>> {
    let dev = cuda(ordinal)?;
    let stream = dev.default_stream().clone();
    // The small tensors first in the arena: packed, they are one contiguous region.
    let (small, large): (Vec<usize>, Vec<usize>) =
        (0..group.len()).partition(|&i| group[i].nbytes() < DIRECT_FROM);
    let order: Vec<usize> = small.iter().chain(&large).copied().collect();
    let placed: Vec<&Tensor> = order.iter().map(|&i| group[i]).collect();
    let (placed_offsets, len) = arena_offsets(&placed, dtype)?;
    let Some(mut arena) = within_budget(PinnedPool::global()?.alloc(len))? else {
        return one_by_one(group, Device::Cpu, meter);
    };
    let mut offsets = vec![0; group.len()];
    for (&i, &at) in order.iter().zip(&placed_offsets) {
        offsets[i] = at;
    }
    let mut batch = arena.batch(&stream)?;
    if small.len() > 1 {
        // Many small copies cost a few microseconds each: gather them on the device in a few
        // kernel launches, then move them as one DMA. Queued first, so the big copies follow
        // a short kernel, not the other way round.
        let (packed, elements) = Tensor::pack(&placed[..small.len()], ALIGN)?;
        debug_assert!(
            elements
                .iter()
                .zip(&placed_offsets)
                .all(|(e, o)| e * dtype.size() == *o)
        );
        // Device scratch, held until the one synchronization.
        meter.hold(CudaDevice::block_size(packed.nbytes()));
        {
            let guard = packed.storage().read();
            let Buffer::Cuda(from) = &*guard else {
                return Err(TensorError::UnsupportedDevice {
                    op: "move_state_dict",
                    device: packed.device(),
                });
            };
            batch.download(from, 0, 0, packed.nbytes())?;
        }
        keep.tensors.push(packed);
    }
    let direct = if small.len() > 1 {
        &large[..]
    } else {
        &order[..]
    };
    for &i in direct {
        let t = group[i];
        // Contiguous views (offsets included) copy straight from their storage.
        let src = if t.is_contiguous() {
            t.detach()
        } else {
            // Made contiguous on the device first: scratch, held until the synchronization.
            meter.hold(CudaDevice::block_size(t.nbytes()));
            dense(t)?
        };
        let guard = src.storage().read();
        let Buffer::Cuda(from) = &*guard else {
            return Err(TensorError::UnsupportedDevice {
                op: "move_state_dict",
                device: src.device(),
            });
        };
        batch.download(
            from,
            src.layout().offset() * dtype.size(),
            offsets[i],
            src.nbytes(),
        )?;
        drop(guard);
        keep.tensors.push(src);
    }
    batch.finish()?;
    to_sync.push(stream);
    let storage = Arc::new(Storage::new(Buffer::Pinned(arena), dtype, Device::Cpu));
    views(storage, group, &offsets, dtype)
}

fn upload_group(
    group: &[&Tensor],
    dtype: DType,
    ordinal: usize,
    to_sync: &mut Vec<Stream>,
    keep: &mut Scratch,
    meter: &mut StagingMeter,
) -> Result<Vec<Tensor>> {
    let dev = cuda(ordinal)?;
    let stream = dev.default_stream().clone();
    let (offsets, len) = arena_offsets(group, dtype)?;
    let Some(mut staging) = within_budget(PinnedPool::global()?.alloc(len))? else {
        return one_by_one(group, Device::Cuda(ordinal), meter);
    };
    // Held until the one synchronization.
    meter.hold(staging.block_size());
    {
        let bytes = staging.as_bytes_mut()?;
        for (t, &at) in group.iter().zip(&offsets) {
            let src = if t.is_contiguous() {
                t.detach()
            } else {
                t.detach().copy()?
            };
            let guard = src.storage().read();
            let host = guard.host_slice("move_state_dict", src.device())?;
            let from = src.layout().offset() * dtype.size();
            copy_bytes(
                &mut bytes[at..at + src.nbytes()],
                &host[from..from + src.nbytes()],
            );
        }
    }
    let mut out = dev.alloc(len, &stream)?;
    {
        // One upload for the whole arena: the device arena has the same offsets.
        let mut batch = staging.batch(&stream)?;
        batch.upload(&mut out, 0, 0, len)?;
        batch.finish()?;
    }
    to_sync.push(stream);
    // Dropping the staging arena early would be safe too: its event keeps the pool from
    // reusing it before the upload has read it.
    keep.staging.push(staging);
    let storage = Arc::new(Storage::new(
        Buffer::Cuda(out),
        dtype,
        Device::Cuda(ordinal),
    ));
    views(storage, group, &offsets, dtype)
}

/// A group whose arena does not fit the pinned budget: each tensor on its own, blocking (each
/// lands pinned while it fits, else in pageable memory through bounded staging).
fn one_by_one(group: &[&Tensor], device: Device, meter: &mut StagingMeter) -> Result<Vec<Tensor>> {
    group
        .iter()
        .map(|t| {
            let (moved, _, staging) = move_bytes(t, device, false)?;
            // Each move's staging is gone when it returns.
            meter.hold(staging);
            meter.release(staging);
            Ok(moved)
        })
        .collect()
}
