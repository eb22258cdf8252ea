//! Tensors in the graph: the process-wide graph, leaves, recording ops, and backward.

use std::sync::{Arc, LazyLock};

use ferry_graph::{
    Backward, BackwardOptions, BackwardReport, BoxError, DetachCut, GradSlot, GradValue, Graph,
    InputGrads, NodeHandle, NodeKind, NodeMeta, is_grad_enabled,
};

use crate::tensor::{Autograd, Inner};
use crate::{Result, Tensor, TensorError};

static GRAPH: LazyLock<Graph<Tensor>> = LazyLock::new(Graph::new);

/// The graph every tensor op records into. Its counts show pruning at work.
pub fn graph() -> &'static Graph<Tensor> {
    &GRAPH
}

impl GradValue for Tensor {
    fn accumulate(&mut self, other: Self) -> std::result::Result<(), BoxError> {
        *self = self.add(&other)?;
        Ok(())
    }

    fn describe(&self) -> String {
        let norm = self
            .norm()
            .ok()
            .map(|n| format!(" norm {n:.4}"))
            .unwrap_or_default();
        format!(
            "{:?} {} {}{norm}",
            self.shape(),
            self.dtype(),
            self.device()
        )
    }
}

/// A backward rule built from a closure over the tensors it saved.
struct Rule<F> {
    saved_bytes: usize,
    f: F,
}

impl<F> Backward<Tensor> for Rule<F>
where
    F: Fn(&Tensor, &[bool]) -> Result<InputGrads<Tensor>> + Send + Sync,
{
    fn backward(
        &self,
        grad: &Tensor,
        wanted: &[bool],
    ) -> std::result::Result<InputGrads<Tensor>, BoxError> {
        Ok((self.f)(grad, wanted)?)
    }

    fn saved_bytes(&self) -> usize {
        self.saved_bytes
    }
}

/// A backward rule whose closure keeps `saved_bytes` of tensors alive (see [`saved_bytes`]).
pub fn rule<F>(saved_bytes: usize, f: F) -> Arc<dyn Backward<Tensor>>
where
    F: Fn(&Tensor, &[bool]) -> Result<InputGrads<Tensor>> + Send + Sync + 'static,
{
    Arc::new(Rule { saved_bytes, f })
}

/// Bytes of the tensors a rule saves.
pub fn saved_bytes(saved: &[&Tensor]) -> usize {
    saved.iter().map(|t| t.nbytes()).sum()
}

/// Whether an op on `inputs` must record a node right now.
pub fn should_record(inputs: &[&Tensor]) -> bool {
    is_grad_enabled() && inputs.iter().any(|t| t.requires_grad())
}

/// Records `output` as the result of `op` on `inputs`, when any input requires grad and grad
/// mode is on; `make_rule` runs only then, so nothing is saved otherwise.
pub fn record(
    output: Tensor,
    op: &'static str,
    inputs: &[&Tensor],
    make_rule: impl FnOnce() -> Arc<dyn Backward<Tensor>>,
) -> Tensor {
    record_kind(output, op, NodeKind::Op, inputs, make_rule)
}

/// [`record`] with an explicit node kind (transfers draw differently).
pub fn record_kind(
    output: Tensor,
    op: &'static str,
    kind: NodeKind,
    inputs: &[&Tensor],
    make_rule: impl FnOnce() -> Arc<dyn Backward<Tensor>>,
) -> Tensor {
    if !should_record(inputs) {
        return output;
    }
    let mut meta = NodeMeta::op(
        op,
        output.shape(),
        output.dtype().name(),
        output.device().to_string(),
    );
    meta.kind = kind;
    let nodes: Vec<Option<&NodeHandle<Tensor>>> = inputs.iter().map(|t| t.node()).collect();
    let node = GRAPH.record(meta, make_rule(), &nodes);
    output.attach(Autograd { node, grad: None })
}

impl Tensor {
    fn attach(self, autograd: Autograd) -> Tensor {
        Tensor(Arc::new(Inner {
            storage: Arc::clone(&self.0.storage),
            layout: self.0.layout.clone(),
            autograd: Some(autograd),
        }))
    }

    /// Whether gradients flow to or through this tensor.
    pub fn requires_grad(&self) -> bool {
        self.0.autograd.is_some()
    }

    /// A leaf over the same data that requires grad; only float tensors can.
    pub fn with_grad(&self) -> Result<Tensor> {
        if !self.dtype().is_float() {
            return Err(TensorError::NotDifferentiable {
                dtype: self.dtype(),
            });
        }
        let slot = GradSlot::default();
        let meta = NodeMeta::op(
            "leaf",
            self.shape(),
            self.dtype().name(),
            self.device().to_string(),
        );
        let node = GRAPH.leaf(meta, slot.clone());
        Ok(self.detach().attach(Autograd {
            node,
            grad: Some(slot),
        }))
    }

    /// Whether this tensor is a leaf: it has no history, or it is a leaf that requires grad.
    pub fn is_leaf(&self) -> bool {
        self.0.autograd.as_ref().is_none_or(|a| a.grad.is_some())
    }

    /// This tensor's node, when it has one.
    pub fn node(&self) -> Option<&NodeHandle<Tensor>> {
        self.0.autograd.as_ref().map(|a| &a.node)
    }

    /// The accumulated gradient of a leaf.
    pub fn grad(&self) -> Option<Tensor> {
        self.grad_slot().and_then(|slot| slot.lock().clone())
    }

    /// Replaces a leaf's gradient (`None` frees it, like `zero_grad(set_to_none=True)`).
    pub fn set_grad(&self, grad: Option<Tensor>) {
        if let Some(slot) = self.grad_slot() {
            *slot.lock() = grad;
        }
    }

    fn grad_slot(&self) -> Option<&GradSlot<Tensor>> {
        self.0.autograd.as_ref().and_then(|a| a.grad.as_ref())
    }

    /// Backward from a one-element tensor, with gradient 1.
    pub fn backward(&self) -> Result<BackwardReport> {
        if self.numel() != 1 {
            return Err(TensorError::NonScalarBackward { shape: self.dims() });
        }
        let ones = Tensor::ones(self.shape(), self.dtype(), self.device())?;
        self.backward_with(ones, BackwardOptions::default())
    }

    /// Backward from a one-element tensor that also reports every node visited, in order, with
    /// the gradient it received and what it passed on (see [`BackwardReport::trace`]).
    pub fn backward_traced(&self) -> Result<BackwardReport> {
        if self.numel() != 1 {
            return Err(TensorError::NonScalarBackward { shape: self.dims() });
        }
        let ones = Tensor::ones(self.shape(), self.dtype(), self.device())?;
        let options = BackwardOptions {
            trace: true,
            ..BackwardOptions::default()
        };
        self.backward_with(ones, options)
    }

    /// Backward with an explicit output gradient and options (retain_graph, trace).
    pub fn backward_with(&self, grad: Tensor, options: BackwardOptions) -> Result<BackwardReport> {
        let node = self.node().ok_or(TensorError::NoGraph)?;
        if grad.device() != self.device() {
            return Err(TensorError::DeviceMismatch {
                op: "backward",
                lhs: self.device(),
                rhs: grad.device(),
            });
        }
        if grad.dtype() != self.dtype() {
            return Err(TensorError::dtype_mismatch(
                "backward",
                grad.dtype(),
                self.dtype(),
            ));
        }
        if grad.shape() != self.shape() {
            return Err(TensorError::ShapeMismatch {
                op: "backward",
                lhs: self.dims(),
                rhs: grad.dims(),
                hint: "the gradient must have the output's shape",
            });
        }
        Ok(node.backward(grad.detach(), options)?)
    }
}

/// The graph behind `roots` in Graphviz DOT: op, shape, dtype, device and saved bytes per node,
/// transfer nodes and edges drawn distinctly, and each `(label, source)` in `cuts` drawn as a
/// detach cut into the node of `source` (the tensor that was detached).
pub fn to_dot(roots: &[&Tensor], cuts: &[(&str, &Tensor)]) -> String {
    let nodes: Vec<&NodeHandle<Tensor>> = roots.iter().filter_map(|t| t.node()).collect();
    let cuts: Vec<DetachCut> = cuts
        .iter()
        .filter_map(|(label, source)| {
            source.node().map(|n| DetachCut {
                label: (*label).to_string(),
                node: n.index(),
            })
        })
        .collect();
    GRAPH.dot_from(&nodes, &cuts)
}
