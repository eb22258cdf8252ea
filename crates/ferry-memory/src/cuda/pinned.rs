//! Page-locked host memory: a pool of reusable blocks for DMA staging, and registration of
//! existing host buffers.
//!
//! One pool per process, not per device: page-locked memory is a host resource, a staging block
//! serves copies to and from any GPU, and one set of statistics answers "how much RAM is pinned".
//! Blocks are allocated `CU_MEMHOSTALLOC_PORTABLE` so every context treats them as pinned; that
//! flag does not make them write-combined (cudarc's `alloc_pinned` does, and CPU reads of
//! write-combined memory are very slow, so device-to-host destinations must avoid it).

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys::{self, CUevent_flags, CUresult};
use cudarc::driver::{CudaEvent, DriverError, result};
use parking_lot::Mutex;

use super::cache::{BlockCache, Cached, pinned_class};
use super::device::CudaDevice;
use super::stream::{Stream, driver};
use crate::MemoryError;

/// Counters of the pinned pool. Bytes are block sizes (requests rounded to their class).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PinnedStats {
    /// Bytes in blocks handed out to live buffers.
    pub allocated_bytes: usize,
    /// Bytes page-locked by the pool: allocated plus cached.
    pub reserved_bytes: usize,
    /// Highest `allocated_bytes` since creation or the last `reset_peak`.
    pub peak_allocated_bytes: usize,
    /// Allocation requests served (empty buffers excluded).
    pub allocations: u64,
    /// Requests served from the cache.
    pub cache_hits: u64,
    /// `cuMemHostAlloc` calls that succeeded.
    pub host_allocations: u64,
}

/// A page-locked block and the event of the last copy that used it.
struct HostBlock {
    ptr: NonNull<u8>,
    size: usize,
    event: Option<CudaEvent>,
    pending: bool,
    /// Large blocks are prefaulted huge-page mappings registered with the driver (this owns
    /// the mapping); small ones come from `cuMemHostAlloc` (`None`).
    mapping: Option<crate::HostBuffer>,
}

/// Blocks at least this large are mapped, prefaulted by every core and registered, instead of
/// `cuMemHostAlloc`ed: measured on the H200 host, 400 MB costs 260 ms to allocate that way and
/// 44 ms more to touch, against about 10 ms to prefault and 15 ms to register.
const REGISTER_FROM: usize = 4 << 20;

// SAFETY: the block is plain host memory owned by whoever holds the HostBlock; it is only
// reached through that owner.
unsafe impl Send for HostBlock {}

impl Cached for HostBlock {
    fn size(&self) -> usize {
        self.size
    }
}

impl HostBlock {
    fn is_idle(&self) -> bool {
        !self.pending
            || self
                .event
                .as_ref()
                .is_some_and(|e| e.try_is_complete() == Ok(true))
    }
}

struct PoolState {
    cache: BlockCache<HostBlock>,
    stats: PinnedStats,
}

/// The process-wide pool of page-locked host blocks.
pub struct PinnedPool {
    /// Supplies a context for allocation calls (portable blocks serve every device).
    device: CudaDevice,
    state: Mutex<PoolState>,
    deferred: Mutex<Option<MemoryError>>,
}

impl PinnedPool {
    /// The pool, created on first use (needs a driver and at least one GPU).
    pub fn global() -> Result<&'static PinnedPool, MemoryError> {
        static POOL: OnceLock<PinnedPool> = OnceLock::new();
        if let Some(pool) = POOL.get() {
            return Ok(pool);
        }
        let device = CudaDevice::get(0)?;
        Ok(POOL.get_or_init(|| PinnedPool {
            device,
            state: Mutex::new(PoolState {
                cache: BlockCache::new(),
                stats: PinnedStats::default(),
            }),
            deferred: Mutex::new(None),
        }))
    }

    /// A pinned buffer of `len` bytes, reusing a cached block of the same size class whose last
    /// copy has finished. Fresh blocks are zeroed; reused ones hold their previous bytes.
    pub fn alloc(&'static self, len: usize) -> Result<PinnedBuffer, MemoryError> {
        if let Some(source) = self.deferred.lock().take() {
            return Err(MemoryError::FailedInDrop {
                what: "pinned buffer",
                source: Box::new(source),
            });
        }
        if len == 0 {
            let block = HostBlock {
                ptr: NonNull::dangling(),
                size: 0,
                event: None,
                pending: false,
                mapping: None,
            };
            return Ok(PinnedBuffer::new(block, 0, self));
        }
        let class = pinned_class(len);
        let mut state = self.state.lock();
        state.stats.allocations += 1;
        // Exact class only: classes are already 1/8 apart, and a bigger block would add waste.
        if let Some(block) = state.cache.take(class, class, HostBlock::is_idle) {
            state.stats.cache_hits += 1;
            note_allocated(&mut state.stats, class);
            return Ok(PinnedBuffer::new(block, len, self));
        }
        self.device.bind()?;
        if class >= REGISTER_FROM {
            let block = self.map_and_register(class, len, &mut state)?;
            return Ok(PinnedBuffer::new(block, len, self));
        }
        let ptr = match host_alloc(class) {
            Ok(ptr) => ptr,
            Err(e) if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                // Cached blocks may be what exhausts lockable memory: release them, retry once.
                self.release_cached(&mut state)?;
                host_alloc(class).map_err(|e| match e.0 {
                    CUresult::CUDA_ERROR_OUT_OF_MEMORY => MemoryError::PinnedOutOfMemory {
                        requested: len,
                        stats: state.stats,
                    },
                    _ => driver("cuMemHostAlloc")(e),
                })?
            }
            Err(e) => return Err(driver("cuMemHostAlloc")(e)),
        };
        // SAFETY: `ptr` is a fresh allocation of `class` bytes. Zeroing makes every byte
        // initialised before safe code can read it.
        unsafe { ptr.as_ptr().write_bytes(0, class) };
        state.stats.host_allocations += 1;
        state.stats.reserved_bytes += class;
        note_allocated(&mut state.stats, class);
        Ok(PinnedBuffer::new(
            HostBlock {
                ptr,
                size: class,
                event: None,
                pending: false,
                mapping: None,
            },
            len,
            self,
        ))
    }

    /// A large block: a huge-page mapping prefaulted in parallel (zeroed), then registered.
    fn map_and_register(
        &self,
        class: usize,
        len: usize,
        state: &mut PoolState,
    ) -> Result<HostBlock, MemoryError> {
        let register = |mapping: &mut crate::HostBuffer| {
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
        };
        // Counted by the pinned pool's statistics, not the host's: each byte in one place.
        let mut mapping = crate::HostBuffer::prefaulted_uncounted(class)?;
        if let Err(e) = register(&mut mapping) {
            if e.0 != CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                return Err(driver("cuMemHostRegister")(e));
            }
            // Cached blocks may be what exhausts lockable memory: release them, retry once.
            self.release_cached(state)?;
            register(&mut mapping).map_err(|e| match e.0 {
                CUresult::CUDA_ERROR_OUT_OF_MEMORY => MemoryError::PinnedOutOfMemory {
                    requested: len,
                    stats: state.stats,
                },
                _ => driver("cuMemHostRegister")(e),
            })?;
        }
        state.stats.host_allocations += 1;
        state.stats.reserved_bytes += class;
        note_allocated(&mut state.stats, class);
        let ptr =
            NonNull::new(mapping.as_bytes_mut().as_mut_ptr()).expect("a mapping is never null");
        Ok(HostBlock {
            ptr,
            size: class,
            event: None,
            pending: false,
            mapping: Some(mapping),
        })
    }

    /// The block size (the pool's size class) a request of `len` bytes occupies; statistics
    /// count these, so bounds on staging are checked against them.
    pub fn block_size(len: usize) -> usize {
        if len == 0 { 0 } else { pinned_class(len) }
    }

    /// The pool's counters.
    pub fn stats(&self) -> PinnedStats {
        let state = self.state.lock();
        debug_assert_eq!(
            state.stats.reserved_bytes,
            state.stats.allocated_bytes + state.cache.bytes()
        );
        state.stats
    }

    /// Restarts peak tracking from the current allocated bytes.
    pub fn reset_peak(&self) {
        let mut state = self.state.lock();
        state.stats.peak_allocated_bytes = state.stats.allocated_bytes;
    }

    /// Unlocks and frees every cached block, waiting for copies still using them.
    pub fn empty_cache(&self) -> Result<(), MemoryError> {
        let mut state = self.state.lock();
        self.release_cached(&mut state)
    }

    fn release_cached(&self, state: &mut PoolState) -> Result<(), MemoryError> {
        self.device.bind()?;
        let mut outcome = Ok(());
        for block in state.cache.drain() {
            // Leaving the cache either way: a block that cannot be freed safely is leaked, and
            // the statistics stop counting it.
            state.stats.reserved_bytes -= block.size;
            if block.pending
                && let Some(event) = &block.event
                && let Err(e) = event.synchronize()
            {
                // A DMA may still target it: leaking the block is the only safe choice.
                outcome = Err(driver("cuEventSynchronize")(e));
                continue;
            }
            // Waiting on an event binds the event's context; free in the pool's.
            if let Err(e) = self.device.bind() {
                outcome = Err(e);
                continue;
            }
            if let Err(e) = free_block(block) {
                outcome = Err(e);
            }
        }
        outcome
    }

    fn give_back(&self, block: HostBlock) {
        let mut state = self.state.lock();
        state.stats.allocated_bytes -= block.size;
        state.cache.put(block);
    }
}

fn note_allocated(stats: &mut PinnedStats, bytes: usize) {
    stats.allocated_bytes += bytes;
    stats.peak_allocated_bytes = stats.peak_allocated_bytes.max(stats.allocated_bytes);
}

/// Gives a cached block back to the OS. No copy may use it any more.
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

/// Page-locked host bytes from the [`PinnedPool`]. After an async copy it is "pending": reading
/// or writing it waits for the copy first, so a read-before-sync cannot happen.
pub struct PinnedBuffer {
    block: HostBlock,
    len: usize,
    /// Set by `record`; cleared once the event is seen complete.
    pending: AtomicBool,
    pool: &'static PinnedPool,
}

// SAFETY: the buffer owns its block exclusively; shared access hands out only `&[u8]` (after
// the pending copy finished) and the event is thread-safe, as for `Vec<u8>`.
unsafe impl Send for PinnedBuffer {}
// SAFETY: as above; `pending` is atomic.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    fn new(block: HostBlock, len: usize, pool: &'static PinnedPool) -> Self {
        Self {
            pending: AtomicBool::new(block.pending),
            block,
            len,
            pool,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the last copy queued on it has finished (so reading will not wait).
    pub fn is_ready(&self) -> bool {
        if !self.pending.load(Ordering::Acquire) {
            return true;
        }
        let done = self
            .block
            .event
            .as_ref()
            .is_none_or(|e| e.try_is_complete() == Ok(true));
        if done {
            self.pending.store(false, Ordering::Release);
        }
        done
    }

    /// Blocks until the last copy queued on it has finished.
    pub fn wait(&self) -> Result<(), MemoryError> {
        if self.pending.load(Ordering::Acquire) {
            if let Some(event) = &self.block.event {
                event.synchronize().map_err(driver("cuEventSynchronize"))?;
            }
            self.pending.store(false, Ordering::Release);
        }
        Ok(())
    }

    /// The bytes, once the pending copy (if any) has finished.
    pub fn as_bytes(&self) -> Result<&[u8], MemoryError> {
        self.wait()?;
        // SAFETY: the block holds `len` initialised bytes and no DMA writes them any more.
        Ok(unsafe { std::slice::from_raw_parts(self.block.ptr.as_ptr(), self.len) })
    }

    /// The bytes, mutably, once the pending copy (if any) has finished.
    pub fn as_bytes_mut(&mut self) -> Result<&mut [u8], MemoryError> {
        self.wait()?;
        // SAFETY: as in `as_bytes`, and `&mut self` makes the access unique; no DMA reads them.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.block.ptr.as_ptr(), self.len) })
    }

    /// The bytes without waiting, for queuing a copy that is ordered after the pending one.
    pub(crate) fn raw_bytes(&self) -> &[u8] {
        // SAFETY: `len` initialised bytes; only the driver reads them through this slice.
        unsafe { std::slice::from_raw_parts(self.block.ptr.as_ptr(), self.len) }
    }

    /// Mutable bytes without waiting, for a DMA destination ordered after the pending copy.
    pub(crate) fn raw_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `raw_bytes`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.block.ptr.as_ptr(), self.len) }
    }

    /// Makes `stream` wait, on the device, for the copy pending on this buffer.
    pub(crate) fn order_before(&self, stream: &Stream) -> Result<(), MemoryError> {
        if let (true, Some(event)) = (self.pending.load(Ordering::Acquire), &self.block.event) {
            stream
                .cudarc()
                .wait(event)
                .map_err(driver("cuStreamWaitEvent"))?;
        }
        Ok(())
    }

    /// Marks the end of a copy just queued on `stream`.
    pub(crate) fn record(&mut self, stream: &Stream) -> Result<(), MemoryError> {
        let ctx = stream.cudarc().context();
        // An event can only be recorded on streams of the context that created it.
        if self.block.event.as_ref().is_none_or(|e| e.context() != ctx) {
            let event = ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(driver("cuEventCreate"))?;
            self.block.event = Some(event);
        }
        let event = self.block.event.as_ref().expect("set above");
        event
            .record(stream.cudarc())
            .map_err(driver("cuEventRecord"))?;
        self.pending.store(true, Ordering::Release);
        Ok(())
    }
}

impl Deref for PinnedBuffer {
    type Target = [u8];

    /// Waits for the pending copy. A failed wait means the context is broken (nothing runs on it
    /// any more); the error is kept for the pool's next allocation.
    fn deref(&self) -> &[u8] {
        if let Err(e) = self.wait() {
            self.pool.deferred.lock().get_or_insert(e);
        }
        self.raw_bytes()
    }
}

impl DerefMut for PinnedBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        if let Err(e) = self.wait() {
            self.pool.deferred.lock().get_or_insert(e);
        }
        self.raw_bytes_mut()
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.block.size == 0 {
            return;
        }
        let pending = *self.pending.get_mut();
        let block = HostBlock {
            ptr: self.block.ptr,
            size: self.block.size,
            event: self.block.event.take(),
            pending,
            mapping: self.block.mapping.take(),
        };
        self.pool.give_back(block);
    }
}

impl fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("len", &self.len)
            .field("ready", &self.is_ready())
            .finish()
    }
}

/// Existing host memory page-locked in place for as long as this guard lives, so copies into it
/// are direct DMA; unregistered on drop.
pub struct HostRegistration<'a> {
    bytes: &'a mut [u8],
    device: CudaDevice,
}

impl CudaDevice {
    /// Page-locks `bytes` (any alignment) until the returned guard drops.
    pub fn register_host<'a>(
        &self,
        bytes: &'a mut [u8],
    ) -> Result<HostRegistration<'a>, MemoryError> {
        self.check()?;
        if !bytes.is_empty() {
            self.bind()?;
            // SAFETY: `bytes` is valid for its length and stays borrowed (so allocated and
            // unmoved) until the guard unregisters it.
            unsafe {
                sys::cuMemHostRegister_v2(
                    bytes.as_mut_ptr().cast(),
                    bytes.len(),
                    sys::CU_MEMHOSTREGISTER_PORTABLE,
                )
            }
            .result()
            .map_err(driver("cuMemHostRegister"))?;
        }
        Ok(HostRegistration {
            bytes,
            device: self.clone(),
        })
    }
}

impl Deref for HostRegistration<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.bytes
    }
}

impl DerefMut for HostRegistration<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.bytes
    }
}

impl Drop for HostRegistration<'_> {
    fn drop(&mut self) {
        if self.bytes.is_empty() {
            return;
        }
        let outcome = self.device.bind().and_then(|()| {
            // SAFETY: registered in `register_host`; copies into it are synchronous, so none is
            // in flight.
            match unsafe { sys::cuMemHostUnregister(self.bytes.as_mut_ptr().cast()) } {
                CUresult::CUDA_SUCCESS => Ok(()),
                other => Err(driver("cuMemHostUnregister")(result::DriverError(other))),
            }
        });
        if let Err(e) = outcome {
            self.device.defer(e);
        }
    }
}

impl fmt::Debug for HostRegistration<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostRegistration")
            .field("len", &self.bytes.len())
            .finish()
    }
}
