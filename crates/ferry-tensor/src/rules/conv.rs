//! Convolution's rules: conv2d's (cuDNN's backward passes, or im2col / col2im and products,
//! which are differentiable, under `create_graph`), and im2col and col2im, each the other's
//! gradient.

use ferry_cuda::ConvPass;
use ferry_graph::InputGrads;
use smallvec::smallvec;

use crate::autograd::{Rule, Save, Saved};
use crate::op::conv::Geometry;
use crate::{Result, Tensor, backend};

/// conv2d over `geo` in `groups`, with or without a bias; `save` names the inputs kept.
pub(crate) fn conv2d(
    save: Save,
    geo: &Geometry,
    groups: usize,
    has_bias: bool,
) -> Rule<(Vec<usize>, (usize, bool))> {
    Rule::new(save, (geo.to_vec(), (groups, has_bias)), conv2d_backward)
}

/// im2col over `geo`: its gradient folds the columns back (col2im).
pub(crate) fn im2col(geo: &Geometry) -> Rule<Vec<usize>> {
    Rule::new(Save::NOTHING, geo.to_vec(), |_, geo, g, _| {
        Ok(smallvec![Some(g.col2im(&Geometry::from_slice(geo))?)])
    })
}

/// col2im over `geo`: its gradient unfolds again (im2col).
pub(crate) fn col2im(geo: &Geometry) -> Rule<Vec<usize>> {
    Rule::new(Save::NOTHING, geo.to_vec(), |_, geo, g, _| {
        Ok(smallvec![Some(g.im2col(&Geometry::from_slice(geo))?)])
    })
}

/// The gradients of conv2d's input, weight and (when present) bias.
fn conv2d_backward(
    saved: &Saved<'_>,
    (geo, (groups, has_bias)): &(Vec<usize>, (usize, bool)),
    g: &Tensor,
    wanted: &[bool],
) -> Result<InputGrads<Tensor>> {
    let geo = Geometry::from_slice(geo);
    let groups = *groups;
    let cgk = geo.c / groups * geo.k();
    let o = g.shape()[1];
    // A native pass where the device has one; its passes are not differentiable ops, so with
    // create_graph the composed path runs.
    let native = |pass, first: &Tensor, second: &Tensor| -> Result<Option<Tensor>> {
        if ferry_graph::is_grad_enabled() {
            return Ok(None);
        }
        backend::convolution(pass, &geo, groups, o, first, second)
    };
    // g as [N, G, O/G, L]
    let gg = g.reshape(&[geo.n, groups, o / groups, geo.l()])?;
    let dx = if wanted[0] {
        let w = saved.input(1)?;
        match native(ConvPass::BackwardData, g, &w)? {
            Some(dx) => Some(dx),
            None => {
                let w = w.reshape(&[groups, o / groups, cgk])?;
                let dcols = w
                    .t()?
                    .matmul(&gg)?
                    .reshape(&[geo.n, geo.c * geo.k(), geo.l()])?;
                Some(dcols.col2im(&geo)?)
            }
        }
    } else {
        None
    };
    let dw = if wanted[1] {
        let x = saved.input(0)?;
        match native(ConvPass::BackwardFilter, &x, g)? {
            Some(dw) => Some(dw),
            None => {
                let cols = x.im2col(&geo)?.reshape(&[geo.n, groups, cgk, geo.l()])?;
                let per_image = gg.matmul(&cols.t()?)?; // [N, G, O/G, CgK]
                let cg = geo.c / groups;
                Some(
                    per_image
                        .sum_axis(0, false)?
                        .reshape(&[o, cg, geo.kh, geo.kw])?,
                )
            }
        }
    } else {
        None
    };
    let mut grads: InputGrads<Tensor> = smallvec![dx, dw];
    if *has_bias {
        let db = if wanted[2] {
            let per_channel = g.reshape(&[geo.n, o, geo.l()])?.sum_axis(2, false)?;
            Some(per_channel.sum_axis(0, false)?)
        } else {
            None
        };
        grads.push(db);
    }
    Ok(grads)
}
