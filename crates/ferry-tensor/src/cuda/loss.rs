//! Cross-entropy on a GPU (kernels/softmax.cu): the forward is one block per row for the
//! log-sum-exp, then one block for the mean and the target check; the backward one block per
//! row. Targets are checked on the device and the flag read later
//! ([`CudaDevice::check_later`](ferry_memory::cuda::CudaDevice::check_later)), as nll does.

use ferry_cuda::{Kernels, grid_stride_blocks};

use super::kernels::Kernel;
use super::{Cuda, MAX_ROW_BLOCKS, THREADS, alloc, buffer, dense, device_of, float_only, wrap};
use crate::Result;
use crate::kernel::{Dense, Loss, Operand, View};
use crate::op::stats_dtype;

const OP: &str = "cross_entropy";

impl Loss for Cuda {
    fn cross_entropy(
        &self,
        logits: &Operand<'_>,
        targets: &Operand<'_>,
        ignore: Option<i64>,
    ) -> Result<Option<(Dense, Dense)>> {
        float_only(OP, logits.dtype())?;
        let (x, targets) = (dense(logits)?, dense(targets)?);
        let dev = device_of(&x)?;
        let (rows, classes) = (x.shape()[0], x.shape()[1]);
        let (dtype, sd) = (x.dtype(), stats_dtype(x.dtype()));
        let mut lse = alloc(&dev, OP, &[rows], sd)?;
        let mut loss = alloc(&dev, OP, &[], dtype)?;
        let mut bad = dev.alloc_zeroed(16, dev.default_stream())?;
        let src = buffer(&x)?;
        if rows > 0 {
            let f = Kernel::CrossEntropyRows(dtype).load(&dev)?;
            let blocks = grid_stride_blocks(rows, MAX_ROW_BLOCKS);
            dev.launch(&f, (blocks, 1, 1), (THREADS, 1, 1), 0, dev.default_stream())
                .arg_buffer(&src)
                .arg_buffer_mut(&mut lse)
                .arg_u64(rows as u64)
                .arg_u64(classes as u64)
                .run()?;
        }
        let f = Kernel::CrossEntropyMean(dtype).load(&dev)?;
        dev.launch(&f, (1, 1, 1), (THREADS, 1, 1), 0, dev.default_stream())
            .arg_buffer(&src)
            .arg_buffer(&*buffer(&targets)?)
            .arg_buffer(&lse)
            .arg_buffer_mut(&mut loss)
            .arg_u64(rows as u64)
            .arg_u64(classes as u64)
            .arg_i64(ignore.unwrap_or(0))
            .arg_i32(ignore.is_some() as i32)
            .arg_buffer_mut(&mut bad)
            .run()?;
        drop(src);
        let report = move |flag: &[u8]| {
            let flag: &[i64] = bytemuck::cast_slice(flag);
            (flag[0] != 0).then(|| crate::op::message::classes_message(flag[0], flag[1], classes))
        };
        dev.check_later(OP, &bad, dev.default_stream(), Box::new(report))?;
        Ok(Some((
            wrap(&dev, loss, dtype, &[]),
            wrap(&dev, lse, sd, &[rows]),
        )))
    }

    fn cross_entropy_backward(
        &self,
        logits: &Operand<'_>,
        targets: &Operand<'_>,
        lse: &Operand<'_>,
        scale: &Operand<'_>,
        ignore: Option<i64>,
    ) -> Result<Option<Dense>> {
        const BACKWARD: &str = "cross_entropy backward";
        float_only(BACKWARD, logits.dtype())?;
        let (x, targets) = (dense(logits)?, dense(targets)?);
        let (lse, scale) = (dense(lse)?, dense(scale)?);
        let dev = device_of(&x)?;
        let (rows, classes) = (x.shape()[0], x.shape()[1]);
        let mut dx = alloc(&dev, BACKWARD, x.shape(), x.dtype())?;
        if rows > 0 {
            let f = Kernel::CrossEntropyBackward(x.dtype()).load(&dev)?;
            let blocks = grid_stride_blocks(rows, MAX_ROW_BLOCKS);
            dev.launch(&f, (blocks, 1, 1), (THREADS, 1, 1), 0, dev.default_stream())
                .arg_buffer(&*buffer(&x)?)
                .arg_buffer(&*buffer(&targets)?)
                .arg_buffer(&*buffer(&lse)?)
                .arg_buffer(&*buffer(&scale)?)
                .arg_buffer_mut(&mut dx)
                .arg_u64(rows as u64)
                .arg_u64(classes as u64)
                .arg_i64(ignore.unwrap_or(0))
                .arg_i32(ignore.is_some() as i32)
                .run()?;
        }
        Ok(Some(wrap(&dev, dx, x.dtype(), x.shape())))
    }
}
