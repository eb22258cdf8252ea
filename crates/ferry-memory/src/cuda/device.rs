//! `CudaDevice`: one lazily created instance per ordinal, owning the context, the default
//! stream and the caching allocator of that GPU; each CUDA library keeps its own state beside it
//! ([`CudaDevice::local`]).

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaContext, result};
use parking_lot::{Mutex, RwLock};

use super::allocator::{DeviceAllocator, DeviceMemoryInfo, MemoryStats};
use super::buffer::DeviceBuffer;
use super::discover::{self, CudaDeviceInfo};
use super::local::DeviceLocals;
use super::stream::{Stream, driver};
use crate::{Device, MemoryError};

/// A CUDA GPU. Cheap to clone: clones share one context, allocator and kernel cache.
#[derive(Clone)]
pub struct CudaDevice {
    pub(crate) inner: Arc<DeviceInner>,
}

pub(crate) struct DeviceInner {
    pub(crate) info: CudaDeviceInfo,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) default_stream: Stream,
    /// Set once a second stream exists. Until then every free is ordered by the one stream and
    /// needs no event; the switch synchronizes the device so earlier frees are complete.
    multi_stream: AtomicBool,
    pub(crate) allocator: DeviceAllocator,
    /// An error raised in a destructor, reported by the next checked call.
    deferred: Mutex<Option<MemoryError>>,
    /// Whether `deferred` may hold an error: every checked call reads this, not the lock, so
    /// threads launching on one GPU do not meet on it.
    has_deferred: AtomicBool,
    /// Each library's state (kernels, cuBLAS, cuBLASLt, cuDNN, the profiler), made on first use.
    pub(crate) locals: DeviceLocals,
}

/// Devices live for the process, like the primary contexts they hold: a tensor may be created
/// from any thread and must find the same allocator. Looked up once per op on a GPU, so a
/// read lock: threads on one device share it.
fn registry() -> &'static RwLock<HashMap<usize, CudaDevice>> {
    static REGISTRY: OnceLock<RwLock<HashMap<usize, CudaDevice>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

impl CudaDevice {
    /// The device with this ordinal, created on first use.
    ///
    /// Returns [`MemoryError::NoDriver`] without a driver and [`MemoryError::NoSuchDevice`] for an
    /// ordinal past the last GPU; never panics.
    pub fn get(ordinal: usize) -> Result<CudaDevice, MemoryError> {
        // A device made before needs no driver call: this runs once per tensor in some paths.
        if let Some(device) = registry().read().get(&ordinal) {
            return Ok(device.clone());
        }
        discover::init()?;
        let mut devices = registry().write();
        if let Some(device) = devices.get(&ordinal) {
            return Ok(device.clone());
        }
        let available = result::device::get_count().map_err(driver("cuDeviceGetCount"))? as usize;
        if ordinal >= available {
            return Err(MemoryError::NoSuchDevice {
                device: Device::Cuda(ordinal),
                available,
            });
        }
        let info = discover::info(ordinal)?;
        let budget = super::allocator::budget_from_env()?;
        let ctx = CudaContext::new(ordinal).map_err(driver("cuDevicePrimaryCtxRetain"))?;
        let default_stream = Stream::wrap(ctx.default_stream());
        let device = CudaDevice {
            inner: Arc::new(DeviceInner {
                info,
                allocator: DeviceAllocator::new(Device::Cuda(ordinal), ctx.clone(), budget),
                ctx,
                default_stream,
                multi_stream: AtomicBool::new(false),
                deferred: Mutex::new(None),
                has_deferred: AtomicBool::new(false),
                locals: DeviceLocals::default(),
            }),
        };
        devices.insert(ordinal, device.clone());
        Ok(device)
    }

    /// The devices made so far in this process (by [`CudaDevice::get`]), in ordinal order;
    /// empty without a driver. Never initializes CUDA.
    pub fn made() -> Vec<CudaDevice> {
        let mut made: Vec<CudaDevice> = registry().read().values().cloned().collect();
        made.sort_by_key(CudaDevice::ordinal);
        made
    }

    /// The CUDA ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.info.ordinal
    }

    /// As a [`Device`].
    pub fn device(&self) -> Device {
        Device::Cuda(self.ordinal())
    }

    /// Name, compute capability, memory and SM count.
    pub fn info(&self) -> &CudaDeviceInfo {
        &self.inner.info
    }

    /// This device's `T`, made with `T::default()` on first use and shared by every clone for as
    /// long as the device lives (the process): where a CUDA library keeps its per-device state
    /// (handles, caches, workspaces), declared as a type of its own in its own module, so the
    /// device type names no library and adding one touches only that library.
    ///
    /// The lookup takes a shared lock only (an exclusive one the first time a type is asked
    /// for); `T` guards its own contents.
    pub fn local<T: Default + Send + Sync + 'static>(&self) -> Arc<T> {
        self.inner.locals.get()
    }

    /// The cudarc context of this device (its primary context), for the CUDA libraries that
    /// load modules or create handles in it.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    /// The stream work goes to when no other is named.
    pub fn default_stream(&self) -> &Stream {
        &self.inner.default_stream
    }

    /// A new stream that runs concurrently with the default one.
    pub fn new_stream(&self) -> Result<Stream, MemoryError> {
        self.check()?;
        self.enter_multi_stream()?;
        let stream = self
            .inner
            .ctx
            .new_stream()
            .map_err(driver("cuStreamCreate"))?;
        Ok(Stream::wrap(stream))
    }

    /// A stream another runtime owns on this device (torch's current stream, say), by its raw
    /// `CUstream` handle, so that ferry's work can be ordered with that runtime's work there.
    /// The legacy default stream (handle 0, or 1 as DLPack and torch name it) is this device's
    /// default stream itself; 2 is the per-thread default stream. Dropping the stream never
    /// destroys it.
    ///
    /// # Safety
    /// `handle` must be 0, 1, 2 or a live stream of this device's primary context, and its
    /// owner must keep it alive for as long as the returned stream (or a buffer that recorded
    /// a use on it) may still queue or record work on it.
    pub unsafe fn borrow_stream(&self, handle: u64) -> Result<Stream, MemoryError> {
        self.check()?;
        if handle <= 1 {
            return Ok(self.default_stream().clone());
        }
        // Work on another stream may use this device's memory now: frees must record events.
        self.enter_multi_stream()?;
        // SAFETY: the caller's promise: a live stream of this context, kept alive by its owner.
        let stream = unsafe {
            self.inner
                .ctx
                .wrap_borrowed_stream(handle as usize as sys::CUstream)
        };
        Ok(Stream::wrap(stream))
    }

    /// Switches to multi-stream mode (once): frees record events from then on, and blocks freed
    /// before carry none, so the device is synchronized first.
    fn enter_multi_stream(&self) -> Result<(), MemoryError> {
        if !self.inner.multi_stream.swap(true, Ordering::SeqCst) {
            self.inner
                .ctx
                .synchronize()
                .map_err(driver("cuCtxSynchronize"))?;
        }
        Ok(())
    }

    /// Blocks the host until every stream of this device is idle.
    /// Reports the first failed [`CudaDevice::check_later`] check this thread queued, if any.
    pub fn synchronize(&self) -> Result<(), MemoryError> {
        self.check()?;
        self.inner
            .ctx
            .synchronize()
            .map_err(driver("cuCtxSynchronize"))?;
        self.poll_checks(true)
    }

    /// The allocator's counters.
    pub fn memory_stats(&self) -> MemoryStats {
        self.inner.allocator.stats()
    }

    /// Free and total memory of the device as the driver reports them now (every process's
    /// and runtime's use counted; blocks cached in ferry's allocator count as used); `None` if
    /// the driver cannot say.
    pub fn memory_info(&self) -> Option<DeviceMemoryInfo> {
        self.inner.allocator.memory_info()
    }

    /// The most bytes ferry's allocator may reserve on this device, `None` for no cap but the
    /// device's own memory. Set by `FERRY_DEVICE_BUDGET` (bytes, or a size such as `20G`) when
    /// the device is first used, or by [`CudaDevice::set_budget`].
    pub fn budget(&self) -> Option<usize> {
        Some(self.inner.allocator.budget()).filter(|&b| b != usize::MAX)
    }

    /// Caps the bytes ferry's allocator may reserve on this device (`None` lifts the cap). A
    /// request beyond it first gives cached blocks back to the driver, then fails with
    /// [`MemoryError::DeviceBudgetExceeded`], as a request beyond the device's memory fails.
    /// Memory already reserved stays; the cap applies to new blocks.
    pub fn set_budget(&self, bytes: Option<usize>) {
        self.inner.allocator.set_budget(bytes.unwrap_or(usize::MAX));
    }

    /// Restarts peak tracking from the current allocated bytes.
    pub fn reset_peak(&self) {
        self.inner.allocator.reset_peak()
    }

    /// Waits for the device, then returns every cached block to the driver (reserved drops to
    /// allocated).
    pub fn empty_cache(&self) -> Result<(), MemoryError> {
        self.check()?;
        self.inner.allocator.empty_cache()
    }

    /// The block size (the allocator's size class) a request of `bytes` occupies in its
    /// statistics: a multiple of 512 bytes below 1 MiB, of 2 MiB from there. `usize::MAX` for a
    /// request too large for any block, which [`CudaDevice::alloc`] refuses.
    pub fn block_size(bytes: usize) -> usize {
        if bytes == 0 {
            0
        } else {
            crate::classes::device_class(bytes).unwrap_or(usize::MAX)
        }
    }

    /// Free and total device memory in bytes, as the driver sees it (other processes included).
    pub fn mem_get_info(&self) -> Result<(usize, usize), MemoryError> {
        self.check()?;
        self.inner
            .ctx
            .mem_get_info()
            .map_err(driver("cuMemGetInfo"))
    }

    /// `bytes` of uninitialised device memory, ordered on `stream`.
    pub fn alloc(&self, bytes: usize, stream: &Stream) -> Result<DeviceBuffer, MemoryError> {
        self.check()?;
        self.check_stream("alloc", stream)?;
        if bytes == 0 {
            return Ok(DeviceBuffer::empty(self.clone(), stream.clone()));
        }
        let block = self.inner.allocator.allocate(bytes, stream)?;
        Ok(DeviceBuffer::new(
            self.clone(),
            block,
            bytes,
            stream.clone(),
        ))
    }

    /// `bytes` of zeroed device memory; the zeroing is queued on `stream`.
    pub fn alloc_zeroed(&self, bytes: usize, stream: &Stream) -> Result<DeviceBuffer, MemoryError> {
        let mut buffer = self.alloc(bytes, stream)?;
        buffer.memset_zero(stream)?;
        Ok(buffer)
    }

    /// Lets kernels and copies on this device read `peer`'s memory directly (NVLink or PCIe
    /// peer-to-peer). Already enabled is fine; unsupported hardware is an error.
    pub fn enable_peer_access(&self, peer: &CudaDevice) -> Result<(), MemoryError> {
        self.check()?;
        if peer.ordinal() == self.ordinal() {
            return Ok(());
        }
        let mut can_access = 0;
        // SAFETY: both handles come from live contexts; `can_access` is a valid out-pointer.
        unsafe {
            sys::cuDeviceCanAccessPeer(
                &mut can_access,
                self.inner.ctx.cu_device(),
                peer.inner.ctx.cu_device(),
            )
        }
        .result()
        .map_err(driver("cuDeviceCanAccessPeer"))?;
        if can_access == 0 {
            return Err(MemoryError::PeerAccessUnsupported {
                from: self.device(),
                to: peer.device(),
            });
        }
        self.bind()?;
        // SAFETY: our context is current and `peer`'s context lives as long as `peer`.
        match unsafe { sys::cuCtxEnablePeerAccess(peer.inner.ctx.cu_ctx(), 0) } {
            CUresult::CUDA_SUCCESS | CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
            other => Err(driver("cuCtxEnablePeerAccess")(result::DriverError(other))),
        }
    }

    /// Binds this device's context to the calling thread (driver calls act on the current one,
    /// and libraries such as cuBLAS do not bind it themselves).
    pub fn bind(&self) -> Result<(), MemoryError> {
        self.inner
            .ctx
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))
    }

    pub(crate) fn is_multi_stream(&self) -> bool {
        self.inner.multi_stream.load(Ordering::SeqCst)
    }

    /// Reports an error a destructor recorded, once (as [`MemoryError::FailedInDrop`], naming
    /// what failed), then the first failed [`CudaDevice::check_later`] check of this thread that
    /// has reached the host. Every call that queues work on the device makes it first.
    pub fn check(&self) -> Result<(), MemoryError> {
        if self.inner.has_deferred.load(Ordering::Acquire) {
            // The flag changes only under the lock, so no error deferred now is lost.
            let mut deferred = self.inner.deferred.lock();
            self.inner.has_deferred.store(false, Ordering::Release);
            if let Some(error) = deferred.take() {
                return Err(error);
            }
        }
        self.poll_checks(false)
    }

    /// Keeps an error raised where none can be returned (a destructor, ordering a buffer's use)
    /// for the next checked call; `what` says what was being done, on what, so the report makes
    /// sense on an unrelated call. The first one wins: later errors are usually its consequences.
    /// `error` is a [`MemoryError`] or a CUDA library's error.
    pub fn defer(&self, what: String, error: impl Into<Box<dyn std::error::Error + Send + Sync>>) {
        let mut deferred = self.inner.deferred.lock();
        deferred.get_or_insert(MemoryError::FailedInDrop {
            what,
            source: error.into(),
        });
        self.inner.has_deferred.store(true, Ordering::Release);
    }

    /// Refuses `op` when its stream is on another device than this one.
    pub(crate) fn check_stream(
        &self,
        op: &'static str,
        stream: &Stream,
    ) -> Result<(), MemoryError> {
        self.check_operands(op, [stream.device()])
    }

    /// Refuses `op` with [`MemoryError::DeviceMismatch`] naming the first of `operands` (the
    /// devices of its stream, buffers and functions) that is not this device: the one check
    /// every library call (cuBLAS, cuBLASLt, cuDNN, NCCL, kernel launches) makes.
    pub fn check_operands(
        &self,
        op: &'static str,
        operands: impl IntoIterator<Item = Device>,
    ) -> Result<(), MemoryError> {
        all_on(op, self.device(), operands)
    }
}

/// [`CudaDevice::check_operands`] for a device `expected`.
fn all_on(
    op: &'static str,
    expected: Device,
    operands: impl IntoIterator<Item = Device>,
) -> Result<(), MemoryError> {
    match operands.into_iter().find(|&actual| actual != expected) {
        None => Ok(()),
        Some(actual) => Err(MemoryError::DeviceMismatch {
            op,
            expected,
            actual,
        }),
    }
}

// Devices, streams, events and pinned buffers cross threads with the tensors that use them.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<CudaDevice>();
    send_sync::<Stream>();
    send_sync::<super::stream::Event>();
    send_sync::<super::pinned::PinnedBuffer>();
};

impl PartialEq for CudaDevice {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Eq for CudaDevice {}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal())
            .field("name", &self.inner.info.name)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_driver_or_device_is_an_error_value() {
        let err = CudaDevice::get(10_000).unwrap_err();
        if discover::driver_present() {
            assert!(matches!(err, MemoryError::NoSuchDevice { .. }), "{err}");
        } else {
            assert!(matches!(err, MemoryError::NoDriver), "{err}");
            assert!(matches!(CudaDevice::get(0), Err(MemoryError::NoDriver)));
            assert!(matches!(
                super::super::PinnedPool::global(),
                Err(MemoryError::NoDriver)
            ));
        }
    }

    #[test]
    fn operands_on_another_device_are_refused_naming_the_first() {
        let (gpu0, gpu1) = (Device::Cuda(0), Device::Cuda(1));
        assert!(all_on("gemm", gpu0, [gpu0, gpu0, gpu0]).is_ok());
        assert!(all_on("gemm", gpu0, []).is_ok());
        match all_on("conv2d", gpu0, [gpu0, gpu1, Device::Cpu]) {
            Err(MemoryError::DeviceMismatch {
                op,
                expected,
                actual,
            }) => assert_eq!((op, expected, actual), ("conv2d", gpu0, gpu1)),
            other => panic!("{other:?}"),
        }
    }
}
