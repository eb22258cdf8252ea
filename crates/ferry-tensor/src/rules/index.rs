//! The index ops' rules: each is the matching op of the family (a read's gradient accumulates,
//! an accumulation's gradient reads), keeping the index tensor alone as its auxiliary tensor, so
//! higher-order gradients flow through the same ops.

use ferry_graph::InputGrads;
use smallvec::smallvec;

use crate::autograd::{Rule, Save, Saved};
use crate::layout::Shape;
use crate::{Result, Tensor};

/// `index_select` of `x` along `axis` by `index`.
pub(crate) fn index_select(x: &Tensor, axis: usize, index: Tensor) -> Rule<(Shape, usize)> {
    Rule::new(Save::NOTHING, (x.dims(), axis), index_select_backward).with_aux(index)
}

/// `index_add` along `axis` by `index`.
pub(crate) fn index_add(axis: usize, index: Tensor) -> Rule<usize> {
    Rule::new(Save::NOTHING, axis, index_add_backward).with_aux(index)
}

/// `gather` of `x` along `axis` by `index`.
pub(crate) fn gather(x: &Tensor, axis: usize, index: Tensor) -> Rule<(Shape, usize)> {
    Rule::new(Save::NOTHING, (x.dims(), axis), gather_backward).with_aux(index)
}

/// `scatter_add` along `axis` by `index`.
pub(crate) fn scatter_add(axis: usize, index: Tensor) -> Rule<usize> {
    Rule::new(Save::NOTHING, axis, scatter_add_backward).with_aux(index)
}

/// `index_select`'s gradient: the output's gradient added into zeros at the selected entries.
fn index_select_backward(
    saved: &Saved<'_>,
    (shape, axis): &(Shape, usize),
    g: &Tensor,
    _: &[bool],
) -> Result<InputGrads<Tensor>> {
    let zeros = Tensor::zeros(shape, g.dtype(), g.device())?;
    Ok(smallvec![Some(zeros.index_add(
        *axis as isize,
        &saved.aux()?,
        g
    )?)])
}

/// `index_add`'s gradient: `self` gets `g`; `src` reads `g` back at the indexed entries.
fn index_add_backward(
    saved: &Saved<'_>,
    &axis: &usize,
    g: &Tensor,
    wanted: &[bool],
) -> Result<InputGrads<Tensor>> {
    let dsrc = if wanted[1] {
        Some(g.index_select(axis as isize, &saved.aux()?)?)
    } else {
        None
    };
    Ok(smallvec![wanted[0].then(|| g.clone()), dsrc])
}

/// `gather`'s gradient: the output's gradient scatter-added into zeros.
fn gather_backward(
    saved: &Saved<'_>,
    (shape, axis): &(Shape, usize),
    g: &Tensor,
    _: &[bool],
) -> Result<InputGrads<Tensor>> {
    let zeros = Tensor::zeros(shape, g.dtype(), g.device())?;
    Ok(smallvec![Some(zeros.scatter_add(
        *axis as isize,
        &saved.aux()?,
        g
    )?)])
}

/// `scatter_add`'s gradient: `self` gets `g`; `src` gathers `g` back by the index.
fn scatter_add_backward(
    saved: &Saved<'_>,
    &axis: &usize,
    g: &Tensor,
    wanted: &[bool],
) -> Result<InputGrads<Tensor>> {
    let dsrc = if wanted[1] {
        Some(g.gather(axis as isize, &saved.aux()?)?)
    } else {
        None
    };
    Ok(smallvec![wanted[0].then(|| g.clone()), dsrc])
}
