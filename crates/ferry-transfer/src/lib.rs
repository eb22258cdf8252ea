//! Every byte that crosses a device boundary in ferry: autograd-aware moves, detach-before-copy,
//! moves by value, and the report each move returns.
//!
//! Tensor ops never move data between devices; this crate is the one place that does, so that
//! "what did this move cost, and what did it record in the graph" has one answer: the
//! [`TransferReport`].
//!
//! Key decision: a move is an ordinary graph op (a transfer node) whose backward moves the
//! gradient back to the source device and dtype. `detach()` before a move records nothing, and
//! copies never carry `.grad`: a moved leaf's copy starts with no gradient.
#![warn(missing_docs)]

mod copy;
mod moves;
mod report;

pub use moves::{DeviceMove, MoveOptions};
pub use report::{TransferPath, TransferReport};
