//! CUDA through cudarc: discovery first; nothing here touches the driver before
//! [`driver_present`] has said it can be loaded.

mod discover;

pub use discover::{devices, driver_present, driver_version, CudaDeviceInfo};
