//! Batched matrix products through cuBLAS, reading transposed and broadcast operands in place
//! where their strides allow and copying only when they do not.

use ferry_cuda::{Blas, BlasLt, GemmEpilogue, GemmInput, GemmOutput, GemmSpec};
use ferry_memory::DType;

use super::{Cuda, buffer, dense, with_output};
use crate::kernel::{Copies, Create, Dense, Matmul, Operand, Source, View};
use crate::layout::Layout;
use crate::{Result, TensorError};

/// How cuBLAS can read one operand: its elements (in place, or a copy cuBLAS can read), whether
/// its rows are contiguous, the leading dimension, and the distance between batch entries.
struct Matrix<'a> {
    elements: Source<'a>,
    row_major: bool,
    ld: usize,
    stride: usize,
}

impl<'a> Matrix<'a> {
    /// `t` (`[batch.., rows, cols]`), copied only when cuBLAS cannot read it as it is.
    fn new(t: &Operand<'a>) -> Result<Matrix<'a>> {
        if let Some((row_major, ld, stride)) = reading(t.layout()) {
            return Ok(Matrix {
                elements: Source::InPlace(*t),
                row_major,
                ld,
                stride,
            });
        }
        let copy = Cuda.contiguous(t)?;
        let (row_major, ld, stride) =
            reading(copy.layout()).expect("a contiguous operand is row-major");
        Ok(Matrix {
            elements: Source::Copy(copy),
            row_major,
            ld,
            stride,
        })
    }
}

/// Whether cuBLAS reads `layout` row-major, its leading dimension and its batch stride, or
/// `None` where it cannot read it in place.
fn reading(layout: &Layout) -> Option<(bool, usize, usize)> {
    let nd = layout.ndim();
    let (rows, cols) = (layout.shape()[nd - 2], layout.shape()[nd - 1]);
    let (rs, cs) = (layout.strides()[nd - 2], layout.strides()[nd - 1]);
    let stride = batch_stride(&layout.shape()[..nd - 2], &layout.strides()[..nd - 2])?;
    if cols == 1 || cs == 1 {
        let ld = if rows == 1 { cols.max(1) } else { rs };
        if ld >= cols.max(1) {
            return Some((true, ld, stride));
        }
    }
    if rows == 1 || rs == 1 {
        let ld = if cols == 1 { rows.max(1) } else { cs };
        if ld >= rows.max(1) {
            return Some((false, ld, stride));
        }
    }
    None
}

/// One stride that steps through every batch entry in order, if there is one.
fn batch_stride(shape: &[usize], strides: &[usize]) -> Option<usize> {
    let count: usize = shape.iter().product();
    if count <= 1 {
        return Some(0);
    }
    let mut step = None;
    let mut inner = 1;
    for (&n, &s) in shape.iter().zip(strides).rev() {
        if n != 1 {
            let unit = s.checked_div(inner).filter(|u| u * inner == s)?;
            match step {
                None => step = Some(unit),
                Some(u) if u == unit => {}
                Some(_) => return None,
            }
        }
        inner *= n;
    }
    step
}

impl Matmul for Cuda {
    /// `a [.., m, k] · b [.., k, n]` with layouts broadcast to `batch`.
    fn matmul(&self, a: &Operand<'_>, b: &Operand<'_>, batch: &[usize]) -> Result<Dense> {
        let (la, lb) = (a.layout(), b.layout());
        let dtype = a.dtype();
        if !dtype.is_float() {
            return Err(TensorError::UnsupportedDType {
                op: "matmul",
                dtype,
                hint: "matmul needs a float dtype; cast with `.to_dtype(DType::F32)`",
            });
        }
        let nd = la.ndim();
        let (m, k, n) = (la.shape()[nd - 2], la.shape()[nd - 1], lb.shape()[nd - 1]);
        let mut shape = batch.to_vec();
        shape.extend([m, n]);
        // Sized first: `count` and the strides below are products only a checked shape bounds.
        if crate::layout::shape_bytes("matmul", &shape, dtype)? == 0 || k == 0 {
            return self.full(a.device(), &shape, dtype, 0.0);
        }
        let count: usize = batch.iter().product();
        let (lhs, rhs) = (Matrix::new(a)?, Matrix::new(b)?);
        with_output(a.device(), "matmul", &shape, dtype, |dev, out| {
            let (abuf, bbuf) = (buffer(&lhs.elements)?, buffer(&rhs.elements)?);
            // Row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ: B goes first. A row-major operand read
            // column-major is already its transpose, so it needs no transpose flag.
            let spec = GemmSpec {
                dtype,
                transa: !rhs.row_major,
                transb: !lhs.row_major,
                m: n,
                n: m,
                k,
                alpha: 1.0,
                beta: 0.0,
                batch: count,
            };
            let size = dtype.size();
            let first = GemmInput {
                buffer: &bbuf,
                offset_bytes: rhs.elements.layout().offset() * size,
                ld: rhs.ld,
                stride: rhs.stride,
            };
            let second = GemmInput {
                buffer: &abuf,
                offset_bytes: lhs.elements.layout().offset() * size,
                ld: lhs.ld,
                stride: lhs.stride,
            };
            let c = GemmOutput {
                buffer: out,
                offset_bytes: 0,
                ld: n,
                stride: m * n,
            };
            dev.gemm_strided_batched(&spec, first, second, c, dev.default_stream())?;
            drop((abuf, bbuf));
            Ok(())
        })
    }

    /// `x [.., k] · wᵀ + bias` (w is `[n, k]`), then ReLU when `relu`: one cuBLASLt product with
    /// the bias and ReLU in its epilogue, over the input's rows (leading axes flattened). Operands
    /// are read in place where cuBLAS can, like `matmul`. `None` where cuBLASLt cannot fuse it
    /// here.
    fn fused_linear(
        &self,
        x: &Operand<'_>,
        w: &Operand<'_>,
        bias: &Operand<'_>,
        relu: bool,
    ) -> Result<Option<Dense>> {
        if !fuses_linear(x, w, bias) {
            return Ok(None);
        }
        let dtype = x.dtype();
        let (k, n) = (w.shape()[1], w.shape()[0]);
        let rows = x.numel() / k;
        let mut shape = x.shape().to_vec();
        *shape.last_mut().expect("a linear input has an axis") = n;
        // A matrix is read in place as it is (transposed or strided, where cuBLAS can); more axes
        // are flattened into rows, by a view where the layout allows.
        let (flat, copied);
        let x = if x.ndim() == 2 {
            *x
        } else {
            match x.layout().reshape_view(&[rows, k]) {
                Some(layout) => {
                    flat = layout;
                    Operand::new(x.storage(), &flat)
                }
                None => {
                    copied = Cuda.contiguous(x)?;
                    flat = Layout::contiguous(&[rows, k]);
                    Operand::new(copied.storage(), &flat)
                }
            }
        };
        let transposed = w.layout().transpose(0, 1);
        let wt = Operand::new(w.storage(), &transposed);
        let (lhs, rhs) = (Matrix::new(&x)?, Matrix::new(&wt)?);
        let bias = dense(bias)?;
        with_output(x.device(), "linear", &shape, dtype, |dev, out| {
            let (abuf, bbuf, biasbuf) = (
                buffer(&lhs.elements)?,
                buffer(&rhs.elements)?,
                buffer(&bias)?,
            );
            // As in `matmul`: row-major out = x·wᵀ is column-major outᵀ = w·xᵀ, whose rows are the
            // output features, so the bias (one per feature) runs down each column.
            let spec = GemmSpec {
                dtype,
                transa: !rhs.row_major,
                transb: !lhs.row_major,
                m: n,
                n: rows,
                k,
                alpha: 1.0,
                beta: 0.0,
                batch: 1,
            };
            let size = dtype.size();
            let first = GemmInput {
                buffer: &bbuf,
                offset_bytes: rhs.elements.layout().offset() * size,
                ld: rhs.ld,
                stride: 0,
            };
            let second = GemmInput {
                buffer: &abuf,
                offset_bytes: lhs.elements.layout().offset() * size,
                ld: lhs.ld,
                stride: 0,
            };
            let c = GemmOutput {
                buffer: out,
                offset_bytes: 0,
                ld: n,
                stride: 0,
            };
            let epilogue = GemmEpilogue {
                bias: &biasbuf,
                bias_offset_bytes: bias.layout().offset() * size,
                relu,
            };
            dev.gemm_epilogue(&spec, first, second, c, epilogue, dev.default_stream())?;
            drop((abuf, bbuf, biasbuf));
            Ok(())
        })
        .map(Some)
    }
}

/// Whether cuBLASLt can fuse `x · wᵀ + b` here: the library loads, `FERRY_CUBLASLT` is not `0`,
/// none of the three is empty, and they share the device and one dtype it fuses.
fn fuses_linear(x: &Operand<'_>, w: &Operand<'_>, b: &Operand<'_>) -> bool {
    x.numel() > 0
        && w.numel() > 0
        && w.device() == x.device()
        && b.device() == x.device()
        && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && w.dtype() == x.dtype()
        && b.dtype() == x.dtype()
        && ferry_cuda::cublaslt_present()
        && std::env::var_os("FERRY_CUBLASLT").is_none_or(|v| v != "0")
}
