//! Sends each primitive to the kernels of the device its tensors live on.

use ferry_memory::{DType, Device, Element};

use crate::cpu;
use crate::layout::Layout;
use crate::ops::{BinaryOp, CmpOp, ReduceOp, UnaryOp};
use crate::{Result, Tensor, TensorError};

fn on_cpu(op: &'static str, device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        device => Err(TensorError::UnsupportedDevice { op, device }),
    }
}

pub(crate) fn unary(x: &Tensor, op: UnaryOp) -> Result<Tensor> {
    on_cpu(op.name(), x.device())?;
    cpu::elementwise::unary(x, op)
}

pub(crate) fn binary(
    a: &Tensor,
    la: &Layout,
    b: &Tensor,
    lb: &Layout,
    op: BinaryOp,
) -> Result<Tensor> {
    on_cpu(op.name(), a.device())?;
    cpu::elementwise::binary(a, la, b, lb, op)
}

pub(crate) fn compare(
    a: &Tensor,
    la: &Layout,
    b: &Tensor,
    lb: &Layout,
    op: CmpOp,
) -> Result<Tensor> {
    on_cpu(op.name(), a.device())?;
    cpu::elementwise::compare(a, la, b, lb, op)
}

pub(crate) fn cast(x: &Tensor, dtype: DType) -> Result<Tensor> {
    on_cpu("to_dtype", x.device())?;
    cpu::elementwise::cast(x, dtype)
}

pub(crate) fn reduce(x: &Tensor, axis: usize, op: ReduceOp) -> Result<Tensor> {
    on_cpu("reduce", x.device())?;
    cpu::reduce::reduce(x, axis, op)
}

pub(crate) fn sum_all(x: &Tensor) -> Result<Tensor> {
    on_cpu("sum", x.device())?;
    cpu::reduce::sum_all(x)
}

pub(crate) fn matmul(
    a: &Tensor,
    la: &Layout,
    b: &Tensor,
    lb: &Layout,
    batch: &[usize],
) -> Result<Tensor> {
    on_cpu("matmul", a.device())?;
    cpu::matmul::matmul(a, la, b, lb, batch)
}

pub(crate) fn contiguous(x: &Tensor) -> Result<Tensor> {
    on_cpu("contiguous", x.device())?;
    cpu::copy::contiguous(x)
}

pub(crate) fn cat(parts: &[Tensor], axis: usize, shape: &[usize]) -> Result<Tensor> {
    on_cpu("cat", parts[0].device())?;
    cpu::copy::cat(parts, axis, shape)
}

pub(crate) fn full(shape: &[usize], dtype: DType, device: Device, value: f64) -> Result<Tensor> {
    on_cpu("full", device)?;
    cpu::full(shape, dtype, value)
}

/// Elements of a contiguous tensor, read out to a `Vec`.
pub(crate) fn read_elements<T: Element>(x: &Tensor) -> Result<Vec<T>> {
    on_cpu("to_vec", x.device())?;
    let data = x.storage().host::<T>("to_vec")?;
    let off = x.layout().offset();
    Ok(data[off..off + x.numel()].to_vec())
}
