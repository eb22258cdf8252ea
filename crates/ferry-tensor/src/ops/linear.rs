//! Linear layers as one op: `x · Wᵀ + b`, optionally followed by ReLU.

use crate::autograd::record;
use crate::kept::kept_optional;
use crate::{Result, Tensor, TensorError, backend, rules};

impl Tensor {
    /// `self [.., in] · weightᵀ ([out, in]) + bias ([out])`, the op of a linear layer.
    ///
    /// On a GPU with cuBLASLt this is one product with the bias added in its epilogue (one node
    /// in the graph, whose backward is two products and a column sum); on the CPU, or without a
    /// bias, it is `matmul` then `add`, recorded as those ops. Inside an autocast scope it runs
    /// in the scope's dtype, every operand cast.
    /// The results are the same either way, up to the order of float additions.
    pub fn linear(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        self.linear_then(weight, bias, false)
    }

    /// `relu(self · weightᵀ + bias)`: [`Tensor::linear`] with the ReLU fused into the same
    /// product's epilogue on a GPU (no pass over the result for the bias, none for the ReLU).
    pub fn linear_relu(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        self.linear_then(weight, bias, true)
    }

    fn linear_then(&self, weight: &Tensor, bias: Option<&Tensor>, relu: bool) -> Result<Tensor> {
        let (in_features, out_features) = match weight.shape() {
            [out, inp] => (*inp, *out),
            _ => {
                return Err(TensorError::ShapeMismatch {
                    op: "linear",
                    lhs: self.dims(),
                    rhs: weight.dims(),
                    hint: "the weight must be [out_features, in_features]",
                });
            }
        };
        if self.ndim() == 0 || self.shape()[self.ndim() - 1] != in_features {
            return Err(TensorError::ShapeMismatch {
                op: "linear",
                lhs: self.dims(),
                rhs: weight.dims(),
                hint: "the input's last axis must have in_features = the weight's second axis",
            });
        }
        if let Some(b) = bias
            && b.shape() != [out_features]
        {
            return Err(TensorError::ShapeMismatch {
                op: "linear",
                lhs: b.dims(),
                rhs: weight.dims(),
                hint: "the bias must be [out_features] = the weight's first axis",
            });
        }
        // Inside an autocast scope, f32 operands are cast and the layer runs in the scope's dtype.
        if let Some(out) = crate::autocast::linear(self, weight, bias, relu)? {
            return Ok(out);
        }
        let mut shape = self.shape().to_vec();
        *shape.last_mut().expect("checked: at least one axis") = out_features;
        if let Some(b) = bias
            && let Some(out) =
                kept_optional(if relu { "linear_relu" } else { "linear" }, &shape, || {
                    backend::fused_linear(self, weight, b, relu)
                })?
        {
            return Ok(record(out, "linear", &[self, weight, b], || {
                rules::linear(self, weight, b, relu)
            }));
        }
        let out = self.matmul(&weight.t()?)?;
        let out = match bias {
            Some(b) => out.add(b)?,
            None => out,
        };
        if relu { out.relu() } else { Ok(out) }
    }
}
