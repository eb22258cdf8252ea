//! Reductions, matrix products, linear layers, views and copies, casts, the softmax family, and
//! device moves.

use ferry::{ChunkSpec, DeviceMove};
use ferry_tensor::{DType, Device, Tensor};

use super::Input::{Float as F, Index as I};
use super::{Case, Keeps};

/// One `i64` index per output element (max's argmax).
fn index_per_output(_: &[Tensor], out: &Tensor) -> usize {
    8 * out.numel()
}

/// log_softmax's output, shaped like the logits.
fn like_input0(x: &[Tensor], _: &Tensor) -> usize {
    x[0].nbytes()
}

/// An f64 copy of an f32 input 0.
fn twice_input0(x: &[Tensor], _: &Tensor) -> usize {
    2 * x[0].nbytes()
}

pub(super) fn cases() -> Vec<Case> {
    vec![
        Case::new(
            "sum_all",
            &["sum"],
            &[F(&[4, 5])],
            |x| x[0].sum(),
            Keeps::NOTHING,
        ),
        Case::new(
            "mean_all",
            &["sum", "mul_scalar"],
            &[F(&[4, 5])],
            |x| x[0].mean(),
            Keeps::NOTHING,
        ),
        Case::new(
            "sum_axis_keepdim",
            &["sum", "reshape"],
            &[F(&[4, 5, 3])],
            |x| x[0].sum_axis(1, true),
            Keeps::NOTHING,
        ),
        Case::new(
            "mean_axis",
            &["sum", "mul_scalar"],
            &[F(&[4, 5, 3])],
            |x| x[0].mean_axis(-1, false),
            Keeps::NOTHING,
        ),
        Case::new(
            "max_axis",
            &["max"],
            &[F(&[6, 7])],
            |x| x[0].max_axis(1, false),
            Keeps {
                unnamed: index_per_output,
                ..Keeps::NOTHING
            },
        ),
        Case::new(
            "argmax",
            &[],
            &[F(&[6, 7])],
            |x| x[0].argmax(0, false)?.to_dtype(DType::F32),
            Keeps::NOTHING,
        )
        .records_nothing(),
        Case::new(
            "matmul",
            &["matmul"],
            &[F(&[8, 16]), F(&[16, 4])],
            |x| x[0].matmul(&x[1]),
            Keeps::inputs(&[0, 1]),
        ),
        Case::new(
            "matmul_batched_broadcast",
            &["matmul"],
            &[F(&[3, 8, 16]), F(&[16, 4])],
            |x| x[0].matmul(&x[1]),
            Keeps::inputs(&[0, 1]),
        ),
        Case::new(
            "matmul_transposed",
            &["transpose", "matmul"],
            &[F(&[16, 8]), F(&[4, 16])],
            |x| x[0].t()?.matmul(&x[1].t()?),
            Keeps::inputs(&[0, 1]),
        ),
        // One fused node on a GPU (cuBLASLt); matmul and add elsewhere, keeping the same.
        Case::new(
            "linear",
            &["linear"],
            &[F(&[8, 16]), F(&[4, 16]), F(&[4])],
            |x| x[0].linear(&x[1], Some(&x[2])),
            Keeps::inputs(&[0, 1]),
        )
        .on_cpu(&["transpose", "matmul", "add"]),
        Case::new(
            "linear_relu",
            &["linear"],
            &[F(&[8, 16]), F(&[4, 16]), F(&[4])],
            |x| x[0].linear_relu(&x[1], Some(&x[2])),
            Keeps {
                output: true,
                ..Keeps::inputs(&[0, 1])
            },
        )
        .on_cpu(&["transpose", "matmul", "add", "relu"]),
        Case::new(
            "transpose_reshape_narrow",
            &["transpose", "reshape", "narrow"],
            &[F(&[4, 6])],
            |x| x[0].transpose(0, 1)?.reshape(&[3, 8])?.narrow(1, 2, 4),
            Keeps::NOTHING,
        ),
        Case::new(
            "chunk_cat",
            &["narrow", "cat"],
            &[F(&[6, 4])],
            |x| {
                let c = x[0].chunk(3, 0)?;
                Tensor::cat(&[&c[2], &c[0]], 1)
            },
            Keeps::NOTHING,
        ),
        Case::new(
            "unsqueeze_broadcast_squeeze",
            &["reshape", "broadcast_to", "sum"],
            &[F(&[5])],
            |x| {
                x[0].unsqueeze(0)?
                    .broadcast_to(&[3, 5])?
                    .sum_axis(0, true)?
                    .squeeze(0)
            },
            Keeps::NOTHING,
        ),
        Case::new(
            "copy",
            &["copy"],
            &[F(&[3, 4])],
            |x| x[0].copy(),
            Keeps::NOTHING,
        ),
        Case::new(
            "contiguous",
            &["transpose", "contiguous"],
            &[F(&[3, 4])],
            |x| x[0].t()?.contiguous(),
            Keeps::NOTHING,
        ),
        // mul keeps the round trip's f32 result and x1.
        Case::new(
            "cast_f16_round_trip",
            &["to_dtype", "mul"],
            &[F(&[10]), F(&[10])],
            |x| x[0].to_dtype(DType::F16)?.to_dtype(DType::F32)?.mul(&x[1]),
            Keeps {
                unnamed: like_input0,
                ..Keeps::inputs(&[1])
            },
        )
        .no_gradcheck("f16 rounding is a staircase at gradcheck's step (grad_shape checks casts)"),
        // A cast to the other of f32 and f64 and back: mul keeps the cast value (twice, counted
        // once), f64 for an f32 input.
        Case::new(
            "to_dtype_square",
            &["to_dtype", "mul"],
            &[F(&[3, 4])],
            |x| {
                let other = if x[0].dtype() == DType::F32 {
                    DType::F64
                } else {
                    DType::F32
                };
                let y = x[0].to_dtype(other)?;
                y.mul(&y)?.to_dtype(x[0].dtype())
            },
            Keeps {
                unnamed: twice_input0,
                ..Keeps::NOTHING
            },
        )
        .loose(),
        Case::new(
            "softmax",
            &["softmax"],
            &[F(&[4, 9])],
            |x| x[0].softmax(1),
            Keeps::OUTPUT,
        ),
        // Along axis 0 the kernel runs on a transposed view: the output views the kept storage.
        Case::new(
            "log_softmax_axis0",
            &["transpose", "log_softmax"],
            &[F(&[4, 9])],
            |x| x[0].log_softmax(0),
            Keeps::OUTPUT,
        ),
        // One node keeping the logits, the targets and a log-sum-exp per row (f32): never a
        // second [rows, classes] tensor. Under create_graph its backward rebuilds the softmax.
        Case::new(
            "cross_entropy",
            &["cross_entropy"],
            &[F(&[8, 5]), I(&[8])],
            |x| x[0].cross_entropy(&x[1]),
            Keeps {
                unnamed: super::layers::row_log_sum_exp_of_input0,
                ..Keeps::inputs(&[0, 1])
            },
        )
        .backward(&["softmax"]),
        Case::new(
            "permute",
            &["permute", "mul"],
            &[F(&[2, 3, 4]), F(&[4, 2, 3])],
            |x| x[0].permute(&[2, 0, 1])?.mul(&x[1]),
            Keeps::inputs(&[0, 1]),
        ),
        Case::new(
            "stack",
            &["transpose", "reshape", "cat"],
            &[F(&[2, 3]), F(&[3, 2])],
            |x| Tensor::stack(&[&x[0], &x[1].t()?], 1),
            Keeps::NOTHING,
        ),
        // Moves keep nothing: the source's device and dtype are all the way home needs.
        Case::new(
            "to_device",
            &["to_device"],
            &[F(&[3, 4])],
            |x| x[0].to(Device::Cpu),
            Keeps::NOTHING,
        )
        .no_parity(),
        Case::new(
            "to_chunked",
            &["to_chunked"],
            &[F(&[6, 4])],
            |x| Ok(x[0].to_chunked(Device::Cpu, ChunkSpec::Count(3))?.0),
            Keeps::NOTHING,
        )
        .no_parity(),
        Case::new(
            "to_async",
            &["to_async"],
            &[F(&[6, 4])],
            |x| {
                let Device::Cuda(ordinal) = x[0].device() else {
                    unreachable!("a cuda_only case runs on a GPU")
                };
                let stream = ferry::memory::cuda::CudaDevice::get(ordinal)?.new_stream()?;
                Ok(x[0].to_async(Device::Cpu, &stream)?.wait()?.0)
            },
            Keeps::NOTHING,
        )
        .no_parity()
        .cuda_only(),
    ]
}
