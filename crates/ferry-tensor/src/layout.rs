//! Shapes, strides and offsets: how a tensor's elements sit in its storage.

use smallvec::SmallVec;

use crate::{Result, TensorError};

/// Dimensions of a tensor.
pub type Shape = SmallVec<[usize; 4]>;

/// Where each element of a tensor is: `storage[offset + Σ index[i] * strides[i]]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    shape: Shape,
    strides: Shape,
    offset: usize,
}

impl Layout {
    /// A contiguous row-major layout of `shape`.
    pub fn contiguous(shape: &[usize]) -> Self {
        Self {
            shape: shape.into(),
            strides: contiguous_strides(shape),
            offset: 0,
        }
    }

    /// A layout from its parts: one stride per dimension, and an element count and a last
    /// index that can be computed in a `usize`. Whether it fits a storage is checked where it
    /// meets one ([`Tensor::from_storage`](crate::Tensor::from_storage)).
    pub fn new(shape: Shape, strides: Shape, offset: usize) -> Result<Self> {
        let layout = Self::from_parts(shape, strides, offset);
        match layout.defect() {
            Some(problem) => Err(layout.bad("Layout::new", problem)),
            None => Ok(layout),
        }
    }

    /// What makes this layout unusable whatever its storage, if anything.
    fn defect(&self) -> Option<String> {
        if self.shape.len() != self.strides.len() {
            Some(format!(
                "has {} dimension(s) but {} stride(s)",
                self.shape.len(),
                self.strides.len()
            ))
        } else if ferry_memory::size::checked_numel(&self.shape).is_none() {
            Some("has more elements than a usize can count".to_string())
        } else if self.last_index().is_none() {
            Some("reaches past usize::MAX elements (a stride or the offset is too large)".into())
        } else {
            None
        }
    }

    /// A layout from parts derived from a valid one (a view of it): nothing to check.
    pub(crate) fn from_parts(shape: Shape, strides: Shape, offset: usize) -> Self {
        Self {
            shape,
            strides,
            offset,
        }
    }

    /// The dimensions.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Elements to step per index of each dimension.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// Index of the first element in storage.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements (`usize::MAX` when they cannot be counted, which no tensor's layout
    /// reaches: allocations and [`Tensor::from_storage`](crate::Tensor::from_storage) refuse
    /// such shapes).
    pub fn numel(&self) -> usize {
        numel(&self.shape)
    }

    /// Whether the elements are row-major and gap-free (offset may be non-zero).
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1;
        for (&dim, &stride) in self.shape.iter().zip(&self.strides).rev() {
            if dim != 1 && stride != expected {
                return false;
            }
            expected = expected.saturating_mul(dim);
        }
        true
    }

    /// Storage span `[offset, end)` this layout can touch; `None` when it has no elements.
    /// Saturates at `usize::MAX` for a layout whose reach cannot be computed.
    pub fn span(&self) -> Option<(usize, usize)> {
        if self.numel() == 0 {
            return None;
        }
        let last = self.last_index().unwrap_or(usize::MAX);
        Some((self.offset, last.saturating_add(1)))
    }

    /// Storage index of the last element this layout reaches (`offset` when it is empty), or
    /// `None` when a stride or the offset makes it overflow.
    fn last_index(&self) -> Option<usize> {
        if numel(&self.shape) == 0 {
            return Some(self.offset);
        }
        self.shape
            .iter()
            .zip(&self.strides)
            .try_fold(self.offset, |end, (&d, &s)| {
                (d - 1).checked_mul(s)?.checked_add(end)
            })
    }

    /// Checks that this layout, read as elements of `dtype`, stays inside a storage of
    /// `storage_bytes` bytes, and that its shape is small enough to allocate.
    pub(crate) fn check_fits(
        &self,
        op: &'static str,
        dtype: ferry_memory::DType,
        storage_bytes: usize,
    ) -> Result<()> {
        shape_bytes(op, &self.shape, dtype)?;
        if let Some(problem) = self.defect() {
            return Err(self.bad(op, problem));
        }
        let last = self.last_index().unwrap_or(usize::MAX);
        // An empty layout touches nothing but may start at the end of its storage.
        let end = if self.numel() == 0 {
            last
        } else {
            last.saturating_add(1)
        };
        let size = dtype.size();
        match end.checked_mul(size) {
            Some(end_bytes) if end_bytes <= storage_bytes => Ok(()),
            _ => {
                let reach = end
                    .checked_mul(size)
                    .map_or_else(|| "past usize::MAX".to_string(), |b| format!("{b}"));
                let problem = format!(
                    "needs {reach} bytes of {dtype} storage, but the storage holds {storage_bytes} bytes ({} elements)",
                    storage_bytes / size
                );
                Err(self.bad(op, problem))
            }
        }
    }

    fn bad(&self, op: &'static str, problem: String) -> TensorError {
        TensorError::BadLayout {
            op,
            layout: Box::new(self.clone()),
            problem,
        }
    }

    /// Swaps two dimensions (a view).
    pub fn transpose(&self, a: usize, b: usize) -> Self {
        let mut out = self.clone();
        out.shape.swap(a, b);
        out.strides.swap(a, b);
        out
    }

    /// Keeps `len` indices of `axis` starting at `start` (a view).
    pub fn narrow(&self, axis: usize, start: usize, len: usize) -> Self {
        let mut out = self.clone();
        // Saturating: an out-of-range start gives a layout no storage accepts, never a wrap.
        out.offset = out
            .offset
            .saturating_add(start.saturating_mul(self.strides[axis]));
        out.shape[axis] = len;
        out
    }

    /// Repeats size-1 dimensions (and adds leading ones) to reach `shape`, by zero strides.
    pub fn broadcast_to(&self, shape: &[usize]) -> Option<Self> {
        if shape.len() < self.ndim() {
            return None;
        }
        let lead = shape.len() - self.ndim();
        let mut strides: Shape = SmallVec::from_elem(0, shape.len());
        for (i, (&dim, &stride)) in self.shape.iter().zip(&self.strides).enumerate() {
            match (dim, shape[lead + i]) {
                (d, t) if d == t => strides[lead + i] = stride,
                (1, _) => strides[lead + i] = 0,
                _ => return None,
            }
        }
        Some(Self::from_parts(shape.into(), strides, self.offset))
    }

    /// The same elements with a new shape, without copying, when the strides allow it.
    pub fn reshape_view(&self, shape: &[usize]) -> Option<Self> {
        self.is_contiguous().then(|| Self {
            shape: shape.into(),
            strides: contiguous_strides(shape),
            offset: self.offset,
        })
    }

    /// Storage index of every element, in row-major order.
    pub fn offsets(&self) -> StridedOffsets<'_> {
        StridedOffsets::new(self)
    }

    /// The layout as rows of its last dimension: each item is a row's first storage index;
    /// [`Layout::row`] gives the rows' common length and stride. Strided kernels loop over a
    /// row with a plain stride, which costs far less per element than a full index walk.
    pub fn row_starts(&self) -> StridedOffsets<'static> {
        let outer = match self.shape.len() {
            0 => Layout::from_parts(Shape::new(), Shape::new(), self.offset),
            n => Layout::from_parts(
                self.shape[..n - 1].into(),
                self.strides[..n - 1].into(),
                self.offset,
            ),
        };
        StridedOffsets::owned(outer)
    }

    /// `(length, stride)` of the rows [`Layout::row_starts`] walks.
    pub fn row(&self) -> (usize, usize) {
        match (self.shape.last(), self.strides.last()) {
            (Some(&len), Some(&stride)) => (len, stride),
            _ => (1, 0),
        }
    }
}

/// Elements in `shape`; a zero dimension makes it 0 even when the others would overflow, and
/// a count that overflows saturates at `usize::MAX` (which every allocation refuses).
pub(crate) fn numel(shape: &[usize]) -> usize {
    ferry_memory::size::checked_numel(shape).unwrap_or(usize::MAX)
}

/// Bytes a contiguous tensor of `shape` and `dtype` takes, or [`TensorError::TooLarge`] naming
/// the shape when the element count times the element size overflows (or passes
/// [`MAX_BYTES`](ferry_memory::size::MAX_BYTES)). Every allocation of a tensor sizes itself
/// here, before asking for memory.
pub(crate) fn shape_bytes(
    op: &'static str,
    shape: &[usize],
    dtype: ferry_memory::DType,
) -> Result<usize> {
    ferry_memory::size::shape_bytes(shape, dtype)
        .ok_or_else(|| TensorError::too_large(op, shape, dtype))
}

/// Row-major strides of a contiguous tensor of `shape`.
pub fn contiguous_strides(shape: &[usize]) -> Shape {
    let mut strides: Shape = SmallVec::from_elem(1, shape.len());
    for i in (0..shape.len().saturating_sub(1)).rev() {
        // Saturating: only a shape with a zero dimension (no elements to step over) or one
        // that no allocation accepts reaches the limit.
        strides[i] = strides[i + 1].saturating_mul(shape[i + 1]);
    }
    strides
}

/// The shape both operands broadcast to, numpy-style.
pub fn broadcast_shapes(op: &'static str, lhs: &[usize], rhs: &[usize]) -> Result<Shape> {
    let ndim = lhs.len().max(rhs.len());
    let dim = |s: &[usize], i: usize| {
        if i < ndim - s.len() {
            1
        } else {
            s[i - (ndim - s.len())]
        }
    };
    (0..ndim)
        .map(|i| match (dim(lhs, i), dim(rhs, i)) {
            (a, b) if a == b => Ok(a),
            (1, b) => Ok(b),
            (a, 1) => Ok(a),
            _ => Err(TensorError::ShapeMismatch {
                op,
                lhs: lhs.into(),
                rhs: rhs.into(),
                hint: "shapes must be equal or 1 in each trailing dimension to broadcast",
            }),
        })
        .collect()
}

/// Iterates storage offsets of a strided layout in row-major order.
pub struct StridedOffsets<'a> {
    layout: std::borrow::Cow<'a, Layout>,
    index: Shape,
    next: Option<usize>,
}

impl<'a> StridedOffsets<'a> {
    fn new(layout: &'a Layout) -> Self {
        Self::from_cow(std::borrow::Cow::Borrowed(layout))
    }

    fn owned(layout: Layout) -> StridedOffsets<'static> {
        StridedOffsets::from_cow(std::borrow::Cow::Owned(layout))
    }

    fn from_cow(layout: std::borrow::Cow<'a, Layout>) -> Self {
        Self {
            index: SmallVec::from_elem(0, layout.ndim()),
            next: (layout.numel() > 0).then_some(layout.offset),
            layout,
        }
    }
}

impl Iterator for StridedOffsets<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        let current = self.next?;
        let (shape, strides) = (&self.layout.shape, &self.layout.strides);
        let mut offset = current;
        let mut axis = shape.len();
        loop {
            if axis == 0 {
                self.next = None;
                break;
            }
            axis -= 1;
            self.index[axis] += 1;
            offset += strides[axis];
            if self.index[axis] < shape[axis] {
                self.next = Some(offset);
                break;
            }
            offset -= strides[axis] * shape[axis];
            self.index[axis] = 0;
        }
        Some(current)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transposed_offsets_walk_columns() {
        let t = Layout::contiguous(&[2, 3]).transpose(0, 1);
        assert!(!t.is_contiguous());
        assert_eq!(t.offsets().collect::<Vec<_>>(), [0, 3, 1, 4, 2, 5]);
    }

    #[test]
    fn broadcast_repeats_by_zero_strides() {
        let b = Layout::contiguous(&[3, 1])
            .broadcast_to(&[2, 3, 2])
            .unwrap();
        assert_eq!(b.strides(), &[0, 1, 0]);
        assert_eq!(
            b.offsets().collect::<Vec<_>>(),
            [0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2]
        );
        assert!(Layout::contiguous(&[3]).broadcast_to(&[2]).is_none());
        assert_eq!(
            broadcast_shapes("add", &[4, 1, 3], &[2, 1])
                .unwrap()
                .as_slice(),
            &[4, 2, 3]
        );
        assert!(broadcast_shapes("add", &[3], &[4]).is_err());
    }

    #[test]
    fn narrow_moves_the_offset_and_size_one_dims_do_not_break_contiguity() {
        let n = Layout::contiguous(&[4, 3]).narrow(0, 1, 2);
        assert_eq!(n.offset(), 3);
        assert!(n.is_contiguous());
        assert_eq!(n.span(), Some((3, 9)));
        assert!(Layout::contiguous(&[4, 3]).narrow(0, 2, 1).is_contiguous());
        assert!(!Layout::contiguous(&[4, 3]).narrow(1, 1, 1).is_contiguous());
        assert!(!Layout::contiguous(&[4, 3]).narrow(1, 1, 2).is_contiguous());
    }
}
