//! Sums, means and maxima, over everything or along one axis.

use ferry_memory::DType;

use crate::autograd::{record, try_record};
use crate::op::ReduceOp;
use crate::{Result, Tensor, TensorError, backend, rules};

impl Tensor {
    /// Sum of all elements, as a 0-dimensional tensor.
    pub fn sum(&self) -> Result<Tensor> {
        let out = backend::sum_all(self)?;
        Ok(record(out, "sum", &[self], || rules::sum_all(self)))
    }

    /// Mean of all elements.
    pub fn mean(&self) -> Result<Tensor> {
        self.sum()?.div_scalar(self.numel() as f64)
    }

    /// Sum along `axis` (negative counts from the end), keeping it as size 1 when `keepdim`.
    pub fn sum_axis(&self, axis: isize, keepdim: bool) -> Result<Tensor> {
        let axis = self.axis("sum", axis)?;
        let out = backend::reduce(self, axis, ReduceOp::Sum)?;
        let out = record(out, "sum", &[self], || rules::sum_axis(self, axis));
        if keepdim {
            out.unsqueeze(axis as isize)
        } else {
            Ok(out)
        }
    }

    /// Mean along `axis`.
    pub fn mean_axis(&self, axis: isize, keepdim: bool) -> Result<Tensor> {
        let len = self.shape()[self.axis("mean", axis)?];
        self.sum_axis(axis, keepdim)?.div_scalar(len as f64)
    }

    /// Maximum along `axis`; the gradient goes to the first maximal element.
    pub fn max_axis(&self, axis: isize, keepdim: bool) -> Result<Tensor> {
        let axis = self.nonempty_axis("max", axis)?;
        let out = backend::reduce(self, axis, ReduceOp::Max)?;
        let out = try_record(out, "max", &[self], || {
            let index = backend::reduce(self, axis, ReduceOp::ArgMax)?;
            Ok(rules::max_axis(self, axis, index))
        })?;
        if keepdim {
            out.unsqueeze(axis as isize)
        } else {
            Ok(out)
        }
    }

    /// Index of the maximum along `axis`, as `i64` (first on ties).
    pub fn argmax(&self, axis: isize, keepdim: bool) -> Result<Tensor> {
        let axis = self.nonempty_axis("argmax", axis)?;
        let out = backend::reduce(self, axis, ReduceOp::ArgMax)?;
        if keepdim {
            out.unsqueeze(axis as isize)
        } else {
            Ok(out)
        }
    }

    /// An axis to take a maximum over: it needs at least one element.
    fn nonempty_axis(&self, op: &'static str, axis: isize) -> Result<usize> {
        let axis = self.axis(op, axis)?;
        if self.shape()[axis] == 0 {
            return Err(TensorError::InvalidArgument {
                op,
                message: format!(
                    "axis {axis} of shape {:?} is empty, so it has no maximum; narrow or mask instead",
                    self.shape()
                ),
            });
        }
        Ok(axis)
    }

    /// Euclidean norm of all elements, computed in f64 (no gradient).
    pub fn norm(&self) -> Result<f64> {
        let _no_grad = ferry_graph::no_grad();
        let x = if self.dtype() == DType::F64 {
            self.detach()
        } else {
            self.to_dtype(DType::F64)?
        };
        Ok(x.mul(&x)?.sum()?.item()?.sqrt())
    }
}
