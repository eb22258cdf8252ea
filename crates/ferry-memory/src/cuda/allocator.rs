//! The caching device allocator: raw `cuMemAlloc` blocks, kept after free in a small and a large
//! pool keyed by size, reused on the stream that freed them at once and on other streams once the
//! event recorded at free time has completed.
//!
//! The lock guards the pools' bookkeeping only: `cuMemAlloc`, and the device synchronization
//! that must precede `cuMemFree` of cached blocks, run outside it, so a thread emptying the cache
//! (or waiting out an out-of-memory retry) never holds up another thread's cache hit.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::driver::sys::{self, CUevent_flags, CUresult};
use cudarc::driver::{CudaContext, CudaEvent, DriverError, result};
use parking_lot::Mutex;

use super::stream::{Event, Stream, driver};
use crate::cache::{BlockCache, Cached};
use crate::classes::{DEVICE_MAX_REQUEST, SMALL_LIMIT, device_class, largest_reusable, too_large};
use crate::{Device, MemoryError};

/// Counters of one device's allocator. Bytes are block sizes (requests rounded to their class).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes in blocks handed out to live buffers.
    pub allocated_bytes: usize,
    /// Bytes obtained from the driver: allocated plus cached.
    pub reserved_bytes: usize,
    /// Highest `allocated_bytes` since creation or the last `reset_peak`.
    pub peak_allocated_bytes: usize,
    /// Allocation requests served (cache hits and misses; empty buffers excluded).
    pub allocations: u64,
    /// Requests served from the cache.
    pub cache_hits: u64,
    /// `cuMemAlloc` calls that succeeded.
    pub device_allocations: u64,
    /// Blocks returned by dropped buffers.
    pub frees: u64,
}

/// Free and total memory of a device as the driver reports them (`cuMemGetInfo`): what every
/// process and context on the device uses is taken into account.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemoryInfo {
    /// Bytes the driver could still hand out.
    pub free_bytes: usize,
    /// Bytes of memory on the device.
    pub total_bytes: usize,
}

impl MemoryStats {
    fn note_allocated(&mut self, bytes: usize) {
        self.allocated_bytes += bytes;
        self.peak_allocated_bytes = self.peak_allocated_bytes.max(self.allocated_bytes);
    }
}

/// A block owned by a live buffer.
pub(crate) struct Block {
    pub(crate) ptr: u64,
    pub(crate) size: usize,
    /// Reused across the block's lives so a free costs a record, not a create.
    event: Option<CudaEvent>,
}

/// A block waiting in the cache.
struct FreeBlock {
    block: Block,
    /// Identity of the stream that freed it: work there is ordered after the free.
    stream: u64,
    /// Whether the block's event was recorded at free time; if not, nothing can still be using it.
    pending: bool,
    /// Copies on other streams still reading or writing it when it was freed: it is reused, on
    /// any stream, only once these are complete (so freeing it made no stream wait for them).
    after: Vec<Arc<Event>>,
}

impl Cached for FreeBlock {
    fn size(&self) -> usize {
        self.block.size
    }
}

impl FreeBlock {
    fn usable_on(&self, stream: u64) -> bool {
        if !self.after.iter().all(|e| e.is_complete()) {
            return false;
        }
        if self.stream == stream || !self.pending {
            return true;
        }
        // Errors count as "not yet": the block stays cached until empty_cache synchronizes.
        self.block
            .event
            .as_ref()
            .is_some_and(|e| e.try_is_complete() == Ok(true))
    }
}

struct Pools {
    small: BlockCache<FreeBlock>,
    large: BlockCache<FreeBlock>,
    stats: MemoryStats,
    /// Bytes reserved for `cuMemAlloc` calls in flight (counted in `reserved_bytes`).
    making: usize,
}

impl Pools {
    fn pool(&mut self, class: usize) -> &mut BlockCache<FreeBlock> {
        if class <= SMALL_LIMIT {
            &mut self.small
        } else {
            &mut self.large
        }
    }
}

/// One device's caching allocator.
pub(crate) struct DeviceAllocator {
    device: Device,
    ctx: Arc<CudaContext>,
    pools: Mutex<Pools>,
    /// The most bytes it may reserve from the driver (`usize::MAX`: no cap but the device's).
    budget: AtomicUsize,
}

/// The environment variable that caps each device's allocator: bytes, or a size such as `20G`.
pub const DEVICE_BUDGET_VARIABLE: &str = "FERRY_DEVICE_BUDGET";

/// The budget `FERRY_DEVICE_BUDGET` sets, `usize::MAX` when unset; an error naming the variable
/// when it is not a size.
pub(crate) fn budget_from_env() -> Result<usize, MemoryError> {
    Ok(crate::host::budget::size_from_env(DEVICE_BUDGET_VARIABLE)?.unwrap_or(usize::MAX))
}

impl DeviceAllocator {
    pub(crate) fn new(device: Device, ctx: Arc<CudaContext>, budget: usize) -> Self {
        let pools = Pools {
            small: BlockCache::new(),
            large: BlockCache::new(),
            stats: MemoryStats::default(),
            making: 0,
        };
        Self {
            device,
            ctx,
            pools: Mutex::new(pools),
            budget: AtomicUsize::new(budget),
        }
    }

    pub(crate) fn budget(&self) -> usize {
        self.budget.load(Ordering::Acquire)
    }

    pub(crate) fn set_budget(&self, bytes: usize) {
        self.budget.store(bytes, Ordering::Release);
    }

    pub(crate) fn stats(&self) -> MemoryStats {
        let pools = self.pools.lock();
        debug_assert_eq!(
            pools.stats.reserved_bytes,
            pools.stats.allocated_bytes + pools.small.bytes() + pools.large.bytes() + pools.making
        );
        pools.stats
    }

    pub(crate) fn reset_peak(&self) {
        let mut pools = self.pools.lock();
        pools.stats.peak_allocated_bytes = pools.stats.allocated_bytes;
    }

    /// A block of at least `bytes` (> 0) usable on `stream` without further waiting.
    pub(crate) fn allocate(&self, bytes: usize, stream: &Stream) -> Result<Block, MemoryError> {
        let class = device_class(bytes)
            .ok_or_else(|| too_large("CudaDevice::alloc", bytes, DEVICE_MAX_REQUEST))?;
        {
            let mut pools = self.pools.lock();
            pools.stats.allocations += 1;
            if let Some(free) = pools
                .pool(class)
                .take(class, largest_reusable(class), |b| b.usable_on(stream.id()))
            {
                pools.stats.cache_hits += 1;
                pools.stats.note_allocated(free.block.size);
                return Ok(free.block);
            }
            if !self.within_budget(&mut pools, class)? {
                let stats = pools.stats;
                return Err(MemoryError::DeviceBudgetExceeded {
                    device: self.device,
                    requested: bytes,
                    budget: self.budget(),
                    stats: Box::new(stats),
                });
            }
            // Counted before the driver call, which runs outside the lock.
            pools.stats.reserved_bytes += class;
            pools.making += class;
        }
        match self.malloc_retrying(class) {
            Ok(ptr) => {
                let mut pools = self.pools.lock();
                pools.making -= class;
                pools.stats.device_allocations += 1;
                pools.stats.note_allocated(class);
                Ok(Block {
                    ptr,
                    size: class,
                    event: None,
                })
            }
            Err(failure) => {
                let stats = {
                    let mut pools = self.pools.lock();
                    pools.making -= class;
                    pools.stats.reserved_bytes -= class;
                    pools.stats
                };
                Err(match failure {
                    MallocFailure::OutOfMemory => MemoryError::DeviceOutOfMemory {
                        device: self.device,
                        requested: bytes,
                        stats: Box::new(stats),
                        memory: self.memory_info(),
                    },
                    MallocFailure::Other(e) => e,
                })
            }
        }
    }

    /// Whether a new block of `class` bytes fits the budget, once cached blocks have been given
    /// back to the driver if they are what stands in the way (the lock is let go meanwhile).
    fn within_budget(
        &self,
        pools: &mut parking_lot::MutexGuard<'_, Pools>,
        class: usize,
    ) -> Result<bool, MemoryError> {
        let fits = |p: &Pools| p.stats.reserved_bytes.saturating_add(class) <= self.budget();
        if fits(pools) {
            return Ok(true);
        }
        parking_lot::MutexGuard::unlocked(pools, || self.release_cached(false))?;
        Ok(fits(pools))
    }

    /// `cuMemAlloc`; on out-of-memory, gives the cached blocks back to the driver (they may be
    /// what fills the device) and tries once more.
    fn malloc_retrying(&self, class: usize) -> Result<u64, MallocFailure> {
        let oom = |e: DriverError| {
            if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                MallocFailure::OutOfMemory
            } else {
                MallocFailure::Other(driver("cuMemAlloc")(e))
            }
        };
        let bind = || {
            self.ctx
                .bind_to_thread()
                .map_err(|e| MallocFailure::Other(driver("cuCtxSetCurrent")(e)))
        };
        bind()?;
        match malloc(class).map_err(oom) {
            Err(MallocFailure::OutOfMemory) => {
                self.release_cached(false).map_err(MallocFailure::Other)?;
                bind()?;
                malloc(class).map_err(oom)
            }
            other => other,
        }
    }

    /// Free and total memory of the device, as the driver sees them now; `None` if it cannot say.
    pub(crate) fn memory_info(&self) -> Option<DeviceMemoryInfo> {
        self.ctx.bind_to_thread().ok()?;
        let (mut free_bytes, mut total_bytes) = (0, 0);
        // SAFETY: the device's context is bound; both out-pointers are valid for writes.
        unsafe { sys::cuMemGetInfo_v2(&mut free_bytes, &mut total_bytes) }
            .result()
            .ok()?;
        Some(DeviceMemoryInfo {
            free_bytes,
            total_bytes,
        })
    }

    /// Takes back a block last used (in stream order) on `home`. With `record`, an event marks
    /// the free so other streams wait for it; without, the caller knows no other stream exists.
    /// The block is cached even when recording fails (after waiting for `home` instead). Copies
    /// on other streams that may still use it are `after`: the block stays cached, unused,
    /// until their events complete; nothing waits for them now.
    pub(crate) fn release(
        &self,
        mut block: Block,
        home: &Stream,
        record: bool,
        after: Vec<Arc<Event>>,
    ) -> Result<(), MemoryError> {
        let mut outcome = Ok(());
        let mut pending = false;
        if record {
            match record_free(&self.ctx, &mut block.event, home) {
                Ok(()) => pending = true,
                Err(e) => {
                    // Without an event the only safe state is "finished": wait for the stream.
                    outcome = Err(e);
                    if let Err(e) = home.synchronize() {
                        outcome = Err(e);
                    }
                }
            }
        }
        let mut pools = self.pools.lock();
        pools.stats.allocated_bytes -= block.size;
        pools.stats.frees += 1;
        let size = block.size;
        pools.pool(size).put(FreeBlock {
            block,
            stream: home.id(),
            pending,
            after,
        });
        outcome
    }

    /// Waits for the device, then returns every cached block to the driver.
    pub(crate) fn empty_cache(&self) -> Result<(), MemoryError> {
        self.release_cached(true)
    }

    /// Takes every cached block out under the lock; synchronizes the device and frees them
    /// outside it. With nothing cached, synchronizes only if `always_wait`.
    fn release_cached(&self, always_wait: bool) -> Result<(), MemoryError> {
        let blocks: Vec<FreeBlock> = {
            let mut pools = self.pools.lock();
            let mut blocks = pools.small.drain();
            blocks.extend(pools.large.drain());
            // Leaving the cache either way; a block the driver refuses to free is not ours.
            pools.stats.reserved_bytes -= blocks.iter().map(|b| b.block.size).sum::<usize>();
            blocks
        };
        if blocks.is_empty() && !always_wait {
            return Ok(());
        }
        #[cfg(test)]
        super::test_hooks::slow_part(super::test_hooks::Slow::DeviceRelease);
        self.ctx
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))?;
        // cuMemFree of a block a stream still uses would be a use-after-free on the device.
        // (If this fails the blocks are leaked: freeing them could be exactly that.)
        self.ctx.synchronize().map_err(driver("cuCtxSynchronize"))?;
        let mut outcome = Ok(());
        for free in blocks {
            // Copies that may still use the block can run on another GPU's stream (a peer
            // copy queued there), which this context's synchronize does not wait for.
            if let Some(e) = free.after.iter().find_map(|e| e.synchronize().err()) {
                outcome = Err(e);
                continue; // leaked: freeing it could be a use-after-free
            }
            // Waiting on an event binds the event's context; free in ours.
            self.ctx
                .bind_to_thread()
                .map_err(driver("cuCtxSetCurrent"))?;
            // SAFETY: the block came from cuMemAlloc in this context, is in no live buffer
            // (it was cached), the synchronize above finished all work this context queued on
            // it, and the events waited for, the work queued on other devices.
            if let Err(e) = unsafe { result::free_sync(free.block.ptr) } {
                outcome = Err(driver("cuMemFree")(e));
            }
        }
        outcome
    }
}

/// Why `cuMemAlloc` failed.
enum MallocFailure {
    OutOfMemory,
    Other(MemoryError),
}

fn malloc(bytes: usize) -> Result<u64, DriverError> {
    // SAFETY: the caller bound the device's context; the memory is uninitialised bytes, which
    // ferry only exposes through copies and kernels that write before reading.
    unsafe { result::malloc_sync(bytes) }
}

fn record_free(
    ctx: &Arc<CudaContext>,
    event: &mut Option<CudaEvent>,
    home: &Stream,
) -> Result<(), MemoryError> {
    let event = match event {
        Some(event) => event,
        None => event.insert(
            ctx.new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(driver("cuEventCreate"))?,
        ),
    };
    event.record(home.cudarc()).map_err(driver("cuEventRecord"))
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::thread;
    use std::time::Duration;

    use super::super::CudaDevice;
    use super::super::test_hooks::{SERIAL, Slow, arm};

    #[test]
    #[ignore = "needs a CUDA device"]
    fn an_allocation_does_not_wait_for_another_thread_emptying_the_cache() {
        let _serial = SERIAL.lock();
        let dev = CudaDevice::get(0).unwrap();
        // Something cached for empty_cache to free.
        drop(dev.alloc(8 << 20, dev.default_stream()).unwrap());
        let gate = arm(Slow::DeviceRelease);
        let emptier = {
            let dev = dev.clone();
            thread::spawn(move || dev.empty_cache())
        };
        assert!(
            gate.entered(Duration::from_secs(60)),
            "empty_cache never reached its synchronize"
        );
        // The emptier holds the drained blocks and is about to synchronize the device.
        let (done_tx, done_rx) = mpsc::channel();
        let allocator = {
            let dev = dev.clone();
            thread::spawn(move || {
                let len = dev.alloc(1 << 20, dev.default_stream()).map(|b| b.len());
                let _ = done_tx.send(len);
            })
        };
        let outcome = done_rx.recv_timeout(Duration::from_secs(30));
        let emptier_done_first = emptier.is_finished();
        gate.release();
        emptier.join().unwrap().unwrap();
        allocator.join().unwrap();
        let len = outcome.expect(
            "an allocation waited for another thread's empty_cache: the allocator's lock is held across the device synchronize",
        );
        assert!(!emptier_done_first, "the gate did not hold the emptier");
        assert_eq!(len.unwrap(), 1 << 20);
        let stats = dev.memory_stats();
        assert!(stats.reserved_bytes >= stats.allocated_bytes, "{stats:?}");
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn emptying_the_cache_waits_for_copies_on_another_devices_stream() {
        use std::sync::Arc;

        use super::super::Stream;
        use super::super::test_hooks::{hold, second_context};

        let _serial = SERIAL.lock();
        let dev = CudaDevice::get(0).unwrap();
        // A copy that still uses the block runs on a stream this device's synchronize does not
        // cover (another GPU's, here another context's), held there until the test says so.
        let other = second_context(&dev);
        let stream = Stream::wrap(other.new_stream().unwrap());
        let held = hold(&stream);
        let copy = Arc::new(stream.record().unwrap());
        dev.bind().unwrap();
        let home = dev.default_stream();
        let allocator = &dev.inner.allocator;
        let block = allocator.allocate(1 << 20, home).unwrap();
        allocator
            .release(block, home, true, vec![Arc::clone(&copy)])
            .unwrap();
        let emptier = {
            let dev = dev.clone();
            thread::spawn(move || dev.empty_cache())
        };
        // Ordering, not timing: the emptier cannot finish before the held copy completes.
        thread::sleep(Duration::from_millis(500));
        let freed_under_the_copy = emptier.is_finished();
        held.release();
        emptier.join().unwrap().unwrap();
        assert!(
            !freed_under_the_copy,
            "empty_cache freed a block whose copy on another device's stream was still running"
        );
        assert!(copy.is_complete());
        assert_eq!(
            dev.memory_stats().reserved_bytes,
            dev.memory_stats().allocated_bytes
        );
    }
}
