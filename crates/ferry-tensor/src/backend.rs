//! Sends each primitive to the kernels of the device its tensors live on.

use ferry_memory::{DType, Device, Element};

use crate::layout::Layout;
use crate::ops::{BinaryOp, CmpOp, ReduceOp, UnaryOp};
use crate::{Result, Tensor, cpu, cuda};

/// `$cpu` on the host, `$cuda` on a GPU.
macro_rules! on {
    ($device:expr, cpu => $cpu:expr, cuda => $cuda:expr $(,)?) => {
        match $device {
            Device::Cpu => $cpu,
            Device::Cuda(_) => $cuda,
        }
    };
}

pub(crate) fn unary(x: &Tensor, op: UnaryOp) -> Result<Tensor> {
    on!(x.device(), cpu => cpu::elementwise::unary(x, op), cuda => cuda::unary(x, op))
}

pub(crate) fn binary(
    a: &Tensor,
    la: &Layout,
    b: &Tensor,
    lb: &Layout,
    op: BinaryOp,
) -> Result<Tensor> {
    on!(a.device(),
        cpu => cpu::elementwise::binary(a, la, b, lb, op),
        cuda => cuda::binary(a, la, b, lb, op))
}

pub(crate) fn compare(
    a: &Tensor,
    la: &Layout,
    b: &Tensor,
    lb: &Layout,
    op: CmpOp,
) -> Result<Tensor> {
    on!(a.device(),
        cpu => cpu::elementwise::compare(a, la, b, lb, op),
        cuda => cuda::compare(a, la, b, lb, op))
}

pub(crate) fn cast(x: &Tensor, dtype: DType) -> Result<Tensor> {
    on!(x.device(), cpu => cpu::elementwise::cast(x, dtype), cuda => cuda::cast(x, dtype))
}

pub(crate) fn reduce(x: &Tensor, axis: usize, op: ReduceOp) -> Result<Tensor> {
    on!(x.device(), cpu => cpu::reduce::reduce(x, axis, op), cuda => cuda::reduce(x, axis, op))
}

pub(crate) fn sum_all(x: &Tensor) -> Result<Tensor> {
    on!(x.device(), cpu => cpu::reduce::sum_all(x), cuda => cuda::sum_all(x))
}

/// `x [rows, in] · wᵀ + b`, then ReLU when `relu`, as one fused product on a GPU (the caller
/// checked that it can be); the CPU computes the same with the plain ops.
pub(crate) fn linear(x: &Tensor, w: &Tensor, b: &Tensor, relu: bool) -> Result<Tensor> {
    on!(x.device(),
        cpu => ferry_graph::with_no_grad(|| {
            let out = x.matmul(&w.t()?)?.add(b)?;
            if relu { out.relu() } else { Ok(out) }
        }),
        cuda => cuda::linear(x, w, b, relu))
}

/// Softmax's (or log-softmax's) gradient over the last axis from its output; CUDA only (the CPU
/// composes it).
pub(crate) fn softmax_backward(y: &Tensor, g: &Tensor, log: bool) -> Result<Tensor> {
    cuda::softmax_backward(y, g, log)
}

/// `-mean(logp[i, targets[i]])` of `[rows, classes]` log-probabilities (cross-entropy's last
/// step). The CPU checks the targets at once; CUDA checks them on the device and reports a bad
/// one from a later call (see `CudaDevice::check_later`).
pub(crate) fn nll(logp: &Tensor, targets: &Tensor) -> Result<Tensor> {
    on!(logp.device(), cpu => cpu::reduce::nll(logp, targets), cuda => cuda::nll(logp, targets))
}

/// nll's gradient with respect to `[rows, classes]` log-probabilities, from the 0-d `g`.
pub(crate) fn nll_backward(targets: &Tensor, g: &Tensor, classes: usize) -> Result<Tensor> {
    on!(g.device(),
        cpu => cpu::reduce::nll_backward(targets, g, classes),
        cuda => cuda::nll_backward(targets, g, classes))
}

/// Softmax (or log-softmax) over the last axis.
pub(crate) fn softmax(x: &Tensor, log: bool) -> Result<Tensor> {
    on!(x.device(), cpu => cpu::reduce::softmax(x, log), cuda => cuda::softmax(x, log))
}

pub(crate) fn matmul(
    a: &Tensor,
    la: &Layout,
    b: &Tensor,
    lb: &Layout,
    batch: &[usize],
) -> Result<Tensor> {
    on!(a.device(),
        cpu => cpu::matmul::matmul(a, la, b, lb, batch),
        cuda => cuda::matmul(a, la, b, lb, batch))
}

pub(crate) fn contiguous(x: &Tensor) -> Result<Tensor> {
    on!(x.device(), cpu => cpu::copy::contiguous(x), cuda => cuda::contiguous(x))
}

pub(crate) fn assign(dst: &Tensor, src: &Tensor) -> Result<()> {
    on!(dst.device(), cpu => cpu::copy::assign(dst, src), cuda => cuda::assign(dst, src))
}

pub(crate) fn cat(parts: &[Tensor], axis: usize, shape: &[usize]) -> Result<Tensor> {
    on!(parts[0].device(), cpu => cpu::copy::cat(parts, axis, shape), cuda => cuda::cat(parts, axis, shape))
}

pub(crate) fn full(shape: &[usize], dtype: DType, device: Device, value: f64) -> Result<Tensor> {
    match device {
        Device::Cpu => cpu::full(shape, dtype, value),
        Device::Cuda(ordinal) => cuda::full(ordinal, shape, dtype, value),
    }
}

/// Elements of a contiguous tensor, read out to a `Vec`.
pub(crate) fn read_elements<T: Element>(x: &Tensor) -> Result<Vec<T>> {
    on!(x.device(),
        cpu => {
            let data = x.storage().host::<T>("to_vec")?;
            let off = x.layout().offset();
            Ok(data[off..off + x.numel()].to_vec())
        },
        cuda => cuda::read_elements::<T>(x))
}
