//! Tensors for ferry: shared storage, strided layouts, the op set with its gradient rules,
//! and `gradcheck`.
//!
//! A [`Tensor`] is storage (bytes on one device) seen through a [`Layout`] (shape, strides,
//! offset), plus autograd metadata: a node in its graph ([`Tensor::graph`]) when it requires
//! grad. Views (transpose, narrow, chunk, broadcast, reshape of contiguous data)
//! share storage and copy nothing.
//!
//! Ops never move bytes between devices: ops on tensors from two devices are an error that
//! names both. Moving a tensor is ferry-transfer's job, so that what a move cost and what it
//! recorded are answerable in one place. Bytes cross a device boundary in this crate in three
//! places only: reading values out to the host ([`Tensor::to_vec`], [`Tensor::to_vec_f64`],
//! [`Tensor::item`] copy a CUDA tensor's elements into a `Vec`); an
//! [`offload_saved`](autograd::offload_saved) scope, which moves the activations rules save to
//! pinned host memory during forward and back to the GPU in backward; and the error flags of
//! CUDA kernels that check their inputs on the device (an index or a target out of range), a
//! few bytes read back to report them.
//!
//! Layers, each importing only those below it: `layout`, `storage`, `error`, then `op` (the op
//! vocabulary: the op table, conv geometry, the Adam step's scalars, shared messages), `kernel`
//! (the interface a device's kernels implement: operands of borrowed storage and a layout, dense
//! outputs, and `Backend`, a trait per op family with a method per primitive and per fused path)
//! and `tensor` (the type alone: storage, layout, autograd metadata); the kernels (`cpu`, `cuda`),
//! one `Backend` per device on storage and layouts, each family's trait implemented in that
//! family's file, which know nothing of tensors and call no op; `backend`, the one place that
//! matches on the device and makes tensors of the kernels' outputs; and on top `autograd`, `rules`
//! and `ops`. The backend module's docs say what adding a fused op touches.
//!
//! Key decision: a gradient rule declares what it saves ([`Save`]: inputs, the output, or
//! nothing but shapes and scalars) and is otherwise plain data and a `fn`, so a node keeps alive
//! exactly what its rule declares and the graph's saved-byte count is exact. Rules live in one
//! module (`rules`), written with tensor ops: each is a few lines, runs on every device, and is
//! itself differentiable (higher-order gradients). Composite ops (mean, cross-entropy) are built
//! from primitives and need no rule of their own.
//!
//! ```
//! use ferry_tensor::{DType, Device, Tensor};
//!
//! let x = Tensor::from_slice(&[1.0f32, -2.0, 3.0], &[3])?.with_grad()?;
//! let y = x.mul(&x)?.sum()?; // y = Σ x²
//! y.backward()?;
//! assert_eq!(x.grad().unwrap().to_vec::<f32>()?, [2.0, -4.0, 6.0]); // dy/dx = 2x
//! # Ok::<(), ferry_tensor::TensorError>(())
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod autocast;
pub mod autograd;
mod backend;
mod backward;
mod cpu;
mod cuda;
mod error;
pub mod gradcheck;
mod kept;
pub(crate) mod kernel;
mod layout;
mod op;
pub mod ops;
mod recompute;
mod rules;
mod storage;
mod tensor;

pub use autograd::{Rule, RuleState, Save, Saved, record, record_kind, should_record, try_record};
pub use backward::to_dot;
pub use cuda::{KERNEL_MODULES, compile_copy_kernels, compile_kernels};
pub use error::{Result, TensorError};
pub use ferry_graph::{
    BackwardOptions, BackwardReport, Graph, GraphStats, HookHandle, inference_mode, no_grad,
    with_no_grad,
};
pub use ferry_memory::{DType, Device};
pub use kept::{KeptProducts, keep_products, reuse_products};
pub use layout::{Layout, Shape, broadcast_shapes};
pub use ops::attention::AttentionOptions;
pub use ops::conv::Conv2dOptions;
pub use ops::create::{RngState, manual_seed, rng_state, set_rng_state};
pub use recompute::{recompute, recompute_selective};
pub use storage::{Buffer, ReadHold, Storage};
pub use tensor::Tensor;
