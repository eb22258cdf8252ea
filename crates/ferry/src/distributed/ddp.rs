//! [`DataParallel`]: gradient buckets all-reduced while backward runs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use ferry_tensor::{DType, HookHandle, Result, Tensor, TensorError, with_no_grad};
use parking_lot::Mutex;

use super::{ProcessGroup, ReduceOp};

/// How [`DataParallel`] groups gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DdpOptions {
    /// Gradient bytes per bucket (a parameter larger than this gets a bucket of its own).
    /// Smaller buckets start sending sooner; larger ones pay the per-collective cost less often.
    /// Default 25 MiB.
    pub bucket_bytes: usize,
}

impl Default for DdpOptions {
    fn default() -> Self {
        Self {
            bucket_bytes: 25 << 20,
        }
    }
}

/// What one [`DataParallel::finish`] saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DdpStats {
    /// Buckets all-reduced this step.
    pub buckets: usize,
    /// Of them, those started by backward itself (the rest started in `finish`).
    pub started_in_backward: usize,
    /// Gradient bytes all-reduced.
    pub bytes: usize,
    /// Parameters that got no gradient this step (zeros were sent for them).
    pub missing: usize,
    /// Time spent in `finish`.
    pub finish_time: Duration,
}

/// One replica's side of data-parallel training: its parameters, its rank of the group, and
/// the gradient buckets.
///
/// [`DataParallel::new`] broadcasts the parameters from rank 0, so every replica starts equal.
/// Each backward then packs the gradients into buckets as they are accumulated (in reverse
/// parameter order, the order backward produces them, at most [`DdpOptions::bucket_bytes`]
/// each, one dtype per bucket) and starts averaging each full bucket across the ranks
/// (`ReduceOp::Avg`) while backward goes on, in bucket order on every rank.
/// [`DataParallel::finish`], after backward, starts what is left, and leaves each parameter's
/// `.grad` as a view of its averaged bucket, so the optimizer step that follows sees the same
/// gradient on every rank and the replicas stay equal.
///
/// Every rank must run the same steps: backward, then `finish`, then the same optimizer.
/// Accumulating over several backward passes: run all but the last inside
/// [`DataParallel::no_sync`].
pub struct DataParallel {
    shared: Arc<Shared>,
    hooks: Vec<HookHandle<Tensor>>,
}

struct Shared {
    group: ProcessGroup,
    params: Vec<Tensor>,
    buckets: Vec<Bucket>,
    /// For each parameter: its bucket.
    bucket_of: Vec<usize>,
    syncing: AtomicBool,
    step: Mutex<Step>,
}

struct Bucket {
    params: Vec<usize>,
    dtype: DType,
    numel: usize,
}

#[derive(Default)]
struct Step {
    /// Parameters whose gradient this step has seen.
    seen: Vec<bool>,
    /// Their gradients, until their bucket starts.
    grads: Vec<Option<Tensor>>,
    ready: Vec<usize>,
    /// The next bucket to start: buckets start in order on every rank.
    next: usize,
    /// The flat, averaging (then averaged) gradients of each started bucket.
    flats: Vec<Option<Tensor>>,
    started_in_backward: usize,
}

impl DataParallel {
    /// Wraps this replica's `params` (the same parameters, in the same order, on every rank),
    /// broadcasts them from rank 0, and registers the hooks that start the buckets.
    pub fn new(params: Vec<Tensor>, group: ProcessGroup, options: DdpOptions) -> Result<Self> {
        let device = group.device();
        for (i, p) in params.iter().enumerate() {
            if p.device() != device {
                return Err(TensorError::InvalidArgument {
                    op: "DataParallel::new",
                    message: format!(
                        "parameter {i} is on {} but rank {} works on {device}; move the model \
                         there first (`model.to(...)`)",
                        p.device(),
                        group.rank()
                    ),
                });
            }
            if !p.is_leaf() || !p.requires_grad() {
                return Err(TensorError::InvalidArgument {
                    op: "DataParallel::new",
                    message: format!(
                        "parameter {i} is not a leaf that requires grad; pass the model's \
                         parameters (`model.parameters()`)"
                    ),
                });
            }
        }
        with_no_grad(|| {
            params
                .iter()
                .try_for_each(|p| group.broadcast(&p.detach(), 0))
        })?;
        let buckets = plan_buckets(&params, options.bucket_bytes);
        let mut bucket_of = vec![0; params.len()];
        for (b, bucket) in buckets.iter().enumerate() {
            for &i in &bucket.params {
                bucket_of[i] = b;
            }
        }
        let shared = Arc::new(Shared {
            group,
            step: Mutex::new(Step::fresh(params.len(), buckets.len())),
            params,
            buckets,
            bucket_of,
            syncing: AtomicBool::new(true),
        });
        let hooks = shared
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let weak: Weak<Shared> = Arc::downgrade(&shared);
                p.register_post_accumulate_grad_hook(move |grad| match weak.upgrade() {
                    Some(shared) if shared.syncing.load(Ordering::Acquire) => {
                        shared.accumulated(i, grad)
                    }
                    _ => Ok(()),
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self { shared, hooks })
    }

    /// This replica's group.
    pub fn group(&self) -> &ProcessGroup {
        &self.shared.group
    }

    /// How many buckets the gradients travel in.
    pub fn buckets(&self) -> usize {
        self.shared.buckets.len()
    }

    /// Runs `f` (backward passes whose gradients are to be accumulated locally) without
    /// starting any bucket; the `finish` after the last backward averages the sum.
    pub fn no_sync<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Restore<'a>(&'a AtomicBool);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Release);
            }
        }
        self.shared.syncing.store(false, Ordering::Release);
        let _restore = Restore(&self.shared.syncing);
        f()
    }

    /// After backward: starts the buckets backward did not, then sets each parameter's `.grad`
    /// to its average over the ranks (a view of the bucket). A parameter that got no gradient
    /// on this rank counts as zeros. Returns before the averaging has finished on the GPU: the
    /// kernels that read the gradients wait for it on the device.
    pub fn finish(&self) -> Result<DdpStats> {
        let started = Instant::now();
        let shared = &self.shared;
        let mut step = shared.step.lock();
        let started_in_backward = step.started_in_backward;
        let mut missing = 0;
        for (i, p) in shared.params.iter().enumerate() {
            if !step.seen[i] {
                step.seen[i] = true;
                step.grads[i] = match p.grad() {
                    Some(g) => Some(g),
                    None => {
                        missing += 1;
                        Some(Tensor::zeros(p.shape(), p.dtype(), p.device())?)
                    }
                };
                step.ready[shared.bucket_of[i]] += 1;
            }
        }
        shared.start_ready(&mut step)?;
        let mut bytes = 0;
        for (b, bucket) in shared.buckets.iter().enumerate() {
            let flat = step.flats[b]
                .take()
                .expect("every bucket was started above");
            bytes += flat.nbytes();
            let mut at = 0;
            for &i in &bucket.params {
                let p = &shared.params[i];
                let grad = flat.narrow(0, at, p.numel())?.reshape(p.shape())?;
                at += p.numel();
                p.set_grad(Some(grad));
            }
        }
        *step = Step::fresh(shared.params.len(), shared.buckets.len());
        Ok(DdpStats {
            buckets: shared.buckets.len(),
            started_in_backward,
            bytes,
            missing,
            finish_time: started.elapsed(),
        })
    }
}

impl Drop for DataParallel {
    fn drop(&mut self) {
        for hook in self.hooks.drain(..) {
            hook.remove();
        }
    }
}

impl std::fmt::Debug for DataParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataParallel")
            .field("group", &self.shared.group)
            .field("parameters", &self.shared.params.len())
            .field("buckets", &self.shared.buckets.len())
            .finish()
    }
}

impl Step {
    fn fresh(params: usize, buckets: usize) -> Self {
        Step {
            seen: vec![false; params],
            grads: vec![None; params],
            ready: vec![0; buckets],
            next: 0,
            flats: vec![None; buckets],
            started_in_backward: 0,
        }
    }
}

impl Shared {
    /// Backward has accumulated parameter `i`'s gradient.
    fn accumulated(&self, i: usize, grad: &Tensor) -> Result<()> {
        let mut step = self.step.lock();
        if std::mem::replace(&mut step.seen[i], true) {
            return Err(TensorError::InvalidArgument {
                op: "DataParallel",
                message: format!(
                    "parameter {i} got a second gradient before `finish()`; call `finish()` \
                     after each backward, or run the backward passes you accumulate inside \
                     `no_sync`"
                ),
            });
        }
        step.grads[i] = Some(grad.detach());
        step.ready[self.bucket_of[i]] += 1;
        let before = step.next;
        self.start_ready(&mut step)?;
        step.started_in_backward += step.next - before;
        Ok(())
    }

    /// Starts, in order, every bucket whose gradients are all in.
    fn start_ready(&self, step: &mut Step) -> Result<()> {
        while step.next < self.buckets.len()
            && step.ready[step.next] == self.buckets[step.next].params.len()
        {
            let b = step.next;
            let bucket = &self.buckets[b];
            let parts = bucket
                .params
                .iter()
                .map(|&i| {
                    let g = step.grads[i].take().expect("counted as ready");
                    g.reshape(&[g.numel()])
                })
                .collect::<Result<Vec<_>>>()?;
            let flat = if parts.len() == 1 {
                parts[0].contiguous()?.copy()?
            } else {
                Tensor::cat(&parts.iter().collect::<Vec<_>>(), 0)?
            };
            debug_assert_eq!(flat.numel(), bucket.numel);
            debug_assert_eq!(flat.dtype(), bucket.dtype);
            self.group.all_reduce(&flat, ReduceOp::Avg)?;
            step.flats[b] = Some(flat);
            step.next += 1;
        }
        Ok(())
    }
}

/// Buckets in reverse parameter order (backward produces the last layers' gradients first),
/// each at most `bytes` (or one parameter) and of one dtype.
fn plan_buckets(params: &[Tensor], bytes: usize) -> Vec<Bucket> {
    let mut buckets: Vec<Bucket> = Vec::new();
    for (i, p) in params.iter().enumerate().rev() {
        let size = p.numel() * p.dtype().size();
        let fits = buckets.last().is_some_and(|b: &Bucket| {
            b.dtype == p.dtype() && (b.numel * b.dtype.size() + size <= bytes)
        });
        if fits {
            let b = buckets.last_mut().expect("checked above");
            b.params.push(i);
            b.numel += p.numel();
        } else {
            buckets.push(Bucket {
                params: vec![i],
                dtype: p.dtype(),
                numel: p.numel(),
            });
        }
    }
    buckets
}

/// Where the buckets go, for the tests: `(parameter indices, dtype)` per bucket.
#[cfg(test)]
pub(crate) fn bucket_plan(params: &[Tensor], bytes: usize) -> Vec<(Vec<usize>, DType)> {
    plan_buckets(params, bytes)
        .into_iter()
        .map(|b| (b.params, b.dtype))
        .collect()
}
