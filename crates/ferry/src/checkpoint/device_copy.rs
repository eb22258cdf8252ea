//! The device copy of an asynchronous save
//! ([`AsyncSaveOptions::device_copy`](super::AsyncSaveOptions::device_copy)): in the call, each
//! GPU tensor copied on its GPU where it has room, so that the snapshot reads the copies and
//! in-place writes after the call never wait.
//!
//! Tensors of [`SIDE_COPY_MIN_BYTES`] or more are copied on the save's copy stream, beside the
//! work queued after the call (the training's next forward and backward), not ahead of it: the
//! copy of a 12 GB state took 10-13 ms of an H100's memory bandwidth, which the first step
//! after the call paid in full when the copies were queued on the default stream. Writes to
//! them are ordered after the copies on the device: ferry's own by its buffers' stream
//! tracking, another runtime's by [`PendingSave::order_writes_after`](super::PendingSave::order_writes_after).
//! Smaller tensors, and non-contiguous ones, are copied on the default stream, in its order.

use std::sync::Arc;

use ferry_memory::cuda::{CudaDevice, Event};
use ferry_tensor::{Buffer, Device, Layout, Storage, Tensor, TensorError};

use super::CheckpointError;
use super::plan::{DeviceCopy, device_copy_headroom};
use super::snapshot::{Job, release};
use super::stage::{after_default, copy_stream};
use super::write::cuda_buffer;

/// The least bytes of a tensor copied on the save's copy stream rather than the default one:
/// a norm's weights and running statistics (written in a forward, say) stay in the default
/// stream's order, and the bulk of a state, its matrices and their optimizer moments, is
/// copied beside the training.
pub const SIDE_COPY_MIN_BYTES: usize = 1 << 20;

/// Each side copy's start in its buffer: a multiple of every element size, and of the DMA's
/// preferred alignment.
const SIDE_ALIGN: usize = 256;

/// What [`copy_on_devices`] copied.
#[derive(Default)]
pub(super) struct Copied {
    pub bytes: usize,
    /// Per device with copies on its copy stream: the event after them.
    pub side: Vec<(usize, Event)>,
    /// The entries copied there, in file order.
    pub side_entries: Vec<usize>,
}

/// Copies the device tensors on their devices and lets go of them: called at the call
/// ([`AsyncSaveOptions::device_copy`](super::AsyncSaveOptions::device_copy)), so the copies
/// read the work queued before the call, and in-place writes never wait. Under
/// [`DeviceCopy::IfRoom`] a device's tensors are copied only where it has room for them
/// ([`has_room`]). Tensors of [`SIDE_COPY_MIN_BYTES`] or more, contiguous, are copied on the
/// device's copy stream (one buffer per device and dtype, each tensor then read through a view
/// of it); the other contiguous ones of one device and dtype together into one buffer on the
/// default stream (`Tensor::cat`, a few launches for hundreds of tensors); the rest one by
/// one, stopping at the first failure (device memory full, say): the tensors left are read in
/// place as usual, their writes held off until their DMA. Makes each device's `ready` event the
/// one after its default-stream copies.
pub(super) fn copy_on_devices(
    job: &mut Job,
    policy: DeviceCopy,
) -> Result<Copied, CheckpointError> {
    // The copies wait on the default streams for the other streams' work of before the call
    // (`after`), as the DMAs would on the copy stream.
    for (ordinal, event) in &job.after {
        let dev = CudaDevice::get(*ordinal).map_err(TensorError::from)?;
        dev.default_stream()
            .wait_event(event)
            .map_err(TensorError::from)?;
    }
    let devices = devices_to_copy(job, policy)?;
    let mut copied = copy_beside(job, &devices)?;
    // A plain copy: the snapshot is no part of any graph.
    copied.bytes += ferry_tensor::with_no_grad(|| copy_grouped(job, &devices))?;
    // The DMAs come after the copies: each device's `ready` event (there is one per device
    // with tensors, recorded at the call) is recorded anew behind them.
    for (ordinal, event) in &mut job.ready {
        let dev = CudaDevice::get(*ordinal).map_err(TensorError::from)?;
        *event = dev.default_stream().record().map_err(TensorError::from)?;
    }
    Ok(copied)
}

/// Copies the contiguous tensors of [`SIDE_COPY_MIN_BYTES`] or more on `devices` on each
/// device's copy stream, after everything queued before the call, into one buffer per device
/// and dtype; where a buffer cannot be had, its tensors are left to [`copy_grouped`].
fn copy_beside(job: &mut Job, devices: &[Device]) -> Result<Copied, CheckpointError> {
    let mut copied = Copied::default();
    let large = |t: &Tensor| t.nbytes() >= SIDE_COPY_MIN_BYTES;
    for ((device, dtype), members) in groups(job.entries.iter().map(|e| &e.t), devices, large) {
        let Device::Cuda(ordinal) = device else {
            continue;
        };
        let dev = CudaDevice::get(ordinal).map_err(TensorError::from)?;
        let stream = copy_stream(&dev)?;
        if !copied.side.iter().any(|(o, _)| *o == ordinal) {
            // After the default stream's work of the call, which waits for `after` (above).
            after_default(&dev, &stream)?;
        }
        let (end, starts) = side_len(members.iter().map(|&e| job.entries[e].t.nbytes()));
        let Ok(mut buffer) = dev.alloc(end, &stream) else {
            continue; // no room for one buffer: on the default stream below
        };
        for (&e, &at) in members.iter().zip(&starts) {
            let t = &job.entries[e].t;
            let guard = t.storage().read();
            let from = cuda_buffer(&guard, t)?;
            let start = t.layout().offset() * dtype.size();
            buffer
                .copy_region(at, from, start, t.nbytes(), &stream)
                .map_err(TensorError::from)?;
        }
        let storage = Arc::new(Storage::new(Buffer::Cuda(buffer), dtype, device));
        let whole = Tensor::from_storage(storage, Layout::contiguous(&[end / dtype.size()]))?;
        for (&e, &at) in members.iter().zip(&starts) {
            let t = &job.entries[e].t;
            let view = whole
                .narrow(0, at / dtype.size(), t.numel())?
                .reshape(t.shape())?;
            copied.bytes += view.nbytes();
            let copied_from = std::mem::replace(&mut job.entries[e].t, view);
            job.retired.push(copied_from);
            release(job, e);
            copied.side_entries.push(e);
        }
        let after = stream.record().map_err(TensorError::from)?;
        match copied.side.iter_mut().find(|(o, _)| *o == ordinal) {
            Some((_, event)) => *event = after,
            None => copied.side.push((ordinal, after)),
        }
    }
    copied.side_entries.sort_unstable();
    Ok(copied)
}

/// Takes the device memory that the device copies of an asynchronous save of `tensors` use
/// ([`AsyncSaveOptions::device_copy`](super::AsyncSaveOptions::device_copy)) from the driver
/// now, and leaves it in ferry's allocator cache, where the copies of the first save find it,
/// compiles the kernels the copies launch on those devices
/// ([`compile_copy_kernels`](ferry_tensor::compile_copy_kernels), 53 ms on a fresh H100) and
/// makes the copy stream: without it, the first save of a process pays for `cuMemAlloc` in its
/// call (about 10 ms a GiB), that compile, and the device synchronization of a first second
/// stream; every later one finds the memory the one before gave back. Call it where a stall is
/// not felt (after the model and optimizer are built, before the loop) with the tensors the
/// saves will take, or ones of the same shapes and dtypes. Under [`DeviceCopy::IfRoom`] only
/// devices with room for the copies are reserved for, as the save would decide now;
/// [`DeviceCopy::Off`] reserves nothing. Returns the bytes held ready, cached blocks that already served them
/// included; where device memory runs out first, less than the copies need (the save then
/// copies what it can and reads the rest in place).
///
/// The memory is ferry's until [`cuda::empty_cache`](crate::cuda::empty_cache) gives it
/// back: other runtimes in the process (torch's allocator) cannot use it meanwhile.
pub fn reserve_device_copy(
    tensors: &[(String, Tensor)],
    policy: DeviceCopy,
) -> Result<usize, TensorError> {
    let ts: Vec<&Tensor> = tensors.iter().map(|(_, t)| t).collect();
    let devices = devices_needing(ts.iter().copied(), policy)?;
    let mut buffers = Vec::new();
    let mut grouped = vec![false; ts.len()];
    let mut sizes = Vec::new();
    // The buffers the save allocates: one per device and dtype for the large tensors (on the
    // copy stream; the cache hands a block freed on another stream to it once free), one for
    // the small ones where there are several, each other tensor its own.
    let large = |t: &Tensor| t.nbytes() >= SIDE_COPY_MIN_BYTES;
    for ((device, _), members) in groups(ts.iter().copied(), &devices, large) {
        let (len, _) = side_len(members.iter().map(|&e| ts[e].nbytes()));
        let bytes = members.iter().map(|&e| ts[e].nbytes()).sum();
        sizes.push((device, len, bytes));
        members.iter().for_each(|&e| grouped[e] = true);
    }
    let small = |t: &Tensor| !large(t);
    for ((device, dtype), members) in groups(ts.iter().copied(), &devices, small) {
        if members.len() > 1 {
            let numel: usize = members.iter().map(|&e| ts[e].numel()).sum();
            sizes.push((device, numel * dtype.size(), numel * dtype.size()));
            members.iter().for_each(|&e| grouped[e] = true);
        }
    }
    for (e, t) in ts.iter().enumerate() {
        if !grouped[e] && devices.contains(&t.device()) {
            let bytes = t.numel() * t.dtype().size();
            sizes.push((t.device(), bytes, bytes));
        }
    }
    let mut held = 0;
    // (device, buffer length, tensor bytes it holds)
    for (device, len, bytes) in sizes {
        let Device::Cuda(ordinal) = device else {
            continue;
        };
        let dev = CudaDevice::get(ordinal)?;
        // All at once, so each is a block of its own; dropped together into the cache. Where
        // memory runs out the save would copy no further either: the rest is read in place.
        let Ok(buffer) = dev.alloc(len, dev.default_stream()) else {
            break;
        };
        buffers.push(buffer);
        held += bytes;
    }
    for device in &devices {
        if let Device::Cuda(ordinal) = *device {
            // Best effort: where the kernels cannot be had, the save reads the tensors in place
            // instead of copying them, as where memory runs out.
            let _ = ferry_tensor::compile_copy_kernels(ordinal);
            // The copy stream too: a device's first stream beside its default one synchronizes
            // the device as it is made.
            copy_stream(&CudaDevice::get(ordinal)?)?;
        }
    }
    Ok(held)
}

/// The length of one buffer holding pieces of `lens` bytes, each starting on [`SIDE_ALIGN`],
/// and each piece's start.
fn side_len(lens: impl Iterator<Item = usize>) -> (usize, Vec<usize>) {
    let mut end = 0usize;
    let starts = lens
        .map(|len| {
            let at = end.next_multiple_of(SIDE_ALIGN);
            end = at + len;
            at
        })
        .collect();
    (end, starts)
}

/// The devices whose tensors [`copy_on_devices`] copies under `policy`.
fn devices_to_copy(job: &Job, policy: DeviceCopy) -> Result<Vec<Device>, TensorError> {
    devices_needing(
        job.entries.iter().filter(|e| !e.released).map(|e| &e.t),
        policy,
    )
}

/// The devices of `tensors` whose copies `policy` takes.
fn devices_needing<'a>(
    tensors: impl Iterator<Item = &'a Tensor>,
    policy: DeviceCopy,
) -> Result<Vec<Device>, TensorError> {
    let mut need: Vec<(Device, usize)> = Vec::new();
    for t in tensors {
        if !t.device().is_cuda() {
            continue;
        }
        // The copy is contiguous, whatever the tensor's layout.
        let bytes = t.numel() * t.dtype().size();
        match need.iter_mut().find(|(d, _)| *d == t.device()) {
            Some((_, sum)) => *sum += bytes,
            None => need.push((t.device(), bytes)),
        }
    }
    let mut devices = Vec::new();
    for (device, bytes) in need {
        let Device::Cuda(ordinal) = device else {
            continue;
        };
        let room = match policy {
            DeviceCopy::Off => false,
            DeviceCopy::Always => true,
            DeviceCopy::IfRoom => has_room(&CudaDevice::get(ordinal)?, bytes),
        };
        if room {
            devices.push(device);
        }
    }
    Ok(devices)
}

/// Whether `dev` can hold `bytes` more: within ferry's budget for it, and leaving
/// [`device_copy_headroom`] of the device free. A device that cannot say has no room.
fn has_room(dev: &CudaDevice, bytes: usize) -> bool {
    let Some(info) = dev.memory_info() else {
        return false;
    };
    let stats = dev.memory_stats();
    fits(
        bytes,
        Free {
            driver: info.free_bytes,
            cached: stats.reserved_bytes.saturating_sub(stats.allocated_bytes),
            budget_left: dev
                .budget()
                .map_or(usize::MAX, |b| b.saturating_sub(stats.allocated_bytes)),
            total: info.total_bytes,
        },
    )
}

/// What a device has free for a device copy.
#[derive(Debug, Clone, Copy)]
struct Free {
    /// The driver's free memory: every process's and runtime's use taken out.
    driver: usize,
    /// Blocks cached in ferry's allocator, which the copies may reuse.
    cached: usize,
    /// What ferry's budget for the device still allows (`usize::MAX` without one).
    budget_left: usize,
    total: usize,
}

/// [`has_room`]'s rule: the copies fit ferry's budget, and what the driver and ferry's cache
/// have free covers them and the headroom left for the training beside the save.
fn fits(bytes: usize, free: Free) -> bool {
    let available = free.driver.saturating_add(free.cached);
    bytes <= free.budget_left && available >= bytes.saturating_add(device_copy_headroom(free.total))
}

/// The contiguous, non-empty tensors of `tensors` on `devices`, by device and dtype: the groups
/// [`copy_grouped`] copies into one buffer each where a group has more than one member.
fn groups<'a>(
    tensors: impl Iterator<Item = &'a Tensor>,
    devices: &[Device],
    wanted: impl Fn(&Tensor) -> bool,
) -> Vec<((Device, ferry_tensor::DType), Vec<usize>)> {
    let mut groups: Vec<((Device, ferry_tensor::DType), Vec<usize>)> = Vec::new();
    for (e, t) in tensors.enumerate() {
        if !devices.contains(&t.device()) || !t.is_contiguous() || t.numel() == 0 || !wanted(t) {
            continue;
        }
        let key = (t.device(), t.dtype());
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, members)) => members.push(e),
            None => groups.push((key, vec![e])),
        }
    }
    groups
}

/// [`copy_on_devices`]' copies of the tensors on `devices`: by group where it can, then one by
/// one.
fn copy_grouped(job: &mut Job, devices: &[Device]) -> Result<usize, TensorError> {
    // Those not copied beside the training already.
    let groups = groups(job.entries.iter().map(|entry| &entry.t), devices, |_| true)
        .into_iter()
        .map(|(key, members)| {
            let left = members.into_iter().filter(|&e| !job.entries[e].released);
            (key, left.collect::<Vec<_>>())
        })
        .collect::<Vec<_>>();
    let mut copied = 0;
    for (_, members) in groups.iter().filter(|(_, m)| m.len() > 1) {
        let flat = members
            .iter()
            .map(|&e| job.entries[e].t.reshape(&[job.entries[e].t.numel()]))
            .collect::<ferry_tensor::Result<Vec<_>>>()?;
        let Ok(together) = Tensor::cat(&flat.iter().collect::<Vec<_>>(), 0) else {
            continue; // no room for one buffer: one by one below
        };
        let mut start = 0;
        for &e in members {
            let t = &job.entries[e].t;
            let view = together.narrow(0, start, t.numel())?.reshape(t.shape())?;
            start += t.numel();
            copied += view.nbytes();
            // The pieces stay as they were cut: the view is laid out as the tensor was.
            let copied_from = std::mem::replace(&mut job.entries[e].t, view);
            job.retired.push(copied_from);
            release(job, e);
        }
    }
    for e in 0..job.entries.len() {
        let entry = &job.entries[e];
        if !devices.contains(&entry.t.device()) || entry.released {
            continue;
        }
        let Ok(copy) = entry.t.copy() else {
            break;
        };
        // On the contiguous copy, a non-contiguous tensor's blocks are contiguous ones.
        copied += copy.nbytes();
        let copied_from = std::mem::replace(&mut job.entries[e].t, copy);
        job.retired.push(copied_from);
        release(job, e);
    }
    Ok(copied)
}

#[cfg(test)]
mod tests {
    use super::{Free, fits};

    const GIB: usize = 1 << 30;

    fn free(driver: usize, cached: usize) -> Free {
        Free {
            driver,
            cached,
            budget_left: usize::MAX,
            total: 141 * GIB,
        }
    }

    #[test]
    fn a_device_copy_leaves_a_32nd_of_the_device_to_training() {
        // 141 GiB: the headroom is 4.4 GiB.
        assert!(fits(10 * GIB, free(15 * GIB, 0)));
        assert!(!fits(10 * GIB, free(14 * GIB, 0)));
        // Blocks ferry's allocator caches count as free: the last save's copies are reused.
        assert!(fits(10 * GIB, free(2 * GIB, 13 * GIB)));
    }

    #[test]
    fn a_small_device_keeps_at_least_a_gib() {
        let small = Free {
            total: 8 * GIB,
            ..free(GIB + GIB / 2, 0)
        };
        assert!(fits(GIB / 2, small));
        assert!(!fits(GIB / 2 + 1, small));
    }

    #[test]
    fn a_device_copy_stays_within_ferrys_budget() {
        let capped = Free {
            budget_left: GIB,
            ..free(100 * GIB, 0)
        };
        assert!(fits(GIB, capped));
        assert!(!fits(GIB + 1, capped));
        // Sizes near the top of the address space do not wrap around into "fits".
        assert!(!fits(usize::MAX - GIB, free(100 * GIB, 100 * GIB)));
    }
}
