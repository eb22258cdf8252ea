//! The autograd graph of ferry: backward nodes, gradient edges, the backward engine, grad mode
//! and DOT export.
//!
//! This crate owns the graph and nothing about tensors: it is generic over the gradient value
//! ([`GradValue`]), so the same engine runs on `f64` scalars in teaching examples and on tensors
//! in the runtime. Nodes are backward rules; edges run from an op's output node to the nodes of
//! its inputs and carry the input slot. Leaves that require grad have an accumulate node whose
//! gradient lands in a shared [`GradSlot`].
//!
//! The key decision is **per-node ownership with per-graph accounting**. Each node is
//! reference-counted and owns the handles of its inputs' nodes: recording an op allocates one
//! node and takes no lock shared with other graphs, and dropping the last tensor that refers to
//! a node frees it and everything only it kept alive, with the buffers their rules saved. The
//! counts (live nodes, saved bytes, recorded, pruned) belong to the connected graph a node is
//! in ([`Graph`]), behind that graph's own lock, so threads training their own models never
//! contend, and [`Graph::stats`] describes exactly the caller's graph. petgraph serves where a
//! whole graph is needed at once: planning backward and drawing. docs/architecture.md has the
//! measurements behind the choice.
//!
//! # A scalar autograd engine in a few lines
//!
//! ```
//! use std::sync::Arc;
//! use ferry_graph::{BackwardOptions, BoxError, GradSlot, Graph, InputGrads, NodeHandle, NodeMeta};
//!
//! struct Value {
//!     data: f64,
//!     node: Option<NodeHandle<f64>>,
//!     grad: Option<GradSlot<f64>>,
//! }
//!
//! fn leaf(g: &Graph, data: f64) -> Value {
//!     let grad = GradSlot::default();
//!     let node = g.leaf(NodeMeta::scalar("leaf"), grad.clone());
//!     Value { data, node: Some(node), grad: Some(grad) }
//! }
//!
//! fn op(g: &Graph, name: &'static str, data: f64, inputs: &[&Value], local: Vec<f64>) -> Value {
//!     // Chain rule: each input receives the output's gradient times its local derivative.
//!     let rule = move |grad: &f64, _wanted: &[bool]| -> Result<InputGrads<f64>, BoxError> {
//!         Ok(local.iter().map(|d| Some(grad * d)).collect())
//!     };
//!     let nodes: Vec<_> = inputs.iter().map(|v| v.node.as_ref()).collect();
//!     let node = g.record(NodeMeta::scalar(name), Arc::new(rule), &nodes);
//!     Value { data, node: Some(node), grad: None }
//! }
//!
//! let add = |g: &Graph, a: &Value, b: &Value| op(g, "add", a.data + b.data, &[a, b], vec![1.0, 1.0]);
//! let mul = |g: &Graph, a: &Value, b: &Value| op(g, "mul", a.data * b.data, &[a, b], vec![b.data, a.data]);
//! let tanh = |g: &Graph, a: &Value| {
//!     let t = a.data.tanh();
//!     op(g, "tanh", t, &[a], vec![1.0 - t * t]) // d tanh(a)/da = 1 - tanh²(a)
//! };
//!
//! let g = Graph::new();
//! let (a, b) = (leaf(&g, 2.0), leaf(&g, -3.0));
//! let c = add(&g, &mul(&g, &a, &b), &a); // c = a*b + a = -4
//! let out = tanh(&g, &c);
//! assert_eq!(g.live_nodes(), 5); // two leaves, mul (held by add's edge), add, tanh
//!
//! out.node.as_ref().unwrap().backward(1.0, BackwardOptions::default())?;
//! let dc = 1.0 - out.data * out.data;
//! let da = a.grad.as_ref().unwrap().lock().unwrap(); // d/da (a*b + a) = b + 1
//! let db = b.grad.as_ref().unwrap().lock().unwrap(); // d/db (a*b + a) = a
//! approx::assert_relative_eq!(da, dc * (-3.0 + 1.0));
//! approx::assert_relative_eq!(db, dc * 2.0);
//!
//! drop((out, c));
//! assert_eq!(g.live_nodes(), 2); // only the leaves a and b still hold nodes
//! # Ok::<(), ferry_graph::GraphError>(())
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod dot;
mod engine;
mod error;
mod graph;
mod group;
mod hooks;
mod mode;
mod node;

pub use dot::{DetachCut, dot};
pub use engine::{BackwardOptions, BackwardReport, TraceStep, backward, grad};
pub use error::{BoxError, GraphError};
pub use graph::{GradEdge, GradSlot, Graph, NodeHandle, WeakNode, pruned_on_this_thread, record};
pub use group::GraphStats;
pub use hooks::{GradHook, HookHandle, PostAccumulateHook};
pub use mode::{
    GradMode, GradModeGuard, enable_grad, inference_mode, is_grad_enabled, is_inference_mode,
    no_grad, with_no_grad,
};
pub use node::{
    Backward, BackwardContext, GradValue, InputGrads, NodeKind, NodeMeta, OffloadedSave,
    SavedBuffer, SavedBuffers,
};

#[cfg(test)]
mod tests;
