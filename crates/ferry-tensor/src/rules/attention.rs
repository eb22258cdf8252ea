//! Attention's rule: the device's fused backward from the saved `q`, `k`, `v`, output and
//! log-sum-exp, or the same gradients composed from tensor ops (where the device has no fused
//! kernel, and under `create_graph`, so second derivatives flow). The composed forward lives
//! here too, beside the backward that recomputes its weights.

use ferry_graph::InputGrads;

use crate::autograd::{Rule, Save, Saved, should_record};
use crate::op::attention::Attend;
use crate::{DType, Result, Tensor, backend};

/// Attention `how`, keeping q, k, v (inputs 0 to 2), the output and the log-sum-exp `lse`.
pub(crate) fn attention(how: Attend, lse: Tensor) -> Rule<Attend> {
    let save = Save::input(0)
        .and(Save::input(1))
        .and(Save::input(2))
        .and(Save::OUTPUT);
    Rule::new(save, how, attention_backward).with_aux(lse)
}

fn attention_backward(
    saved: &Saved<'_>,
    how: &Attend,
    g: &Tensor,
    wanted: &[bool],
) -> Result<InputGrads<Tensor>> {
    let (q, k, v) = (saved.input(0)?, saved.input(1)?, saved.input(2)?);
    let (out, lse) = (saved.output()?, saved.aux()?);
    let fused = match should_record(&[g, &q, &k, &v]) {
        true => None,
        false => backend::attention_backward([&q, &k, &v], &out, g, &lse, how)?,
    };
    let grads = match fused {
        Some(grads) => grads,
        None => composed_backward([&q, &k, &v], &out, g, &lse, how)?,
    };
    let mut result = InputGrads::new();
    for (want, grad) in wanted.iter().zip(grads) {
        result.push(want.then_some(grad));
    }
    Ok(result)
}

/// Each key/value head of `x` (`[B, kv_heads, S, d]`) repeated for the `group` query heads it
/// serves: `[B, kv_heads × group, S, d]`.
fn repeat_heads(x: &Tensor, group: usize) -> Result<Tensor> {
    if group == 1 {
        return Ok(x.clone());
    }
    let s = x.shape();
    let (b, n, len, d) = (s[0], s[1], s[2], s[3]);
    x.unsqueeze(2)?
        .broadcast_to(&[b, n, group, len, d])?
        .reshape(&[b, n * group, len, d])
}

/// `x` (`[B, kv_heads × group, S, d]`) summed over each key/value head's group.
fn sum_groups(x: &Tensor, how: &Attend) -> Result<Tensor> {
    let d = how.dims;
    if d.group() == 1 {
        return Ok(x.clone());
    }
    let s = x.shape();
    x.reshape(&[s[0], d.kv_heads, d.group(), s[2], s[3]])?
        .sum_axis(2, false)
}

/// `[q_len, kv_len]`, true where query `i` may not see key `j`.
fn hidden(how: &Attend, like: &Tensor) -> Result<Tensor> {
    let d = how.dims;
    let device = like.device();
    let rows = Tensor::arange(0.0, d.q_len as f64, DType::F32, device)?
        .add_scalar((d.kv_len - d.q_len) as f64)?
        .reshape(&[d.q_len, 1])?;
    let cols = Tensor::arange(0.0, d.kv_len as f64, DType::F32, device)?.reshape(&[1, d.kv_len])?;
    cols.gt(&rows)
}

/// The factor dropout leaves on each weight (`[B, H, q_len, kv_len]`, 0 or `1 / (1 - p)`),
/// drawn from the call's seed on its device, the same in forward and backward.
fn kept(how: &Attend, like: &Tensor) -> Result<Tensor> {
    let d = how.dims;
    let shape = [d.batch, d.heads, d.q_len, d.kv_len];
    let u = backend::random(&shape, like.dtype(), like.device(), how.seed, false)?;
    u.ge(&Tensor::full(
        &[1],
        how.dropout,
        like.dtype(),
        like.device(),
    )?)?
    .to_dtype(like.dtype())?
    .mul_scalar(1.0 / (1.0 - how.dropout))
}

/// The scores `q kᵀ · scale` (`[B, H, q_len, kv_len]`) of 4-D `q` and repeated `k`.
fn scores(q: &Tensor, k: &Tensor, how: &Attend) -> Result<Tensor> {
    let k = repeat_heads(k, how.dims.group())?;
    q.matmul(&k.transpose(2, 3)?)?.mul_scalar(how.scale)
}

/// The output and log-sum-exp from matrix products and a softmax, for devices without a fused
/// kernel (the caller decides whether they record).
pub(crate) fn attention_composed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    how: &Attend,
) -> Result<(Tensor, Tensor)> {
    let mut s = scores(q, k, how)?;
    if how.causal {
        s = s.masked_fill(&hidden(how, q)?, f64::NEG_INFINITY)?;
    }
    let wide = if q.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let s = s.to_dtype(wide)?;
    let max = s.max_axis(-1, true)?;
    let lse = s.sub(&max)?.exp()?.sum_axis(-1, true)?.log()?.add(&max)?;
    let mut weights = s.sub(&lse)?.exp()?.to_dtype(q.dtype())?;
    if how.dropout > 0.0 {
        weights = weights.mul(&kept(how, q)?)?;
    }
    let out = weights.matmul(&repeat_heads(v, how.dims.group())?)?;
    Ok((out, lse.squeeze(-1)?))
}

/// The gradients of q, k and v from tensor ops: the weights recomputed from the log-sum-exp (as
/// a softmax of the scores when the gradient itself records a graph),
/// then `dv = Pᵀ g`, `ds = P (g vᵀ - rowsum(g ∘ out))`, `dq = ds k · scale`, `dk = dsᵀ q · scale`,
/// with k's and v's summed over the query heads each serves.
fn composed_backward(
    [q, k, v]: [&Tensor; 3],
    out: &Tensor,
    g: &Tensor,
    lse: &Tensor,
    how: &Attend,
) -> Result<[Tensor; 3]> {
    let group = how.dims.group();
    let s = scores(q, k, how)?;
    let p = if should_record(&[g, q, k, v]) {
        // A graph of the gradient: the weights as a function of q and k, not of the saved
        // log-sum-exp (a constant to it).
        let s = match how.causal {
            true => s.masked_fill(&hidden(how, q)?, f64::NEG_INFINITY)?,
            false => s,
        };
        s.softmax(-1)?
    } else {
        let p = s.sub(&lse.to_dtype(q.dtype())?.unsqueeze(-1)?)?.exp()?;
        match how.causal {
            true => p.masked_fill(&hidden(how, q)?, 0.0)?,
            false => p,
        }
    };
    let dropped = match how.dropout > 0.0 {
        true => Some(kept(how, q)?),
        false => None,
    };
    let pd = match &dropped {
        Some(m) => p.mul(m)?,
        None => p.clone(),
    };
    let dv = sum_groups(&pd.transpose(2, 3)?.matmul(g)?, how)?;
    let mut dp = g.matmul(&repeat_heads(v, group)?.transpose(2, 3)?)?;
    if let Some(m) = &dropped {
        dp = dp.mul(m)?;
    }
    let delta = g.mul(out)?.sum_axis(-1, true)?;
    let ds = p.mul(&dp.sub(&delta)?)?.mul_scalar(how.scale)?;
    let dq = ds.matmul(&repeat_heads(k, group)?)?;
    let dk = sum_groups(&ds.transpose(2, 3)?.matmul(q)?, how)?;
    Ok([dq, dk, dv])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::attention::Dims;
    use crate::{Device, manual_seed};

    fn how(causal: bool, dropout: f64) -> Attend {
        Attend {
            dims: Dims {
                batch: 2,
                heads: 4,
                kv_heads: 2,
                q_len: 70,
                kv_len: 75,
                dim: 8,
                v_dim: 6,
            },
            scale: 0.4,
            causal,
            dropout,
            seed: 5,
        }
    }

    fn inputs(how: &Attend) -> [Tensor; 4] {
        let d = how.dims;
        let r = |s: &[usize]| Tensor::randn(s, DType::F64, Device::Cpu).unwrap();
        [
            r(&[d.batch, d.heads, d.q_len, d.dim]),
            r(&[d.batch, d.kv_heads, d.kv_len, d.dim]),
            r(&[d.batch, d.kv_heads, d.kv_len, d.v_dim]),
            r(&[d.batch, d.heads, d.q_len, d.v_dim]),
        ]
    }

    fn gap(a: &Tensor, b: &Tensor) -> f64 {
        let (a, b) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max)
    }

    /// The composed path (what a device without the kernel runs) gives the CPU kernel's output,
    /// log-sum-exp and gradients.
    #[test]
    fn the_composed_path_equals_the_fused_kernel() {
        manual_seed(3);
        for causal in [false, true] {
            let how = how(causal, 0.0);
            let [q, k, v, g] = inputs(&how);
            let (out, lse) = backend::attention(&q, &k, &v, &how).unwrap().unwrap();
            let (c_out, c_lse) = attention_composed(&q, &k, &v, &how).unwrap();
            assert!(gap(&out, &c_out) < 1e-12 && gap(&lse, &c_lse) < 1e-12);
            let fused = backend::attention_backward([&q, &k, &v], &out, &g, &lse, &how)
                .unwrap()
                .unwrap();
            let composed = composed_backward([&q, &k, &v], &out, &g, &lse, &how).unwrap();
            for (f, c) in fused.iter().zip(&composed) {
                assert!(gap(f, c) < 1e-12, "causal {causal}: {}", gap(f, c));
            }
        }
    }

    /// With dropout the composed path draws its mask on the device: its backward is the
    /// derivative of its forward (central differences of `sum(out ∘ g)`).
    #[test]
    fn the_composed_dropout_backward_is_its_forward_s_derivative() {
        manual_seed(4);
        let how = how(true, 0.3);
        let [q, k, v, g] = inputs(&how);
        let loss = |q: &Tensor, k: &Tensor, v: &Tensor| -> f64 {
            let (out, _) = attention_composed(q, k, v, &how).unwrap();
            out.mul(&g).unwrap().sum().unwrap().item().unwrap()
        };
        let (out, lse) = attention_composed(&q, &k, &v, &how).unwrap();
        let grads = composed_backward([&q, &k, &v], &out, &g, &lse, &how).unwrap();
        let x = [&q, &k, &v].map(|t| t.to_vec_f64().unwrap());
        for (which, grad) in grads.iter().enumerate() {
            let grad = grad.to_vec_f64().unwrap();
            for e in (0..grad.len()).step_by(7) {
                let shifted = |h: f64| {
                    let mut t = x.clone();
                    t[which][e] += h;
                    let [a, b, c] = [0, 1, 2]
                        .map(|i| Tensor::from_vec(t[i].clone(), [&q, &k, &v][i].shape()).unwrap());
                    loss(&a, &b, &c)
                };
                let numeric = (shifted(1e-6) - shifted(-1e-6)) / 2e-6;
                assert!(
                    (numeric - grad[e]).abs() < 1e-6,
                    "{which}[{e}]: {numeric} vs {}",
                    grad[e]
                );
            }
        }
    }
}
