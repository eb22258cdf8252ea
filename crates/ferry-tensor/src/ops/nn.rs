//! Softmax and log-softmax (fused kernels with their own rules: one pass over each row instead
//! of five ops), and cross-entropy composed from them.

use ferry_memory::DType;

use crate::autograd::record;
use crate::{Result, Tensor, TensorError, backend, rules};

impl Tensor {
    /// `exp(x) / Σ exp(x)` along `axis`, shifted by the maximum for stability.
    pub fn softmax(&self, axis: isize) -> Result<Tensor> {
        self.softmax_along(axis, false)
    }

    /// `x - log Σ exp(x)` along `axis`, computed stably.
    pub fn log_softmax(&self, axis: isize) -> Result<Tensor> {
        self.softmax_along(axis, true)
    }

    fn softmax_along(&self, axis: isize, log: bool) -> Result<Tensor> {
        let op = if log { "log_softmax" } else { "softmax" };
        let axis = self.axis(op, axis)?;
        let last = self.ndim() - 1;
        if axis != last {
            let moved = self.transpose(axis as isize, last as isize)?;
            return moved
                .softmax_along(-1, log)?
                .transpose(axis as isize, last as isize);
        }
        let out = backend::softmax(self, log)?;
        Ok(record(out, op, &[self], || rules::softmax(log)))
    }

    /// Mean cross-entropy of `[n, classes]` logits against `[n]` class indices (`i64`).
    pub fn cross_entropy(&self, targets: &Tensor) -> Result<Tensor> {
        if self.ndim() != 2 || targets.shape() != [self.shape()[0]] {
            return Err(TensorError::ShapeMismatch {
                op: "cross_entropy",
                lhs: self.dims(),
                rhs: targets.dims(),
                hint: "logits must be [n, classes] and targets [n]",
            });
        }
        if targets.dtype() != DType::I64 {
            return Err(TensorError::dtype_mismatch(
                "cross_entropy targets",
                targets.dtype(),
                DType::I64,
            ));
        }
        let classes = self.shape()[1];
        check_classes(targets, classes)?;
        self.log_softmax(1)?.nll(targets)
    }

    /// `-mean(self[i, targets[i]])` of `[n, classes]` log-probabilities; keeps only the targets
    /// for backward, as PyTorch's `nll_loss` does.
    fn nll(&self, targets: &Tensor) -> Result<Tensor> {
        let value = ferry_graph::with_no_grad(|| {
            let one_hot = Tensor::one_hot(targets, self.shape()[1], self.dtype())?;
            self.detach()
                .mul(&one_hot)?
                .sum()?
                .div_scalar(-(self.shape()[0] as f64))
        })?;
        Ok(record(value, "nll", &[self], || rules::nll(self, targets)))
    }

    /// `[n]` class indices to `[n, classes]` rows of 0 and 1 in `dtype`. Indices outside
    /// `0..classes` give rows of zeros.
    pub fn one_hot(indices: &Tensor, classes: usize, dtype: DType) -> Result<Tensor> {
        let classes_row = Tensor::arange(0.0, classes as f64, indices.dtype(), indices.device())?;
        // [.., 1] against [classes]: a 0-d index gives [classes], not [1, classes].
        indices.unsqueeze(-1)?.eq(&classes_row)?.to_dtype(dtype)
    }
}

/// Targets must name a class; a row of zeros would silently drop the sample from the loss.
fn check_classes(targets: &Tensor, classes: usize) -> Result<()> {
    let _no_grad = ferry_graph::no_grad();
    let zero = Tensor::zeros(&[], targets.dtype(), targets.device())?;
    let limit = Tensor::full(&[], classes as f64, targets.dtype(), targets.device())?;
    let outside = targets
        .lt(&zero)?
        .to_dtype(DType::F64)?
        .add(&targets.ge(&limit)?.to_dtype(DType::F64)?)?;
    let bad = outside.sum()?.item()?;
    if bad > 0.0 {
        return Err(TensorError::InvalidArgument {
            op: "cross_entropy",
            message: format!(
                "{bad} target(s) lie outside 0..{classes}; targets are class indices of the logits' second axis"
            ),
        });
    }
    Ok(())
}
