//! The autocast state: a per-thread precision in which matrix products, convolutions and
//! attention run while a scope is open ([`AutocastGuard`]), read by [`Tensor::matmul`],
//! [`Tensor::conv2d`] and [`Tensor::scaled_dot_product_attention`] at their entry.
//!
//! Inside a scope of `bf16` (or `f16`), a matmul with an `f32` operand casts its `f32` operands
//! to that dtype, multiplies in it, and casts the product back to `f32`; a conv2d of an `f32`
//! input and weight does the same, and adds its bias in `f32`; attention with an `f32` query, key
//! or value casts them to that dtype, so that the fused kernels (which take only `bf16` and
//! `f16`) run it, and casts its output back to `f32`, as PyTorch's autocast runs
//! `scaled_dot_product_attention` in the low precision. Every other op sees only
//! `f32` tensors, so reductions, softmax, cross-entropy and normalisations stay in `f32` with no
//! hook of their own, and a model's parameters (the master weights) and their gradients stay
//! `f32`: the casts are recorded ops, so gradients flow back through them. Products of operands
//! already in a low precision, `f64` products, and products outside a scope are untouched.
//!
//! Key decision: the product comes back in `f32`, not in the low precision. It costs one cast of
//! the output, and in exchange no other op needs an autocast rule and mixed-dtype arithmetic
//! never arises (a `bf16` product plus an `f32` bias would be a dtype mismatch).
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
/// scope's dtype and cast back to `f32`; otherwise `None` (the caller computes as usual).
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
    let out = a.matmul(&b)?;
    out.to_dtype(DType::F32).map(Some)
}

/// The attention entry's hook: inside a scope, with an `f32` query, key or value (and the others
/// `f32` or the scope's dtype), the attention computed in the scope's dtype and its output cast
/// back to `f32`; otherwise `None`.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    options: crate::AttentionOptions,
) -> Result<Option<Tensor>> {
    let Some(low) = autocast_dtype() else {
        return Ok(None);
    };
    let dtypes = [q.dtype(), k.dtype(), v.dtype()];
    let in_scope = |d: &DType| *d == DType::F32 || *d == low;
    if !dtypes.iter().all(in_scope) || !dtypes.contains(&DType::F32) {
        return Ok(None); // nothing to cast, or a dtype the plain path reports
    }
    if q.device() != k.device() || q.device() != v.device() {
        return Ok(None); // the plain path names the devices
    }
    let low_of = |t: &Tensor| t.to_dtype(low);
    let (q, k, v) = (low_of(q)?, low_of(k)?, low_of(v)?);
    // No operand is f32 now, so this call takes the plain path.
    let out = q.scaled_dot_product_attention(&k, &v, options)?;
    out.to_dtype(DType::F32).map(Some)
}

/// The conv2d entry's hook, called once the arguments are checked: inside a scope, with `f32`
/// input and weight, the convolution computed in the scope's dtype and cast back to `f32`, the
/// bias added in `f32`; otherwise `None`.
pub(crate) fn conv2d(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    options: crate::Conv2dOptions,
) -> Result<Option<Tensor>> {
    let Some(low) = autocast_dtype() else {
        return Ok(None);
    };
    if x.dtype() != DType::F32 || weight.dtype() != DType::F32 {
        return Ok(None);
    }
    let y = x
        .to_dtype(low)?
        .conv2d(&weight.to_dtype(low)?, None, options)?
        .to_dtype(DType::F32)?;
    match bias {
        Some(b) => y.add(&b.reshape(&[1, b.numel(), 1, 1])?).map(Some),
        None => Ok(Some(y)),
    }
}
