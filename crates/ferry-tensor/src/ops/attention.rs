//! Scaled dot-product attention as one op: one node that keeps `q`, `k`, `v`, the output and
//! each query row's log-sum-exp, never the `q_len x kv_len` weights. Where the device has a
//! fused kernel (the CPU's one-pass kernel), forward and backward run through it; elsewhere the
//! same node is computed from matrix products and a softmax (without recording them), and its
//! backward recomputes the weights from the log-sum-exp.

use crate::autograd::record;
use crate::kept::kept;
use crate::layout::broadcast_shapes;
use crate::op::attention::{Attend, Dims};
use crate::ops::select::draw_seed;
use crate::{Result, Tensor, TensorError, backend, rules};

const OP: &str = "scaled_dot_product_attention";

/// How [`Tensor::scaled_dot_product_attention`] weighs the keys.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionOptions {
    /// Each query sees only the keys up to its own position, the queries being the last
    /// positions of the keys' sequence (a decoder's mask; with as many queries as keys, PyTorch's
    /// `is_causal=True`).
    pub causal: bool,
    /// Multiplies `q · k`; `1 / sqrt(head dim)` when `None`.
    pub scale: Option<f64>,
    /// The probability of dropping each weight (training); 0 for none.
    pub dropout: f64,
}

impl Default for AttentionOptions {
    fn default() -> Self {
        Self {
            causal: false,
            scale: None,
            dropout: 0.0,
        }
    }
}

fn invalid(message: String) -> TensorError {
    TensorError::InvalidArgument { op: OP, message }
}

impl Tensor {
    /// `softmax(q kᵀ · scale) v`, with `self` as `q` (`[.., heads, q_len, dim]`), `k`
    /// (`[.., kv_heads, kv_len, dim]`) and `v` (`[.., kv_heads, kv_len, v_dim]`): the result is
    /// `[.., heads, q_len, v_dim]`. Leading axes broadcast; `kv_heads` divides `heads`, each
    /// key/value head serving `heads / kv_heads` query heads (grouped-query attention, as
    /// PyTorch's `enable_gqa=True`). Two-axis inputs are one head.
    ///
    /// The node keeps `q`, `k`, `v`, the output and a log-sum-exp per query row; the weights are
    /// recomputed in backward, so the memory kept grows with the sequence, not its square. Float
    /// dtypes; the statistics are `f32` (`f64` for `f64` inputs).
    pub fn scaled_dot_product_attention(
        &self,
        k: &Tensor,
        v: &Tensor,
        options: AttentionOptions,
    ) -> Result<Tensor> {
        if let Some(out) = crate::autocast::attention(self, k, v, options)? {
            return Ok(out);
        }
        let q = self;
        let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
        let nd = qs.len();
        if nd < 2 || ks.len() != nd || vs.len() != nd {
            return Err(invalid(format!(
                "q, k and v need the same number of axes, at least two ([.., T, d]); got {qs:?}, \
                 {ks:?}, {vs:?}"
            )));
        }
        q.same_kind(OP, k)?;
        q.same_kind(OP, v)?;
        if !q.dtype().is_float() {
            return Err(TensorError::UnsupportedDType {
                op: OP,
                dtype: q.dtype(),
                hint: "attention takes float tensors; cast with `.to_dtype(DType::F32)`",
            });
        }
        let (q_len, dim, kv_len, v_dim) = (qs[nd - 2], qs[nd - 1], ks[nd - 2], vs[nd - 1]);
        if ks[nd - 1] != dim || vs[nd - 2] != kv_len {
            return Err(invalid(format!(
                "q [.., Tq, d] and k [.., Tk, d] must share d, and v must have Tk rows; got q \
                 {qs:?}, k {ks:?}, v {vs:?}"
            )));
        }
        if options.causal && q_len > kv_len {
            return Err(invalid(format!(
                "a causal mask needs Tq <= Tk; got Tq {q_len}, Tk {kv_len}"
            )));
        }
        if !(0.0..1.0).contains(&options.dropout) {
            return Err(invalid(format!(
                "dropout = {}: the drop probability must lie in [0, 1)",
                options.dropout
            )));
        }
        let scale = options.scale.unwrap_or(1.0 / (dim.max(1) as f64).sqrt());
        if !scale.is_finite() {
            return Err(invalid(format!("the scale must be finite, got {scale}")));
        }
        let (heads, kv_heads) = match nd {
            2 => (1, 1),
            _ => (qs[nd - 3], ks[nd - 3]),
        };
        if nd > 2 && (vs[nd - 3] != kv_heads || kv_heads == 0 || heads % kv_heads != 0) {
            return Err(invalid(format!(
                "k and v need the same number of heads, dividing q's (grouped-query attention); \
                 got q {qs:?}, k {ks:?}, v {vs:?}"
            )));
        }
        let lead = nd.saturating_sub(3);
        let batch_shape: Vec<usize> = broadcast_shapes(OP, &qs[..lead], &ks[..lead])
            .and_then(|s| broadcast_shapes(OP, &s, &vs[..lead]))
            .map(|s| s.to_vec())
            .map_err(|_| {
                invalid(format!(
                    "the axes before the heads must broadcast; got q {qs:?}, k {ks:?}, v {vs:?}"
                ))
            })?;
        let batch: usize = batch_shape.iter().product();
        let as4 = |t: &Tensor, h: usize, len: usize, width: usize| -> Result<Tensor> {
            let mut full = batch_shape.clone();
            if nd > 2 {
                full.push(h);
            }
            full.extend([len, width]);
            let t = if t.shape() == full.as_slice() {
                t.clone()
            } else {
                t.broadcast_to(&full)?
            };
            if t.ndim() == 4 {
                Ok(t)
            } else {
                t.reshape(&[batch, h, len, width])
            }
        };
        let (q4, k4, v4) = (
            as4(q, heads, q_len, dim)?,
            as4(k, kv_heads, kv_len, dim)?,
            as4(v, kv_heads, kv_len, v_dim)?,
        );
        let how = Attend {
            dims: Dims {
                batch,
                heads,
                kv_heads,
                q_len,
                kv_len,
                dim,
                v_dim,
            },
            scale,
            causal: options.causal,
            dropout: options.dropout,
            seed: if options.dropout > 0.0 {
                draw_seed()?
            } else {
                0
            },
        };
        let [out, lse] = kept(OP, &[batch, heads, q_len, v_dim], || {
            let (out, lse) = match backend::attention(&q4, &k4, &v4, &how)? {
                Some(fused) => fused,
                None => {
                    let _no_grad = ferry_graph::no_grad();
                    let _as_given = crate::autocast::AutocastGuard::new(None)?;
                    rules::attention_composed(&q4, &k4, &v4, &how)?
                }
            };
            Ok([out, lse])
        })?;
        let out = record(out, OP, &[&q4, &k4, &v4], || rules::attention(how, lse));
        let mut shape = batch_shape;
        if nd > 2 {
            shape.push(heads);
        }
        shape.extend([q_len, v_dim]);
        if out.shape() == shape.as_slice() {
            Ok(out)
        } else {
            out.reshape(&shape)
        }
    }
}
