//! The CUDA libraries ferry calls: cuBLAS GEMMs, cuBLASLt products with fused epilogues, cuDNN
//! convolutions, NCCL collectives, NVRTC-compiled kernel modules with a safe launch builder, and
//! the kernel profiler that times all of them.
//!
//! It owns every call into those libraries and checks each call's operands (extents, devices,
//! dtypes) before it is made, returning [`CudaLibError`]. It does not own devices, memory,
//! streams or events: those are ferry-memory's ([`ferry_memory::cuda`]), and each library here
//! keeps its per-device state in the device's slots ([`CudaDevice::local`]), so the device type
//! names no library and a new library is one folder here. It knows nothing of tensors.
//!
//! Each library's calls are methods of the device through a trait of that library ([`Blas`],
//! [`BlasLt`], [`Dnn`], [`Kernels`], [`Profiling`]; NCCL's are [`Communicator`]'s). Key
//! decision: the cuBLAS, cuBLASLt and cuDNN handles of a device are pooled, not one per device
//! behind a lock: a call takes an idle handle (making one when none is idle) and gives it back
//! when it returns, so threads sharing a GPU queue their work side by side (each call sets the
//! handle's stream, as a handle serves one call at a time).
//!
//! Every library is loaded at run time: nothing calls into one before its `*_present` check
//! has found it, so a machine without it gets an error value naming the fix, never a panic.
//!
//! [`CudaDevice::local`]: ferry_memory::cuda::CudaDevice::local
#![warn(missing_docs)]

mod blas;
mod blas_lt;
mod dnn;
mod error;
mod kernels;
mod launch;
mod nccl;
mod pool;
mod profile;

pub use blas::{Blas, GemmInput, GemmOutput, GemmSpec};
pub use blas_lt::{BlasLt, GemmEpilogue, cublaslt_present};
pub use dnn::{
    Attention, Causal, ConvInput, ConvOutput, ConvPass, ConvSpec, Dnn, DropoutRng,
    SDPA_MAX_HEAD_DIM, SDPA_MIN_CUDNN, SdpaBackward, SdpaForward, SdpaInput, SdpaOutput, SdpaSpec,
    cudnn_present, cudnn_version,
};
pub use error::CudaLibError;
pub use kernels::{KernelModule, Kernels, compile_ptx, nvrtc_present, nvrtc_version};
pub use launch::{
    CudaFunction, Dim3, Launch, MAX_GRID_X, blocks_for, exact_grid, grid_stride_blocks,
};
pub use nccl::{Communicator, ReduceOp, UniqueId, group, nccl_present, nccl_version};
pub use profile::{KernelTime, Profiling};

/// The library traits are implemented for [`CudaDevice`](ferry_memory::cuda::CudaDevice) only.
mod sealed {
    pub trait Sealed {}
    impl Sealed for ferry_memory::cuda::CudaDevice {}
}
