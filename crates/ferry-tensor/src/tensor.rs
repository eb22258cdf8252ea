//! The tensor type: shared storage, a strided layout, and autograd metadata.

use std::fmt;
use std::sync::Arc;

use ferry_graph::{GradSlot, NodeHandle};
use ferry_memory::{DType, Device, Element, HostBuffer};

use crate::layout::{Layout, Shape, shape_bytes};
use crate::storage::{Buffer, Storage};
use crate::{Result, TensorError};

/// An n-dimensional array on a device, with optional gradient tracking.
///
/// Cloning is cheap and yields the *same* tensor (like a second Python reference): both see
/// the same gradient. [`Tensor::detach`] gives a tensor over the same data without history.
#[derive(Clone)]
pub struct Tensor(pub(crate) Arc<Inner>);

pub(crate) struct Inner {
    pub(crate) storage: Arc<Storage>,
    pub(crate) layout: Layout,
    pub(crate) autograd: Option<Autograd>,
    /// Made in an inference scope, or computed from such data (see `Tensor::is_inference`).
    pub(crate) inference: bool,
}

/// A tensor's place in the graph: its node, and for leaves where its gradient lands.
pub(crate) struct Autograd {
    pub(crate) node: NodeHandle<Tensor>,
    pub(crate) grad: Option<GradSlot<Tensor>>,
}

impl Tensor {
    /// A tensor over `storage` seen through `layout`, with no gradient history.
    ///
    /// The layout must stay inside the storage: every element it reaches, read as the
    /// storage's dtype, lies within the storage's bytes, and its shape is small enough to
    /// allocate. Anything else is [`TensorError::BadLayout`] (or [`TensorError::TooLarge`]):
    /// kernels trust a tensor's layout, and on a GPU a layout past the end of its buffer would
    /// read or write other memory.
    pub fn from_storage(storage: Arc<Storage>, layout: Layout) -> Result<Self> {
        layout.check_fits("from_storage", storage.dtype(), storage.bytes())?;
        storage.check_aligned("from_storage")?;
        Ok(Self::over(storage, layout))
    }

    /// A tensor over a layout already known to fit its storage.
    fn over(storage: Arc<Storage>, layout: Layout) -> Self {
        Tensor(Arc::new(Inner {
            storage,
            layout,
            autograd: None,
            inference: ferry_graph::is_inference_mode(),
        }))
    }

    /// A contiguous host tensor owning `buffer`, which must hold exactly the shape's bytes.
    pub fn from_host_buffer(buffer: HostBuffer, dtype: DType, shape: &[usize]) -> Result<Self> {
        let bytes = shape_bytes("from_host_buffer", shape, dtype)?;
        if bytes != buffer.len() {
            return Err(TensorError::LengthMismatch {
                op: "from_host_buffer",
                len: buffer.len() / dtype.size(),
                shape: shape.into(),
                numel: bytes / dtype.size(),
            });
        }
        let storage = Storage::new(Buffer::Host(buffer), dtype, Device::Cpu);
        Ok(Self::from_shape(storage, shape))
    }

    /// A host tensor holding `data` in row-major order.
    pub fn from_vec<T: Element>(data: Vec<T>, shape: &[usize]) -> Result<Self> {
        Self::from_slice(&data, shape)
    }

    /// A host tensor holding a copy of `data` in row-major order.
    pub fn from_slice<T: Element>(data: &[T], shape: &[usize]) -> Result<Self> {
        let numel = shape_bytes("from_slice", shape, T::DTYPE)? / T::DTYPE.size();
        if data.len() != numel {
            return Err(TensorError::LengthMismatch {
                op: "from_slice",
                len: data.len(),
                shape: shape.into(),
                numel,
            });
        }
        Self::from_host_buffer(HostBuffer::from_slice(data)?, T::DTYPE, shape)
    }

    /// A 0-dimensional host tensor.
    pub fn scalar<T: Element>(value: T) -> Self {
        Self::from_slice(&[value], &[]).expect("one value fills a scalar")
    }

    /// The dimensions.
    pub fn shape(&self) -> &[usize] {
        self.0.layout.shape()
    }

    /// Size of dimension `axis` (negative counts from the end).
    pub fn dim(&self, axis: isize) -> Result<usize> {
        Ok(self.shape()[self.axis("dim", axis)?])
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.0.layout.ndim()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.0.layout.numel()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.0.storage.dtype()
    }

    /// Where the data lives.
    pub fn device(&self) -> Device {
        self.0.storage.device()
    }

    /// Shape, strides and offset.
    pub fn layout(&self) -> &Layout {
        &self.0.layout
    }

    /// The shared storage (for crates that move bytes, like ferry-transfer).
    pub fn storage(&self) -> &Arc<Storage> {
        &self.0.storage
    }

    /// Bytes the elements take (not the storage, which views may share). Exact: every tensor's
    /// shape passed the checked size computation when it was made.
    pub fn nbytes(&self) -> usize {
        self.numel().saturating_mul(self.dtype().size())
    }

    /// Whether the elements are row-major without gaps.
    pub fn is_contiguous(&self) -> bool {
        self.0.layout.is_contiguous()
    }

    /// Whether two tensors share storage.
    pub fn shares_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.0.storage, &other.0.storage)
    }

    /// Resolves a possibly negative axis.
    pub(crate) fn axis(&self, op: &'static str, axis: isize) -> Result<usize> {
        let ndim = self.ndim();
        let resolved = if axis < 0 { axis + ndim as isize } else { axis };
        if resolved < 0 || resolved as usize >= ndim {
            return Err(TensorError::AxisOutOfRange { op, axis, ndim });
        }
        Ok(resolved as usize)
    }

    /// A tensor over the same data with no gradient history: records nothing, and when this was
    /// the last reference to its node, that node and what only it kept alive are pruned.
    pub fn detach(&self) -> Tensor {
        self.with_layout(self.0.layout.clone())
    }

    /// The same tensor viewed through another layout, keeping no history (inference data stays
    /// inference data).
    pub(crate) fn with_layout(&self, layout: Layout) -> Tensor {
        Tensor(Arc::new(Inner {
            storage: Arc::clone(&self.0.storage),
            layout,
            autograd: None,
            inference: self.0.inference || ferry_graph::is_inference_mode(),
        }))
    }

    /// A contiguous tensor over storage just allocated for `shape` (its size came from
    /// [`shape_bytes`], so the layout fits by construction).
    pub(crate) fn from_shape(storage: Storage, shape: &[usize]) -> Tensor {
        Tensor::from_contiguous(storage, Layout::contiguous(shape))
    }

    /// A tensor over storage just allocated for the contiguous `layout` (a kernel's output).
    pub(crate) fn from_contiguous(storage: Storage, layout: Layout) -> Tensor {
        debug_assert!(
            layout.is_contiguous()
                && layout
                    .check_fits("from_contiguous", storage.dtype(), storage.bytes())
                    .is_ok()
        );
        Tensor::over(Arc::new(storage), layout)
    }

    pub(crate) fn dims(&self) -> Shape {
        self.shape().into()
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Tensor[{:?}, {}, {}",
            self.shape(),
            self.dtype(),
            self.device()
        )?;
        if self.requires_grad() {
            write!(f, ", requires_grad")?;
        }
        // Small tensors show their values, read from any device (a read, not a move).
        if self.numel() <= 16
            && let Ok(values) = self.to_vec_f64()
        {
            write!(f, ", {values:?}")?;
        }
        write!(f, "]")
    }
}
