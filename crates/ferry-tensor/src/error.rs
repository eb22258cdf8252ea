use ferry_cuda::CudaLibError;
use ferry_graph::GraphError;
use ferry_memory::{DType, Device, MemoryError};
use thiserror::Error;

use crate::layout::{Layout, Shape};

/// Result of tensor operations.
pub type Result<T, E = TensorError> = std::result::Result<T, E>;

/// Everything a tensor operation can reject; each message says how to fix the call.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TensorError {
    /// Two shapes that must agree do not.
    #[error("{op}: shapes {lhs:?} and {rhs:?} do not match: {hint}")]
    ShapeMismatch {
        /// The op.
        op: &'static str,
        /// First shape.
        lhs: Shape,
        /// Second shape.
        rhs: Shape,
        /// What the op needs.
        hint: &'static str,
    },
    /// Two dtypes that must agree do not.
    #[error(
        "{op}: dtypes {lhs} and {rhs} differ: cast one first, e.g. `.to_dtype(DType::{rhs_upper})`"
    )]
    DTypeMismatch {
        /// The op.
        op: &'static str,
        /// First dtype.
        lhs: DType,
        /// Second dtype.
        rhs: DType,
        /// `rhs` in upper case, for the hint.
        rhs_upper: String,
    },
    /// Tensors on different devices met in one op.
    #[error(
        "{op}: tensors are on {lhs} and {rhs}: move one with `.to(Device::...)` (ferry never moves data implicitly)"
    )]
    DeviceMismatch {
        /// The op.
        op: &'static str,
        /// First device.
        lhs: Device,
        /// Second device.
        rhs: Device,
    },
    /// The op does not exist for this dtype.
    #[error("{op} is not defined for {dtype}: {hint}")]
    UnsupportedDType {
        /// The op.
        op: &'static str,
        /// The dtype given.
        dtype: DType,
        /// What to do instead.
        hint: &'static str,
    },
    /// The op is not available on this device.
    #[error("{op} is not available on {device} yet: move the tensor with `.to(Device::Cpu)` first")]
    UnsupportedDevice {
        /// The op.
        op: &'static str,
        /// The device.
        device: Device,
    },
    /// An axis beyond the tensor's dimensions.
    #[error(
        "{op}: axis {axis} is out of range for a tensor with {ndim} dimension(s); use 0..{ndim} or -1 for the last"
    )]
    AxisOutOfRange {
        /// The op.
        op: &'static str,
        /// The axis asked for.
        axis: isize,
        /// The tensor's number of dimensions.
        ndim: usize,
    },
    /// A range beyond an axis' length.
    #[error("{op}: range {start}..{end} is out of bounds for axis {axis} of length {len}")]
    RangeOutOfBounds {
        /// The op.
        op: &'static str,
        /// The axis.
        axis: usize,
        /// Start of the range.
        start: usize,
        /// End of the range.
        end: usize,
        /// Length of the axis.
        len: usize,
    },
    /// A reshape to a different number of elements.
    #[error(
        "reshape: cannot view {from:?} ({from_numel} elements) as {to:?} ({to_numel} elements); the element counts must match"
    )]
    BadReshape {
        /// Current shape.
        from: Shape,
        /// Elements in it.
        from_numel: usize,
        /// Requested shape.
        to: Shape,
        /// Elements in that.
        to_numel: usize,
    },
    /// Data whose length does not fit the shape.
    #[error("{op}: {len} values cannot fill shape {shape:?} ({numel} elements)")]
    LengthMismatch {
        /// The op.
        op: &'static str,
        /// Values given.
        len: usize,
        /// The shape.
        shape: Shape,
        /// Elements the shape holds.
        numel: usize,
    },
    /// A shape whose bytes cannot be addressed: the element count times the element size
    /// overflows, or passes `isize::MAX` (the most one allocation may hold). Refused before
    /// anything is allocated.
    #[error(
        "{op}: a tensor of shape {shape:?} and dtype {dtype} is too large: its element count times {size} bytes overflows the limit of {limit} bytes (isize::MAX); use smaller dimensions, or split the data",
        size = .dtype.size(),
        limit = ferry_memory::size::MAX_BYTES
    )]
    TooLarge {
        /// The op.
        op: &'static str,
        /// The shape asked for.
        shape: Shape,
        /// Its dtype.
        dtype: DType,
    },
    /// A layout that reaches outside its storage, or whose extent cannot be computed.
    #[error(
        "{op}: a layout of shape {:?}, strides {:?} and offset {} {problem}; make views with narrow, transpose or broadcast_to, or fix the strides and offset",
        .layout.shape(), .layout.strides(), .layout.offset()
    )]
    BadLayout {
        /// The op.
        op: &'static str,
        /// The layout refused (boxed: errors stay small).
        layout: Box<Layout>,
        /// What is wrong with it.
        problem: String,
    },
    /// An argument out of its domain (a chunk count of zero, a negative class index, ...).
    #[error("{op}: {message}")]
    InvalidArgument {
        /// The op.
        op: &'static str,
        /// What was wrong and what is allowed.
        message: String,
    },
    /// Backward from a tensor that is not a scalar, without an explicit gradient.
    #[error(
        "backward: the output has shape {shape:?}; call it on a scalar (e.g. `.sum()?` or `.mean()?` first) or use `backward_with(grad)`"
    )]
    NonScalarBackward {
        /// The output's shape.
        shape: Shape,
    },
    /// Backward from a tensor that has no gradient history.
    #[error(
        "backward: this tensor does not require grad and has no graph node; mark a leaf with `.with_grad()?` before computing it, outside `no_grad`"
    )]
    NoGraph,
    /// An op that needs the tensor's graph node, on a tensor without one.
    #[error(
        "{op}: this tensor does not require grad and has no graph node; mark a leaf with `.with_grad()?` before computing it, outside `no_grad`"
    )]
    NoGraphFor {
        /// The op.
        op: &'static str,
    },
    /// `autograd::grad` asked for the gradient of a tensor that does not require grad.
    #[error(
        "{op}: input {index} does not require grad, so it has no gradient; pass tensors made with `.with_grad()?` or computed from them"
    )]
    InputWithoutGrad {
        /// The op.
        op: &'static str,
        /// Position of the input.
        index: usize,
    },
    /// `autograd::grad` found no path from the outputs to an input.
    #[error(
        "grad: input {index} was not used to compute the outputs; pass `allow_unused: true` to get `None` for it instead"
    )]
    UnusedInput {
        /// Position of the input.
        index: usize,
    },
    /// A tensor a gradient rule saved was written in place before backward used it.
    #[error(
        "{tensor} of `{op}` (shape {shape:?}), saved for the gradient, was modified in place since (version {version}, saved at {saved_version}); \
         the gradient would be wrong. Write into a copy (`.copy()?`) instead, or run the in-place update after backward"
    )]
    ModifiedInPlace {
        /// The op whose rule saved the tensor.
        op: &'static str,
        /// Which tensor: `input 1`, `the output`.
        tensor: String,
        /// Its shape.
        shape: Shape,
        /// Version of its storage when it was saved.
        saved_version: u64,
        /// Version now.
        version: u64,
    },
    /// Gradients asked of a dtype that cannot carry them.
    #[error(
        "requires_grad: {dtype} tensors cannot require grad; only float tensors can (cast with `.to_dtype(DType::F32)`)"
    )]
    NotDifferentiable {
        /// The dtype.
        dtype: DType,
    },
    /// Reading host data out of a device tensor.
    #[error("{op}: the tensor is on {device}; move it first with `.to(Device::Cpu)`")]
    NotOnHost {
        /// The op.
        op: &'static str,
        /// Where the tensor is.
        device: Device,
    },
    /// Typed access to bytes that do not start at a multiple of the element size.
    #[error(
        "{op}: the data at address {address:#x} is not aligned to the {align} bytes a {dtype} element needs (foreign memory viewed at an odd offset, say); copy it into aligned memory first (torch: `.clone()`, numpy: `.copy()`)"
    )]
    Misaligned {
        /// The operation that met the data.
        op: &'static str,
        /// Where the data starts (a host or device address).
        address: usize,
        /// The alignment the dtype needs.
        align: usize,
        /// The element type.
        dtype: DType,
    },
    /// Leaving the graph (to ndarray, to a file) with a tensor whose history would be lost.
    #[error("{op}: the tensor requires grad; call `.detach()` first to leave the graph explicitly")]
    RequiresGrad {
        /// The op.
        op: &'static str,
    },
    /// A memory or device error.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// A CUDA library's error (cuBLAS, cuBLASLt, cuDNN, NCCL, NVRTC, a kernel launch); the
    /// memory and device errors met inside a library call are [`TensorError::Memory`].
    #[error(transparent)]
    Cuda(CudaLibError),
    /// A backward error.
    #[error(transparent)]
    Graph(#[from] GraphError),
}

impl From<CudaLibError> for TensorError {
    /// A memory or device error raised inside a library call stays [`TensorError::Memory`], as
    /// it is when raised anywhere else.
    fn from(error: CudaLibError) -> Self {
        match error {
            CudaLibError::Memory(error) => TensorError::Memory(error),
            error => TensorError::Cuda(error),
        }
    }
}

impl TensorError {
    pub(crate) fn too_large(op: &'static str, shape: &[usize], dtype: DType) -> Self {
        TensorError::TooLarge {
            op,
            shape: shape.into(),
            dtype,
        }
    }

    pub(crate) fn dtype_mismatch(op: &'static str, lhs: DType, rhs: DType) -> Self {
        TensorError::DTypeMismatch {
            op,
            lhs,
            rhs,
            rhs_upper: rhs.name().to_uppercase(),
        }
    }
}
