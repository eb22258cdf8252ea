//! Every gradient rule of ferry-tensor's ops, and only here: this module holds the elementwise,
//! reduction, matmul, shape and nll rules; `index`, `conv`, `norm`, `attention` and `loss`
//! (cross-entropy) hold the rules of those op families. Ops call a function here that builds
//! their rule; no op builds one itself. (The device move's rule lives with the move, in
//! ferry-transfer, which owns that op.) Each says what it saves, as PyTorch's rules do: an input
//! only when the gradient of *another* input needs it, the output where the derivative is
//! cheapest from it (exp, tanh, sigmoid, sqrt, relu, softmax), and otherwise shapes alone.
//!
//! Rules are written with tensor ops, so the same rule runs on every device, and under
//! `create_graph` the backward records its own graph: every rule is itself differentiable.
//! Composite ops (mean, cross-entropy where a device has no fused kernel, ...) are built from these and need no rule.

mod activation;
mod attention;
mod conv;
mod index;
mod loss;
mod norm;

pub(crate) use attention::{attention, attention_composed};
pub(crate) use conv::{col2im, conv2d, im2col};
pub(crate) use index::{gather, index_add, index_select, scatter_add};
pub(crate) use loss::{counted_rows, cross_entropy, kept_rows};
pub(crate) use norm::{layer_norm, rms_norm};

use ferry_graph::InputGrads;
use ferry_memory::DType;
use smallvec::smallvec;

use crate::autograd::{Rule, Save};
use crate::layout::Shape;
use crate::op::{BinaryOp, UnaryOp};
use crate::{Result, Tensor};

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

fn want(wanted: bool, f: impl FnOnce() -> Result<Tensor>) -> Result<Option<Tensor>> {
    wanted.then(f).transpose()
}

fn reduced(g: Option<Tensor>, shape: &[usize]) -> Result<Option<Tensor>> {
    g.map(|d| d.sum_to(shape)).transpose()
}

/// `a ∘ b`: the chain rule per element, then a sum over what broadcasting repeated.
pub(crate) fn binary(op: BinaryOp, a: &Tensor, b: &Tensor) -> Rule<(BinaryOp, Shape, Shape)> {
    let (ga, gb) = (a.requires_grad(), b.requires_grad());
    let save = match op {
        BinaryOp::Add | BinaryOp::Sub => Save::NOTHING,
        // d(ab) = b da + a db: a is needed only for db, b only for da.
        BinaryOp::Mul => Save::input_if(0, gb).and(Save::input_if(1, ga)),
        // d(a/b) = da / b - a db / b²
        BinaryOp::Div => Save::input(1).and(Save::input_if(0, gb)),
        // f(g, y) is linear in g: dg needs y; dy needs g and y (none for relu's, a step).
        BinaryOp::ReluBackward => Save::input_if(1, ga),
        BinaryOp::TanhBackward | BinaryOp::SigmoidBackward => {
            Save::input(1).and(Save::input_if(0, gb))
        }
        // f(g, x) = g h(x), from the activation's input x: dg needs x, dx needs g and x.
        BinaryOp::SiluBackward | BinaryOp::GeluBackward | BinaryOp::GeluTanhBackward => {
            Save::input(1).and(Save::input_if(0, gb))
        }
        // Who gets the gradient depends on both values.
        BinaryOp::Maximum | BinaryOp::Minimum => Save::input(0).and(Save::input(1)),
        // Piecewise constant: never recorded with gradients (ops::activation).
        BinaryOp::MaxShare => Save::NOTHING,
    };
    Rule::new(
        save,
        (op, a.dims(), b.dims()),
        |saved, (op, sa, sb), g, wanted| {
            let (da, db) = match op {
                BinaryOp::Add => (
                    want(wanted[0], || Ok(g.clone()))?,
                    want(wanted[1], || Ok(g.clone()))?,
                ),
                BinaryOp::Sub => (
                    want(wanted[0], || Ok(g.clone()))?,
                    want(wanted[1], || g.neg())?,
                ),
                BinaryOp::Mul => (
                    want(wanted[0], || g.mul(&saved.input(1)?))?,
                    want(wanted[1], || g.mul(&saved.input(0)?))?,
                ),
                BinaryOp::Div => {
                    let b = saved.input(1)?;
                    (
                        want(wanted[0], || g.div(&b))?,
                        want(wanted[1], || {
                            g.mul(&saved.input(0)?)?.div(&b.mul(&b)?)?.neg()
                        })?,
                    )
                }
                // r = a where y > 0: piecewise linear in y, so no gradient reaches y.
                BinaryOp::ReluBackward => {
                    (want(wanted[0], || g.relu_backward(&saved.input(1)?))?, None)
                }
                // r = a (1 - y²): dr/da = 1 - y², dr/dy = -2ay
                BinaryOp::TanhBackward => {
                    let y = saved.input(1)?;
                    (
                        want(wanted[0], || g.tanh_backward(&y))?,
                        want(wanted[1], || {
                            g.mul(&saved.input(0)?)?.mul(&y)?.mul_scalar(-2.0)
                        })?,
                    )
                }
                // r = a y (1 - y): dr/da = y (1 - y), dr/dy = a (1 - 2y)
                BinaryOp::SigmoidBackward => {
                    let y = saved.input(1)?;
                    (
                        want(wanted[0], || g.sigmoid_backward(&y))?,
                        want(wanted[1], || {
                            g.mul(&saved.input(0)?)?
                                .mul(&y.mul_scalar(-2.0)?.add_scalar(1.0)?)
                        })?,
                    )
                }
                // r = a h(x): dr/da = h(x) (the same fused kernel), dr/dx = a h'(x)
                BinaryOp::SiluBackward | BinaryOp::GeluBackward | BinaryOp::GeluTanhBackward => {
                    use activation as act;
                    let x = saved.input(1)?;
                    let da = want(wanted[0], || match op {
                        BinaryOp::SiluBackward => g.silu_backward(&x),
                        BinaryOp::GeluBackward => g.gelu_backward(&x),
                        _ => g.gelu_tanh_backward(&x),
                    })?;
                    let db = want(wanted[1], || {
                        let curvature = match op {
                            BinaryOp::SiluBackward => act::silu_curvature(&x)?,
                            BinaryOp::GeluBackward => act::gelu_erf_curvature(&x)?,
                            _ => act::gelu_tanh_curvature(&x)?,
                        };
                        g.mul(&saved.input(0)?)?.mul(&curvature)
                    })?;
                    (da, db)
                }
                // The larger (smaller) input takes the gradient; a tie splits it in halves.
                BinaryOp::Maximum | BinaryOp::Minimum => {
                    let (a, b) = (saved.input(0)?, saved.input(1)?);
                    let (wa, wb) = if *op == BinaryOp::Maximum {
                        (a.max_share(&b)?, b.max_share(&a)?)
                    } else {
                        (b.max_share(&a)?, a.max_share(&b)?)
                    };
                    (
                        want(wanted[0], || g.mul(&wa))?,
                        want(wanted[1], || g.mul(&wb))?,
                    )
                }
                BinaryOp::MaxShare => (None, None),
            };
            Ok(smallvec![reduced(da, sa)?, reduced(db, sb)?])
        },
    )
}

/// `y = f(x)` elementwise.
pub(crate) fn unary(op: UnaryOp) -> Rule<UnaryOp> {
    let save = match op {
        UnaryOp::Exp | UnaryOp::Tanh | UnaryOp::Sigmoid | UnaryOp::Sqrt | UnaryOp::Relu => {
            Save::OUTPUT
        }
        UnaryOp::Log | UnaryOp::Abs | UnaryOp::PowScalar(_) => Save::input(0),
        UnaryOp::Sin
        | UnaryOp::Cos
        | UnaryOp::Silu
        | UnaryOp::Gelu
        | UnaryOp::GeluTanh
        | UnaryOp::ClampMin(_)
        | UnaryOp::ClampMax(_) => Save::input(0),
        UnaryOp::StepGe(_) | UnaryOp::StepLe(_) => Save::NOTHING,
        UnaryOp::Neg | UnaryOp::Step | UnaryOp::AddScalar(_) | UnaryOp::MulScalar(_) => {
            Save::NOTHING
        }
    };
    Rule::new(save, op, |saved, op, g, _| {
        let dx = match *op {
            UnaryOp::Neg => g.neg()?,                 // d(-x) = -1
            UnaryOp::Exp => g.mul(&saved.output()?)?, // d eˣ = eˣ
            UnaryOp::Log => g.div(&saved.input(0)?)?, // d ln x = 1/x
            // These three run fused kernels (one pass, no temporaries), ops with rules of
            // their own, so their second derivatives still flow.
            UnaryOp::Relu => g.relu_backward(&saved.output()?)?, // 1 where y = relu(x) > 0
            UnaryOp::Tanh => g.tanh_backward(&saved.output()?)?, // 1 - tanh²
            UnaryOp::Sigmoid => g.sigmoid_backward(&saved.output()?)?, // σ(1 - σ)
            UnaryOp::Sqrt => g.div(&saved.output()?.mul_scalar(2.0)?)?, // 1 / (2√x)
            UnaryOp::Abs => {
                let x = saved.input(0)?; // sign(x)
                g.mul(&x.step()?.sub(&x.neg()?.step()?)?)?
            }
            UnaryOp::Step => g.zeros_like()?,
            UnaryOp::AddScalar(_) => g.clone(),
            UnaryOp::MulScalar(c) => g.mul_scalar(c)?,
            UnaryOp::PowScalar(p) => g.mul(&saved.input(0)?.powf(p - 1.0)?.mul_scalar(p)?)?, // p xᵖ⁻¹
            UnaryOp::Sin => g.mul(&saved.input(0)?.cos()?)?, // cos x
            UnaryOp::Cos => g.mul(&saved.input(0)?.sin()?.neg()?)?, // -sin x
            // Fused kernels from the input, ops with rules of their own (second derivatives).
            UnaryOp::Silu => g.silu_backward(&saved.input(0)?)?,
            UnaryOp::Gelu => g.gelu_backward(&saved.input(0)?)?,
            UnaryOp::GeluTanh => g.gelu_tanh_backward(&saved.input(0)?)?,
            // 1 inside the bound (the bound itself included), 0 outside.
            UnaryOp::ClampMin(c) => g.mul(&saved.input(0)?.unary(UnaryOp::StepGe(c))?)?,
            UnaryOp::ClampMax(c) => g.mul(&saved.input(0)?.unary(UnaryOp::StepLe(c))?)?,
            UnaryOp::StepGe(_) | UnaryOp::StepLe(_) => g.zeros_like()?,
        };
        Ok(smallvec![Some(dx)])
    })
}

/// Sum of everything: every element gets the (scalar) gradient, as a broadcast view (no copy:
/// the ops that consume it read stride-0 views, and a leaf's `.grad` densifies it).
pub(crate) fn sum_all(x: &Tensor) -> Rule<Shape> {
    Rule::new(Save::NOTHING, x.dims(), |_, shape, g, _| {
        Ok(smallvec![Some(g.broadcast_to(shape)?)])
    })
}

/// Sum along `axis` (removed from the output): the gradient repeats along it, as a view.
pub(crate) fn sum_axis(x: &Tensor, axis: usize) -> Rule<(Shape, usize)> {
    Rule::new(Save::NOTHING, (x.dims(), axis), |_, (shape, axis), g, _| {
        Ok(smallvec![Some(
            g.unsqueeze(*axis as isize)?.broadcast_to(shape)?
        )])
    })
}

/// Broadcasting: what was repeated sums back.
pub(crate) fn broadcast(x: &Tensor) -> Rule<Shape> {
    Rule::new(Save::NOTHING, x.dims(), |_, shape, g, _| {
        Ok(smallvec![Some(g.sum_to(shape)?)])
    })
}

/// Max along an axis: the gradient goes to the (first) maximal element only, found from the
/// indices the forward kept (one `i64` per output element, not the whole input).
pub(crate) fn max_axis(x: &Tensor, axis: usize, index: Tensor) -> Rule<(usize, usize)> {
    let len = x.shape()[axis];
    Rule::new(Save::NOTHING, (axis, len), |saved, &(axis, len), g, _| {
        // one_hot puts classes last; move that axis to where it was reduced.
        let mut mask = Tensor::one_hot(&saved.aux()?, len, g.dtype())?;
        let last = mask.ndim() - 1;
        for to in (axis..last).rev() {
            mask = mask.transpose(to as isize + 1, to as isize)?;
        }
        Ok(smallvec![Some(g.unsqueeze(axis as isize)?.mul(&mask)?)])
    })
    .with_aux(index)
}

/// `a · b`: da = g · bᵀ needs b, db = aᵀ · g needs a; summed over broadcast batch dimensions.
pub(crate) fn matmul(a: &Tensor, b: &Tensor) -> Rule<(Shape, Shape)> {
    let save = Save::input_if(1, a.requires_grad()).and(Save::input_if(0, b.requires_grad()));
    Rule::new(save, (a.dims(), b.dims()), |saved, (sa, sb), g, wanted| {
        let da = want(wanted[0], || g.matmul(&saved.input(1)?.t()?)?.sum_to(sa))?;
        let db = want(wanted[1], || saved.input(0)?.t()?.matmul(g)?.sum_to(sb))?;
        Ok(smallvec![da, db])
    })
}

/// `x · Wᵀ + b`, then ReLU when `relu` (one node): the gradient goes through ReLU's mask (from
/// the saved output), then `dx = g · W`, `dW = gᵀ · x`, `db = Σ_rows g`, over the input's rows.
pub(crate) fn linear(x: &Tensor, w: &Tensor, b: &Tensor, relu: bool) -> Rule<(Shape, bool)> {
    let save = Save::input_if(1, x.requires_grad())
        .and(Save::input_if(0, w.requires_grad()))
        .and(if relu { Save::OUTPUT } else { Save::NOTHING });
    let _ = b;
    Rule::new(save, (x.dims(), relu), |saved, (shape, relu), g, wanted| {
        let out_features = g.shape()[g.ndim() - 1];
        let rows = g.numel() / out_features.max(1);
        let g = if *relu {
            g.relu_backward(&saved.output()?)?
        } else {
            g.clone()
        };
        let g = g.reshape(&[rows, out_features])?;
        let dx = want(wanted[0], || g.matmul(&saved.input(1)?)?.reshape(shape))?;
        let dw = want(wanted[1], || {
            let x = saved.input(0)?;
            let in_features = x.shape()[x.ndim() - 1];
            g.t()?.matmul(&x.reshape(&[rows, in_features])?)
        })?;
        let db = want(wanted[2], || g.sum_axis(0, false))?;
        Ok(smallvec![dx, dw, db])
    })
}

/// Swapping axes back.
pub(crate) fn transpose(a: usize, b: usize) -> Rule<(usize, usize)> {
    Rule::new(Save::NOTHING, (a, b), |_, &(a, b), g, _| {
        Ok(smallvec![Some(g.transpose(a as isize, b as isize)?)])
    })
}

/// Viewing the gradient in the input's shape.
pub(crate) fn reshape(x: &Tensor) -> Rule<Shape> {
    Rule::new(Save::NOTHING, x.dims(), |_, shape, g, _| {
        Ok(smallvec![Some(g.reshape(shape)?)])
    })
}

/// A copy: the gradient passes through unchanged.
pub(crate) fn identity() -> Rule<()> {
    Rule::new(Save::NOTHING, (), |_, _, g, _| {
        Ok(smallvec![Some(g.clone())])
    })
}

/// A narrowed view: the gradient, padded with zeros where the view did not reach.
pub(crate) fn narrow(x: &Tensor, axis: usize, start: usize) -> Rule<(Shape, usize, usize)> {
    Rule::new(
        Save::NOTHING,
        (x.dims(), axis, start),
        |saved, (shape, axis, start), g, _| {
            let (axis, start) = (*axis, *start);
            let len = g.shape()[axis];
            if !g.requires_grad() {
                // Another view of the same input got there first (the heads split out of a
                // fused projection, a chunk): add into its gradient's slice in place, instead of
                // a full buffer of this view's own that the engine would add whole.
                let added = saved.with_accumulated(0, |acc| -> Result<bool> {
                    let fits = |a: &&mut Tensor| {
                        a.shape() == &shape[..]
                            && a.dtype() == g.dtype()
                            && a.device() == g.device()
                    };
                    let Some(acc) = acc.filter(fits) else {
                        return Ok(false);
                    };
                    let slice = acc.narrow(axis as isize, start, len)?;
                    slice.assign(&slice.add(g)?)?;
                    Ok(true)
                })?;
                if added {
                    return Ok(smallvec![None]);
                }
                // One fill and one copy of the slice, instead of two pads and a copy of all of
                // it through `cat` (which only a gradient with history of its own needs).
                let full = Tensor::zeros(shape, g.dtype(), g.device())?;
                full.narrow(axis as isize, start, len)?.assign(g)?;
                return Ok(smallvec![Some(full)]);
            }
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
        },
    )
}

/// Concatenation: each input gets its slice of the gradient.
pub(crate) fn cat(parts: &[&Tensor], axis: usize) -> Rule<(Vec<usize>, usize)> {
    let sizes: Vec<usize> = parts.iter().map(|p| p.shape()[axis]).collect();
    Rule::new(
        Save::NOTHING,
        (sizes, axis),
        |_, (sizes, axis), g, wanted| {
            let mut start = 0;
            let mut grads = InputGrads::new();
            for (&size, &w) in sizes.iter().zip(wanted) {
                grads.push(want(w, || {
                    g.narrow(*axis as isize, start, size)?.contiguous()
                })?);
                start += size;
            }
            Ok(grads)
        },
    )
}

/// A dtype conversion: the gradient converts back.
pub(crate) fn cast(from: DType) -> Rule<DType> {
    Rule::new(Save::NOTHING, from, |_, &from, g, _| {
        Ok(smallvec![Some(g.to_dtype(from)?)])
    })
}

/// Softmax over the last axis, from its output y: dx = y ⊙ (g − Σ g⊙y).
/// Log-softmax, from its output y: dx = g − eʸ ⊙ Σ g.
pub(crate) fn softmax(log: bool) -> Rule<bool> {
    Rule::new(Save::OUTPUT, log, |saved, &log, g, _| {
        let y = saved.output()?;
        // One fused kernel where the device has one; composed (and so differentiable) otherwise.
        if !ferry_graph::is_grad_enabled()
            && let Some(dx) = crate::backend::softmax_backward(&y, g, log)?
        {
            return Ok(smallvec![Some(dx)]);
        }
        let dx = if log {
            g.sub(&y.exp()?.mul(&g.sum_axis(-1, true)?)?)?
        } else {
            y.mul(&g.sub(&g.mul(&y)?.sum_axis(-1, true)?)?)?
        };
        Ok(smallvec![Some(dx)])
    })
}

/// The rotary embedding: the gradient is the transposed rotation of `g` by the same tables,
/// one kernel where the device has one (composed, and so differentiable, otherwise). Keeps the
/// tables alone.
pub(crate) fn rotary() -> Rule<()> {
    Rule::new(Save::input(1).and(Save::input(2)), (), |saved, _, g, _| {
        let (cos, sin) = (saved.input(1)?, saved.input(2)?);
        let fused = match ferry_graph::is_grad_enabled() {
            true => None,
            false => crate::backend::rotary(g, &cos, &sin, true)?,
        };
        let dx = match fused {
            Some(dx) => dx,
            None => rotary_composed(g, &cos, &sin, true)?,
        };
        Ok(smallvec![Some(dx), None, None])
    })
}

/// [`Tensor::rotary_embedding`] (with `inverse`, its transpose: `x * cos + [(x * sin)2,
/// -(x * sin)1]`, the gradient's map) from recorded ops: the CPU's path, and the one that
/// differentiates with respect to the tables or twice.
pub(crate) fn rotary_composed(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    inverse: bool,
) -> Result<Tensor> {
    let half = x.shape()[x.ndim() - 1] / 2;
    let halves = |t: &Tensor| -> Result<(Tensor, Tensor)> {
        Ok((t.narrow(-1, 0, half)?, t.narrow(-1, half, half)?))
    };
    let turned = match inverse {
        false => {
            let (x1, x2) = halves(x)?;
            Tensor::cat(&[&x2.neg()?, &x1], -1)?.mul(sin)?
        }
        true => {
            let (s1, s2) = halves(&x.mul(sin)?)?;
            Tensor::cat(&[&s2, &s1.neg()?], -1)?
        }
    };
    x.mul(cos)?.add(&turned)
}

/// `-mean(logp[i, targets[i]])`: the gradient is `-g / n` at each row's target, zero elsewhere.
/// Keeps the targets (one `i64` per row), not a one-hot matrix.
pub(crate) fn nll(logp: &Tensor, targets: &Tensor) -> Rule<usize> {
    Rule::new(Save::NOTHING, logp.shape()[1], |saved, &classes, g, _| {
        let targets = saved.aux()?;
        // One fused kernel where the device has one; composed from recorded ops for a gradient
        // of the gradient.
        if !ferry_graph::is_grad_enabled()
            && let Some(dx) = crate::backend::nll_backward(&targets, g, classes)?
        {
            return Ok(smallvec![Some(dx)]);
        }
        let one_hot = Tensor::one_hot(&targets, classes, g.dtype())?;
        let scale = g.div_scalar(-(targets.numel() as f64))?;
        Ok(smallvec![Some(one_hot.mul(&scale)?)])
    })
    .with_aux(targets.clone())
}

/// Permuting axes: the gradient is permuted back by the inverse order.
pub(crate) fn permute(order: &[usize]) -> Rule<Vec<usize>> {
    let mut inverse = vec![0; order.len()];
    for (i, &d) in order.iter().enumerate() {
        inverse[d] = i;
    }
    Rule::new(Save::NOTHING, inverse, |_, inverse, g, _| {
        let dims: Vec<isize> = inverse.iter().map(|&d| d as isize).collect();
        Ok(smallvec![Some(g.permute(&dims)?)])
    })
}

/// `where_cond(cond, a, b)`: each value input gets the gradient where it was chosen, 0
/// elsewhere, summed back to its shape. Keeps `cond` (one byte per element), not the values.
pub(crate) fn where_cond(cond: &Tensor, a: &Tensor, b: &Tensor) -> Rule<(Shape, Shape)> {
    Rule::new(
        Save::NOTHING,
        (a.dims(), b.dims()),
        |saved, (sa, sb), g, wanted| {
            let cond = saved.aux()?;
            let zero = Tensor::zeros(&[], g.dtype(), g.device())?;
            let da = want(wanted[0], || Tensor::where_cond(&cond, g, &zero))?;
            let db = want(wanted[1], || Tensor::where_cond(&cond, &zero, g))?;
            Ok(smallvec![reduced(da, sa)?, reduced(db, sb)?])
        },
    )
    .with_aux(cond.clone())
}

/// Dropout (and its backward, the same linear map): the gradient is scaled where the mask
/// kept the element and 0 elsewhere. Keeps only the mask, one `u8` per element.
pub(crate) fn dropout(mask: Tensor, scale: f64) -> Rule<f64> {
    Rule::new(Save::NOTHING, scale, |saved, &scale, g, _| {
        Ok(smallvec![Some(g.masked_scale(&saved.aux()?, scale)?)])
    })
    .with_aux(mask)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Device;

    /// The inverse map is the rotation's transpose (what its gradient needs): `<rot(x), g> ==
    /// <x, rot_inv(g)>` for any x and g, the tables broadcast as the Llama's are.
    #[test]
    fn the_inverse_rotation_is_the_transpose() -> Result<()> {
        let shape = [2, 5, 3, 8];
        let x = Tensor::randn(&shape, DType::F64, Device::Cpu)?;
        let g = Tensor::randn(&shape, DType::F64, Device::Cpu)?;
        let cos = Tensor::randn(&[5, 1, 8], DType::F64, Device::Cpu)?;
        let sin = Tensor::randn(&[5, 1, 8], DType::F64, Device::Cpu)?;
        let forward = rotary_composed(&x, &cos, &sin, false)?.mul(&g)?.sum()?;
        let back = x.mul(&rotary_composed(&g, &cos, &sin, true)?)?.sum()?;
        let (a, b) = (forward.item()?, back.item()?);
        assert!((a - b).abs() <= 1e-12 * a.abs().max(1.0), "{a} vs {b}");
        Ok(())
    }
}
