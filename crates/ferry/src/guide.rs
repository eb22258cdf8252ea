//! The guide (docs/guide/) as doctests: every Rust block in every chapter compiles and runs
//! under `cargo test --doc`, so the guide cannot drift from the code it teaches.

/// The guide's index: it has no Rust blocks, but its text blocks must stay text.
#[doc = include_str!("../../../docs/guide/README.md")]
pub struct Contents;

/// Chapter 1: a scalar autograd engine on ferry-graph with `f64`.
#[doc = include_str!("../../../docs/guide/01-scalar-engine.md")]
pub struct ScalarEngine;

/// Chapter 2: tensors, broadcasting and their gradients.
#[doc = include_str!("../../../docs/guide/02-tensors-and-broadcasting.md")]
pub struct TensorsAndBroadcasting;

/// Chapter 3: what a device move records, and why its gradient goes home.
#[doc = include_str!("../../../docs/guide/03-device-moves.md")]
pub struct DeviceMoves;

/// Chapter 4: detach, no_grad and pruning, with live-node counts.
#[doc = include_str!("../../../docs/guide/04-detach-no-grad-pruning.md")]
pub struct DetachNoGradPruning;

/// Chapter 5: leaks, and how the debug helper finds them.
#[doc = include_str!("../../../docs/guide/05-leaks.md")]
pub struct Leaks;

/// Chapter 6: gradcheck.
#[doc = include_str!("../../../docs/guide/06-gradcheck.md")]
pub struct Gradcheck;

/// Chapter 7: higher-order gradients, hooks and in-place safety.
#[doc = include_str!("../../../docs/guide/07-higher-order-hooks-inplace.md")]
pub struct HigherOrderHooksInPlace;
