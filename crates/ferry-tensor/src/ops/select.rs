//! Choosing elements by a mask: `where_cond`, `masked_fill`, and dropout as one fused op that
//! draws its mask, scales and keeps only the mask (one byte per element) for backward.

use ferry_memory::{DType, Device};

use crate::autograd::record;
use crate::layout::broadcast_shapes;
use crate::{Result, Tensor, TensorError, backend, rules};

impl Tensor {
    /// `on_true` where `cond` is nonzero, else `on_false`, elementwise; the three broadcast
    /// together. `cond` is a `u8` tensor as the comparisons (`gt`, `eq`, ...) produce it;
    /// `on_true` and `on_false` share a dtype. Each value input's gradient is the output's
    /// where it was chosen and 0 elsewhere (summed over what broadcasting repeated); the rule
    /// keeps `cond` alone.
    pub fn where_cond(cond: &Tensor, on_true: &Tensor, on_false: &Tensor) -> Result<Tensor> {
        if cond.dtype() != DType::U8 {
            return Err(TensorError::UnsupportedDType {
                op: "where_cond",
                dtype: cond.dtype(),
                hint: "the condition must be u8 (1 true, 0 false) as comparisons return it; \
                       build it with `a.gt(&b)?` or cast with `.to_dtype(DType::U8)`",
            });
        }
        on_true.same_kind("where_cond", on_false)?;
        if cond.device() != on_true.device() {
            return Err(TensorError::DeviceMismatch {
                op: "where_cond",
                lhs: cond.device(),
                rhs: on_true.device(),
            });
        }
        let shape = broadcast_shapes("where_cond", on_true.shape(), on_false.shape())?;
        let shape = broadcast_shapes("where_cond", cond.shape(), &shape)?;
        crate::layout::shape_bytes("where_cond", &shape, on_true.dtype())?;
        let layout = |t: &Tensor| {
            t.layout()
                .broadcast_to(&shape)
                .expect("broadcast_shapes checked it")
        };
        let (lc, la, lb) = (layout(cond), layout(on_true), layout(on_false));
        let out = backend::where_cond(cond, &lc, on_true, &la, on_false, &lb)?;
        Ok(record(out, "where_cond", &[on_true, on_false], || {
            rules::where_cond(cond, on_true, on_false)
        }))
    }

    /// `value` where `mask` is nonzero, else `self`; `mask` (`u8`) broadcasts against `self`.
    /// The gradient passes where the mask is 0.
    pub fn masked_fill(&self, mask: &Tensor, value: f64) -> Result<Tensor> {
        let shape = broadcast_shapes("masked_fill", self.shape(), mask.shape())?;
        if shape.as_slice() != self.shape() {
            return Err(TensorError::ShapeMismatch {
                op: "masked_fill",
                lhs: self.dims(),
                rhs: mask.dims(),
                hint: "the mask must broadcast to the tensor's shape without growing it",
            });
        }
        let fill = Tensor::full(&[], value, self.dtype(), self.device())?;
        Tensor::where_cond(mask, &fill, self)
    }

    /// Dropout as one op: while `training`, each element is zeroed with probability `p` and
    /// the survivors scaled by `1 / (1 - p)` (so the expected output is the input); otherwise,
    /// or with `p = 0`, the input itself. One kernel draws the mask and scales; the gradient
    /// rule keeps only the mask, one `u8` per element (not the input). The mask comes from a
    /// seed drawn from this thread's generator ([`crate::manual_seed`]), and element `i`'s draw
    /// depends only on (seed, `i`): a seed gives the same mask on the CPU and on a GPU.
    /// `p = 1` gives zeros.
    pub fn dropout(&self, p: f64, training: bool) -> Result<Tensor> {
        if !(0.0..=1.0).contains(&p) {
            return Err(TensorError::InvalidArgument {
                op: "dropout",
                message: format!("p = {p}: the drop probability must lie in [0, 1]"),
            });
        }
        if !self.dtype().is_float() {
            return Err(TensorError::UnsupportedDType {
                op: "dropout",
                dtype: self.dtype(),
                hint: "dropout works on float tensors; cast with `.to_dtype(DType::F32)`",
            });
        }
        if !training || p == 0.0 {
            return Ok(self.clone());
        }
        let scale = if p < 1.0 { 1.0 / (1.0 - p) } else { 0.0 };
        let seed = draw_seed()?;
        let (out, mask) = backend::dropout(self, p, scale, seed)?;
        Ok(record(out, "dropout", &[self], || {
            rules::dropout(mask, scale)
        }))
    }

    /// `self * scale` where `mask` (u8, contiguous, same shape) is nonzero, else 0: dropout's
    /// backward, linear in `self`, so its rule is dropout's own.
    pub(crate) fn masked_scale(&self, mask: &Tensor, scale: f64) -> Result<Tensor> {
        let out = backend::masked_scale(self, mask, scale)?;
        Ok(record(out, "masked_scale", &[self], || {
            rules::dropout(mask.clone(), scale)
        }))
    }
}

/// A 64-bit seed from this thread's generator (two uniform draws of 53 bits each), so that
/// `manual_seed` fixes dropout masks as it fixes `rand`.
pub(crate) fn draw_seed() -> Result<u64> {
    let draws = Tensor::rand(&[2], DType::F64, Device::Cpu)?.to_vec::<f64>()?;
    let bits = |u: f64| (u * 9_007_199_254_740_992.0) as u64; // 2^53
    Ok(bits(draws[0]) << 11 ^ bits(draws[1]))
}
