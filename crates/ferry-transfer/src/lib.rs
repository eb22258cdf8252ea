//! Every byte that crosses a device boundary in ferry: autograd-aware moves, detach-before-copy,
//! pinned, asynchronous, chunked and batched copies, and the report each move returns.
//!
//! Tensor ops never move data between devices; this crate is the one place that does, so that
//! "what did this move cost, and what did it record in the graph" has one answer.
#![warn(missing_docs)]
