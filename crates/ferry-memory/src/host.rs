//! Pageable host buffers: zero-initialised, aligned for SIMD and DMA, and counted.
//!
//! Every [`HostBuffer`] adds its bytes to process-wide counters ([`host_stats`]) while it
//! lives: the host-side twin of the device allocator's statistics. Library code reads them but
//! never calls [`reset_host_peak`], whose peak belongs to the user.

use std::alloc::{self, Layout};
use std::fmt;
use std::ptr::NonNull;

use self::counters::HostCounters;

use crate::{Element, MemoryError};

pub(crate) mod budget;
mod counters;
mod pool;
mod recycle;

use pool::HOST_POOL;
pub use pool::{HostPool, HostPoolStats};

/// Alignment of every host buffer: a cache line, enough for any SIMD load.
const ALIGN: usize = 64;
/// Buffers at least this large are page-aligned, as DMA registration wants.
const PAGE_ALIGN_FROM: usize = 1 << 20;
const PAGE: usize = 4096;

/// Huge-page size the prefaulted path aligns to (the host pool's blocks are whole ones).
const HUGE_PAGE: usize = crate::classes::HOST_GRANULE;

/// An owned, aligned, zero-initialised block of host memory.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
    /// Returns to the [`HostPool`] on drop instead of to the OS.
    pooled: bool,
    /// Bytes this buffer adds to [`host_stats`]' `allocated_bytes`: its length, its pool block
    /// when pooled, 0 while it waits in the pool's cache.
    counted: usize,
    /// The registration that page-locks the bytes in place, once the CUDA layer pinned them
    /// (`PinnedPool::pin_in_place`); dropped, so unregistered, before the bytes are freed.
    page_lock: PageLock,
}

/// Whatever keeps a buffer's pages locked; this module only holds it and drops it first.
type PageLock = parking_lot::Mutex<Option<Box<dyn std::any::Any + Send + Sync>>>;

/// Where the bytes came from, so drop gives them back the same way.
enum Backing {
    Heap(Layout),
    /// An anonymous mapping of `len` bytes starting at `base` (before huge-page alignment).
    Mapped {
        base: NonNull<u8>,
        len: usize,
    },
    /// Memory another runtime owns, kept alive by `owner` and given back by dropping it.
    External(Box<dyn Send + Sync>),
    /// Moved out (into the pool); nothing to free.
    Gone,
}

// SAFETY: the buffer owns its allocation exclusively; `&HostBuffer` hands out only shared
// slices and `&mut HostBuffer` only unique ones, as for `Vec<u8>`.
unsafe impl Send for HostBuffer {}
// SAFETY: as above; no interior mutability.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// A zeroed buffer of `len` bytes. Large buffers come from the OS as untouched zero pages.
    pub fn zeroed(len: usize) -> Result<Self, MemoryError> {
        Ok(Self::zeroed_uncounted(len)?.counted_as(len))
    }

    /// A buffer of `len` bytes whose contents are unspecified (initialised, but not zero): for
    /// outputs a kernel overwrites entirely. Small buffers come from this thread's cache of
    /// freed blocks when one fits, skipping the allocator and the zeroing; others are zeroed.
    pub fn for_overwrite(len: usize) -> Result<Self, MemoryError> {
        if len <= recycle::MAX_BLOCK
            && let Ok(layout) = Self::heap_layout(len)
            && let Some(ptr) = recycle::take(layout)
        {
            let buffer = Self {
                ptr,
                len,
                backing: Backing::Heap(layout),
                pooled: false,
                counted: 0,
                page_lock: PageLock::default(),
            };
            return Ok(buffer.counted_as(len));
        }
        Self::zeroed(len)
    }

    fn heap_layout(len: usize) -> Result<Layout, MemoryError> {
        let align = if len >= PAGE_ALIGN_FROM { PAGE } else { ALIGN };
        Layout::from_size_align(len.max(1), align)
            .map_err(|_| MemoryError::HostOutOfMemory { bytes: len })
    }

    /// A buffer over `len` bytes at `ptr` that another runtime owns (a torch tensor received
    /// through DLPack, say): no copy is made, and the bytes stay valid for as long as the
    /// buffer lives because it holds `owner`, which it drops when it is dropped. Not counted in
    /// [`host_stats`]: ferry did not allocate it.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be readable and writable host memory that stays allocated, and is
    /// not freed or reused by anyone, until `owner` is dropped.
    pub unsafe fn from_external(ptr: NonNull<u8>, len: usize, owner: Box<dyn Send + Sync>) -> Self {
        Self {
            ptr,
            len,
            backing: Backing::External(owner),
            pooled: false,
            counted: 0,
            page_lock: PageLock::default(),
        }
    }

    /// Whether the bytes belong to another runtime ([`HostBuffer::from_external`]).
    pub fn is_external(&self) -> bool {
        matches!(self.backing, Backing::External(_))
    }

    /// Frees the blocks this thread keeps for [`HostBuffer::for_overwrite`].
    pub fn release_thread_cache() {
        recycle::clear();
    }

    fn zeroed_uncounted(len: usize) -> Result<Self, MemoryError> {
        let layout = Self::heap_layout(len)?;
        // SAFETY: `layout` has non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(MemoryError::HostOutOfMemory { bytes: len })?;
        Ok(Self {
            ptr,
            len,
            backing: Backing::Heap(layout),
            pooled: false,
            counted: 0,
            page_lock: PageLock::default(),
        })
    }

    /// A zeroed buffer whose pages are already faulted in, by all cores at once, backed by
    /// transparent huge pages where the kernel allows (`madvise(MADV_HUGEPAGE)`). Writing into
    /// fresh memory otherwise pays one page fault per 4 KiB on a single thread, which is slower
    /// than the PCIe link; this moves that cost up front and spreads it over every core.
    pub fn prefaulted(len: usize) -> Result<Self, MemoryError> {
        Ok(Self::prefaulted_uncounted(len)?.counted_as(len))
    }

    /// [`HostBuffer::prefaulted`], left out of [`host_stats`]: for memory accounted elsewhere
    /// (the host pool counts its blocks by size class; the pinned pool registers its large
    /// blocks and counts them as pinned memory).
    pub(crate) fn prefaulted_uncounted(len: usize) -> Result<Self, MemoryError> {
        if len < HUGE_PAGE {
            return Self::zeroed_uncounted(len);
        }
        let oom = || MemoryError::HostOutOfMemory { bytes: len };
        let map_len = len.checked_add(HUGE_PAGE).ok_or_else(oom)?;
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing; no file,
        // no existing memory is affected.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(oom());
        }
        let base = NonNull::new(raw.cast::<u8>()).ok_or_else(oom)?;
        let aligned = (base.as_ptr() as usize).next_multiple_of(HUGE_PAGE);
        let ptr = NonNull::new(aligned as *mut u8).ok_or_else(oom)?;
        // SAFETY: `ptr..ptr + len` lies inside the mapping made above (the extra huge page
        // covers the alignment). A failed madvise only means no huge pages: not an error.
        unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
        let mut buffer = Self {
            ptr,
            len,
            backing: Backing::Mapped { base, len: map_len },
            pooled: false,
            counted: 0,
            page_lock: PageLock::default(),
        };
        use rayon::prelude::*;
        // Anonymous pages read as zero; writing a zero to each faults it in without changing
        // what the buffer holds.
        buffer
            .as_bytes_mut()
            .par_chunks_mut(HUGE_PAGE)
            .for_each(|chunk| chunk.iter_mut().step_by(PAGE).for_each(|b| *b = 0));
        Ok(buffer)
    }

    /// A buffer holding a copy of `values`.
    pub fn from_slice<T: Element>(values: &[T]) -> Result<Self, MemoryError> {
        let bytes: &[u8] = bytemuck::cast_slice(values);
        let mut buffer = Self::zeroed(bytes.len())?;
        buffer.as_bytes_mut().copy_from_slice(bytes);
        Ok(buffer)
    }

    /// Counts the buffer in [`host_stats`] as `bytes` until it drops.
    fn counted_as(mut self, bytes: usize) -> Self {
        debug_assert_eq!(self.counted, 0);
        counters::count_allocation(bytes);
        self.counted = bytes;
        self
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` initialised bytes for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_bytes`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The elements, viewed as `T` (the length must be a multiple of `T`'s size).
    pub fn as_slice<T: Element>(&self) -> &[T] {
        bytemuck::cast_slice(self.as_bytes())
    }

    /// The elements, mutably.
    pub fn as_mut_slice<T: Element>(&mut self) -> &mut [T] {
        bytemuck::cast_slice_mut(self.as_bytes_mut())
    }
}

impl HostBuffer {
    /// The page lock the CUDA layer keeps in this buffer.
    pub(crate) fn page_lock(&self) -> &PageLock {
        &self.page_lock
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // Unlocked before the bytes go back to whoever owns them.
        drop(self.page_lock.get_mut().take());
        if self.counted > 0 {
            counters::count_free(self.counted);
        }
        if self.pooled {
            // A pooled buffer is counted as its pool block: `counted` is the block's size.
            let buffer = HostBuffer {
                ptr: self.ptr,
                len: self.counted,
                backing: std::mem::replace(&mut self.backing, Backing::Gone),
                pooled: false,
                counted: 0,
                page_lock: PageLock::default(),
            };
            HOST_POOL.give_back(buffer);
            return;
        }
        match std::mem::replace(&mut self.backing, Backing::Gone) {
            Backing::Gone => {}
            // The owner gives the bytes back to the runtime they came from.
            Backing::External(owner) => drop(owner),
            Backing::Heap(layout) => {
                if let Err(ptr) = recycle::keep(layout, self.ptr) {
                    // SAFETY: allocated in `zeroed` with exactly this layout; the recycler
                    // declined it, so it is freed here, once.
                    unsafe { alloc::dealloc(ptr.as_ptr(), layout) }
                }
            }
            Backing::Mapped { base, len } => {
                // SAFETY: the mapping made in `prefaulted`, unmapped exactly once. A failure
                // leaks address space only; there is nothing better to do in drop.
                unsafe { libc::munmap(base.as_ptr().cast(), len) };
            }
        }
    }
}

/// Process-wide counters of host memory in [`HostBuffer`]s; [`host_stats`] reads them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct HostStats {
    /// Bytes in live host buffers: each buffer's length, or for a buffer from the
    /// [`HostPool`] the pool block (its size class) it occupies. Buffers idle in the
    /// pool's cache are not counted (see `pool`).
    pub allocated_bytes: usize,
    /// Highest `allocated_bytes` since the process started or the last [`reset_host_peak`].
    pub peak_allocated_bytes: usize,
    /// Host buffers made since the process started (pooled and empty ones included).
    pub allocations: u64,
    /// The [`HostPool`]'s own counters: reserved bytes are handed out plus cached.
    pub pool: HostPoolStats,
}

/// The counters of every [`HostBuffer`] in the process: bytes alive now, the peak, and the
/// number made; with the [`HostPool`]'s reserved and cached bytes.
///
/// The numbers are process-wide (other threads' buffers move them too) and exact for the calling
/// thread's buffers: `allocated_bytes` is the sum of the sizes of the buffers alive, and the
/// peak the highest such sum. Buffers under 64 KiB are counted per thread and reach the shared
/// counters in batches of up to 1 MiB, so another thread's most recent small buffers may be
/// missing, by less than 1 MiB per thread (shared counters updated on every small buffer held
/// back thread scaling: the `counters` module has the measurements).
pub fn host_stats() -> HostStats {
    counters::flush_this_thread();
    let counts = HOST_COUNTERS.read();
    HostStats {
        allocated_bytes: counts.live,
        peak_allocated_bytes: counts.peak,
        allocations: counts.allocations,
        pool: HOST_POOL.stats(),
    }
}

/// Restarts peak tracking from what is allocated now. The peak is the user's: ferry itself
/// never calls this (measure with differences of `allocated_bytes`, or a peak of your own).
pub fn reset_host_peak() {
    counters::flush_this_thread();
    HOST_COUNTERS.reset_peak();
}

static HOST_COUNTERS: HostCounters = HostCounters::new();

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("len", &self.len)
            .finish()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Host statistics are process-wide: the tests here and in the pool's module that make
    /// buffers take turns, and so do the pinned pool's tests, which make large host buffers
    /// on a GPU machine.
    static SERIAL: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

    /// A test's turn at the host statistics ([`stats_turn`]). Ending it first flushes the
    /// counts this thread batched: left for the thread's end, they would land in the middle
    /// of the next test's reading.
    pub(crate) struct StatsTurn {
        _turn: parking_lot::MutexGuard<'static, ()>,
    }

    impl Drop for StatsTurn {
        fn drop(&mut self) {
            counters::flush_this_thread();
        }
    }

    /// Waits for this test's turn at the process-wide host statistics.
    pub(crate) fn stats_turn() -> StatsTurn {
        StatsTurn {
            _turn: SERIAL.lock(),
        }
    }

    #[test]
    fn host_buffers_are_counted_while_they_live() {
        let _turn = stats_turn();
        let before = host_stats();
        let a = HostBuffer::zeroed(1000).unwrap();
        let b = HostBuffer::from_slice(&[1.0f64; 3]).unwrap();
        let empty = HostBuffer::zeroed(0).unwrap();
        let now = host_stats();
        assert_eq!(now.allocated_bytes, before.allocated_bytes + 1024);
        assert_eq!(now.allocations, before.allocations + 3);
        assert!(now.peak_allocated_bytes >= now.allocated_bytes);
        drop((a, b, empty));
        assert_eq!(host_stats().allocated_bytes, before.allocated_bytes);
        reset_host_peak();
        assert_eq!(host_stats().peak_allocated_bytes, before.allocated_bytes);
        let big = HostBuffer::prefaulted((2 << 20) + 1).unwrap();
        drop(big);
        let after = host_stats();
        assert_eq!(after.allocated_bytes, before.allocated_bytes);
        assert_eq!(
            after.peak_allocated_bytes,
            before.allocated_bytes + (2 << 20) + 1
        );
    }

    #[test]
    fn prefaulted_buffers_are_zeroed_huge_page_aligned_and_writable() {
        let _turn = stats_turn();
        let len = (5 << 20) + 123;
        let mut buffer = HostBuffer::prefaulted(len).unwrap();
        assert_eq!(buffer.len(), len);
        assert_eq!(buffer.as_bytes().as_ptr() as usize % HUGE_PAGE, 0);
        assert!(buffer.as_bytes().iter().all(|&b| b == 0));
        buffer.as_bytes_mut()[len - 1] = 7;
        assert_eq!(buffer.as_bytes()[len - 1], 7);
        assert_eq!(HostBuffer::prefaulted(100).unwrap().len(), 100);
    }

    #[test]
    fn buffers_are_zeroed_aligned_and_typed() {
        let _turn = stats_turn();
        for len in [0, 3, 64, 1 << 20] {
            let buffer = HostBuffer::zeroed(len).unwrap();
            assert_eq!(buffer.len(), len);
            assert!(buffer.as_bytes().iter().all(|&b| b == 0));
            assert_eq!(buffer.as_bytes().as_ptr() as usize % ALIGN, 0);
        }
        let buffer = HostBuffer::from_slice(&[1.5f32, -2.0]).unwrap();
        assert_eq!(buffer.as_slice::<f32>(), &[1.5, -2.0]);
    }
}
