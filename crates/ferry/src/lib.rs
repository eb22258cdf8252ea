//! ferry: an autograd-aware tensor runtime whose device moves are correct and fast.
//!
//! This is the crate users depend on. It re-exports the tensor, graph, memory, CUDA-library and
//! transfer layers under one roof; each layer lives in its own crate (memory <- cuda, graph <-
//! tensor <- transfer <- ferry) so that unsafe code, the graph engine and device moves each sit
//! in one place. Of its own it holds what a training program builds on those layers:
//!
//! - [`nn`]: the [`Module`](nn::Module) trait, layers, initialisers and losses; [`models`]:
//!   the ready-made networks the CLI trains and benches;
//! - [`optim`]: optimizers, their steps over host memory and the optimizer offload,
//!   learning-rate schedules, gradient clipping and a moving average of the weights;
//! - [`train`]: the [`Trainer`](train::Trainer) loop; [`checkpoint`]: safetensors files,
//!   written through bounded staging, durably and in the background;
//! - [`distributed`]: process groups and data parallelism; [`amp`]: mixed precision;
//! - [`autograd`]: gradients beyond `backward`, grad modes, activation offload; [`debug`]: the
//!   graph-leak watch;
//! - [`prelude`]: the names most programs need;
//! - at the edge of ferry: ndarray and `.npy` interop ([`to_ndarray`], [`from_ndarray`],
//!   [`save_npy`], [`load_npy`]) and memory statistics ([`cuda`], [`host`], and
//!   [`allocated`] for either device).
//!
//! ```
//! use ferry::prelude::*;
//!
//! let w = Tensor::randn(&[4, 3], DType::F32, Device::Cpu)?.with_grad()?;
//! let x = Tensor::rand(&[8, 4], DType::F32, Device::Cpu)?;
//! let loss = x.matmul(&w)?.relu()?.mean()?;
//! loss.backward()?;
//! assert_eq!(w.grad().unwrap().shape(), &[4, 3]);
//! # Ok::<(), ferry::TensorError>(())
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod allocated;
pub mod amp;
mod array;
pub mod checkpoint;
pub mod cuda;
pub mod debug;
pub mod distributed;
mod durable;
pub mod host;
pub mod models;
pub mod nn;
pub mod optim;
pub mod train;

pub use array::{NpyError, from_ndarray, load_npy, save_npy, to_ndarray};
pub use checkpoint::CheckpointError;
pub use ferry_cuda as cuda_libs;
pub use ferry_graph as graph;
pub use ferry_memory as memory;
pub use ferry_tensor as tensor;
pub use ferry_tensor::gradcheck;
pub use ferry_tensor::{
    AttentionOptions, BackwardOptions, BackwardReport, DType, Device, Graph, GraphStats,
    HookHandle, Layout, Result, RngState, Tensor, TensorError, inference_mode, manual_seed,
    no_grad, rng_state, set_rng_state, with_no_grad,
};

/// Gradients beyond `backward`: [`grad`](autograd::grad) returns them instead of
/// accumulating (with `create_graph` for higher orders), grad modes, and the hooks' types.
pub mod autograd {
    pub use ferry_graph::{
        GradMode, GradModeGuard, enable_grad, inference_mode, is_grad_enabled, is_inference_mode,
        no_grad, with_no_grad,
    };
    pub use ferry_tensor::autograd::{
        Choice, GradOptions, Link, MeasuredPeaks, MemoryPlan, OffloadGuard, OffloadOptions,
        OffloadStats, PlannedRegion, RegionCost, Selective, StepCost, grad, offload_saved,
    };
    pub use ferry_tensor::gradcheck::{gradcheck, gradgradcheck};
    pub use ferry_tensor::{
        KeptProducts, keep_products, recompute, recompute_selective, reuse_products,
    };
}
pub use ferry_transfer::{
    Batch, ChunkPlan, ChunkSpec, ChunkStream, DEFAULT_IN_FLIGHT, DeviceLoader, DeviceMove,
    HostChunk, LoaderStats, MoveOptions, PendingTensor, QueuedStateDict, StateDict, TransferPath,
    TransferReport, move_state_dict, pinned_block_size, queue_state_dict,
};
/// The ndarray version ferry converts to and from, so callers name the same types.
pub use ndarray;

/// The names most programs need.
pub mod prelude {
    pub use crate::nn::Module;
    pub use crate::optim::Optimizer;
    pub use crate::{
        ChunkSpec, DType, Device, DeviceMove, MoveOptions, Tensor, TensorError, no_grad,
        with_no_grad,
    };
}

/// The README's examples run as doctests, so the front page cannot drift from the code.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeDoctests;

/// The guide's chapters (docs/guide/) run as doctests.
#[cfg(doctest)]
mod guide;
