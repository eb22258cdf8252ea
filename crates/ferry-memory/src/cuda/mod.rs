//! CUDA through cudarc: discovery, device memory behind a caching allocator, a pinned host pool,
//! streams and events, and the per-device state slots ([`CudaDevice::local`]) in which the CUDA
//! libraries (cuBLAS, cuBLASLt, cuDNN, NCCL, NVRTC kernels: the ferry-cuda crate) keep theirs.
//!
//! Nothing here touches the driver before [`driver_present`] has said it can be loaded: every
//! entry point returns [`MemoryError::NoDriver`](crate::MemoryError::NoDriver) instead. Device
//! memory is raw `cuMemAlloc` blocks, not cudarc's `CudaSlice`, because the allocator orders
//! reuse itself (per-stream, with one event per block) and needs no per-slice events.
//!
//! Buffers order their uses across streams themselves (see [`DeviceBuffer`]): a copy on another
//! stream waits for the buffer's producers, and later uses wait for copies still in flight.
//! Page-locked memory is bounded by the [`PinnedPool`]'s budget. The pools' and the allocator's
//! locks guard bookkeeping only: making, registering and freeing blocks, and synchronizing the
//! device, happen outside them.

mod allocator;
mod batch;
mod buffer;
mod checks;
mod device;
mod discover;
mod local;
mod pinned;
mod stream;
#[cfg(test)]
pub(crate) mod test_hooks;

pub use allocator::{DEVICE_BUDGET_VARIABLE, DeviceMemoryInfo, MemoryStats};
pub use batch::PinnedBatch;
pub use buffer::DeviceBuffer;
pub use checks::CheckReport;
pub use device::CudaDevice;
pub use discover::{CudaDeviceInfo, devices, driver_present, driver_version};
pub use pinned::{HostRegistration, PinnedBuffer, PinnedPool, PinnedStats, is_page_locked};
pub use stream::{Event, Stream};
