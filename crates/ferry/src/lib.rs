//! ferry: an autograd-aware tensor runtime whose device moves are correct and fast.
//!
//! This is the crate users depend on. It re-exports the tensor, graph and memory layers under
//! one roof; each layer lives in its own crate (memory <- graph <- tensor <- transfer <- ferry)
//! so that unsafe code, the graph engine and device moves each sit in one place.
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
#![warn(missing_docs)]

pub use ferry_graph as graph;
pub use ferry_memory as memory;
pub use ferry_tensor::gradcheck;
pub use ferry_tensor::{
    BackwardOptions, BackwardReport, DType, Device, Layout, Result, Tensor, TensorError,
    manual_seed, no_grad, with_no_grad,
};
pub use ferry_transfer::{DeviceMove, MoveOptions, TransferPath, TransferReport};

/// The names most programs need.
pub mod prelude {
    pub use crate::{
        DType, Device, DeviceMove, MoveOptions, Tensor, TensorError, no_grad, with_no_grad,
    };
}

/// The README's examples run as doctests, so the front page cannot drift from the code.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeDoctests;
