//! Activation offload: inside an [`offload_saved`] scope, the large activations that gradient
//! rules save move to pinned host memory as the forward records them, and come back to the GPU
//! ahead of use in backward.
//!
//! # How it works
//!
//! - **Forward.** When a rule saves a CUDA tensor whose buffer is an activation (the fresh
//!   output of an op recorded inside the scope, not a leaf, a parameter or a view of one) of at
//!   least [`OffloadOptions::min_bytes`], a pinned block is taken for it and an event marks the
//!   end of its producer on the compute stream. The copy into the block is queued on a copy
//!   stream when the second op after the save is recorded (`offload/schedule.rs` says why), and
//!   it waits on the device for that event alone: it starts when the producer ends, alongside
//!   the op that reads the activation next, which was queued before the copy and so does not
//!   wait for it. The node then holds only the pinned block, so once the caller's own handles
//!   are gone the device memory returns to the allocator, which reuses it only after the copy's
//!   event completes. The host never waits. One buffer saved by several rules (`tanh`'s output,
//!   read again by the `matmul` after it) is copied once.
//! - **Backward.** While saved buffers are off the device, the engine asks each rule, two nodes
//!   ahead of its turn, to bring them back ([`ferry_graph::Backward::prefetch`]): a copy into a
//!   fresh device buffer is queued on a copy stream, and the kernels that read it wait for that
//!   copy on the device. A rule that was not prefetched fetches when it runs, the same way. A
//!   buffer whose copy out was not queued yet (the last op's saves, when backward follows the
//!   forward) is read on the device, where it is, and never moves
//!   ([`OffloadStats::read_in_place`]). Rules that share a buffer read one device copy, dropped
//!   after the last of them has read it, so it does not outlive their turns (even with
//!   `retain_graph`).
//! - **Limits.** Pinned blocks come from the pinned pool, within its budget; a buffer the budget
//!   has no room for stays on the device and is counted ([`OffloadStats::kept_over_budget`]).
//!   Nothing in the scope fails because of the offload.
//!
//! Copy streams are taken round robin from a small set per device, so that copies out and
//! copies back of different buffers do not queue behind one another.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use ferry_graph::OffloadedSave;
use ferry_memory::cuda::{CudaDevice, Event, PinnedBuffer, PinnedPool, Stream};
use ferry_memory::{DType, Device, MemoryError};
use parking_lot::Mutex;

use crate::storage::{Buffer, Storage};
use crate::{Result, Tensor, TensorError};

use schedule::Waiting;

mod schedule;

/// What [`offload_saved`] moves off the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffloadOptions {
    /// Saved buffers smaller than this stay on the GPU: their copies would cost more in
    /// launches than they free. Default 1 MiB.
    pub min_bytes: usize,
}

impl Default for OffloadOptions {
    fn default() -> Self {
        Self { min_bytes: 1 << 20 }
    }
}

/// What one [`offload_saved`] scope did so far, as [`OffloadGuard::stats`] returns it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OffloadStats {
    /// Saved buffers whose copy to pinned host memory was queued.
    pub offloaded: u64,
    /// Their bytes (each buffer once): what crosses the link each way.
    pub offloaded_bytes: u64,
    /// Saves that found their buffer already offloaded by another rule of the scope.
    pub shared: u64,
    /// Saved tensors left on the GPU for being below [`OffloadOptions::min_bytes`].
    pub kept_small: u64,
    /// Saved tensors left in place for not being an activation of the scope: leaves,
    /// parameters and views of them, tensors from before the scope. Copying them would free
    /// nothing, since their owner keeps them alive.
    pub kept_not_activation: u64,
    /// Saved tensors already in host memory (on a CPU the scope moves nothing).
    pub kept_on_host: u64,
    /// Saved buffers left on the GPU because the pinned budget had no room for them.
    pub kept_over_budget: u64,
    /// Their bytes.
    pub kept_over_budget_bytes: u64,
    /// Saved buffers left on the GPU because queuing the copy failed (a driver error).
    pub kept_on_error: u64,
    /// Buffers brought back ahead of their rule's turn in backward.
    pub prefetched: u64,
    /// Buffers brought back when their rule ran, without a prefetch.
    pub fetched_on_demand: u64,
    /// Buffers backward read on the device before their copy was queued (the last op's saves,
    /// when backward follows the forward): they never moved, and are not in `offloaded`.
    pub read_in_place: u64,
    /// Their bytes.
    pub read_in_place_bytes: u64,
}

#[derive(Default)]
struct Counters {
    offloaded: AtomicU64,
    offloaded_bytes: AtomicU64,
    shared: AtomicU64,
    kept_small: AtomicU64,
    kept_not_activation: AtomicU64,
    kept_on_host: AtomicU64,
    kept_over_budget: AtomicU64,
    kept_over_budget_bytes: AtomicU64,
    kept_on_error: AtomicU64,
    prefetched: AtomicU64,
    fetched_on_demand: AtomicU64,
    read_in_place: AtomicU64,
    read_in_place_bytes: AtomicU64,
}

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

impl Counters {
    fn snapshot(&self) -> OffloadStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        OffloadStats {
            offloaded: get(&self.offloaded),
            offloaded_bytes: get(&self.offloaded_bytes),
            shared: get(&self.shared),
            kept_small: get(&self.kept_small),
            kept_not_activation: get(&self.kept_not_activation),
            kept_on_host: get(&self.kept_on_host),
            kept_over_budget: get(&self.kept_over_budget),
            kept_over_budget_bytes: get(&self.kept_over_budget_bytes),
            kept_on_error: get(&self.kept_on_error),
            prefetched: get(&self.prefetched),
            fetched_on_demand: get(&self.fetched_on_demand),
            read_in_place: get(&self.read_in_place),
            read_in_place_bytes: get(&self.read_in_place_bytes),
        }
    }
}

/// A buffer the scope has seen produced, and its offloaded copy once it has one.
struct Produced {
    storage: Weak<Storage>,
    offloaded: Weak<Offloaded>,
}

/// One active scope: its options, counters and the activations it has seen.
pub(crate) struct Scope {
    options: OffloadOptions,
    counters: Arc<Counters>,
    /// By storage address: buffers produced by ops recorded in the scope.
    produced: Mutex<HashMap<usize, Produced>>,
    /// Size of `produced` after its last sweep of dead entries.
    swept_at: AtomicUsize,
    /// Offloaded buffers whose copy to the host is not queued yet (see `schedule`).
    pending: Mutex<Waiting<Arc<Offloaded>>>,
    /// Offloaded buffers whose copy to the host is in flight, device buffer still held.
    copying: Mutex<Vec<Weak<Offloaded>>>,
}

thread_local! {
    static SCOPE: RefCell<Option<Arc<Scope>>> = const { RefCell::new(None) };
}

/// The calling thread's offload scope, if one is active (one thread-local read).
pub(crate) fn current() -> Option<Arc<Scope>> {
    SCOPE.with(|s| s.borrow().clone())
}

/// Moves the large activations that gradient rules save to pinned host memory while the guard
/// lives, on this thread, and brings them back ahead of use in backward (see the module docs).
/// Gradients are bitwise the same as without the scope; peak device memory in the forward drops
/// by the offloaded bytes, less the two nodes' worth backward brings back ahead of time.
///
/// Like [`ferry_graph::no_grad`] it covers the calling thread only. Scopes nest: the innermost
/// one's options apply. Backward may run inside or outside the scope. On the CPU it moves
/// nothing (host tensors are already in host memory) and counts them as
/// [`OffloadStats::kept_on_host`].
///
/// ```
/// use ferry_tensor::Tensor;
/// use ferry_tensor::autograd::{OffloadOptions, offload_saved};
///
/// let w = Tensor::from_slice(&[0.5f32, -1.0, 2.0], &[3])?.with_grad()?;
/// let guard = offload_saved(OffloadOptions { min_bytes: 0 });
/// let loss = w.tanh()?.mul(&w)?.sum()?;
/// loss.backward()?;
/// assert_eq!(guard.stats().offloaded, 0); // host tensors stay where they are
/// assert!(w.grad().is_some());
/// # Ok::<(), ferry_tensor::TensorError>(())
/// ```
pub fn offload_saved(options: OffloadOptions) -> OffloadGuard {
    let scope = Arc::new(Scope {
        options,
        counters: Arc::new(Counters::default()),
        produced: Mutex::new(HashMap::new()),
        swept_at: AtomicUsize::new(0),
        pending: Mutex::new(Waiting::new()),
        copying: Mutex::new(Vec::new()),
    });
    let previous = SCOPE.with(|s| s.borrow_mut().replace(Arc::clone(&scope)));
    OffloadGuard {
        scope,
        previous,
        _not_send: std::marker::PhantomData,
    }
}

/// Ends an [`offload_saved`] scope when dropped (restoring the scope around it, if any). What
/// was offloaded stays in host memory until backward or the graph's end frees it.
#[must_use = "the scope ends as soon as the guard is dropped"]
pub struct OffloadGuard {
    scope: Arc<Scope>,
    previous: Option<Arc<Scope>>,
    // The scope is thread-local, so the guard must stay on its thread.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl OffloadGuard {
    /// What this scope did so far; backward's prefetches and fetches of what it offloaded
    /// count here even after the guard has dropped (read them before).
    pub fn stats(&self) -> OffloadStats {
        self.scope.counters.snapshot()
    }

    /// Queues the copies to the host not queued yet (those of the last two ops recorded) and
    /// lets go of the device buffers whose copies have completed. Nothing waits: call it after
    /// a device synchronization to see every offloaded buffer off the device. Recording an op
    /// does the same for what ops two records back saved.
    pub fn settle(&self) {
        self.scope.settle();
    }

    /// The options the scope runs with.
    pub fn options(&self) -> OffloadOptions {
        self.scope.options
    }
}

impl std::fmt::Debug for OffloadGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadGuard")
            .field("options", &self.scope.options)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Drop for OffloadGuard {
    fn drop(&mut self) {
        // The last op's saves stay on the device: backward, which usually comes next, reads
        // them first, and a round trip over the link would only make it wait. (`settle` before
        // the drop sends them too.)
        let previous = self.previous.take();
        SCOPE.with(|s| *s.borrow_mut() = previous);
    }
}

/// A saved buffer moved to pinned host memory, shared by every rule that saved it.
pub(crate) struct Offloaded {
    pinned: Mutex<PinnedBuffer>,
    dtype: DType,
    ordinal: usize,
    bytes: usize,
    /// The copy stream this buffer's transfers use.
    stream: Stream,
    /// How many saves (rules, slots) share this copy.
    uses: AtomicUsize,
    /// Whether backward has read it on the device before its copy was queued (counted once).
    read_in_place: std::sync::atomic::AtomicBool,
    /// The device buffer, until its copy to the host has completed.
    source: Mutex<Source>,
    /// The copy back on the device, while backward still has uses for it.
    back: Mutex<Back>,
    counters: Arc<Counters>,
    _live: OffloadedSave,
}

/// Where the device buffer of an [`Offloaded`] one is.
enum Source {
    /// Saved, its copy to the host not queued yet (see `schedule`); `ready` marks the end of
    /// its producer on the buffer's stream, the one thing the copy will wait for.
    Pending { storage: Arc<Storage>, ready: Event },
    /// Its copy to the host is queued; kept until that copy completes or `records` more ops
    /// have been recorded, whichever comes first (see [`Scope::reap`]).
    Copying(Arc<Storage>, Event, u32),
    /// Only the host copy is left.
    Gone,
}

/// The device copy of an [`Offloaded`] buffer during backward.
#[derive(Default)]
struct Back {
    copy: Option<Arc<Storage>>,
    /// Reads of it still to come in this backward; at 0 the copy goes.
    left: usize,
}

impl Offloaded {
    /// Bytes of the buffer.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// The device buffer itself while it is still there (its copy to the host not queued or
    /// not finished): nothing to bring back then.
    fn still_on_device(&self) -> Option<Arc<Storage>> {
        match &*self.source.lock() {
            Source::Pending { storage, .. } | Source::Copying(storage, ..) => {
                Some(Arc::clone(storage))
            }
            Source::Gone => None,
        }
    }

    /// [`Offloaded::still_on_device`] for a read by a rule: a read before the copy was queued
    /// counts as [`OffloadStats::read_in_place`], once per buffer.
    fn read_on_device(&self) -> Option<Arc<Storage>> {
        let source = self.source.lock();
        match &*source {
            Source::Pending { storage, .. } => {
                if !self.read_in_place.swap(true, Ordering::Relaxed) {
                    bump(&self.counters.read_in_place, 1);
                    bump(&self.counters.read_in_place_bytes, self.bytes as u64);
                }
                Some(Arc::clone(storage))
            }
            Source::Copying(storage, ..) => Some(Arc::clone(storage)),
            Source::Gone => None,
        }
    }

    /// Queues the copy of the device buffer to the host, if not queued yet; the buffer stays
    /// until that copy completes. Errors leave it on the device (still correct, less freed).
    fn copy_out(&self) -> Result<bool> {
        let mut source = self.source.lock();
        let Source::Pending { storage, ready } = &*source else {
            return Ok(false);
        };
        let event = {
            let guard = storage.read();
            let Buffer::Cuda(buffer) = &*guard else {
                return Err(TensorError::UnsupportedDevice {
                    op: "offload_saved",
                    device: storage.device(),
                });
            };
            // Ordered on the device after its producer alone: it runs alongside the ops queued
            // since, which read it. A later in-place write waits for it.
            buffer.copy_to_pinned_async_after(&mut self.pinned.lock(), &self.stream, ready)?;
            self.stream.record()?
        };
        let storage = Arc::clone(storage);
        *source = Source::Copying(storage, event, HOLD_RECORDS);
        Ok(true)
    }

    /// One more op recorded: lets the device buffer go if its copy to the host has completed or
    /// it was held for [`HOLD_RECORDS`] records; whether it is gone.
    fn tick(&self) -> bool {
        let mut source = self.source.lock();
        match &mut *source {
            Source::Copying(_, event, records) => {
                *records = records.saturating_sub(1);
                if *records == 0 || event.is_complete() {
                    *source = Source::Gone;
                    true
                } else {
                    false
                }
            }
            Source::Gone => true,
            Source::Pending { .. } => false,
        }
    }

    /// Queues the copy back unless it is back already (errors are left to
    /// [`Offloaded::fetch`]); the bytes of device memory it took (0 when nothing was queued).
    pub(crate) fn prefetch(&self) -> usize {
        if self.still_on_device().is_some() {
            return 0;
        }
        let mut back = self.back.lock();
        if back.copy.is_none()
            && let Ok(storage) = self.copy_in()
        {
            back.copy = Some(storage);
            back.left = self.uses.load(Ordering::Relaxed);
            bump(&self.counters.prefetched, 1);
            return self.bytes;
        }
        0
    }

    /// The buffer back on its device: the copy a prefetch (or an earlier read) brought back, or
    /// one queued now. Kernels that read it wait for the copy on the device; the host does not
    /// wait. Every rule sharing the buffer reads the same copy, which goes after the last of
    /// their reads (so it does not outlive their turns, even with `retain_graph`).
    pub(crate) fn fetch(&self) -> Result<Arc<Storage>> {
        if let Some(storage) = self.read_on_device() {
            return Ok(storage);
        }
        let mut back = self.back.lock();
        let copy = match &back.copy {
            Some(copy) => Arc::clone(copy),
            None => {
                let copy = self.copy_in()?;
                bump(&self.counters.fetched_on_demand, 1);
                back.copy = Some(Arc::clone(&copy));
                back.left = self.uses.load(Ordering::Relaxed);
                copy
            }
        };
        back.left = back.left.saturating_sub(1);
        if back.left == 0 {
            back.copy = None;
        }
        Ok(copy)
    }

    fn copy_in(&self) -> Result<Arc<Storage>> {
        let dev = CudaDevice::get(self.ordinal)?;
        // Allocated on the compute stream, where the kernels that read it run: they wait for
        // the copy through the buffer's in-flight event, not for the whole copy stream.
        let mut out = dev.alloc(self.bytes, dev.default_stream())?;
        {
            let mut pinned = self.pinned.lock();
            out.copy_from_pinned_async(&mut pinned, &self.stream)?;
        }
        Ok(Arc::new(Storage::new(
            Buffer::Cuda(out),
            self.dtype,
            Device::Cuda(self.ordinal),
        )))
    }
}

/// Where one copy stream of each device is taken from, round robin.
const COPY_STREAMS: usize = 4;

/// Ops recorded after a buffer's copy to the host was queued before the node lets go of the
/// device buffer even if the copy has not completed (the host usually runs far ahead of the
/// device, so a completed copy is rarely seen during the forward). Letting go at once is safe
/// and costs the compute stream nothing: the allocator keeps a freed block whose copy is still
/// in flight out of use until the copy's event completes, without making any stream wait.
const HOLD_RECORDS: u32 = 1;

/// Each device's copy streams, made on first use.
type CopyStreams = Vec<(usize, Arc<Vec<Stream>>)>;

fn copy_stream(ordinal: usize) -> Result<Stream> {
    static STREAMS: Mutex<CopyStreams> = Mutex::new(Vec::new());
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let streams = {
        let mut all = STREAMS.lock();
        match all.iter().find(|(o, _)| *o == ordinal) {
            Some((_, s)) => Arc::clone(s),
            None => {
                let dev = CudaDevice::get(ordinal)?;
                let made = (0..COPY_STREAMS)
                    .map(|_| dev.new_stream())
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                let made = Arc::new(made);
                all.push((ordinal, Arc::clone(&made)));
                made
            }
        }
    };
    Ok(streams[NEXT.fetch_add(1, Ordering::Relaxed) % streams.len()].clone())
}

/// What the scope made of one saved tensor.
pub(crate) enum Packed {
    /// Saved as is.
    Kept,
    /// Moved off the device.
    Offloaded(Arc<Offloaded>),
}

impl Scope {
    /// Notes `output` as an activation of the scope, unless it shares an input's buffer (a
    /// view: the buffer belongs to whoever made the input).
    pub(crate) fn note_output(&self, output: &Tensor, inputs: &[&Tensor]) {
        let storage = output.storage();
        if !storage.device().is_cuda() || inputs.iter().any(|i| Arc::ptr_eq(i.storage(), storage)) {
            return;
        }
        let mut produced = self.produced.lock();
        produced.insert(
            Arc::as_ptr(storage) as usize,
            Produced {
                storage: Arc::downgrade(storage),
                offloaded: Weak::new(),
            },
        );
        // Sweep buffers gone since, once the map has doubled.
        let swept = self.swept_at.load(Ordering::Relaxed);
        if produced.len() > 2 * swept.max(64) {
            produced.retain(|_, p| p.storage.strong_count() > 0);
            self.swept_at.store(produced.len(), Ordering::Relaxed);
        }
    }

    /// Offloads `tensor`'s buffer if it is a large activation of the scope on a GPU (or finds
    /// it offloaded already); otherwise says to keep it.
    pub(crate) fn pack(&self, tensor: &Tensor) -> Packed {
        let storage = tensor.storage();
        let counters = &self.counters;
        let Device::Cuda(ordinal) = storage.device() else {
            bump(&counters.kept_on_host, 1);
            return Packed::Kept;
        };
        if storage.bytes() < self.options.min_bytes || storage.bytes() == 0 {
            bump(&counters.kept_small, 1);
            return Packed::Kept;
        }
        let key = Arc::as_ptr(storage) as usize;
        let mut produced = self.produced.lock();
        let Some(entry) = produced
            .get_mut(&key)
            .filter(|p| p.storage.strong_count() > 0)
        else {
            bump(&counters.kept_not_activation, 1);
            return Packed::Kept;
        };
        if let Some(offloaded) = entry.offloaded.upgrade() {
            bump(&counters.shared, 1);
            offloaded.uses.fetch_add(1, Ordering::Relaxed);
            return Packed::Offloaded(offloaded);
        }
        match self.offload(storage, ordinal) {
            Ok(Some(offloaded)) => {
                entry.offloaded = Arc::downgrade(&offloaded);
                Packed::Offloaded(offloaded)
            }
            Ok(None) => {
                bump(&counters.kept_over_budget, 1);
                bump(&counters.kept_over_budget_bytes, storage.bytes() as u64);
                Packed::Kept
            }
            Err(_) => {
                bump(&counters.kept_on_error, 1);
                Packed::Kept
            }
        }
    }

    /// A pinned block for `storage` and its entry, whose copy is queued when `schedule` says;
    /// `None` beyond the pinned budget.
    fn offload(&self, storage: &Arc<Storage>, ordinal: usize) -> Result<Option<Arc<Offloaded>>> {
        let bytes = storage.bytes();
        let pinned = match PinnedPool::global()?.alloc(bytes) {
            Ok(pinned) => pinned,
            Err(MemoryError::PinnedBudgetExceeded { .. }) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        // The op that made it was queued just now: this marks its end.
        let ready = match &*storage.read() {
            Buffer::Cuda(buffer) => buffer.stream().record()?,
            _ => {
                return Err(TensorError::UnsupportedDevice {
                    op: "offload_saved",
                    device: storage.device(),
                });
            }
        };
        let offloaded = Arc::new(Offloaded {
            pinned: Mutex::new(pinned),
            dtype: storage.dtype(),
            ordinal,
            bytes,
            stream: copy_stream(ordinal)?,
            uses: AtomicUsize::new(1),
            read_in_place: std::sync::atomic::AtomicBool::new(false),
            source: Mutex::new(Source::Pending {
                storage: Arc::clone(storage),
                ready,
            }),
            back: Mutex::new(Back::default()),
            counters: Arc::clone(&self.counters),
            _live: OffloadedSave::new(),
        });
        self.pending.lock().push(Arc::clone(&offloaded));
        Ok(Some(offloaded))
    }

    /// An op is being recorded: queues the copies to the host that are due (see `schedule`;
    /// the ops that read them are queued by now, so they do not wait for them), and lets go of
    /// the device buffers whose copies have completed.
    pub(crate) fn on_record(&self) {
        let due = self.pending.lock().record();
        self.queue(due);
    }

    /// Queues every copy to the host not queued yet ([`OffloadGuard::settle`]).
    fn settle(&self) {
        let all = self.pending.lock().drain();
        self.queue(all);
    }

    fn queue(&self, due: Vec<Arc<Offloaded>>) {
        if !due.is_empty() {
            let mut copying = self.copying.lock();
            for offloaded in due {
                if Arc::strong_count(&offloaded) == 1 {
                    // No rule holds it any more (backward has run, or the graph is gone):
                    // nobody will read it, so nothing goes.
                    continue;
                }
                match offloaded.copy_out() {
                    Ok(true) => {
                        bump(&self.counters.offloaded, 1);
                        bump(&self.counters.offloaded_bytes, offloaded.bytes as u64);
                        copying.push(Arc::downgrade(&offloaded));
                    }
                    Ok(false) => {}
                    // Left on the device: correct, it just frees nothing.
                    Err(_) => bump(&self.counters.kept_on_error, 1),
                }
            }
        }
        self.reap();
    }

    /// Lets go of the device buffers whose copies to the host have completed or were held for
    /// [`HOLD_RECORDS`] records (a query per copy in flight; nothing waits on the host).
    fn reap(&self) {
        let mut copying = self.copying.lock();
        if !copying.is_empty() {
            copying.retain(|w| w.upgrade().is_some_and(|o| !o.tick()));
        }
    }
}
