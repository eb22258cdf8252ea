//! Views and rearrangements: transpose, reshape, narrow, chunk, cat, broadcast, squeeze.

use crate::autograd::record;
use crate::layout::{Shape, shape_bytes};
use crate::{Result, Tensor, TensorError, backend, rules};

impl Tensor {
    /// Swaps two dimensions, as a view.
    pub fn transpose(&self, a: isize, b: isize) -> Result<Tensor> {
        let (a, b) = (self.axis("transpose", a)?, self.axis("transpose", b)?);
        let out = self.with_layout(self.layout().transpose(a, b));
        Ok(record(out, "transpose", &[self], || rules::transpose(a, b)))
    }

    /// The transpose of a matrix (the last two dimensions swapped).
    pub fn t(&self) -> Result<Tensor> {
        if self.ndim() < 2 {
            return Err(TensorError::InvalidArgument {
                op: "t",
                message: format!(
                    "needs at least 2 dimensions, got shape {:?}; reshape first",
                    self.shape()
                ),
            });
        }
        self.transpose(-2, -1)
    }

    /// The same elements in a new shape: a view when the data is contiguous, else a copy.
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        let numel = shape_bytes("reshape", shape, self.dtype())? / self.dtype().size();
        if numel != self.numel() {
            return Err(TensorError::BadReshape {
                from: self.dims(),
                from_numel: self.numel(),
                to: shape.into(),
                to_numel: numel,
            });
        }
        let out = match self.layout().reshape_view(shape) {
            Some(layout) => self.with_layout(layout),
            None => {
                backend::contiguous(self)?.with_layout(crate::layout::Layout::contiguous(shape))
            }
        };
        Ok(record(out, "reshape", &[self], || rules::reshape(self)))
    }

    /// A contiguous tensor with these elements (`self` itself when already contiguous).
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        let out = backend::contiguous(self)?;
        Ok(record(out, "contiguous", &[self], rules::identity))
    }

    /// A new tensor with storage of its own holding these elements, contiguous (a copy even when
    /// `self` is contiguous; the gradient passes through).
    ///
    /// Outside an inference scope, a copy of inference data is a normal tensor: the way out
    /// that `with_grad`'s error names.
    pub fn copy(&self) -> Result<Tensor> {
        let out = backend::contiguous(self)?;
        if self.is_inference() && !ferry_graph::is_inference_mode() {
            return Ok(out); // made outside the scope: not inference data, and nothing to record
        }
        Ok(record(out, "copy", &[self], rules::identity))
    }

    /// Overwrites this tensor's elements, in place, with `src`'s (same shape, dtype and device;
    /// views write through to their storage). In-place writes bypass the graph, so a tensor
    /// that requires grad can only be assigned with grad mode off, as optimizer steps do.
    pub fn assign(&self, src: &Tensor) -> Result<()> {
        self.same_kind("assign", src)?;
        if self.shape() != src.shape() {
            return Err(TensorError::ShapeMismatch {
                op: "assign",
                lhs: self.dims(),
                rhs: src.dims(),
                hint: "assign needs the same shape; broadcast_to or reshape the source first",
            });
        }
        if self.requires_grad() && ferry_graph::is_grad_enabled() {
            return Err(TensorError::InvalidArgument {
                op: "assign",
                message: "this tensor requires grad; update it inside `no_grad()` (as optimizer steps do)".into(),
            });
        }
        // Reading and writing one storage at once would deadlock its lock: copy the source out.
        let src = if src.shares_storage(self) {
            src.detach().copy()?
        } else {
            src.detach()
        };
        backend::assign(self, &src)
    }

    /// `len` indices of `axis` from `start`, as a view.
    pub fn narrow(&self, axis: isize, start: usize, len: usize) -> Result<Tensor> {
        let axis = self.axis("narrow", axis)?;
        let size = self.shape()[axis];
        let end = start.saturating_add(len);
        if end > size {
            return Err(TensorError::RangeOutOfBounds {
                op: "narrow",
                axis,
                start,
                end,
                len: size,
            });
        }
        let out = self.with_layout(self.layout().narrow(axis, start, len));
        Ok(record(out, "narrow", &[self], || {
            rules::narrow(self, axis, start)
        }))
    }

    /// Splits `axis` into `chunks` views of equal size (the last may be smaller), like PyTorch.
    pub fn chunk(&self, chunks: usize, axis: isize) -> Result<Vec<Tensor>> {
        if chunks == 0 {
            return Err(TensorError::InvalidArgument {
                op: "chunk",
                message: "the number of chunks must be at least 1".into(),
            });
        }
        let size = self.shape()[self.axis("chunk", axis)?];
        let step = size.div_ceil(chunks).max(1);
        (0..size)
            .step_by(step)
            .map(|start| self.narrow(axis, start, step.min(size - start)))
            .collect()
    }

    /// Packs tensors of one dtype and device into one 1-D tensor, each starting at a multiple of
    /// `align` bytes; returns it with each part's element offset. On a GPU this is a few gather
    /// launches however many parts there are: state dicts move as one buffer. Records nothing.
    pub fn pack(parts: &[&Tensor], align: usize) -> Result<(Tensor, Vec<usize>)> {
        let first = parts.first().ok_or_else(|| TensorError::InvalidArgument {
            op: "pack",
            message: "needs at least one tensor".into(),
        })?;
        let size = first.dtype().size();
        if align == 0 || !align.is_multiple_of(size) {
            return Err(TensorError::InvalidArgument {
                op: "pack",
                message: format!(
                    "align must be a positive multiple of the element size ({size} bytes), got {align}"
                ),
            });
        }
        let mut end = 0usize;
        let mut offsets = Vec::with_capacity(parts.len());
        for part in parts {
            first.same_kind("pack", part)?;
            let at = end.checked_next_multiple_of(align);
            match at.and_then(|at| Some((at, at.checked_add(part.nbytes())?))) {
                Some((at, part_end)) if part_end <= ferry_memory::size::MAX_BYTES => {
                    offsets.push(at);
                    end = part_end;
                }
                _ => {
                    let total = [parts
                        .iter()
                        .map(|p| p.numel())
                        .fold(0, usize::saturating_add)];
                    return Err(TensorError::too_large("pack", &total, first.dtype()));
                }
            }
        }
        let dense: Vec<Tensor> = parts
            .iter()
            .map(|p| {
                if p.is_contiguous() {
                    Ok(p.detach())
                } else {
                    p.detach().copy()
                }
            })
            .collect::<Result<_>>()?;
        let packed = backend::pack(&dense, &offsets, end)?;
        Ok((packed, offsets.iter().map(|o| o / size).collect()))
    }

    /// Joins tensors along `axis`; all other dimensions must match.
    pub fn cat(parts: &[&Tensor], axis: isize) -> Result<Tensor> {
        let first = parts.first().ok_or_else(|| TensorError::InvalidArgument {
            op: "cat",
            message: "needs at least one tensor".into(),
        })?;
        let axis = first.axis("cat", axis)?;
        let mut shape: Shape = first.dims();
        for part in &parts[1..] {
            first.same_kind("cat", part)?;
            let same_rank = part.ndim() == first.ndim();
            let others_match =
                same_rank && (0..shape.len()).all(|d| d == axis || part.shape()[d] == shape[d]);
            if !others_match {
                return Err(TensorError::ShapeMismatch {
                    op: "cat",
                    lhs: first.dims(),
                    rhs: part.dims(),
                    hint: "every dimension but the joined one must match",
                });
            }
            // Saturating: the size check below refuses a joined axis that overflows.
            shape[axis] = shape[axis].saturating_add(part.shape()[axis]);
        }
        shape_bytes("cat", &shape, first.dtype())?;
        let owned: Vec<Tensor> = parts.iter().map(|t| (*t).clone()).collect();
        let out = backend::cat(&owned, axis, &shape)?;
        Ok(record(out, "cat", parts, || rules::cat(parts, axis)))
    }

    /// Repeats size-1 dimensions (and adds leading ones) to reach `shape`, as a view.
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Tensor> {
        // A view, but one whose elements could not be addressed is refused now rather than
        // when something tries to allocate its copy.
        shape_bytes("broadcast_to", shape, self.dtype())?;
        let layout =
            self.layout()
                .broadcast_to(shape)
                .ok_or_else(|| TensorError::ShapeMismatch {
                    op: "broadcast_to",
                    lhs: self.dims(),
                    rhs: shape.into(),
                    hint: "each dimension must equal the target or be 1",
                })?;
        let out = self.with_layout(layout);
        Ok(record(out, "broadcast_to", &[self], || {
            rules::broadcast(self)
        }))
    }

    /// Inserts a dimension of size 1 at `axis` (which may equal `ndim`).
    pub fn unsqueeze(&self, axis: isize) -> Result<Tensor> {
        let ndim = self.ndim() as isize;
        let resolved = if axis < 0 { axis + ndim + 1 } else { axis };
        if !(0..=ndim).contains(&resolved) {
            return Err(TensorError::AxisOutOfRange {
                op: "unsqueeze",
                axis,
                ndim: self.ndim() + 1,
            });
        }
        let mut shape = self.shape().to_vec();
        shape.insert(resolved as usize, 1);
        self.view_as(&shape)
    }

    /// Removes dimension `axis`, which must have size 1.
    pub fn squeeze(&self, axis: isize) -> Result<Tensor> {
        let axis = self.axis("squeeze", axis)?;
        if self.shape()[axis] != 1 {
            return Err(TensorError::InvalidArgument {
                op: "squeeze",
                message: format!("axis {axis} has size {}, not 1", self.shape()[axis]),
            });
        }
        let mut shape = self.shape().to_vec();
        shape.remove(axis);
        self.view_as(&shape)
    }

    /// A view in a shape that differs only by size-1 dimensions, keeping strides (no copy even
    /// when the tensor is not contiguous).
    fn view_as(&self, shape: &[usize]) -> Result<Tensor> {
        let mut strides = Vec::with_capacity(shape.len());
        let mut src = self
            .shape()
            .iter()
            .zip(self.layout().strides())
            .filter(|(d, _)| **d != 1);
        for &d in shape {
            strides.push(if d == 1 {
                0
            } else {
                *src.next().expect("same non-1 dims").1
            });
        }
        let layout =
            crate::layout::Layout::from_parts(shape.into(), strides.into(), self.layout().offset());
        let out = self.with_layout(layout);
        Ok(record(out, "reshape", &[self], || rules::reshape(self)))
    }
}
