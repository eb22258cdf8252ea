//! Tensors for ferry: shared storage, strided layouts, the op set with its gradient rules,
//! and `gradcheck`.
//!
//! A [`Tensor`] is storage (bytes on one device) seen through a [`Layout`] (shape, strides,
//! offset), plus autograd metadata: a node in the process-wide graph ([`graph`]) when it
//! requires grad. Views (transpose, narrow, chunk, broadcast, reshape of contiguous data)
//! share storage and copy nothing.
//!
//! This crate never moves bytes between devices: ops on tensors from two devices are an error
//! that names both. Moving is ferry-transfer's job, so that what a move cost and what it
//! recorded are answerable in one place.
//!
//! Key decision: every gradient rule lives in one module (`rules`), written with tensor ops, so
//! each rule is a few lines, runs on every device, and composite ops (mean, softmax,
//! cross-entropy) are built from primitives and need no rule of their own.
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
#![warn(missing_docs)]

mod autograd;
mod backend;
mod cpu;
mod cuda;
mod error;
pub mod gradcheck;
mod layout;
pub mod ops;
mod rules;
mod storage;
mod tensor;

pub use autograd::{graph, record, record_kind, rule, saved_bytes, should_record, to_dot};
pub use cuda::{KERNEL_MODULES, compile_kernels};
pub use error::{Result, TensorError};
pub use ferry_graph::{BackwardOptions, BackwardReport, no_grad, with_no_grad};
pub use ferry_memory::{DType, Device};
pub use layout::{Layout, Shape, broadcast_shapes};
pub use ops::create::manual_seed;
pub use storage::{Buffer, Storage};
pub use tensor::Tensor;
