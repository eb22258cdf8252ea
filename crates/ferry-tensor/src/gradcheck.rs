//! Numerical gradient checking: central differences in f64 against what backward computes.

use ferry_memory::DType;

use crate::{Result, Tensor, TensorError};

/// Step and tolerances for [`gradcheck`].
#[derive(Debug, Clone, Copy)]
pub struct GradcheckOptions {
    /// Perturbation for central differences.
    pub eps: f64,
    /// Absolute tolerance.
    pub atol: f64,
    /// Relative tolerance.
    pub rtol: f64,
}

impl Default for GradcheckOptions {
    fn default() -> Self {
        Self {
            eps: 1e-6,
            atol: 1e-5,
            rtol: 1e-4,
        }
    }
}

/// Where an analytical gradient disagreed with the numerical one.
#[derive(Debug, Clone, PartialEq)]
pub struct GradMismatch {
    /// Which input.
    pub input: usize,
    /// Which element of it (row-major).
    pub element: usize,
    /// From backward.
    pub analytical: f64,
    /// From central differences.
    pub numerical: f64,
}

/// Checks `f`'s gradients at `inputs` (f64 tensors): backward of `Σ f(x) · v` for a fixed
/// random `v` against central differences, element by element. Returns every mismatch (empty
/// when all agree).
pub fn gradcheck(
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
    options: GradcheckOptions,
) -> Result<Vec<GradMismatch>> {
    if let Some(bad) = inputs.iter().find(|t| t.dtype() != DType::F64) {
        return Err(TensorError::UnsupportedDType {
            op: "gradcheck",
            dtype: bad.dtype(),
            hint: "gradcheck needs f64 inputs for accurate differences; cast with `.to_dtype(DType::F64)`",
        });
    }
    let leaves: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.detach().with_grad())
        .collect::<Result<_>>()?;
    let probe = {
        let out = crate::with_no_grad(|| f(&leaves))?;
        Tensor::rand(out.shape(), DType::F64, out.device())?.add_scalar(0.5)?
    };
    let objective = |xs: &[Tensor]| -> Result<Tensor> { f(xs)?.mul(&probe)?.sum() };
    let value = objective(&leaves)?;
    // An output without history has no analytical gradient: zero, which central differences
    // then confirm, or refute when a rule's backward recorded nothing it should have.
    if value.requires_grad() {
        value.backward()?;
    }

    let mut mismatches = Vec::new();
    for (i, leaf) in leaves.iter().enumerate() {
        let analytical = match leaf.grad() {
            // A rule that returns the right values in the wrong shape is still wrong.
            Some(g) if g.shape() != leaf.shape() => {
                return Err(TensorError::ShapeMismatch {
                    op: "gradcheck",
                    lhs: leaf.dims(),
                    rhs: g.dims(),
                    hint: "the gradient of an input must have the input's shape; the op's rule is wrong",
                });
            }
            Some(g) => g.to_vec::<f64>()?,
            None => vec![0.0; leaf.numel()],
        };
        let base = leaf.detach().contiguous()?;
        for (e, &analytical) in analytical.iter().enumerate() {
            let at = |delta: f64| -> Result<f64> {
                let bump = Tensor::arange(0.0, base.numel() as f64, DType::F64, base.device())?
                    .eq(&Tensor::full(&[], e as f64, DType::F64, base.device())?)?
                    .to_dtype(DType::F64)?
                    .mul_scalar(delta)?
                    .reshape(base.shape())?;
                let mut xs: Vec<Tensor> = leaves.iter().map(Tensor::detach).collect();
                xs[i] = base.add(&bump)?;
                crate::with_no_grad(|| objective(&xs))?.item()
            };
            let numerical = (at(options.eps)? - at(-options.eps)?) / (2.0 * options.eps);
            if !approx::relative_eq!(
                analytical,
                numerical,
                epsilon = options.atol,
                max_relative = options.rtol
            ) {
                mismatches.push(GradMismatch {
                    input: i,
                    element: e,
                    analytical,
                    numerical,
                });
            }
        }
    }
    Ok(mismatches)
}

/// Checks `f`'s second derivatives at `inputs` (f64 tensors on one device), as PyTorch's
/// `gradgradcheck` does: [`gradcheck`] of `h(x, v) = Σᵢ ⟨∂⟨f(x), v⟩/∂xᵢ, uᵢ⟩` for fixed random
/// directions `uᵢ`, where the inner gradient comes from [`grad`](crate::autograd::grad) with
/// `create_graph` and `v` (random) is its output gradient. `v` is an input of `h` as well (the
/// last one, index `inputs.len()` in a mismatch): a rule's backward must be differentiable in
/// the incoming gradient too, which is all there is to check for linear ops (their second
/// derivative in `x` is zero). Returns every mismatch of `h`'s gradient.
pub fn gradgradcheck(
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
    options: GradcheckOptions,
) -> Result<Vec<GradMismatch>> {
    let grad_output = {
        let out = crate::with_no_grad(|| f(inputs))?;
        Tensor::rand(out.shape(), DType::F64, out.device())?.add_scalar(0.5)?
    };
    let directions: Vec<Tensor> = inputs
        .iter()
        .map(|x| Tensor::rand(x.shape(), DType::F64, x.device())?.sub_scalar(0.5))
        .collect::<Result<_>>()?;
    let h = |xs_and_v: &[Tensor]| -> Result<Tensor> {
        let _recording = ferry_graph::enable_grad();
        // The numerical pass hands in plain tensors: they need a node to differentiate at.
        let leaves: Vec<Tensor> = xs_and_v
            .iter()
            .map(|x| {
                if x.requires_grad() {
                    Ok(x.clone())
                } else {
                    x.detach().with_grad()
                }
            })
            .collect::<Result<_>>()?;
        let (xs, v) = leaves.split_at(inputs.len());
        let out = f(xs)?;
        let refs: Vec<&Tensor> = xs.iter().collect();
        let options = crate::autograd::GradOptions {
            grad_outputs: Some(v.to_vec()),
            create_graph: true,
            allow_unused: true,
            ..Default::default()
        };
        let grads = crate::autograd::grad(&[&out], &refs, options)?;
        let mut total: Option<Tensor> = None;
        for (g, u) in grads.iter().zip(&directions) {
            if let Some(g) = g {
                let term = g.mul(u)?.sum()?;
                total = Some(match total {
                    Some(t) => t.add(&term)?,
                    None => term,
                });
            }
        }
        match total {
            Some(t) => Ok(t),
            None => Tensor::zeros(&[], DType::F64, v[0].device()),
        }
    };
    let mut xs_and_v = inputs.to_vec();
    xs_and_v.push(grad_output);
    gradcheck(h, &xs_and_v, options)
}
