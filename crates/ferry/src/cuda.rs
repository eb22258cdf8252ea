//! Memory statistics and cache control for CUDA devices and the pinned host pool: thin
//! wrappers over ferry-memory, named as PyTorch users look for them. Without a GPU each one
//! returns an error (no driver, or no such device); none panics.

use ferry_memory::cuda::{CudaDevice, MemoryStats, PinnedPool, PinnedStats};
use ferry_tensor::{Device, Result, TensorError};

fn device(op: &'static str, device: Device) -> Result<CudaDevice> {
    match device {
        Device::Cuda(ordinal) => Ok(CudaDevice::get(ordinal)?),
        Device::Cpu => Err(TensorError::InvalidArgument {
            op,
            message: "cpu has no CUDA allocator; pass Device::Cuda(n) (host pinned memory: ferry::cuda::pinned)".into(),
        }),
    }
}

/// Whether a CUDA driver and at least one GPU are there.
pub fn is_available() -> bool {
    CudaDevice::get(0).is_ok()
}

/// All counters of `device`'s caching allocator.
pub fn memory_stats(on: Device) -> Result<MemoryStats> {
    Ok(device("memory_stats", on)?.memory_stats())
}

/// Bytes in blocks held by live tensors on `device`.
pub fn memory_allocated(on: Device) -> Result<usize> {
    Ok(device("memory_allocated", on)?
        .memory_stats()
        .allocated_bytes)
}

/// The most bytes allocated at once since start or the last [`reset_peak`].
pub fn max_memory_allocated(on: Device) -> Result<usize> {
    Ok(device("max_memory_allocated", on)?
        .memory_stats()
        .peak_allocated_bytes)
}

/// Bytes obtained from the driver: allocated plus cached.
pub fn memory_reserved(on: Device) -> Result<usize> {
    Ok(device("memory_reserved", on)?.memory_stats().reserved_bytes)
}

/// Restarts peak tracking from what is allocated now.
pub fn reset_peak(on: Device) -> Result<()> {
    device("reset_peak", on)?.reset_peak();
    Ok(())
}

/// Returns cached blocks to the driver.
pub fn empty_cache(on: Device) -> Result<()> {
    Ok(device("empty_cache", on)?.empty_cache()?)
}

/// Blocks until all work queued on `device` has finished.
pub fn synchronize(on: Device) -> Result<()> {
    Ok(device("synchronize", on)?.synchronize()?)
}

/// The process-wide pool of page-locked host memory that GPU-to-host copies land in.
///
/// Page-locked memory cannot be swapped, so the pool holds at most a budget of it: 1/8 of the
/// machine's memory by default (or of the container's limit), `FERRY_PINNED_BUDGET` at start
/// (bytes, or a size such as `8G`), or [`set_budget`](crate::cuda::pinned::set_budget). Within
/// it, GPU-to-host results land pinned (DMA straight into them); beyond it, blocking moves land
/// in pooled pageable memory through bounded pinned staging, and non-blocking ones
/// (`non_blocking`, `to_async`) run blocking that way. Idle cached blocks are trimmed least
/// recently used first, so reserved bytes stay within the budget.
///
/// ```no_run
/// // Keep at most 8 GiB of host memory page-locked.
/// ferry::cuda::pinned::set_budget(8 << 30)?;
/// assert!(ferry::cuda::pinned::memory_reserved()? <= ferry::cuda::pinned::budget()?);
/// # Ok::<(), ferry::TensorError>(())
/// ```
pub mod pinned {
    use super::*;

    fn pool() -> Result<&'static PinnedPool> {
        Ok(PinnedPool::global()?)
    }

    /// All counters of the pool.
    pub fn stats() -> Result<PinnedStats> {
        Ok(pool()?.stats())
    }

    /// Pinned bytes held by live buffers.
    pub fn memory_allocated() -> Result<usize> {
        Ok(pool()?.stats().allocated_bytes)
    }

    /// The most pinned bytes in use at once since start or the last [`reset_peak`].
    pub fn max_memory_allocated() -> Result<usize> {
        Ok(pool()?.stats().peak_allocated_bytes)
    }

    /// Bytes page-locked by the pool: allocated plus cached.
    pub fn memory_reserved() -> Result<usize> {
        Ok(pool()?.stats().reserved_bytes)
    }

    /// Restarts peak tracking from what is allocated now.
    pub fn reset_peak() -> Result<()> {
        pool()?.reset_peak();
        Ok(())
    }

    /// Unlocks and frees cached blocks.
    pub fn empty_cache() -> Result<()> {
        Ok(pool()?.empty_cache()?)
    }

    /// Sets the budget of page-locked bytes. Lowering it below what the pool holds frees idle
    /// cached blocks (least recently used first) right away; live pinned tensors stay, and
    /// moves land in pageable memory until they drop.
    pub fn set_budget(bytes: usize) -> Result<()> {
        Ok(pool()?.set_budget(bytes)?)
    }

    /// The budget of page-locked bytes now.
    pub fn budget() -> Result<usize> {
        Ok(pool()?.budget())
    }
}
