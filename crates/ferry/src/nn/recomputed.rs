//! A module whose forward is a recomputed region: it keeps only its input for backward.

use std::sync::Arc;

use ferry_tensor::{Result, Tensor, TensorError, recompute, recompute_selective};
use parking_lot::RwLock;

use super::Module;

/// `module`, run as one recomputed region ([`ferry_tensor::recompute`]): its forward saves
/// nothing inside, and backward runs it again (same dropout masks, same autocast dtype) to get
/// its gradients, which equal the plain module's. The memory a transformer block saves, traded
/// for one more forward of it in backward (PyTorch's `torch.utils.checkpoint` per block).
///
/// Change the module (its parameters, its training mode) between a backward and the next
/// forward, not between a forward and its backward: the second run would compute with the new
/// state. Parameters replaced or written in place in between are caught (the backward fails,
/// naming it); a training mode switched in between is not.
///
/// ```
/// use ferry::nn::{Linear, Module, Recomputed, Sequential, Tanh};
/// use ferry::prelude::*;
///
/// let block = Sequential::new()
///     .push(Linear::new(16, 64, Device::Cpu)?)
///     .push(Tanh)
///     .push(Linear::new(64, 16, Device::Cpu)?);
/// let block = Recomputed::new(block);
/// let x = Tensor::randn(&[8, 16], DType::F32, Device::Cpu)?.with_grad()?;
/// block.forward(&x)?.sum()?.backward()?;
/// assert!(block.parameters().iter().all(|p| p.grad().is_some()));
/// # Ok::<(), ferry::TensorError>(())
/// ```
pub struct Recomputed<M> {
    module: Arc<RwLock<M>>,
}

impl<M: Module + Send + Sync + 'static> Recomputed<M> {
    /// `module` as a recomputed region.
    pub fn new(module: M) -> Self {
        Self {
            module: Arc::new(RwLock::new(module)),
        }
    }

    /// Runs `f` on the module inside.
    pub fn with_inner<R>(&self, f: impl FnOnce(&M) -> R) -> R {
        f(&self.module.read())
    }
}

/// Each parameter of `module` and the version of its storage.
fn versions(module: &impl Module) -> Vec<(Tensor, u64)> {
    let mut out = Vec::new();
    module.visit_parameters("", &mut |_, p| out.push((p.clone(), p.storage().version())));
    out
}

/// An error unless `module`'s parameters are the tensors, at the versions, of `expected`.
fn unchanged(module: &impl Module, expected: &[(Tensor, u64)]) -> Result<()> {
    let now = versions(module);
    let same = now.len() == expected.len()
        && now
            .iter()
            .zip(expected)
            .all(|((p, v), (q, w))| p.shares_storage(q) && v == w);
    match same {
        true => Ok(()),
        false => Err(TensorError::InvalidArgument {
            op: "Recomputed",
            message: "the module's parameters were replaced or written in place between its \
                      forward and the backward that runs it again; step the optimizer (or move \
                      the module) after backward"
                .into(),
        }),
    }
}

/// `module.forward(input)` as a recomputed region (for a model's own blocks, each shared by an
/// `Arc` with the region), `selective` keeping its products' outputs; the second run refuses
/// parameters replaced or written in place since the first.
pub(crate) fn recompute_forward<M: Module + Send + Sync + 'static>(
    module: Arc<M>,
    input: &Tensor,
    selective: bool,
) -> Result<Tensor> {
    let expected = versions(&*module);
    let f = move |x: &[Tensor]| {
        unchanged(&*module, &expected)?;
        module.forward(&x[0])
    };
    match selective {
        true => recompute_selective(&[input], f),
        false => recompute(&[input], f),
    }
}

impl<M: Module + Send + Sync + 'static> Module for Recomputed<M> {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        let module = Arc::clone(&self.module);
        let expected = versions(&*module.read());
        recompute(&[input], move |x| {
            let module = module.read();
            unchanged(&*module, &expected)?;
            module.forward(&x[0])
        })
    }

    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        self.module.read().visit_parameters(prefix, f);
    }

    fn visit_parameters_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(String, &mut Tensor) -> Result<()>,
    ) -> Result<()> {
        self.module.write().visit_parameters_mut(prefix, f)
    }

    fn set_training(&mut self, training: bool) {
        self.module.write().set_training(training);
    }
}
