//! Reductions along an axis and over everything, softmax and its gradient, and the
//! cross-entropy loss's last step: the kernels that reduce rows.

use ferry_cuda::{Kernels, Launch, blocks_for, grid_stride_blocks};
use ferry_memory::DType;
use ferry_memory::cuda::DeviceBuffer;

use super::kernels::Kernel;
use super::{Cuda, MAX_ROW_BLOCKS, THREADS, buffer, dense, float_only, launch, with_output};
use crate::kernel::{Dense, Operand, Reduce, View};
use crate::op::ReduceOp;
use crate::{Result, TensorError};

impl Reduce for Cuda {
    fn nll_backward(
        &self,
        targets: &Operand<'_>,
        g: &Operand<'_>,
        classes: usize,
    ) -> Result<Option<Dense>> {
        nll_gradient(targets, g, classes).map(Some)
    }

    fn reduce(&self, x: &Operand<'_>, axis: usize, op: ReduceOp) -> Result<Dense> {
        float_only("reduce", x.dtype())?;
        let x = dense(x)?;
        let shape = x.shape();
        let (outer, len, inner): (usize, usize, usize) = (
            shape[..axis].iter().product(),
            shape[axis],
            shape[axis + 1..].iter().product(),
        );
        let mut out_shape = shape.to_vec();
        out_shape.remove(axis);
        let outputs = outer * inner;
        let out_dtype = if op == ReduceOp::ArgMax {
            DType::I64
        } else {
            x.dtype()
        };
        if len == 0 && op != ReduceOp::Sum {
            return Err(TensorError::InvalidArgument {
                op: "max",
                message: "cannot take the maximum of an empty axis".into(),
            });
        }
        with_output(x.device(), op.name(), &out_shape, out_dtype, |dev, out| {
            let code = op.code();
            let src = buffer(&x)?;
            // The kernel's unused output pointer is null; op decides which one it writes.
            let (values, indices) = if op == ReduceOp::ArgMax {
                (None, Some(&mut *out))
            } else {
                (Some(&mut *out), None)
            };
            if inner == 1 {
                let f = Kernel::ReduceRow(x.dtype()).load(dev)?;
                let blocks = grid_stride_blocks(outputs, MAX_ROW_BLOCKS);
                let l = dev
                    .launch(&f, (blocks, 1, 1), (THREADS, 1, 1), 0, dev.default_stream())
                    .arg_i32(code)
                    .arg_buffer(&src);
                out_arg(out_arg(l, values), indices)
                    .arg_u64(outer as u64)
                    .arg_u64(len as u64)
                    .run()?;
            } else if op == ReduceOp::Sum && len >= 32 {
                let f = Kernel::SumColTiled(x.dtype()).load(dev)?;
                let tiles = outer * inner.div_ceil(32);
                let blocks = grid_stride_blocks(tiles, MAX_ROW_BLOCKS);
                dev.launch(&f, (blocks, 1, 1), (32, 32, 1), 0, dev.default_stream())
                    .arg_buffer(&src)
                    .arg_buffer_mut(out)
                    .arg_u64(outer as u64)
                    .arg_u64(len as u64)
                    .arg_u64(inner as u64)
                    .run()?;
            } else {
                let f = Kernel::ReduceCol(x.dtype()).load(dev)?;
                let l = launch(dev, &f, outputs).arg_i32(code).arg_buffer(&src);
                out_arg(out_arg(l, values), indices)
                    .arg_u64(outer as u64)
                    .arg_u64(len as u64)
                    .arg_u64(inner as u64)
                    .run()?;
            }
            drop(src);
            Ok(())
        })
    }

    fn sum_all(&self, x: &Operand<'_>) -> Result<Dense> {
        float_only("sum", x.dtype())?;
        let x = dense(x)?;
        let n = x.numel();
        let parts = blocks_for(n.max(1), THREADS).min(1024);
        with_output(x.device(), "sum", &[], x.dtype(), |dev, out| {
            let mut partials = dev.alloc(parts as usize * 8, dev.default_stream())?;
            let src = buffer(&x)?;
            let f = Kernel::SumPartial(x.dtype()).load(dev)?;
            dev.launch(&f, (parts, 1, 1), (THREADS, 1, 1), 0, dev.default_stream())
                .arg_buffer(&src)
                .arg_u64(n as u64)
                .arg_buffer_mut(&mut partials)
                .run()?;
            let f = Kernel::SumFinish(x.dtype()).load(dev)?;
            dev.launch(&f, (1, 1, 1), (THREADS, 1, 1), 0, dev.default_stream())
                .arg_buffer(&partials)
                .arg_u64(parts as u64)
                .arg_buffer_mut(out)
                .run()?;
            Ok(())
        })
    }

    /// Fused softmax (or log-softmax) over the last axis.
    fn softmax(&self, x: &Operand<'_>, log: bool) -> Result<Dense> {
        float_only("softmax", x.dtype())?;
        let x = dense(x)?;
        let cols = *x.shape().last().unwrap_or(&1);
        let rows = x.numel() / cols.max(1);
        with_output(x.device(), "softmax", x.shape(), x.dtype(), |dev, out| {
            let src = buffer(&x)?;
            let f = Kernel::Softmax(x.dtype()).load(dev)?;
            let blocks = grid_stride_blocks(rows, MAX_ROW_BLOCKS);
            dev.launch(&f, (blocks, 1, 1), (THREADS, 1, 1), 0, dev.default_stream())
                .arg_buffer(&src)
                .arg_buffer_mut(out)
                .arg_u64(rows as u64)
                .arg_u64(cols as u64)
                .arg_i32(log as i32)
                .run()?;
            Ok(())
        })
    }

    /// `-mean(logp[i, targets[i]])` of `[rows, classes]` log-probabilities, one kernel. Targets are
    /// checked on the device and the flag read later ([`CudaDevice::check_later`]), so the step
    /// does not wait for the GPU: a bad target makes the loss NaN at once and an error of the next
    /// call.
    fn nll(&self, logp: &Operand<'_>, targets: &Operand<'_>) -> Result<Dense> {
        const OP: &str = "cross_entropy";
        float_only(OP, logp.dtype())?;
        let (logp, targets) = (dense(logp)?, dense(targets)?);
        let (rows, classes) = (logp.shape()[0], logp.shape()[1]);
        with_output(logp.device(), OP, &[], logp.dtype(), |dev, out| {
            let mut bad = dev.alloc_zeroed(16, dev.default_stream())?;
            let f = Kernel::Nll(logp.dtype()).load(dev)?;
            dev.launch(&f, (1, 1, 1), (THREADS, 1, 1), 0, dev.default_stream())
                .arg_buffer(&*buffer(&logp)?)
                .arg_buffer(&*buffer(&targets)?)
                .arg_buffer_mut(out)
                .arg_u64(rows as u64)
                .arg_u64(classes as u64)
                .arg_buffer_mut(&mut bad)
                .run()?;
            let report = move |flag: &[u8]| {
                let flag: &[i64] = bytemuck::cast_slice(flag);
                (flag[0] != 0)
                    .then(|| crate::op::message::classes_message(flag[0], flag[1], classes))
            };
            dev.check_later(OP, &bad, dev.default_stream(), Box::new(report))?;
            Ok(())
        })
    }

    /// Softmax's (or log-softmax's) gradient over the last axis from its output `y`, fused; `None`
    /// when `g`'s dtype is not `y`'s (the kernel reads both as one type).
    fn softmax_backward(
        &self,
        y: &Operand<'_>,
        g: &Operand<'_>,
        log: bool,
    ) -> Result<Option<Dense>> {
        if g.dtype() != y.dtype() {
            return Ok(None);
        }
        let (y, g) = (dense(y)?, dense(g)?);
        let cols = *y.shape().last().unwrap_or(&1);
        let rows = y.numel() / cols.max(1);
        with_output(
            y.device(),
            "softmax backward",
            y.shape(),
            y.dtype(),
            |dev, out| {
                let f = Kernel::SoftmaxBackward(y.dtype()).load(dev)?;
                let blocks = grid_stride_blocks(rows, MAX_ROW_BLOCKS);
                dev.launch(&f, (blocks, 1, 1), (THREADS, 1, 1), 0, dev.default_stream())
                    .arg_buffer(&*buffer(&y)?)
                    .arg_buffer(&*buffer(&g)?)
                    .arg_buffer_mut(out)
                    .arg_u64(rows as u64)
                    .arg_u64(cols as u64)
                    .arg_i32(log as i32)
                    .run()?;
                Ok(())
            },
        )
        .map(Some)
    }
}

/// A buffer argument, or a null pointer where the kernel leaves that output alone.
fn out_arg<'a>(launch: Launch<'a>, buffer: Option<&'a mut DeviceBuffer>) -> Launch<'a> {
    match buffer {
        Some(b) => launch.arg_buffer_mut(b),
        None => launch.arg_u64(0),
    }
}

/// nll's gradient: `-g / rows` at each row's target of a `[rows, classes]` tensor, 0 elsewhere.
fn nll_gradient(targets: &Operand<'_>, g: &Operand<'_>, classes: usize) -> Result<Dense> {
    const OP: &str = "cross_entropy backward";
    let (targets, g) = (dense(targets)?, dense(g)?);
    let shape = [targets.numel(), classes];
    with_output(g.device(), OP, &shape, g.dtype(), |dev, out| {
        let f = Kernel::NllBackward(g.dtype()).load(dev)?;
        launch(dev, &f, shape[0] * classes)
            .arg_buffer(&*buffer(&targets)?)
            .arg_buffer(&*buffer(&g)?)
            .arg_buffer_mut(out)
            .arg_u64(shape[0] as u64)
            .arg_u64(classes as u64)
            .run()?;
        Ok(())
    })
}
