//! What a node is: its backward rule, its description, and the gradient-value trait.

use smallvec::SmallVec;

use crate::BoxError;

/// Gradients returned by a backward rule, one per input slot (`None` where not wanted).
pub type InputGrads<G> = SmallVec<[Option<G>; 2]>;

/// A value gradients are made of: `f64` in teaching examples, tensors in the runtime.
pub trait GradValue: Clone + Send + Sync + 'static {
    /// Adds `other` into `self` (the same gradient reaching a node twice).
    fn accumulate(&mut self, other: Self) -> Result<(), BoxError>;
    /// A short description for traces: shape and norm for tensors, the value for scalars.
    fn describe(&self) -> String;
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

/// The backward rule of one recorded op.
pub trait Backward<G>: Send + Sync {
    /// Given the gradient of the op's output, returns the gradient of each input.
    ///
    /// `wanted[i]` says whether input `i` needs a gradient; a rule may skip the others and
    /// return `None` for them.
    fn backward(&self, grad: &G, wanted: &[bool]) -> Result<InputGrads<G>, BoxError>;

    /// Bytes of tensors this rule saved from the forward pass.
    fn saved_bytes(&self) -> usize {
        0
    }
}

/// Any closure of the right shape is a backward rule that saves nothing visible.
impl<G, F> Backward<G> for F
where
    F: Fn(&G, &[bool]) -> Result<InputGrads<G>, BoxError> + Send + Sync,
{
    fn backward(&self, grad: &G, wanted: &[bool]) -> Result<InputGrads<G>, BoxError> {
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
        from: String,
        /// Target device of the move.
        to: String,
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
    pub device: String,
    /// Op, leaf or transfer.
    pub kind: NodeKind,
}

impl NodeMeta {
    /// An op node describing an output of `shape`, `dtype` on `device`.
    pub fn op(
        op: &'static str,
        shape: &[usize],
        dtype: &'static str,
        device: impl Into<String>,
    ) -> Self {
        Self {
            op,
            shape: shape.into(),
            dtype,
            device: device.into(),
            kind: NodeKind::Op,
        }
    }

    /// A scalar `f64` op node on the CPU, as the teaching examples use.
    pub fn scalar(op: &'static str) -> Self {
        Self::op(op, &[], "f64", "cpu")
    }

    /// The same description, as a leaf.
    pub fn into_leaf(self) -> Self {
        Self {
            kind: NodeKind::Leaf,
            ..self
        }
    }
}
