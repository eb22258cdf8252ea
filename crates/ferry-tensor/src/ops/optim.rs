//! Fused optimizer updates: one pass over a parameter, its gradient and its moments, in place.

pub use crate::op::AdamStep;
use crate::{Result, Tensor, TensorError, backend};

impl Tensor {
    /// One Adam (or AdamW) step, in place: updates this parameter and its moment buffers `m`
    /// and `v` from `grad` in a single pass, where the composed version takes a dozen kernels
    /// and temporaries. All four must have the same shape, dtype and device, and be contiguous;
    /// it runs under `no_grad` (in-place writes bypass the graph), as optimizer steps do.
    pub fn adam_update(
        &self,
        grad: &Tensor,
        m: &Tensor,
        v: &Tensor,
        step: &AdamStep,
    ) -> Result<()> {
        for other in [grad, m, v] {
            self.same_kind("adam_update", other)?;
            if other.shape() != self.shape() {
                return Err(TensorError::ShapeMismatch {
                    op: "adam_update",
                    lhs: self.dims(),
                    rhs: other.dims(),
                    hint: "the gradient and both moments must have the parameter's shape",
                });
            }
        }
        if ferry_graph::is_grad_enabled() && self.requires_grad() {
            return Err(TensorError::InvalidArgument {
                op: "adam_update",
                message:
                    "in-place update of a tensor that requires grad: run it inside `no_grad()`"
                        .into(),
            });
        }
        let shared = [m, v].iter().any(|t| t.shares_storage(self)) || m.shares_storage(v);
        if shared || ![self, m, v].iter().all(|t| t.is_contiguous()) {
            return Err(TensorError::InvalidArgument {
                op: "adam_update",
                message: "the parameter and both moments must be contiguous and have storage of their own".into(),
            });
        }
        // A gradient that shares storage with what this step writes (a parameter that is its
        // own gradient, a view of a moment) would be read and written at once: its lock would
        // wait on itself. Copy it first, as one for a strided gradient.
        let aliased = [self, m, v].iter().any(|t| t.shares_storage(grad));
        let grad = if grad.is_contiguous() && !aliased {
            grad.detach()
        } else {
            grad.detach().copy()?
        };
        backend::adam(self, &grad, m, v, step)
    }
}
