//! A small cache, per thread, of freed small heap blocks, handed back out by
//! [`HostBuffer::for_overwrite`](super::HostBuffer::for_overwrite) without zeroing them.
//!
//! Every CPU op writes a fresh output, and on small tensors (a 64x64 step of a training loop)
//! zeroing it and the allocator's round trip cost more than the arithmetic. A recycled block
//! holds some earlier buffer's bytes: initialised memory, which a kernel that writes every
//! element overwrites anyway. The cache is bounded ([`MAX_BYTES`] per thread, blocks up to
//! [`MAX_BLOCK`]), lives and dies with its thread, and is never shared, so no lock or atomic is
//! touched; cached blocks are not counted as allocated in the host statistics (they are freed
//! memory, as glibc's own free lists are).

use std::alloc::{self, Layout};
use std::cell::RefCell;
use std::ptr::NonNull;

/// Largest block kept: the outputs of small ops, not whole datasets.
pub(crate) const MAX_BLOCK: usize = 256 << 10;
/// Bytes kept per thread at most.
const MAX_BYTES: usize = 2 << 20;
/// Blocks kept per thread at most (the lookup is a scan).
const MAX_BLOCKS: usize = 32;

struct Recycler {
    blocks: Vec<(Layout, NonNull<u8>)>,
    bytes: usize,
}

impl Drop for Recycler {
    fn drop(&mut self) {
        for (layout, ptr) in self.blocks.drain(..) {
            // SAFETY: each block was allocated with exactly this layout and is owned here.
            unsafe { alloc::dealloc(ptr.as_ptr(), layout) };
        }
    }
}

thread_local! {
    static RECYCLER: RefCell<Recycler> = const {
        RefCell::new(Recycler { blocks: Vec::new(), bytes: 0 })
    };
}

/// A cached block of exactly `layout`, most recently freed first (warmest in cache).
pub(crate) fn take(layout: Layout) -> Option<NonNull<u8>> {
    RECYCLER
        .try_with(|r| {
            let mut r = r.borrow_mut();
            let at = r.blocks.iter().rposition(|(l, _)| *l == layout)?;
            let (_, ptr) = r.blocks.swap_remove(at);
            r.bytes -= layout.size();
            Some(ptr)
        })
        .ok()
        .flatten()
}

/// Keeps a freed block for reuse; `Err` gives it back when the cache is full or gone.
pub(crate) fn keep(layout: Layout, ptr: NonNull<u8>) -> Result<(), NonNull<u8>> {
    if layout.size() > MAX_BLOCK {
        return Err(ptr);
    }
    RECYCLER
        .try_with(|r| {
            let mut r = r.borrow_mut();
            if r.blocks.len() >= MAX_BLOCKS || r.bytes + layout.size() > MAX_BYTES {
                return Err(ptr);
            }
            r.bytes += layout.size();
            r.blocks.push((layout, ptr));
            Ok(())
        })
        .unwrap_or(Err(ptr))
}

/// Frees this thread's cached blocks.
pub(crate) fn clear() {
    let _ = RECYCLER.try_with(|r| {
        let mut r = r.borrow_mut();
        for (layout, ptr) in r.blocks.drain(..) {
            // SAFETY: as in `Drop`.
            unsafe { alloc::dealloc(ptr.as_ptr(), layout) };
        }
        r.bytes = 0;
    });
}
