//! Devices, dtypes and memory for ferry: host buffers, CUDA discovery, and (on CUDA machines)
//! device memory, caching allocators, streams, events, and the per-device state slots
//! ([`cuda::CudaDevice::local`]) in which the CUDA libraries (ferry-cuda) keep theirs.
//!
//! This crate owns every raw pointer to memory in ferry and every `unsafe` block that touches
//! memory or the driver; the crates above it see safe types only, and ferry-cuda hands the
//! libraries it calls the device addresses of buffers ([`cuda::DeviceBuffer::device_ptr`],
//! [`cuda::DeviceBuffer::range`]) after their extents are checked. The other crates with
//! `unsafe` code of their own are ferry-cuda (its calls into the CUDA libraries) and ferry-py,
//! at its boundary with PyTorch: DLPack capsules (raw pointers taken in and handed out, wrapped
//! here by [`HostBuffer::from_external`] and its device twin) and torch's CUDA streams
//! borrowed by handle ([`cuda::CudaDevice::borrow_stream`], an `unsafe fn` whose promise, a
//! live stream kept alive by torch, ferry-py keeps). It knows nothing of tensors, autograd, or
//! the CUDA libraries.
//!
//! Key decision: CUDA support is always compiled (cudarc loads the driver dynamically), and
//! whether a GPU is there is decided at run time. Nothing touches cudarc before
//! [`cuda::driver_present`] says the driver library loads, so a machine without one gets
//! [`MemoryError::NoDriver`] as a value, never a panic.
#![warn(missing_docs)]

mod cache;
mod classes;
pub mod cuda;
mod device;
mod dtype;
mod error;
pub mod gemm;
mod host;
pub mod simd;
pub mod size;

pub use device::Device;
pub use dtype::{DType, Element};
pub use error::MemoryError;
pub use half::{bf16, f16};
pub use host::{HostBuffer, HostPool, HostPoolStats, HostStats, host_stats, reset_host_peak};
