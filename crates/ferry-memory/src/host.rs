//! Pageable host buffers: zero-initialised, aligned for SIMD and DMA.

use std::alloc::{self, Layout};
use std::fmt;
use std::ptr::NonNull;

use crate::{Element, MemoryError};

/// Alignment of every host buffer: a cache line, enough for any SIMD load.
const ALIGN: usize = 64;
/// Buffers at least this large are page-aligned, as DMA registration wants.
const PAGE_ALIGN_FROM: usize = 1 << 20;
const PAGE: usize = 4096;

/// Huge-page size the prefaulted path aligns to.
const HUGE_PAGE: usize = 2 << 20;

/// An owned, aligned, zero-initialised block of host memory.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
    /// Returns to the [`HostPool`] on drop instead of to the OS.
    pooled: bool,
}

/// Where the bytes came from, so drop gives them back the same way.
enum Backing {
    Heap(Layout),
    /// An anonymous mapping of `len` bytes starting at `base` (before huge-page alignment).
    Mapped {
        base: NonNull<u8>,
        len: usize,
    },
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
        let align = if len >= PAGE_ALIGN_FROM { PAGE } else { ALIGN };
        let layout = Layout::from_size_align(len.max(1), align)
            .map_err(|_| MemoryError::HostOutOfMemory { bytes: len })?;
        // SAFETY: `layout` has non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(MemoryError::HostOutOfMemory { bytes: len })?;
        Ok(Self {
            ptr,
            len,
            backing: Backing::Heap(layout),
            pooled: false,
        })
    }

    /// A zeroed buffer whose pages are already faulted in, by all cores at once, backed by
    /// transparent huge pages where the kernel allows (`madvise(MADV_HUGEPAGE)`). Writing into
    /// fresh memory otherwise pays one page fault per 4 KiB on a single thread, which is slower
    /// than the PCIe link; this moves that cost up front and spreads it over every core.
    pub fn prefaulted(len: usize) -> Result<Self, MemoryError> {
        if len < HUGE_PAGE {
            return Self::zeroed(len);
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

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if self.pooled {
            let buffer = HostBuffer {
                ptr: self.ptr,
                len: self.len,
                backing: std::mem::replace(&mut self.backing, Backing::Gone),
                pooled: false,
            };
            HOST_POOL.give_back(buffer);
            return;
        }
        match self.backing {
            Backing::Gone => {}
            // SAFETY: allocated in `zeroed` with exactly this layout.
            Backing::Heap(layout) => unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) },
            Backing::Mapped { base, len } => {
                // SAFETY: the mapping made in `prefaulted`, unmapped exactly once. A failure
                // leaks address space only; there is nothing better to do in drop.
                unsafe { libc::munmap(base.as_ptr().cast(), len) };
            }
        }
    }
}

/// Large pageable buffers kept with their pages faulted in, for results that are written
/// once by a copy (chunked moves land here): fresh pageable memory costs a page fault per
/// 4 KiB on first write, slower than the PCIe link itself.
#[derive(Debug)]
pub struct HostPool {
    cached: parking_lot::Mutex<std::collections::HashMap<usize, Vec<HostBuffer>>>,
    stats: parking_lot::Mutex<HostPoolStats>,
}

/// Counters of the [`HostPool`], in bytes of whole (huge-page rounded) buffers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostPoolStats {
    /// Bytes in buffers handed out.
    pub allocated_bytes: usize,
    /// Bytes held: handed out plus cached.
    pub reserved_bytes: usize,
    /// Requests served from the cache.
    pub cache_hits: u64,
}

static HOST_POOL: std::sync::LazyLock<HostPool> = std::sync::LazyLock::new(|| HostPool {
    cached: Default::default(),
    stats: Default::default(),
});

impl HostPool {
    /// The process-wide pool.
    pub fn global() -> &'static HostPool {
        &HOST_POOL
    }

    /// A prefaulted buffer of `len` bytes, reused when one of its size is cached. Reused
    /// buffers hold their previous bytes (initialised, but not zero): for destinations that a
    /// copy overwrites whole.
    pub fn alloc(&self, len: usize) -> Result<HostBuffer, MemoryError> {
        if len < HUGE_PAGE {
            return HostBuffer::zeroed(len);
        }
        let class = len.next_multiple_of(HUGE_PAGE);
        let reused = self.cached.lock().get_mut(&class).and_then(Vec::pop);
        let mut stats = self.stats.lock();
        let mut buffer = match reused {
            Some(buffer) => {
                stats.cache_hits += 1;
                buffer
            }
            None => {
                let buffer = HostBuffer::prefaulted(class)?;
                stats.reserved_bytes += class;
                buffer
            }
        };
        stats.allocated_bytes += class;
        buffer.len = len;
        buffer.pooled = true;
        Ok(buffer)
    }

    fn give_back(&self, mut buffer: HostBuffer) {
        let class = buffer.len.next_multiple_of(HUGE_PAGE);
        buffer.len = class;
        self.stats.lock().allocated_bytes -= class;
        self.cached.lock().entry(class).or_default().push(buffer);
    }

    /// The pool's counters.
    pub fn stats(&self) -> HostPoolStats {
        *self.stats.lock()
    }

    /// Returns every cached buffer to the OS.
    pub fn empty_cache(&self) {
        let drained: Vec<HostBuffer> = self.cached.lock().drain().flat_map(|(_, v)| v).collect();
        self.stats.lock().reserved_bytes -= drained.iter().map(HostBuffer::len).sum::<usize>();
    }
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("len", &self.len)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefaulted_buffers_are_zeroed_huge_page_aligned_and_writable() {
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
    fn the_host_pool_reuses_buffers_of_a_size_class() {
        let pool = HostPool::global();
        let mut first = pool.alloc(3 << 20).unwrap();
        first.as_bytes_mut()[17] = 9;
        let address = first.as_bytes().as_ptr();
        drop(first);
        let hits = pool.stats().cache_hits;
        // Same 2 MiB class: the same pages come back, faulted in and holding their old bytes.
        let reused = pool.alloc((3 << 20) + 5).unwrap();
        assert_eq!(reused.len(), (3 << 20) + 5);
        assert_eq!(pool.stats().cache_hits, hits + 1);
        assert_eq!(reused.as_bytes().as_ptr(), address);
        assert_eq!(reused.as_bytes()[17], 9);
        drop(reused);
        pool.empty_cache();
        assert_eq!(pool.stats().reserved_bytes, pool.stats().allocated_bytes);
    }

    #[test]
    fn buffers_are_zeroed_aligned_and_typed() {
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
