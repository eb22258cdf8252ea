//! Errors and messages that kernels of both devices report in the same words.

use crate::error::TensorError;

/// The error for indices outside `0..len`: how many, one of them, and the axis they index.
pub(crate) fn out_of_range(
    op: &'static str,
    count: u64,
    example: i64,
    len: usize,
    axis: usize,
    shape: &[usize],
) -> TensorError {
    TensorError::InvalidArgument {
        op,
        message: format!(
            "{count} index value(s) lie outside 0..{len} (one is {example}): axis {axis} of the \
             indexed tensor (shape {shape:?}) has {len} entries, so indices must lie in 0..{len}"
        ),
    }
}

/// What is wrong with `count` targets outside `0..classes` (one of them `example`).
pub(crate) fn classes_message(count: i64, example: i64, classes: usize) -> String {
    format!(
        "{count} target(s) lie outside 0..{classes} (one is {example}); targets are class indices \
         of the logits' second axis"
    )
}
