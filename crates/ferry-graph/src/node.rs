//! What a node is made of: its backward rule, what the rule saved, its description, and the
//! gradient-value trait.

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};

use ferry_memory::Device;
use smallvec::SmallVec;

use crate::BoxError;
use crate::graph::NodeHandle;

/// Gradients returned by a backward rule, one per input slot (`None` where not wanted).
pub type InputGrads<G> = SmallVec<[Option<G>; 2]>;

/// A value gradients are made of: `f64` in teaching examples, tensors in the runtime.
pub trait GradValue: Clone + Send + Sync + 'static {
    /// Adds `other` into `self` (the same gradient reaching a node twice).
    fn accumulate(&mut self, other: Self) -> Result<(), BoxError>;
    /// A short description for traces: shape and norm for tensors, the value for scalars.
    fn describe(&self) -> String;

    /// The gradient as a leaf's `.grad` (or a retained gradient) first keeps it. Tensors give
    /// broadcast views and buffers other gradients share a buffer of their own here, so gradients
    /// can flow as cheap views and an in-place update of one `.grad` never reaches another.
    fn into_kept(self) -> Result<Self, BoxError> {
        Ok(self)
    }
}

impl GradValue for f64 {
    fn accumulate(&mut self, other: Self) -> Result<(), BoxError> {
        *self += other;
        Ok(())
    }

    fn describe(&self) -> String {
        format!("{self:.6}")
    }
}

/// One buffer a rule keeps alive for backward, as the graph's accounting sees it.
///
/// Buffers with a `key` (the address of the storage, for tensors) are counted once per graph
/// however many nodes save them: `tanh` and the `matmul` after it both save tanh's output, but
/// it is kept alive once. Buffers without a key are counted every time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SavedBuffer {
    /// Identity of the underlying buffer, shared by every view of it.
    pub key: Option<usize>,
    /// Bytes the buffer holds (the whole buffer, not the part a view sees: that is what stays
    /// allocated).
    pub bytes: usize,
}

/// The buffers one rule saved.
pub type SavedBuffers = SmallVec<[SavedBuffer; 2]>;

/// What a rule may ask of the engine while it runs.
pub struct BackwardContext<'a, G: GradValue> {
    pub(crate) node: &'a NodeHandle<G>,
    pub(crate) create_graph: bool,
    pub(crate) pending: PendingInputs<'a, G>,
}

/// The gradients a backward has accumulated so far for every node, and which of them belong to
/// the inputs of the rule that runs.
pub(crate) struct PendingInputs<'a, G> {
    pub(crate) grads: &'a RefCell<Vec<Option<G>>>,
    /// `(input slot, node)` for each input the rule is asked for.
    pub(crate) inputs: SmallVec<[(usize, usize); 2]>,
}

impl<G: GradValue> BackwardContext<'_, G> {
    /// The node whose rule runs. A rule that saved its own output re-attaches it to this node
    /// when [`create_graph`](Self::create_graph) is on, so the second derivative flows through
    /// the output's history without the node ever holding a reference to itself.
    pub fn node(&self) -> &NodeHandle<G> {
        self.node
    }

    /// Whether this backward records its own graph (higher-order gradients).
    pub fn create_graph(&self) -> bool {
        self.create_graph
    }

    /// Runs `f` on the gradient this backward has accumulated so far for the node of input
    /// `slot` (`None` when nothing has reached that node yet, or the input is not asked for),
    /// so that a rule can add its part into it in place and return `None` for that input,
    /// instead of a gradient the engine then adds whole. A narrowed view does this: the
    /// gradients of the three heads split out of a fused projection fill one buffer instead of
    /// three padded ones summed. The engine reaches that node only after every rule that feeds
    /// it has run, so nothing reads the gradient meanwhile; `f` must check that nothing else
    /// holds it (a rule may hand one gradient to two inputs).
    pub fn with_accumulated<R>(&self, slot: usize, f: impl FnOnce(Option<&mut G>) -> R) -> R {
        let pending = &self.pending;
        let Some(&(_, node)) = pending.inputs.iter().find(|(s, _)| *s == slot) else {
            return f(None);
        };
        match pending.grads.try_borrow_mut() {
            Ok(mut grads) => f(grads.get_mut(node).and_then(Option::as_mut)),
            Err(_) => f(None),
        }
    }
}

/// The backward rule of one recorded op.
pub trait Backward<G: GradValue>: Send + Sync {
    /// Given the gradient of the op's output, returns the gradient of each input.
    ///
    /// `wanted[i]` says whether input `i` needs a gradient; a rule may skip the others and
    /// return `None` for them. When [`BackwardContext::create_graph`] is on, grad mode is on
    /// while the rule runs, so a rule written in recorded ops is itself differentiable.
    fn backward(
        &self,
        ctx: &BackwardContext<'_, G>,
        grad: &G,
        wanted: &[bool],
    ) -> Result<InputGrads<G>, BoxError>;

    /// The buffers this rule keeps alive until it is freed; the graph's `saved_bytes` is built
    /// from these, so they must be exactly what the rule owns.
    fn saved(&self) -> SavedBuffers {
        SavedBuffers::new()
    }

    /// Starts bringing back what this rule saved off the device (see [`OffloadedSave`]), so it
    /// is in place when the rule runs. The engine calls it a few nodes ahead of the rule while
    /// any saved buffer is off the device; it must not block the host. It reports nothing: a
    /// rule whose prefetch failed fetches again, and reports the error, when it runs. Returns
    /// the bytes it started bringing back (0 when nothing new was queued), which the engine
    /// counts against its prefetch window.
    fn prefetch(&self) -> usize {
        0
    }
}

/// Saved buffers held off their device (activation offload) right now, in the whole process.
static OFFLOADED_LIVE: AtomicUsize = AtomicUsize::new(0);

/// Held by a saved buffer that a rule keeps off its device (in host memory) until backward
/// needs it. While any is alive, backward plans the order of its nodes and calls
/// [`Backward::prefetch`] ahead of each rule; with none alive it plans nothing extra.
#[derive(Debug)]
pub struct OffloadedSave(());

impl OffloadedSave {
    /// Counts one more saved buffer off its device until the token drops.
    pub fn new() -> Self {
        OFFLOADED_LIVE.fetch_add(1, Ordering::Relaxed);
        OffloadedSave(())
    }

    /// How many saved buffers are off their device now, process-wide.
    pub fn live() -> usize {
        OFFLOADED_LIVE.load(Ordering::Relaxed)
    }
}

impl Default for OffloadedSave {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for OffloadedSave {
    fn drop(&mut self) {
        OFFLOADED_LIVE.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Any closure of the right shape is a backward rule that saves nothing visible.
impl<G, F> Backward<G> for F
where
    G: GradValue,
    F: Fn(&G, &[bool]) -> Result<InputGrads<G>, BoxError> + Send + Sync,
{
    fn backward(
        &self,
        _ctx: &BackwardContext<'_, G>,
        grad: &G,
        wanted: &[bool],
    ) -> Result<InputGrads<G>, BoxError> {
        self(grad, wanted)
    }
}

/// What kind of node this is, for drawing and for the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeKind {
    /// An ordinary op.
    Op,
    /// A leaf that requires grad: gradients reaching it accumulate into its `.grad`.
    Leaf,
    /// A device move; its backward sends the gradient back to `from`.
    Transfer {
        /// Source device of the move.
        from: Device,
        /// Target device of the move.
        to: Device,
    },
}

/// How a node describes itself in DOT output and traces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeMeta {
    /// The op's name (`mul`, `matmul`, `to_device`, `leaf`).
    pub op: &'static str,
    /// Shape of the op's output.
    pub shape: SmallVec<[usize; 4]>,
    /// Dtype of the op's output.
    pub dtype: &'static str,
    /// Device of the op's output.
    pub device: Device,
    /// Op, leaf or transfer.
    pub kind: NodeKind,
}

impl NodeMeta {
    /// An op node describing an output of `shape`, `dtype` on `device`.
    pub fn op(op: &'static str, shape: &[usize], dtype: &'static str, device: Device) -> Self {
        Self {
            op,
            shape: shape.into(),
            dtype,
            device,
            kind: NodeKind::Op,
        }
    }

    /// A scalar `f64` op node on the CPU, as the teaching examples use.
    pub fn scalar(op: &'static str) -> Self {
        Self::op(op, &[], "f64", Device::Cpu)
    }

    /// The same description, as a leaf.
    pub fn into_leaf(self) -> Self {
        Self {
            kind: NodeKind::Leaf,
            ..self
        }
    }
}
