//! Linear layers as one op: `x · Wᵀ + b`, optionally followed by ReLU.

use crate::autograd::record;
use crate::{Result, Tensor, TensorError, backend, rules};

impl Tensor {
    /// `self [.., in] · weightᵀ ([out, in]) + bias ([out])`, the op of a linear layer.
    ///
    /// On a GPU with cuBLASLt this is one product with the bias added in its epilogue (one node
    /// in the graph, whose backward is two products and a column sum); on the CPU, inside an
    /// autocast scope, or without a bias, it is `matmul` then `add`, recorded as those ops.
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
        match bias {
            Some(b) if fusable(self, weight, b) => self.linear_fused(weight, b, relu),
            _ => {
                let out = self.matmul(&weight.t()?)?;
                let out = match bias {
                    Some(b) => out.add(b)?,
                    None => out,
                };
                if relu { out.relu() } else { Ok(out) }
            }
        }
    }

    /// One cuBLASLt product over the input's rows (leading axes flattened), one graph node.
    fn linear_fused(&self, weight: &Tensor, bias: &Tensor, relu: bool) -> Result<Tensor> {
        let in_features = weight.shape()[1];
        let rows = self.numel() / in_features.max(1);
        let flat = if self.ndim() == 2 {
            self.clone()
        } else {
            ferry_graph::with_no_grad(|| self.reshape(&[rows, in_features]))?
        };
        let out = backend::linear(&flat, weight, bias, relu)?;
        let mut shape = self.shape().to_vec();
        *shape.last_mut().expect("checked above") = weight.shape()[0];
        let out = if self.ndim() == 2 {
            out
        } else {
            out.reshape(&shape)?
        };
        Ok(record(out, "linear", &[self, weight, bias], || {
            rules::linear(self, weight, bias, relu)
        }))
    }
}

/// Whether `x · wᵀ + b` can run as one fused product here: a GPU with cuBLASLt, one float dtype
/// it fuses, no autocast scope (which picks the product's precision itself).
fn fusable(x: &Tensor, w: &Tensor, b: &Tensor) -> bool {
    use ferry_memory::DType;
    x.device().is_cuda()
        && x.numel() > 0
        && w.numel() > 0
        && w.device() == x.device()
        && b.device() == x.device()
        && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && w.dtype() == x.dtype()
        && b.dtype() == x.dtype()
        && crate::autocast::autocast_dtype().is_none()
        && ferry_cuda::cublaslt_present()
        && std::env::var_os("FERRY_CUBLASLT").is_none_or(|v| v != "0")
}
