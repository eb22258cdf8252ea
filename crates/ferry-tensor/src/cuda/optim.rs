//! One fused Adam (or AdamW) step on a GPU, in place (kernels/optim.cu).

use super::kernels::Kernel;
use super::{Cuda, device_of, float_only, launch};
use crate::kernel::{Operand, Optim, View};
use crate::storage::{Buffer, Storage};
use crate::{Result, TensorError};

impl Optim for Cuda {
    /// One fused Adam step on contiguous operands, in place on `p`, `m` and `v`.
    fn adam(
        &self,
        p: &Operand<'_>,
        g: &Operand<'_>,
        m: &Operand<'_>,
        v: &Operand<'_>,
        step: &crate::op::AdamStep,
    ) -> Result<()> {
        float_only("adam_update", p.dtype())?;
        let dev = device_of(p)?;
        let f = Kernel::Adam(p.dtype()).load(&dev)?;
        let n = p.numel();
        let mut locks = Storage::lock_for_update(
            "adam_update",
            &[p.storage(), m.storage(), v.storage()],
            &[g.storage()],
        )?;
        let [pw, mw, vw] = &mut locks.writes[..] else {
            unreachable!("three write locks were asked for")
        };
        let (Buffer::Cuda(pb), Buffer::Cuda(mb), Buffer::Cuda(vb), Buffer::Cuda(grad)) =
            (&mut **pw, &mut **mw, &mut **vw, &*locks.reads[0])
        else {
            return Err(TensorError::UnsupportedDevice {
                op: "adam_update",
                device: p.device(),
            });
        };
        let offset = |t: &Operand<'_>| t.layout().offset() as u64;
        launch(&dev, &f, n)
            .arg_buffer_mut(pb)
            .arg_u64(offset(p))
            .arg_buffer(grad)
            .arg_u64(offset(g))
            .arg_buffer_mut(mb)
            .arg_u64(offset(m))
            .arg_buffer_mut(vb)
            .arg_u64(offset(v))
            .arg_u64(n as u64)
            .arg_pod(step)
            .run()?;
        Ok(())
    }
}
