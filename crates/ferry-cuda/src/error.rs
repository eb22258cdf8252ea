use ferry_memory::{DType, Device, MemoryError};
use thiserror::Error;

/// Errors from the CUDA libraries: a library that cannot be loaded, a call it failed, an
/// argument it would reject; and, as [`CudaLibError::Memory`], the device and memory errors met
/// on the way (no driver, a device mismatch, out of memory), unchanged.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum CudaLibError {
    /// A device or memory error (ferry-memory's), as it was raised.
    #[error(transparent)]
    Memory(#[from] MemoryError),
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
    /// libcudnn is missing or lacks a function ferry calls.
    #[error(
        "cuDNN could not be used: {reason}; install cuDNN 9 (e.g. `pip install nvidia-cudnn-cu13`) and put its lib directory on LD_LIBRARY_PATH (convolutions fall back to im2col and cuBLAS without it)"
    )]
    NoCudnn {
        /// Why: not found, or the missing function.
        reason: String,
    },
    /// A cuDNN call failed.
    #[error("cuDNN call {call} failed: {message}")]
    Cudnn {
        /// The cuDNN function.
        call: &'static str,
        /// cuDNN's status.
        message: String,
    },
    /// A convolution argument cuDNN would reject or that would read outside a buffer.
    #[error("conv2d: {argument} {reason}")]
    ConvArgument {
        /// The argument (`groups`, `filter`, `output`, ...).
        argument: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A fused attention argument that is wrong in itself or would read outside a buffer.
    #[error("sdpa: {argument} {reason}")]
    AttentionArgument {
        /// The argument (`kv_heads`, `q`, `dropout`, ...).
        argument: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A fused attention call cuDNN cannot run (an old cuDNN, a dtype, head dim or layout its
    /// engines do not take, or no engine for the graph): run the composed attention instead.
    #[error(
        "cuDNN's fused attention cannot run this call: {reason}; use the composed attention (matmul, softmax, matmul)"
    )]
    AttentionUnsupported {
        /// Why.
        reason: String,
    },
    /// An operation that does not support this dtype.
    #[error("{op} does not support {dtype}: cast to f32 first")]
    UnsupportedDType {
        /// The operation.
        op: &'static str,
        /// The dtype given.
        dtype: DType,
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
    /// A kernel without a grid-stride loop needs more blocks than a grid holds.
    #[error(
        "{op}: the kernel needs {blocks} blocks, more than a grid's {limit}; split the tensor into smaller parts"
    )]
    GridTooLarge {
        /// The operation.
        op: &'static str,
        /// Blocks it needs.
        blocks: usize,
        /// The most a grid holds ([`MAX_GRID_X`](crate::MAX_GRID_X)).
        limit: u32,
    },
    /// NCCL (libnccl) could not be used: it is not installed, not on the library path, or
    /// lacks a function ferry calls.
    #[error(
        "NCCL (libnccl) is not usable: {reason}. Install NCCL 2.x (libnccl.so.2: the libnccl2 package, or `pip install nvidia-nccl-cu13`) \
         and put its directory on LD_LIBRARY_PATH; the loader looks for the name libnccl.so, so where only libnccl.so.2 exists add a link \
         `ln -s /path/to/libnccl.so.2 DIR/libnccl.so` in a directory DIR on LD_LIBRARY_PATH"
    )]
    NoNccl {
        /// Why: not found, or the missing function.
        reason: String,
    },
    /// An NCCL call failed.
    #[error("NCCL call {call} failed: {message}")]
    Nccl {
        /// The NCCL function.
        call: &'static str,
        /// NCCL's error string, with its last-error detail where it gave one.
        message: String,
    },
    /// A collective or communicator argument that NCCL would reject or that would read outside
    /// a buffer.
    #[error("{op}: {reason}")]
    CollectiveArgument {
        /// The operation (`all_reduce`, `Communicator::for_devices`, ...).
        op: &'static str,
        /// What is wrong and how to fix it.
        reason: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_stay_small_and_messages_are_the_libraries() {
        // TensorError holds a CudaLibError inline, as it holds a MemoryError.
        assert!(
            size_of::<CudaLibError>() <= size_of::<MemoryError>() + 8,
            "{}",
            size_of::<CudaLibError>()
        );
        let wrapped = CudaLibError::from(MemoryError::NoDriver);
        assert_eq!(wrapped.to_string(), MemoryError::NoDriver.to_string());
        let err = CudaLibError::NoCudnn {
            reason: "libcudnn was not found".into(),
        };
        let text = err.to_string();
        for needle in ["cuDNN could not be used", "LD_LIBRARY_PATH", "im2col"] {
            assert!(text.contains(needle), "`{needle}` missing from: {text}");
        }
    }
}
