//! Prefetching to a GPU: a [`DeviceLoader`] over any iterator of host batches keeps `k` of them
//! in flight (pinned staging, copy streams) and hands each out ordered with the default stream.
//!
//! The ordering, on the device and never by a host synchronization:
//!
//! - A batch's device buffers are allocated on the default stream (their home), like any tensor
//!   ferry's ops make, and the copy into them is queued on a copy stream. Queuing the copy makes
//!   the copy stream wait for the work already on the default stream (the block may have been
//!   freed by a kernel still queued there), and the buffer records the copy's event.
//! - When [`Iterator::next`] hands a batch out, the default stream waits for that batch's copy
//!   event; the buffers' own bookkeeping also makes every kernel ferry launches on them wait for
//!   it. So a kernel the consumer queues right after `next()` reads the copied bytes.
//! - A buffer dropped while its copy may run (a batch dropped unread, the loader dropped early)
//!   returns to the allocator only after its copy stream's work: the buffer joins the streams
//!   that used it into its home stream before the block is freed. Pinned staging goes back to
//!   the pool, which does not reuse a block before the copy that read it has completed.
//!
//! The loader keeps the staging of handed-out batches until their copies have finished, and
//! waits for the oldest once more than `k` are outstanding, so a consumer that never
//! synchronizes cannot make it pin a block per batch: it holds about `2k + 1` batches of pinned
//! staging at most. The source and the host copy into staging run on the caller's thread,
//! inside `next()`; what overlaps is the DMA with the GPU's work, and the host's work with the
//! GPU work already queued.
//!
//! Batches rotate over a ring of `k + 1` copy streams, so dropping batch `i` (which joins its
//! copy stream into the default stream) does not also wait for the copies of later batches.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use ferry_memory::cuda::{CudaDevice, Event, PinnedBuffer, PinnedPool, Stream};
use ferry_memory::{Device, MemoryError};
use ferry_tensor::{Buffer, Result, Tensor, TensorError};
use parking_lot::Mutex;

use crate::copy::move_bytes;
use crate::staging::{StagingMeter, copy_bytes, cuda, dense, within_budget, wrap};

/// Batches kept in flight unless [`DeviceLoader::in_flight`] says otherwise.
pub const DEFAULT_IN_FLIGHT: usize = 2;

/// Copy streams a device shares among its loaders; a loader uses `min(k + 1, this)` of them.
const MAX_COPY_STREAMS: usize = 8;

/// What a [`DeviceLoader`] can move: one tensor or a fixed group of them. Each tensor is moved
/// on its own, and the batch is rebuilt with the moved tensors in the same places.
pub trait Batch: Sized {
    /// Rebuilds the batch with `f` applied to each tensor, in order; the first error stops it.
    fn try_map_tensors(self, f: &mut dyn FnMut(Tensor) -> Result<Tensor>) -> Result<Self>;
}

impl Batch for Tensor {
    fn try_map_tensors(self, f: &mut dyn FnMut(Tensor) -> Result<Tensor>) -> Result<Self> {
        f(self)
    }
}

impl Batch for (Tensor, Tensor) {
    fn try_map_tensors(self, f: &mut dyn FnMut(Tensor) -> Result<Tensor>) -> Result<Self> {
        Ok((f(self.0)?, f(self.1)?))
    }
}

impl Batch for (Tensor, Tensor, Tensor) {
    fn try_map_tensors(self, f: &mut dyn FnMut(Tensor) -> Result<Tensor>) -> Result<Self> {
        Ok((f(self.0)?, f(self.1)?, f(self.2)?))
    }
}

impl<const N: usize> Batch for [Tensor; N] {
    fn try_map_tensors(self, f: &mut dyn FnMut(Tensor) -> Result<Tensor>) -> Result<Self> {
        let moved: Vec<Tensor> = self.into_iter().map(f).collect::<Result<_>>()?;
        Ok(moved
            .try_into()
            .unwrap_or_else(|_: Vec<Tensor>| unreachable!("N tensors in, N out")))
    }
}

impl Batch for Vec<Tensor> {
    fn try_map_tensors(self, f: &mut dyn FnMut(Tensor) -> Result<Tensor>) -> Result<Self> {
        self.into_iter().map(f).collect()
    }
}

/// What a [`DeviceLoader`] did so far. `waited` against `elapsed` tells whether a training loop
/// is input-bound: the consumer spends `waited` inside `next()`, the rest of `elapsed` on its
/// own work.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LoaderStats {
    /// Batches handed out (errors not counted).
    pub batches: usize,
    /// Bytes copied to the device (tensors already there, and CPU targets, count nothing).
    pub bytes_moved: usize,
    /// Time the consumer spent inside `next()`, waiting for data.
    pub waited: Duration,
    /// Of `waited`, the time spent inside the source iterator producing host batches.
    pub source_time: Duration,
    /// From the start of the first `next()` to the end of the latest one.
    pub elapsed: Duration,
    /// Batches whose copy had not finished when they were handed out: the default stream waits
    /// for those on the device (a sign that the link, not the source, is the bottleneck).
    pub not_ready_at_handout: usize,
    /// Tensors moved blocking through the ordinary move (`.to(device)`) because their pinned
    /// staging did not fit the pinned budget or the loader's own bound, or because the loader
    /// keeps nothing in flight.
    pub moved_blocking: usize,
    /// The most pinned staging the loader held at once (block sizes, as the pool counts them).
    pub staging_peak_bytes: usize,
}

impl LoaderStats {
    /// `waited / elapsed`, between 0 and 1: near 1 the loop is input-bound (the consumer mostly
    /// waits for data), near 0 it is bound by its own work. 0 before the first batch.
    pub fn waited_fraction(&self) -> f64 {
        let elapsed = self.elapsed.as_secs_f64();
        if elapsed > 0.0 {
            (self.waited.as_secs_f64() / elapsed).min(1.0)
        } else {
            0.0
        }
    }
}

/// A batch whose copies are queued: its tensors exist on the device, but it is handed out only
/// by `next()`, after the default stream was made to wait for `done`.
struct InFlight<B> {
    batch: B,
    /// Recorded on the copy stream after the batch's last copy; `None` when nothing was queued.
    done: Option<Event>,
    /// Kept until hand-out; the pool orders the blocks' reuse after the copies anyway.
    staging: Vec<PinnedBuffer>,
    staging_bytes: usize,
}

/// The staging of a batch handed out whose copies may still run: kept (and counted) until they
/// have, so a consumer that never synchronizes cannot make the loader pin a block per batch.
struct Retiring {
    done: Event,
    staging: Vec<PinnedBuffer>,
    staging_bytes: usize,
}

/// Moves the batches of a host iterator to a device, keeping `k` of them in flight (default
/// [`DEFAULT_IN_FLIGHT`]) while the consumer works on the current one.
///
/// Each host tensor is copied into a pinned staging block from the pinned pool (within its
/// budget) and uploaded from there on a copy stream; the batch is handed out ordered with the
/// default stream by an event wait on the device, so `next()` does not wait for that copy on
/// the host (it may wait for the copy of a batch handed out `k` batches earlier, which bounds
/// the pinned memory a consumer that never synchronizes makes it hold). A tensor whose staging does not fit the pinned budget (or the bound set with
/// [`DeviceLoader::max_staging_bytes`]) moves blocking through the ordinary move instead: the
/// loader never fails for lack of pinned memory. See the module docs for the ordering.
///
/// Batches are data: the moved tensors are detached and nothing is recorded in the graph.
/// Tensors already on the target device pass through as they are, so on a CPU target the
/// loader hands out the source's batches unchanged (in the same order, with the same look-ahead).
///
/// Errors from the source iterator or from a copy come out of `next()` in the batch's place;
/// the batches after it still come. Dropping the loader early is safe at any point.
///
/// ```
/// use ferry_tensor::{Device, Tensor};
/// use ferry_transfer::DeviceLoader;
///
/// let batches = (0..4).map(|i| Tensor::full(&[2, 3], i as f64, ferry_tensor::DType::F32, Device::Cpu));
/// let mut seen = Vec::new();
/// for batch in DeviceLoader::from_results(batches, Device::Cpu).in_flight(2) {
///     seen.push(batch?.to_vec::<f32>()?[0]);
/// }
/// assert_eq!(seen, [0.0, 1.0, 2.0, 3.0]);
/// # Ok::<(), ferry_tensor::TensorError>(())
/// ```
pub struct DeviceLoader<'a, B, E = TensorError> {
    source: Box<dyn Iterator<Item = std::result::Result<B, E>> + 'a>,
    exhausted: bool,
    device: Device,
    in_flight: usize,
    max_staging: Option<usize>,
    /// Set with [`DeviceLoader::with_stream`]: every copy goes there.
    stream: Option<Stream>,
    /// The target GPU and its copy streams, resolved at the first copy.
    gpu: Option<(CudaDevice, Vec<Stream>)>,
    issued: usize,
    queue: VecDeque<std::result::Result<InFlight<B>, E>>,
    retiring: VecDeque<Retiring>,
    meter: StagingMeter,
    held: usize,
    stats: LoaderStats,
    started: Option<Instant>,
}

impl<'a, B: Batch + 'a> DeviceLoader<'a, B, TensorError> {
    /// A loader over `batches` (host batches, or results of them) that moves each to `device`.
    /// Prefetching starts at the first `next()`.
    pub fn new(batches: impl IntoIterator<Item = B> + 'a, device: Device) -> Self {
        Self::from_results(batches.into_iter().map(Ok), device)
    }
}

impl<'a, B: Batch, E: From<TensorError>> DeviceLoader<'a, B, E> {
    /// A loader over a fallible source: an `Err` from it comes out of `next()` in its place.
    /// Copy errors come out as `E::from(TensorError)`.
    pub fn from_results(
        batches: impl IntoIterator<Item = std::result::Result<B, E>> + 'a,
        device: Device,
    ) -> Self {
        Self {
            source: Box::new(batches.into_iter()),
            exhausted: false,
            device,
            in_flight: DEFAULT_IN_FLIGHT,
            max_staging: None,
            stream: None,
            gpu: None,
            issued: 0,
            queue: VecDeque::new(),
            retiring: VecDeque::new(),
            meter: StagingMeter::default(),
            held: 0,
            stats: LoaderStats::default(),
            started: None,
        }
    }

    /// Keeps `k` batches in flight beyond the one handed out. `0` turns prefetching off: each
    /// batch is read from the source and moved blocking (`.to(device)`) when asked for, which is
    /// the baseline to compare against.
    pub fn in_flight(mut self, k: usize) -> Self {
        self.in_flight = k;
        self
    }

    /// Bounds the pinned staging the loader holds at once to `bytes` (on top of the pinned
    /// pool's own budget); a tensor whose staging would go beyond it moves blocking instead.
    pub fn max_staging_bytes(mut self, bytes: usize) -> Self {
        self.max_staging = Some(bytes);
        self
    }

    /// Queues every copy on `stream` instead of the loader's ring of copy streams. The stream
    /// must belong to the target device; anything else is an error naming both devices.
    pub fn with_stream(mut self, stream: Stream) -> std::result::Result<Self, E> {
        if stream.device() != self.device {
            return Err(TensorError::from(MemoryError::DeviceMismatch {
                op: "DeviceLoader::with_stream",
                expected: self.device,
                actual: stream.device(),
            })
            .into());
        }
        self.stream = Some(stream);
        Ok(self)
    }

    /// Where the batches go.
    pub fn device(&self) -> Device {
        self.device
    }

    /// What the loader did so far.
    pub fn stats(&self) -> LoaderStats {
        let mut stats = self.stats;
        stats.staging_peak_bytes = self.meter.peak();
        stats
    }

    /// The next batch from the source, with its copies queued; `None` once the source is done.
    fn pull(&mut self) -> Option<std::result::Result<InFlight<B>, E>> {
        if self.exhausted {
            return None;
        }
        let asked = Instant::now();
        let item = self.source.next();
        self.stats.source_time += asked.elapsed();
        let Some(item) = item else {
            self.exhausted = true;
            return None;
        };
        Some(item.and_then(|batch| self.start(batch).map_err(E::from)))
    }

    /// Gives back the staging of handed-out batches whose copies finished; beyond `k` such
    /// batches, waits for the oldest (its copy was queued `k` batches ago, so it is usually
    /// done): what the loader pins stays within about `2k + 1` batches.
    fn retire(&mut self) -> Result<()> {
        while let Some(oldest) = self.retiring.front() {
            if !oldest.done.is_complete() {
                if self.retiring.len() <= self.in_flight {
                    break;
                }
                oldest.done.synchronize()?;
            }
            let Retiring {
                staging,
                staging_bytes,
                ..
            } = self.retiring.pop_front().expect("looked at above");
            drop(staging);
            self.held -= staging_bytes;
            self.meter.release(staging_bytes);
        }
        Ok(())
    }

    /// Queues the copies of `batch`'s tensors (or moves them blocking, see the type's docs).
    fn start(&mut self, batch: B) -> Result<InFlight<B>> {
        self.retire()?;
        let device = self.device;
        let in_flight = self.in_flight;
        let prefetch = in_flight > 0;
        let mut staging = Vec::new();
        let mut queued_on: Option<Stream> = None;
        let (mut moved, mut blocking) = (0, 0);
        let mut held = self.held;
        let max_staging = self.max_staging;
        let slot = self.issued;
        self.issued += 1;
        let gpu = &mut self.gpu;
        let user_stream = &self.stream;
        let meter = &mut self.meter;
        let batch = batch.try_map_tensors(&mut |t: Tensor| {
            if t.device() == device {
                return Ok(t);
            }
            let Device::Cuda(ordinal) = device else {
                // To the host: the ordinary move.
                blocking += 1;
                moved += t.nbytes();
                return Ok(move_bytes(&t.detach(), device, false)?.0);
            };
            if t.device() != Device::Cpu || !prefetch || t.nbytes() == 0 {
                blocking += usize::from(t.nbytes() > 0);
                moved += t.nbytes();
                return Ok(move_bytes(&t.detach(), device, false)?.0);
            }
            let src = dense(&t)?;
            let bytes = src.nbytes();
            let room = max_staging.map(|max| max.saturating_sub(held));
            let Some(pinned) = take_staging(bytes, room)? else {
                blocking += 1;
                moved += bytes;
                return Ok(move_bytes(&src, device, false)?.0);
            };
            if gpu.is_none() {
                let dev = cuda(ordinal)?;
                let streams = match user_stream {
                    Some(stream) => vec![stream.clone()],
                    None => copy_streams(&dev, (in_flight + 1).min(MAX_COPY_STREAMS))?,
                };
                *gpu = Some((dev, streams));
            }
            let (dev, streams) = gpu.as_ref().expect("resolved above");
            let stream = &streams[slot % streams.len()];
            let (out, pinned) = upload(&src, dev, stream, pinned)?;
            held += pinned.block_size();
            meter.hold(pinned.block_size());
            staging.push(pinned);
            queued_on = Some(stream.clone());
            moved += bytes;
            Ok(out)
        });
        let staging_bytes: usize = staging.iter().map(PinnedBuffer::block_size).sum();
        let done = match (&batch, &queued_on) {
            (Ok(_), Some(stream)) => stream.record().map(Some).map_err(TensorError::from),
            _ => Ok(None),
        };
        let (batch, done) = match (batch, done) {
            (Ok(batch), Ok(done)) => (batch, done),
            (Err(e), _) | (Ok(_), Err(e)) => {
                // The staging goes back to the pool as it drops, its reuse ordered after the
                // copies already queued.
                self.meter.release(staging_bytes);
                return Err(e);
            }
        };
        self.held += staging_bytes;
        self.stats.bytes_moved += moved;
        self.stats.moved_blocking += blocking;
        Ok(InFlight {
            batch,
            done,
            staging,
            staging_bytes,
        })
    }

    /// Hands out a batch whose copies were queued: orders the default stream after them.
    fn hand_out(&mut self, flight: InFlight<B>) -> Result<B> {
        let InFlight {
            batch,
            done,
            staging,
            staging_bytes,
        } = flight;
        match (done, &self.gpu) {
            (Some(done), Some((dev, _))) => {
                if !done.is_complete() {
                    self.stats.not_ready_at_handout += 1;
                }
                let ordered = dev.default_stream().wait_event(&done);
                self.retiring.push_back(Retiring {
                    done,
                    staging,
                    staging_bytes,
                });
                ordered?;
            }
            _ => {
                drop(staging);
                self.held -= staging_bytes;
                self.meter.release(staging_bytes);
            }
        }
        Ok(batch)
    }
}

impl<B: Batch, E: From<TensorError>> Iterator for DeviceLoader<'_, B, E> {
    type Item = std::result::Result<B, E>;

    fn next(&mut self) -> Option<Self::Item> {
        let entered = Instant::now();
        let started = *self.started.get_or_insert(entered);
        // The batch to hand out, then `k` more queued behind it. Reading the source here, before
        // handing out, overlaps it with the GPU work the consumer queued since the last call.
        while self.queue.len() <= self.in_flight {
            match self.pull() {
                Some(item) => self.queue.push_back(item),
                None => break,
            }
        }
        let item = self.queue.pop_front();
        let out = item.map(|item| {
            let batch = item.and_then(|flight| self.hand_out(flight).map_err(E::from))?;
            self.stats.batches += 1;
            Ok(batch)
        });
        let now = Instant::now();
        self.stats.waited += now - entered;
        self.stats.elapsed = now - started;
        out
    }
}

impl<B, E> fmt::Debug for DeviceLoader<'_, B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceLoader")
            .field("device", &self.device)
            .field("in_flight", &self.in_flight)
            .field("queued", &self.queue.len())
            .field("exhausted", &self.exhausted)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

/// A pinned staging block for `bytes`, or `None` when the pinned budget, or the loader's `room`
/// left under its bound, has no space for it.
fn take_staging(bytes: usize, room: Option<usize>) -> Result<Option<PinnedBuffer>> {
    if room.is_some_and(|room| PinnedPool::block_size(bytes) > room) {
        return Ok(None);
    }
    let pool = PinnedPool::global()?;
    // Under a bound, a block of its own class only: a cached block of the class above, which
    // `alloc` may hand out, would count more than the bound allowed for.
    let pinned = within_budget(match room {
        Some(_) => pool.alloc_exact(bytes),
        None => pool.alloc(bytes),
    })?;
    Ok(pinned.filter(|p| room.is_none_or(|room| p.block_size() <= room)))
}

/// Copies the dense host tensor `src` into `pinned` and queues its upload on `stream` into a
/// fresh buffer of `dev` (allocated on the default stream, so the copy first waits, on the
/// device, for the work queued there: the block may have been freed by a kernel still queued).
fn upload(
    src: &Tensor,
    dev: &CudaDevice,
    stream: &Stream,
    mut pinned: PinnedBuffer,
) -> Result<(Tensor, PinnedBuffer)> {
    {
        let guard = src.storage().read();
        let from = guard.host_slice("DeviceLoader", src.device())?;
        copy_bytes(pinned.as_bytes_mut()?, from);
    }
    let mut out = dev.alloc(src.nbytes(), dev.default_stream())?;
    out.copy_from_pinned_async(&mut pinned, stream)?;
    Ok((wrap(Buffer::Cuda(out), src, dev.device()), pinned))
}

/// `n` copy streams of `dev`, shared by its loaders: made once (outside the lock: a device's
/// first extra stream synchronizes it) and reused.
fn copy_streams(dev: &CudaDevice, n: usize) -> Result<Vec<Stream>> {
    /// Per device ordinal, the copy streams made so far.
    type Streams = Mutex<HashMap<usize, Vec<Stream>>>;
    static STREAMS: OnceLock<Streams> = OnceLock::new();
    let all = STREAMS.get_or_init(Default::default);
    loop {
        {
            let streams = all.lock();
            if let Some(have) = streams.get(&dev.ordinal())
                && have.len() >= n
            {
                return Ok(have[..n].to_vec());
            }
        }
        let stream = dev.new_stream()?;
        let mut streams = all.lock();
        let have = streams.entry(dev.ordinal()).or_default();
        if have.len() < n {
            have.push(stream);
        }
    }
}
