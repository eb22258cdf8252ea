//! Indexing along one axis through `i64` index tensors: `index_select`, `index_add`, `gather`,
//! `scatter_add`, and `embedding` built on `index_select`.
//!
//! Their gradient rules (in `rules::index`) are each other's ops: the rule of a read (`index_select`, `gather`) is the matching accumulation into zeros, and the rule of an
//! accumulation (`index_add`, `scatter_add`) passes the gradient through to `self` and reads it
//! back for `src`. Each rule keeps the index tensor alone (as its auxiliary tensor), and since the
//! rules are written with these same ops, higher-order gradients flow.
//!
//! Out-of-range indices are an error naming the range. On the CPU the indices are checked as
//! they are read. On CUDA each kernel checks every index it reads, skips the bad ones (no memory
//! outside the tensors is touched), and counts them in a 16-byte flag that the host reads back
//! after the launch: one small device-to-host copy, which waits for the kernel, per call.

use ferry_memory::DType;

use crate::autograd::record;
use crate::{Result, Tensor, TensorError, backend, rules};

impl Tensor {
    /// The entries `index` names along `axis`, in its order: `out` has `self`'s shape with
    /// `axis` of length `index.numel()`, and `out[.., j, ..] = self[.., index[j], ..]`.
    ///
    /// `index` is a 1-D (or 0-d) `i64` tensor on `self`'s device, each entry in
    /// `0..self.shape()[axis]` (anything else is an error naming the range). Any dtype. The
    /// gradient accumulates into the selected entries (repeated indices add up).
    pub fn index_select(&self, axis: isize, index: &Tensor) -> Result<Tensor> {
        const OP: &str = "index_select";
        let axis = self.axis(OP, axis)?;
        check_index(OP, self, index)?;
        if index.ndim() > 1 {
            return Err(TensorError::InvalidArgument {
                op: OP,
                message: format!(
                    "the index must be 1-D, got shape {:?}; flatten it with `.reshape(&[n])` (or use \
                     `Tensor::embedding`, which takes indices of any shape)",
                    index.shape()
                ),
            });
        }
        let flat = if index.ndim() == 0 {
            index.reshape(&[1])?
        } else {
            index.clone()
        };
        let out = backend::index_select(self, axis, &flat)?;
        Ok(record(out, OP, &[self], || {
            rules::index_select(self, axis, flat)
        }))
    }

    /// `self` plus `src` added at the entries `index` names along `axis` (out of place):
    /// `out[.., index[j], ..] += src[.., j, ..]`, repeated indices adding up.
    ///
    /// `src` has `self`'s shape but `index.numel()` along `axis`; float dtypes. On CUDA the
    /// additions are atomic, so the order in which repeated indices add up is not fixed.
    pub fn index_add(&self, axis: isize, index: &Tensor, src: &Tensor) -> Result<Tensor> {
        const OP: &str = "index_add";
        let axis = self.axis(OP, axis)?;
        check_index(OP, self, index)?;
        self.same_kind(OP, src)?;
        float_dtype(OP, self.dtype())?;
        if index.ndim() > 1 {
            return Err(TensorError::InvalidArgument {
                op: OP,
                message: format!(
                    "the index must be 1-D, got shape {:?}; flatten it (and src) first",
                    index.shape()
                ),
            });
        }
        let flat = if index.ndim() == 0 {
            index.reshape(&[1])?
        } else {
            index.clone()
        };
        let mut want = self.shape().to_vec();
        want[axis] = flat.numel();
        if src.shape() != want.as_slice() {
            return Err(TensorError::ShapeMismatch {
                op: OP,
                lhs: self.dims(),
                rhs: src.dims(),
                hint: "src must have self's shape except along the axis, where it has one entry \
                       per index",
            });
        }
        let out = backend::index_add(self, axis, &flat, src)?;
        Ok(record(out, OP, &[self, src], || {
            rules::index_add(axis, flat)
        }))
    }

    /// Values picked along `axis` by `index`: `out` has `index`'s shape, and (for axis 1 of a
    /// 3-D tensor) `out[i, j, k] = self[i, index[i, j, k], k]`.
    ///
    /// `index` is an `i64` tensor with as many dimensions as `self`, no longer than `self` along
    /// every other axis, each entry in `0..self.shape()[axis]`. Any dtype. The gradient
    /// scatter-adds back into zeros of `self`'s shape.
    pub fn gather(&self, axis: isize, index: &Tensor) -> Result<Tensor> {
        const OP: &str = "gather";
        let axis = self.axis(OP, axis)?;
        check_index(OP, self, index)?;
        check_fits(OP, self, index, axis, "self")?;
        let index = index.clone();
        let out = backend::gather(self, axis, &index)?;
        Ok(record(out, OP, &[self], || {
            rules::gather(self, axis, index)
        }))
    }

    /// `self` plus `src` scattered along `axis` by `index` (out of place): for axis 1 of a 3-D
    /// tensor, `out[i, index[i, j, k], k] += src[i, j, k]` for every position of `index`.
    ///
    /// `index` is `i64` with as many dimensions as `self` and `src`, no longer than `src` along
    /// any axis and no longer than `self` along every axis but `axis`; entries in
    /// `0..self.shape()[axis]`. Float dtypes. Gradients: `self` gets the output's gradient,
    /// `src` gets it gathered back by `index` (zero where `index` does not reach). On CUDA the
    /// additions are atomic, so their order is not fixed.
    pub fn scatter_add(&self, axis: isize, index: &Tensor, src: &Tensor) -> Result<Tensor> {
        const OP: &str = "scatter_add";
        let axis = self.axis(OP, axis)?;
        check_index(OP, self, index)?;
        self.same_kind(OP, src)?;
        float_dtype(OP, self.dtype())?;
        check_fits(OP, self, index, axis, "self")?;
        check_fits(OP, src, index, usize::MAX, "src")?;
        // Only the part of src that index covers takes part: a view (its gradient pads zeros).
        let mut src = src.clone();
        for (d, &n) in index.shape().iter().enumerate() {
            if src.shape()[d] != n {
                src = src.narrow(d as isize, 0, n)?;
            }
        }
        let index = index.clone();
        let out = backend::scatter_add(self, axis, &index, &src)?;
        Ok(record(out, OP, &[self, &src], || {
            rules::scatter_add(axis, index)
        }))
    }

    /// Rows of `weight` (`[num, dim]`) picked by `indices` (`i64`, any shape, entries in
    /// `0..num`): the output is `indices.shape() + [dim]`. An `index_select` on axis 0 of the
    /// weight, so its gradient accumulates into the rows used (atomically on CUDA) and the node
    /// keeps the indices alone.
    pub fn embedding(weight: &Tensor, indices: &Tensor) -> Result<Tensor> {
        if weight.ndim() != 2 {
            return Err(TensorError::InvalidArgument {
                op: "embedding",
                message: format!(
                    "the weight must be [num_embeddings, dim], got shape {:?}",
                    weight.shape()
                ),
            });
        }
        check_index("embedding", weight, indices)?;
        let flat = indices.reshape(&[indices.numel()])?;
        let mut shape = indices.shape().to_vec();
        shape.push(weight.shape()[1]);
        weight.index_select(0, &flat)?.reshape(&shape)
    }
}

/// `index` must be `i64` on `x`'s device.
fn check_index(op: &'static str, x: &Tensor, index: &Tensor) -> Result<()> {
    if index.dtype() != DType::I64 {
        return Err(TensorError::dtype_mismatch(op, index.dtype(), DType::I64));
    }
    if index.device() != x.device() {
        return Err(TensorError::DeviceMismatch {
            op,
            lhs: x.device(),
            rhs: index.device(),
        });
    }
    Ok(())
}

fn float_dtype(op: &'static str, dtype: DType) -> Result<()> {
    if dtype.is_float() {
        Ok(())
    } else {
        Err(TensorError::UnsupportedDType {
            op,
            dtype,
            hint: "only float dtypes accumulate; cast with `.to_dtype(DType::F32)`",
        })
    }
}

/// `index` has `x`'s number of dimensions and is no longer than `x` along every axis but
/// `skip` (`usize::MAX`: along every axis).
fn check_fits(
    op: &'static str,
    x: &Tensor,
    index: &Tensor,
    skip: usize,
    what: &'static str,
) -> Result<()> {
    let fits = index.ndim() == x.ndim()
        && (0..x.ndim()).all(|d| d == skip || index.shape()[d] <= x.shape()[d]);
    if fits {
        return Ok(());
    }
    Err(TensorError::InvalidArgument {
        op,
        message: format!(
            "the index, shape {:?}, must have as many dimensions as {what}, shape {:?}, and be no \
             longer than it along {}; reshape or narrow the index",
            index.shape(),
            x.shape(),
            if skip == usize::MAX {
                "any axis".to_string()
            } else {
                format!("every axis but {skip}")
            }
        ),
    })
}
