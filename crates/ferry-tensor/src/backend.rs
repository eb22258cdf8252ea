//! Sends each primitive to the kernels of the device its tensors live on: the one place that
//! matches on the device. Ops above it check arguments and record nodes; the kernels below it
//! (`cpu`, `cuda`) each serve one device and name ops only through the vocabulary in `op`.
//!
//! Fused paths (cuBLASLt's linear epilogue, cuDNN's convolution passes, softmax's and nll's
//! one-pass gradients) are capabilities the backend answers: each returns `Ok(None)` where the
//! device has no kernel or library for it, and the op or rule composes the same result from
//! primitives. Which libraries load, and the switches that turn them off (`FERRY_CUBLASLT`,
//! `FERRY_CUDNN`), are read by the device's kernels, never above this module.
//!
//! Adding a fused op (attention, RMSNorm, cross-entropy) touches:
//! 1. the op table: its public method in `ops/<family>.rs`, which calls the fused path here and
//!    composes on `None`, and its gradient rule in `rules` (a row of `op` too when it is an
//!    elementwise or reduction op, or a struct of scalars there when kernels read one);
//! 2. the backend interface: one function in the fused paths at the end of this file;
//! 3. one kernel file per device: `cpu/<family>.rs` (or `Ok(None)` here, where the CPU composes
//!    it) and `cuda/<family>.rs`, whose CUDA C source sits in kernels/ and is loaded through a
//!    `Kernel` id (a variant in `cuda/kernels.rs`, like every kernel's).

use ferry_memory::{DType, Device, Element};

use ferry_cuda::ConvPass;

use crate::layout::Layout;
use crate::op::AdamStep;
use crate::op::conv::Geometry;
use crate::op::{BinaryOp, CmpOp, ReduceOp, UnaryOp};
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

/// `-mean(logp[i, targets[i]])` of `[rows, classes]` log-probabilities (cross-entropy's last
/// step). The CPU checks the targets at once; CUDA checks them on the device and reports a bad
/// one from a later call (see `CudaDevice::check_later`).
pub(crate) fn nll(logp: &Tensor, targets: &Tensor) -> Result<Tensor> {
    on!(logp.device(), cpu => cpu::reduce::nll(logp, targets), cuda => cuda::nll(logp, targets))
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
        Device::Cuda(_) => cuda::full(device, shape, dtype, value),
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

/// The entries `index` names along `axis`.
pub(crate) fn index_select(x: &Tensor, axis: usize, index: &Tensor) -> Result<Tensor> {
    on!(x.device(),
        cpu => cpu::index::index_select(x, axis, index),
        cuda => cuda::index::index_select(x, axis, index))
}

/// `x` plus `src` added at the entries `index` names along `axis`.
pub(crate) fn index_add(x: &Tensor, axis: usize, index: &Tensor, src: &Tensor) -> Result<Tensor> {
    on!(x.device(),
        cpu => cpu::index::index_add(x, axis, index, src),
        cuda => cuda::index::index_add(x, axis, index, src))
}

/// Values picked along `axis` by `index`.
pub(crate) fn gather(x: &Tensor, axis: usize, index: &Tensor) -> Result<Tensor> {
    on!(x.device(),
        cpu => cpu::index::gather(x, axis, index),
        cuda => cuda::index::gather(x, axis, index))
}

/// `x` plus `src` scattered along `axis` by `index`.
pub(crate) fn scatter_add(x: &Tensor, axis: usize, index: &Tensor, src: &Tensor) -> Result<Tensor> {
    on!(x.device(),
        cpu => cpu::index::scatter_add(x, axis, index, src),
        cuda => cuda::index::scatter_add(x, axis, index, src))
}

/// `a` where `c != 0`, else `b`, over layouts already broadcast to the output's shape.
pub(crate) fn where_cond(
    c: &Tensor,
    lc: &Layout,
    a: &Tensor,
    la: &Layout,
    b: &Tensor,
    lb: &Layout,
) -> Result<Tensor> {
    on!(a.device(),
        cpu => cpu::select::where_cond(c, lc, a, la, b, lb),
        cuda => cuda::select::where_cond(c, lc, a, la, b, lb))
}

/// Dropout's output and its `u8` keep-mask, drawn from `seed`.
pub(crate) fn dropout(x: &Tensor, p: f64, scale: f64, seed: u64) -> Result<(Tensor, Tensor)> {
    on!(x.device(),
        cpu => cpu::select::dropout(x, p, scale, seed),
        cuda => cuda::select::dropout(x, p, scale, seed))
}

/// `x * scale` where `mask` is nonzero, else 0.
pub(crate) fn masked_scale(x: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    on!(x.device(),
        cpu => cpu::select::masked_scale(x, mask, scale),
        cuda => cuda::select::masked_scale(x, mask, scale))
}

/// Layer norm's output and `[rows, 2]` statistics of `x` (`[rows, cols]`).
pub(crate) fn layer_norm(
    x: &Tensor,
    w: Option<&Tensor>,
    b: Option<&Tensor>,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    on!(x.device(),
        cpu => cpu::norm::layer_norm(x, w, b, eps),
        cuda => cuda::norm::layer_norm(x, w, b, eps))
}

/// Layer norm's `dx`, `dweight` and `dbias`, each only when `want` says so.
pub(crate) fn layer_norm_backward(
    g: &Tensor,
    x: &Tensor,
    w: Option<&Tensor>,
    stats: &Tensor,
    want: [bool; 3],
) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
    on!(g.device(),
        cpu => cpu::norm::layer_norm_backward(g, x, w, stats, want),
        cuda => cuda::norm::layer_norm_backward(g, x, w, stats, want))
}

/// Columns `[N, C·KH·KW, OH·OW]` of an NCHW input.
pub(crate) fn im2col(x: &Tensor, geo: &Geometry) -> Result<Tensor> {
    on!(x.device(), cpu => cpu::conv::im2col(x, geo), cuda => cuda::conv::im2col(x, geo))
}

/// Columns folded back into NCHW, summing what lands on one pixel.
pub(crate) fn col2im(cols: &Tensor, geo: &Geometry) -> Result<Tensor> {
    on!(cols.device(), cpu => cpu::conv::col2im(cols, geo), cuda => cuda::conv::col2im(cols, geo))
}

/// The index of each pooling window's maximum.
pub(crate) fn pool_argmax(x: &Tensor, geo: &Geometry) -> Result<Tensor> {
    on!(x.device(), cpu => cpu::conv::pool_argmax(x, geo), cuda => cuda::conv::pool_argmax(x, geo))
}

/// One Adam (or AdamW) step on contiguous `p`, `m` and `v` from `g`, in place.
pub(crate) fn adam(p: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor, step: &AdamStep) -> Result<()> {
    on!(p.device(), cpu => cpu::optim::adam(p, g, m, v, step), cuda => cuda::adam(p, g, m, v, step))
}

/// `start, start + 1, ..` (`len` of them).
pub(crate) fn arange(start: f64, len: usize, dtype: DType, device: Device) -> Result<Tensor> {
    match device {
        Device::Cpu => cpu::create::arange(start, len, dtype),
        Device::Cuda(ordinal) => cuda::arange(ordinal, start, len, dtype),
    }
}

/// Uniform (or standard normal, when `normal`) samples fixed by `seed`.
pub(crate) fn random(
    shape: &[usize],
    dtype: DType,
    device: Device,
    seed: u64,
    normal: bool,
) -> Result<Tensor> {
    match device {
        Device::Cpu => cpu::create::random(shape, dtype, seed, normal),
        Device::Cuda(ordinal) => cuda::random(ordinal, shape, dtype, seed, normal),
    }
}

/// Contiguous `parts` (of one dtype and device) copied into one 1-D tensor of `len` bytes, each
/// at its byte offset.
pub(crate) fn pack(parts: &[Tensor], offsets: &[usize], len: usize) -> Result<Tensor> {
    on!(parts[0].device(),
        cpu => cpu::copy::pack(parts, offsets, len),
        cuda => cuda::pack(parts, offsets, len))
}

// Fused paths. Each answers `Ok(None)` where the device has no kernel (or library call) for it,
// and the op or rule then composes the same result from primitives: ops and rules never ask
// which device they run on, or which libraries it has, only these.

/// `x [.., in] · wᵀ + b`, then ReLU when `relu`, as one product: cuBLASLt's epilogue on a GPU
/// where the library loads, `FERRY_CUBLASLT` is not `0`, and all three share one dtype of f32,
/// f16 or bf16 and the device.
pub(crate) fn fused_linear(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    relu: bool,
) -> Result<Option<Tensor>> {
    on!(x.device(), cpu => Ok(None), cuda => cuda::linear(x, w, b, relu))
}

/// One native convolution pass (cuDNN, where it loads and is enabled for the dtype): `Forward`
/// takes (x, w), `BackwardData` (dy, w), `BackwardFilter` (x, dy). Elsewhere conv2d is composed
/// from im2col and a product.
pub(crate) fn convolution(
    pass: ConvPass,
    geo: &Geometry,
    groups: usize,
    filters: usize,
    first: &Tensor,
    second: &Tensor,
) -> Result<Option<Tensor>> {
    on!(first.device(),
        cpu => Ok(None),
        cuda => cuda::conv::convolution(pass, geo, groups, filters, first, second))
}

/// Softmax's (or log-softmax's) gradient over the last axis from its output `y`, in one pass:
/// a kernel on a GPU when `g` has `y`'s dtype; the CPU composes it.
pub(crate) fn softmax_backward(y: &Tensor, g: &Tensor, log: bool) -> Result<Option<Tensor>> {
    on!(y.device(), cpu => Ok(None), cuda => cuda::softmax_backward(y, g, log))
}

/// nll's gradient with respect to `[rows, classes]` log-probabilities, from the 0-d `g`: one
/// kernel on every device.
pub(crate) fn nll_backward(targets: &Tensor, g: &Tensor, classes: usize) -> Result<Option<Tensor>> {
    on!(g.device(),
        cpu => cpu::reduce::nll_backward(targets, g, classes).map(Some),
        cuda => cuda::nll_backward(targets, g, classes).map(Some))
}
