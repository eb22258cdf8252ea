//! Layer norm's and RMSNorm's rules: the fused backward kernels from the saved input, weight and
//! statistics, or, under `create_graph`, the same gradients composed from differentiable ops.

use ferry_graph::InputGrads;

use crate::autograd::{Rule, Save, Saved, should_record};
use crate::{Result, Tensor, backend};

/// layer_norm with `eps`, whether it has a weight and a bias, keeping `stats` (`[rows, 2]`).
pub(crate) fn layer_norm(
    save: Save,
    eps: f64,
    affine: (bool, bool),
    stats: Tensor,
) -> Rule<(f64, (bool, bool))> {
    Rule::new(save, (eps, affine), layer_norm_backward).with_aux(stats)
}

/// The gradients of layer_norm's inputs, in their order (x, then weight and bias if present).
fn layer_norm_backward(
    saved: &Saved<'_>,
    &(eps, (has_w, has_b)): &(f64, (bool, bool)),
    g: &Tensor,
    wanted: &[bool],
) -> Result<InputGrads<Tensor>> {
    let want_dx = wanted[0];
    let want_dw = has_w && wanted[1];
    let want_db = has_b && wanted[1 + has_w as usize];
    let x = if want_dx || want_dw {
        Some(saved.input(0)?)
    } else {
        None
    };
    let w = if has_w && want_dx {
        Some(saved.input(1)?)
    } else {
        None
    };
    let mut parts = vec![g];
    parts.extend(x.as_ref());
    parts.extend(w.as_ref());
    let (dx, dw, db) = if should_record(&parts) {
        // create_graph: differentiable ops, recomputing the statistics from x.
        composed_backward(g, x.as_ref(), w.as_ref(), eps, want_dx, want_dw, want_db)?
    } else if let Some(x) = &x {
        let stats = saved.aux()?;
        let want = [want_dx, want_dw, want_db];
        backend::layer_norm_backward(g, x, w.as_ref(), &stats, want)?
    } else {
        // Only the bias wants a gradient: a column sum of g.
        (
            None,
            None,
            want_db.then(|| g.sum_axis(0, false)).transpose()?,
        )
    };
    let mut grads = InputGrads::new();
    grads.push(dx);
    if has_w {
        grads.push(dw);
    }
    if has_b {
        grads.push(db);
    }
    Ok(grads)
}

type Grads = (Option<Tensor>, Option<Tensor>, Option<Tensor>);

/// The same gradients as the fused kernels, from tensor ops (recorded under `create_graph`).
fn composed_backward(
    g: &Tensor,
    x: Option<&Tensor>,
    w: Option<&Tensor>,
    eps: f64,
    want_dx: bool,
    want_dw: bool,
    want_db: bool,
) -> Result<Grads> {
    let db = if want_db {
        Some(g.sum_axis(0, false)?)
    } else {
        None
    };
    let Some(x) = x else {
        return Ok((None, None, db));
    };
    let cols = x.shape()[1] as f64;
    let xc = x.sub(&x.mean_axis(-1, true)?)?;
    let var = xc.mul(&xc)?.sum_axis(-1, true)?.div_scalar(cols)?;
    let rstd = var.add_scalar(eps)?.powf(-0.5)?;
    let xhat = xc.mul(&rstd)?;
    let dw = if want_dw {
        Some(g.mul(&xhat)?.sum_axis(0, false)?)
    } else {
        None
    };
    let dx = if want_dx {
        let gw = match w {
            Some(w) => g.mul(w)?,
            None => g.clone(),
        };
        let m1 = gw.mean_axis(-1, true)?;
        let m2 = gw.mul(&xhat)?.mean_axis(-1, true)?;
        Some(rstd.mul(&gw.sub(&m1)?.sub(&xhat.mul(&m2)?)?)?)
    } else {
        None
    };
    Ok((dx, dw, db))
}

/// rms_norm with `eps`, whether it has a weight, keeping `rstd` (`[rows]`).
pub(crate) fn rms_norm(save: Save, eps: f64, has_w: bool, rstd: Tensor) -> Rule<(f64, bool)> {
    Rule::new(save, (eps, has_w), rms_norm_backward).with_aux(rstd)
}

/// The gradients of rms_norm's inputs, in their order (x, then the weight if present).
fn rms_norm_backward(
    saved: &Saved<'_>,
    &(eps, has_w): &(f64, bool),
    g: &Tensor,
    wanted: &[bool],
) -> Result<InputGrads<Tensor>> {
    let want = [wanted[0], has_w && wanted[1]];
    let x = saved.input(0)?;
    let w = if has_w && want[0] {
        Some(saved.input(1)?)
    } else {
        None
    };
    let mut parts = vec![g, &x];
    parts.extend(w.as_ref());
    let (dx, dw) = if should_record(&parts) {
        // create_graph: differentiable ops, recomputing the inverse root mean square from x.
        let rstd = x
            .mul(&x)?
            .mean_axis(-1, true)?
            .add_scalar(eps)?
            .powf(-0.5)?;
        let xhat = x.mul(&rstd)?;
        let dw = if want[1] {
            Some(g.mul(&xhat)?.sum_axis(0, false)?)
        } else {
            None
        };
        let dx = if want[0] {
            let gw = match &w {
                Some(w) => g.mul(w)?,
                None => g.clone(),
            };
            let m = gw.mul(&xhat)?.mean_axis(-1, true)?;
            Some(rstd.mul(&gw.sub(&xhat.mul(&m)?)?)?)
        } else {
            None
        };
        (dx, dw)
    } else {
        backend::rms_norm_backward(g, &x, w.as_ref(), &saved.aux()?, want)?
    };
    let mut grads = InputGrads::new();
    grads.push(dx);
    if has_w {
        grads.push(dw);
    }
    Ok(grads)
}
