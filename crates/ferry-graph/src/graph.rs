//! Nodes and their ownership: each node is reference-counted and owns its gradient edges (the
//! handles of its inputs' nodes), so recording an op or dropping a tensor takes no lock shared
//! with other graphs. A node lives while a [`NodeHandle`] (held by a tensor, or by a downstream
//! node's edge) refers to it; the last handle to go frees it, and with it every upstream node
//! only it kept alive.

use std::cell::Cell;
use std::fmt;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use smallvec::SmallVec;

use crate::group::{GraphStats, Group};
use crate::hooks::Hooks;
use crate::node::{Backward, GradValue, NodeKind, NodeMeta, SavedBuffers};

/// Where a leaf's gradient accumulates; shared with the tensor that owns the leaf.
pub type GradSlot<G> = Arc<Mutex<Option<G>>>;

/// A gradient edge from an op's output node to the node of one of its inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GradEdge {
    /// Which input of the op this edge feeds.
    pub slot: usize,
}

/// A node's rule and what it saved, until backward frees them.
pub(crate) enum RuleSlot<G: GradValue> {
    /// Leaves have no rule: gradients reaching them accumulate.
    Leaf,
    /// The rule, with the buffers it keeps alive (as counted by the graph).
    Ready(Arc<dyn Backward<G>>, SavedBuffers),
    /// A backward without `retain_graph` ran the rule and freed what it saved.
    Freed,
}

pub(crate) struct Node<G: GradValue> {
    pub(crate) meta: NodeMeta,
    /// Per input slot, the node of that input (`None` when the input needs no gradient).
    pub(crate) edges: SmallVec<[Option<NodeHandle<G>>; 2]>,
    pub(crate) rule: Mutex<RuleSlot<G>>,
    pub(crate) leaf_grad: Option<GradSlot<G>>,
    pub(crate) hooks: Mutex<Hooks<G>>,
    pub(crate) group: Arc<Group>,
    /// Recording order on the recording thread: backward runs later nodes first, as PyTorch
    /// does, so a node's saved buffers go as early as the order allows.
    pub(crate) seq: u64,
}

thread_local! {
    static SEQ: Cell<u64> = const { Cell::new(0) };
    static PRUNED_HERE: Cell<u64> = const { Cell::new(0) };
}

fn next_seq() -> u64 {
    SEQ.with(|s| {
        let n = s.get() + 1;
        s.set(n);
        n
    })
}

/// Nodes this thread has freed so far. The difference across a call that drops tensors is
/// exactly the nodes that call pruned, whatever other threads do meanwhile.
pub fn pruned_on_this_thread() -> u64 {
    PRUNED_HERE.try_with(Cell::get).unwrap_or(0)
}

impl<G: GradValue> Drop for Node<G> {
    fn drop(&mut self) {
        // Saved buffers leave the count before they are freed, so their addresses cannot be
        // reused (and counted) by another node in between.
        let saved = match std::mem::replace(self.rule.get_mut(), RuleSlot::Freed) {
            RuleSlot::Ready(rule, saved) => Some((rule, saved)),
            RuleSlot::Leaf | RuleSlot::Freed => None,
        };
        let released = saved.as_ref().map(|(_, s)| s.as_slice()).unwrap_or(&[]);
        self.group.with_state(|s| s.node_pruned(released));
        drop(saved);
        let _ = PRUNED_HERE.try_with(|c| c.set(c.get() + 1));
        // Free the chain upstream iteratively: a recursive drop of a long chain would overflow
        // the stack. A node whose last handle is on the stack is taken apart here.
        let mut pending: SmallVec<[NodeHandle<G>; 8]> = std::mem::take(&mut self.edges)
            .into_iter()
            .flatten()
            .collect();
        while let Some(mut handle) = pending.pop() {
            // The last handle: take the node's edges here, so its own drop finds none.
            if let Some(node) = Arc::get_mut(&mut handle.0) {
                pending.extend(std::mem::take(&mut node.edges).into_iter().flatten());
            }
            drop(handle);
        }
    }
}

/// A counted reference to a node; the node lives at least as long as its handles.
pub struct NodeHandle<G: GradValue>(pub(crate) Arc<Node<G>>);

/// A reference to a node that does not keep it alive (hook handles, drawings).
pub struct WeakNode<G: GradValue>(pub(crate) Weak<Node<G>>);

impl<G: GradValue> WeakNode<G> {
    /// The node, if it is still alive.
    pub fn upgrade(&self) -> Option<NodeHandle<G>> {
        self.0.upgrade().map(NodeHandle)
    }
}

impl<G: GradValue> Clone for WeakNode<G> {
    fn clone(&self) -> Self {
        Self(Weak::clone(&self.0))
    }
}

/// An autograd graph: the nodes connected to one another by gradient edges, and their counts.
///
/// Graphs are made implicitly: a leaf starts one, an op joins its inputs' graph, and an op on
/// inputs from two graphs merges them. A `Graph` value is a handle for reading the counts
/// ([`Graph::stats`]); cheap to clone. Independent graphs share no lock.
#[derive(Clone)]
pub struct Graph {
    pub(crate) group: Arc<Group>,
}

impl Default for Graph {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let stats = self.stats();
        f.debug_struct("Graph")
            .field("live_nodes", &stats.live_nodes)
            .field("saved_bytes", &stats.saved_bytes)
            .finish()
    }
}

impl Graph {
    /// A new, empty graph.
    pub fn new() -> Self {
        Self {
            group: Group::new(),
        }
    }

    /// Records a leaf of this graph whose gradients accumulate into `grad`.
    pub fn leaf<G: GradValue>(&self, meta: NodeMeta, grad: GradSlot<G>) -> NodeHandle<G> {
        let group = Arc::clone(self.group.root());
        group.with_state(|s| s.node_recorded(&[]));
        NodeHandle(Arc::new(Node {
            meta: meta.into_leaf(),
            edges: SmallVec::new(),
            rule: Mutex::new(RuleSlot::Leaf),
            leaf_grad: Some(grad),
            hooks: Mutex::new(Hooks::default()),
            group,
            seq: next_seq(),
        }))
    }

    /// Records an op node in this graph, merged with the graphs of its inputs, with a gradient
    /// edge to each input that requires grad (`inputs[i]` is the node of input `i`, or `None`).
    pub fn record<G: GradValue>(
        &self,
        meta: NodeMeta,
        backward: Arc<dyn Backward<G>>,
        inputs: &[Option<&NodeHandle<G>>],
    ) -> NodeHandle<G> {
        record_in(Some(&self.group), meta, backward, inputs)
    }

    /// Counts of this graph (of everything merged with it).
    pub fn stats(&self) -> GraphStats {
        self.group.stats()
    }

    /// Number of nodes alive in the graph.
    pub fn live_nodes(&self) -> usize {
        self.stats().live_nodes
    }

    /// Bytes saved for backward by the graph's live nodes, each buffer counted once.
    pub fn saved_bytes(&self) -> usize {
        self.stats().saved_bytes
    }

    /// Of [`Graph::saved_bytes`], the buffers whose keys are among `keys` (for tensors, their
    /// storages' addresses): what the graph's live nodes save of those buffers now, each counted
    /// once. A model's parameters, say, which its rules save but which stay alive without them.
    pub fn saved_bytes_of(&self, keys: &[usize]) -> usize {
        self.group.held_bytes(keys)
    }

    /// Nodes recorded in the graph since it began, pruned ones included.
    pub fn recorded_total(&self) -> u64 {
        self.stats().recorded
    }

    /// Nodes pruned from the graph since it began.
    pub fn pruned_total(&self) -> u64 {
        self.stats().pruned
    }

    /// Whether `self` and `other` are (by now) the same graph.
    pub fn same_graph(&self, other: &Graph) -> bool {
        Arc::ptr_eq(self.group.root(), other.group.root())
    }

    /// The counts of the distinct graphs among `graphs`, added up (a graph reached through
    /// several handles counts once).
    pub fn stats_of(graphs: &[Graph]) -> GraphStats {
        let mut roots: SmallVec<[Arc<Group>; 8]> = SmallVec::new();
        for g in graphs {
            let root = g.group.root();
            if !roots.iter().any(|r| Arc::ptr_eq(r, root)) {
                roots.push(Arc::clone(root));
            }
        }
        let mut total = GraphStats::default();
        for root in &roots {
            total.add(&root.stats());
        }
        total
    }
}

/// Records an op node in the graph of its inputs (a new graph when none has a node).
pub fn record<G: GradValue>(
    meta: NodeMeta,
    backward: Arc<dyn Backward<G>>,
    inputs: &[Option<&NodeHandle<G>>],
) -> NodeHandle<G> {
    record_in(None, meta, backward, inputs)
}

fn record_in<G: GradValue>(
    graph: Option<&Arc<Group>>,
    meta: NodeMeta,
    backward: Arc<dyn Backward<G>>,
    inputs: &[Option<&NodeHandle<G>>],
) -> NodeHandle<G> {
    let mut group: Option<Arc<Group>> = graph.map(|g| Arc::clone(g.root()));
    for input in inputs.iter().flatten() {
        let theirs = input.0.group.root();
        group = Some(match group {
            None => Arc::clone(theirs),
            Some(ours) if Arc::ptr_eq(&ours, theirs) => ours,
            Some(ours) => ours.merge(theirs),
        });
    }
    let group = group.unwrap_or_default();
    let saved = backward.saved();
    group.with_state(|s| s.node_recorded(&saved));
    NodeHandle(Arc::new(Node {
        meta,
        edges: inputs.iter().map(|i| i.cloned()).collect(),
        rule: Mutex::new(RuleSlot::Ready(backward, saved)),
        leaf_grad: None,
        hooks: Mutex::new(Hooks::default()),
        group,
        seq: next_seq(),
    }))
}

impl<G: GradValue> NodeHandle<G> {
    /// The graph this node belongs to.
    pub fn graph(&self) -> Graph {
        Graph {
            group: Arc::clone(self.0.group.root()),
        }
    }

    /// The node's description.
    pub fn meta(&self) -> &NodeMeta {
        &self.0.meta
    }

    /// Whether this is a leaf's accumulate node.
    pub fn is_leaf(&self) -> bool {
        self.0.meta.kind == NodeKind::Leaf
    }

    /// Whether the node is the same node as `other`.
    pub fn same_node(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// The node of each input slot (`None` for inputs that need no gradient).
    pub fn inputs(&self) -> impl DoubleEndedIterator<Item = Option<&NodeHandle<G>>> {
        self.0.edges.iter().map(Option::as_ref)
    }

    /// Bytes the node's rule keeps alive right now (0 for leaves and once freed).
    pub fn saved_bytes(&self) -> usize {
        match &*self.0.rule.lock() {
            RuleSlot::Ready(_, saved) => saved.iter().map(|b| b.bytes).sum(),
            RuleSlot::Leaf | RuleSlot::Freed => 0,
        }
    }

    /// Whether a backward without `retain_graph` has freed this node's saved buffers.
    pub fn is_freed(&self) -> bool {
        matches!(&*self.0.rule.lock(), RuleSlot::Freed)
    }

    /// A reference that does not keep the node alive.
    pub fn downgrade(&self) -> WeakNode<G> {
        WeakNode(Arc::downgrade(&self.0))
    }

    pub(crate) fn key(&self) -> usize {
        Arc::as_ptr(&self.0) as *const () as usize
    }
}

impl<G: GradValue> Clone for NodeHandle<G> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<G: GradValue> fmt::Debug for NodeHandle<G> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeHandle")
            .field("op", &self.0.meta.op)
            .field("shape", &self.0.meta.shape)
            .finish()
    }
}

// Nodes carry `Arc<dyn Backward<G>>`, which is `Send + Sync` by the trait's bounds.
#[allow(dead_code)]
fn assert_send_sync() {
    fn is<T: Send + Sync>() {}
    is::<Graph>();
    is::<NodeHandle<f64>>();
    is::<WeakNode<f64>>();
}
