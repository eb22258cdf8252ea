use thiserror::Error;

/// Errors from devices, buffers and allocators.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// A device string that does not parse.
    #[error("`{text}` is not a device: write `cpu` or `cuda:N`")]
    BadDevice {
        /// What was given.
        text: String,
    },
    /// A dtype string that does not parse.
    #[error("`{text}` is not a dtype: write one of f32, f64, f16, bf16, i64, u8")]
    BadDType {
        /// What was given.
        text: String,
    },
    /// The host allocator refused.
    #[error("could not allocate {bytes} bytes of host memory: free some memory or move less at once (a chunked move bounds staging)")]
    HostOutOfMemory {
        /// Size of the request.
        bytes: usize,
    },
    /// No CUDA driver library could be loaded.
    #[error("no CUDA driver found (libcuda could not be loaded): use Device::Cpu, or install the NVIDIA driver")]
    NoDriver,
    /// The driver is there but the device is not.
    #[error("{device} is not available: {available} CUDA device(s) found; use Device::Cpu or a lower ordinal")]
    NoSuchDevice {
        /// The device asked for.
        device: crate::Device,
        /// How many CUDA devices exist.
        available: usize,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver call {call} failed: {message}")]
    Driver {
        /// The driver function.
        call: &'static str,
        /// The driver's error text.
        message: String,
    },
}
