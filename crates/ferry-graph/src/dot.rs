//! Graphviz DOT output: op, shape, dtype, device and saved bytes per node; transfer nodes and
//! their edges drawn distinctly.

use std::collections::HashMap;
use std::fmt::Write;

use petgraph::stable_graph::NodeIndex;
use petgraph::visit::EdgeRef;

use crate::graph::{Graph, GraphState, NodeData, NodeHandle};
use crate::node::{GradValue, NodeKind};

/// A detach cut to draw: a tensor that was cut off from `node` by `detach`.
#[derive(Debug, Clone)]
pub struct DetachCut {
    /// What to call the detached tensor in the drawing.
    pub label: String,
    /// Index of the node the tensor was detached from.
    pub node: NodeIndex,
}

impl<G: GradValue> Graph<G> {
    /// The whole graph in DOT, nodes in index order.
    pub fn to_dot(&self) -> String {
        let state = self.state.lock();
        let nodes: Vec<NodeIndex> = state.graph.node_indices().collect();
        render(&state, &nodes, &[])
    }

    /// What `roots` reach, in DOT, with `cuts` drawn as dashed edges into the cut node.
    pub fn dot_from(&self, roots: &[&NodeHandle<G>], cuts: &[DetachCut]) -> String {
        let state = self.state.lock();
        let mut seen = std::collections::HashSet::new();
        let mut nodes = Vec::new();
        // Roots first, then what only the cuts reach.
        let mut stack: Vec<NodeIndex> = cuts.iter().rev().map(|c| c.node).collect();
        stack.extend(roots.iter().rev().map(|r| r.index));
        while let Some(node) = stack.pop() {
            if !state.graph.contains_node(node) || !seen.insert(node) {
                continue;
            }
            nodes.push(node);
            stack.extend(
                edges_by_slot(&state, node)
                    .into_iter()
                    .rev()
                    .map(|(_, target)| target),
            );
        }
        render(&state, &nodes, cuts)
    }
}

impl<G: GradValue> NodeHandle<G> {
    /// What this node reaches, in DOT.
    pub fn to_dot(&self) -> String {
        self.graph.dot_from(&[self], &[])
    }
}

fn render<G>(state: &GraphState<G>, nodes: &[NodeIndex], cuts: &[DetachCut]) -> String {
    let ids: HashMap<NodeIndex, usize> = nodes.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let mut out = String::from(
        "digraph autograd {\n  rankdir=BT;\n  node [fontname=\"monospace\", fontsize=10];\n",
    );
    for (id, &node) in nodes.iter().enumerate() {
        let data = &state.graph[node];
        let _ = writeln!(out, "  n{id} [{}];", node_attrs(data));
    }
    for &node in nodes {
        let data = &state.graph[node];
        for (slot, target) in edges_by_slot(state, node) {
            let Some(target) = ids.get(&target) else {
                continue;
            };
            let mut attrs = Vec::new();
            if data.inputs > 1 {
                attrs.push(format!("label=\"{slot}\""));
            }
            if matches!(data.meta.kind, NodeKind::Transfer { .. }) {
                attrs.push("color=\"darkorange\", penwidth=2, style=bold".to_string());
            }
            // Edges point the way gradients flow: from an op to its inputs.
            let attrs = if attrs.is_empty() {
                String::new()
            } else {
                format!(" [{}]", attrs.join(", "))
            };
            let _ = writeln!(out, "  n{} -> n{target}{attrs};", ids[&node]);
        }
    }
    for (i, cut) in cuts.iter().enumerate() {
        let Some(target) = ids.get(&cut.node) else {
            continue;
        };
        let _ = writeln!(
            out,
            "  cut{i} [label=\"{}\", shape=note, style=filled, fillcolor=\"#eeeeee\"];\n  cut{i} -> n{target} [style=dashed, color=red, arrowhead=tee, label=\"detach\"];",
            escape(&cut.label)
        );
    }
    out.push_str("}\n");
    out
}

/// A node's gradient edges as `(slot, input node)`, in slot order.
fn edges_by_slot<G>(state: &GraphState<G>, node: NodeIndex) -> Vec<(usize, NodeIndex)> {
    let mut edges: Vec<_> = state
        .graph
        .edges(node)
        .map(|e| (e.weight().slot, e.target()))
        .collect();
    edges.sort_unstable();
    edges
}

fn node_attrs<G>(data: &NodeData<G>) -> String {
    let meta = &data.meta;
    let shape = meta
        .shape
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    let mut label = format!("{}\\n[{shape}] {} {}", meta.op, meta.dtype, meta.device);
    // Leaves save nothing by construction; every op node says what it keeps for backward.
    if !data.is_leaf() {
        let _ = write!(label, "\\nsaved {} B", data.saved_bytes);
    }
    if data.backward.is_none() && !data.is_leaf() {
        label.push_str("\\n(buffers freed)");
    }
    match &meta.kind {
        NodeKind::Op => format!("label=\"{}\", shape=box", escape_quotes(&label)),
        NodeKind::Leaf => format!(
            "label=\"{}\", shape=ellipse, style=filled, fillcolor=\"lightblue\"",
            escape_quotes(&label)
        ),
        NodeKind::Transfer { from, to } => format!(
            "label=\"{}\\n{} -> {}\", shape=box, style=\"filled,bold\", fillcolor=\"orange\"",
            escape_quotes(&label),
            escape(from),
            escape(to)
        ),
    }
}

fn escape(s: &str) -> String {
    escape_quotes(&s.replace('\\', "\\\\"))
}

fn escape_quotes(s: &str) -> String {
    s.replace('"', "\\\"")
}
