//! Registration of existing host memory: page-locked in place for as long as a guard lives,
//! borrowed ([`HostRegistration`]) or, within the pinned pool's budget, for memory another
//! owner keeps alive ([`PinnedRegistration`]).

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use parking_lot::Mutex;

use cudarc::driver::result;
use cudarc::driver::sys::{self, CUresult};

use super::PinnedPool;
use crate::cuda::device::CudaDevice;
use crate::cuda::stream::{Stream, driver};
use crate::size::human_bytes;
use crate::{HostBuffer, MemoryError};

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
            self.device.defer(
                format!(
                    "unregistering {} of host memory page-locked by CudaDevice::register_host",
                    human_bytes(self.bytes.len())
                ),
                e,
            );
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

/// Host memory page-locked in place within the [`PinnedPool`]'s budget, held by the
/// [`HostBuffer`] it locks ([`PinnedPool::pin_in_place`]): copies to and from the buffer run at
/// the link, as from a pinned block. Dropped with the buffer, before its bytes are freed, it
/// waits for the work recorded on it ([`PinnedPool::record_host_use`]), unregisters the memory
/// and gives its bytes back to the budget.
struct PinnedRegistration {
    ptr: NonNull<u8>,
    len: usize,
    /// Streams other code used the memory on: waited for before unregistering.
    uses: Mutex<Vec<Stream>>,
    pool: &'static PinnedPool,
}

// SAFETY: the registration holds no reference to the memory beyond its address, which only the
// driver and its own drop use; `uses` is behind a lock.
unsafe impl Send for PinnedRegistration {}
// SAFETY: as above.
unsafe impl Sync for PinnedRegistration {}

impl PinnedPool {
    /// Page-locks `buffer`'s memory in place (`cuMemHostRegister`) for as long as the buffer
    /// lives, counted in the budget like the pool's own blocks: idle cached blocks are trimmed
    /// to make room, and a request that live pinned memory leaves no room for is refused with
    /// [`MemoryError::PinnedBudgetExceeded`] (which names the budget and how to raise it).
    /// Returns `false`, doing nothing, when the driver already knows the memory as page-locked
    /// (a pinned tensor from another runtime, or a buffer pinned before).
    pub fn pin_in_place(&'static self, buffer: &HostBuffer) -> Result<bool, MemoryError> {
        if let Some(error) = self.take_deferred() {
            return Err(error);
        }
        let mut lock = buffer.page_lock().lock();
        let bytes = buffer.as_bytes();
        if lock.is_some() || bytes.is_empty() || is_page_locked(bytes.as_ptr()) {
            return Ok(false);
        }
        let (ptr, len) = (NonNull::from(bytes).cast::<u8>(), bytes.len());
        self.reserve(len, len)?;
        let registered = self.device.bind().and_then(|()| {
            // SAFETY: the buffer's bytes stay allocated until it drops, and it drops the
            // registration (unregistering them) before it frees them.
            unsafe {
                sys::cuMemHostRegister_v2(
                    ptr.as_ptr().cast(),
                    len,
                    sys::CU_MEMHOSTREGISTER_PORTABLE,
                )
            }
            .result()
            .map_err(driver("cuMemHostRegister"))
        });
        self.registered(len, registered.is_ok());
        registered?;
        *lock = Some(Box::new(PinnedRegistration {
            ptr,
            len,
            uses: Mutex::new(Vec::new()),
            pool: self,
        }));
        Ok(true)
    }

    /// Whether copies of `buffer` run at the link: pinned in place by ferry, or memory the
    /// driver knows as page-locked (asking never initializes CUDA).
    pub fn is_page_locked(buffer: &HostBuffer) -> bool {
        buffer.page_lock().lock().is_some()
            || (!buffer.is_empty() && is_page_locked(buffer.as_bytes().as_ptr()))
    }

    /// Notes that work queued on `stream` by other code (a copy torch queued from a tensor over
    /// the buffer, say) may use a buffer ferry pinned in place: when the buffer drops, it waits
    /// for the work queued there by then before unregistering the memory. Nothing to do for a
    /// buffer ferry did not pin.
    pub fn record_host_use(buffer: &HostBuffer, stream: &Stream) {
        let lock = buffer.page_lock().lock();
        if let Some(registration) = lock
            .as_ref()
            .and_then(|l| l.downcast_ref::<PinnedRegistration>())
        {
            let mut uses = registration.uses.lock();
            if !uses.contains(stream) {
                uses.push(stream.clone());
            }
        }
    }
}

/// Whether the driver knows `ptr` as page-locked host memory (a pinned allocation, or a range
/// registered by anyone); `false` for ordinary pageable memory, and without a driver or before
/// CUDA was initialized (asking never initializes it).
pub fn is_page_locked(ptr: *const u8) -> bool {
    if !crate::cuda::driver_present() {
        return false;
    }
    let mut kind = 0u32;
    // SAFETY: the attribute query only reads the driver's tables; `kind` is a valid out-pointer
    // of the attribute's size.
    let queried = unsafe {
        sys::cuPointerGetAttribute(
            (&mut kind as *mut u32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            ptr as sys::CUdeviceptr,
        )
    };
    queried == CUresult::CUDA_SUCCESS && kind == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32
}

impl Drop for PinnedRegistration {
    fn drop(&mut self) {
        let what = || {
            format!(
                "unregistering {} of host memory pinned in place",
                human_bytes(self.len)
            )
        };
        // Unregistering under a DMA still using the pages is undefined: wait for it first.
        for stream in std::mem::take(self.uses.get_mut()) {
            if let Err(e) = stream.synchronize() {
                self.pool.defer(what(), e);
            }
        }
        let unregistered = self.pool.device.bind().and_then(|()| {
            // SAFETY: registered in `PinnedPool::pin_in_place`, unregistered once, here; the
            // memory is still allocated (its buffer frees it after this) and no copy uses it.
            unsafe { sys::cuMemHostUnregister(self.ptr.as_ptr().cast()) }
                .result()
                .map_err(driver("cuMemHostUnregister"))
        });
        if let Err(e) = unregistered {
            self.pool.defer(what(), e);
        }
        self.pool.unregistered(self.len);
    }
}
