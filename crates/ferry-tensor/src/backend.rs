//! Sends each primitive to the kernels of the device its tensors live on: the one place that
//! matches on the device (`on`) and the one place kernels' outputs become tensors. Ops above
//! it check arguments and record nodes; below it each device (`cpu::Cpu`, `cuda::Cuda`)
//! implements the interface in `kernel` (`Backend`: a trait per op family) on storage and
//! layouts, knowing nothing of tensors, and names ops only through the vocabulary in `op`.
//! Each function here views its tensors as `Operand`s, calls the device's method and wraps the
//! `Dense` output.
//!
//! Fused paths (cuBLASLt's linear epilogue, cuDNN's convolution passes and fused attention,
//! the host's blocked attention, softmax's and nll's one-pass gradients) are capabilities the backend answers: each such trait method's default
//! returns `Ok(None)`, so a device without the kernel or library says nothing, and the op or
//! rule composes the same result from primitives. Which libraries load, and the switches that
//! turn them off (`FERRY_CUBLASLT`, `FERRY_CUDNN`, `FERRY_CUDNN_ATTENTION`), are read by the
//! device's kernels, never above this module.
//!
//! Adding a fused op touches (attention, RMSNorm and cross-entropy were added this way):
//! 1. the op table: its public method in `ops/<family>.rs`, which calls the fused path here and
//!    composes on `None`, and its gradient rule in `rules` (a row of `op` too when it is an
//!    elementwise or reduction op, or a struct of scalars there when kernels read one);
//! 2. the backend interface: one method with its default `Ok(None)` in its family's trait in
//!    `kernel.rs` (`Reduce`, `Matmul`, `Norm`, `Conv`, ...; a new family is a new trait there,
//!    added to `Backend`'s list), and its dispatch function at the end of this file;
//! 3. one kernel file per device that has the path: the method in `impl <Family> for Cpu` in
//!    `cpu/<family>.rs` and in `impl <Family> for Cuda` in `cuda/<family>.rs`; a device that
//!    composes it writes nothing. A CUDA kernel's C source sits in kernels/ and is loaded
//!    through a `Kernel` id (a variant in `cuda/kernels.rs`, like every kernel's).

use ferry_memory::{DType, Device, Element};

use ferry_cuda::ConvPass;

use crate::cpu::{self, Cpu};
use crate::cuda::{self, Cuda};
use crate::kernel::{Backend, Dense, Operand};
use crate::layout::Layout;
use crate::op::AdamStep;
use crate::op::attention::Attend;
use crate::op::conv::Geometry;
use crate::op::{BinaryOp, CmpOp, ReduceOp, UnaryOp};
use crate::{Result, Tensor};

/// The kernels of `device`: the one match on the device.
fn on(device: Device) -> &'static dyn Backend {
    match device {
        Device::Cpu => &Cpu,
        Device::Cuda(_) => &Cuda,
    }
}

/// `t`'s storage seen through its own layout.
fn view(t: &Tensor) -> Operand<'_> {
    Operand::new(t.storage(), t.layout())
}

/// `t`'s storage seen through `layout` (broadcast to an op's output shape, say).
fn view_as<'a>(t: &'a Tensor, layout: &'a Layout) -> Operand<'a> {
    Operand::new(t.storage(), layout)
}

fn views(ts: &[Tensor]) -> Vec<Operand<'_>> {
    ts.iter().map(view).collect()
}

/// A kernel's output as a tensor without history: the one place kernels' outputs become
/// tensors.
fn tensor(out: Dense) -> Tensor {
    let (storage, layout) = out.into_parts();
    Tensor::from_contiguous(storage, layout)
}

pub(crate) fn unary(x: &Tensor, op: UnaryOp) -> Result<Tensor> {
    on(x.device()).unary(&view(x), op).map(tensor)
}

pub(crate) fn binary(
    a: &Tensor,
    la: &Layout,
    b: &Tensor,
    lb: &Layout,
    op: BinaryOp,
) -> Result<Tensor> {
    on(a.device())
        .binary(&view_as(a, la), &view_as(b, lb), op)
        .map(tensor)
}

pub(crate) fn compare(
    a: &Tensor,
    la: &Layout,
    b: &Tensor,
    lb: &Layout,
    op: CmpOp,
) -> Result<Tensor> {
    on(a.device())
        .compare(&view_as(a, la), &view_as(b, lb), op)
        .map(tensor)
}

pub(crate) fn cast(x: &Tensor, dtype: DType) -> Result<Tensor> {
    on(x.device()).cast(&view(x), dtype).map(tensor)
}

/// The rotary embedding of `x` (with `inverse`, its transpose) in one pass, where the device has
/// the kernel; `cos` and `sin` (one shape) are broadcast to `x`'s shape here.
pub(crate) fn rotary(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    inverse: bool,
) -> Result<Option<Tensor>> {
    let (Some(lc), Some(ls)) = (
        cos.layout().broadcast_to(x.shape()),
        sin.layout().broadcast_to(x.shape()),
    ) else {
        return Ok(None);
    };
    let out = on(x.device()).rotary(&view(x), &view_as(cos, &lc), &view_as(sin, &ls), inverse)?;
    Ok(out.map(tensor))
}

pub(crate) fn reduce(x: &Tensor, axis: usize, op: ReduceOp) -> Result<Tensor> {
    on(x.device()).reduce(&view(x), axis, op).map(tensor)
}

pub(crate) fn sum_all(x: &Tensor) -> Result<Tensor> {
    on(x.device()).sum_all(&view(x)).map(tensor)
}

/// `-mean(logp[i, targets[i]])` of `[rows, classes]` log-probabilities (cross-entropy's last
/// step). The CPU checks the targets at once; CUDA checks them on the device and reports a bad
/// one from a later call (see `CudaDevice::check_later`).
pub(crate) fn nll(logp: &Tensor, targets: &Tensor) -> Result<Tensor> {
    on(logp.device())
        .nll(&view(logp), &view(targets))
        .map(tensor)
}

/// Softmax (or log-softmax) over the last axis.
pub(crate) fn softmax(x: &Tensor, log: bool) -> Result<Tensor> {
    on(x.device()).softmax(&view(x), log).map(tensor)
}

pub(crate) fn matmul(
    a: &Tensor,
    la: &Layout,
    b: &Tensor,
    lb: &Layout,
    batch: &[usize],
) -> Result<Tensor> {
    on(a.device())
        .matmul(&view_as(a, la), &view_as(b, lb), batch)
        .map(tensor)
}

pub(crate) fn contiguous(x: &Tensor) -> Result<Tensor> {
    on(x.device()).contiguous(&view(x)).map(tensor)
}

pub(crate) fn assign(dst: &Tensor, src: &Tensor) -> Result<()> {
    on(dst.device()).assign(&view(dst), &view(src))
}

pub(crate) fn cat(parts: &[Tensor], axis: usize, shape: &[usize]) -> Result<Tensor> {
    on(parts[0].device())
        .cat(&views(parts), axis, shape)
        .map(tensor)
}

pub(crate) fn full(shape: &[usize], dtype: DType, device: Device, value: f64) -> Result<Tensor> {
    on(device).full(device, shape, dtype, value).map(tensor)
}

/// Elements of a contiguous tensor, read out to a `Vec` (generic over the element type, so
/// beside the interface rather than in it).
pub(crate) fn read_elements<T: Element>(x: &Tensor) -> Result<Vec<T>> {
    match x.device() {
        Device::Cpu => cpu::read_elements::<T>(&view(x)),
        Device::Cuda(_) => cuda::read_elements::<T>(&view(x)),
    }
}

/// The entries `index` names along `axis`.
pub(crate) fn index_select(x: &Tensor, axis: usize, index: &Tensor) -> Result<Tensor> {
    on(x.device())
        .index_select(&view(x), axis, &view(index))
        .map(tensor)
}

/// `x` plus `src` added at the entries `index` names along `axis`.
pub(crate) fn index_add(x: &Tensor, axis: usize, index: &Tensor, src: &Tensor) -> Result<Tensor> {
    on(x.device())
        .index_add(&view(x), axis, &view(index), &view(src))
        .map(tensor)
}

/// Values picked along `axis` by `index`.
pub(crate) fn gather(x: &Tensor, axis: usize, index: &Tensor) -> Result<Tensor> {
    on(x.device())
        .gather(&view(x), axis, &view(index))
        .map(tensor)
}

/// `x` plus `src` scattered along `axis` by `index`.
pub(crate) fn scatter_add(x: &Tensor, axis: usize, index: &Tensor, src: &Tensor) -> Result<Tensor> {
    on(x.device())
        .scatter_add(&view(x), axis, &view(index), &view(src))
        .map(tensor)
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
    on(a.device())
        .where_cond(&view_as(c, lc), &view_as(a, la), &view_as(b, lb))
        .map(tensor)
}

/// Dropout's output and its `u8` keep-mask, drawn from `seed`.
pub(crate) fn dropout(x: &Tensor, p: f64, scale: f64, seed: u64) -> Result<(Tensor, Tensor)> {
    let (out, mask) = on(x.device()).dropout(&view(x), p, scale, seed)?;
    Ok((tensor(out), tensor(mask)))
}

/// `x * scale` where `mask` is nonzero, else 0.
pub(crate) fn masked_scale(x: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    on(x.device())
        .masked_scale(&view(x), &view(mask), scale)
        .map(tensor)
}

/// Layer norm's output and `[rows, 2]` statistics of `x` (`[rows, cols]`).
pub(crate) fn layer_norm(
    x: &Tensor,
    w: Option<&Tensor>,
    b: Option<&Tensor>,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let (w, b) = (w.map(view), b.map(view));
    let (y, stats) = on(x.device()).layer_norm(&view(x), w.as_ref(), b.as_ref(), eps)?;
    Ok((tensor(y), tensor(stats)))
}

/// Layer norm's `dx`, `dweight` and `dbias`, each only when `want` says so.
pub(crate) fn layer_norm_backward(
    g: &Tensor,
    x: &Tensor,
    w: Option<&Tensor>,
    stats: &Tensor,
    want: [bool; 3],
) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
    let w = w.map(view);
    let (dx, dw, db) =
        on(g.device()).layer_norm_backward(&view(g), &view(x), w.as_ref(), &view(stats), want)?;
    Ok((dx.map(tensor), dw.map(tensor), db.map(tensor)))
}

/// Columns `[N, C·KH·KW, OH·OW]` of an NCHW input.
pub(crate) fn im2col(x: &Tensor, geo: &Geometry) -> Result<Tensor> {
    on(x.device()).im2col(&view(x), geo).map(tensor)
}

/// Columns folded back into NCHW, summing what lands on one pixel.
pub(crate) fn col2im(cols: &Tensor, geo: &Geometry) -> Result<Tensor> {
    on(cols.device()).col2im(&view(cols), geo).map(tensor)
}

/// The index of each pooling window's maximum.
pub(crate) fn pool_argmax(x: &Tensor, geo: &Geometry) -> Result<Tensor> {
    on(x.device()).pool_argmax(&view(x), geo).map(tensor)
}

/// One Adam (or AdamW) step on contiguous `p`, `m` and `v` from `g`, in place.
pub(crate) fn adam(p: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor, step: &AdamStep) -> Result<()> {
    on(p.device()).adam(&view(p), &view(g), &view(m), &view(v), step)
}

/// `start, start + 1, ..` (`len` of them).
pub(crate) fn arange(start: f64, len: usize, dtype: DType, device: Device) -> Result<Tensor> {
    on(device).arange(device, start, len, dtype).map(tensor)
}

/// Uniform (or standard normal, when `normal`) samples fixed by `seed`.
pub(crate) fn random(
    shape: &[usize],
    dtype: DType,
    device: Device,
    seed: u64,
    normal: bool,
) -> Result<Tensor> {
    on(device)
        .random(device, shape, dtype, seed, normal)
        .map(tensor)
}

/// Contiguous `parts` (of one dtype and device) copied into one 1-D tensor of `len` bytes, each
/// at its byte offset.
pub(crate) fn pack(parts: &[Tensor], offsets: &[usize], len: usize) -> Result<Tensor> {
    on(parts[0].device())
        .pack(&views(parts), offsets, len)
        .map(tensor)
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
    let out = on(x.device()).fused_linear(&view(x), &view(w), &view(b), relu)?;
    Ok(out.map(tensor))
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
    let out =
        on(first.device()).convolution(pass, geo, groups, filters, &view(first), &view(second))?;
    Ok(out.map(tensor))
}

/// Softmax's (or log-softmax's) gradient over the last axis from its output `y`, in one pass:
/// a kernel on a GPU when `g` has `y`'s dtype; the CPU composes it.
pub(crate) fn softmax_backward(y: &Tensor, g: &Tensor, log: bool) -> Result<Option<Tensor>> {
    let out = on(y.device()).softmax_backward(&view(y), &view(g), log)?;
    Ok(out.map(tensor))
}

/// nll's gradient with respect to `[rows, classes]` log-probabilities, from the 0-d `g`: one
/// kernel on every device.
pub(crate) fn nll_backward(targets: &Tensor, g: &Tensor, classes: usize) -> Result<Option<Tensor>> {
    let out = on(g.device()).nll_backward(&view(targets), &view(g), classes)?;
    Ok(out.map(tensor))
}

/// Fused attention's output and log-sum-exp, where the device has the kernel.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    how: &Attend,
) -> Result<Option<(Tensor, Tensor)>> {
    let fused = on(q.device()).attention(&view(q), &view(k), &view(v), how)?;
    Ok(fused.map(|(out, lse)| (tensor(out), tensor(lse))))
}

/// Fused attention's gradients of `q`, `k` and `v`, where the device has the kernel.
pub(crate) fn attention_backward(
    [q, k, v]: [&Tensor; 3],
    out: &Tensor,
    g: &Tensor,
    lse: &Tensor,
    how: &Attend,
) -> Result<Option<[Tensor; 3]>> {
    let grads = on(q.device()).attention_backward(
        &view(q),
        &view(k),
        &view(v),
        &view(out),
        &view(g),
        &view(lse),
        how,
    )?;
    Ok(grads.map(|g| g.map(tensor)))
}

/// RMSNorm's output and `[rows]` inverse root mean squares of `x` (`[rows, cols]`).
pub(crate) fn rms_norm(x: &Tensor, w: Option<&Tensor>, eps: f64) -> Result<(Tensor, Tensor)> {
    let w = w.map(view);
    let (y, rstd) = on(x.device()).rms_norm(&view(x), w.as_ref(), eps)?;
    Ok((tensor(y), tensor(rstd)))
}

/// RMSNorm's `dx` and `dweight`, each only when `want` says so.
pub(crate) fn rms_norm_backward(
    g: &Tensor,
    x: &Tensor,
    w: Option<&Tensor>,
    rstd: &Tensor,
    want: [bool; 2],
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let w = w.map(view);
    let (dx, dw) =
        on(g.device()).rms_norm_backward(&view(g), &view(x), w.as_ref(), &view(rstd), want)?;
    Ok((dx.map(tensor), dw.map(tensor)))
}

/// Cross-entropy's mean loss and per-row log-sum-exp in one pass over the logits, where the
/// device has the kernel (both do).
pub(crate) fn cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    ignore: Option<i64>,
) -> Result<Option<(Tensor, Tensor)>> {
    let fused = on(logits.device()).cross_entropy(&view(logits), &view(targets), ignore)?;
    Ok(fused.map(|(loss, lse)| (tensor(loss), tensor(lse))))
}

/// Cross-entropy's logits gradient from the log-sum-exp, where the device has the kernel.
pub(crate) fn cross_entropy_backward(
    logits: &Tensor,
    targets: &Tensor,
    lse: &Tensor,
    scale: &Tensor,
    ignore: Option<i64>,
) -> Result<Option<Tensor>> {
    let out = on(logits.device()).cross_entropy_backward(
        &view(logits),
        &view(targets),
        &view(lse),
        &view(scale),
        ignore,
    )?;
    Ok(out.map(tensor))
}
