//! How a tensor is cut into pieces that each fit one staging slot: the options a bounded save
//! or load takes, and the plan, which is pure arithmetic on shapes (so the CPU tests check it).
//!
//! A contiguous tensor is cut into byte ranges of its data. A non-contiguous one is cut into
//! blocks along its leading axes (rows, then parts of one row, and so on), each made
//! contiguous on its own device before it is staged; blocks follow each other in C order, so
//! the bytes written are those of the whole tensor made contiguous.

use std::ops::Range;

use ferry_memory::cuda::{CudaDevice, PinnedPool, Stream};

use super::CheckpointError;

/// Staging a bounded save or load holds by default: 256 MiB.
pub const DEFAULT_STAGING_BYTES: usize = 256 << 20;

/// Slots in the staging ring: while the host writes (or reads) one, the others are in DMA.
pub(super) const SLOTS: usize = 4;

/// The smallest slot: the pinned pool's smallest block.
const MIN_SLOT: usize = 4096;

/// Options of [`save_with`](super::save_with).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SaveOptions {
    /// The most extra memory the save holds at once, on the host (pinned staging, and scratch
    /// for non-contiguous host tensors) and on each device (scratch for non-contiguous device
    /// tensors): each bounded separately by this many bytes, as the pools count them.
    pub staging_bytes: usize,
}

impl Default for SaveOptions {
    fn default() -> Self {
        Self {
            staging_bytes: DEFAULT_STAGING_BYTES,
        }
    }
}

/// Options of [`load_to`](super::load_to).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadOptions {
    /// The most pinned staging the load holds at once, as the pinned pool counts it. The
    /// loaded tensors themselves take the file's size on the target device; this bounds what
    /// comes on top.
    pub staging_bytes: usize,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            staging_bytes: DEFAULT_STAGING_BYTES,
        }
    }
}

/// Where an asynchronous save's snapshot lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SnapshotMemory {
    /// [`SnapshotMemory::Bounded`] to the staging's size where the call copied every tensor
    /// of a save of GPU tensors on its GPU ([`AsyncSaveOptions::device_copy`]): nothing waits
    /// for the snapshot, so it goes at the disk's pace, DMAed from the device copies into
    /// pinned pieces that the writer writes as they are, with no drain beside the training
    /// and little host memory (the device copies are held until the file has caught up).
    /// [`SnapshotMemory::Pageable`] where host tensors are saved beside them.
    /// [`SnapshotMemory::Pinned`] where GPU tensors are read in place (no room for the copies,
    /// or the copy off): writes to them wait for their DMAs, which land at the link's rate
    /// only in pinned memory.
    #[default]
    Auto,
    /// Pageable host memory: device pieces cross the pinned ring, drained by all cores but
    /// two. Extra host memory up to the state's size, falling as the file is written (each
    /// piece is freed once its bytes are in the file); beside training the drain moves a
    /// fraction of the link's rate, so writes to GPU tensors read in place wait that long.
    Pageable,
    /// At most this many bytes of snapshot in host memory at once (the pinned ring aside):
    /// the disk sets the pace, and writes to tensors not yet copied wait until the file has
    /// caught up with them. Device pieces are DMAed into pinned pieces of their own, which the
    /// writer writes as they are (through the ring and a drain into pageable memory where the
    /// pinned budget has no room).
    Bounded(usize),
    /// Straight into pinned memory, one buffer per piece, where the pinned budget has room
    /// (pieces that do not fit go through the ring into pageable memory): no drain, the
    /// link's full speed, but pinned memory up to the state's size.
    Pinned,
}

/// Options of [`save_async`](super::save_async).
#[derive(Debug, Clone)]
pub struct AsyncSaveOptions {
    /// The pinned ring device pieces cross through (256 MiB by default, in four slots).
    pub staging_bytes: usize,
    /// Where the snapshot lands.
    pub memory: SnapshotMemory,
    /// Streams whose work queued before the call the copies also come after (each device's
    /// default stream always counts): another runtime's current stream, say.
    pub after: Vec<Stream>,
    /// Rename the written file over the target only once [`PendingSave::confirm`] (or
    /// [`PendingSave::wait`]) says so; [`PendingSave::abandon`] discards it instead. For
    /// callers that check the snapshot before keeping it, as the Python package checks torch's
    /// version counters. A later save to the same path waits until this one is confirmed (or
    /// abandoned) and written.
    ///
    /// [`PendingSave::confirm`]: super::PendingSave::confirm
    /// [`PendingSave::wait`]: super::PendingSave::wait
    /// [`PendingSave::abandon`]: super::PendingSave::abandon
    pub confirm: bool,
    /// Whether each GPU tensor is first copied on its GPU, at the call (queued on its default
    /// stream right after the work before the call, at the device's memory speed), the host
    /// copy then taken from there: in-place writes never wait, at the price of extra device
    /// memory the size of the device tensors until the snapshot is taken. By default where the
    /// device has room for it ([`DeviceCopy::IfRoom`]).
    pub device_copy: DeviceCopy,
}

/// Whether an asynchronous save copies GPU tensors on their GPU first
/// ([`AsyncSaveOptions::device_copy`]).
///
/// The copies' memory comes from ferry's device allocator and goes back to its cache once the
/// snapshot is taken, so a periodic save finds it there: only the first save of a state pays
/// for `cuMemAlloc`, in its call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DeviceCopy {
    /// Read every tensor in place: an in-place write to a GPU tensor waits until its bytes have
    /// crossed the link.
    Off,
    /// Copy a device's tensors where its free memory (the driver's, plus blocks cached in
    /// ferry's allocator) covers them and leaves [`device_copy_headroom`] for the training
    /// beside it; read them in place otherwise.
    #[default]
    IfRoom,
    /// Copy wherever device memory can be had; where it runs out, the remaining tensors are
    /// read in place.
    Always,
}

/// The free device memory [`DeviceCopy::IfRoom`] leaves untouched on a device of
/// `total_bytes`: a 32nd of it, and at least 1 GiB, for the allocations of the training that
/// goes on beside the save (its activations come back with the next forward).
pub fn device_copy_headroom(total_bytes: usize) -> usize {
    (total_bytes / 32).max(1 << 30)
}

impl Default for AsyncSaveOptions {
    fn default() -> Self {
        Self {
            staging_bytes: DEFAULT_STAGING_BYTES,
            memory: SnapshotMemory::Auto,
            after: Vec::new(),
            confirm: false,
            device_copy: DeviceCopy::IfRoom,
        }
    }
}

/// The sizes a staging bound allows: the slot a piece is staged in, and the largest block of a
/// non-contiguous tensor (so its scratch, as the device allocator sizes it, fits a slot).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Slots {
    /// Bytes of one slot; `SLOTS` of them, as the pinned pool sizes them, fit the bound.
    pub slot: usize,
    /// Bytes of the largest contiguous block made of a non-contiguous tensor.
    pub block: usize,
}

impl Slots {
    /// The slots for `staging_bytes`, or an error naming the smallest bound that works.
    pub fn new(op: &'static str, staging_bytes: usize) -> Result<Self, CheckpointError> {
        let share = staging_bytes / SLOTS;
        if share < MIN_SLOT {
            return Err(CheckpointError::StagingTooSmall {
                op,
                staging_bytes,
                minimum: SLOTS * MIN_SLOT,
            });
        }
        // The largest pinned class within the share: classes are multiples of 1/8 of their
        // power of two.
        let granule = (1usize << share.ilog2()) >> 3;
        let slot = share / granule.max(1) * granule.max(1);
        debug_assert!(PinnedPool::block_size(slot) <= share);
        let block = largest_within(slot, CudaDevice::block_size).min(slot);
        Ok(Self { slot, block })
    }
}

/// The largest `n <= limit` whose `size(n)` is at most `limit` (`size` grows with `n`).
fn largest_within(limit: usize, size: impl Fn(usize) -> usize) -> usize {
    let (mut lo, mut hi) = (0usize, limit);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if size(mid) <= limit {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

/// One piece of a tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Piece {
    /// Bytes of a contiguous tensor's data, counted from its first element.
    Bytes(Range<usize>),
    /// A block of a non-contiguous tensor: a range of each leading axis (every range but the
    /// last has length 1), the trailing axes whole.
    Block(Vec<Range<usize>>),
}

impl Piece {
    /// Bytes the piece holds.
    pub fn len(&self, shape: &[usize], elem: usize) -> usize {
        match self {
            Piece::Bytes(r) => r.len(),
            Piece::Block(ranges) => {
                let inner: usize = shape[ranges.len()..].iter().product();
                ranges.iter().map(Range::len).product::<usize>() * inner * elem
            }
        }
    }
}

/// The pieces of a tensor of `shape` with `elem`-byte elements, in order: byte ranges of at
/// most `slot` when it is contiguous, else blocks of at most `block` bytes. An empty tensor has
/// none.
pub(super) fn pieces(shape: &[usize], elem: usize, contiguous: bool, slots: Slots) -> Vec<Piece> {
    let nbytes = shape.iter().product::<usize>() * elem;
    if nbytes == 0 {
        return Vec::new();
    }
    if contiguous || shape.is_empty() {
        return (0..nbytes)
            .step_by(slots.slot)
            .map(|start| Piece::Bytes(start..(start + slots.slot).min(nbytes)))
            .collect();
    }
    let mut out = Vec::new();
    blocks(
        shape,
        elem,
        slots.block.max(elem),
        &mut Vec::new(),
        &mut out,
    );
    out
}

/// Cuts the sub-tensor selected by `prefix` (one index per leading axis) along the next axis.
fn blocks(
    shape: &[usize],
    elem: usize,
    limit: usize,
    prefix: &mut Vec<Range<usize>>,
    out: &mut Vec<Piece>,
) {
    let axis = prefix.len();
    let row: usize = shape[axis + 1..].iter().product::<usize>() * elem;
    let rows_per_block = limit / row;
    if rows_per_block == 0 {
        // One row is too large: cut each row along the next axis.
        for i in 0..shape[axis] {
            prefix.push(i..i + 1);
            blocks(shape, elem, limit, prefix, out);
            prefix.pop();
        }
        return;
    }
    for start in (0..shape[axis]).step_by(rows_per_block) {
        let mut ranges = prefix.clone();
        ranges.push(start..(start + rows_per_block).min(shape[axis]));
        out.push(Piece::Block(ranges));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The flat element indices a piece covers, in order.
    fn covered(shape: &[usize], elem: usize, piece: &Piece) -> Vec<usize> {
        match piece {
            Piece::Bytes(r) => {
                assert_eq!(r.start % elem, 0);
                (r.start / elem..r.end.div_ceil(elem)).collect()
            }
            Piece::Block(ranges) => {
                let strides: Vec<usize> = (0..shape.len())
                    .map(|a| shape[a + 1..].iter().product())
                    .collect();
                let inner: usize = shape[ranges.len()..].iter().product();
                let mut idx = vec![0usize];
                for (a, r) in ranges.iter().enumerate() {
                    let stride = strides[a];
                    idx = idx
                        .iter()
                        .flat_map(|&base| r.clone().map(move |i| base + i * stride))
                        .collect();
                }
                idx.iter().flat_map(|&b| b..b + inner).collect()
            }
        }
    }

    #[test]
    fn slots_fit_the_bound_as_the_pools_size_them() {
        for bound in [
            16 << 10,
            100_000,
            1 << 20,
            3 << 20,
            256 << 20,
            1_000_000_007,
        ] {
            let s = Slots::new("save", bound).unwrap();
            assert!(SLOTS * PinnedPool::block_size(s.slot) <= bound, "{bound}");
            assert!(CudaDevice::block_size(s.block) <= s.slot, "{bound}");
            // Within 1/8 (the pinned classes' step) of the share, so the bound is used.
            assert!(s.slot * 8 >= bound / SLOTS * 7, "{bound}: slot {}", s.slot);
            assert!(s.block > 0);
        }
        assert_eq!(Slots::new("save", 256 << 20).unwrap().slot, 64 << 20);
        let err = Slots::new("save", 16383).unwrap_err().to_string();
        assert!(err.contains("16384"), "{err}");
    }

    #[test]
    fn pieces_cover_every_element_once_in_order_within_the_slot() {
        let slots = Slots {
            slot: 4096,
            block: 4096,
        };
        let cases: &[(&[usize], usize, bool)] = &[
            (&[10_000], 4, true),
            (&[3, 5000], 8, true),
            (&[], 8, true),
            (&[0, 7], 4, true),
            (&[64, 300], 4, false),       // many rows per block
            (&[2, 3000], 4, false),       // one row is larger than a block: cut along axis 1
            (&[2, 3, 2000, 2], 2, false), // cut down to axis 2
            (&[5, 1], 8, false),
        ];
        for &(shape, elem, contiguous) in cases {
            let n: usize = shape.iter().product();
            let pieces = pieces(shape, elem, contiguous, slots);
            let flat: Vec<usize> = pieces
                .iter()
                .flat_map(|p| covered(shape, elem, p))
                .collect();
            assert_eq!(flat, (0..n).collect::<Vec<_>>(), "{shape:?}");
            for p in &pieces {
                let len = p.len(shape, elem);
                assert!(len > 0 && len <= 4096, "{shape:?}: {p:?} holds {len}");
            }
            let total: usize = pieces.iter().map(|p| p.len(shape, elem)).sum();
            assert_eq!(total, n * elem);
        }
        // A contiguous 10 000-element f32 tensor in 4 KiB slots: ten pieces, the last short.
        let p = pieces(&[10_000], 4, true, slots);
        assert_eq!(p.len(), 10);
        assert_eq!(p[9], Piece::Bytes(36_864..40_000));
    }

    #[test]
    fn the_largest_size_within_a_limit_is_found() {
        assert_eq!(largest_within(100, |n| n.div_ceil(16) * 16), 96);
        assert_eq!(largest_within(5 << 20, CudaDevice::block_size), 4 << 20);
        assert_eq!(largest_within(0, |n| n), 0);
    }
}
