//! Batched matrix products through cuBLAS, with every operand's extent checked against its
//! buffer before the call.
//!
//! cuBLAS is column-major. For row-major C (M×N) = A (M×K) · B (K×N), compute the column-major
//! product C^T = B^T · A^T, which reads the same bytes: pass B as `a` and A as `b`, with
//! m = N, n = M, k = K, lda = N, ldb = K, ldc = N, and no transposes.
//!
//! A device's cuBLAS handles are pooled ([`HandlePool`]): each call takes one, sets its stream,
//! and gives it back, so calls from several threads run side by side. Each handle keeps
//! cuBLAS's own default workspace.

use std::ffi::{c_int, c_longlong, c_void};

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::{CudaBlas, result as blas, sys as blas_sys};

use ferry_memory::cuda::{CudaDevice, DeviceBuffer, Stream};
use ferry_memory::{DType, MemoryError};

use crate::CudaLibError;
use crate::pool::HandlePool;
use crate::profile::profiled;
use crate::sealed::Sealed;

/// A device's cuBLAS handles (a device slot, see `CudaDevice::local`), made as calls need them.
#[derive(Default)]
struct BlasHandles(HandlePool<CudaBlas>);

/// Shape and scalars of `C[i] = alpha · op(A[i]) · op(B[i]) + beta · C[i]` for `i < batch`, in
/// cuBLAS's column-major terms: op(A) is m×k, op(B) is k×n, C is m×n.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GemmSpec {
    /// Element type of A, B and C. f32 and f64 compute in their own precision; f16 and bf16
    /// accumulate in f32.
    pub dtype: DType,
    /// Whether op(A) is A transposed.
    pub transa: bool,
    /// Whether op(B) is B transposed.
    pub transb: bool,
    /// Rows of op(A) and C.
    pub m: usize,
    /// Columns of op(B) and C.
    pub n: usize,
    /// Columns of op(A), rows of op(B).
    pub k: usize,
    /// Scale of the product.
    pub alpha: f64,
    /// Scale of C's previous contents (0 ignores them).
    pub beta: f64,
    /// Number of independent products.
    pub batch: usize,
}

/// An input matrix: `ld` is the leading dimension (elements between columns), `stride` the
/// elements between consecutive matrices of the batch (0 reuses one matrix for all).
#[derive(Debug, Clone, Copy)]
pub struct GemmInput<'a> {
    /// The buffer holding it.
    pub buffer: &'a DeviceBuffer,
    /// Where the first matrix starts, in bytes (a multiple of the element size).
    pub offset_bytes: usize,
    /// Leading dimension, in elements.
    pub ld: usize,
    /// Distance between batch entries, in elements.
    pub stride: usize,
}

/// The output matrix; batch entries must not overlap.
#[derive(Debug)]
pub struct GemmOutput<'a> {
    /// The buffer written.
    pub buffer: &'a mut DeviceBuffer,
    /// Where the first matrix starts, in bytes (a multiple of the element size).
    pub offset_bytes: usize,
    /// Leading dimension, in elements.
    pub ld: usize,
    /// Distance between batch entries, in elements.
    pub stride: usize,
}

pub(crate) fn bad(argument: &'static str, reason: String) -> CudaLibError {
    CudaLibError::Memory(MemoryError::GemmArgument { argument, reason })
}

pub(crate) fn to_int(argument: &'static str, value: usize) -> Result<c_int, CudaLibError> {
    c_int::try_from(value).map_err(|_| {
        bad(
            argument,
            format!(
                "is {value}, above cuBLAS's limit of {}; split the batch",
                c_int::MAX
            ),
        )
    })
}

/// Elements one operand spans: `batch` matrices of rows×cols, column-major with `ld`, `stride`
/// apart. `None` on overflow.
fn extent(rows: usize, cols: usize, ld: usize, stride: usize, batch: usize) -> Option<usize> {
    if rows == 0 || cols == 0 || batch == 0 {
        return Some(0);
    }
    let one = ld.checked_mul(cols - 1)?.checked_add(rows)?;
    stride.checked_mul(batch - 1)?.checked_add(one)
}

/// Where one operand lives, for validation.
pub(crate) struct Placement<'a> {
    pub(crate) name: &'static str,
    pub(crate) ld_name: &'static str,
    pub(crate) buffer: &'a DeviceBuffer,
    pub(crate) offset: usize,
    pub(crate) ld: usize,
    pub(crate) stride: usize,
}

/// Checks that one stored rows×cols operand lies inside its buffer; returns its leading
/// dimension as a C int.
pub(crate) fn check_operand(
    place: Placement<'_>,
    (rows, cols): (usize, usize),
    batch: usize,
    elem: usize,
) -> Result<c_int, CudaLibError> {
    let Placement {
        name,
        ld_name,
        buffer,
        offset,
        ld,
        stride,
    } = place;
    if ld < rows.max(1) {
        return Err(bad(
            ld_name,
            format!(
                "is {ld} but must be at least {} (the rows of {name} as stored)",
                rows.max(1)
            ),
        ));
    }
    if !offset.is_multiple_of(elem) {
        return Err(bad(
            name,
            format!("offset {offset} is not a multiple of the element size {elem}"),
        ));
    }
    let needed = extent(rows, cols, ld, stride, batch)
        .and_then(|n| n.checked_mul(elem))
        .and_then(|n| n.checked_add(offset))
        .ok_or_else(|| bad(name, "extent overflows usize".to_string()))?;
    if needed > buffer.len() {
        return Err(bad(
            name,
            format!(
                "needs bytes 0..{needed} ({rows}x{cols}, ld {ld}, stride {stride}, batch {batch}, offset {offset}) but its buffer has {}",
                buffer.len()
            ),
        ));
    }
    to_int(ld_name, ld)
}

/// A device's matrix products through cuBLAS.
pub trait Blas: Sealed {
    /// `C[i] = alpha · op(A[i]) · op(B[i]) + beta · C[i]` on `stream` with
    /// `cublasGemmStridedBatchedEx`. Column-major; see the module docs for row-major operands.
    /// Every operand's extent is checked against its buffer first.
    fn gemm_strided_batched(
        &self,
        spec: &GemmSpec,
        a: GemmInput<'_>,
        b: GemmInput<'_>,
        c: GemmOutput<'_>,
        stream: &Stream,
    ) -> Result<(), CudaLibError>;
}

impl Blas for CudaDevice {
    fn gemm_strided_batched(
        &self,
        spec: &GemmSpec,
        a: GemmInput<'_>,
        b: GemmInput<'_>,
        c: GemmOutput<'_>,
        stream: &Stream,
    ) -> Result<(), CudaLibError> {
        self.check()?;
        self.check_operands(
            "gemm",
            [
                stream.device(),
                a.buffer.device(),
                b.buffer.device(),
                c.buffer.device(),
            ],
        )?;
        let (data, compute) = match spec.dtype {
            DType::F32 => (
                cudaDataType::CUDA_R_32F,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            DType::F64 => (
                cudaDataType::CUDA_R_64F,
                cublasComputeType_t::CUBLAS_COMPUTE_64F,
            ),
            DType::F16 => (
                cudaDataType::CUDA_R_16F,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            DType::BF16 => (
                cudaDataType::CUDA_R_16BF,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            dtype => return Err(CudaLibError::UnsupportedDType { op: "gemm", dtype }),
        };
        let GemmSpec {
            m,
            n,
            k,
            batch,
            transa,
            transb,
            ..
        } = *spec;
        let elem = spec.dtype.size();
        // Stored shapes: op(A) is m×k, so A is k×m when transposed.
        let a_shape = if transa { (k, m) } else { (m, k) };
        let b_shape = if transb { (n, k) } else { (k, n) };
        let place_a = Placement {
            name: "a",
            ld_name: "lda",
            buffer: a.buffer,
            offset: a.offset_bytes,
            ld: a.ld,
            stride: a.stride,
        };
        let lda = check_operand(place_a, a_shape, batch, elem)?;
        let place_b = Placement {
            name: "b",
            ld_name: "ldb",
            buffer: b.buffer,
            offset: b.offset_bytes,
            ld: b.ld,
            stride: b.stride,
        };
        let ldb = check_operand(place_b, b_shape, batch, elem)?;
        let place_c = Placement {
            name: "c",
            ld_name: "ldc",
            buffer: c.buffer,
            offset: c.offset_bytes,
            ld: c.ld,
            stride: c.stride,
        };
        let ldc = check_operand(place_c, (m, n), batch, elem)?;
        let c_one = extent(m, n, c.ld, 0, 1).unwrap_or(usize::MAX);
        if batch > 1 && c.stride < c_one {
            return Err(bad(
                "stride_c",
                format!(
                    "is {} but batch outputs would overlap: it must be at least {c_one}",
                    c.stride
                ),
            ));
        }
        let (m, n, k, batch_count) = (
            to_int("m", m)?,
            to_int("n", n)?,
            to_int("k", k)?,
            to_int("batch", batch)?,
        );
        if m == 0 || n == 0 || batch_count == 0 {
            return Ok(());
        }
        let stride = |s: usize, name| {
            c_longlong::try_from(s)
                .map_err(|_| bad(name, format!("{s} does not fit in a 64-bit integer")))
        };
        let (stride_a, stride_b, stride_c) = (
            stride(a.stride, "stride_a")?,
            stride(b.stride, "stride_b")?,
            stride(c.stride, "stride_c")?,
        );
        let op = |t: bool| {
            if t {
                cublasOperation_t::CUBLAS_OP_T
            } else {
                cublasOperation_t::CUBLAS_OP_N
            }
        };
        // Scalars in the compute type: f64 for f64, f32 otherwise.
        let (alpha64, beta64) = (spec.alpha, spec.beta);
        let (alpha32, beta32) = (spec.alpha as f32, spec.beta as f32);
        let (alpha, beta): (*const c_void, *const c_void) = if spec.dtype == DType::F64 {
            (
                (&alpha64 as *const f64).cast(),
                (&beta64 as *const f64).cast(),
            )
        } else {
            (
                (&alpha32 as *const f32).cast(),
                (&beta32 as *const f32).cast(),
            )
        };
        for buffer in [a.buffer, b.buffer, &*c.buffer] {
            buffer.record_stream(stream);
        }
        let a_ptr = (a.buffer.device_ptr() + a.offset_bytes as u64) as *const c_void;
        let b_ptr = (b.buffer.device_ptr() + b.offset_bytes as u64) as *const c_void;
        let c_ptr = (c.buffer.device_ptr() + c.offset_bytes as u64) as *mut c_void;

        self.bind()?;
        let handles = self.local::<BlasHandles>();
        let handle = handles.0.take(|| {
            // SAFETY: only tries to dlopen libcublas.
            if !unsafe { blas_sys::is_culib_present() } {
                return Err(CudaLibError::NoCublas);
            }
            CudaBlas::new(self.default_stream().cudarc().clone()).map_err(|e| {
                CudaLibError::Cublas {
                    call: "cublasCreate",
                    message: format!("{e:?}"),
                }
            })
        })?;
        let raw = *handle.handle();
        let cublas = |call| {
            move |e: blas::CublasError| CudaLibError::Cublas {
                call,
                message: format!("{e:?}"),
            }
        };
        // SAFETY: the handle is ours (leased from the pool, used by this call alone) and `stream`
        // belongs to this device's context, which is current.
        unsafe { blas::set_stream(raw, stream.cudarc().cu_stream() as _) }
            .map_err(cublas("cublasSetStream"))?;
        let name = || {
            let t = |t: bool| if t { 'T' } else { 'N' };
            format!(
                "gemm {m}x{n}x{k} {}{} {:?}{}",
                t(transa),
                t(transb),
                spec.dtype,
                if batch_count > 1 {
                    format!(" batch {batch_count}")
                } else {
                    String::new()
                }
            )
            .into()
        };
        // SAFETY: every operand's extent was checked against its buffer above; the buffers are
        // borrowed for the call and marked used on `stream`, so their memory is not reused
        // before the product finishes; alpha and beta are host scalars of the compute type that
        // outlive the call (cuBLAS reads them before returning in host pointer mode).
        profiled(self, stream, name, || unsafe {
            blas::gemm_strided_batched_ex(
                raw,
                op(transa),
                op(transb),
                m,
                n,
                k,
                alpha,
                a_ptr,
                data,
                lda,
                stride_a,
                b_ptr,
                data,
                ldb,
                stride_b,
                beta,
                c_ptr,
                data,
                ldc,
                stride_c,
                batch_count,
                compute,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
            .map_err(cublas("cublasGemmStridedBatchedEx"))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_count_the_last_column_and_batch_exactly() {
        // 2x3 column-major with ld 2: 2*2 + 2 = 6 elements.
        assert_eq!(extent(2, 3, 2, 0, 1), Some(6));
        // ld 4 pads columns: 4*2 + 2 = 10.
        assert_eq!(extent(2, 3, 4, 0, 1), Some(10));
        // Three batch entries 6 apart: 6*2 + 6 = 18.
        assert_eq!(extent(2, 3, 2, 6, 3), Some(18));
        // Broadcast (stride 0) reads one matrix.
        assert_eq!(extent(2, 3, 2, 0, 5), Some(6));
        assert_eq!(extent(0, 3, 1, 0, 5), Some(0));
        assert_eq!(extent(usize::MAX, 3, usize::MAX, 0, 1), None);
    }
}
