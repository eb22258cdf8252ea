//! Every byte that crosses a device boundary in ferry: autograd-aware moves, detach-before-copy,
//! moves by value, chunked moves through bounded pinned staging, asynchronous moves on a chosen
//! stream, batched moves of whole state dicts, and the report each move returns.
//!
//! Tensor ops never move data between devices; this crate is the one place that does, so that
//! "what did this move cost, and what did it record in the graph" has one answer: the
//! [`TransferReport`]. It does not own memory (ferry-memory does: buffers, pools, streams) or
//! the graph (ferry-graph); it composes them.
//!
//! Key decision: a move is an ordinary graph op (a transfer node) whose backward moves the
//! gradient back to the source device and dtype. `detach()` before a move records nothing, and
//! copies never carry `.grad`: a moved leaf's copy starts with no gradient. Whether a result is
//! ready to read is carried by types, not by convention: pinned buffers wait for their copy on
//! every read, and an asynchronous move hands out its tensor only from [`PendingTensor::wait`].
//!
//! The seven methods (see docs/transfer-methods.md):
//! [`DeviceMove::cpu`] / [`DeviceMove::to`], [`DeviceMove::to_with`] (fused dtype,
//! non_blocking), `detach()` then a move, [`DeviceMove::into_device`] /
//! [`DeviceMove::detach_into`], [`DeviceMove::to_chunked`], [`DeviceMove::to_async`], and
//! creating tensors on their device in the first place; plus [`move_state_dict`].
#![warn(missing_docs)]

mod batched;
mod chunked;
mod copy;
mod moves;
mod pending;
mod pipeline;
mod report;

pub use batched::{StateDict, move_state_dict};
pub use chunked::{ChunkPlan, ChunkSpec, pinned_block_size};
pub use moves::{DeviceMove, MoveOptions};
pub use pending::PendingTensor;
pub use report::{TransferPath, TransferReport};
