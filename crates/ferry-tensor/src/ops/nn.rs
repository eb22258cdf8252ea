//! Softmax and log-softmax (fused kernels with their own rules: one pass over each row instead
//! of five ops), cross-entropy as one fused op (its rule in `rules::loss`), and the rotary
//! position embedding (one kernel each way on a GPU instead of about a dozen).

use ferry_memory::DType;

use crate::autograd::{record, should_record};
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
        if let Some(x) = crate::autocast::in_f32(self)? {
            return x.softmax_along(axis, log);
        }
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

    /// The rotary position embedding of `self` over its last axis (of even length): `self * cos
    /// + rotate_half(self) * sin`, where `rotate_half` turns the halves `[x1, x2]` of each row
    /// into `[-x2, x1]` (the pairing of Llama, GPT-NeoX and transformers'
    /// `apply_rotary_pos_emb`). `cos` and `sin` have one shape, broadcast to `self`'s, and
    /// `self`'s dtype and device: `[T, D]` tables rotate `[.., T, D]`, and `[T, 1, D]` ones a
    /// `[B, T, H, D]` projection before its heads are moved out.
    ///
    /// On a GPU it is one kernel each way (the gradient is the transposed rotation by the same
    /// tables) and the node keeps only the tables; the CPU, tables that want a gradient and
    /// gradients of gradients compose the same map from recorded ops.
    pub fn rotary_embedding(&self, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        const OP: &str = "rotary_embedding";
        match self.shape().last() {
            Some(&d) if d > 0 && d % 2 == 0 => {}
            _ => {
                return Err(TensorError::InvalidArgument {
                    op: OP,
                    message: format!(
                        "the last axis pairs its halves, so it must have an even, nonzero length; \
                         got shape {:?}",
                        self.shape()
                    ),
                });
            }
        }
        if !self.dtype().is_float() {
            return Err(TensorError::UnsupportedDType {
                op: OP,
                dtype: self.dtype(),
                hint: "only float tensors rotate; cast with `.to_dtype(DType::F32)`",
            });
        }
        self.same_kind(OP, cos)?;
        self.same_kind(OP, sin)?;
        let fits = |t: &Tensor| t.layout().broadcast_to(self.shape()).is_some();
        if cos.shape() != sin.shape() || !fits(cos) {
            return Err(TensorError::ShapeMismatch {
                op: OP,
                lhs: self.dims(),
                rhs: if fits(cos) { sin.dims() } else { cos.dims() },
                hint: "cos and sin must have one shape that broadcasts to the input's \
                       ([T, D] for [.., T, D], [T, 1, D] for [B, T, H, D])",
            });
        }
        if !should_record(&[cos, sin])
            && let Some(out) = backend::rotary(self, cos, sin, false)?
        {
            return Ok(record(out, OP, &[self, cos, sin], rules::rotary));
        }
        rules::rotary_composed(self, cos, sin, false)
    }

    /// Mean cross-entropy of `[n, classes]` logits against `[n]` class indices (`i64`), as one
    /// op: the forward computes each row's log-sum-exp (f32; f64 for f64 logits) and the loss in
    /// one pass, and the node keeps the logits, the targets and the `[n]` log-sum-exp, never a
    /// second `[n, classes]` tensor; the backward rebuilds `softmax(logits) - onehot` from them.
    /// The loss has the logits' dtype (bf16 logits give a bf16 loss, accumulated in f32). A
    /// target outside `0..classes` is an error: at once on the CPU, from the next call on the
    /// device on a GPU (the loss is NaN meanwhile), as with `nll`.
    pub fn cross_entropy(&self, targets: &Tensor) -> Result<Tensor> {
        self.cross_entropy_with(targets, None)
    }

    /// [`Tensor::cross_entropy`] where rows whose target is `ignore_index` (when given) add
    /// nothing and do not count in the mean, as PyTorch's `ignore_index` (`-100` there by
    /// default); the ignored class may lie outside `0..classes`. Every row ignored gives NaN
    /// (0 / 0), as in PyTorch.
    pub fn cross_entropy_with(
        &self,
        targets: &Tensor,
        ignore_index: Option<i64>,
    ) -> Result<Tensor> {
        const OP: &str = "cross_entropy";
        if let Some(logits) = crate::autocast::in_f32(self)? {
            return logits.cross_entropy_with(targets, ignore_index);
        }
        if self.ndim() != 2 || targets.shape() != [self.shape()[0]] {
            return Err(TensorError::ShapeMismatch {
                op: OP,
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
                op: OP,
                lhs: self.device(),
                rhs: targets.device(),
            });
        }
        if !self.dtype().is_float() {
            return Err(TensorError::UnsupportedDType {
                op: OP,
                dtype: self.dtype(),
                hint: "logits must be floats; cast with `.to_dtype(DType::F32)`",
            });
        }
        // Targets made in inference mode are read, not differentiated: a plain handle on the
        // same storage keeps them from turning the loss into inference data.
        let targets = if targets.is_inference() {
            Tensor::from_storage(targets.storage().clone(), targets.layout().clone())?
        } else {
            targets.clone()
        };
        match backend::cross_entropy(self, &targets, ignore_index)? {
            Some((loss, lse)) => Ok(record(loss, OP, &[self, &targets], || {
                rules::cross_entropy(ignore_index, lse)
            })),
            None => self.cross_entropy_composed(&targets, ignore_index),
        }
    }

    /// Cross-entropy from recorded ops, for a device without the fused kernel.
    fn cross_entropy_composed(&self, targets: &Tensor, ignore: Option<i64>) -> Result<Tensor> {
        let logp = self.log_softmax(1)?;
        let Some(ignore) = ignore else {
            return logp.nll(targets);
        };
        let kept = rules::kept_rows(targets, ignore, self.dtype())?;
        let ignored = kept.eq(&Tensor::zeros(&[], self.dtype(), self.device())?)?;
        let zero = Tensor::zeros(&[], DType::I64, self.device())?;
        let safe = Tensor::where_cond(&ignored, &zero, targets)?.unsqueeze(1)?;
        let picked = logp.gather(1, &safe)?.squeeze(1)?.mul(&kept)?.sum()?;
        let counted = rules::counted_rows(targets, Some(ignore), self.dtype())?;
        picked.neg()?.div(&counted)
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
