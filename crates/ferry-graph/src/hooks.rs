//! Hooks: code that runs as gradients flow. A gradient hook sees (and may replace) the gradient
//! of a node's output before the node uses it; a retained gradient keeps a non-leaf's gradient
//! like a leaf's; a post-accumulate hook runs after a leaf's `.grad` was updated (where bucketed
//! gradient all-reduce starts its communication).

use std::sync::Arc;

use crate::BoxError;
use crate::graph::{GradSlot, NodeHandle, WeakNode};
use crate::node::GradValue;

/// Sees the gradient flowing into a node's output; returning `Some` replaces it.
pub type GradHook<G> = Arc<dyn Fn(&G) -> Result<Option<G>, BoxError> + Send + Sync>;

/// Runs after a leaf's gradient was accumulated, with the accumulated total.
pub type PostAccumulateHook<G> = Arc<dyn Fn(&G) -> Result<(), BoxError> + Send + Sync>;

pub(crate) struct Hooks<G> {
    next_id: u64,
    pub(crate) grad: Vec<(u64, GradHook<G>)>,
    pub(crate) retained: Option<GradSlot<G>>,
    pub(crate) post_accumulate: Vec<(u64, PostAccumulateHook<G>)>,
}

impl<G> Default for Hooks<G> {
    fn default() -> Self {
        Self {
            next_id: 0,
            grad: Vec::new(),
            retained: None,
            post_accumulate: Vec::new(),
        }
    }
}

impl<G> Hooks<G> {
    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.grad.is_empty() && self.retained.is_none() && self.post_accumulate.is_empty()
    }
}

/// Removes the hook it was returned for; the hook stays registered until then (dropping the
/// handle does not remove it) and the handle does not keep the node alive.
#[must_use = "keep the handle to remove the hook later, or drop it to keep the hook for good"]
pub struct HookHandle<G: GradValue> {
    node: WeakNode<G>,
    id: u64,
}

impl<G: GradValue> HookHandle<G> {
    /// Removes the hook; `false` when it was already gone (removed, or its node freed).
    pub fn remove(self) -> bool {
        let Some(node) = self.node.upgrade() else {
            return false;
        };
        let mut hooks = node.0.hooks.lock();
        let before = hooks.grad.len() + hooks.post_accumulate.len();
        hooks.grad.retain(|(id, _)| *id != self.id);
        hooks.post_accumulate.retain(|(id, _)| *id != self.id);
        before != hooks.grad.len() + hooks.post_accumulate.len()
    }
}

impl<G: GradValue> std::fmt::Debug for HookHandle<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HookHandle").field("id", &self.id).finish()
    }
}

impl<G: GradValue> NodeHandle<G> {
    /// Runs `hook` on the gradient of this node's output each time backward reaches it, before
    /// the node uses it; a hook returning `Some(g)` replaces the gradient with `g`. Hooks run
    /// in the order they were registered.
    pub fn register_hook(
        &self,
        hook: impl Fn(&G) -> Result<Option<G>, BoxError> + Send + Sync + 'static,
    ) -> HookHandle<G> {
        let mut hooks = self.0.hooks.lock();
        let id = hooks.id();
        hooks.grad.push((id, Arc::new(hook)));
        HookHandle {
            node: self.downgrade(),
            id,
        }
    }

    /// Runs `hook` with a leaf's accumulated gradient each time backward has added to it.
    /// On a non-leaf node it never runs.
    pub fn register_post_accumulate_hook(
        &self,
        hook: impl Fn(&G) -> Result<(), BoxError> + Send + Sync + 'static,
    ) -> HookHandle<G> {
        let mut hooks = self.0.hooks.lock();
        let id = hooks.id();
        hooks.post_accumulate.push((id, Arc::new(hook)));
        HookHandle {
            node: self.downgrade(),
            id,
        }
    }

    /// Keeps the gradient of this node's output after backward (accumulating across calls, as
    /// a leaf's does) and returns where it lands. A leaf's slot is its `.grad`.
    pub fn retain_grad(&self) -> GradSlot<G> {
        if let Some(slot) = &self.0.leaf_grad {
            return Arc::clone(slot);
        }
        let mut hooks = self.0.hooks.lock();
        Arc::clone(hooks.retained.get_or_insert_with(GradSlot::default))
    }

    /// Where this node's gradient is kept: a leaf's `.grad`, or a retained non-leaf gradient.
    pub fn grad_slot(&self) -> Option<GradSlot<G>> {
        match &self.0.leaf_grad {
            Some(slot) => Some(Arc::clone(slot)),
            None => self.0.hooks.lock().retained.clone(),
        }
    }
}
