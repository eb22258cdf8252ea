//! CPU kernels: generic over the element type, parallel with rayon above a size threshold.

pub(crate) mod conv;
pub(crate) mod copy;
pub(crate) mod create;
pub(crate) mod elementwise;
pub(crate) mod index;
pub(crate) mod matmul;
pub(crate) mod norm;
pub(crate) mod optim;
pub(crate) mod reduce;
pub(crate) mod select;

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

use ferry_memory::{DType, Element};

use crate::storage::Storage;
use crate::{Result, Tensor};

/// A fresh contiguous host tensor of `shape`, filled by `fill`, which must write every element:
/// the buffer starts with unspecified contents (a recycled block, to skip the allocator and
/// the zeroing on small outputs).
pub(crate) fn build<T: Element>(
    op: &'static str,
    shape: &[usize],
    fill: impl FnOnce(&mut [T]),
) -> Result<Tensor> {
    let bytes = crate::layout::shape_bytes(op, shape, T::DTYPE)?;
    let buffer = ferry_memory::HostBuffer::for_overwrite(bytes)?;
    let storage = Storage::new(
        crate::Buffer::Host(buffer),
        T::DTYPE,
        ferry_memory::Device::Cpu,
    );
    fill(&mut storage.host_mut::<T>(op)?);
    Ok(Tensor::from_shape(storage, shape))
}

/// `x` itself when contiguous, else a contiguous copy; kernels use it so that reading an input
/// never records a graph node.
pub(crate) fn dense(x: &Tensor) -> Result<Tensor> {
    if x.is_contiguous() {
        Ok(x.clone())
    } else {
        copy::contiguous(x)
    }
}

/// A contiguous host tensor of `dtype` with every element `value`.
pub(crate) fn full(shape: &[usize], dtype: DType, value: f64) -> Result<Tensor> {
    any_dispatch!(dtype, |T| build::<T>("full", shape, |out| out
        .fill(<T as Element>::from_f64(value))))
}
