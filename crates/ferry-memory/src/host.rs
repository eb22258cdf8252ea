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

/// An owned, aligned, zero-initialised block of host memory.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
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
        Ok(Self { ptr, len, layout })
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
        // SAFETY: allocated in `zeroed` with exactly this layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
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
