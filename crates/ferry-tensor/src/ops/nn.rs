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
        if targets.device() != self.device() {
            return Err(TensorError::DeviceMismatch {
                op: "cross_entropy",
                lhs: self.device(),
                rhs: targets.device(),
            });
        }
        self.log_softmax(1)?.nll(targets)
    }

    /// `-mean(self[i, targets[i]])` of `[n, classes]` log-probabilities, one kernel; keeps only
    /// the targets for backward, as PyTorch's `nll_loss` does. A target outside `0..classes` is
    /// an error: at once on the CPU; on a GPU the kernel flags it, the loss is NaN, and the
    /// error comes from the next call on the device once the flag has reached the host (the
    /// step never waits for the GPU to find out).
    fn nll(&self, targets: &Tensor) -> Result<Tensor> {
        let value = backend::nll(self, targets)?;
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
