//! The backward engine. It plans on a petgraph of what the roots reach (only what leads to the
//! asked-for inputs, for [`grad`]), then runs nodes in dependency order, latest-recorded first,
//! freeing each node's saved buffers as soon as its rule has run unless the graph is retained.
//! A leaf accumulates as soon as its gradient is complete, ahead of every rule: its hooks (a
//! bucket's all-reduce, a gradient's copy to the host) start while backward goes on.

use std::cell::RefCell;
use std::collections::{BinaryHeap, HashMap};
use std::hash::BuildHasherDefault;

use petgraph::Direction;
use petgraph::graph::{DiGraph, NodeIndex};
use petgraph::visit::EdgeRef;
use smallvec::SmallVec;

use crate::GraphError;
use crate::graph::{NodeHandle, RuleSlot};
use crate::group::AddressHasher;
use crate::mode::{enable_grad, no_grad};
use crate::node::{BackwardContext, GradValue, NodeMeta, OffloadedSave, PendingInputs};

/// How to run backward.
#[derive(Debug, Clone, Copy, Default)]
pub struct BackwardOptions {
    /// Keep saved buffers so backward can run through this graph again.
    pub retain_graph: bool,
    /// Record the backward's own ops, so the gradients it returns have history and can be
    /// differentiated again (higher-order gradients). Implies nothing about `retain_graph`.
    pub create_graph: bool,
    /// Record a [`TraceStep`] for every node visited.
    pub trace: bool,
}

/// One node visited by a traced backward.
#[derive(Debug, Clone)]
pub struct TraceStep {
    /// The node's description.
    pub meta: NodeMeta,
    /// The gradient the node received (after its hooks), described by
    /// [`GradValue::describe`].
    pub received: String,
    /// What the node passed on: `(input slot, gradient)` for each input that wanted one.
    pub passed: Vec<(usize, String)>,
    /// The hooks that ran at this node, in order, and what each did.
    pub hooks: Vec<String>,
}

/// What a backward did.
#[derive(Debug, Clone, Default)]
pub struct BackwardReport {
    /// Nodes visited, leaves included.
    pub visited: usize,
    /// Leaves whose gradient was accumulated.
    pub leaves_reached: usize,
    /// Bytes of saved buffers released as their nodes ran (0 with `retain_graph`).
    pub freed_bytes: usize,
    /// The visit in order, when [`BackwardOptions::trace`] was set.
    pub trace: Vec<TraceStep>,
}

impl<G: GradValue> NodeHandle<G> {
    /// Runs backward from this node with `grad` as the gradient of its output, accumulating
    /// into the leaves it reaches.
    pub fn backward(
        &self,
        grad: G,
        options: BackwardOptions,
    ) -> Result<BackwardReport, GraphError> {
        backward(&[(self, grad)], options)
    }
}

/// Runs backward from several roots at once (each with the gradient of its output),
/// accumulating into every leaf they reach.
pub fn backward<G: GradValue>(
    roots: &[(&NodeHandle<G>, G)],
    options: BackwardOptions,
) -> Result<BackwardReport, GraphError> {
    Ok(Run::new(roots, None, options)?.execute()?.1)
}

/// The gradients of the roots with respect to `inputs` (any nodes: leaves or intermediate),
/// returned instead of accumulated: no leaf's `.grad` changes. Only the nodes on paths from
/// the roots to the inputs run. An input no path reaches gets `None`.
pub fn grad<G: GradValue>(
    roots: &[(&NodeHandle<G>, G)],
    inputs: &[&NodeHandle<G>],
    options: BackwardOptions,
) -> Result<(Vec<Option<G>>, BackwardReport), GraphError> {
    Run::new(roots, Some(inputs), options)?.execute()
}

/// A planned backward: the reached subgraph, which nodes must run, and the gradients so far.
struct Run<G: GradValue> {
    graph: DiGraph<NodeHandle<G>, usize>,
    /// Whether a node's gradient is needed: it reaches a target (everything, in backward).
    needed: Vec<bool>,
    /// Edges from needed nodes not yet run.
    waiting: Vec<usize>,
    grads: Vec<Option<G>>,
    /// For [`grad`]: each input's node index, and what it received.
    targets: Option<Vec<NodeIndex>>,
    options: BackwardOptions,
}

/// Ready nodes: leaves first, then latest recorded first.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Ready {
    seq: u64,
    index: NodeIndex,
}

impl Ready {
    fn of<G: GradValue>(graph: &DiGraph<NodeHandle<G>, usize>, index: NodeIndex) -> Self {
        let node = &graph[index].0;
        // A leaf's accumulation ends its gradient's journey: nothing waits behind it, and
        // its post-accumulate hooks should start at once, not after every rule recorded later
        // than the leaf was made (all of them).
        let seq = if node.leaf_grad.is_some() {
            u64::MAX
        } else {
            node.seq
        };
        Self { seq, index }
    }
}

impl<G: GradValue> Run<G> {
    fn new(
        roots: &[(&NodeHandle<G>, G)],
        targets: Option<&[&NodeHandle<G>]>,
        options: BackwardOptions,
    ) -> Result<Self, GraphError> {
        let mut graph: DiGraph<NodeHandle<G>, usize> = DiGraph::with_capacity(16, 16);
        let mut index: HashMap<usize, NodeIndex, BuildHasherDefault<AddressHasher>> =
            HashMap::with_capacity_and_hasher(16, BuildHasherDefault::default());
        let mut stack = Vec::with_capacity(16);
        let mut add = |graph: &mut DiGraph<NodeHandle<G>, usize>,
                       stack: &mut Vec<NodeIndex>,
                       node: &NodeHandle<G>| {
            *index.entry(node.key()).or_insert_with(|| {
                let i = graph.add_node(node.clone());
                stack.push(i);
                i
            })
        };
        for (root, _) in roots {
            add(&mut graph, &mut stack, root);
        }
        while let Some(i) = stack.pop() {
            let node = graph[i].clone();
            for (slot, input) in node.0.edges.iter().enumerate() {
                if let Some(input) = input {
                    let j = add(&mut graph, &mut stack, input);
                    graph.add_edge(i, j, slot);
                }
            }
        }
        let targets = targets.map(|inputs| {
            inputs
                .iter()
                .map(|t| index.get(&t.key()).copied().unwrap_or(NodeIndex::end()))
                .collect::<Vec<_>>()
        });
        let needed = match &targets {
            None => vec![true; graph.node_count()],
            Some(targets) => needed_for(&graph, targets),
        };
        let mut waiting = vec![0; graph.node_count()];
        for edge in graph.edge_references() {
            if needed[edge.source().index()] && needed[edge.target().index()] {
                waiting[edge.target().index()] += 1;
            }
        }
        let mut grads: Vec<Option<G>> = vec![None; graph.node_count()];
        for (root, g) in roots {
            let i = index[&root.key()].index();
            accumulate(&mut grads[i], g.clone(), root.0.meta.op)?;
        }
        Ok(Self {
            graph,
            needed,
            waiting,
            grads,
            targets,
            options,
        })
    }

    fn execute(mut self) -> Result<(Vec<Option<G>>, BackwardReport), GraphError> {
        let _mode = if self.options.create_graph {
            enable_grad()
        } else {
            no_grad()
        };
        let mut report = BackwardReport::default();
        let mut captured: Vec<Option<G>> = vec![None; self.targets.as_ref().map_or(0, Vec::len)];
        let mut ready: BinaryHeap<Ready> = self
            .graph
            .node_indices()
            .filter(|i| self.needed[i.index()] && self.waiting[i.index()] == 0)
            .map(|index| Ready::of(&self.graph, index))
            .collect();
        // Only while some saved buffer is off its device: one atomic read otherwise.
        let mut prefetch = (OffloadedSave::live() > 0).then(|| Prefetch::plan(&self));
        while let Some(Ready { index, .. }) = ready.pop() {
            if let Some(prefetch) = &mut prefetch {
                prefetch.ahead(&self.graph, index);
            }
            let mut passed = match self.grads[index.index()].take() {
                Some(grad) => self.visit(index, grad, &mut captured, &mut report)?,
                None => SmallVec::new(), // every path into this node carried no gradient
            };
            let edges: SmallVec<[(NodeIndex, usize); 2]> = self
                .graph
                .edges(index)
                .map(|e| (e.target(), *e.weight()))
                .collect();
            for (target, slot) in edges {
                if !self.needed[target.index()] {
                    continue;
                }
                // mul(x, x) has two edges to x: each takes the gradient of its own slot.
                let grad = passed
                    .iter()
                    .position(|(s, _)| *s == slot)
                    .map(|k| passed.swap_remove(k).1);
                if let Some(grad) = grad {
                    let op = self.graph[index].0.meta.op;
                    accumulate(&mut self.grads[target.index()], grad, op)?;
                }
                self.waiting[target.index()] -= 1;
                if self.waiting[target.index()] == 0 {
                    ready.push(Ready::of(&self.graph, target));
                }
            }
        }
        Ok((captured, report))
    }

    /// Runs one node on its total gradient; returns `(slot, gradient)` for its needed inputs.
    fn visit(
        &mut self,
        index: NodeIndex,
        grad: G,
        captured: &mut [Option<G>],
        report: &mut BackwardReport,
    ) -> Result<SmallVec<[(usize, G); 2]>, GraphError> {
        let handle = self.graph[index].clone();
        let node = &handle.0;
        let op = node.meta.op;
        report.visited += 1;
        let mut hook_notes = Vec::new();
        let grad = run_hooks(&handle, grad, self.options.trace, &mut hook_notes)?;
        let mut step = self.options.trace.then(|| TraceStep {
            meta: node.meta.clone(),
            received: grad.describe(),
            passed: Vec::new(),
            hooks: hook_notes,
        });
        if let Some(targets) = &self.targets {
            for (k, t) in targets.iter().enumerate() {
                if *t == index {
                    captured[k] = Some(grad.clone());
                }
            }
        }
        let mut out = SmallVec::new();
        if let Some(slot) = &node.leaf_grad {
            if self.targets.is_none() {
                let total = {
                    let mut slot = slot.lock();
                    keep(&mut slot, grad, op)?;
                    slot.clone().expect("just accumulated")
                };
                report.leaves_reached += 1;
                let hooks: Vec<_> = node
                    .hooks
                    .lock()
                    .post_accumulate
                    .iter()
                    .map(|(_, h)| h.clone())
                    .collect();
                for hook in hooks {
                    hook(&total).map_err(|source| GraphError::Hook { op, source })?;
                    if let Some(step) = &mut step {
                        step.hooks.push("post-accumulate hook ran".into());
                    }
                }
            }
        } else {
            // The inputs the rule is asked for: by slot, and with their nodes, whose gradients
            // so far the rule may add into (`BackwardContext::with_accumulated`).
            let mut wanted: SmallVec<[bool; 4]> = SmallVec::from_elem(false, node.edges.len());
            let mut inputs = SmallVec::new();
            for edge in self.graph.edges(index) {
                if self.needed[edge.target().index()] {
                    wanted[*edge.weight()] = true;
                    inputs.push((*edge.weight(), edge.target().index()));
                }
            }
            if !inputs.is_empty() {
                // The gradients are lent to the rule for the call.
                let grads = RefCell::new(std::mem::take(&mut self.grads));
                let pending = PendingInputs {
                    grads: &grads,
                    inputs,
                };
                let ran = self.run_rule(&handle, &grad, &wanted, report, pending);
                self.grads = grads.into_inner();
                out = ran?;
                if let Some(step) = &mut step {
                    step.passed = out.iter().map(|(s, g)| (*s, g.describe())).collect();
                    step.passed.sort_by_key(|(s, _)| *s);
                }
            }
        }
        report.trace.extend(step);
        Ok(out)
    }

    fn run_rule(
        &self,
        handle: &NodeHandle<G>,
        grad: &G,
        wanted: &[bool],
        report: &mut BackwardReport,
        pending: PendingInputs<'_, G>,
    ) -> Result<SmallVec<[(usize, G); 2]>, GraphError> {
        let node = &handle.0;
        let op = node.meta.op;
        // Without retain_graph the rule leaves the node now, and what it saved goes when it
        // has run: peak memory in backward is not every saved buffer at once.
        let rule = {
            let mut slot = node.rule.lock();
            match &*slot {
                RuleSlot::Leaf => unreachable!("leaves have no rule"),
                RuleSlot::Freed => return Err(GraphError::BuffersFreed { op }),
                // A rule that saved nothing keeps only shapes and scalars: it stays, so a second
                // backward through it works, as in PyTorch.
                RuleSlot::Ready(rule, saved) if self.options.retain_graph || saved.is_empty() => {
                    rule.clone()
                }
                RuleSlot::Ready(..) => {
                    let RuleSlot::Ready(rule, saved) =
                        std::mem::replace(&mut *slot, RuleSlot::Freed)
                    else {
                        unreachable!()
                    };
                    node.group.with_state(|s| s.release(&saved));
                    report.freed_bytes += saved.iter().map(|b| b.bytes).sum::<usize>();
                    rule
                }
            }
        };
        let ctx = BackwardContext {
            node: handle,
            create_graph: self.options.create_graph,
            pending,
        };
        let grads = rule
            .backward(&ctx, grad, wanted)
            .map_err(|source| GraphError::Backward { op, source })?;
        drop(rule);
        if grads.len() != node.edges.len() {
            return Err(GraphError::GradientArity {
                op,
                expected: node.edges.len(),
                got: grads.len(),
            });
        }
        Ok(grads
            .into_iter()
            .enumerate()
            .filter_map(|(slot, g)| Some((slot, g?)).filter(|_| wanted[slot]))
            .collect())
    }
}

/// How far ahead of the one running backward asks rules to bring back what they saved off the
/// device: at least the next two nodes, and on while the buffers brought back ahead of their
/// turn hold less than the largest one brought back so far (at most [`PREFETCH_BYTES`]). Where
/// buffers are alike (a stack of layers) that is the two nodes; where small ones sit between
/// large ones (a transformer block's norms and projections beside its attention), the window
/// reaches past the small ones, so the link has work queued across ops of every size, and the
/// device holds at most that window (plus one node's buffers) before their turn.
pub(crate) const PREFETCH_NODES: usize = 2;

/// The bytes of the prefetch window (see [`PREFETCH_NODES`]).
pub(crate) const PREFETCH_BYTES: usize = 256 << 20;

/// The order backward will run the rules in, for prefetching. The engine runs the ready node
/// recorded last; every node's consumers were recorded after it, so that is simply the needed
/// rule nodes by recording order, latest first (on one recording thread; with several it is
/// still a valid order, and a prefetch out of order only costs overlap, never correctness).
struct Prefetch {
    order: Vec<NodeIndex>,
    /// Position of each node in `order` (`usize::MAX` for leaves and unneeded nodes).
    position: Vec<usize>,
    /// First position not asked to prefetch yet.
    next: usize,
    /// Positions not run yet whose prefetch brought bytes back, with those bytes.
    window: std::collections::VecDeque<(usize, usize)>,
    /// Their sum.
    window_bytes: usize,
    /// The most one prefetch brought back so far: the window's size, up to [`PREFETCH_BYTES`].
    largest: usize,
}

impl Prefetch {
    fn plan<G: GradValue>(run: &Run<G>) -> Self {
        let mut order: Vec<NodeIndex> = run
            .graph
            .node_indices()
            .filter(|i| run.needed[i.index()] && run.graph[*i].0.leaf_grad.is_none())
            .collect();
        order.sort_unstable_by_key(|i| std::cmp::Reverse(run.graph[*i].0.seq));
        let mut position = vec![usize::MAX; run.graph.node_count()];
        for (k, i) in order.iter().enumerate() {
            position[i.index()] = k;
        }
        Self {
            order,
            position,
            next: 0,
            window: Default::default(),
            window_bytes: 0,
            largest: 0,
        }
    }

    /// `index` is about to run: ask it, then the nodes after it, to bring their saved buffers
    /// back, each once: at least [`PREFETCH_NODES`] of them, and on while the window holds
    /// less than the largest buffer so far, up to [`PREFETCH_BYTES`].
    fn ahead<G: GradValue>(&mut self, graph: &DiGraph<NodeHandle<G>, usize>, index: NodeIndex) {
        let at = self.position[index.index()];
        if at == usize::MAX {
            return;
        }
        // What this node (and any before it) brought back is in use now, not ahead.
        while let Some(&(k, bytes)) = self.window.front() {
            if k > at {
                break;
            }
            self.window.pop_front();
            self.window_bytes -= bytes;
        }
        let mut k = self.next.max(at);
        while k < self.order.len()
            && (k <= at + PREFETCH_NODES || self.window_bytes < self.largest.min(PREFETCH_BYTES))
        {
            let rule = match &*graph[self.order[k]].0.rule.lock() {
                RuleSlot::Ready(rule, saved) if !saved.is_empty() => Some(rule.clone()),
                _ => None,
            };
            let bytes = rule.map_or(0, |rule| rule.prefetch());
            self.largest = self.largest.max(bytes);
            if bytes > 0 && k > at {
                self.window.push_back((k, bytes));
                self.window_bytes += bytes;
            }
            k += 1;
        }
        self.next = self.next.max(k);
    }
}

/// Nodes from which a target can be reached (targets included).
fn needed_for<G>(graph: &DiGraph<G, usize>, targets: &[NodeIndex]) -> Vec<bool> {
    let mut needed = vec![false; graph.node_count()];
    let mut stack: Vec<NodeIndex> = targets
        .iter()
        .copied()
        .filter(|t| t.index() < graph.node_count())
        .collect();
    while let Some(i) = stack.pop() {
        if std::mem::replace(&mut needed[i.index()], true) {
            continue;
        }
        stack.extend(graph.neighbors_directed(i, Direction::Incoming));
    }
    needed
}

fn run_hooks<G: GradValue>(
    handle: &NodeHandle<G>,
    mut grad: G,
    trace: bool,
    notes: &mut Vec<String>,
) -> Result<G, GraphError> {
    let op = handle.0.meta.op;
    let (hooks, retained) = {
        let hooks = handle.0.hooks.lock();
        if hooks.is_empty() {
            return Ok(grad);
        }
        let list: SmallVec<[_; 2]> = hooks.grad.iter().map(|(_, h)| h.clone()).collect();
        (list, hooks.retained.clone())
    };
    for hook in hooks {
        match hook(&grad).map_err(|source| GraphError::Hook { op, source })? {
            Some(replaced) => {
                if trace {
                    notes.push(format!(
                        "hook replaced the gradient with {}",
                        replaced.describe()
                    ));
                }
                grad = replaced;
            }
            None => {
                if trace {
                    notes.push("hook observed the gradient".into());
                }
            }
        }
    }
    if let Some(slot) = retained {
        keep(&mut slot.lock(), grad.clone(), op)?;
        if trace {
            notes.push("gradient retained".into());
        }
    }
    Ok(grad)
}

/// Accumulates into a kept gradient (`.grad`, a retained slot).
fn keep<G: GradValue>(slot: &mut Option<G>, grad: G, op: &'static str) -> Result<(), GraphError> {
    match slot {
        Some(_) => accumulate(slot, grad, op),
        None => {
            *slot = Some(
                grad.into_kept()
                    .map_err(|source| GraphError::Backward { op, source })?,
            );
            Ok(())
        }
    }
}

fn accumulate<G: GradValue>(
    slot: &mut Option<G>,
    grad: G,
    op: &'static str,
) -> Result<(), GraphError> {
    match slot {
        Some(existing) => existing
            .accumulate(grad)
            .map_err(|source| GraphError::Backward { op, source }),
        None => {
            *slot = Some(grad);
            Ok(())
        }
    }
}
