//! Fused optimizer updates: one pass over a parameter, its gradient and its moments, in place.

use ferry_memory::{Device, Element};

use crate::cpu::float_dispatch;
use crate::storage::Storage;
use crate::{Result, Tensor, TensorError, cuda};

/// The scalars of one Adam step (`repr(C)`: the CUDA kernel reads it as a parameter).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct AdamStep {
    /// Learning rate.
    pub lr: f64,
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the second moment.
    pub beta2: f64,
    /// Added to the denominator for stability.
    pub eps: f64,
    /// Weight decay: an L2 term in the gradient, or decoupled (AdamW).
    pub weight_decay: f64,
    /// `1 - beta1^t` for step `t` (counting from 1).
    pub bias_correction1: f64,
    /// `1 - beta2^t`.
    pub bias_correction2: f64,
    /// 1 for decoupled weight decay (AdamW), 0 for L2.
    pub decoupled: u32,
    /// Keeps the layout free of implicit padding.
    pub pad: u32,
}

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
        match self.device() {
            Device::Cuda(_) => cuda::adam(self, &grad, m, v, step),
            Device::Cpu => adam_cpu(self, &grad, m, v, step),
        }
    }
}

fn adam_cpu(p: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor, s: &AdamStep) -> Result<()> {
    float_dispatch!(p.dtype(), "adam_update", |T| {
        const OP: &str = "adam_update";
        let n = p.numel();
        let slice = |t: &Tensor| t.layout().offset()..t.layout().offset() + n;
        let mut locks =
            Storage::lock_for_update(OP, &[p.storage(), m.storage(), v.storage()], &[g.storage()])?;
        let grads: &[T] = bytemuck::cast_slice(locks.reads[0].host_slice(OP, g.device())?);
        let [pw, mw, vw] = &mut locks.writes[..] else {
            unreachable!("three write locks were asked for")
        };
        let params: &mut [T] = bytemuck::cast_slice_mut(pw.host_slice_mut(OP, p.device())?);
        let first: &mut [T] = bytemuck::cast_slice_mut(mw.host_slice_mut(OP, m.device())?);
        let second: &mut [T] = bytemuck::cast_slice_mut(vw.host_slice_mut(OP, v.device())?);
        let items = params[slice(p)].iter_mut().zip(&grads[slice(g)]);
        let moments = first[slice(m)].iter_mut().zip(second[slice(v)].iter_mut());
        for ((p, g), (m, v)) in items.zip(moments) {
            let (mut pi, mut gi) = (p.to_f64(), g.to_f64());
            if s.weight_decay != 0.0 {
                if s.decoupled != 0 {
                    pi *= 1.0 - s.lr * s.weight_decay;
                } else {
                    gi += s.weight_decay * pi;
                }
            }
            let mi = s.beta1 * m.to_f64() + (1.0 - s.beta1) * gi;
            let vi = s.beta2 * v.to_f64() + (1.0 - s.beta2) * gi * gi;
            pi -= s.lr / s.bias_correction1 * mi / ((vi / s.bias_correction2).sqrt() + s.eps);
            *p = <T as Element>::from_f64(pi);
            *m = <T as Element>::from_f64(mi);
            *v = <T as Element>::from_f64(vi);
        }
        Ok(())
    })
}
