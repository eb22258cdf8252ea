//! CPU kernels on host storage and layouts: generic over the element type, parallel with rayon
//! above a size threshold. [`Cpu`] offers them as the host's [`Backend`].

mod conv;
mod copy;
mod create;
mod elementwise;
mod index;
mod matmul;
mod norm;
mod optim;
mod reduce;
mod select;

/// Below this many elements, threads cost more than they save.
pub(crate) const PARALLEL_THRESHOLD: usize = 1 << 15;
/// Elements per parallel task.
pub(crate) const CHUNK: usize = 1 << 13;

/// Runs `$body` with `$T` bound to the Rust type of a float dtype; other dtypes are an error.
macro_rules! float_dispatch {
    ($dtype:expr, $op:expr, |$T:ident| $body:expr) => {
        match $dtype {
            ferry_memory::DType::F32 => {
                type $T = f32;
                $body
            }
            ferry_memory::DType::F64 => {
                type $T = f64;
                $body
            }
            ferry_memory::DType::F16 => {
                type $T = half::f16;
                $body
            }
            ferry_memory::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            other => {
                return Err($crate::TensorError::UnsupportedDType {
                    op: $op,
                    dtype: other,
                    hint: "only float dtypes support this; cast with `.to_dtype(DType::F32)`",
                })
            }
        }
    };
}

/// Runs `$body` with `$T` bound to the Rust type of any dtype.
macro_rules! any_dispatch {
    ($dtype:expr, |$T:ident| $body:expr) => {
        match $dtype {
            ferry_memory::DType::F32 => {
                type $T = f32;
                $body
            }
            ferry_memory::DType::F64 => {
                type $T = f64;
                $body
            }
            ferry_memory::DType::F16 => {
                type $T = half::f16;
                $body
            }
            ferry_memory::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            ferry_memory::DType::I64 => {
                type $T = i64;
                $body
            }
            ferry_memory::DType::U8 => {
                type $T = u8;
                $body
            }
        }
    };
}

pub(crate) use {any_dispatch, float_dispatch};

use ferry_memory::{DType, Device, Element};

use crate::Result;
use crate::kernel::{Backend, Dense, Operand, Source, View};
use crate::op::conv::Geometry;
use crate::op::{AdamStep, BinaryOp, CmpOp, ReduceOp, UnaryOp};
use crate::storage::Storage;

/// Fresh contiguous host storage of `shape`, filled by `fill`, which must write every element:
/// the buffer starts with unspecified contents (a recycled block, to skip the allocator and
/// the zeroing on small outputs).
pub(crate) fn build<T: Element>(
    op: &'static str,
    shape: &[usize],
    fill: impl FnOnce(&mut [T]),
) -> Result<Dense> {
    let bytes = crate::layout::shape_bytes(op, shape, T::DTYPE)?;
    let buffer = ferry_memory::HostBuffer::for_overwrite(bytes)?;
    let storage = Storage::new(crate::Buffer::Host(buffer), T::DTYPE, Device::Cpu);
    fill(&mut storage.host_mut::<T>(op)?);
    Ok(Dense::new(storage, shape))
}

/// `x` itself when contiguous, else a contiguous copy.
pub(crate) fn dense<'a>(x: &Operand<'a>) -> Result<Source<'a>> {
    if x.is_contiguous() {
        Ok(Source::InPlace(*x))
    } else {
        copy::contiguous(x).map(Source::Copy)
    }
}

/// Host storage of `shape` and `dtype` with every element `value`.
pub(crate) fn full(shape: &[usize], dtype: DType, value: f64) -> Result<Dense> {
    any_dispatch!(dtype, |T| build::<T>("full", shape, |out| out
        .fill(<T as Element>::from_f64(value))))
}

/// Elements of a contiguous host operand, read out to a `Vec`.
pub(crate) fn read_elements<T: Element>(x: &Operand<'_>) -> Result<Vec<T>> {
    let data = x.storage().host::<T>("to_vec")?;
    let off = x.layout().offset();
    Ok(data[off..off + x.numel()].to_vec())
}

/// The host's kernels.
pub(crate) struct Cpu;

impl Backend for Cpu {
    fn unary(&self, x: &Operand<'_>, op: UnaryOp) -> Result<Dense> {
        elementwise::unary(x, op)
    }
    fn binary(&self, a: &Operand<'_>, b: &Operand<'_>, op: BinaryOp) -> Result<Dense> {
        elementwise::binary(a, b, op)
    }
    fn compare(&self, a: &Operand<'_>, b: &Operand<'_>, op: CmpOp) -> Result<Dense> {
        elementwise::compare(a, b, op)
    }
    fn cast(&self, x: &Operand<'_>, dtype: DType) -> Result<Dense> {
        elementwise::cast(x, dtype)
    }
    fn reduce(&self, x: &Operand<'_>, axis: usize, op: ReduceOp) -> Result<Dense> {
        reduce::reduce(x, axis, op)
    }
    fn sum_all(&self, x: &Operand<'_>) -> Result<Dense> {
        reduce::sum_all(x)
    }
    fn nll(&self, logp: &Operand<'_>, targets: &Operand<'_>) -> Result<Dense> {
        reduce::nll(logp, targets)
    }
    fn softmax(&self, x: &Operand<'_>, log: bool) -> Result<Dense> {
        reduce::softmax(x, log)
    }
    fn matmul(&self, a: &Operand<'_>, b: &Operand<'_>, batch: &[usize]) -> Result<Dense> {
        matmul::matmul(a, b, batch)
    }
    fn contiguous(&self, x: &Operand<'_>) -> Result<Dense> {
        copy::contiguous(x)
    }
    fn assign(&self, dst: &Operand<'_>, src: &Operand<'_>) -> Result<()> {
        copy::assign(dst, src)
    }
    fn cat(&self, parts: &[Operand<'_>], axis: usize, shape: &[usize]) -> Result<Dense> {
        copy::cat(parts, axis, shape)
    }
    fn pack(&self, parts: &[Operand<'_>], offsets: &[usize], len: usize) -> Result<Dense> {
        copy::pack(parts, offsets, len)
    }
    fn full(&self, _: Device, shape: &[usize], dtype: DType, value: f64) -> Result<Dense> {
        full(shape, dtype, value)
    }
    fn arange(&self, _: Device, start: f64, len: usize, dtype: DType) -> Result<Dense> {
        create::arange(start, len, dtype)
    }
    fn random(
        &self,
        _: Device,
        shape: &[usize],
        dtype: DType,
        seed: u64,
        normal: bool,
    ) -> Result<Dense> {
        create::random(shape, dtype, seed, normal)
    }
    fn index_select(&self, x: &Operand<'_>, axis: usize, index: &Operand<'_>) -> Result<Dense> {
        index::index_select(x, axis, index)
    }
    fn index_add(
        &self,
        x: &Operand<'_>,
        axis: usize,
        index: &Operand<'_>,
        src: &Operand<'_>,
    ) -> Result<Dense> {
        index::index_add(x, axis, index, src)
    }
    fn gather(&self, x: &Operand<'_>, axis: usize, index: &Operand<'_>) -> Result<Dense> {
        index::gather(x, axis, index)
    }
    fn scatter_add(
        &self,
        x: &Operand<'_>,
        axis: usize,
        index: &Operand<'_>,
        src: &Operand<'_>,
    ) -> Result<Dense> {
        index::scatter_add(x, axis, index, src)
    }
    fn where_cond(&self, c: &Operand<'_>, a: &Operand<'_>, b: &Operand<'_>) -> Result<Dense> {
        select::where_cond(c, a, b)
    }
    fn dropout(&self, x: &Operand<'_>, p: f64, scale: f64, seed: u64) -> Result<(Dense, Dense)> {
        select::dropout(x, p, scale, seed)
    }
    fn masked_scale(&self, x: &Operand<'_>, mask: &Operand<'_>, scale: f64) -> Result<Dense> {
        select::masked_scale(x, mask, scale)
    }
    fn layer_norm(
        &self,
        x: &Operand<'_>,
        w: Option<&Operand<'_>>,
        b: Option<&Operand<'_>>,
        eps: f64,
    ) -> Result<(Dense, Dense)> {
        norm::layer_norm(x, w, b, eps)
    }
    fn layer_norm_backward(
        &self,
        g: &Operand<'_>,
        x: &Operand<'_>,
        w: Option<&Operand<'_>>,
        stats: &Operand<'_>,
        want: [bool; 3],
    ) -> Result<(Option<Dense>, Option<Dense>, Option<Dense>)> {
        norm::layer_norm_backward(g, x, w, stats, want)
    }
    fn im2col(&self, x: &Operand<'_>, geo: &Geometry) -> Result<Dense> {
        conv::im2col(x, geo)
    }
    fn col2im(&self, cols: &Operand<'_>, geo: &Geometry) -> Result<Dense> {
        conv::col2im(cols, geo)
    }
    fn pool_argmax(&self, x: &Operand<'_>, geo: &Geometry) -> Result<Dense> {
        conv::pool_argmax(x, geo)
    }
    fn adam(
        &self,
        p: &Operand<'_>,
        g: &Operand<'_>,
        m: &Operand<'_>,
        v: &Operand<'_>,
        step: &AdamStep,
    ) -> Result<()> {
        optim::adam(p, g, m, v, step)
    }
    // The CPU composes the fused linear, convolution and softmax's gradient from primitives.
    fn nll_backward(
        &self,
        targets: &Operand<'_>,
        g: &Operand<'_>,
        classes: usize,
    ) -> Result<Option<Dense>> {
        reduce::nll_backward(targets, g, classes).map(Some)
    }
}
