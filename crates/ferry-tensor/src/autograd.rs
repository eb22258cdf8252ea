//! Tensors in the graph: what a rule may save and how it gets it back, recording ops, and
//! inference data.
//!
//! A gradient rule is data, not a closure over whatever the forward pass had at hand: a
//! [`Save`] naming which inputs (and whether the output) it keeps, a state of shapes and scalars
//! ([`RuleState`], which no tensor implements), and a plain `fn` for the backward. So a node
//! keeps alive exactly what its rule declares, and the graph's saved-byte count is built from
//! the same declaration.

use std::sync::Arc;

use ferry_graph::{
    Backward, BackwardContext, BoxError, GradSlot, Graph, InputGrads, NodeHandle, NodeKind,
    NodeMeta, SavedBuffer, SavedBuffers, is_grad_enabled, is_inference_mode,
};
use ferry_memory::{DType, Device};
use smallvec::SmallVec;

use crate::layout::Shape;
use crate::op::attention::Attend;
use crate::op::{BinaryOp, UnaryOp};
use crate::tensor::{Autograd, Inner};
use crate::{Result, Tensor, TensorError};

pub use crate::backward::{GradOptions, grad};
pub use offload::{OffloadGuard, OffloadOptions, OffloadStats, offload_saved};
pub use plan::{
    Choice, Link, MeasuredPeaks, MemoryPlan, PlannedRegion, RegionCost, Selective, StepCost,
};

mod offload;
mod plan;

/// Which tensors of the forward pass a rule keeps for backward: some inputs, the output, or
/// nothing (shapes and scalars travel in the rule's state).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Save(u8);

impl Save {
    const OUTPUT_BIT: u8 = 1 << 7;
    /// Keeps no tensor.
    pub const NOTHING: Save = Save(0);
    /// Keeps the output.
    pub const OUTPUT: Save = Save(Self::OUTPUT_BIT);

    /// Keeps input `i` (of at most seven).
    pub const fn input(i: usize) -> Save {
        assert!(i < 7, "a rule saves inputs 0..7");
        Save(1 << i)
    }

    /// Keeps these inputs as well.
    pub const fn and(self, other: Save) -> Save {
        Save(self.0 | other.0)
    }

    /// Keeps input `i` only `when` (a rule saves what the wanted gradients need).
    pub const fn input_if(i: usize, when: bool) -> Save {
        if when { Save::input(i) } else { Save::NOTHING }
    }

    fn has_input(self, i: usize) -> bool {
        i < 7 && self.0 & (1 << i) != 0
    }

    fn has_output(self) -> bool {
        self.0 & Self::OUTPUT_BIT != 0
    }
}

mod sealed {
    pub trait Sealed {}
}

/// What a rule may keep besides its declared tensors: shapes, axes, scalars, dtypes and
/// devices. Tensors do not implement it, so a rule cannot hold one by accident.
pub trait RuleState: sealed::Sealed + Send + Sync + 'static {}

macro_rules! rule_state {
    ($($t:ty),* $(,)?) => {
        $(impl sealed::Sealed for $t {} impl RuleState for $t {})*
    };
}

rule_state!(
    (),
    bool,
    usize,
    isize,
    f64,
    DType,
    Device,
    Shape,
    Vec<usize>,
    BinaryOp,
    UnaryOp,
    Attend
);

impl<A: RuleState, B: RuleState> sealed::Sealed for (A, B) {}
impl<A: RuleState, B: RuleState> RuleState for (A, B) {}
impl<A: RuleState, B: RuleState, C: RuleState> sealed::Sealed for (A, B, C) {}
impl<A: RuleState, B: RuleState, C: RuleState> RuleState for (A, B, C) {}

/// The backward of a rule: the saved tensors, the state, the output's gradient and which
/// inputs want one; returns a gradient per input.
pub type BackwardFn<S> = fn(&Saved<'_>, &S, &Tensor, &[bool]) -> Result<InputGrads<Tensor>>;

/// A gradient rule as ops declare it (see the module docs).
pub struct Rule<S: RuleState> {
    save: Save,
    aux: Option<Tensor>,
    state: S,
    backward: BackwardFn<S>,
}

impl<S: RuleState> Rule<S> {
    /// A rule that keeps the tensors `save` names and `state`.
    pub fn new(save: Save, state: S, backward: BackwardFn<S>) -> Self {
        Self {
            save,
            aux: None,
            state,
            backward,
        }
    }

    /// Also keeps `aux`, a tensor the forward computed for the backward alone (the indices of
    /// a maximum, the targets of a loss); it counts as saved like the others.
    pub fn with_aux(mut self, aux: Tensor) -> Self {
        self.aux = Some(aux.detach());
        self
    }
}

/// Which saved tensor: an input slot, the output, or the auxiliary tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Input(usize),
    Output,
    Aux,
}

/// A tensor a rule kept, with the version of its storage at the time.
struct SavedTensor {
    /// Inputs keep their history (their node is the node's own edge anyway); the output is kept
    /// without it (its node is the node that saves it) and re-attached in a create-graph
    /// backward.
    tensor: Tensor,
    version: u64,
    slot: Slot,
}

/// What a node holds of one saved tensor: the tensor, or (inside an [`offload_saved`] scope)
/// its buffer's copy in pinned host memory, with what it takes to rebuild the tensor.
enum Kept {
    Here(SavedTensor),
    Offloaded {
        data: Arc<offload::Offloaded>,
        layout: crate::layout::Layout,
        /// The buffer as the forward saw it, to notice an in-place write since (it is alive
        /// only while someone else still holds it).
        source: std::sync::Weak<crate::storage::Storage>,
        version: u64,
        slot: Slot,
    },
}

impl Kept {
    fn slot(&self) -> Slot {
        match self {
            Kept::Here(s) => s.slot,
            Kept::Offloaded { slot, .. } => *slot,
        }
    }

    /// Keeps `saved`, offloaded when the scope takes it.
    fn pack(saved: SavedTensor, scope: Option<&offload::Scope>) -> Kept {
        let Some(scope) = scope else {
            return Kept::Here(saved);
        };
        match scope.pack(&saved.tensor) {
            offload::Packed::Kept => Kept::Here(saved),
            offload::Packed::Offloaded(data) => Kept::Offloaded {
                data,
                layout: saved.tensor.layout().clone(),
                source: Arc::downgrade(saved.tensor.storage()),
                version: saved.version,
                slot: saved.slot,
            },
        }
    }
}

/// The tensors a rule saved, handed back to its backward.
pub struct Saved<'a> {
    op: &'static str,
    tensors: &'a [Kept],
    ctx: &'a BackwardContext<'a, Tensor>,
}

impl Saved<'_> {
    /// The saved tensor of `slot`, back on its device if it was offloaded (the kernels that
    /// read it wait for that copy on the device), refused if it was written in place since.
    fn find(&self, slot: Slot) -> Result<Tensor> {
        let kept = self
            .tensors
            .iter()
            .find(|s| s.slot() == slot)
            .ok_or_else(|| TensorError::InvalidArgument {
                op: self.op,
                message: format!(
                    "the gradient rule reads {} but did not declare it saved (a bug in the rule)",
                    describe_slot(slot)
                ),
            })?;
        let modified =
            |version: u64, now: u64, shape: SmallVec<[usize; 4]>| TensorError::ModifiedInPlace {
                op: self.op,
                tensor: describe_slot(slot),
                shape,
                saved_version: version,
                version: now,
            };
        match kept {
            Kept::Here(saved) => {
                let now = saved.tensor.storage().version();
                if now != saved.version {
                    return Err(modified(saved.version, now, saved.tensor.dims()));
                }
                Ok(saved.tensor.clone())
            }
            Kept::Offloaded {
                data,
                layout,
                source,
                version,
                ..
            } => {
                // The copy holds the values as saved, but a run without offload would refuse
                // them: so does this one, while the written buffer is still around to tell.
                if let Some(now) = source.upgrade().map(|s| s.version())
                    && now != *version
                {
                    return Err(modified(*version, now, layout.shape().into()));
                }
                let tensor = Tensor::from_storage(data.fetch()?, layout.clone())?;
                // An input keeps its history, as it would have without the offload: its node
                // is this node's edge of the same slot.
                if let Slot::Input(i) = slot
                    && self.ctx.create_graph()
                    && let Some(Some(node)) = self.ctx.node().inputs().nth(i)
                {
                    return Ok(tensor.attach(Autograd {
                        node: node.clone(),
                        grad: None,
                    }));
                }
                Ok(tensor)
            }
        }
    }

    /// Input `i` as the forward pass saw it (with its history, for higher-order gradients).
    pub fn input(&self, i: usize) -> Result<Tensor> {
        self.find(Slot::Input(i))
    }

    /// Runs `f` on the gradient accumulated so far in this backward for input `i`'s node,
    /// when it is a dense buffer nothing else holds (no other handle, no view, no history), so
    /// the rule may add into it in place and return `None` for that input; else `f(None)`.
    /// See [`BackwardContext::with_accumulated`].
    pub fn with_accumulated<R>(&self, i: usize, f: impl FnOnce(Option<&mut Tensor>) -> R) -> R {
        self.ctx.with_accumulated(i, |acc| {
            f(acc.filter(|t| t.is_alone() && !t.requires_grad()))
        })
    }

    /// The auxiliary tensor of [`Rule::with_aux`].
    pub fn aux(&self) -> Result<Tensor> {
        self.find(Slot::Aux)
    }

    /// The output; in a create-graph backward it is re-attached to its own node, so the second
    /// derivative flows through it.
    pub fn output(&self) -> Result<Tensor> {
        let saved = &self.find(Slot::Output)?;
        if self.ctx.create_graph() {
            Ok(saved.attach(Autograd {
                node: self.ctx.node().clone(),
                grad: None,
            }))
        } else {
            Ok(saved.clone())
        }
    }
}

fn describe_slot(slot: Slot) -> String {
    match slot {
        Slot::Input(i) => format!("input {i}"),
        Slot::Output => "the output".to_string(),
        Slot::Aux => "the auxiliary tensor".to_string(),
    }
}

/// A declared rule with its saved tensors: what a node owns.
struct TensorRule<S: RuleState> {
    op: &'static str,
    saved: SmallVec<[Kept; 2]>,
    state: S,
    backward: BackwardFn<S>,
}

/// Adds a buffer of `bytes` identified by `key` to `buffers` unless one with that key is there
/// already: a rule that keeps one storage twice owns it once.
pub(crate) fn keep_once(buffers: &mut SavedBuffers, key: usize, bytes: usize) {
    if !buffers.iter().any(|b: &SavedBuffer| b.key == Some(key)) {
        buffers.push(SavedBuffer {
            key: Some(key),
            bytes,
        });
    }
}

impl<S: RuleState> Backward<Tensor> for TensorRule<S> {
    fn backward(
        &self,
        ctx: &BackwardContext<'_, Tensor>,
        grad: &Tensor,
        wanted: &[bool],
    ) -> std::result::Result<InputGrads<Tensor>, BoxError> {
        let saved = Saved {
            op: self.op,
            tensors: &self.saved,
            ctx,
        };
        Ok((self.backward)(&saved, &self.state, grad, wanted)?)
    }

    fn saved(&self) -> SavedBuffers {
        let mut buffers = SavedBuffers::new();
        for s in &self.saved {
            // An offloaded buffer is held in host memory: counted by its copy's identity (each
            // copy once, however many rules share it) and the same bytes.
            let (key, bytes) = match s {
                Kept::Here(s) => (
                    Arc::as_ptr(s.tensor.storage()) as usize,
                    s.tensor.storage().bytes(),
                ),
                Kept::Offloaded { data, .. } => (Arc::as_ptr(data) as usize, data.bytes()),
            };
            // mul(x, x) keeps one storage once.
            keep_once(&mut buffers, key, bytes);
        }
        buffers
    }

    fn prefetch(&self) -> usize {
        let mut bytes = 0;
        for s in &self.saved {
            if let Kept::Offloaded { data, .. } = s {
                bytes += data.prefetch();
            }
        }
        bytes
    }
}

impl Tensor {
    /// Whether this handle is the only one to its buffer and sees all of it, densely: nothing
    /// else (another handle, a view, a caller) would see a write into it.
    pub(crate) fn is_alone(&self) -> bool {
        Arc::strong_count(&self.0) == 1
            && Arc::strong_count(self.storage()) == 1
            && self.is_contiguous()
            && self.layout().offset() == 0
    }
}

impl ferry_graph::GradValue for Tensor {
    fn accumulate(&mut self, other: Self) -> std::result::Result<(), BoxError> {
        *self = self.add(&other)?;
        Ok(())
    }

    fn into_kept(self) -> std::result::Result<Self, BoxError> {
        // Alone in its buffer and dense: keep it as is. Otherwise a copy of its own (a stride-0
        // view from `sum`'s backward, or one buffer `add`'s backward passed to both inputs).
        if self.is_alone() {
            Ok(self)
        } else {
            Ok(self.copy()?)
        }
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

/// Whether an op on `inputs` must record a node right now: grad mode is on, an input requires
/// grad, and none is inference data.
pub fn should_record(inputs: &[&Tensor]) -> bool {
    is_grad_enabled()
        && inputs.iter().any(|t| t.requires_grad())
        && !inputs.iter().any(|t| t.is_inference())
}

/// Records `output` as the result of `op` on `inputs` when [`should_record`] says so;
/// `make_rule` runs only then, so nothing is saved otherwise. An output computed from
/// inference data is inference data too, on whichever thread computed it.
pub fn record<S: RuleState>(
    output: Tensor,
    op: &'static str,
    inputs: &[&Tensor],
    make_rule: impl FnOnce() -> Rule<S>,
) -> Tensor {
    record_kind(output, op, NodeKind::Op, inputs, make_rule)
}

/// [`record`] for a rule whose making can fail (it computes what it keeps, like the indices of
/// a maximum); it runs only when recording.
pub fn try_record<S: RuleState>(
    output: Tensor,
    op: &'static str,
    inputs: &[&Tensor],
    make_rule: impl FnOnce() -> Result<Rule<S>>,
) -> Result<Tensor> {
    if !should_record(inputs) {
        return Ok(record_kind(
            output,
            op,
            NodeKind::Op,
            inputs,
            || -> Rule<S> { unreachable!("record_kind makes no rule when not recording") },
        ));
    }
    let rule = make_rule()?;
    Ok(record_kind(output, op, NodeKind::Op, inputs, || rule))
}

/// [`record`] with an explicit node kind (transfers draw differently).
pub fn record_kind<S: RuleState>(
    output: Tensor,
    op: &'static str,
    kind: NodeKind,
    inputs: &[&Tensor],
    make_rule: impl FnOnce() -> Rule<S>,
) -> Tensor {
    if !should_record(inputs) {
        if !output.is_inference() && inputs.iter().any(|t| t.is_inference()) {
            return output.into_inference();
        }
        return output;
    }
    let Rule {
        save,
        aux,
        state,
        backward,
    } = make_rule();
    // One thread-local read; an offload scope is rare.
    let scope = offload::current();
    if let Some(scope) = &scope {
        scope.on_record();
        scope.note_output(&output, inputs);
    }
    let scope = scope.as_deref();
    let mut saved = SmallVec::new();
    for (i, input) in inputs.iter().enumerate() {
        if save.has_input(i) {
            let tensor = SavedTensor {
                tensor: (*input).clone(),
                version: input.storage().version(),
                slot: Slot::Input(i),
            };
            saved.push(Kept::pack(tensor, scope));
        }
    }
    if save.has_output() {
        let tensor = SavedTensor {
            tensor: output.detach(),
            version: output.storage().version(),
            slot: Slot::Output,
        };
        saved.push(Kept::pack(tensor, scope));
    }
    if let Some(aux) = aux {
        let tensor = SavedTensor {
            version: aux.storage().version(),
            tensor: aux,
            slot: Slot::Aux,
        };
        saved.push(Kept::pack(tensor, scope));
    }
    let rule = TensorRule {
        op,
        saved,
        state,
        backward,
    };
    let mut meta = NodeMeta::op(op, output.shape(), output.dtype().name(), output.device());
    meta.kind = kind;
    let nodes: SmallVec<[Option<&NodeHandle<Tensor>>; 4]> =
        inputs.iter().map(|t| t.node()).collect();
    let node = ferry_graph::record(meta, Arc::new(rule), &nodes);
    output.attach(Autograd { node, grad: None })
}

impl Tensor {
    pub(crate) fn attach(&self, autograd: Autograd) -> Tensor {
        Tensor(Arc::new(Inner {
            storage: Arc::clone(&self.0.storage),
            layout: self.0.layout.clone(),
            autograd: Some(autograd),
            inference: self.0.inference,
        }))
    }

    fn into_inference(self) -> Tensor {
        Tensor(Arc::new(Inner {
            storage: Arc::clone(&self.0.storage),
            layout: self.0.layout.clone(),
            autograd: None,
            inference: true,
        }))
    }

    /// Whether this is inference data: made inside [`ferry_graph::inference_mode`], or computed
    /// from such data. No op that reads it records a node, on any thread. [`Tensor::copy`]
    /// outside the scope is the way back to a normal tensor.
    pub fn is_inference(&self) -> bool {
        self.0.inference
    }

    /// Whether gradients flow to or through this tensor.
    pub fn requires_grad(&self) -> bool {
        self.0.autograd.is_some()
    }

    /// A leaf over the same data that requires grad, in a graph of its own; only float tensors
    /// can, and not inference data (copy it outside the inference scope first).
    pub fn with_grad(&self) -> Result<Tensor> {
        if !self.dtype().is_float() {
            return Err(TensorError::NotDifferentiable {
                dtype: self.dtype(),
            });
        }
        if self.is_inference() || is_inference_mode() {
            return Err(TensorError::InvalidArgument {
                op: "with_grad",
                message: "inference data cannot require grad: outside `inference_mode`, make a \
                          normal tensor with `.copy()?` and call `.with_grad()` on that"
                    .into(),
            });
        }
        let slot = GradSlot::default();
        let meta = NodeMeta::op("leaf", self.shape(), self.dtype().name(), self.device());
        let node = Graph::new().leaf(meta, slot.clone());
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

    /// The graph this tensor belongs to, when it has history: its counts (live nodes, saved
    /// bytes, recorded, pruned) describe this tensor's graph alone.
    pub fn graph(&self) -> Option<Graph> {
        self.node().map(NodeHandle::graph)
    }

    /// The accumulated gradient of a leaf, or of a non-leaf after [`Tensor::retain_grad`].
    pub fn grad(&self) -> Option<Tensor> {
        let autograd = self.0.autograd.as_ref()?;
        match &autograd.grad {
            Some(slot) => slot.lock().clone(),
            None => autograd.node.grad_slot()?.lock().clone(),
        }
    }

    /// Replaces the kept gradient (`None` frees it, like `zero_grad(set_to_none=True)`).
    pub fn set_grad(&self, grad: Option<Tensor>) {
        let Some(autograd) = self.0.autograd.as_ref() else {
            return;
        };
        let slot = match &autograd.grad {
            Some(slot) => Some(Arc::clone(slot)),
            None => autograd.node.grad_slot(),
        };
        if let Some(slot) = slot {
            *slot.lock() = grad;
        }
    }

    pub(crate) fn requires_node(&self, op: &'static str) -> Result<&NodeHandle<Tensor>> {
        self.node().ok_or(TensorError::NoGraphFor { op })
    }
}
