//! Choosing a cuDNN algorithm for one (shape, pass): cuDNN's heuristics rank the candidates, and
//! the first that fits the workspace limit and keeps f32/f64 off tensor cores wins, a
//! deterministic one before any other.

use std::ffi::c_int;

use cudarc::cudnn::result as dnn;
use cudarc::cudnn::sys::{
    self, cudnnConvolutionBwdDataAlgo_t, cudnnConvolutionBwdFilterAlgo_t,
    cudnnConvolutionFwdAlgo_t, cudnnDeterminism_t, cudnnMathType_t, cudnnStatus_t,
};

use ferry_memory::DType;

use super::{ConvPass, ConvSpec, Descriptors, failed};
use crate::CudaLibError;

/// Workspace a chosen algorithm may ask for; a faster one that needs more is passed over.
pub(super) const WORKSPACE_LIMIT: usize = 256 << 20;

/// The algorithm picked for one (spec, pass), with its math type and workspace.
#[derive(Debug, Clone, Copy)]
pub(super) struct Choice {
    pub algo: u32,
    pub math: cudnnMathType_t,
    pub workspace: usize,
}

/// The math cuDNN may use for a dtype: exact FMA for f32/f64, tensor cores for 16-bit floats.
pub(super) fn math_for(dtype: DType) -> cudnnMathType_t {
    match dtype {
        DType::F16 | DType::BF16 => cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
        _ => cudnnMathType_t::CUDNN_FMA_MATH,
    }
}

/// One row of cuDNN's ranked answer, whatever the pass.
struct Offer {
    algo: u32,
    status: cudnnStatus_t,
    memory: usize,
    deterministic: bool,
    math: cudnnMathType_t,
}

/// The first usable offer that is deterministic, else the first usable one.
fn pick(offers: &[Offer], spec: &ConvSpec) -> Option<Choice> {
    let usable = |o: &&Offer| {
        o.status == cudnnStatus_t::CUDNN_STATUS_SUCCESS
            && o.memory <= WORKSPACE_LIMIT
            // f32 and f64 stay on FMA math even if cuDNN ranks a tensor-core kernel first.
            && (matches!(spec.dtype, DType::F16 | DType::BF16)
                || o.math == cudnnMathType_t::CUDNN_FMA_MATH
                || o.math == cudnnMathType_t::CUDNN_DEFAULT_MATH)
    };
    let best = offers
        .iter()
        .filter(usable)
        .find(|o| o.deterministic)
        .or_else(|| offers.iter().find(usable))?;
    Some(Choice {
        algo: best.algo,
        math: math_for(spec.dtype),
        workspace: best.memory,
    })
}

/// Asks cuDNN's `_v7` heuristics for one pass's ranked algorithms (no trial runs) and reads
/// them into [`Offer`]s.
macro_rules! ranked {
    ($perf:ty, $query:path, $call:literal, $handle:expr, [$($desc:expr),*]) => {{
        const WANT: usize = 8;
        let mut count: c_int = 0;
        // SAFETY: the perf structs are plain C data (enums, floats, sizes) for which zeroed
        // bytes are valid values.
        let mut perf = [unsafe { std::mem::zeroed::<$perf>() }; WANT];
        // SAFETY: handle and descriptors are live; the array holds WANT entries and cuDNN
        // writes at most that many, reporting how many in `count`.
        unsafe { $query($handle, $($desc),*, WANT as c_int, &mut count, perf.as_mut_ptr()) }
            .map_err(failed($call))?;
        perf[..(count.max(0) as usize).min(WANT)]
            .iter()
            .map(|p| Offer {
                algo: p.algo as u32,
                status: p.status,
                memory: p.memory,
                deterministic: p.determinism == cudnnDeterminism_t::CUDNN_DETERMINISTIC,
                math: p.mathType,
            })
            .collect::<Vec<_>>()
    }};
}

/// cuDNN's choice for `pass` of `spec` over the descriptors `d` (made with `math_for`).
pub(super) fn choose(
    handle: sys::cudnnHandle_t,
    pass: ConvPass,
    spec: &ConvSpec,
    d: &Descriptors,
) -> Result<Choice, CudaLibError> {
    let offers = match pass {
        ConvPass::Forward => ranked!(
            sys::cudnnConvolutionFwdAlgoPerf_t,
            dnn::get_convolution_forward_algorithm,
            "cudnnGetConvolutionForwardAlgorithm_v7",
            handle,
            [d.a, d.filter, d.conv, d.b]
        ),
        ConvPass::BackwardData => ranked!(
            sys::cudnnConvolutionBwdDataAlgoPerf_t,
            dnn::get_convolution_backward_data_algorithm,
            "cudnnGetConvolutionBackwardDataAlgorithm_v7",
            handle,
            [d.filter, d.b, d.conv, d.a]
        ),
        ConvPass::BackwardFilter => ranked!(
            sys::cudnnConvolutionBwdFilterAlgoPerf_t,
            dnn::get_convolution_backward_filter_algorithm,
            "cudnnGetConvolutionBackwardFilterAlgorithm_v7",
            handle,
            [d.a, d.b, d.conv, d.filter]
        ),
    };
    pick(&offers, spec).ok_or_else(|| CudaLibError::Cudnn {
        call: "cudnnGetConvolution*Algorithm_v7",
        message: format!(
            "no algorithm for {pass:?} of {spec:?} within {WORKSPACE_LIMIT} bytes of workspace"
        ),
    })
}

/// The algorithm enums from the numbers cuDNN reported; an out-of-range number (never
/// returned by cuDNN) maps to an algorithm every shape supports.
pub(super) fn fwd_algo(n: u32) -> cudnnConvolutionFwdAlgo_t {
    use cudnnConvolutionFwdAlgo_t::*;
    [
        CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
        CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
        CUDNN_CONVOLUTION_FWD_ALGO_GEMM,
        CUDNN_CONVOLUTION_FWD_ALGO_DIRECT,
        CUDNN_CONVOLUTION_FWD_ALGO_FFT,
        CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING,
        CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD,
        CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED,
    ]
    .get(n as usize)
    .copied()
    .unwrap_or(CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM)
}

/// See [`fwd_algo`].
pub(super) fn bwd_data_algo(n: u32) -> cudnnConvolutionBwdDataAlgo_t {
    use cudnnConvolutionBwdDataAlgo_t::*;
    [
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_0,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_1,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED,
    ]
    .get(n as usize)
    .copied()
    .unwrap_or(CUDNN_CONVOLUTION_BWD_DATA_ALGO_1)
}

/// See [`fwd_algo`].
pub(super) fn bwd_filter_algo(n: u32) -> cudnnConvolutionBwdFilterAlgo_t {
    use cudnnConvolutionBwdFilterAlgo_t::*;
    [
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING,
    ]
    .get(n as usize)
    .copied()
    .unwrap_or(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pick_prefers_deterministic_fma_algorithms_within_the_workspace_limit() {
        let spec = ConvSpec {
            dtype: DType::F32,
            input: [1, 2, 5, 5],
            filter: [2, 2, 3, 3],
            stride: [1, 1],
            padding: [0, 0],
            dilation: [1, 1],
            groups: 1,
        };
        let offer = |algo, memory, deterministic, math| Offer {
            algo,
            status: cudnnStatus_t::CUDNN_STATUS_SUCCESS,
            memory,
            deterministic,
            math,
        };
        let fma = cudnnMathType_t::CUDNN_FMA_MATH;
        let tensor = cudnnMathType_t::CUDNN_TENSOR_OP_MATH;
        let offers = [
            offer(0, 0, false, fma),
            offer(5, WORKSPACE_LIMIT + 1, true, fma),
            offer(6, 0, true, tensor),
            offer(1, 64, true, fma),
        ];
        assert_eq!(pick(&offers, &spec).unwrap().algo, 1);
        let half = ConvSpec {
            dtype: DType::BF16,
            ..spec
        };
        assert_eq!(pick(&offers, &half).unwrap().algo, 6);
        // Nothing but an over-limit offer: no choice (an error naming the limit upstream).
        assert!(pick(&offers[1..2], &spec).is_none());
        // An out-of-range number falls back to an always-supported algorithm.
        assert_eq!(
            fwd_algo(99),
            cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM
        );
    }
}
