//! Matrix products with a fused epilogue through cuBLASLt: `C = op(A)·op(B) + bias`, the bias
//! broadcast along C's columns, then ReLU if asked, in one kernel instead of a product and two
//! passes over its result. Products keep full precision (f32 computes in f32, never TF32; f16
//! and bf16 accumulate in f32), as [`Blas::gemm_strided_batched`](crate::Blas) does.
//!
//! Each call builds its small descriptors (microseconds) and takes its algorithm from a cache
//! keyed by shape, layout, dtype and epilogue, filled by cuBLASLt's heuristic on first use and
//! shared by the device's handles. The handles are pooled ([`HandlePool`]), each with its own
//! workspace; a workspace's uses on different streams are ordered by its buffer, as any
//! buffer's are (it is marked used on the call's stream before, and queued on it after).

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::size_of;

use cudarc::cublaslt::{result as lt, sys as lt_sys};

use ferry_memory::DType;
use ferry_memory::cuda::{CudaDevice, DeviceBuffer, Stream};
use parking_lot::Mutex;

use crate::CudaLibError;
use crate::blas::{GemmInput, GemmOutput, GemmSpec, Placement, bad, check_operand, to_int};
use crate::pool::HandlePool;
use crate::profile::profiled;
use crate::sealed::Sealed;

/// cuBLASLt's workspace: 32 MiB, what NVIDIA recommends for Hopper.
const WORKSPACE_BYTES: usize = 32 << 20;

/// Whether libcublasLt can be loaded (on this machine, not necessarily with a GPU).
pub fn cublaslt_present() -> bool {
    // SAFETY: only tries to dlopen libcublasLt.
    unsafe { lt_sys::is_culib_present() }
}

/// What a fused product adds to its result.
#[derive(Debug, Clone, Copy)]
pub struct GemmEpilogue<'a> {
    /// `m` elements of the product's dtype, added to every column of C.
    pub bias: &'a DeviceBuffer,
    /// Where the bias starts, in bytes (a multiple of the element size).
    pub bias_offset_bytes: usize,
    /// `max(x, 0)` after the bias.
    pub relu: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct AlgoKey {
    dtype: DType,
    transa: bool,
    transb: bool,
    m: usize,
    n: usize,
    k: usize,
    lds: [usize; 3],
    relu: bool,
}

/// A device's cuBLASLt state (a device slot, see `CudaDevice::local`): its handles, made as
/// calls need them, and the algorithms chosen so far.
#[derive(Default)]
struct LtDevice {
    handles: HandlePool<LtHandle>,
    algos: Mutex<HashMap<AlgoKey, lt_sys::cublasLtMatmulAlgo_t>>,
}

/// One cuBLASLt handle and its workspace.
struct LtHandle {
    handle: lt_sys::cublasLtHandle_t,
    workspace: DeviceBuffer,
}

// SAFETY: a handle is used by one call at a time (leased from the pool), from any thread.
unsafe impl Send for LtHandle {}

impl Drop for LtHandle {
    fn drop(&mut self) {
        // SAFETY: the handle is ours and no call is running (we hold the last reference).
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

fn failed(call: &'static str) -> impl FnOnce(lt::CublasError) -> CudaLibError {
    move |e| CudaLibError::Cublas {
        call,
        message: format!("{e:?}"),
    }
}

/// Descriptors of one call, destroyed when it returns.
struct Descriptors {
    desc: lt_sys::cublasLtMatmulDesc_t,
    layouts: Vec<lt_sys::cublasLtMatrixLayout_t>,
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: created by this struct's owner and used by no call still running (cuBLASLt
        // reads descriptors before cublasLtMatmul returns).
        unsafe {
            let _ = lt::destroy_matmul_desc(self.desc);
            for &layout in &self.layouts {
                let _ = lt::destroy_matrix_layout(layout);
            }
        }
    }
}

/// Sets one attribute of a matmul descriptor from a plain value.
///
/// # Safety
/// `T` must be the attribute's documented type.
unsafe fn set_attr<T>(
    desc: lt_sys::cublasLtMatmulDesc_t,
    attr: lt_sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> Result<(), CudaLibError> {
    // SAFETY: `value` is a live `T` of `size_of::<T>()` bytes, the attribute's type (caller).
    unsafe { lt::set_matmul_desc_attribute(desc, attr, (value as *const T).cast(), size_of::<T>()) }
        .map_err(failed("cublasLtMatmulDescSetAttribute"))
}

/// A device's matrix products with fused epilogues through cuBLASLt.
pub trait BlasLt: Sealed {
    /// `C = op(A)·op(B) + bias` (bias broadcast along C's columns), then `max(·, 0)` when
    /// `epilogue.relu`, on `stream`, in one cuBLASLt call. Column-major like
    /// [`Blas::gemm_strided_batched`](crate::Blas::gemm_strided_batched); one product
    /// (`spec.batch == 1`), `spec.beta == 0`, f32, f16 or bf16. Every operand's extent and the
    /// bias's are checked first.
    fn gemm_epilogue(
        &self,
        spec: &GemmSpec,
        a: GemmInput<'_>,
        b: GemmInput<'_>,
        c: GemmOutput<'_>,
        epilogue: GemmEpilogue<'_>,
        stream: &Stream,
    ) -> Result<(), CudaLibError>;
}

impl BlasLt for CudaDevice {
    fn gemm_epilogue(
        &self,
        spec: &GemmSpec,
        a: GemmInput<'_>,
        b: GemmInput<'_>,
        c: GemmOutput<'_>,
        epilogue: GemmEpilogue<'_>,
        stream: &Stream,
    ) -> Result<(), CudaLibError> {
        self.check()?;
        self.check_operands(
            "gemm_epilogue",
            [
                stream.device(),
                a.buffer.device(),
                b.buffer.device(),
                c.buffer.device(),
                epilogue.bias.device(),
            ],
        )?;
        let data = match spec.dtype {
            DType::F32 => lt_sys::cudaDataType_t::CUDA_R_32F,
            DType::F16 => lt_sys::cudaDataType_t::CUDA_R_16F,
            DType::BF16 => lt_sys::cudaDataType_t::CUDA_R_16BF,
            dtype => {
                return Err(CudaLibError::UnsupportedDType {
                    op: "gemm_epilogue",
                    dtype,
                });
            }
        };
        if spec.batch != 1 {
            return Err(bad(
                "batch",
                format!("is {}; a fused product is one product", spec.batch),
            ));
        }
        if spec.beta != 0.0 {
            return Err(bad(
                "beta",
                "must be 0: the epilogue's bias replaces C's old contents".into(),
            ));
        }
        let GemmSpec {
            m,
            n,
            k,
            transa,
            transb,
            ..
        } = *spec;
        let elem = spec.dtype.size();
        let a_shape = if transa { (k, m) } else { (m, k) };
        let b_shape = if transb { (n, k) } else { (k, n) };
        let place = |name, ld_name, buffer, offset, ld| Placement {
            name,
            ld_name,
            buffer,
            offset,
            ld,
            stride: 0,
        };
        check_operand(
            place("a", "lda", a.buffer, a.offset_bytes, a.ld),
            a_shape,
            1,
            elem,
        )?;
        check_operand(
            place("b", "ldb", b.buffer, b.offset_bytes, b.ld),
            b_shape,
            1,
            elem,
        )?;
        check_operand(
            place("c", "ldc", c.buffer, c.offset_bytes, c.ld),
            (m, n),
            1,
            elem,
        )?;
        check_operand(
            place(
                "bias",
                "bias length",
                epilogue.bias,
                epilogue.bias_offset_bytes,
                m.max(1),
            ),
            (m, 1),
            1,
            elem,
        )?;
        for (name, value) in [("m", m), ("n", n), ("k", k)] {
            to_int(name, value)?;
        }
        if m == 0 || n == 0 {
            return Ok(());
        }
        for buffer in [a.buffer, b.buffer, &*c.buffer, epilogue.bias] {
            buffer.record_stream(stream);
        }
        let ptr = |buffer: &DeviceBuffer, offset: usize| buffer.device_ptr() + offset as u64;
        let (a_ptr, b_ptr, c_ptr) = (
            ptr(a.buffer, a.offset_bytes),
            ptr(b.buffer, b.offset_bytes),
            ptr(c.buffer, c.offset_bytes),
        );
        let bias_ptr = ptr(epilogue.bias, epilogue.bias_offset_bytes);

        self.bind()?;
        let lt_device = self.local::<LtDevice>();
        let state = lt_device.handles.take(|| {
            if !cublaslt_present() {
                return Err(CudaLibError::Cublas {
                    call: "cublasLtCreate",
                    message: "libcublasLt could not be loaded: install the CUDA cuBLAS library"
                        .into(),
                });
            }
            // The workspace first: a handle made and then not kept would leak.
            let workspace = self.alloc(WORKSPACE_BYTES, self.default_stream())?;
            let handle = lt::create_handle().map_err(failed("cublasLtCreate"))?;
            Ok(LtHandle { handle, workspace })
        })?;
        // Ordered after the workspace's earlier uses, on any stream (see the module docs).
        state.workspace.record_stream(stream);

        let mut d = Descriptors {
            desc: lt::create_matmul_desc(
                lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                lt_sys::cudaDataType_t::CUDA_R_32F,
            )
            .map_err(failed("cublasLtMatmulDescCreate"))?,
            layouts: Vec::with_capacity(3),
        };
        for ((rows, cols), ld) in [(a_shape, a.ld), (b_shape, b.ld), ((m, n), c.ld)] {
            let layout = lt::create_matrix_layout(data, rows as u64, cols as u64, ld as i64)
                .map_err(failed("cublasLtMatrixLayoutCreate"))?;
            d.layouts.push(layout);
        }
        // cublasOperation_t as the int32 the attribute holds: CUBLAS_OP_N = 0, CUBLAS_OP_T = 1.
        let op = |t: bool| i32::from(t);
        let kind = if epilogue.relu {
            lt_sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_RELU_BIAS
        } else {
            lt_sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS
        };
        use lt_sys::cublasLtMatmulDescAttributes_t as Attr;
        // SAFETY: each value has its attribute's type (cublasOperation_t, cublasLtEpilogue_t,
        // a device pointer).
        unsafe {
            set_attr(d.desc, Attr::CUBLASLT_MATMUL_DESC_TRANSA, &op(transa))?;
            set_attr(d.desc, Attr::CUBLASLT_MATMUL_DESC_TRANSB, &op(transb))?;
            set_attr(d.desc, Attr::CUBLASLT_MATMUL_DESC_EPILOGUE, &kind)?;
            set_attr(d.desc, Attr::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr)?;
        }
        let key = AlgoKey {
            dtype: spec.dtype,
            transa,
            transb,
            m,
            n,
            k,
            lds: [a.ld, b.ld, c.ld],
            relu: epilogue.relu,
        };
        let cached = lt_device.algos.lock().get(&key).copied();
        let algo = match cached {
            Some(algo) => algo,
            None => {
                let pref =
                    lt::create_matmul_pref().map_err(failed("cublasLtMatmulPreferenceCreate"))?;
                let size = WORKSPACE_BYTES;
                // SAFETY: the attribute is a size_t; the descriptors are live.
                let found = unsafe {
                    lt::set_matmul_pref_attribute(
                        pref,
                        lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                        (&size as *const usize).cast(),
                        size_of::<usize>(),
                    )
                    .and_then(|()| {
                        lt::get_matmul_algo_heuristic(
                            state.handle,
                            d.desc,
                            d.layouts[0],
                            d.layouts[1],
                            d.layouts[2],
                            d.layouts[2],
                            pref,
                        )
                    })
                };
                // SAFETY: created above, used by no running call.
                let _ = unsafe { lt::destroy_matmul_pref(pref) };
                let algo = found
                    .map_err(failed("cublasLtMatmulAlgoGetHeuristic"))?
                    .algo;
                lt_device.algos.lock().insert(key, algo);
                algo
            }
        };
        let (alpha, beta) = (spec.alpha as f32, 0.0f32);
        let name = || {
            let t = |t: bool| if t { 'T' } else { 'N' };
            let act = if epilogue.relu { "+bias+relu" } else { "+bias" };
            format!(
                "gemm{act} {m}x{n}x{k} {}{} {:?}",
                t(transa),
                t(transb),
                spec.dtype
            )
            .into()
        };
        let (handle, ws_ptr) = (state.handle, state.workspace.device_ptr());
        // SAFETY: every operand's extent (and the bias's) was checked against its buffer above
        // and matches the layouts; the buffers and the workspace are marked used on `stream`, so
        // their memory is not reused before the product finishes; alpha and beta are f32 host
        // scalars (the scale type) that outlive the call; the algorithm came from cuBLASLt's
        // heuristic for these descriptors.
        let queued = profiled(self, stream, name, || unsafe {
            lt::matmul(
                handle,
                d.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                a_ptr as *const c_void,
                d.layouts[0],
                b_ptr as *const c_void,
                d.layouts[1],
                c_ptr as *const c_void,
                d.layouts[2],
                c_ptr as *mut c_void,
                d.layouts[2],
                &algo,
                ws_ptr as *mut c_void,
                WORKSPACE_BYTES,
                stream.cudarc().cu_stream() as _,
            )
            .map_err(failed("cublasLtMatmul"))
        });
        // Later uses of the workspace on other streams (by the next call to lease this handle)
        // wait for this product: noted even when the profiler's closing record failed, since
        // the product was queued by then.
        let noted = state.workspace.queued_on(stream);
        queued?;
        noted?;
        Ok(())
    }
}
