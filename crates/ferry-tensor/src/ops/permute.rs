//! Reordering every axis at once (a view) and stacking tensors along a new axis.

use crate::autograd::record;
use crate::layout::{Layout, Shape};
use crate::{Result, Tensor, TensorError, rules};

impl Tensor {
    /// The axes reordered: axis `i` of the result is axis `dims[i]` of `self` (negative axes
    /// count from the end). A view, like [`Tensor::transpose`]: nothing is copied, and the
    /// gradient is permuted back by the inverse order.
    pub fn permute(&self, dims: &[isize]) -> Result<Tensor> {
        let order = permutation(self, dims)?;
        let shape: Shape = order.iter().map(|&d| self.shape()[d]).collect();
        let strides: Shape = order.iter().map(|&d| self.layout().strides()[d]).collect();
        let out = self.with_layout(Layout::from_parts(shape, strides, self.layout().offset()));
        Ok(record(out, "permute", &[self], || rules::permute(&order)))
    }

    /// Joins tensors of one shape along a new axis `axis` (in `0..=ndim`; negative counts from
    /// the end of the result): `n` tensors of shape `s` give `[.., n, ..]` with `n` at `axis`.
    /// Recorded as each input viewed with a size-1 axis, then `cat`: each input's gradient is
    /// its slice of the output's.
    pub fn stack(parts: &[&Tensor], axis: isize) -> Result<Tensor> {
        let first = parts.first().ok_or_else(|| TensorError::InvalidArgument {
            op: "stack",
            message: "needs at least one tensor".into(),
        })?;
        for part in &parts[1..] {
            first.same_kind("stack", part)?;
            if part.shape() != first.shape() {
                return Err(TensorError::ShapeMismatch {
                    op: "stack",
                    lhs: first.dims(),
                    rhs: part.dims(),
                    hint: "every tensor stacked must have the same shape; use cat to join along an existing axis",
                });
            }
        }
        let ndim = first.ndim() as isize + 1;
        let resolved = if axis < 0 { axis + ndim } else { axis };
        if !(0..ndim).contains(&resolved) {
            return Err(TensorError::AxisOutOfRange {
                op: "stack",
                axis,
                ndim: ndim as usize,
            });
        }
        let views: Vec<Tensor> = parts
            .iter()
            .map(|p| p.unsqueeze(resolved))
            .collect::<Result<_>>()?;
        let refs: Vec<&Tensor> = views.iter().collect();
        Tensor::cat(&refs, resolved)
    }
}

/// `dims` resolved to axes of `x`, checked to name each axis exactly once.
fn permutation(x: &Tensor, dims: &[isize]) -> Result<Vec<usize>> {
    if dims.len() != x.ndim() {
        return Err(TensorError::InvalidArgument {
            op: "permute",
            message: format!(
                "got {} axes {dims:?} for a tensor of shape {:?}; name each of its {} axes once",
                dims.len(),
                x.shape(),
                x.ndim()
            ),
        });
    }
    let mut seen = vec![false; x.ndim()];
    let mut order = Vec::with_capacity(dims.len());
    for &d in dims {
        let axis = x.axis("permute", d)?;
        if std::mem::replace(&mut seen[axis], true) {
            return Err(TensorError::InvalidArgument {
                op: "permute",
                message: format!(
                    "axis {axis} appears twice in {dims:?}; name each axis of shape {:?} once",
                    x.shape()
                ),
            });
        }
        order.push(axis);
    }
    Ok(order)
}
