//! Running backward from tensors: `backward`, `autograd::grad` for gradients returned instead of
//! accumulated, hooks, retained gradients, and DOT drawings of a tensor's graph.

use std::cell::Cell;

use ferry_graph::{BackwardOptions, BackwardReport, DetachCut, HookHandle};

use crate::autocast::AutocastGuard;
use crate::{Result, Tensor, TensorError};

thread_local! {
    /// Whether this thread is inside [`grad`], which leaves `.grad` alone: a recomputed region,
    /// whose parameters get their gradients while it runs, refuses it.
    static FUNCTIONAL: Cell<bool> = const { Cell::new(false) };
}

/// Whether this thread is inside [`grad`].
pub(crate) fn in_functional_grad() -> bool {
    FUNCTIONAL.with(Cell::get)
}

/// Marks this thread as inside [`grad`] until dropped.
struct FunctionalGrad(bool);

impl FunctionalGrad {
    fn enter() -> Self {
        Self(FUNCTIONAL.with(|f| f.replace(true)))
    }
}

impl Drop for FunctionalGrad {
    fn drop(&mut self) {
        FUNCTIONAL.with(|f| f.set(self.0));
    }
}

/// Options of [`grad`]. The default: the output gradients are ones, no graph of the backward is
/// recorded, saved buffers are freed, and every input must be reached.
#[derive(Debug, Clone, Default)]
pub struct GradOptions {
    /// The gradient of each output (ones of the output's shape where `None`, which needs
    /// one-element outputs).
    pub grad_outputs: Option<Vec<Tensor>>,
    /// Record the backward itself, so the gradients returned have history and can be
    /// differentiated again (Hessian-vector products, gradient penalties). Keeps the graph,
    /// as a second backward through it is what usually follows.
    pub create_graph: bool,
    /// Keep the saved buffers for another backward through the same graph.
    pub retain_graph: bool,
    /// Return `None` for an input no output depends on, instead of an error.
    pub allow_unused: bool,
}

/// The gradients of `outputs` with respect to `inputs`, returned and not accumulated: no
/// tensor's `.grad` changes, and only the nodes on paths from the outputs to the inputs run.
/// `inputs` may be leaves or intermediate tensors; each must require grad.
///
/// ```
/// use ferry_tensor::{DType, Device, Tensor, autograd::{grad, GradOptions}};
///
/// let x = Tensor::from_slice(&[3.0f64], &[1])?.with_grad()?;
/// let y = x.powf(3.0)?.sum()?; // y = x³
/// let options = GradOptions { create_graph: true, ..GradOptions::default() };
/// let dy = grad(&[&y], &[&x], options)?.remove(0).unwrap(); // 3x² = 27
/// let d2y = grad(&[&dy.sum()?], &[&x], GradOptions::default())?.remove(0).unwrap(); // 6x = 18
/// assert_eq!((dy.item()?, d2y.item()?), (27.0, 18.0));
/// assert!(x.grad().is_none());
/// # Ok::<(), ferry_tensor::TensorError>(())
/// ```
pub fn grad(
    outputs: &[&Tensor],
    inputs: &[&Tensor],
    options: GradOptions,
) -> Result<Vec<Option<Tensor>>> {
    let seeds = seeds("grad", outputs, options.grad_outputs.as_deref())?;
    let roots: Vec<_> = outputs
        .iter()
        .zip(seeds)
        .map(|(t, g)| Ok((t.requires_node("grad")?, g)))
        .collect::<Result<_>>()?;
    let targets = inputs
        .iter()
        .enumerate()
        .map(|(index, t)| {
            t.node()
                .ok_or(TensorError::InputWithoutGrad { op: "grad", index })
        })
        .collect::<Result<Vec<_>>>()?;
    let backward = BackwardOptions {
        retain_graph: options.retain_graph || options.create_graph,
        create_graph: options.create_graph,
        trace: false,
    };
    // Gradients take their tensors' dtypes, as the forward left them: no autocast in the rules.
    let _forward_only = AutocastGuard::new(None)?;
    let _functional = FunctionalGrad::enter();
    let (grads, _) = ferry_graph::grad(&roots, &targets, backward)?;
    if !options.allow_unused
        && let Some(index) = grads.iter().position(Option::is_none)
    {
        return Err(TensorError::UnusedInput { index });
    }
    Ok(grads)
}

/// The gradient each output starts from: given ones, checked against the output.
fn seeds(op: &'static str, outputs: &[&Tensor], given: Option<&[Tensor]>) -> Result<Vec<Tensor>> {
    match given {
        Some(given) if given.len() != outputs.len() => Err(TensorError::InvalidArgument {
            op,
            message: format!(
                "{} output gradient(s) for {} output(s); give one per output",
                given.len(),
                outputs.len()
            ),
        }),
        Some(given) => outputs
            .iter()
            .zip(given)
            .map(|(out, g)| seed_matches(op, out, g).map(|()| g.clone()))
            .collect(),
        None => outputs
            .iter()
            .map(|out| {
                if out.numel() != 1 {
                    return Err(TensorError::NonScalarBackward { shape: out.dims() });
                }
                Tensor::ones(out.shape(), out.dtype(), out.device())
            })
            .collect(),
    }
}

fn seed_matches(op: &'static str, out: &Tensor, grad: &Tensor) -> Result<()> {
    if grad.device() != out.device() {
        return Err(TensorError::DeviceMismatch {
            op,
            lhs: out.device(),
            rhs: grad.device(),
        });
    }
    if grad.dtype() != out.dtype() {
        return Err(TensorError::dtype_mismatch(op, grad.dtype(), out.dtype()));
    }
    if grad.shape() != out.shape() {
        return Err(TensorError::ShapeMismatch {
            op,
            lhs: out.dims(),
            rhs: grad.dims(),
            hint: "the gradient must have the output's shape",
        });
    }
    Ok(())
}

impl Tensor {
    /// Backward from a one-element tensor, with gradient 1: every leaf it reaches accumulates
    /// its gradient into `.grad`.
    pub fn backward(&self) -> Result<BackwardReport> {
        self.backward_from_ones(BackwardOptions::default())
    }

    /// Backward from a one-element tensor that also reports every node visited, in order, with
    /// the gradient it received, the hooks that ran and what it passed on (see
    /// [`BackwardReport::trace`]).
    pub fn backward_traced(&self) -> Result<BackwardReport> {
        self.backward_from_ones(BackwardOptions {
            trace: true,
            ..BackwardOptions::default()
        })
    }

    fn backward_from_ones(&self, options: BackwardOptions) -> Result<BackwardReport> {
        if self.numel() != 1 {
            return Err(TensorError::NonScalarBackward { shape: self.dims() });
        }
        let ones = Tensor::ones(self.shape(), self.dtype(), self.device())?;
        self.backward_with(ones, options)
    }

    /// Backward with an explicit output gradient and options (`retain_graph`, `create_graph`,
    /// `trace`). With `create_graph` the accumulated `.grad`s have history (and the graph is
    /// kept); prefer [`grad`] for higher-order work, which leaves `.grad` alone.
    pub fn backward_with(&self, grad: Tensor, options: BackwardOptions) -> Result<BackwardReport> {
        let node = self.node().ok_or(TensorError::NoGraph)?;
        seed_matches("backward", self, &grad)?;
        let grad = if options.create_graph {
            grad
        } else {
            grad.detach()
        };
        let options = BackwardOptions {
            retain_graph: options.retain_graph || options.create_graph,
            ..options
        };
        // Gradients take their tensors' dtypes, as the forward left them: no autocast in the
        // rules, even when backward is called inside a scope.
        let _forward_only = AutocastGuard::new(None)?;
        Ok(node.backward(grad, options)?)
    }

    /// Runs `hook` on the gradient of this tensor each time backward computes it, before it
    /// flows on; returning `Some(g)` replaces it with `g` (same shape, dtype and device). On a
    /// leaf it runs before accumulation. Remove it with the handle.
    pub fn register_hook(
        &self,
        hook: impl Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync + 'static,
    ) -> Result<HookHandle<Tensor>> {
        let node = self.requires_node("register_hook")?;
        let (shape, dtype, device) = (self.dims(), self.dtype(), self.device());
        Ok(node.register_hook(move |g: &Tensor| {
            let replaced = hook(g)?;
            if let Some(r) = &replaced
                && (r.shape() != shape.as_slice() || r.dtype() != dtype || r.device() != device)
            {
                return Err(Box::new(TensorError::ShapeMismatch {
                    op: "register_hook",
                    lhs: shape.clone(),
                    rhs: r.dims(),
                    hint: "a hook must return a gradient of the tensor's shape, dtype and device",
                }) as ferry_graph::BoxError);
            }
            Ok(replaced)
        }))
    }

    /// Runs `hook` with this leaf's accumulated `.grad` each time backward has added to it
    /// (where bucketed gradient all-reduce starts sending a bucket).
    pub fn register_post_accumulate_grad_hook(
        &self,
        hook: impl Fn(&Tensor) -> Result<()> + Send + Sync + 'static,
    ) -> Result<HookHandle<Tensor>> {
        if !self.is_leaf() || !self.requires_grad() {
            return Err(TensorError::InvalidArgument {
                op: "register_post_accumulate_grad_hook",
                message: "only leaves that require grad accumulate a gradient; use \
                          `register_hook` on other tensors"
                    .into(),
            });
        }
        let node = self.requires_node("register_post_accumulate_grad_hook")?;
        Ok(node.register_post_accumulate_hook(move |g: &Tensor| Ok(hook(g)?)))
    }

    /// Keeps this tensor's gradient after backward, as a leaf's is kept: read it with
    /// [`Tensor::grad`]. A no-op on leaves.
    pub fn retain_grad(&self) -> Result<()> {
        self.requires_node("retain_grad")?.retain_grad();
        Ok(())
    }
}

/// The graph behind `roots` in Graphviz DOT: op, shape, dtype, device and saved bytes per node,
/// transfer nodes and edges drawn distinctly, and each `(label, source)` in `cuts` drawn as a
/// detach cut into the node of `source` (the tensor that was detached).
pub fn to_dot(roots: &[&Tensor], cuts: &[(&str, &Tensor)]) -> String {
    let nodes: Vec<_> = roots.iter().filter_map(|t| t.node()).collect();
    let cuts: Vec<DetachCut<Tensor>> = cuts
        .iter()
        .filter_map(|(label, source)| {
            source.node().map(|n| DetachCut {
                label: (*label).to_string(),
                node: n.clone(),
            })
        })
        .collect();
    ferry_graph::dot(&nodes, &cuts)
}
