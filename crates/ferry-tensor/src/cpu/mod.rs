//! CPU kernels on host storage and layouts: generic over the element type, parallel with rayon
//! above a size threshold. [`Cpu`] implements every family's trait of the backend interface, each
//! in the family's file.

mod attention;
mod conv;
mod copy;
mod create;
mod elementwise;
mod index;
mod loss;
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

use ferry_memory::{Device, Element};

use crate::Result;
use crate::kernel::{Copies, Dense, Operand, Source, View};
use crate::storage::Storage;

/// The host's kernels: each family's trait (`kernel`) is implemented in its file here.
pub(crate) struct Cpu;

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
        Cpu.contiguous(x).map(Source::Copy)
    }
}

/// Elements of a contiguous host operand, read out to a `Vec`.
pub(crate) fn read_elements<T: Element>(x: &Operand<'_>) -> Result<Vec<T>> {
    let data = x.storage().host::<T>("to_vec")?;
    let off = x.layout().offset();
    Ok(data[off..off + x.numel()].to_vec())
}
