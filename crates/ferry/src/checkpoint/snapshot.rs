//! The snapshot of an asynchronous save: every tensor's bytes copied, in file order, into
//! host memory the save owns, while training goes on.
//!
//! Each tensor's storage is held for reading from the call (see `ReadHold`) until its bytes
//! are copied: training reads it freely, and the first in-place write to it waits for that
//! tensor's copy alone. Device pieces go through a ring of pinned slots on a copy stream that
//! waits for the work queued before the call; each slot, once its DMA is done, is drained
//! into pageable memory by all cores but two (or the piece is DMAed straight into a pinned
//! buffer of its own: [`SnapshotMemory::Pinned`] within the pinned budget,
//! [`SnapshotMemory::Bounded`] within its bound, at the disk's pace, with no drain). Host
//! tensors are copied by all cores but two. Pieces go to the writer thread in file order.

use std::collections::{HashSet, VecDeque};
use std::ops::Range;
use std::sync::mpsc::Sender;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use ferry_memory::cuda::{CudaDevice, DeviceBuffer, Event, PinnedBatch, PinnedBuffer, PinnedPool};
use ferry_memory::{HostBuffer, HostPool, MemoryError, simd};
use ferry_tensor::{ReadHold, Tensor, TensorError};

use super::CheckpointError;
use super::plan::{Piece, SLOTS, Slots, SnapshotMemory};
use super::progress::Shared;
use super::stage::{Meter, Ring, Slot, copy_stream};
use super::write::{block_view, cuda_buffer, host_source, with_host_bytes};

/// Bytes a core copies at a time when a piece is copied by all cores.
const COPY_CHUNK: usize = 4 << 20;

/// Why a snapshot stopped early.
pub(super) enum Stop {
    Failed(CheckpointError),
    /// The writer stopped first: its error is the save's.
    WriterGone,
}

impl<E: Into<CheckpointError>> From<E> for Stop {
    fn from(e: E) -> Self {
        Stop::Failed(e.into())
    }
}

/// A tensor to snapshot, in file order.
pub(super) struct Entry {
    pub t: Tensor,
    pub pieces: Vec<Piece>,
    /// Index of the hold on its storage.
    pub hold: usize,
    /// Whether its share of the hold was given up.
    pub released: bool,
}

/// A hold on one storage, released once every tensor over it is copied.
pub(super) struct Held {
    pub hold: Option<ReadHold>,
    pub tensors_left: usize,
}

/// One piece's bytes, owned by the save until the writer has written them.
pub(super) enum Bytes {
    Host(HostBuffer),
    Pinned(PinnedBuffer),
    /// Bytes of a pinned block that the pieces packed into it share.
    Shared(Arc<PinnedBuffer>, Range<usize>),
}

impl Bytes {
    pub fn as_slice(&self) -> Result<&[u8], MemoryError> {
        match self {
            Bytes::Host(b) => Ok(b.as_bytes()),
            Bytes::Pinned(b) => b.as_bytes(),
            Bytes::Shared(b, range) => Ok(&b.as_bytes()?[range.clone()]),
        }
    }
}

/// A piece on its way to the file.
pub(super) struct Chunk {
    pub bytes: Bytes,
    /// Extra host memory it holds (pinned included), as the pools size it.
    pub held: usize,
}

impl Chunk {
    /// Gives its memory back to the save's count, once written.
    pub fn release(&self, shared: &Shared) {
        match self.bytes {
            Bytes::Shared(..) => shared.release_paced(self.held),
            Bytes::Pinned(_) => shared.release_pinned(self.held),
            Bytes::Host(_) => shared.release_host(self.held),
        }
    }
}

/// Where a device piece's DMA lands.
enum Dest {
    Slot(usize),
    Own(PinnedBuffer),
    /// A pinned block the size of a slot, its pieces packed, written from where they landed
    /// ([`SnapshotMemory::Bounded`]).
    Paced(PinnedBuffer),
}

/// DMAs queued into one destination: a piece into a pinned buffer of its own, or pieces
/// packed one after another into a ring slot (small tensors share a slot's trip).
struct Flight {
    dest: Dest,
    /// In file order.
    parts: Vec<Part>,
    /// Bytes of the destination taken so far.
    used: usize,
}

/// A device piece in a flight.
struct Part {
    entry: usize,
    /// Whether it is its entry's last piece.
    last: bool,
    /// Where in the destination.
    at: usize,
    len: usize,
    /// A contiguous copy the piece is read from (a non-contiguous tensor's block), kept until
    /// its DMA is done.
    _scratch: Option<Tensor>,
}

/// Pieces packed into a slot start on this boundary.
const PACK_ALIGN: usize = 256;

/// The snapshot's work: entries in file order, their holds, and what the copies come after.
pub(super) struct Job {
    pub entries: Vec<Entry>,
    pub holds: Vec<Held>,
    /// Per device: the event after which its tensors' bytes are the state to save, on its
    /// default stream (recorded at the call; after the device copies, with `device_copy`).
    /// The DMAs of tensors made there wait for it alone, not for the training work queued
    /// there since, which only reads them: writers are held off until their copy.
    pub ready: Vec<(usize, Event)>,
    /// Per device: events recorded at the call on the other streams the copies follow.
    pub after: Vec<(usize, Event)>,
    pub memory: SnapshotMemory,
    pub slots: Slots,
    /// Bytes copied on their device at the call
    /// ([`copy_on_devices`](super::device_copy::copy_on_devices)).
    pub device_copied: usize,
    /// The tensors the device copies replaced, dropped with the job on the snapshot's thread:
    /// the last drop of another runtime's buffer waits for its stream's work (the copies), which
    /// the call must not.
    pub retired: Vec<Tensor>,
}

/// What a snapshot did, and where its thread's time went.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Done {
    pub device_bytes: usize,
    /// Waiting for DMAs to land.
    pub dma_wait: Duration,
    /// Copying landed bytes into the save's own memory (device pieces' drains, host tensors).
    pub copy: Duration,
    /// Bytes copied on their device first.
    pub device_copied: usize,
}

/// Runs `job`, sending each piece to `tx` in file order; returns what it did. Holds are
/// released as tensors are copied, and all of them on any error.
pub(super) fn run(mut job: Job, shared: &Shared, tx: Sender<Chunk>) -> Result<Done, Stop> {
    let mut snap = Snapshot {
        ring: None,
        ring_meter: Meter::default(),
        free: Vec::new(),
        flight: VecDeque::new(),
        ordered: HashSet::new(),
        done: Done {
            device_copied: job.device_copied,
            ..Done::default()
        },
    };
    let result = snap.all(&mut job, shared, &tx);
    // Whatever happened, no tensor stays held.
    job.holds.iter_mut().for_each(|h| h.hold = None);
    if let Some(ring) = snap.ring.take() {
        shared.release_pinned(ring.held());
        ring.release(&mut snap.ring_meter);
    }
    result.map(|()| snap.done)
}

struct Snapshot {
    ring: Option<Ring>,
    ring_meter: Meter,
    free: Vec<usize>,
    flight: VecDeque<Flight>,
    /// Devices whose copy stream waits for the call's events already.
    ordered: HashSet<usize>,
    done: Done,
}

impl Snapshot {
    fn all(&mut self, job: &mut Job, shared: &Shared, tx: &Sender<Chunk>) -> Result<(), Stop> {
        for e in 0..job.entries.len() {
            if job.entries[e].t.device().is_cuda() {
                let count = job.entries[e].pieces.len();
                for p in 0..count {
                    self.queue_device_piece(job, e, p, p + 1 == count, shared, tx)?;
                }
                if count == 0 {
                    release(job, e);
                }
            } else {
                // File order: the device pieces before this one are sent first.
                while !self.flight.is_empty() {
                    self.retire(job, shared, tx)?;
                }
                for p in 0..job.entries[e].pieces.len() {
                    let started = Instant::now();
                    let chunk = host_piece(&job.entries[e], p, shared)?;
                    self.done.copy += started.elapsed();
                    send(tx, chunk)?;
                }
                release(job, e);
            }
        }
        while !self.flight.is_empty() {
            self.retire(job, shared, tx)?;
        }
        Ok(())
    }

    /// Queues the DMA of piece `p` of device entry `e`, into a pinned buffer of its own
    /// ([`SnapshotMemory::Pinned`], within the pinned budget) or a ring slot.
    fn queue_device_piece(
        &mut self,
        job: &mut Job,
        e: usize,
        p: usize,
        last: bool,
        shared: &Shared,
        tx: &Sender<Chunk>,
    ) -> Result<(), Stop> {
        let entry = &job.entries[e];
        let (t, elem) = (&entry.t, entry.t.dtype().size());
        let len = entry.pieces[p].len(t.shape(), elem);
        let ferry_tensor::Device::Cuda(ordinal) = t.device() else {
            unreachable!("device entries are on a GPU")
        };
        let dev = CudaDevice::get(ordinal).map_err(TensorError::from)?;
        let stream = copy_stream(&dev)?;
        // What the piece is read from: a byte range of the held storage, or a block of it
        // (made contiguous on the device first when it is not).
        let (source, start, scratch) = match &entry.pieces[p] {
            Piece::Bytes(r) => (t.clone(), t.layout().offset() * elem + r.start, None),
            Piece::Block(ranges) => {
                let b = block_view(t, ranges)?;
                if b.is_contiguous() {
                    let start = b.layout().offset() * elem;
                    (b, start, None)
                } else {
                    let c = ferry_tensor::with_no_grad(|| b.copy())?;
                    // The copy was queued on the default stream: the DMA comes after it.
                    stream
                        .wait_event(&dev.default_stream().record().map_err(TensorError::from)?)
                        .map_err(TensorError::from)?;
                    let start = c.layout().offset() * elem;
                    (c.clone(), start, Some(c))
                }
            }
        };
        if self.ordered.insert(ordinal) {
            for (_, event) in job.after.iter().filter(|(o, _)| *o == ordinal) {
                stream.wait_event(event).map_err(TensorError::from)?;
            }
        }
        // A contiguous copy made just now waits for its own making (above) instead.
        let ready = match scratch {
            None => job.ready.iter().position(|(o, _)| *o == ordinal),
            Some(_) => None,
        };
        if matches!(job.memory, SnapshotMemory::Bounded(_))
            && let Some(at) = self.paced_room(job, len, shared, tx)?
        {
            let flight = self.flight.back_mut().expect("paced_room opened a flight");
            let Dest::Paced(block) = &mut flight.dest else {
                unreachable!("paced_room packs into a paced block")
            };
            let mut batch = block.batch(&stream).map_err(TensorError::from)?;
            let guard = source.storage().read();
            let ready = ready.map(|i| &job.ready[i].1);
            download(
                &mut batch,
                cuda_buffer(&guard, &source)?,
                start,
                at,
                len,
                ready,
                &dev,
            )?;
            batch.finish().map_err(TensorError::from)?;
            drop(guard);
            flight.used = at + len;
            flight.parts.push(Part {
                entry: e,
                last,
                at,
                len,
                _scratch: scratch,
            });
            return Ok(());
        }
        if job.memory == SnapshotMemory::Pinned {
            match PinnedPool::global()
                .map_err(TensorError::from)?
                .alloc_exact(len)
            {
                Ok(mut own) => {
                    shared.hold_pinned(own.block_size());
                    let mut batch = own.batch(&stream).map_err(TensorError::from)?;
                    let guard = source.storage().read();
                    let ready = ready.map(|i| &job.ready[i].1);
                    download(
                        &mut batch,
                        cuda_buffer(&guard, &source)?,
                        start,
                        0,
                        len,
                        ready,
                        &dev,
                    )?;
                    batch.finish().map_err(TensorError::from)?;
                    drop(guard);
                    let part = Part {
                        entry: e,
                        last,
                        at: 0,
                        len,
                        _scratch: scratch,
                    };
                    // Every piece's DMA is queued before the oldest is waited for (the
                    // pinned budget bounds them): the copy engine never waits for this thread.
                    self.flight.push_back(Flight {
                        dest: Dest::Own(own),
                        parts: vec![part],
                        used: len,
                    });
                    return Ok(());
                }
                // No room left in the pinned budget: this piece goes through the ring.
                Err(MemoryError::PinnedBudgetExceeded { .. }) => {}
                Err(other) => return Err(TensorError::from(other).into()),
            }
        }
        if self.ring.is_none() {
            let ring = Ring::new(slot_len(job), device_pieces(job), &mut self.ring_meter)?;
            shared.hold_pinned(ring.held());
            self.free = (0..ring.slots.len()).rev().collect();
            self.ring = Some(ring);
        }
        let slot_len = self.ring.as_ref().map_or(0, Ring::slot_len);
        // Into the slot filling last, after its pieces, when it has room; else a free slot.
        let packed = match self.flight.back() {
            Some(f) if matches!(f.dest, Dest::Slot(_)) => {
                let at = f.used.next_multiple_of(PACK_ALIGN);
                (at + len <= slot_len).then_some(at)
            }
            _ => None,
        };
        if packed.is_none() {
            while self.free.is_empty() {
                self.retire(job, shared, tx)?;
            }
            let slot = self.free.pop().expect("a slot is free");
            self.flight.push_back(Flight {
                dest: Dest::Slot(slot),
                parts: Vec::new(),
                used: 0,
            });
        }
        let at = packed.unwrap_or(0);
        let flight = self.flight.back_mut().expect("a flight was opened");
        let Dest::Slot(slot) = flight.dest else {
            unreachable!("pieces are packed into slots only")
        };
        let ring = self.ring.as_mut().expect("the ring was made");
        let guard = source.storage().read();
        let from = cuda_buffer(&guard, &source)?;
        match &mut ring.slots[slot] {
            Slot::Pinned(staging) => {
                let mut batch = staging.batch(&stream).map_err(TensorError::from)?;
                let ready = ready.map(|i| &job.ready[i].1);
                download(&mut batch, from, start, at, len, ready, &dev)?;
                batch.finish().map_err(TensorError::from)?;
            }
            Slot::Pageable(bytes) => {
                // The driver's synchronous path: the bytes are there when this returns.
                from.copy_to_host_at(start, &mut bytes[at..at + len], &stream)
                    .map_err(TensorError::from)?;
            }
        }
        drop(guard);
        flight.used = at + len;
        flight.parts.push(Part {
            entry: e,
            last,
            at,
            len,
            _scratch: scratch,
        });
        Ok(())
    }

    /// Where a device piece of `len` bytes lands in the bounded mode: packed after the pieces of
    /// the last pinned block when it has room, else at the start of a new one the size of a
    /// ring slot (so the pinned pool serves every save from the same few blocks), taken once it
    /// fits the bound: the DMAs queued so far go to the writer until it does. `None` where the
    /// pinned budget has no room for a block (the piece then goes through the ring).
    fn paced_room(
        &mut self,
        job: &mut Job,
        len: usize,
        shared: &Shared,
        tx: &Sender<Chunk>,
    ) -> Result<Option<usize>, Stop> {
        let block_len = slot_len(job);
        if let Some(Flight {
            dest: Dest::Paced(_),
            used,
            ..
        }) = self.flight.back()
        {
            let at = used.next_multiple_of(PACK_ALIGN);
            if at + len <= block_len {
                return Ok(Some(at));
            }
        }
        let needs = PinnedPool::block_size(block_len);
        while !shared.fits(needs) && !self.flight.is_empty() {
            self.retire(job, shared, tx)?;
        }
        match PinnedPool::global()
            .map_err(TensorError::from)?
            .alloc_exact(block_len)
        {
            Ok(block) => {
                // Waits until the writer has made room, where the flights were all retired.
                shared.hold_paced(block.block_size());
                self.flight.push_back(Flight {
                    dest: Dest::Paced(block),
                    parts: Vec::new(),
                    used: 0,
                });
                Ok(Some(0))
            }
            Err(MemoryError::PinnedBudgetExceeded { .. }) => Ok(None),
            Err(other) => Err(TensorError::from(other).into()),
        }
    }

    /// Waits for the oldest flight's DMAs, releases each tensor whose last piece it carried,
    /// and sends its pieces on (drained into pageable memory when they sit in a ring slot).
    fn retire(&mut self, job: &mut Job, shared: &Shared, tx: &Sender<Chunk>) -> Result<(), Stop> {
        let flight = self.flight.pop_front().expect("a DMA is in flight");
        self.done.device_bytes += flight.parts.iter().map(|p| p.len).sum::<usize>();
        match flight.dest {
            Dest::Paced(block) => {
                let started = Instant::now();
                block.wait().map_err(TensorError::from)?;
                self.done.dma_wait += started.elapsed();
                let held = block.block_size();
                let block = Arc::new(block);
                let count = flight.parts.len();
                for (k, part) in flight.parts.iter().enumerate() {
                    if part.last {
                        release(job, part.entry);
                    }
                    // The writer writes from the block itself; its memory counts against the
                    // bound until its last piece (written after the others) is written.
                    let range = part.at..part.at + part.len;
                    let chunk = Chunk {
                        bytes: Bytes::Shared(Arc::clone(&block), range),
                        held: if k + 1 == count { held } else { 0 },
                    };
                    send(tx, chunk)?;
                }
                Ok(())
            }
            Dest::Own(own) => {
                let started = Instant::now();
                own.wait().map_err(TensorError::from)?;
                self.done.dma_wait += started.elapsed();
                for part in &flight.parts {
                    if part.last {
                        release(job, part.entry);
                    }
                }
                let held = own.block_size();
                send(
                    tx,
                    Chunk {
                        bytes: Bytes::Pinned(own),
                        held,
                    },
                )
            }
            Dest::Slot(slot) => {
                let ring = self.ring.as_ref().expect("a slot's ring exists");
                let started = Instant::now();
                let staged = match &ring.slots[slot] {
                    Slot::Pinned(b) => b.as_bytes().map_err(TensorError::from)?,
                    Slot::Pageable(v) => v.as_slice(),
                };
                self.done.dma_wait += started.elapsed();
                for part in &flight.parts {
                    // The bytes are in the save's own memory: the tensor may be written now.
                    if part.last {
                        release(job, part.entry);
                    }
                    let started = Instant::now();
                    let chunk = drained(&staged[part.at..part.at + part.len], shared)?;
                    self.done.copy += started.elapsed();
                    send(tx, chunk)?;
                }
                self.free.push(slot);
                Ok(())
            }
        }
    }
}

/// Queues `len` bytes of `from` from `start` into the batch's pinned buffer from `at`: after
/// `ready` alone when the buffer lives on the device's default stream, where `ready` was
/// recorded (training's later work there only reads it); else after everything queued on its
/// own stream so far.
fn download(
    batch: &mut PinnedBatch<'_>,
    from: &DeviceBuffer,
    start: usize,
    at: usize,
    len: usize,
    ready: Option<&Event>,
    dev: &CudaDevice,
) -> Result<(), Stop> {
    let queued = match ready {
        Some(ready) if from.stream() == dev.default_stream() => {
            batch.download_after(from, start, at, len, ready)
        }
        _ => batch.download(from, start, at, len),
    };
    queued.map_err(|e| TensorError::from(e).into())
}

/// Device pieces of the whole snapshot.
fn device_pieces(job: &Job) -> usize {
    job.entries
        .iter()
        .filter(|e| e.t.device().is_cuda())
        .map(|e| e.pieces.len())
        .sum()
}

/// The ring's slots: no larger than a quarter of what crosses (a small state takes little
/// pinned memory), but holding the longest piece.
fn slot_len(job: &Job) -> usize {
    let lens = job
        .entries
        .iter()
        .filter(|e| e.t.device().is_cuda())
        .flat_map(|e| {
            let elem = e.t.dtype().size();
            e.pieces.iter().map(move |p| p.len(e.t.shape(), elem))
        });
    let (longest, total) = lens.fold((0, 0), |(m, s), l| (m.max(l), s + l));
    longest.max(total.div_ceil(SLOTS)).min(job.slots.slot)
}

/// Drops entry `e`'s share of its hold (once); the last tensor over a storage releases it.
pub(super) fn release(job: &mut Job, e: usize) {
    if std::mem::replace(&mut job.entries[e].released, true) {
        return;
    }
    let held = &mut job.holds[job.entries[e].hold];
    held.tensors_left -= 1;
    if held.tensors_left == 0 {
        held.hold = None;
    }
}

fn send(tx: &Sender<Chunk>, chunk: Chunk) -> Result<(), Stop> {
    // The writer stopped (its error is the save's): nothing more to copy.
    tx.send(chunk).map_err(|_| Stop::WriterGone)
}

/// Cores the drain leaves to the training beside the save: the thread that queues its GPU work
/// (a Python loop's, or ferry's) and one more (torch's autograd thread, the save's writer).
const CORES_LEFT_TO_TRAINING: usize = 2;

/// The threads that drain the snapshot: all cores but [`CORES_LEFT_TO_TRAINING`], apart from
/// the global pool, so a drain at memory speed leaves the training thread the cores it launches
/// its kernels from, and does not queue behind CPU work of the training's own in that pool.
/// `None` where the threads could not be made: the drain then uses the global pool.
fn drain_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        rayon::ThreadPoolBuilder::new()
            .num_threads(cores.saturating_sub(CORES_LEFT_TO_TRAINING).max(1))
            .thread_name(|i| format!("ferry-drain-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// `bytes` copied by all cores but two into a new pageable buffer, counted against the save's
/// host memory (waiting for room in the bounded mode).
fn drained(bytes: &[u8], shared: &Shared) -> Result<Chunk, CheckpointError> {
    let held = bytes.len();
    shared.hold_host(held);
    // From the host pool: a save after the first finds the last one's pages faulted in, so
    // the drain runs at memory speed rather than at the rate pages can be faulted.
    let mut buffer = match HostPool::global().alloc(bytes.len()) {
        Ok(b) => b,
        Err(e) => {
            shared.release_host(held);
            return Err(TensorError::from(e).into());
        }
    };
    // Around the cache: the writer thread reads these bytes next, long after they would have
    // left it, and a cached store reads each line before writing it. With the DMA writing the
    // ring, the drain reading it and writing here, host memory carries the snapshot three
    // times this way rather than four.
    let mut copy = || simd::copy_around_cache_parallel(buffer.as_bytes_mut(), bytes, COPY_CHUNK);
    match drain_pool() {
        Some(pool) => pool.install(copy),
        None => copy(),
    }
    Ok(Chunk {
        bytes: Bytes::Host(buffer),
        held,
    })
}

/// Piece `p` of a host entry, copied by all cores but two.
fn host_piece(entry: &Entry, p: usize, shared: &Shared) -> Result<Chunk, CheckpointError> {
    let (source, range) = host_source(&entry.t, &entry.pieces[p])?;
    with_host_bytes("checkpoint::save_async", &source, range, |bytes| {
        drained(bytes, shared)
    })
}
