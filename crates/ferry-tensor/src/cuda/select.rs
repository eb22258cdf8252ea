//! CUDA launches for choosing by a mask (kernels/select.cu): `where_cond`, fused dropout and
//! its backward.

use ferry_memory::DType;

use super::kernels::Kernel;
use super::{Cuda, KernelLayout, alloc, buffer, device_of, float_only, launch, with_output, wrap};
use crate::kernel::{Dense, Operand, Select, View};
use crate::{Result, TensorError};

impl Select for Cuda {
    /// `a` where `c != 0`, else `b`, over layouts already broadcast to the output's shape.
    fn where_cond(&self, c: &Operand<'_>, a: &Operand<'_>, b: &Operand<'_>) -> Result<Dense> {
        let (lc, la, lb) = (c.layout(), a.layout(), b.layout());
        let op = "where_cond";
        let n = la.numel();
        with_output(a.device(), op, la.shape(), a.dtype(), |dev, out| {
            if n == 0 {
                return Ok(());
            }
            let f = Kernel::Where(a.dtype()).load(dev)?;
            let (kc, ka, kb) = (
                KernelLayout::of(op, lc)?,
                KernelLayout::of(op, la)?,
                KernelLayout::of(op, lb)?,
            );
            let (cs, xs, ys) = (buffer(c)?, buffer(a)?, buffer(b)?);
            launch(dev, &f, n)
                .arg_buffer(&cs)
                .arg_pod(&kc)
                .arg_buffer(&xs)
                .arg_pod(&ka)
                .arg_buffer(&ys)
                .arg_pod(&kb)
                .arg_buffer_mut(out)
                .arg_u64(n as u64)
                .run()?;
            Ok(())
        })
    }

    /// Draws the keep mask of (seed, p) and scales the kept elements in one launch; returns the
    /// output and the mask.
    fn dropout(&self, x: &Operand<'_>, p: f64, scale: f64, seed: u64) -> Result<(Dense, Dense)> {
        float_only("dropout", x.dtype())?;
        let dev = device_of(x)?;
        let n = x.numel();
        let mut out = alloc(&dev, "dropout", x.shape(), x.dtype())?;
        let mut mask = alloc(&dev, "dropout", x.shape(), DType::U8)?;
        if n > 0 {
            let f = Kernel::Dropout(x.dtype()).load(&dev)?;
            let lx = KernelLayout::of("dropout", x.layout())?;
            let src = buffer(x)?;
            launch(&dev, &f, n)
                .arg_buffer(&src)
                .arg_pod(&lx)
                .arg_buffer_mut(&mut out)
                .arg_buffer_mut(&mut mask)
                .arg_u64(n as u64)
                .arg_u64(seed)
                .arg_f64(p)
                .arg_f64(scale)
                .run()?;
        }
        Ok((
            wrap(&dev, out, x.dtype(), x.shape()),
            wrap(&dev, mask, DType::U8, x.shape()),
        ))
    }

    /// `x * scale` where `mask` (u8, contiguous from offset 0 as dropout made it) is set, else 0.
    fn masked_scale(&self, x: &Operand<'_>, mask: &Operand<'_>, scale: f64) -> Result<Dense> {
        float_only("masked_scale", x.dtype())?;
        if !mask.is_contiguous() || mask.layout().offset() != 0 || mask.shape() != x.shape() {
            return Err(TensorError::InvalidArgument {
                op: "masked_scale",
                message: format!(
                    "the mask must be dropout's own (contiguous, shape {:?}), got shape {:?}",
                    x.shape(),
                    mask.shape()
                ),
            });
        }
        let n = x.numel();
        with_output(
            x.device(),
            "masked_scale",
            x.shape(),
            x.dtype(),
            |dev, out| {
                if n > 0 {
                    let f = Kernel::MaskedScale(x.dtype()).load(dev)?;
                    let lx = KernelLayout::of("masked_scale", x.layout())?;
                    let (src, keep) = (buffer(x)?, buffer(mask)?);
                    launch(dev, &f, n)
                        .arg_buffer(&src)
                        .arg_pod(&lx)
                        .arg_buffer(&keep)
                        .arg_f64(scale)
                        .arg_buffer_mut(out)
                        .arg_u64(n as u64)
                        .run()?;
                }
                Ok(())
            },
        )
    }
}
