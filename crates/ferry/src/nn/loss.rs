//! Losses: scalar tensors to call `backward()` on.

use ferry_tensor::{Result, Tensor, TensorError};

/// Mean squared error `mean((prediction - target)²)`; the shapes must be equal (no silent
/// broadcasting of a `[n]` target against `[n, 1]` predictions).
pub fn mse(prediction: &Tensor, target: &Tensor) -> Result<Tensor> {
    if prediction.shape() != target.shape() {
        return Err(TensorError::ShapeMismatch {
            op: "mse",
            lhs: prediction.shape().into(),
            rhs: target.shape().into(),
            hint: "prediction and target must have the same shape (reshape the target)",
        });
    }
    prediction.sub(target)?.powf(2.0)?.mean()
}

/// Mean cross-entropy of `[n, classes]` logits against `[n]` class indices (`i64`), computed
/// through a stable log-softmax.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    logits.cross_entropy(targets)
}
