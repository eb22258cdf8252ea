//! Indexing, layer norm, attention, selection by mask, convolution, pooling and dropout.

use ferry::nn::Conv2dOptions;
use ferry_tensor::{AttentionOptions, DType, Tensor};

use super::Input::{Float as F, Index as I};
use super::{Case, Keeps};

/// layer_norm's statistics: a mean and an inverse deviation per row, in f32.
fn row_statistics<const COLS: usize>(x: &[Tensor], _: &Tensor) -> usize {
    x[0].numel() / COLS * 2 * 4
}

/// rms_norm's statistic: an inverse root mean square per row, in f32.
fn row_rstd<const COLS: usize>(x: &[Tensor], _: &Tensor) -> usize {
    x[0].numel() / COLS * 4
}

/// The rotation's cos and sin tables, `[T, 1, D]` each, in the input's dtype.
fn rotary_tables(x: &[Tensor], _: &Tensor) -> usize {
    let s = x[0].shape();
    2 * s[1] * s[3] * x[0].dtype().size()
}

/// Attention's log-sum-exp: one f32 per query row of the output `[.., q_len, v_dim]`.
fn row_log_sum_exp(_: &[Tensor], out: &Tensor) -> usize {
    out.numel() / out.shape()[out.ndim() - 1] * 4
}

/// Cross-entropy's log-sum-exp: one f32 per row of the `[rows, classes]` logits.
pub(super) fn row_log_sum_exp_of_input0(x: &[Tensor], _: &Tensor) -> usize {
    x[0].shape()[0] * 4
}

/// One byte per output element (a u8 condition or mask).
fn byte_per_output(_: &[Tensor], out: &Tensor) -> usize {
    out.numel()
}

/// One byte per element of input 1 (a mask built from it).
fn byte_per_input1(x: &[Tensor], _: &Tensor) -> usize {
    x[1].numel()
}

/// One `i64` index per output element (max pooling's window maxima).
fn index_per_output(_: &[Tensor], out: &Tensor) -> usize {
    8 * out.numel()
}

pub(super) fn cases() -> Vec<Case> {
    vec![
        // Each index op keeps its index tensor alone.
        Case::new(
            "index_select",
            &["index_select"],
            &[F(&[6, 4]), I(&[7])],
            |x| x[0].index_select(0, &x[1]),
            Keeps::inputs(&[1]),
        ),
        Case::new(
            "index_add",
            &["index_add"],
            &[F(&[5, 3]), I(&[4]), F(&[4, 3])],
            |x| x[0].index_add(0, &x[1], &x[2]),
            Keeps::inputs(&[1]),
        ),
        Case::new(
            "gather",
            &["gather"],
            &[F(&[4, 6]), I(&[4, 3])],
            |x| x[0].gather(1, &x[1]),
            Keeps::inputs(&[1]),
        ),
        // src is wider than the index: its covered part is a narrowed view.
        Case::new(
            "scatter_add",
            &["narrow", "scatter_add"],
            &[F(&[4, 6]), I(&[4, 3]), F(&[4, 5])],
            |x| x[0].scatter_add(1, &x[1], &x[2]),
            Keeps::inputs(&[1]),
        ),
        Case::new(
            "embedding",
            &["index_select", "reshape"],
            &[F(&[5, 3]), I(&[2, 4])],
            |x| Tensor::embedding(&x[0], &x[1]),
            Keeps::inputs(&[1]),
        ),
        // x, the weight (for x's gradient) and the row statistics.
        Case::new(
            "layer_norm_affine",
            &["reshape", "layer_norm"],
            &[F(&[4, 16]), F(&[16]), F(&[16])],
            |x| x[0].layer_norm(&[16], Some(&x[1]), Some(&x[2]), 1e-5),
            Keeps {
                unnamed: row_statistics::<16>,
                ..Keeps::inputs(&[0, 1])
            },
        ),
        Case::new(
            "layer_norm_plain_3d",
            &["reshape", "layer_norm"],
            &[F(&[2, 3, 8])],
            |x| x[0].layer_norm(&[3, 8], None, None, 1e-5),
            Keeps {
                unnamed: row_statistics::<24>,
                ..Keeps::inputs(&[0])
            },
        ),
        // mul keeps x0 and x1; where_cond keeps the condition alone.
        Case::new(
            "where_broadcast",
            &["mul", "where_cond"],
            &[F(&[3, 4]), F(&[4]), F(&[3, 1])],
            |x| {
                let zero = Tensor::zeros(&[], DType::F32, x[0].device())?.to_dtype(x[0].dtype())?;
                Tensor::where_cond(&x[0].gt(&zero)?, &x[0].mul(&x[1])?, &x[2])
            },
            Keeps {
                unnamed: byte_per_output,
                ..Keeps::inputs(&[0, 1])
            },
        ),
        Case::new(
            "masked_fill",
            &["where_cond"],
            &[F(&[3, 4]), I(&[4])],
            |x| {
                let two = Tensor::full(&[], 2.0, DType::I64, x[1].device())?;
                x[0].masked_fill(&x[1].gt(&two)?, -2.0)
            },
            Keeps {
                unnamed: byte_per_input1,
                ..Keeps::NOTHING
            },
        ),
        // conv2d keeps the input and the weight, not the columns.
        Case::new(
            "conv2d_stride_pad_dilation_groups",
            &["conv2d"],
            &[F(&[2, 4, 7, 8]), F(&[6, 2, 3, 2]), F(&[6])],
            |x| {
                let o = Conv2dOptions::default()
                    .stride(2)
                    .padding(1)
                    .dilation(2)
                    .groups(2);
                x[0].conv2d(&x[1], Some(&x[2]), o)
            },
            Keeps::inputs(&[0, 1]),
        ),
        Case::new(
            "conv2d_plain",
            &["conv2d"],
            &[F(&[1, 3, 6, 5]), F(&[4, 3, 3, 3])],
            |x| x[0].conv2d(&x[1], None, Conv2dOptions::default()),
            Keeps::inputs(&[0, 1]),
        )
        .backward(&["col2im"]),
        Case::new(
            "max_pool2d",
            &["reshape", "gather"],
            &[F(&[2, 3, 7, 6])],
            |x| x[0].max_pool2d([3, 3], [2, 2], [1, 1]),
            Keeps {
                unnamed: index_per_output,
                ..Keeps::NOTHING
            },
        ),
        Case::new(
            "avg_pool2d",
            &["reshape", "im2col", "sum", "mul_scalar"],
            &[F(&[2, 3, 7, 6])],
            |x| x[0].avg_pool2d([3, 3], [2, 2], [1, 1]),
            Keeps::NOTHING,
        ),
        // One node keeping q, k, v, the output and a log-sum-exp per query row; its backward
        // under create_graph recomputes the weights with recorded ops.
        Case::new(
            "attention_causal_gqa",
            &["scaled_dot_product_attention"],
            &[F(&[2, 4, 5, 8]), F(&[2, 2, 5, 8]), F(&[2, 2, 5, 8])],
            |x| {
                let options = AttentionOptions {
                    causal: true,
                    ..AttentionOptions::default()
                };
                x[0].scaled_dot_product_attention(&x[1], &x[2], options)
            },
            Keeps {
                inputs: &[0, 1, 2],
                output: true,
                unnamed: row_log_sum_exp,
            },
        )
        .backward(&["matmul", "softmax"]),
        Case::new(
            "attention_cross_scaled",
            &["reshape", "scaled_dot_product_attention"],
            &[F(&[3, 4, 6]), F(&[3, 7, 6]), F(&[3, 7, 5])],
            |x| {
                let options = AttentionOptions {
                    scale: Some(0.3),
                    ..AttentionOptions::default()
                };
                x[0].scaled_dot_product_attention(&x[1], &x[2], options)
            },
            Keeps {
                inputs: &[0, 1, 2],
                output: true,
                unnamed: row_log_sum_exp,
            },
        ),
        // PyTorch cannot draw ferry's mask: parity.py rebuilds it from this output's zeros and
        // checks the kept values and the gradient against x / (1 - p) with that mask. The seed
        // inside fixes the mask for gradcheck's repeated calls. The node keeps the mask alone.
        Case::new(
            "dropout",
            &["dropout"],
            &[F(&[64, 32])],
            |x| {
                ferry_tensor::manual_seed(9);
                x[0].dropout(0.25, true)
            },
            Keeps {
                unnamed: byte_per_output,
                ..Keeps::NOTHING
            },
        )
        .backward(&["masked_scale"]),
        // One node keeping the two tables (built inside, wanting no gradient); the CPU composes
        // it, its products keeping the same tables. parity.py has no rotation to mirror.
        Case::new(
            "rotary_embedding",
            &["rotary_embedding"],
            &[F(&[2, 3, 4, 8])],
            |x| {
                let (t, d) = (x[0].shape()[1], x[0].shape()[3]);
                let angles = Tensor::arange(0.0, (t * d) as f64, x[0].dtype(), x[0].device())?
                    .reshape(&[t, 1, d])?
                    .mul_scalar(0.37)?;
                x[0].rotary_embedding(&angles.cos()?, &angles.sin()?)
            },
            Keeps {
                unnamed: rotary_tables,
                ..Keeps::inputs(&[])
            },
        )
        .on_cpu(&["narrow", "neg", "cat", "mul", "add"])
        .backward(&["mul", "cat"])
        .no_parity(),
        // One node keeping x, the weight and an inverse root mean square per row; its backward
        // under create_graph recomputes the statistic with recorded ops.
        Case::new(
            "rms_norm_weighted",
            &["reshape", "rms_norm"],
            &[F(&[2, 3, 16]), F(&[16])],
            |x| x[0].rms_norm(Some(&x[1]), 1e-5),
            Keeps {
                unnamed: row_rstd::<16>,
                ..Keeps::inputs(&[0, 1])
            },
        )
        .backward(&["mul", "powf", "sub"]),
        Case::new(
            "rms_norm_plain",
            &["reshape", "rms_norm"],
            &[F(&[5, 8])],
            |x| x[0].rms_norm(None, 1e-3),
            Keeps {
                unnamed: row_rstd::<8>,
                ..Keeps::inputs(&[0])
            },
        ),
        // Rows whose target is 2 add nothing and do not count in the mean.
        Case::new(
            "cross_entropy_ignore_index",
            &["cross_entropy"],
            &[F(&[9, 5]), I(&[9])],
            |x| x[0].cross_entropy_with(&x[1], Some(2)),
            Keeps {
                unnamed: row_log_sum_exp_of_input0,
                ..Keeps::inputs(&[0, 1])
            },
        )
        .backward(&["softmax"]),
    ]
}
