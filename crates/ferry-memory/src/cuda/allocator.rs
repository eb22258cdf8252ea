//! The caching device allocator: raw `cuMemAlloc` blocks, kept after free in a small and a large
//! pool keyed by size, reused on the stream that freed them at once and on other streams once the
//! event recorded at free time has completed.

use std::sync::Arc;

use cudarc::driver::sys::{CUevent_flags, CUresult};
use cudarc::driver::{CudaContext, CudaEvent, DriverError, result};
use parking_lot::Mutex;

use super::cache::{BlockCache, Cached, SMALL_LIMIT, device_class, largest_reusable};
use super::stream::{Stream, driver};
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
}

impl Cached for FreeBlock {
    fn size(&self) -> usize {
        self.block.size
    }
}

impl FreeBlock {
    fn usable_on(&self, stream: u64) -> bool {
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
}

impl DeviceAllocator {
    pub(crate) fn new(device: Device, ctx: Arc<CudaContext>) -> Self {
        let pools = Pools {
            small: BlockCache::new(),
            large: BlockCache::new(),
            stats: MemoryStats::default(),
        };
        Self {
            device,
            ctx,
            pools: Mutex::new(pools),
        }
    }

    pub(crate) fn stats(&self) -> MemoryStats {
        let pools = self.pools.lock();
        debug_assert_eq!(
            pools.stats.reserved_bytes,
            pools.stats.allocated_bytes + pools.small.bytes() + pools.large.bytes()
        );
        pools.stats
    }

    pub(crate) fn reset_peak(&self) {
        let mut pools = self.pools.lock();
        pools.stats.peak_allocated_bytes = pools.stats.allocated_bytes;
    }

    /// A block of at least `bytes` (> 0) usable on `stream` without further waiting.
    pub(crate) fn allocate(&self, bytes: usize, stream: &Stream) -> Result<Block, MemoryError> {
        let class = device_class(bytes);
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
        self.ctx
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))?;
        let ptr = match malloc(class) {
            Ok(ptr) => ptr,
            Err(e) if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                // Cached blocks may be what fills the device: give them back and retry once.
                self.release_cached(&mut pools)?;
                match malloc(class) {
                    Ok(ptr) => ptr,
                    Err(e) if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                        return Err(MemoryError::DeviceOutOfMemory {
                            device: self.device,
                            requested: bytes,
                            stats: pools.stats,
                        });
                    }
                    Err(e) => return Err(driver("cuMemAlloc")(e)),
                }
            }
            Err(e) => return Err(driver("cuMemAlloc")(e)),
        };
        pools.stats.device_allocations += 1;
        pools.stats.reserved_bytes += class;
        pools.stats.note_allocated(class);
        Ok(Block {
            ptr,
            size: class,
            event: None,
        })
    }

    /// Takes back a block last used (in stream order) on `home`. With `record`, an event marks
    /// the free so other streams wait for it; without, the caller knows no other stream exists.
    /// The block is cached even when recording fails (after waiting for `home` instead).
    pub(crate) fn release(
        &self,
        mut block: Block,
        home: &Stream,
        record: bool,
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
        });
        outcome
    }

    /// Waits for the device, then returns every cached block to the driver.
    pub(crate) fn empty_cache(&self) -> Result<(), MemoryError> {
        let mut pools = self.pools.lock();
        self.release_cached(&mut pools)
    }

    fn release_cached(&self, pools: &mut Pools) -> Result<(), MemoryError> {
        self.ctx
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))?;
        // cuMemFree of a block a stream still uses would be a use-after-free on the device.
        self.ctx.synchronize().map_err(driver("cuCtxSynchronize"))?;
        let mut outcome = Ok(());
        let blocks = pools.small.drain().into_iter().chain(pools.large.drain());
        for free in blocks {
            // Leaving the cache either way; a block the driver refuses to free is not ours.
            pools.stats.reserved_bytes -= free.block.size;
            // SAFETY: the block came from cuMemAlloc in this context, is in no live buffer
            // (it was cached), and the synchronize above finished all work touching it.
            if let Err(e) = unsafe { result::free_sync(free.block.ptr) } {
                outcome = Err(driver("cuMemFree")(e));
            }
        }
        outcome
    }
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
