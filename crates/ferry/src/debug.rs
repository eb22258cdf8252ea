//! Debugging helpers: catch a training loop that keeps its graphs alive.
//!
//! The autograd graph frees a step's nodes, and the activations they saved, when the last
//! tensor referring to them drops. A loop that keeps such a tensor, most often
//! `total = total.add(&loss)?` to average the loss, keeps every step's graph: memory grows
//! each step until the process runs out. [`GraphWatch`] notes the graph's size when it is
//! created and [`GraphWatch::check`] reports what is still alive beyond it.
//!
//! ```
//! use ferry::debug::GraphWatch;
//! use ferry::prelude::*;
//!
//! let w = Tensor::randn(&[4, 1], DType::F32, Device::Cpu)?.with_grad()?;
//! let x = Tensor::rand(&[8, 4], DType::F32, Device::Cpu)?;
//! let watch = GraphWatch::new();
//! let mut total = 0.0;
//! for _ in 0..3 {
//!     let loss = x.matmul(&w)?.powf(2.0)?.mean()?;
//!     loss.backward()?;
//!     total += loss.item()?; // a number: the step's graph goes when `loss` drops
//! }
//! watch.check()?; // Ok: nothing of the three steps is alive
//! # let _ = total;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The graph is shared by the whole process: a watch sees nodes that other threads create
//! meanwhile too, so check at a point where only the loop being debugged runs.

use std::fmt;

use ferry_tensor::graph;

/// The graph's size at a point in time; [`GraphWatch::check`] compares against it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphWatch {
    live_nodes: usize,
    saved_bytes: usize,
    recorded: u64,
}

/// What happened in the graph since a [`GraphWatch`] was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphDelta {
    /// Live nodes now minus live nodes then (negative when nodes were pruned).
    pub live_nodes: isize,
    /// Saved bytes now minus saved bytes then.
    pub saved_bytes: isize,
    /// Nodes recorded in between (all of them, including those since freed).
    pub recorded: u64,
}

/// Nodes or saved bytes that outlived the code between [`GraphWatch::new`] and
/// [`GraphWatch::check`]; its message says what usually causes it and how to fix it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphLeak {
    /// The change that was found.
    pub delta: GraphDelta,
}

impl GraphWatch {
    /// Notes the graph's current size (call it after creating the model and optimizer: their
    /// parameters are leaf nodes that are meant to stay).
    pub fn new() -> Self {
        let g = graph();
        Self {
            live_nodes: g.live_nodes(),
            saved_bytes: g.saved_bytes(),
            recorded: g.recorded_total(),
        }
    }

    /// What changed since [`GraphWatch::new`].
    pub fn delta(&self) -> GraphDelta {
        let g = graph();
        GraphDelta {
            live_nodes: g.live_nodes() as isize - self.live_nodes as isize,
            saved_bytes: g.saved_bytes() as isize - self.saved_bytes as isize,
            recorded: g.recorded_total() - self.recorded,
        }
    }

    /// `Ok` with the change when no more nodes and saved bytes are alive than at
    /// [`GraphWatch::new`]; a [`GraphLeak`] naming the surplus otherwise. Call it where the
    /// step's tensors have gone out of scope (after the loop body, not inside it).
    pub fn check(&self) -> Result<GraphDelta, GraphLeak> {
        let delta = self.delta();
        if delta.live_nodes > 0 || delta.saved_bytes > 0 {
            Err(GraphLeak { delta })
        } else {
            Ok(delta)
        }
    }
}

impl Default for GraphWatch {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for GraphLeak {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.delta;
        write!(
            f,
            "autograd graph leak: {} node(s) and {} saved byte(s) more are alive than when the GraphWatch was made ({} recorded since). \
             Something still holds a tensor with history: usually a running total such as `total = total.add(&loss)?`, \
             which keeps every step's graph alive. Accumulate `loss.detach()` or the number `loss.item()?` instead, \
             and keep outputs you store (predictions, metrics) detached",
            d.live_nodes.max(0),
            d.saved_bytes.max(0),
            d.recorded
        )
    }
}

impl std::error::Error for GraphLeak {}
