//! The index ops' rules: each is the matching op of the family (a read's gradient accumulates,
//! an accumulation's gradient reads), keeping the index tensor alone as its auxiliary tensor, so
//! higher-order gradients flow through the same ops.

use ferry_graph::InputGrads;
use smallvec::smallvec;

use crate::autograd::{Rule, Save, Saved};
use crate::layout::Shape;
use crate::{Result, Tensor};

/// `index_select` of `x` along `axis` by `index`.
pub(crate) fn index_select(x: &Tensor, axis: usize, index: Tensor) -> Rule<(bool, (Shape, usize))> {
    Rule::new(Save::NOTHING, (SELECT, (x.dims(), axis)), read_backward).with_aux(index)
}

/// `index_add` along `axis` by `index`.
pub(crate) fn index_add(axis: usize, index: Tensor) -> Rule<(bool, usize)> {
    Rule::new(Save::NOTHING, (SELECT, axis), accumulate_backward).with_aux(index)
}

/// `gather` of `x` along `axis` by `index`.
pub(crate) fn gather(x: &Tensor, axis: usize, index: Tensor) -> Rule<(bool, (Shape, usize))> {
    Rule::new(Save::NOTHING, (GATHER, (x.dims(), axis)), read_backward).with_aux(index)
}

/// `scatter_add` along `axis` by `index`.
pub(crate) fn scatter_add(axis: usize, index: Tensor) -> Rule<(bool, usize)> {
    Rule::new(Save::NOTHING, (GATHER, axis), accumulate_backward).with_aux(index)
}

/// The pair a rule belongs to, as its state keeps it: index_select and index_add, whose index
/// names whole entries along the axis, or gather and scatter_add, whose index has the shape of
/// what is read. In each pair one op is the other's gradient.
const SELECT: bool = false;
const GATHER: bool = true;

/// A read's gradient (index_select's, gather's): the output's gradient accumulated into zeros
/// at the entries read, by the pair's accumulation.
fn read_backward(
    saved: &Saved<'_>,
    (pair, (shape, axis)): &(bool, (Shape, usize)),
    g: &Tensor,
    _: &[bool],
) -> Result<InputGrads<Tensor>> {
    let (axis, index) = (*axis as isize, saved.aux()?);
    let zeros = Tensor::zeros(shape, g.dtype(), g.device())?;
    let grad = if *pair == GATHER {
        zeros.scatter_add(axis, &index, g)?
    } else {
        zeros.index_add(axis, &index, g)?
    };
    Ok(smallvec![Some(grad)])
}

/// An accumulation's gradient (index_add's, scatter_add's): `self` gets `g`; `src` reads `g`
/// back at the indexed entries, by the pair's read.
fn accumulate_backward(
    saved: &Saved<'_>,
    &(pair, axis): &(bool, usize),
    g: &Tensor,
    wanted: &[bool],
) -> Result<InputGrads<Tensor>> {
    let dsrc = if wanted[1] {
        let (axis, index) = (axis as isize, saved.aux()?);
        Some(if pair == GATHER {
            g.gather(axis, &index)?
        } else {
            g.index_select(axis, &index)?
        })
    } else {
        None
    };
    Ok(smallvec![wanted[0].then(|| g.clone()), dsrc])
}
