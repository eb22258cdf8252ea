//! Graphviz DOT output: op, shape, dtype, device and saved bytes per node; transfer nodes and
//! their edges drawn distinctly; detach cuts as dashed edges.

use std::collections::HashMap;
use std::fmt::Write;

use petgraph::graph::{DiGraph, NodeIndex};
use petgraph::visit::EdgeRef;

use crate::graph::{NodeHandle, RuleSlot};
use crate::node::{GradValue, NodeKind};

/// A detach cut to draw: a tensor that was cut off from `node` by `detach`.
#[derive(Debug, Clone)]
pub struct DetachCut<G: GradValue> {
    /// What to call the detached tensor in the drawing.
    pub label: String,
    /// The node the tensor was detached from.
    pub node: NodeHandle<G>,
}

/// What `roots` reach, in DOT, with `cuts` drawn as dashed edges into the cut node. Nodes are
/// numbered in the order a depth-first walk from the roots (then the cuts) meets them, inputs
/// in slot order, so a drawing of the same graph is the same text.
pub fn dot<G: GradValue>(roots: &[&NodeHandle<G>], cuts: &[DetachCut<G>]) -> String {
    let mut graph: DiGraph<NodeHandle<G>, usize> = DiGraph::new();
    let mut index: HashMap<usize, NodeIndex> = HashMap::new();
    let mut stack: Vec<NodeHandle<G>> = cuts.iter().rev().map(|c| c.node.clone()).collect();
    stack.extend(roots.iter().rev().map(|r| (*r).clone()));
    while let Some(node) = stack.pop() {
        if index.contains_key(&node.key()) {
            continue;
        }
        index.insert(node.key(), graph.add_node(node.clone()));
        stack.extend(node.inputs().rev().flatten().cloned());
    }
    for i in graph.node_indices() {
        let node = graph[i].clone();
        for (slot, input) in node.inputs().enumerate() {
            if let Some(input) = input {
                graph.add_edge(i, index[&input.key()], slot);
            }
        }
    }
    render(&graph, &index, cuts)
}

impl<G: GradValue> NodeHandle<G> {
    /// What this node reaches, in DOT.
    pub fn to_dot(&self) -> String {
        dot(&[self], &[])
    }
}

fn render<G: GradValue>(
    graph: &DiGraph<NodeHandle<G>, usize>,
    index: &HashMap<usize, NodeIndex>,
    cuts: &[DetachCut<G>],
) -> String {
    let mut out = String::from(
        "digraph autograd {\n  rankdir=BT;\n  node [fontname=\"monospace\", fontsize=10];\n",
    );
    for i in graph.node_indices() {
        let _ = writeln!(out, "  n{} [{}];", i.index(), node_attrs(&graph[i]));
    }
    for i in graph.node_indices() {
        let node = &graph[i];
        let mut edges: Vec<(usize, NodeIndex)> =
            graph.edges(i).map(|e| (*e.weight(), e.target())).collect();
        edges.sort_unstable();
        for (slot, target) in edges {
            let mut attrs = Vec::new();
            if node.0.edges.len() > 1 {
                attrs.push(format!("label=\"{slot}\""));
            }
            if matches!(node.meta().kind, NodeKind::Transfer { .. }) {
                attrs.push("color=\"darkorange\", penwidth=2, style=bold".to_string());
            }
            // Edges point the way gradients flow: from an op to its inputs.
            let attrs = if attrs.is_empty() {
                String::new()
            } else {
                format!(" [{}]", attrs.join(", "))
            };
            let _ = writeln!(out, "  n{} -> n{}{attrs};", i.index(), target.index());
        }
    }
    for (k, cut) in cuts.iter().enumerate() {
        let target = index[&cut.node.key()];
        let _ = writeln!(
            out,
            "  cut{k} [label=\"{}\", shape=note, style=filled, fillcolor=\"#eeeeee\"];\n  cut{k} -> n{} [style=dashed, color=red, arrowhead=tee, label=\"detach\"];",
            escape(&cut.label),
            target.index()
        );
    }
    out.push_str("}\n");
    out
}

fn node_attrs<G: GradValue>(node: &NodeHandle<G>) -> String {
    let meta = node.meta();
    let shape = meta
        .shape
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    let mut label = format!("{}\\n[{shape}] {} {}", meta.op, meta.dtype, meta.device);
    // Leaves save nothing by construction; every op node says what it keeps for backward.
    if !node.is_leaf() {
        let _ = write!(label, "\\nsaved {} B", node.saved_bytes());
    }
    if matches!(&*node.0.rule.lock(), RuleSlot::Freed) {
        label.push_str("\\n(buffers freed)");
    }
    if !node.0.hooks.lock().is_empty() {
        label.push_str("\\n(hooks)");
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
            escape(&from.to_string()),
            escape(&to.to_string())
        ),
    }
}

fn escape(s: &str) -> String {
    escape_quotes(&s.replace('\\', "\\\\"))
}

fn escape_quotes(s: &str) -> String {
    s.replace('"', "\\\"")
}
