//! Debugging helpers: catch a training loop that keeps its graphs alive.
//!
//! The autograd graph frees a step's nodes, and the activations they saved, when the last
//! tensor referring to them drops. A loop that keeps such a tensor, most often
//! `total = total.add(&loss)?` to average the loss, keeps every step's graph: memory grows
//! each step until the process runs out. [`GraphWatch`] notes the size of the graph a model's
//! parameters belong to (every step's graph joins it) and [`GraphWatch::check`] reports what is
//! still alive beyond it.
//!
//! ```
//! use ferry::debug::GraphWatch;
//! use ferry::prelude::*;
//!
//! let w = Tensor::randn(&[4, 1], DType::F32, Device::Cpu)?.with_grad()?;
//! let x = Tensor::rand(&[8, 4], DType::F32, Device::Cpu)?;
//! let watch = GraphWatch::new([&w]);
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
//! A watch counts the graphs of the tensors it was given and nothing else: other threads
//! training their own models meanwhile do not disturb it.

use std::fmt;

use ferry_graph::{Graph, GraphStats};
use ferry_tensor::Tensor;

/// The size of some graphs at a point in time; [`GraphWatch::check`] compares against it.
#[derive(Debug, Clone)]
pub struct GraphWatch {
    graphs: Vec<Graph>,
    start: GraphStats,
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
    /// Notes the current size of the graphs `tensors` belong to: pass a model's parameters.
    /// Their leaves are meant to stay; everything a training step records joins their graph,
    /// so what a step leaves behind shows up there. Tensors without history are skipped.
    pub fn new<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> Self {
        let graphs: Vec<Graph> = tensors.into_iter().filter_map(Tensor::graph).collect();
        let start = Graph::stats_of(&graphs);
        Self { graphs, start }
    }

    /// What changed since [`GraphWatch::new`].
    pub fn delta(&self) -> GraphDelta {
        let now = Graph::stats_of(&self.graphs);
        GraphDelta {
            live_nodes: now.live_nodes as isize - self.start.live_nodes as isize,
            saved_bytes: now.saved_bytes as isize - self.start.saved_bytes as isize,
            recorded: now.recorded - self.start.recorded,
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
