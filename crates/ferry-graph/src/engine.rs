//! The backward engine: topological order over what the root reaches, accumulation into
//! leaves, and freeing saved buffers unless the graph is retained.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use petgraph::stable_graph::NodeIndex;
use petgraph::visit::EdgeRef;
use smallvec::SmallVec;

use crate::GraphError;
use crate::graph::{GradSlot, GraphState, NodeHandle};
use crate::mode::no_grad;
use crate::node::{Backward, GradValue, NodeMeta};

/// How to run backward.
#[derive(Debug, Clone, Copy, Default)]
pub struct BackwardOptions {
    /// Keep saved buffers so backward can run through this graph again.
    pub retain_graph: bool,
    /// Record a [`TraceStep`] for every node visited.
    pub trace: bool,
}

/// One node visited by a traced backward.
#[derive(Debug, Clone)]
pub struct TraceStep {
    /// The node's description.
    pub meta: NodeMeta,
    /// The gradient the node received, described by [`GradValue::describe`].
    pub received: String,
    /// What the node passed on: `(input slot, gradient)` for each input that wanted one.
    pub passed: Vec<(usize, String)>,
}

/// What a backward did.
#[derive(Debug, Clone, Default)]
pub struct BackwardReport {
    /// Nodes visited, leaves included.
    pub visited: usize,
    /// Leaves whose gradient was accumulated.
    pub leaves_reached: usize,
    /// The visit in order, when [`BackwardOptions::trace`] was set.
    pub trace: Vec<TraceStep>,
}

struct Step<G> {
    index: NodeIndex,
    meta: NodeMeta,
    backward: Option<Arc<dyn Backward<G>>>,
    leaf_grad: Option<GradSlot<G>>,
    inputs: usize,
    edges: SmallVec<[(NodeIndex, usize); 2]>,
}

impl<G: GradValue> NodeHandle<G> {
    /// Runs backward from this node with `grad` as the gradient of its output.
    pub fn backward(
        &self,
        grad: G,
        options: BackwardOptions,
    ) -> Result<BackwardReport, GraphError> {
        let plan = self.plan()?;
        let _no_grad = no_grad();
        let mut grads: HashMap<NodeIndex, G> = HashMap::with_capacity(plan.len());
        grads.insert(self.index, grad);
        let mut report = BackwardReport::default();
        for step in &plan {
            let Some(grad) = grads.remove(&step.index) else {
                continue; // every path into this node produced no gradient
            };
            report.visited += 1;
            if let Some(slot) = &step.leaf_grad {
                if options.trace {
                    report.trace.push(TraceStep {
                        meta: step.meta.clone(),
                        received: grad.describe(),
                        passed: Vec::new(),
                    });
                }
                accumulate_into(&mut slot.lock(), grad, step.meta.op)?;
                report.leaves_reached += 1;
                continue;
            }
            let backward = step
                .backward
                .as_ref()
                .expect("plan checked op nodes have rules");
            let mut wanted: SmallVec<[bool; 4]> = SmallVec::from_elem(false, step.inputs);
            for &(_, slot) in &step.edges {
                wanted[slot] = true;
            }
            let mut input_grads =
                backward
                    .backward(&grad, &wanted)
                    .map_err(|source| GraphError::Backward {
                        op: step.meta.op,
                        source,
                    })?;
            if input_grads.len() != step.inputs {
                return Err(GraphError::GradientArity {
                    op: step.meta.op,
                    expected: step.inputs,
                    got: input_grads.len(),
                });
            }
            let mut passed = Vec::new();
            for &(target, slot) in &step.edges {
                let Some(g) = input_grads[slot].take() else {
                    continue;
                };
                if options.trace {
                    passed.push((slot, g.describe()));
                }
                match grads.entry(target) {
                    Entry::Occupied(mut existing) => {
                        existing
                            .get_mut()
                            .accumulate(g)
                            .map_err(|source| GraphError::Backward {
                                op: step.meta.op,
                                source,
                            })?
                    }
                    Entry::Vacant(slot) => {
                        slot.insert(g);
                    }
                }
            }
            if options.trace {
                passed.sort_by_key(|(slot, _)| *slot);
                report.trace.push(TraceStep {
                    meta: step.meta.clone(),
                    received: grad.describe(),
                    passed,
                });
            }
        }
        if !options.retain_graph {
            self.free_saved(&plan);
        }
        Ok(report)
    }

    /// The nodes reachable from this one, in an order where every node comes after all the
    /// nodes that send it gradients (reverse postorder of a depth-first walk).
    fn plan(&self) -> Result<Vec<Step<G>>, GraphError> {
        let state = self.graph.state.lock();
        let order = reverse_postorder(&state, self.index);
        order
            .into_iter()
            .map(|index| {
                let data = &state.graph[index];
                if !data.is_leaf() && data.backward.is_none() {
                    return Err(GraphError::BuffersFreed { op: data.meta.op });
                }
                Ok(Step {
                    index,
                    meta: data.meta.clone(),
                    backward: data.backward.clone(),
                    leaf_grad: data.leaf_grad.clone(),
                    inputs: data.inputs,
                    edges: state
                        .graph
                        .edges(index)
                        .map(|e| (e.target(), e.weight().slot))
                        .collect(),
                })
            })
            .collect()
    }

    fn free_saved(&self, plan: &[Step<G>]) {
        let mut freed = Vec::new();
        let mut state = self.graph.state.lock();
        for step in plan.iter().filter(|s| s.leaf_grad.is_none()) {
            let data = &mut state.graph[step.index];
            let bytes = std::mem::take(&mut data.saved_bytes);
            freed.extend(data.backward.take());
            state.saved_bytes -= bytes;
        }
        drop(state);
        drop(freed);
    }
}

fn accumulate_into<G: GradValue>(
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

fn reverse_postorder<G>(state: &GraphState<G>, root: NodeIndex) -> Vec<NodeIndex> {
    let mut visited = HashSet::new();
    let mut postorder = Vec::new();
    // (node, whether its children have been pushed)
    let mut stack = vec![(root, false)];
    while let Some((node, expanded)) = stack.pop() {
        if expanded {
            postorder.push(node);
            continue;
        }
        if !visited.insert(node) {
            continue;
        }
        stack.push((node, true));
        for edge in state.graph.edges(node) {
            if !visited.contains(&edge.target()) {
                stack.push((edge.target(), false));
            }
        }
    }
    postorder.reverse();
    postorder
}
