//! Recomputation: a region of the forward pass that keeps only its inputs, and runs again in
//! backward to rebuild what its ops would have saved.
//!
//! [`recompute`] runs a closure on the region's inputs with grad mode off, so nothing inside
//! records a node or saves a tensor, and records one node for the whole region that keeps the
//! inputs. When backward reaches it, the node runs the closure again, with grad mode on, the
//! autocast dtype of the first run and the generator put back where the first run found it (so
//! dropout draws the same masks), then runs backward through that second graph: the parameters
//! the closure uses get their gradients there, the inputs get theirs through the node. The
//! gradients are the ones the region would have given without recomputation: on the CPU, where
//! every kernel is deterministic, bit for bit.
//!
//! Key decision: the parameters are reached by running backward inside the node (as PyTorch's
//! reentrant `checkpoint` does), not by listing them as the node's inputs. A region then takes any
//! closure over any module, and the node's inputs are only the activations that flow in. The
//! cost: a region's parameters accumulate their gradients while the node runs, so
//! [`grad`](crate::backward::grad), which leaves `.grad` alone, is refused when it would reach a
//! region; so is `create_graph`.

use std::sync::Arc;

use parking_lot::Mutex;

use ferry_graph::{
    Backward, BackwardContext, BackwardOptions, BoxError, InputGrads, NodeMeta, SavedBuffers,
    enable_grad, is_grad_enabled, no_grad,
};
use ferry_memory::DType;

use crate::autocast::{AutocastGuard, autocast_dtype};
use crate::autograd::keep_once;
use crate::kept::{KeptProducts, keep_products, reuse_products};
use crate::ops::create::{RngState, rng_state, set_rng_state};
use crate::tensor::Autograd;
use crate::{Result, Tensor, TensorError};

const OP: &str = "recompute";

/// The closure of a region: its inputs in, its output out.
pub type RegionFn = dyn Fn(&[Tensor]) -> Result<Tensor> + Send + Sync;

/// Runs `f` on `inputs` as a recomputed region: inside it nothing is saved for backward; the
/// node recorded for it keeps `inputs` alone and runs `f` again when backward reaches it (see the
/// module docs). Outside grad mode, or on inference data, `f` simply runs.
///
/// `f` must compute the same function both times from the same inputs, parameters and random
/// draws (ferry's generator is put back for the second run; a closure that reads other state, or
/// writes in place to something the region reads, breaks that), and may not keep tensors of its
/// first run for later. At least one input must require a gradient: a region's parameters get
/// theirs through the backward that reaches the region along its inputs' path.
///
/// ```
/// use ferry_tensor::{DType, Device, Tensor, recompute};
///
/// let w = Tensor::randn(&[8, 8], DType::F32, Device::Cpu)?.with_grad()?;
/// let x = Tensor::randn(&[4, 8], DType::F32, Device::Cpu)?.with_grad()?;
/// let block = {
///     let w = w.clone();
///     move |inputs: &[Tensor]| inputs[0].matmul(&w)?.tanh()?.matmul(&w)
/// };
/// let y = recompute(&[&x], block)?;
/// y.sum()?.backward()?;
/// assert_eq!(w.grad().unwrap().shape(), &[8, 8]);
/// assert_eq!(x.grad().unwrap().shape(), &[4, 8]);
/// # Ok::<(), ferry_tensor::TensorError>(())
/// ```
pub fn recompute<F>(inputs: &[&Tensor], f: F) -> Result<Tensor>
where
    F: Fn(&[Tensor]) -> Result<Tensor> + Send + Sync + 'static,
{
    region(inputs, f, false)
}

/// [`recompute`], selective: the first run keeps the outputs of its matrix products, fused linear
/// layers and attention ([`keep_products`]), held by the region's node beside its inputs, and the
/// second run takes them back instead of computing them again ([`reuse_products`]), so backward
/// reruns only the cheap ops (norms, activations, element-wise). More memory than [`recompute`]
/// (the kept outputs), less time (no product computed twice). Gradients are the same as
/// [`recompute`]'s; a second backward through the region (its kept outputs let go after the
/// first) recomputes it whole.
///
/// ```
/// use ferry_tensor::{DType, Device, Tensor, recompute_selective};
///
/// let w = Tensor::randn(&[8, 8], DType::F32, Device::Cpu)?.with_grad()?;
/// let x = Tensor::randn(&[4, 8], DType::F32, Device::Cpu)?.with_grad()?;
/// let block = {
///     let w = w.clone();
///     move |inputs: &[Tensor]| inputs[0].matmul(&w)?.tanh()?.matmul(&w)
/// };
/// let y = recompute_selective(&[&x], block)?;
/// y.sum()?.backward()?;
/// assert_eq!(w.grad().unwrap().shape(), &[8, 8]);
/// # Ok::<(), ferry_tensor::TensorError>(())
/// ```
pub fn recompute_selective<F>(inputs: &[&Tensor], f: F) -> Result<Tensor>
where
    F: Fn(&[Tensor]) -> Result<Tensor> + Send + Sync + 'static,
{
    region(inputs, f, true)
}

fn region<F>(inputs: &[&Tensor], f: F, selective: bool) -> Result<Tensor>
where
    F: Fn(&[Tensor]) -> Result<Tensor> + Send + Sync + 'static,
{
    let recording = is_grad_enabled() && inputs.iter().all(|t| !t.is_inference());
    if !recording {
        let owned: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
        return f(&owned);
    }
    if !inputs.iter().any(|t| t.requires_grad()) {
        return Err(TensorError::InvalidArgument {
            op: OP,
            message: "no input requires a gradient, so backward would never reach the region \
                      and its parameters would get none; pass the activation that flows in \
                      (one that requires grad), or run the closure without `recompute`"
                .into(),
        });
    }
    let detached: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
    let region = Region {
        f: Arc::new(f),
        versions: detached.iter().map(|t| t.storage().version()).collect(),
        inputs: detached,
        rng: rng_state(),
        autocast: autocast_dtype(),
        kept: Mutex::new(None),
    };
    let out = {
        let _nothing_saved = no_grad();
        match selective {
            true => {
                let (out, kept) = keep_products(|| (region.f)(&region.inputs));
                *region.kept.lock() = Some(kept);
                out?
            }
            false => (region.f)(&region.inputs)?,
        }
    };
    if out.requires_grad() {
        return Err(TensorError::InvalidArgument {
            op: OP,
            message: "the region's output carries history from outside the region; it must be \
                      computed from its inputs (and parameters) inside the closure"
                .into(),
        });
    }
    let meta = NodeMeta::op(OP, out.shape(), out.dtype().name(), out.device());
    let nodes: Vec<_> = inputs.iter().map(|t| t.node()).collect();
    let node = ferry_graph::record(meta, Arc::new(region), &nodes);
    Ok(out.attach(Autograd { node, grad: None }))
}

/// The node of a region: its closure, its inputs as the first run saw them, and the state that
/// first run ran in.
struct Region {
    f: Arc<RegionFn>,
    inputs: Vec<Tensor>,
    versions: Vec<u64>,
    rng: RngState,
    autocast: Option<DType>,
    /// A selective region's kept outputs, until its second run takes them.
    kept: Mutex<Option<KeptProducts>>,
}

/// Puts the generator back where it stood when dropped.
struct RestoreRng(RngState);

impl Drop for RestoreRng {
    fn drop(&mut self) {
        set_rng_state(&self.0);
    }
}

impl Region {
    /// The second run: `f` on leaf copies of the inputs (those `wanted` require grad), in the
    /// first run's generator state and autocast dtype, grad mode on.
    fn rerun(&self, wanted: &[bool]) -> Result<(Vec<Tensor>, Tensor)> {
        let leaves = self
            .inputs
            .iter()
            .zip(wanted)
            .map(|(t, &w)| match w && t.dtype().is_float() {
                true => t.detach().with_grad(),
                false => Ok(t.detach()),
            })
            .collect::<Result<Vec<_>>>()?;
        let _restore = RestoreRng(rng_state());
        set_rng_state(&self.rng);
        let _grad = enable_grad();
        let _autocast = AutocastGuard::new(self.autocast)?;
        let kept = self.kept.lock().take();
        let out = match kept {
            Some(kept) => reuse_products(kept, || (self.f)(&leaves)).0?,
            None => (self.f)(&leaves)?,
        };
        Ok((leaves, out))
    }
}

impl Backward<Tensor> for Region {
    fn backward(
        &self,
        ctx: &BackwardContext<'_, Tensor>,
        grad: &Tensor,
        wanted: &[bool],
    ) -> std::result::Result<InputGrads<Tensor>, BoxError> {
        if crate::backward::in_functional_grad() {
            return Err(Box::new(TensorError::InvalidArgument {
                op: OP,
                message: "`grad` leaves `.grad` alone, but a recomputed region's parameters get \
                          their gradients while it runs; call `backward()` on the output instead"
                    .into(),
            }));
        }
        if ctx.create_graph() {
            return Err(Box::new(TensorError::InvalidArgument {
                op: OP,
                message: "a recomputed region has no second derivative (create_graph); run it \
                          without `recompute`"
                    .into(),
            }));
        }
        for (i, (t, &version)) in self.inputs.iter().zip(&self.versions).enumerate() {
            let now = t.storage().version();
            if now != version {
                return Err(Box::new(TensorError::ModifiedInPlace {
                    op: OP,
                    tensor: format!("input {i}"),
                    shape: t.dims(),
                    version: now,
                    saved_version: version,
                }));
            }
        }
        let (leaves, out) = self.rerun(wanted)?;
        if out.shape() != grad.shape() || out.dtype() != grad.dtype() {
            return Err(Box::new(TensorError::InvalidArgument {
                op: OP,
                message: format!(
                    "the second run gave {} {:?} where the first gave {} {:?}: the closure must \
                     compute the same function both times",
                    out.dtype(),
                    out.shape(),
                    grad.dtype(),
                    grad.shape()
                ),
            }));
        }
        if out.requires_grad() {
            out.backward_with(grad.clone(), BackwardOptions::default())?;
        }
        Ok(leaves
            .iter()
            .zip(wanted)
            .map(|(leaf, &w)| if w { leaf.grad() } else { None })
            .collect())
    }

    fn saved(&self) -> SavedBuffers {
        let mut buffers = SavedBuffers::new();
        let kept = self.kept.lock();
        let kept = kept.iter().flat_map(|k| k.tensors());
        for t in self.inputs.iter().chain(kept) {
            keep_once(
                &mut buffers,
                Arc::as_ptr(t.storage()) as usize,
                t.storage().bytes(),
            );
        }
        buffers
    }
}
