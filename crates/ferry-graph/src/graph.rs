//! The graph itself: a petgraph `StableGraph` of nodes and gradient edges, with
//! reference-counted pruning.

use std::fmt;
use std::sync::Arc;

use parking_lot::Mutex;
use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::visit::EdgeRef;

use crate::node::{Backward, GradValue, NodeKind, NodeMeta};

/// A gradient edge from an op's output node to the node of one of its inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GradEdge {
    /// Which input of the op this edge feeds.
    pub slot: usize,
}

/// Where a leaf's gradient accumulates; shared with the tensor that owns the leaf.
pub type GradSlot<G> = Arc<Mutex<Option<G>>>;

pub(crate) struct NodeData<G> {
    pub(crate) meta: NodeMeta,
    /// `None` for leaves, and for op nodes after a backward without `retain_graph`.
    pub(crate) backward: Option<Arc<dyn Backward<G>>>,
    pub(crate) leaf_grad: Option<GradSlot<G>>,
    pub(crate) inputs: usize,
    pub(crate) saved_bytes: usize,
    /// Handles held by tensors plus gradient edges from live nodes.
    refs: usize,
}

pub(crate) struct GraphState<G> {
    pub(crate) graph: StableDiGraph<NodeData<G>, GradEdge>,
    pub(crate) saved_bytes: usize,
    pub(crate) recorded_total: u64,
}

/// An autograd graph; cheap to clone (all clones are the same graph).
///
/// A node lives while a [`NodeHandle`] or a live downstream node refers to it. When the last
/// reference goes, the node leaves the graph with everything only it kept alive, and the
/// buffers its backward rule saved are freed.
pub struct Graph<G> {
    pub(crate) state: Arc<Mutex<GraphState<G>>>,
}

impl<G> Clone for Graph<G> {
    fn clone(&self) -> Self {
        Self {
            state: Arc::clone(&self.state),
        }
    }
}

impl<G: GradValue> Default for Graph<G> {
    fn default() -> Self {
        Self::new()
    }
}

impl<G> fmt::Debug for Graph<G> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state.lock();
        f.debug_struct("Graph")
            .field("live_nodes", &state.graph.node_count())
            .field("saved_bytes", &state.saved_bytes)
            .finish()
    }
}

impl<G: GradValue> Graph<G> {
    /// An empty graph.
    pub fn new() -> Self {
        Self {
            state: Arc::new(Mutex::new(GraphState {
                graph: StableDiGraph::default(),
                saved_bytes: 0,
                recorded_total: 0,
            })),
        }
    }

    /// Records an op node with a gradient edge to each input that requires grad.
    ///
    /// `inputs[i]` is the node of input `i`, or `None` when that input needs no gradient.
    pub fn record(
        &self,
        meta: NodeMeta,
        backward: Arc<dyn Backward<G>>,
        inputs: &[Option<&NodeHandle<G>>],
    ) -> NodeHandle<G> {
        let saved_bytes = backward.saved_bytes();
        let mut state = self.state.lock();
        let node = state.graph.add_node(NodeData {
            meta,
            backward: Some(backward),
            leaf_grad: None,
            inputs: inputs.len(),
            saved_bytes,
            refs: 1,
        });
        for (slot, input) in inputs.iter().enumerate() {
            if let Some(input) = input {
                debug_assert!(
                    Arc::ptr_eq(&input.graph.state, &self.state),
                    "an input node belongs to another graph"
                );
                state.graph.add_edge(node, input.index, GradEdge { slot });
                state.graph[input.index].refs += 1;
            }
        }
        state.saved_bytes += saved_bytes;
        state.recorded_total += 1;
        self.handle(node)
    }

    /// Records a leaf whose gradients accumulate into `grad`.
    pub fn leaf(&self, meta: NodeMeta, grad: GradSlot<G>) -> NodeHandle<G> {
        let mut state = self.state.lock();
        let node = state.graph.add_node(NodeData {
            meta: meta.into_leaf(),
            backward: None,
            leaf_grad: Some(grad),
            inputs: 0,
            saved_bytes: 0,
            refs: 1,
        });
        state.recorded_total += 1;
        self.handle(node)
    }

    fn handle(&self, index: NodeIndex) -> NodeHandle<G> {
        NodeHandle {
            graph: self.clone(),
            index,
        }
    }

    /// Number of nodes alive in the graph.
    pub fn live_nodes(&self) -> usize {
        self.state.lock().graph.node_count()
    }

    /// Bytes saved for backward by all live nodes.
    pub fn saved_bytes(&self) -> usize {
        self.state.lock().saved_bytes
    }

    /// Nodes recorded since the graph was made, pruned ones included.
    pub fn recorded_total(&self) -> u64 {
        self.state.lock().recorded_total
    }

    /// Drops one reference to `index`, removing it and whatever only it kept alive.
    fn release(&self, index: NodeIndex) {
        // Removed nodes are dropped after the lock is released: their saved values may own
        // handles of their own, whose drop takes this lock again.
        let mut removed = Vec::new();
        {
            let mut state = self.state.lock();
            let mut pending = vec![index];
            while let Some(node) = pending.pop() {
                let data = &mut state.graph[node];
                data.refs -= 1;
                if data.refs > 0 {
                    continue;
                }
                pending.extend(state.graph.edges(node).map(|e| e.target()));
                let data = state
                    .graph
                    .remove_node(node)
                    .expect("a node with references is in the graph");
                state.saved_bytes -= data.saved_bytes;
                removed.push(data);
            }
        }
        drop(removed);
    }
}

/// A counted reference to a node; the node lives at least as long as its handles.
pub struct NodeHandle<G: GradValue> {
    pub(crate) graph: Graph<G>,
    pub(crate) index: NodeIndex,
}

impl<G: GradValue> NodeHandle<G> {
    /// The graph this node lives in.
    pub fn graph(&self) -> &Graph<G> {
        &self.graph
    }

    /// The node's index, stable for as long as the node lives.
    pub fn index(&self) -> NodeIndex {
        self.index
    }

    /// A copy of the node's description.
    pub fn meta(&self) -> NodeMeta {
        self.graph.state.lock().graph[self.index].meta.clone()
    }

    /// Whether this is a leaf's accumulate node.
    pub fn is_leaf(&self) -> bool {
        self.graph.state.lock().graph[self.index].meta.kind == NodeKind::Leaf
    }

    /// Whether the node is the same node as `other`.
    pub fn same_node(&self, other: &Self) -> bool {
        self.index == other.index && Arc::ptr_eq(&self.graph.state, &other.graph.state)
    }
}

impl<G: GradValue> Clone for NodeHandle<G> {
    fn clone(&self) -> Self {
        self.graph.state.lock().graph[self.index].refs += 1;
        Self {
            graph: self.graph.clone(),
            index: self.index,
        }
    }
}

impl<G: GradValue> Drop for NodeHandle<G> {
    fn drop(&mut self) {
        self.graph.release(self.index);
    }
}

impl<G: GradValue> fmt::Debug for NodeHandle<G> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeHandle")
            .field("index", &self.index.index())
            .field("op", &self.meta().op)
            .finish()
    }
}

// Nodes carry `Arc<dyn Backward<G>>`, which is `Send + Sync` by the trait's bounds.
#[allow(dead_code)]
fn assert_send_sync() {
    fn is<T: Send + Sync>() {}
    is::<Graph<f64>>();
    is::<NodeHandle<f64>>();
}

impl<G> NodeData<G> {
    pub(crate) fn is_leaf(&self) -> bool {
        self.meta.kind == NodeKind::Leaf
    }
}
