//! Memory statistics of the host: the pageable buffers behind CPU tensors (and behind the
//! results of moves into pageable memory), named like their CUDA twins in [`crate::cuda`].
//! Page-locked memory has its own counters in [`crate::cuda::pinned`].
//!
//! The counts are process-wide: `memory_allocated` is the sum of the sizes of the host buffers
//! alive right now, whichever thread made them, exact for the calling thread's buffers; buffers
//! under 64 KiB are counted per thread in batches, so another thread's most recent small buffers
//! (less than 1 MiB of them) may not show yet. ferry never resets the peak; it is yours to
//! reset.
//!
//! ```
//! use ferry::prelude::*;
//!
//! let before = ferry::host::memory_allocated();
//! let x = Tensor::zeros(&[1024], DType::F32, Device::Cpu)?;
//! assert_eq!(ferry::host::memory_allocated(), before + 4096);
//! drop(x);
//! assert_eq!(ferry::host::memory_allocated(), before);
//! assert!(ferry::host::max_memory_allocated() >= before + 4096);
//! # Ok::<(), ferry::TensorError>(())
//! ```

use ferry_memory::{HostPool, host_stats, reset_host_peak};
pub use ferry_memory::{HostPoolStats, HostStats};

/// All host counters: allocated and peak bytes, buffers made, and the host pool's counters.
pub fn stats() -> HostStats {
    host_stats()
}

/// Bytes in host buffers alive now (a pooled buffer counts its whole pool block).
pub fn memory_allocated() -> usize {
    host_stats().allocated_bytes
}

/// The most bytes allocated at once since start or the last [`reset_peak`].
pub fn max_memory_allocated() -> usize {
    host_stats().peak_allocated_bytes
}

/// Bytes held: allocated, plus the idle buffers the host pool keeps for reuse.
pub fn memory_reserved() -> usize {
    let stats = host_stats();
    stats.allocated_bytes + stats.pool.cached_bytes()
}

/// Restarts peak tracking from what is allocated now.
pub fn reset_peak() {
    reset_host_peak();
}

/// Returns the host pool's idle buffers to the OS.
pub fn empty_cache() {
    HostPool::global().empty_cache();
}

/// The host pool's counters: bytes handed out and reserved, cache hits, its budget, buffers
/// trimmed to stay within it, and requests served outside it.
///
/// The host pool keeps large pageable buffers (the results of moves beyond the pinned budget,
/// chunked moves) with their pages faulted in, for reuse. It holds at most a budget of them:
/// 1/4 of the machine's memory by default, `FERRY_HOST_POOL_BUDGET` at start, or
/// [`set_pool_budget`]; idle buffers are trimmed least recently used first, and requests that
/// live buffers leave no room for get plain buffers outside the pool.
pub fn pool_stats() -> HostPoolStats {
    HostPool::global().stats()
}

/// Sets the host pool's budget; lowering it frees idle buffers (least recently used first).
pub fn set_pool_budget(bytes: usize) {
    HostPool::global().set_budget(bytes);
}

/// The host pool's budget now.
pub fn pool_budget() -> usize {
    HostPool::global().budget()
}
