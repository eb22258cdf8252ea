//! One Adam (or AdamW) step over host memory, in place, in f64 arithmetic per element.

use ferry_memory::Element;

use super::Cpu;
use crate::Result;
use crate::cpu::float_dispatch;
use crate::kernel::{Operand, Optim, View};
use crate::op::AdamStep;
use crate::storage::Storage;

impl Optim for Cpu {
    /// `p`, `m` and `v` (contiguous) updated from `g` as one Adam step `s` prescribes.
    fn adam(
        &self,
        p: &Operand<'_>,
        g: &Operand<'_>,
        m: &Operand<'_>,
        v: &Operand<'_>,
        s: &AdamStep,
    ) -> Result<()> {
        float_dispatch!(p.dtype(), "adam_update", |T| {
            const OP: &str = "adam_update";
            let n = p.numel();
            let slice = |t: &Operand<'_>| t.layout().offset()..t.layout().offset() + n;
            let mut locks = Storage::lock_for_update(
                OP,
                &[p.storage(), m.storage(), v.storage()],
                &[g.storage()],
            )?;
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
}
