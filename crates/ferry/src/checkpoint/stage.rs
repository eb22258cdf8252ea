//! The staging a bounded save or load holds: a ring of pinned slots (from the pinned pool,
//! within its budget), the copy stream pieces move on, the meters that count what the save or
//! load holds itself, and the report it returns.
//!
//! The pools' statistics and peaks belong to the user: nothing here resets them; each save or
//! load counts what it allocates.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use ferry_memory::MemoryError;
use ferry_memory::cuda::{CudaDevice, PinnedBuffer, PinnedPool, Stream};
use ferry_tensor::{Result, TensorError};
use ferry_transfer::{TransferPath, TransferReport};

use super::plan::SLOTS;

/// What a bounded save or load did, and the extra memory it held at its peak.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CheckpointReport {
    /// Tensors written or read.
    pub tensors: usize,
    /// Bytes of tensor data in the file.
    pub bytes: usize,
    /// Of those, bytes that crossed a device boundary (GPU to host on save, host to GPU on
    /// load).
    pub device_bytes: usize,
    /// Pieces that went through staging (device tensors, and non-contiguous host tensors).
    pub pieces: usize,
    /// The most extra host memory held at once: pinned staging as the pinned pool sizes its
    /// blocks, pageable staging when the pinned budget had no room, and scratch for
    /// non-contiguous host tensors.
    pub peak_extra_host_bytes: usize,
    /// The most extra device memory held at once, all devices together: scratch for
    /// non-contiguous device tensors, as the device allocator sizes its blocks. Loaded tensors
    /// are the result, not extra.
    pub peak_extra_device_bytes: usize,
    /// Whether the pinned budget had no room for the ring, so pieces went through pageable
    /// memory and the driver's slower path.
    pub pageable: bool,
    /// Wall time, from the first byte to the file synced (save) or the last tensor verified
    /// and on its device (load).
    pub elapsed: Duration,
}

impl CheckpointReport {
    /// The report of [`save`](super::save) in the transfer layer's terms: the device bytes,
    /// moved in pieces, with the staging peak.
    pub fn transfer_report(&self) -> TransferReport {
        TransferReport {
            bytes_moved: self.device_bytes,
            path: if self.device_bytes == 0 {
                TransferPath::SameDevice
            } else {
                TransferPath::Chunked {
                    chunks: self.pieces,
                }
            },
            staging_peak_bytes: self.peak_extra_host_bytes.max(self.peak_extra_device_bytes),
            nodes_recorded: 0,
            nodes_pruned: 0,
            grad_bytes_copied: 0,
            elapsed: self.elapsed,
        }
    }
}

impl fmt::Display for CheckpointReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} tensor(s), {} bytes ({} across devices) in {} piece(s), {:.3} ms; peak extra host {} bytes, device {} bytes{}",
            self.tensors,
            self.bytes,
            self.device_bytes,
            self.pieces,
            self.elapsed.as_secs_f64() * 1e3,
            self.peak_extra_host_bytes,
            self.peak_extra_device_bytes,
            if self.pageable {
                " (pageable staging: the pinned budget had no room)"
            } else {
                ""
            }
        )
    }
}

/// Bytes held by a save or load, counted as it allocates and frees.
#[derive(Debug, Default)]
pub(super) struct Meter {
    now: usize,
    peak: usize,
}

impl Meter {
    pub fn hold(&mut self, bytes: usize) {
        self.now += bytes;
        self.peak = self.peak.max(self.now);
    }

    pub fn release(&mut self, bytes: usize) {
        self.now -= bytes;
    }

    pub fn peak(&self) -> usize {
        self.peak
    }
}

/// One copy stream per device for checkpoint pieces, made once, so their DMA overlaps the
/// work on the default stream and the host's file I/O.
pub(super) fn copy_stream(dev: &CudaDevice) -> Result<Stream> {
    static STREAMS: OnceLock<Mutex<HashMap<usize, Stream>>> = OnceLock::new();
    let streams = STREAMS.get_or_init(Default::default);
    let lock = || {
        streams
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    };
    if let Some(stream) = lock().get(&dev.ordinal()) {
        return Ok(stream.clone());
    }
    // Made outside the lock: a device's first second stream synchronizes the device.
    let stream = dev.new_stream()?;
    Ok(lock().entry(dev.ordinal()).or_insert(stream).clone())
}

/// Orders `stream` after everything queued so far on `dev`'s default stream.
pub(super) fn after_default(dev: &CudaDevice, stream: &Stream) -> Result<()> {
    if stream != dev.default_stream() {
        stream.wait_event(&dev.default_stream().record()?)?;
    }
    Ok(())
}

/// A staging slot: pinned (DMA on the copy stream, overlapped) or, when the pinned budget has
/// no room, pageable (the driver's synchronous path).
pub(super) enum Slot {
    Pinned(PinnedBuffer),
    Pageable(Vec<u8>),
}

/// The ring: `SLOTS` slots of `slot_len` bytes (fewer when fewer pieces need staging), all
/// pinned, or one pageable slot when the pinned budget has no room.
pub(super) struct Ring {
    pub slots: Vec<Slot>,
    slot_len: usize,
    held: usize,
}

impl Ring {
    /// A ring for `pieces` pieces of at most `slot_len` bytes; what it holds goes on `meter`.
    pub fn new(slot_len: usize, pieces: usize, meter: &mut Meter) -> Result<Self> {
        let count = pieces.clamp(1, SLOTS);
        let pool = PinnedPool::global()?;
        let mut slots = Vec::with_capacity(count);
        for _ in 0..count {
            match pool.alloc_exact(slot_len) {
                Ok(buffer) => slots.push(Slot::Pinned(buffer)),
                Err(MemoryError::PinnedBudgetExceeded { .. }) => {
                    // What was taken goes back as `slots` drops.
                    drop(slots);
                    meter.hold(slot_len);
                    return Ok(Self {
                        slots: vec![Slot::Pageable(vec![0; slot_len])],
                        slot_len,
                        held: slot_len,
                    });
                }
                Err(e) => return Err(TensorError::from(e)),
            }
        }
        let held = slots
            .iter()
            .map(|s| match s {
                Slot::Pinned(b) => b.block_size(),
                Slot::Pageable(v) => v.len(),
            })
            .sum();
        meter.hold(held);
        Ok(Self {
            slots,
            slot_len,
            held,
        })
    }

    /// Bytes of each slot.
    pub fn slot_len(&self) -> usize {
        self.slot_len
    }

    /// Bytes the slots hold, as the pools size them.
    pub fn held(&self) -> usize {
        self.held
    }

    /// Whether the slots are pageable.
    pub fn pageable(&self) -> bool {
        matches!(self.slots.first(), Some(Slot::Pageable(_)))
    }

    /// Gives the slots back (to the pool, which reuses a block only once its copies are done).
    pub fn release(self, meter: &mut Meter) {
        meter.release(self.held);
    }
}
