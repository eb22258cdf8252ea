//! Every gradient rule in one place. Each takes what the forward pass saw and returns the
//! backward closure; tensors it keeps are detached, so a node never holds its own history.
//!
//! Rules are written with tensor ops, so the same rule runs on every device. Composite ops
//! (mean, softmax, cross-entropy, ...) are built from these primitives and need no rule.

use std::sync::Arc;

use ferry_graph::{Backward, InputGrads};
use ferry_memory::DType;
use smallvec::smallvec;

use crate::autograd::{rule, saved_bytes};
use crate::layout::Shape;
use crate::ops::{BinaryOp, UnaryOp};
use crate::{Result, Tensor};

type Rule = Arc<dyn Backward<Tensor>>;

impl Tensor {
    /// Sums a broadcast gradient back down to `shape` (the inverse of broadcasting).
    pub(crate) fn sum_to(&self, shape: &[usize]) -> Result<Tensor> {
        if self.shape() == shape {
            return Ok(self.clone());
        }
        let lead = self.ndim() - shape.len();
        let mut g = self.clone();
        for axis in (0..self.ndim()).rev() {
            let target = if axis < lead { 0 } else { shape[axis - lead] };
            if axis < lead || (target == 1 && self.shape()[axis] != 1) {
                g = g.sum_axis(axis as isize, axis >= lead)?;
            }
        }
        g.reshape(shape)
    }
}

/// `a ∘ b`: the chain rule per element, then sum over what broadcasting repeated.
pub(crate) fn binary(op: BinaryOp, a: &Tensor, b: &Tensor) -> Rule {
    let (a, b) = (a.detach(), b.detach());
    let saved: &[&Tensor] = match op {
        BinaryOp::Add | BinaryOp::Sub => &[],
        BinaryOp::Mul | BinaryOp::Div => &[&a, &b],
    };
    rule(saved_bytes(saved), move |g, wanted| {
        let (da, db) = match op {
            // d(a+b) = da + db;  d(a-b) = da - db
            BinaryOp::Add => (
                lazy(wanted[0], || Ok(g.clone())),
                lazy(wanted[1], || Ok(g.clone())),
            ),
            BinaryOp::Sub => (
                lazy(wanted[0], || Ok(g.clone())),
                lazy(wanted[1], || g.neg()),
            ),
            // d(ab) = b da + a db
            BinaryOp::Mul => (lazy(wanted[0], || g.mul(&b)), lazy(wanted[1], || g.mul(&a))),
            // d(a/b) = da / b - a db / b²
            BinaryOp::Div => (
                lazy(wanted[0], || g.div(&b)),
                lazy(wanted[1], || g.mul(&a)?.div(&b.mul(&b)?)?.neg()),
            ),
        };
        Ok(smallvec![
            da?.map(|d| d.sum_to(a.shape())).transpose()?,
            db?.map(|d| d.sum_to(b.shape())).transpose()?,
        ])
    })
}

fn lazy(wanted: bool, f: impl FnOnce() -> Result<Tensor>) -> Result<Option<Tensor>> {
    wanted.then(f).transpose()
}

/// `f(x)` elementwise, given the input `x` and the output `y = f(x)`.
pub(crate) fn unary(op: UnaryOp, x: &Tensor, y: &Tensor) -> Rule {
    let (x, y) = (x.detach(), y.detach());
    let saved: Vec<&Tensor> = match op {
        UnaryOp::Exp | UnaryOp::Tanh | UnaryOp::Sigmoid | UnaryOp::Sqrt => vec![&y],
        UnaryOp::Log | UnaryOp::Relu | UnaryOp::Abs | UnaryOp::PowScalar(_) => vec![&x],
        _ => vec![],
    };
    rule(saved_bytes(&saved), move |g, _| {
        let dx = match op {
            UnaryOp::Neg => g.neg()?,                                     // d(-x) = -1
            UnaryOp::Exp => g.mul(&y)?,                                   // d eˣ = eˣ
            UnaryOp::Log => g.div(&x)?,                                   // d ln x = 1/x
            UnaryOp::Relu => g.mul(&x.step()?)?,                          // 1 where x > 0
            UnaryOp::Tanh => g.mul(&y.mul(&y)?.neg()?.add_scalar(1.0)?)?, // 1 - tanh²
            UnaryOp::Sigmoid => g.mul(&y.mul(&y.neg()?.add_scalar(1.0)?)?)?, // σ(1 - σ)
            UnaryOp::Sqrt => g.div(&y.mul_scalar(2.0)?)?,                 // 1 / (2√x)
            UnaryOp::Abs => g.mul(&x.step()?.sub(&x.neg()?.step()?)?)?,   // sign(x)
            UnaryOp::Step => g.zeros_like()?,
            UnaryOp::AddScalar(_) => g.clone(),
            UnaryOp::MulScalar(c) => g.mul_scalar(c)?,
            UnaryOp::PowScalar(p) => g.mul(&x.powf(p - 1.0)?.mul_scalar(p)?)?, // p xᵖ⁻¹
        };
        Ok(smallvec![Some(dx)])
    })
}

/// Sum of everything: every element gets the (scalar) gradient.
pub(crate) fn sum_all(x: &Tensor) -> Rule {
    let shape: Shape = x.dims();
    rule(0, move |g, _| {
        Ok(smallvec![Some(g.broadcast_to(&shape)?.contiguous()?)])
    })
}

/// Sum along `axis` (removed from the output): the gradient repeats along it.
pub(crate) fn sum_axis(x: &Tensor, axis: usize) -> Rule {
    let shape: Shape = x.dims();
    rule(0, move |g, _| {
        Ok(smallvec![Some(
            g.unsqueeze(axis as isize)?
                .broadcast_to(&shape)?
                .contiguous()?
        )])
    })
}

/// Broadcasting: what was repeated sums back.
pub(crate) fn broadcast(x: &Tensor) -> Rule {
    let shape: Shape = x.dims();
    rule(0, move |g, _| Ok(smallvec![Some(g.sum_to(&shape)?)]))
}

/// Max along an axis: the gradient goes to the (first) maximal element only.
pub(crate) fn max_axis(x: &Tensor, axis: usize) -> Rule {
    let x = x.detach();
    rule(saved_bytes(&[&x]), move |g, _| {
        let index = x.argmax(axis as isize, false)?;
        let len = x.shape()[axis];
        // one_hot puts classes last; move that axis to where it was reduced.
        let mut mask = Tensor::one_hot(&index, len, x.dtype())?;
        let last = mask.ndim() - 1;
        for to in (axis..last).rev() {
            mask = mask.transpose(to as isize + 1, to as isize)?;
        }
        Ok(smallvec![Some(g.unsqueeze(axis as isize)?.mul(&mask)?)])
    })
}

/// `a · b`: da = g · bᵀ, db = aᵀ · g, summed over broadcast batch dimensions.
pub(crate) fn matmul(a: &Tensor, b: &Tensor) -> Rule {
    let (a, b) = (a.detach(), b.detach());
    rule(saved_bytes(&[&a, &b]), move |g, wanted| {
        let da = lazy(wanted[0], || g.matmul(&b.t()?)?.sum_to(a.shape()))?;
        let db = lazy(wanted[1], || a.t()?.matmul(g)?.sum_to(b.shape()))?;
        Ok(smallvec![da, db])
    })
}

/// Swapping axes back.
pub(crate) fn transpose(a: usize, b: usize) -> Rule {
    rule(0, move |g, _| {
        Ok(smallvec![Some(g.transpose(a as isize, b as isize)?)])
    })
}

/// Viewing the gradient in the input's shape.
pub(crate) fn reshape(x: &Tensor) -> Rule {
    let shape: Shape = x.dims();
    rule(0, move |g, _| Ok(smallvec![Some(g.reshape(&shape)?)]))
}

/// A copy: the gradient passes through unchanged.
pub(crate) fn identity() -> Rule {
    rule(0, |g, _| Ok(smallvec![Some(g.clone())]))
}

/// A narrowed view: the gradient, padded with zeros where the view did not reach.
pub(crate) fn narrow(x: &Tensor, axis: usize, start: usize) -> Rule {
    let shape: Shape = x.dims();
    rule(0, move |g, _| {
        let len = g.shape()[axis];
        let pad = |n: usize| {
            let mut s = shape.to_vec();
            s[axis] = n;
            Tensor::zeros(&s, g.dtype(), g.device())
        };
        let (before, after) = (pad(start)?, pad(shape[axis] - start - len)?);
        Ok(smallvec![Some(Tensor::cat(
            &[&before, g, &after],
            axis as isize
        )?)])
    })
}

/// Concatenation: each input gets its slice of the gradient.
pub(crate) fn cat(parts: &[&Tensor], axis: usize) -> Rule {
    let sizes: Vec<usize> = parts.iter().map(|p| p.shape()[axis]).collect();
    rule(0, move |g, wanted| {
        let mut start = 0;
        let mut grads = InputGrads::new();
        for (&size, &want) in sizes.iter().zip(wanted) {
            grads.push(lazy(want, || {
                g.narrow(axis as isize, start, size)?.contiguous()
            })?);
            start += size;
        }
        Ok(grads)
    })
}

/// A dtype conversion: the gradient converts back.
pub(crate) fn cast(from: DType) -> Rule {
    rule(0, move |g, _| Ok(smallvec![Some(g.to_dtype(from)?)]))
}

/// Softmax over the last axis, given its output y: dx = y ⊙ (g − Σ g⊙y).
/// Log-softmax: dx = g − eʸ ⊙ Σ g.
pub(crate) fn softmax(y: &Tensor, log: bool) -> Rule {
    let y = y.detach();
    rule(saved_bytes(&[&y]), move |g, _| {
        let dx = if log {
            g.sub(&y.exp()?.mul(&g.sum_axis(-1, true)?)?)?
        } else {
            y.mul(&g.sub(&g.mul(&y)?.sum_axis(-1, true)?)?)?
        };
        Ok(smallvec![Some(dx)])
    })
}
