//! Elementwise launches: unary maps, broadcast binary ops, comparisons and casts, each op's
//! code from the op table.

use ferry_memory::DType;

use super::kernels::Kernel;
use super::{Cuda, KernelLayout, buffer, float_only, launch, with_output};
use crate::Result;
use crate::kernel::{Dense, Elementwise, Operand, View};
use crate::op::{BinaryOp, CmpOp, UnaryOp};

impl Elementwise for Cuda {
    fn unary(&self, x: &Operand<'_>, op: UnaryOp) -> Result<Dense> {
        float_only(op.name(), x.dtype())?;
        let n = x.numel();
        with_output(x.device(), op.name(), x.shape(), x.dtype(), |dev, out| {
            let f = Kernel::Unary(x.dtype()).load(dev)?;
            let lx = KernelLayout::of(op.name(), x.layout())?;
            let src = buffer(x)?;
            launch(dev, &f, n)
                .arg_i32(op.code())
                .arg_f64(op.scalar())
                .arg_buffer(&src)
                .arg_pod(&lx)
                .arg_buffer_mut(out)
                .arg_u64(n as u64)
                .run()?;
            Ok(())
        })
    }

    /// `op` elementwise over layouts already broadcast to the output's shape.
    fn binary(&self, a: &Operand<'_>, b: &Operand<'_>, op: BinaryOp) -> Result<Dense> {
        float_only(op.name(), a.dtype())?;
        zip(
            a,
            b,
            Kernel::Binary(a.dtype()),
            op.code(),
            a.dtype(),
            op.name(),
        )
    }

    /// `op` as 1 or 0 (`u8`) over layouts already broadcast to the output's shape.
    fn compare(&self, a: &Operand<'_>, b: &Operand<'_>, op: CmpOp) -> Result<Dense> {
        zip(
            a,
            b,
            Kernel::Compare(a.dtype()),
            op.code(),
            DType::U8,
            op.name(),
        )
    }

    fn cast(&self, x: &Operand<'_>, dtype: DType) -> Result<Dense> {
        let n = x.numel();
        with_output(x.device(), "to_dtype", x.shape(), dtype, |dev, out| {
            let f = Kernel::Cast(x.dtype(), dtype).load(dev)?;
            let lx = KernelLayout::of("to_dtype", x.layout())?;
            let src = buffer(x)?;
            launch(dev, &f, n)
                .arg_buffer(&src)
                .arg_pod(&lx)
                .arg_buffer_mut(out)
                .arg_u64(n as u64)
                .run()?;
            Ok(())
        })
    }

    fn rotary(
        &self,
        x: &Operand<'_>,
        cos: &Operand<'_>,
        sin: &Operand<'_>,
        inverse: bool,
    ) -> Result<Option<Dense>> {
        const OP: &str = "rotary_embedding";
        float_only(OP, x.dtype())?;
        let half = x.shape().last().map_or(0, |d| d / 2);
        let pairs = x.numel() / 2;
        if half == 0 || cos.layout() != sin.layout() {
            return Ok(None);
        }
        let out = with_output(x.device(), OP, x.shape(), x.dtype(), |dev, out| {
            let f = Kernel::Rotary(x.dtype()).load(dev)?;
            let lx = KernelLayout::of(OP, x.layout())?;
            let lt = KernelLayout::of(OP, cos.layout())?;
            let (xb, cb, sb) = (buffer(x)?, buffer(cos)?, buffer(sin)?);
            launch(dev, &f, pairs)
                .arg_buffer(&xb)
                .arg_pod(&lx)
                .arg_buffer(&cb)
                .arg_buffer(&sb)
                .arg_pod(&lt)
                .arg_buffer_mut(out)
                .arg_u64(pairs as u64)
                .arg_u64(half as u64)
                .arg_i32(i32::from(inverse))
                .run()?;
            Ok(())
        })?;
        Ok(Some(out))
    }
}

fn zip(
    a: &Operand<'_>,
    b: &Operand<'_>,
    kernel: Kernel,
    code: i32,
    out_dtype: DType,
    op: &'static str,
) -> Result<Dense> {
    let (la, lb) = (a.layout(), b.layout());
    with_output(a.device(), op, la.shape(), out_dtype, |dev, out| {
        let n = la.numel();
        let f = kernel.load(dev)?;
        let (ka, kb) = (KernelLayout::of(op, la)?, KernelLayout::of(op, lb)?);
        let (x, y) = (buffer(a)?, buffer(b)?);
        launch(dev, &f, n)
            .arg_i32(code)
            .arg_buffer(&x)
            .arg_pod(&ka)
            .arg_buffer(&y)
            .arg_pod(&kb)
            .arg_buffer_mut(out)
            .arg_u64(n as u64)
            .run()?;
        Ok(())
    })
}
