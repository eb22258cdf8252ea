//! The autocast state: a per-thread precision in which matrix products, linear layers,
//! convolutions and attention run while a scope is open ([`AutocastGuard`]), read at the entry of
//! the ops it changes.
//!
//! Inside a scope of `bf16` (or `f16`) the policy is PyTorch's:
//! - *low precision*: `matmul`, `linear`, `conv2d` and `scaled_dot_product_attention` with an
//!   `f32` operand cast their `f32` operands (a bias too) to the scope's dtype and answer in it,
//!   so a model's activations between two products stay in the low precision and the next
//!   product takes them without a cast;
//! - *f32*: `softmax`, `log_softmax`, `cross_entropy`, `layer_norm` and `rms_norm` cast an input
//!   (and a norm's weight and bias) in the scope's dtype to `f32` and answer in `f32` (their sums
//!   and exponentials need the range);
//! - *widest*: a binary elementwise op of an `f32` and a scope-dtype operand casts the narrow one
//!   to `f32` (a residual stream in `f32` plus a block's low-precision output stays `f32`).
//!
//! Outside a scope mixed dtypes stay an error. A model's parameters (the master weights) and
//! their gradients stay `f32`: the casts are recorded ops, so gradients flow back through them and
//! arrive in each tensor's own dtype. Operands already all in the low precision, `f64` operands,
//! and ops outside any scope are untouched.
//!
//! The state is per thread, like grad mode: a scope opened on one thread does not change what
//! another thread computes. Scopes nest; dropping a guard restores what was in force before it.

use std::cell::Cell;
use std::marker::PhantomData;

use ferry_memory::DType;

use crate::{Result, Tensor, TensorError};

thread_local! {
    static AUTOCAST: Cell<Option<DType>> = const { Cell::new(None) };
}

/// The precision matrix products run in on this thread, or `None` outside any autocast scope
/// (or inside one that turned it off).
pub fn autocast_dtype() -> Option<DType> {
    AUTOCAST.with(Cell::get)
}

/// Puts a scope in force until dropped; dropping restores the state it replaced, so guards
/// nest. Not `Send`: the state belongs to the thread that opened it.
#[derive(Debug)]
#[must_use = "the scope ends when the guard is dropped"]
pub struct AutocastGuard {
    previous: Option<DType>,
    _thread: PhantomData<*const ()>,
}

impl AutocastGuard {
    /// Opens a scope in which matrix products run in `dtype` (`bf16` or `f16`), or with `None`
    /// a scope in which autocast is off (for an op that must stay in `f32` inside a larger
    /// scope). Any other dtype is an error.
    pub fn new(dtype: Option<DType>) -> Result<Self> {
        if let Some(d) = dtype
            && !matches!(d, DType::BF16 | DType::F16)
        {
            return Err(TensorError::InvalidArgument {
                op: "autocast",
                message: format!(
                    "autocast runs matrix products in a lower precision, bf16 or f16, not {d}; pass DType::BF16 (or DType::F16 with a GradScaler), or leave the code outside the scope to run in {d}"
                ),
            });
        }
        let previous = AUTOCAST.with(|s| s.replace(dtype));
        Ok(Self {
            previous,
            _thread: PhantomData,
        })
    }
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        AUTOCAST.with(|s| s.set(self.previous));
    }
}

/// The matmul entry's hook: inside a scope, with an `f32` operand, the product computed in the
/// scope's dtype; otherwise `None` (the caller computes as usual).
pub(crate) fn matmul(a: &Tensor, b: &Tensor) -> Result<Option<Tensor>> {
    let Some(low) = autocast_dtype() else {
        return Ok(None);
    };
    let cast = |t: &Tensor| {
        if t.dtype() == DType::F32 {
            t.to_dtype(low)
        } else {
            Ok(t.clone())
        }
    };
    let in_scope = |d: DType| d == DType::F32 || d == low;
    if !in_scope(a.dtype()) || !in_scope(b.dtype()) || (a.dtype() == low && b.dtype() == low) {
        return Ok(None); // nothing to cast, or a dtype the plain path reports
    }
    if a.device() != b.device() {
        return Ok(None); // the plain path names both devices
    }
    let (a, b) = (cast(a)?, cast(b)?);
    // The operands are no longer f32, so this call takes the plain path.
    a.matmul(&b).map(Some)
}

/// The low-precision dtype of the scope in force when `operands` (all on one device) are each
/// `f32` or that dtype and at least one is `f32`: the ops of the low-precision list then cast.
fn low_for(operands: &[&Tensor]) -> Option<DType> {
    let low = autocast_dtype()?;
    let dtypes = || operands.iter().map(|t| t.dtype());
    let in_scope = dtypes().all(|d| d == DType::F32 || d == low);
    let one_device = operands.iter().all(|t| t.device() == operands[0].device());
    (in_scope && one_device && dtypes().any(|d| d == DType::F32)).then_some(low)
}

/// The linear entry's hook: inside a scope, with an `f32` input, weight or bias, the layer
/// computed in the scope's dtype (every operand cast), so the fused product-and-bias runs.
pub(crate) fn linear(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    relu: bool,
) -> Result<Option<Tensor>> {
    let mut operands = vec![x, weight];
    operands.extend(bias);
    let Some(low) = low_for(&operands) else {
        return Ok(None);
    };
    let (x, weight) = (x.to_dtype(low)?, weight.to_dtype(low)?);
    let bias = bias.map(|b| b.to_dtype(low)).transpose()?;
    match relu {
        false => x.linear(&weight, bias.as_ref()).map(Some),
        true => x.linear_relu(&weight, bias.as_ref()).map(Some),
    }
}

/// The entry hook of the ops kept in `f32` (softmax, log-softmax, cross-entropy): inside a
/// scope, an input in the scope's dtype cast to `f32`; otherwise `None`.
pub(crate) fn in_f32(x: &Tensor) -> Result<Option<Tensor>> {
    match autocast_dtype() {
        Some(low) if x.dtype() == low => x.to_dtype(DType::F32).map(Some),
        _ => Ok(None),
    }
}

/// [`in_f32`] for a norm's input, weight and bias: inside a scope, when any of them is in the
/// scope's dtype, each that is cast to `f32`; otherwise `None`.
pub(crate) fn norm_in_f32(
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
) -> Result<Option<[Option<Tensor>; 3]>> {
    let Some(low) = autocast_dtype() else {
        return Ok(None);
    };
    let all = [Some(x), weight, bias];
    if !all.iter().flatten().any(|t| t.dtype() == low) {
        return Ok(None);
    }
    let widen = |t: Option<&Tensor>| -> Result<Option<Tensor>> {
        t.map(|t| match t.dtype() == low {
            true => t.to_dtype(DType::F32),
            false => Ok(t.clone()),
        })
        .transpose()
    };
    Ok(Some([widen(all[0])?, widen(all[1])?, widen(all[2])?]))
}

/// The binary elementwise ops' hook: inside a scope, an `f32` operand beside one in the scope's
/// dtype (on the same device) makes both `f32`; otherwise `None`.
pub(crate) fn widest(a: &Tensor, b: &Tensor) -> Result<Option<(Tensor, Tensor)>> {
    if a.dtype() == b.dtype() || low_for(&[a, b]).is_none() {
        return Ok(None);
    }
    Ok(Some((a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?)))
}

/// The attention entry's hook: inside a scope, with an `f32` query, key or value (and the others
/// `f32` or the scope's dtype), the attention computed in the scope's dtype, so that the fused
/// kernels (which take only `bf16` and `f16`) run it; otherwise `None`.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    options: crate::AttentionOptions,
) -> Result<Option<Tensor>> {
    let Some(low) = low_for(&[q, k, v]) else {
        return Ok(None);
    };
    let (q, k, v) = (q.to_dtype(low)?, k.to_dtype(low)?, v.to_dtype(low)?);
    // No operand is f32 now, so this call takes the plain path.
    q.scaled_dot_product_attention(&k, &v, options).map(Some)
}

/// The conv2d entry's hook, called once the arguments are checked: inside a scope, with an
/// `f32` input, weight or bias, the convolution computed in the scope's dtype (the bias cast
/// too); otherwise `None`.
pub(crate) fn conv2d(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    options: crate::Conv2dOptions,
) -> Result<Option<Tensor>> {
    let mut operands = vec![x, weight];
    operands.extend(bias);
    let Some(low) = low_for(&operands) else {
        return Ok(None);
    };
    let bias = bias.map(|b| b.to_dtype(low)).transpose()?;
    x.to_dtype(low)?
        .conv2d(&weight.to_dtype(low)?, bias.as_ref(), options)
        .map(Some)
}
