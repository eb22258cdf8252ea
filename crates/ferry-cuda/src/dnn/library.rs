//! Loading libcudnn without ever panicking: the library and every function ferry calls are
//! looked up once, before the first call into cuDNN.

use std::sync::OnceLock;

use cudarc::cudnn::result as dnn;
use cudarc::cudnn::sys;

use crate::CudaLibError;

/// Functions called here, looked up before the first call so a library without one is reported
/// as unusable instead of failing inside cudarc.
const REQUIRED: [&str; 20] = [
    "cudnnGetVersion",
    "cudnnCreate",
    "cudnnSetStream",
    "cudnnCreateTensorDescriptor",
    "cudnnSetTensor4dDescriptor",
    "cudnnDestroyTensorDescriptor",
    "cudnnCreateFilterDescriptor",
    "cudnnSetFilter4dDescriptor",
    "cudnnDestroyFilterDescriptor",
    "cudnnCreateConvolutionDescriptor",
    "cudnnSetConvolution2dDescriptor",
    "cudnnSetConvolutionGroupCount",
    "cudnnSetConvolutionMathType",
    "cudnnDestroyConvolutionDescriptor",
    "cudnnGetConvolutionForwardAlgorithm_v7",
    "cudnnGetConvolutionBackwardDataAlgorithm_v7",
    "cudnnGetConvolutionBackwardFilterAlgorithm_v7",
    "cudnnConvolutionForward",
    "cudnnConvolutionBackwardData",
    "cudnnConvolutionBackwardFilter",
];

/// Whether libcudnn can be loaded and has every function ferry calls. Checked once per process.
pub fn cudnn_present() -> bool {
    availability().is_ok()
}

fn availability() -> &'static Result<(), String> {
    static AVAILABLE: OnceLock<Result<(), String>> = OnceLock::new();
    AVAILABLE.get_or_init(|| {
        // SAFETY: only tries to dlopen libcudnn; calls nothing in it.
        if !unsafe { sys::is_culib_present() } {
            return Err(
                "libcudnn (libcudnn.so or libcudnn.so.9) was not found on the library \
                        path"
                    .to_string(),
            );
        }
        // The library loads (checked above).
        lookup(&REQUIRED)
    })
}

/// The backend (graph) API functions fused attention calls, looked up apart from [`REQUIRED`] so
/// a cuDNN without them still runs convolutions.
const GRAPH_API: [&str; 7] = [
    "cudnnBackendCreateDescriptor",
    "cudnnBackendDestroyDescriptor",
    "cudnnBackendSetAttribute",
    "cudnnBackendGetAttribute",
    "cudnnBackendFinalize",
    "cudnnBackendExecute",
    "cudnnGetLastErrorString",
];

fn lookup(names: &[&str]) -> Result<(), String> {
    // SAFETY: called only once the library loads, so this does not panic.
    let library = unsafe { sys::culib() };
    for name in names {
        // SAFETY: looks the symbol up without calling it.
        if unsafe { library.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err() {
            return Err(format!("the libcudnn found lacks {name}"));
        }
    }
    Ok(())
}

/// [`ensure_cudnn`], and the graph API's functions found too.
pub(super) fn ensure_cudnn_graphs() -> Result<(), CudaLibError> {
    ensure_cudnn()?;
    static GRAPHS: OnceLock<Result<(), String>> = OnceLock::new();
    GRAPHS
        .get_or_init(|| lookup(&GRAPH_API))
        .clone()
        .map_err(|reason| CudaLibError::NoCudnn { reason })
}

pub(super) fn ensure_cudnn() -> Result<(), CudaLibError> {
    availability()
        .clone()
        .map_err(|reason| CudaLibError::NoCudnn { reason })
}

/// The loaded cuDNN's version, e.g. 91900 for 9.19.0.
pub fn cudnn_version() -> Result<usize, CudaLibError> {
    ensure_cudnn()?;
    Ok(dnn::get_version())
}
