//! Batched matrix products through the `gemm` crate, reading strided operands in place.

use ferry_memory::DType;
use ferry_memory::gemm::{self, GemmElement, MatRef};
use half::f16;

use super::Cpu;
use super::build;
use crate::kernel::{Dense, Elementwise, Matmul, Operand, View};
use crate::layout::Layout;
use crate::{Result, TensorError};

impl Matmul for Cpu {
    /// `a [.., m, k] · b [.., k, n]` with batch layouts already broadcast to `batch`.
    fn matmul(&self, a: &Operand<'_>, b: &Operand<'_>, batch: &[usize]) -> Result<Dense> {
        match a.dtype() {
            DType::F32 => typed::<f32>(a, b, batch),
            DType::F64 => typed::<f64>(a, b, batch),
            DType::F16 => typed::<f16>(a, b, batch),
            // gemm has no bf16 kernels: compute in f32, round once at the end.
            DType::BF16 => {
                let (a32, b32) = (Cpu.cast(a, DType::F32)?, Cpu.cast(b, DType::F32)?);
                let out = typed::<f32>(&a32.operand(), &b32.operand(), batch)?;
                Cpu.cast(&out.operand(), DType::BF16)
            }
            dtype => Err(TensorError::UnsupportedDType {
                op: "matmul",
                dtype,
                hint: "matmul needs a float dtype; cast with `.to_dtype(DType::F32)`",
            }),
        }
    }
}

fn typed<T: GemmElement + ferry_memory::Element>(
    a: &Operand<'_>,
    b: &Operand<'_>,
    batch: &[usize],
) -> Result<Dense> {
    let (la, lb) = (a.layout(), b.layout());
    let nd = la.ndim();
    let (m, k, n) = (la.shape()[nd - 2], la.shape()[nd - 1], lb.shape()[nd - 1]);
    let mut out_shape = batch.to_vec();
    out_shape.extend([m, n]);
    // Sized first: the batch count below is a product that only a checked shape bounds.
    if crate::layout::shape_bytes("matmul", &out_shape, T::DTYPE)? == 0 {
        return build::<T>("matmul", &out_shape, |_| {});
    }
    let (x, y) = (
        a.storage().host::<T>("matmul")?,
        b.storage().host::<T>("matmul")?,
    );
    let count: usize = batch.iter().product();
    let threads = if m.saturating_mul(n).saturating_mul(k) >= 1 << 18 {
        rayon::current_num_threads()
    } else {
        1
    };
    // Offsets of each batch's matrices: walk the batch dims of each layout.
    let batch_offsets = |l: &Layout| {
        let batch_only = Layout::from_parts(
            l.shape()[..nd - 2].into(),
            l.strides()[..nd - 2].into(),
            l.offset(),
        );
        batch_only.offsets().collect::<Vec<_>>()
    };
    let (oa, ob) = (batch_offsets(la), batch_offsets(lb));
    let mut result = Ok(());
    let out = build::<T>("matmul", &out_shape, |out| {
        for i in 0..count {
            let lhs = MatRef {
                data: &x,
                offset: oa[i],
                row_stride: la.strides()[nd - 2],
                col_stride: la.strides()[nd - 1],
            };
            let rhs = MatRef {
                data: &y,
                offset: ob[i],
                row_stride: lb.strides()[nd - 2],
                col_stride: lb.strides()[nd - 1],
            };
            if let Err(e) = gemm::matmul(
                m,
                n,
                k,
                lhs,
                rhs,
                &mut out[i * m * n..(i + 1) * m * n],
                threads,
            ) {
                result = Err(e);
                return;
            }
        }
    })?;
    result?;
    Ok(out)
}
