//! Page-locked host memory: a pool of reusable blocks for DMA, under a budget, and registration
//! of existing host buffers.
//!
//! One pool per process, not per device: page-locked memory is a host resource, a staging block
//! serves copies to and from any GPU, and one set of statistics answers "how much RAM is pinned".
//! Blocks are allocated `CU_MEMHOSTALLOC_PORTABLE` so every context treats them as pinned; that
//! flag does not make them write-combined (cudarc's `alloc_pinned` does, and CPU reads of
//! write-combined memory are very slow, so device-to-host destinations must avoid it).
//!
//! Locked memory cannot be swapped, so the pool holds at most a budget of it: by default 1/8 of
//! the machine's memory ([`PinnedPool::DEFAULT_BUDGET_DIVISOR`]), or `FERRY_PINNED_BUDGET`, or what
//! [`PinnedPool::set_budget`] says. Idle cached blocks are trimmed least recently used first to
//! make room; a request that live blocks leave no room for is refused with
//! [`MemoryError::PinnedBudgetExceeded`], and moves then land in pageable memory instead.
//!
//! Size classes: a request is rounded up to a multiple of 1/8 of its power of two (4 KiB at
//! least: 4096, 4608, 5120, .., 7680, 8192, 9216, ..; 400 MB -> 384 MiB), so rounding wastes under
//! 1/8. A cached block serves requests of its class and of the class just below (under 1/4 of
//! it unused), so sizes that vary a little still reuse blocks.
//!
//! The pool's lock guards its bookkeeping only. Making a block (faulting its pages in and
//! registering it, 10 to 300 ms for hundreds of MB) and freeing blocks (waiting for their last
//! copy, unregistering) run outside it, so cache hits never wait for them.

use std::fmt;
use std::ptr::NonNull;
use std::sync::OnceLock;

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaEvent, DriverError, result};
use parking_lot::{Condvar, Mutex};

use super::device::CudaDevice;
use super::stream::{Event, driver};
use crate::MemoryError;
use crate::cache::{BlockCache, Cached};
use crate::classes::{PINNED_MAX_REQUEST, next_pinned_class, pinned_class, too_large};
use crate::host::budget::{Admission, Reservations, budget_from_env};

mod buffer;
mod register;
#[cfg(test)]
mod tests;

pub use buffer::PinnedBuffer;
pub use register::{HostRegistration, is_page_locked};

/// Counters of the pinned pool. Bytes are block sizes (requests rounded to their class).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PinnedStats {
    /// Bytes in blocks handed out to live buffers.
    pub allocated_bytes: usize,
    /// Bytes page-locked by the pool: allocated, cached, and blocks being made. Never above
    /// `budget_bytes`, except after the budget was lowered below what live buffers hold.
    pub reserved_bytes: usize,
    /// Bytes of idle blocks kept for reuse; [`PinnedPool::empty_cache`] gives them back.
    pub cached_bytes: usize,
    /// Highest `allocated_bytes` since creation or the last `reset_peak`.
    pub peak_allocated_bytes: usize,
    /// Allocation requests served (empty buffers excluded).
    pub allocations: u64,
    /// Requests served from the cache.
    pub cache_hits: u64,
    /// Blocks made (allocated or registered with the driver).
    pub host_allocations: u64,
    /// The budget reserved bytes stay within.
    pub budget_bytes: usize,
    /// Cached blocks freed to stay within the budget, least recently used first.
    pub trimmed_blocks: u64,
    /// Requests refused because live blocks fill the budget (moves then go pageable).
    pub budget_refusals: u64,
    /// Bytes of host memory page-locked in place ([`PinnedPool::pin_in_place`]), counted in
    /// `reserved_bytes` too.
    pub registered_bytes: usize,
}

/// A page-locked block and the event of the last copy that used it.
struct HostBlock {
    ptr: NonNull<u8>,
    size: usize,
    event: Option<CudaEvent>,
    pending: bool,
    /// Events recorded, when its last buffer was dropped, on the streams that buffer was used on
    /// by others ([`PinnedBuffer::record_stream`]): the block is reused only once they complete.
    after: Vec<Event>,
    /// Large blocks are prefaulted huge-page mappings registered with the driver (this owns
    /// the mapping); small ones come from `cuMemHostAlloc` (`None`).
    mapping: Option<crate::HostBuffer>,
}

/// Blocks at least this large are mapped, prefaulted by every core and registered, instead of
/// `cuMemHostAlloc`ed: measured on the H200 host, 400 MB costs 260 ms to allocate that way and
/// 44 ms more to touch, against about 10 ms to prefault and 15 ms to register.
const REGISTER_FROM: usize = 4 << 20;

/// Rounds of trimming one request may go through before it gives up (other threads took the
/// room each time).
const TRIM_ROUNDS: usize = 8;

// SAFETY: the block is plain host memory owned by whoever holds the HostBlock; it is only
// reached through that owner.
unsafe impl Send for HostBlock {}

impl Cached for HostBlock {
    fn size(&self) -> usize {
        self.size
    }
}

impl HostBlock {
    fn empty() -> Self {
        Self {
            ptr: NonNull::dangling(),
            size: 0,
            event: None,
            pending: false,
            after: Vec::new(),
            mapping: None,
        }
    }

    /// Whether no copy uses it any more (errors count as "still in use").
    fn is_idle(&self) -> bool {
        let copied = !self.pending
            || self
                .event
                .as_ref()
                .is_some_and(|e| e.try_is_complete() == Ok(true));
        copied && self.after.iter().all(Event::is_complete)
    }
}

struct PoolState {
    cache: BlockCache<HostBlock>,
    accounts: Reservations,
    stats: PinnedStats,
}

impl PoolState {
    fn snapshot(&self) -> PinnedStats {
        PinnedStats {
            reserved_bytes: self.accounts.reserved,
            cached_bytes: self.cache.bytes(),
            budget_bytes: self.accounts.budget,
            ..self.stats
        }
    }
}

/// The process-wide pool of page-locked host blocks.
pub struct PinnedPool {
    /// Supplies a context for allocation calls (portable blocks serve every device).
    device: CudaDevice,
    state: Mutex<PoolState>,
    /// Signalled whenever blocks finish going back to the OS (room may have appeared).
    released: Condvar,
    /// An error raised where none could be returned, for the next allocation to report.
    deferred: Mutex<Option<MemoryError>>,
}

/// Which cached blocks a request may take.
#[derive(Clone, Copy)]
enum Reuse {
    /// Its class or the next one up.
    Near,
    /// Its class only: staging whose bound is counted in classes.
    Exact,
}

impl PinnedPool {
    /// The default budget is this fraction (1/n) of the machine's memory (or of the container's
    /// limit). 1/8 leaves 7/8 of RAM swappable and reclaimable for the rest of the process and
    /// the system (on the H200 host's 128 GiB: about 16 GiB, some 40 results of 400 MB), while
    /// results beyond it still go by DMA, through bounded pinned staging into pooled,
    /// prefaulted pageable memory. PyTorch pins without a bound; 1/4 would let a program that
    /// collects results lock a quarter of RAM before any memory pressure shows.
    pub const DEFAULT_BUDGET_DIVISOR: usize = 8;

    /// The environment variable that sets the budget at start: bytes, or a size such as `8G`.
    pub const BUDGET_VARIABLE: &'static str = "FERRY_PINNED_BUDGET";

    /// The pool, created on first use (needs a driver and at least one GPU). Its budget comes
    /// from `FERRY_PINNED_BUDGET` when that is set (a value that is not a size is an error).
    pub fn global() -> Result<&'static PinnedPool, MemoryError> {
        static POOL: OnceLock<PinnedPool> = OnceLock::new();
        if let Some(pool) = POOL.get() {
            return Ok(pool);
        }
        let device = CudaDevice::get(0)?;
        let budget = budget_from_env(Self::BUDGET_VARIABLE, Self::DEFAULT_BUDGET_DIVISOR)?;
        Ok(POOL.get_or_init(|| PinnedPool {
            device,
            state: Mutex::new(PoolState {
                cache: BlockCache::new(),
                accounts: Reservations::new(budget),
                stats: PinnedStats::default(),
            }),
            released: Condvar::new(),
            deferred: Mutex::new(None),
        }))
    }

    /// A pinned buffer of `len` bytes. A cached block of its size class, or of the class above,
    /// whose last copy has finished is reused; otherwise a block is made if the budget has room
    /// (trimming idle cached blocks, least recently used first), else the request is refused
    /// with [`MemoryError::PinnedBudgetExceeded`]. Fresh blocks are zeroed; reused ones hold
    /// their previous bytes.
    pub fn alloc(&'static self, len: usize) -> Result<PinnedBuffer, MemoryError> {
        self.alloc_with(len, Reuse::Near)
    }

    /// [`PinnedPool::alloc`] reusing blocks of the request's own class only, so the bytes held
    /// are [`PinnedPool::block_size`] exactly: for staging checked against a bound.
    pub fn alloc_exact(&'static self, len: usize) -> Result<PinnedBuffer, MemoryError> {
        self.alloc_with(len, Reuse::Exact)
    }

    fn alloc_with(&'static self, len: usize, reuse: Reuse) -> Result<PinnedBuffer, MemoryError> {
        if let Some(error) = self.take_deferred() {
            return Err(error);
        }
        if len == 0 {
            return Ok(PinnedBuffer::new(HostBlock::empty(), 0, self));
        }
        let class = pinned_class(len)
            .ok_or_else(|| too_large("PinnedPool::alloc", len, PINNED_MAX_REQUEST))?;
        let largest = match reuse {
            Reuse::Near => next_pinned_class(class),
            Reuse::Exact => class,
        };
        {
            let mut state = self.state.lock();
            state.stats.allocations += 1;
            if let Some(block) = state.cache.take(class, largest, HostBlock::is_idle) {
                state.stats.cache_hits += 1;
                note_allocated(&mut state.stats, block.size);
                return Ok(PinnedBuffer::new(block, len, self));
            }
        }
        self.reserve(class, len)?;
        let made = self.make_block(class, len);
        let mut state = self.state.lock();
        match made {
            Ok(block) => {
                state.accounts.made(class);
                state.stats.host_allocations += 1;
                note_allocated(&mut state.stats, class);
                Ok(PinnedBuffer::new(block, len, self))
            }
            Err(e) => {
                state.accounts.abandoned(class);
                self.released.notify_all();
                Err(e)
            }
        }
    }

    /// Reserves `class` bytes within the budget, trimming cached blocks (freed outside the
    /// lock) or waiting for other threads' frees as needed.
    fn reserve(&self, class: usize, len: usize) -> Result<(), MemoryError> {
        let mut state = self.state.lock();
        let mut rounds = 0;
        loop {
            let s = &mut *state;
            match s.accounts.admit(&mut s.cache, class) {
                Admission::Granted => return Ok(()),
                Admission::WaitForReleases => self.released.wait(&mut state),
                Admission::Trim(victims) if rounds < TRIM_ROUNDS => {
                    rounds += 1;
                    state.stats.trimmed_blocks += victims.len() as u64;
                    let outcome =
                        parking_lot::MutexGuard::unlocked(&mut state, || self.free_blocks(victims));
                    self.finish_release(&mut state, outcome.bytes);
                    outcome.result?;
                }
                Admission::Trim(victims) => {
                    // Give the victims back to the cache: this request gives up.
                    let bytes: usize = victims.iter().map(Cached::size).sum();
                    for block in victims {
                        state.cache.put(block);
                    }
                    state.accounts.released(bytes);
                    state.accounts.reserved += bytes;
                    return Err(self.refusal(&mut state, len));
                }
                Admission::Refused => return Err(self.refusal(&mut state, len)),
            }
        }
    }

    fn refusal(&self, state: &mut PoolState, len: usize) -> MemoryError {
        state.stats.budget_refusals += 1;
        MemoryError::PinnedBudgetExceeded {
            requested: len,
            budget: state.accounts.budget,
            stats: Box::new(state.snapshot()),
        }
    }

    /// Frees trimmed blocks' bytes from the books and wakes requests waiting for room.
    fn finish_release(&self, state: &mut PoolState, bytes: usize) {
        state.accounts.released(bytes);
        self.released.notify_all();
    }

    /// Makes a block of `class` bytes (its bytes already reserved), outside the lock. On
    /// out-of-memory, gives every cached block back (they may be what exhausts lockable
    /// memory) and tries once more.
    fn make_block(&self, class: usize, len: usize) -> Result<HostBlock, MemoryError> {
        #[cfg(test)]
        super::test_hooks::slow_part(super::test_hooks::Slow::PinnedMake);
        self.device.bind()?;
        match make(class) {
            Ok(block) => Ok(block),
            Err(Made::Failed(e)) => Err(e),
            Err(Made::OutOfMemory) => {
                self.empty_cache()?;
                self.device.bind()?;
                make(class).map_err(|e| match e {
                    Made::Failed(e) => e,
                    Made::OutOfMemory => MemoryError::PinnedOutOfMemory {
                        requested: len,
                        stats: Box::new(self.stats()),
                    },
                })
            }
        }
    }

    /// The block size (the pool's size class) a request of `len` bytes occupies when it is made
    /// (or reused by [`PinnedPool::alloc_exact`]); statistics count these. `usize::MAX` for a
    /// request too large for any block, which [`PinnedPool::alloc`] refuses.
    pub fn block_size(len: usize) -> usize {
        if len == 0 {
            0
        } else {
            pinned_class(len).unwrap_or(usize::MAX)
        }
    }

    /// The pool's counters.
    pub fn stats(&self) -> PinnedStats {
        let state = self.state.lock();
        debug_assert_eq!(
            state.accounts.reserved,
            state.stats.allocated_bytes
                + state.stats.registered_bytes
                + state.cache.bytes()
                + state.accounts.making
        );
        state.snapshot()
    }

    /// The budget pinned bytes stay within.
    pub fn budget(&self) -> usize {
        self.state.lock().accounts.budget
    }

    /// Sets the budget. When it is lower than what the pool holds, idle cached blocks are freed
    /// (least recently used first, waiting for copies still using them) until it fits or the
    /// cache is empty; live buffers stay, and requests are refused until they drop.
    pub fn set_budget(&self, bytes: usize) -> Result<(), MemoryError> {
        let mut state = self.state.lock();
        state.accounts.budget = bytes;
        let s = &mut *state;
        let victims = s.accounts.trim_excess(&mut s.cache, |_| true);
        s.stats.trimmed_blocks += victims.len() as u64;
        let outcome = parking_lot::MutexGuard::unlocked(&mut state, || self.free_blocks(victims));
        self.finish_release(&mut state, outcome.bytes);
        self.released.notify_all(); // a higher budget may admit waiting requests
        outcome.result
    }

    /// Restarts peak tracking from the current allocated bytes.
    pub fn reset_peak(&self) {
        let mut state = self.state.lock();
        state.stats.peak_allocated_bytes = state.stats.allocated_bytes;
    }

    /// Unlocks and frees every cached block, waiting for copies still using them (outside the
    /// pool's lock).
    pub fn empty_cache(&self) -> Result<(), MemoryError> {
        let mut state = self.state.lock();
        let s = &mut *state;
        let victims = s.accounts.drain(&mut s.cache);
        let outcome = parking_lot::MutexGuard::unlocked(&mut state, || self.free_blocks(victims));
        self.finish_release(&mut state, outcome.bytes);
        outcome.result
    }

    /// Gives blocks back to the OS, waiting for their last copy. Blocks that cannot be freed
    /// safely are leaked (a DMA may still target them); every byte leaves the books either way.
    fn free_blocks(&self, blocks: Vec<HostBlock>) -> Released {
        let bytes = blocks.iter().map(|b| b.size).sum();
        let mut result = Ok(());
        if blocks.is_empty() {
            return Released { bytes, result };
        }
        for block in blocks {
            if block.pending
                && let Some(event) = &block.event
                && let Err(e) = event.synchronize()
            {
                result = Err(driver("cuEventSynchronize")(e));
                continue;
            }
            if let Some(e) = block.after.iter().find_map(|e| e.synchronize().err()) {
                result = Err(e);
                continue;
            }
            // Waiting on an event binds the event's context; free in the pool's.
            if let Err(e) = self.device.bind().and_then(|()| free_block(block)) {
                result = Err(e);
            }
        }
        Released { bytes, result }
    }

    /// Takes back a dropped buffer's block. If the pool is over its budget (it was lowered),
    /// idle blocks are trimmed, least recently used first.
    fn give_back(&self, block: HostBlock) {
        let mut state = self.state.lock();
        state.stats.allocated_bytes -= block.size;
        state.cache.put(block);
        if state.accounts.reserved <= state.accounts.budget {
            return;
        }
        let s = &mut *state;
        let victims = s.accounts.trim_excess(&mut s.cache, HostBlock::is_idle);
        s.stats.trimmed_blocks += victims.len() as u64;
        let outcome = parking_lot::MutexGuard::unlocked(&mut state, || self.free_blocks(victims));
        self.finish_release(&mut state, outcome.bytes);
        drop(state);
        if let Err(e) = outcome.result {
            self.defer(
                "freeing cached pinned blocks to get back within the budget after a pinned buffer was dropped".into(),
                e,
            );
        }
    }

    /// An error a drop kept for the next request, once.
    fn take_deferred(&self) -> Option<MemoryError> {
        self.deferred.lock().take()
    }

    /// Settles the books of an in-place registration of `len` bytes reserved with `reserve`: made, or
    /// abandoned when registering failed.
    fn registered(&self, len: usize, made: bool) {
        let mut state = self.state.lock();
        if made {
            state.accounts.made(len);
            state.stats.registered_bytes += len;
        } else {
            state.accounts.abandoned(len);
            self.released.notify_all();
        }
    }

    /// A registration of `len` bytes was undone: its bytes leave the budget.
    fn unregistered(&self, len: usize) {
        let mut state = self.state.lock();
        state.stats.registered_bytes -= len;
        state.accounts.reserved -= len;
        self.released.notify_all();
    }

    /// Keeps an error raised where none can be returned, for the next allocation to report
    /// (the first one wins: later errors are usually its consequences).
    fn defer(&self, what: String, error: MemoryError) {
        self.deferred
            .lock()
            .get_or_insert(MemoryError::FailedInDrop {
                what,
                source: Box::new(error),
            });
    }
}

/// What freeing some blocks did: their bytes (gone from the books either way) and the outcome.
struct Released {
    bytes: usize,
    result: Result<(), MemoryError>,
}

fn note_allocated(stats: &mut PinnedStats, bytes: usize) {
    stats.allocated_bytes += bytes;
    stats.peak_allocated_bytes = stats.peak_allocated_bytes.max(stats.allocated_bytes);
}

/// Why making a block failed.
enum Made {
    OutOfMemory,
    Failed(MemoryError),
}

/// A fresh, zeroed block of `class` bytes. A context must be bound.
fn make(class: usize) -> Result<HostBlock, Made> {
    if class >= REGISTER_FROM {
        return map_and_register(class);
    }
    let ptr = host_alloc(class).map_err(|e| match e.0 {
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => Made::OutOfMemory,
        _ => Made::Failed(driver("cuMemHostAlloc")(e)),
    })?;
    // SAFETY: `ptr` is a fresh allocation of `class` bytes. Zeroing makes every byte
    // initialised before safe code can read it.
    unsafe { ptr.as_ptr().write_bytes(0, class) };
    Ok(HostBlock {
        ptr,
        size: class,
        event: None,
        pending: false,
        after: Vec::new(),
        mapping: None,
    })
}

/// A large block: a huge-page mapping prefaulted in parallel (zeroed), then registered.
fn map_and_register(class: usize) -> Result<HostBlock, Made> {
    // Counted by the pinned pool's statistics, not the host's: each byte in one place.
    let mut mapping = crate::HostBuffer::prefaulted_uncounted(class).map_err(Made::Failed)?;
    let bytes = mapping.as_bytes_mut();
    // SAFETY: the mapping is valid for `class` bytes and owned by the block, which
    // unregisters it before unmapping (see `free_block`).
    unsafe {
        sys::cuMemHostRegister_v2(
            bytes.as_mut_ptr().cast(),
            bytes.len(),
            sys::CU_MEMHOSTREGISTER_PORTABLE,
        )
    }
    .result()
    .map_err(|e| match e.0 {
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => Made::OutOfMemory,
        _ => Made::Failed(driver("cuMemHostRegister")(e)),
    })?;
    let ptr = NonNull::new(mapping.as_bytes_mut().as_mut_ptr()).expect("a mapping is never null");
    Ok(HostBlock {
        ptr,
        size: class,
        event: None,
        pending: false,
        after: Vec::new(),
        mapping: Some(mapping),
    })
}

/// Gives a block back to the OS. No copy may use it any more.
fn free_block(block: HostBlock) -> Result<(), MemoryError> {
    match block.mapping {
        Some(mapping) => {
            let ptr = mapping.as_bytes().as_ptr() as *mut std::ffi::c_void;
            // SAFETY: the mapping was registered in `map_and_register`; it is unregistered
            // once, then unmapped when `mapping` drops.
            unsafe { sys::cuMemHostUnregister(ptr) }
                .result()
                .map_err(driver("cuMemHostUnregister"))
        }
        None => {
            // SAFETY: the block came from cuMemHostAlloc, is in no live buffer, and no copy
            // uses it any more (its event completed before the caller got here).
            unsafe { result::free_host(block.ptr.as_ptr().cast()) }.map_err(driver("cuMemFreeHost"))
        }
    }
}

fn host_alloc(bytes: usize) -> Result<NonNull<u8>, DriverError> {
    // SAFETY: a context is bound; the returned memory is uninitialised and zeroed by the caller.
    let raw = unsafe { result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }?;
    NonNull::new(raw.cast()).ok_or(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY))
}

impl fmt::Debug for PinnedPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedPool")
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}
