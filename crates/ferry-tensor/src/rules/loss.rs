//! Cross-entropy's rule: the logits' gradient `(softmax(x) - onehot(target)) * g / counted` built
//! on the fly from the saved logits, targets and per-row log-sum-exp (the device's fused
//! kernel), or from differentiable ops under `create_graph`, so second derivatives flow.

use ferry_graph::InputGrads;
use ferry_memory::DType;
use smallvec::smallvec;

use crate::autograd::{Rule, Save, Saved, should_record};
use crate::{Result, Tensor, backend};

/// cross_entropy ignoring the class `ignore` (`(true, class)`) or none, keeping the logits
/// (input 0), the targets (input 1) and the `[rows]` log-sum-exp `lse`.
pub(crate) fn cross_entropy(ignore: Option<i64>, lse: Tensor) -> Rule<(bool, isize)> {
    let state = (ignore.is_some(), ignore.unwrap_or(0) as isize);
    Rule::new(
        Save::input(0).and(Save::input(1)),
        state,
        cross_entropy_backward,
    )
    .with_aux(lse)
}

fn cross_entropy_backward(
    saved: &Saved<'_>,
    &(has_ignore, ignore): &(bool, isize),
    g: &Tensor,
    _: &[bool],
) -> Result<InputGrads<Tensor>> {
    let ignore = has_ignore.then_some(ignore as i64);
    let (x, targets, lse) = (saved.input(0)?, saved.input(1)?, saved.aux()?);
    let wide = lse.dtype();
    let counted = counted_rows(&targets, ignore, wide)?;
    let fused = if should_record(&[g, &x]) {
        None
    } else {
        let scale = g.to_dtype(wide)?.div(&counted)?;
        backend::cross_entropy_backward(&x, &targets, &lse, &scale, ignore)?
    };
    let dx = match fused {
        Some(dx) => dx,
        None => composed_backward(&x, &targets, g, &counted, ignore)?,
    };
    Ok(smallvec![Some(dx), None])
}

/// The rows that count in the mean (those whose target is not `ignore`), 0-d in `dtype`.
pub(crate) fn counted_rows(targets: &Tensor, ignore: Option<i64>, dtype: DType) -> Result<Tensor> {
    match ignore {
        None => Tensor::full(&[], targets.numel() as f64, dtype, targets.device()),
        Some(k) => kept_rows(targets, k, dtype)?.sum(),
    }
}

/// 1 for each row whose target is not `ignore`, else 0, as `[rows]` of `dtype`.
pub(crate) fn kept_rows(targets: &Tensor, ignore: i64, dtype: DType) -> Result<Tensor> {
    let ignored = Tensor::full(&[], ignore as f64, DType::I64, targets.device())?;
    targets.ne(&ignored)?.to_dtype(dtype)
}

/// The same gradient from tensor ops (recorded under `create_graph`).
fn composed_backward(
    x: &Tensor,
    targets: &Tensor,
    g: &Tensor,
    counted: &Tensor,
    ignore: Option<i64>,
) -> Result<Tensor> {
    let dtype = x.dtype();
    let scale = g.to_dtype(dtype)?.div(&counted.to_dtype(dtype)?)?;
    let per_row = match ignore {
        None => scale,
        Some(k) => kept_rows(targets, k, dtype)?.mul(&scale)?.unsqueeze(1)?,
    };
    let hot = Tensor::one_hot(targets, x.shape()[1], dtype)?;
    x.softmax(1)?.sub(&hot)?.mul(&per_row)
}
