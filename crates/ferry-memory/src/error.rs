use thiserror::Error;

use crate::cuda::{MemoryStats, PinnedStats};
use crate::{DType, Device};

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
    #[error(
        "could not allocate {bytes} bytes of host memory: free some memory or move less at once (a chunked move bounds staging)"
    )]
    HostOutOfMemory {
        /// Size of the request.
        bytes: usize,
    },
    /// No CUDA driver library could be loaded.
    #[error(
        "no CUDA driver found (libcuda could not be loaded): use Device::Cpu, or install the NVIDIA driver"
    )]
    NoDriver,
    /// The driver is there but the device is not.
    #[error(
        "{device} is not available: {available} CUDA device(s) found; use Device::Cpu or a lower ordinal"
    )]
    NoSuchDevice {
        /// The device asked for.
        device: Device,
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
    /// The device allocator could not find memory even after emptying its cache.
    #[error(
        "CUDA out of memory on {device}: tried to allocate {}; ferry has {} allocated and {} reserved (cached blocks were already released and the allocation retried). \
         Free tensors you no longer need, call CudaDevice::empty_cache(), or move the data in chunks (a chunked move bounds device staging)",
        human_bytes(*.requested), human_bytes(.stats.allocated_bytes), human_bytes(.stats.reserved_bytes)
    )]
    DeviceOutOfMemory {
        /// The device that ran out.
        device: Device,
        /// Bytes asked for.
        requested: usize,
        /// The allocator's statistics at the time of the failure.
        stats: MemoryStats,
    },
    /// The pinned host pool could not get page-locked memory even after emptying its cache.
    #[error(
        "could not page-lock {} of host memory ({} pinned by ferry, {} reserved): call PinnedPool::empty_cache(), drop pinned buffers, or use a chunked move with smaller staging",
        human_bytes(*.requested), human_bytes(.stats.allocated_bytes), human_bytes(.stats.reserved_bytes)
    )]
    PinnedOutOfMemory {
        /// Bytes asked for.
        requested: usize,
        /// The pool's statistics at the time of the failure.
        stats: PinnedStats,
    },
    /// Source and destination of a copy have different lengths.
    #[error(
        "{op}: lengths differ ({expected} bytes expected, {actual} given); use copy_region to copy part of a buffer"
    )]
    LengthMismatch {
        /// The operation.
        op: &'static str,
        /// Length the destination (or operation) needs.
        expected: usize,
        /// Length that was given.
        actual: usize,
    },
    /// A byte range does not fit inside its buffer.
    #[error(
        "{op}: bytes {offset}..{offset}+{len} do not fit in a buffer of {buffer_len} bytes; check the offset and length"
    )]
    OutOfBounds {
        /// The operation.
        op: &'static str,
        /// Start of the range, in bytes.
        offset: usize,
        /// Length of the range, in bytes.
        len: usize,
        /// Length of the buffer, in bytes.
        buffer_len: usize,
    },
    /// Two things that must be on one device are not.
    #[error(
        "{op}: expected {expected} but got {actual}; move the data first (ferry-transfer), or use the peer-copy variant"
    )]
    DeviceMismatch {
        /// The operation.
        op: &'static str,
        /// The device the operation runs on.
        expected: Device,
        /// The device of the offending argument.
        actual: Device,
    },
    /// The hardware cannot map one device's memory into another's address space.
    #[error(
        "{from} cannot access {to} directly (no peer access between them); copies still work but stage through host memory"
    )]
    PeerAccessUnsupported {
        /// The device that would read.
        from: Device,
        /// The device whose memory would be read.
        to: Device,
    },
    /// An event without timing was used to measure time.
    #[error(
        "elapsed time needs events created with timing enabled: use Stream::record_timed or Event::timed"
    )]
    EventTimingDisabled,
    /// No NVRTC library could be loaded.
    #[error(
        "NVRTC (libnvrtc) could not be loaded: install the CUDA runtime compiler (e.g. `pip install nvidia-cuda-nvrtc`) and put it on the library path"
    )]
    NoNvrtc,
    /// NVRTC rejected a kernel module; the log says why.
    #[error("kernel module `{module}` failed to compile for {arch}:\n{log}")]
    KernelCompile {
        /// The module's name.
        module: &'static str,
        /// The target architecture (`compute_90`).
        arch: String,
        /// NVRTC's compiler log.
        log: String,
    },
    /// The driver refused compiled PTX.
    #[error(
        "kernel module `{module}` compiled but the driver could not load it ({message}); if NVRTC is newer than the driver, install an NVRTC that matches the driver's CUDA version"
    )]
    KernelLoad {
        /// The module's name.
        module: &'static str,
        /// The driver's error text.
        message: String,
    },
    /// A kernel name that is not in its module.
    #[error(
        "kernel `{function}` is not in module `{module}`: declare it `extern \"C\" __global__` so its name is not mangled"
    )]
    KernelNotFound {
        /// The module's name.
        module: &'static str,
        /// The function asked for.
        function: &'static str,
    },
    /// An NVRTC call other than compilation failed.
    #[error("NVRTC call {call} failed: {message}")]
    Nvrtc {
        /// The NVRTC function.
        call: &'static str,
        /// NVRTC's error text.
        message: String,
    },
    /// No cuBLAS library could be loaded.
    #[error(
        "cuBLAS (libcublas) could not be loaded: install the CUDA cuBLAS library (e.g. `pip install nvidia-cublas`) and put it on the library path"
    )]
    NoCublas,
    /// A cuBLAS call failed.
    #[error("cuBLAS call {call} failed: {message}")]
    Cublas {
        /// The cuBLAS function.
        call: &'static str,
        /// cuBLAS's status.
        message: String,
    },
    /// An operation that does not support this dtype.
    #[error("{op} does not support {dtype}: cast to f32 first")]
    UnsupportedDType {
        /// The operation.
        op: &'static str,
        /// The dtype given.
        dtype: DType,
    },
    /// A GEMM argument that cuBLAS would reject or that would read outside a buffer.
    #[error("gemm: {argument} {reason}")]
    GemmArgument {
        /// The argument (`lda`, `a`, `batch`, ...).
        argument: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A kernel argument that cannot be passed to this launch.
    #[error(
        "kernel launch `{function}`: argument {index} is on {actual} but the kernel runs on {expected}; move it first"
    )]
    LaunchArgumentDevice {
        /// The kernel.
        function: &'static str,
        /// Position of the argument.
        index: usize,
        /// The launch's device.
        expected: Device,
        /// The argument's device.
        actual: Device,
    },
    /// A CUDA call failed inside a destructor, where it could not be returned; reported here at
    /// the next checked call, as cudarc does.
    #[error("an earlier {what} failed while being dropped: {source}")]
    FailedInDrop {
        /// What was being dropped.
        what: &'static str,
        /// The failure.
        source: Box<MemoryError>,
    },
    /// A matrix operand does not fit the slice it was given.
    #[error(
        "matmul operand `{operand}` of {rows}x{cols} does not fit its buffer of {len} elements"
    )]
    OperandOutOfBounds {
        /// Which operand.
        operand: &'static str,
        /// Rows asked for.
        rows: usize,
        /// Columns asked for.
        cols: usize,
        /// Elements available.
        len: usize,
    },
}

/// Bytes as a short human figure (`1.50 GiB`), for error messages.
pub(crate) fn human_bytes(bytes: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_figures_are_readable() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 << 20), "3.00 MiB");
        assert_eq!(human_bytes(200 << 30), "200.00 GiB");
    }

    #[test]
    fn out_of_memory_says_what_was_asked_and_how_to_fix_it() {
        let stats = MemoryStats {
            allocated_bytes: 1 << 30,
            reserved_bytes: 3 << 29,
            ..MemoryStats::default()
        };
        let err = MemoryError::DeviceOutOfMemory {
            device: Device::Cuda(0),
            requested: 200 << 30,
            stats,
        };
        let text = err.to_string();
        for needle in [
            "cuda:0",
            "200.00 GiB",
            "1.00 GiB allocated",
            "1.50 GiB reserved",
            "empty_cache",
            "chunks",
        ] {
            assert!(text.contains(needle), "`{needle}` missing from: {text}");
        }
        let pinned = MemoryError::PinnedOutOfMemory {
            requested: 4096,
            stats: PinnedStats::default(),
        };
        assert!(
            pinned.to_string().contains("PinnedPool::empty_cache"),
            "{pinned}"
        );
    }
}
