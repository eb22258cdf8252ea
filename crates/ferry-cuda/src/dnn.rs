//! Two-dimensional convolutions through cuDNN: forward, the gradient of the input and the
//! gradient of the filter, on dense NCHW buffers, with every operand's extent checked first.
//!
//! cuDNN is optional: nothing here calls into it before [`cudnn_present`] has loaded the library
//! and found every function used, so a machine without libcudnn gets
//! [`CudaLibError::NoCudnn`] (and ferry-tensor its im2col path), never a panic. The algorithm of
//! each (shape, pass) is chosen once from cuDNN's heuristics and cached: a deterministic one
//! when cuDNN offers one, so replicas and reruns agree bit for bit. f32 and f64 run on FMA math
//! only (no TF32), matching the GEMMs; f16 and bf16 use tensor cores and accumulate in f32.
//!
//! A device's cuDNN handles are pooled ([`HandlePool`]), and the chosen algorithms shared by
//! them; each call's workspace comes from the device's allocator, on the call's stream.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};

use cudarc::cudnn::result::{self as dnn, CudnnError};
use cudarc::cudnn::sys::{self, cudnnDataType_t, cudnnMathType_t};

mod algorithms;
mod attention;
mod backend;
mod library;

use algorithms::{Choice, bwd_data_algo, bwd_filter_algo, choose, fwd_algo, math_for};
pub use attention::{
    Attention, Causal, DropoutRng, SDPA_MAX_HEAD_DIM, SDPA_MIN_CUDNN, SdpaBackward, SdpaForward,
    SdpaInput, SdpaOutput, SdpaSpec,
};
use library::ensure_cudnn;
pub use library::{cudnn_present, cudnn_version};

use ferry_memory::DType;
use ferry_memory::cuda::{CudaDevice, DeviceBuffer, Stream};
use parking_lot::Mutex;

use crate::CudaLibError;
use crate::pool::{HandlePool, Lease};
use crate::profile::profiled;
use crate::sealed::Sealed;

fn failed(call: &'static str) -> impl Fn(CudnnError) -> CudaLibError {
    move |e| CudaLibError::Cudnn {
        call,
        message: format!("{:?}", e.0),
    }
}

fn bad(argument: &'static str, reason: String) -> CudaLibError {
    CudaLibError::ConvArgument { argument, reason }
}

/// Which of the three convolution computations to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConvPass {
    /// `y = conv(x, w)`: operands `x` then `w`, output `y`.
    Forward,
    /// `dx` from `dy` and `w`: operands `dy` then `w`, output `dx`.
    BackwardData,
    /// `dw` from `x` and `dy`: operands `x` then `dy`, output `dw`.
    BackwardFilter,
}

/// A grouped 2-D cross-correlation of `input` `[N, C, H, W]` with `filter`
/// `[O, C / groups, KH, KW]`, all dense NCHW of one dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConvSpec {
    /// f32, f64, f16 or bf16.
    pub dtype: DType,
    /// `[N, C, H, W]`.
    pub input: [usize; 4],
    /// `[O, C / groups, KH, KW]`.
    pub filter: [usize; 4],
    /// Vertical and horizontal step.
    pub stride: [usize; 2],
    /// Zeros added on each side, vertically and horizontally.
    pub padding: [usize; 2],
    /// Spacing of the filter taps.
    pub dilation: [usize; 2],
    /// Channel groups; divides C and O.
    pub groups: usize,
}

impl ConvSpec {
    /// `[N, O, OH, OW]`, or an error naming the argument that makes the shape impossible.
    pub fn output(&self) -> Result<[usize; 4], CudaLibError> {
        let [n, c, h, w] = self.input;
        let [o, cg, kh, kw] = self.filter;
        if self.groups == 0 || cg * self.groups != c || !o.is_multiple_of(self.groups) {
            return Err(bad(
                "groups",
                format!(
                    "{} must divide the input channels ({c}) and the filters ({o}), with \
                     C / groups = {cg}",
                    self.groups
                ),
            ));
        }
        let mut out = [n, o, 0, 0];
        for (axis, (size, k)) in [(h, kh), (w, kw)].into_iter().enumerate() {
            if self.stride[axis] == 0 || self.dilation[axis] == 0 || k == 0 {
                return Err(bad(
                    "geometry",
                    "stride, dilation and the kernel size must be at least 1".to_string(),
                ));
            }
            let span = self.dilation[axis] * (k - 1) + 1;
            let padded = size + 2 * self.padding[axis];
            if padded < span {
                return Err(bad(
                    "filter",
                    format!("spans {span} but the padded input is {padded} wide"),
                ));
            }
            out[2 + axis] = (padded - span) / self.stride[axis] + 1;
        }
        Ok(out)
    }

    /// The shapes of (first operand, second operand, output) of `pass`.
    fn shapes(&self, pass: ConvPass) -> Result<[[usize; 4]; 3], CudaLibError> {
        let y = self.output()?;
        Ok(match pass {
            ConvPass::Forward => [self.input, self.filter, y],
            ConvPass::BackwardData => [y, self.filter, self.input],
            ConvPass::BackwardFilter => [self.input, y, self.filter],
        })
    }
}

/// One dense NCHW operand: its buffer and where it starts in bytes.
#[derive(Debug, Clone, Copy)]
pub struct ConvInput<'a> {
    /// The buffer holding it.
    pub buffer: &'a DeviceBuffer,
    /// Byte offset of the first element (a multiple of the element size).
    pub offset_bytes: usize,
}

/// The dense NCHW output, overwritten.
#[derive(Debug)]
pub struct ConvOutput<'a> {
    /// The buffer written.
    pub buffer: &'a mut DeviceBuffer,
    /// Byte offset of the first element (a multiple of the element size).
    pub offset_bytes: usize,
}

/// A device's cuDNN state (a device slot, see `CudaDevice::local`): its handles, made as calls
/// need them, and the algorithms chosen so far.
#[derive(Default)]
struct DnnDevice {
    handles: HandlePool<DnnHandle>,
    algorithms: Mutex<HashMap<(ConvSpec, ConvPass), Choice>>,
}

impl DnnDevice {
    /// An idle handle of the pool (or a new one), its stream set to `stream`, for one call;
    /// given back to the pool when the lease drops. The device's context must be current.
    fn handle_on(&self, stream: &Stream) -> Result<Lease<'_, DnnHandle>, CudaLibError> {
        let lease = self.handles.take(|| {
            dnn::create_handle()
                .map(DnnHandle)
                .map_err(failed("cudnnCreate"))
        })?;
        // SAFETY: the handle is ours (leased from the pool, used by this call alone) and
        // `stream` belongs to this device's context, which is current.
        unsafe { dnn::set_stream(lease.0, stream.cudarc().cu_stream() as _) }
            .map_err(failed("cudnnSetStream"))?;
        Ok(lease)
    }
}

/// One cuDNN handle.
struct DnnHandle(sys::cudnnHandle_t);

// SAFETY: a handle is used by one call at a time (leased from the pool), which is what cuDNN
// requires of a handle; it may move between threads.
unsafe impl Send for DnnHandle {}

impl Drop for DnnHandle {
    fn drop(&mut self) {
        // SAFETY: the handle was created by cudnnCreate and is destroyed once. A failure here
        // leaks the handle only (devices live for the process).
        let _ = unsafe { dnn::destroy_handle(self.0) };
    }
}

/// Descriptors of one call, destroyed on drop.
struct Descriptors {
    a: sys::cudnnTensorDescriptor_t,
    b: sys::cudnnTensorDescriptor_t,
    filter: sys::cudnnFilterDescriptor_t,
    conv: sys::cudnnConvolutionDescriptor_t,
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created below (null ones are skipped) and is destroyed
        // once; errors only leak a descriptor.
        unsafe {
            for t in [self.a, self.b] {
                if !t.is_null() {
                    let _ = dnn::destroy_tensor_descriptor(t);
                }
            }
            if !self.filter.is_null() {
                let _ = dnn::destroy_filter_descriptor(self.filter);
            }
            if !self.conv.is_null() {
                let _ = dnn::destroy_convolution_descriptor(self.conv);
            }
        }
    }
}

fn data_type(dtype: DType) -> Result<(cudnnDataType_t, cudnnDataType_t), CudaLibError> {
    use cudnnDataType_t::*;
    Ok(match dtype {
        DType::F32 => (CUDNN_DATA_FLOAT, CUDNN_DATA_FLOAT),
        DType::F64 => (CUDNN_DATA_DOUBLE, CUDNN_DATA_DOUBLE),
        DType::F16 => (CUDNN_DATA_HALF, CUDNN_DATA_FLOAT),
        DType::BF16 => (CUDNN_DATA_BFLOAT16, CUDNN_DATA_FLOAT),
        dtype => {
            return Err(CudaLibError::UnsupportedDType {
                op: "conv2d",
                dtype,
            });
        }
    })
}

fn to_int(argument: &'static str, value: usize) -> Result<c_int, CudaLibError> {
    c_int::try_from(value)
        .map_err(|_| bad(argument, format!("{value} exceeds cuDNN's 32-bit limit")))
}

fn dims(argument: &'static str, shape: [usize; 4]) -> Result<[c_int; 4], CudaLibError> {
    Ok([
        to_int(argument, shape[0])?,
        to_int(argument, shape[1])?,
        to_int(argument, shape[2])?,
        to_int(argument, shape[3])?,
    ])
}

impl Descriptors {
    /// Descriptors for `pass`: `a` and `b` are the two activation-shaped tensors (x or dx, and
    /// y or dy), `filter` the weight or its gradient.
    fn new(spec: &ConvSpec, math: cudnnMathType_t) -> Result<Self, CudaLibError> {
        let (data, compute) = data_type(spec.dtype)?;
        let mut d = Descriptors {
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            filter: std::ptr::null_mut(),
            conv: std::ptr::null_mut(),
        };
        let x = dims("input", spec.input)?;
        let y = dims("output", spec.output()?)?;
        let w = dims("filter", spec.filter)?;
        let nchw = sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW;
        d.a = dnn::create_tensor_descriptor().map_err(failed("cudnnCreateTensorDescriptor"))?;
        d.b = dnn::create_tensor_descriptor().map_err(failed("cudnnCreateTensorDescriptor"))?;
        d.filter =
            dnn::create_filter_descriptor().map_err(failed("cudnnCreateFilterDescriptor"))?;
        d.conv = dnn::create_convolution_descriptor()
            .map_err(failed("cudnnCreateConvolutionDescriptor"))?;
        let [pad_h, pad_w] = [spec.padding[0], spec.padding[1]].map(|p| p as c_int);
        // SAFETY: the descriptors were just created and are ours; the values were range-checked.
        unsafe {
            dnn::set_tensor4d_descriptor(d.a, nchw, data, x)
                .map_err(failed("cudnnSetTensor4dDescriptor"))?;
            dnn::set_tensor4d_descriptor(d.b, nchw, data, y)
                .map_err(failed("cudnnSetTensor4dDescriptor"))?;
            dnn::set_filter4d_descriptor(d.filter, data, nchw, w)
                .map_err(failed("cudnnSetFilter4dDescriptor"))?;
            dnn::set_convolution2d_descriptor(
                d.conv,
                pad_h,
                pad_w,
                to_int("stride", spec.stride[0])?,
                to_int("stride", spec.stride[1])?,
                to_int("dilation", spec.dilation[0])?,
                to_int("dilation", spec.dilation[1])?,
                sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                compute,
            )
            .map_err(failed("cudnnSetConvolution2dDescriptor"))?;
            dnn::set_convolution_group_count(d.conv, to_int("groups", spec.groups)?)
                .map_err(failed("cudnnSetConvolutionGroupCount"))?;
            dnn::set_convolution_math_type(d.conv, math)
                .map_err(failed("cudnnSetConvolutionMathType"))?;
        }
        Ok(d)
    }
}

fn extent_check(
    name: &'static str,
    buffer: &DeviceBuffer,
    offset: usize,
    shape: [usize; 4],
    elem: usize,
) -> Result<(), CudaLibError> {
    if !offset.is_multiple_of(elem) {
        return Err(bad(
            name,
            format!("offset {offset} is not a multiple of the element size {elem}"),
        ));
    }
    let needed = shape
        .iter()
        .try_fold(elem, |acc, &d| acc.checked_mul(d))
        .and_then(|n| n.checked_add(offset))
        .ok_or_else(|| bad(name, "extent overflows usize".to_string()))?;
    if needed > buffer.len() {
        return Err(bad(
            name,
            format!(
                "needs bytes 0..{needed} (dense {shape:?} at offset {offset}) but its buffer has {}",
                buffer.len()
            ),
        ));
    }
    Ok(())
}

/// A device's convolutions through cuDNN.
pub trait Dnn: Sealed {
    /// Runs one convolution pass through cuDNN on `stream`, overwriting `out`. Operands are
    /// dense NCHW in `spec.dtype`; their order is given by [`ConvPass`]. Returns
    /// [`CudaLibError::NoCudnn`] where libcudnn is missing.
    fn convolution(
        &self,
        pass: ConvPass,
        spec: &ConvSpec,
        first: ConvInput<'_>,
        second: ConvInput<'_>,
        out: ConvOutput<'_>,
        stream: &Stream,
    ) -> Result<(), CudaLibError>;
}

impl Dnn for CudaDevice {
    fn convolution(
        &self,
        pass: ConvPass,
        spec: &ConvSpec,
        first: ConvInput<'_>,
        second: ConvInput<'_>,
        out: ConvOutput<'_>,
        stream: &Stream,
    ) -> Result<(), CudaLibError> {
        ensure_cudnn()?;
        self.check()?;
        self.check_operands(
            "conv2d",
            [
                stream.device(),
                first.buffer.device(),
                second.buffer.device(),
                out.buffer.device(),
            ],
        )?;
        let elem = spec.dtype.size();
        let [sa, sb, so] = spec.shapes(pass)?;
        extent_check("first operand", first.buffer, first.offset_bytes, sa, elem)?;
        extent_check(
            "second operand",
            second.buffer,
            second.offset_bytes,
            sb,
            elem,
        )?;
        extent_check("output", out.buffer, out.offset_bytes, so, elem)?;
        if so.contains(&0) {
            return Ok(());
        }
        if sa.contains(&0) || sb.contains(&0) {
            // An empty reduction: the output is zero.
            return Ok(out.buffer.memset_zero(stream)?);
        }

        self.bind()?;
        let dnn_device = self.local::<DnnDevice>();
        let lease = dnn_device.handle_on(stream)?;
        let handle = lease.0;
        let cached = dnn_device.algorithms.lock().get(&(*spec, pass)).copied();
        let choice = match cached {
            Some(choice) => choice,
            None => {
                let probe = Descriptors::new(spec, math_for(spec.dtype))?;
                let choice = choose(handle, pass, spec, &probe)?;
                dnn_device.algorithms.lock().insert((*spec, pass), choice);
                choice
            }
        };
        let d = Descriptors::new(spec, choice.math)?;
        let workspace = self.alloc(choice.workspace, stream)?;
        for buffer in [first.buffer, second.buffer, &*out.buffer, &workspace] {
            buffer.record_stream(stream);
        }
        // Ordering a buffer on the host (where an event could not be waited on) may have made
        // another GPU's context current.
        self.bind()?;
        let (one32, zero32) = (1.0f32, 0.0f32);
        let (one64, zero64) = (1.0f64, 0.0f64);
        let (alpha, beta): (*const c_void, *const c_void) = if spec.dtype == DType::F64 {
            (
                (&one64 as *const f64).cast(),
                (&zero64 as *const f64).cast(),
            )
        } else {
            (
                (&one32 as *const f32).cast(),
                (&zero32 as *const f32).cast(),
            )
        };
        let ptr = |b: &DeviceBuffer, offset: usize| (b.device_ptr() + offset as u64) as *mut c_void;
        let (a_ptr, b_ptr) = (
            ptr(first.buffer, first.offset_bytes) as *const c_void,
            ptr(second.buffer, second.offset_bytes) as *const c_void,
        );
        let o_ptr = ptr(out.buffer, out.offset_bytes);
        let w_ptr = ptr(&workspace, 0);
        let name = || format!("cudnn conv {pass:?}").into();
        // SAFETY: every operand's extent was checked against its buffer above and matches the
        // descriptors; the buffers (and the workspace) are marked used on `stream`, so their
        // memory is not reused before the call's work finishes; alpha and beta are host scalars
        // of the compute type that outlive the call.
        profiled(self, stream, name, || unsafe {
            match pass {
                ConvPass::Forward => dnn::convolution_forward(
                    handle,
                    alpha,
                    d.a,
                    a_ptr,
                    d.filter,
                    b_ptr,
                    d.conv,
                    fwd_algo(choice.algo),
                    w_ptr,
                    choice.workspace,
                    beta,
                    d.b,
                    o_ptr,
                )
                .map_err(failed("cudnnConvolutionForward")),
                ConvPass::BackwardData => dnn::convolution_backward_data(
                    handle,
                    alpha,
                    d.filter,
                    b_ptr,
                    d.b,
                    a_ptr,
                    d.conv,
                    bwd_data_algo(choice.algo),
                    w_ptr,
                    choice.workspace,
                    beta,
                    d.a,
                    o_ptr,
                )
                .map_err(failed("cudnnConvolutionBackwardData")),
                ConvPass::BackwardFilter => dnn::convolution_backward_filter(
                    handle,
                    alpha,
                    d.a,
                    a_ptr,
                    d.b,
                    b_ptr,
                    d.conv,
                    bwd_filter_algo(choice.algo),
                    w_ptr,
                    choice.workspace,
                    beta,
                    d.filter,
                    o_ptr,
                )
                .map_err(failed("cudnnConvolutionBackwardFilter")),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ConvSpec {
        ConvSpec {
            dtype: DType::F32,
            input: [2, 4, 9, 7],
            filter: [6, 2, 3, 2],
            stride: [2, 1],
            padding: [1, 0],
            dilation: [1, 2],
            groups: 2,
        }
    }

    #[test]
    fn output_shape_follows_the_convolution_formula() {
        // OH = (9 + 2 - 1*(3-1) - 1) / 2 + 1 = 5; OW = (7 + 0 - 2*(2-1) - 1) / 1 + 1 = 5.
        assert_eq!(spec().output().unwrap(), [2, 6, 5, 5]);
        let [x, w, y] = spec().shapes(ConvPass::BackwardData).unwrap();
        assert_eq!((x, w, y), ([2, 6, 5, 5], [6, 2, 3, 2], [2, 4, 9, 7]));
    }

    #[test]
    fn impossible_geometry_is_an_error_naming_the_argument() {
        let mut s = spec();
        s.groups = 3;
        assert!(matches!(
            s.output(),
            Err(CudaLibError::ConvArgument {
                argument: "groups",
                ..
            })
        ));
        let mut s = spec();
        s.filter = [6, 2, 30, 2];
        let err = s.output().unwrap_err().to_string();
        assert!(err.contains("spans 30"), "{err}");
    }

    #[test]
    fn without_libcudnn_the_call_is_an_error_not_a_panic() {
        if cudnn_present() {
            return;
        }
        let err = cudnn_version().unwrap_err();
        assert!(err.to_string().contains("cuDNN"), "{err}");
    }
}
