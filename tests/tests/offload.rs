//! Activation offload (`ferry::autograd::offload_saved`): gradients bitwise equal to a run
//! without it, the graph's saved bytes unchanged, leaves and parameters left in place, the
//! pinned budget respected, create-graph and in-place checks kept. On the CPU the scope moves
//! nothing; the CUDA tests read process-wide allocator and pinned-pool figures, so they run
//! one at a time behind the binary's lock (they live in `memory_accounting`).

use ferry::autograd::{GradOptions, OffloadOptions, OffloadStats, grad, no_grad, offload_saved};
use ferry::memory::cuda::{CudaDevice, PinnedPool};
use ferry_graph::GraphError;
use ferry_tensor::{DType, Device, Result, Tensor, TensorError};
use ferry_tests::randn;

const GPU: Device = Device::Cuda(0);

fn serial(body: impl FnOnce() -> Result<()>) {
    let _serial = super::serial_lock();
    ferry_tests::fresh_seed();
    if let Err(e) = body() {
        panic!("(replay with FERRY_SEED={}): {e}", ferry_tests::seed());
    }
}

/// An MLP's parameters: `layers` square f32 matrices of `width`, and an input batch.
struct Mlp {
    x: Tensor,
    ws: Vec<Tensor>,
}

impl Mlp {
    fn new(device: Device, batch: usize, width: usize, layers: usize) -> Result<Self> {
        let scale = 1.0 / (width as f64).sqrt();
        let ws = (0..layers)
            .map(|_| {
                Tensor::randn(&[width, width], DType::F32, device)?
                    .mul_scalar(scale)?
                    .with_grad()
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            x: Tensor::randn(&[batch, width], DType::F32, device)?,
            ws,
        })
    }

    /// tanh(... tanh(x·w0) ...) summed: every tanh output is saved by tanh and by the next
    /// matmul; the weights and x are saved too, but belong to the caller.
    fn loss(&self) -> Result<Tensor> {
        let mut h = self.x.clone();
        for w in &self.ws {
            h = h.matmul(w)?.tanh()?;
        }
        h.sum()
    }

    /// The raw bits of every weight's gradient, then cleared.
    fn take_grads(&self) -> Result<Vec<Vec<u32>>> {
        self.ws
            .iter()
            .map(|w| {
                let g = w.grad().expect("backward reached every weight");
                w.set_grad(None);
                Ok(g.to_vec::<f32>()?.iter().map(|v| v.to_bits()).collect())
            })
            .collect()
    }
}

/// One training step's gradients (bits) and the graph's saved bytes after the forward, with
/// an offload scope of `options` around the forward or without one; the scope's stats.
fn step(
    mlp: &Mlp,
    options: Option<OffloadOptions>,
) -> Result<(Vec<Vec<u32>>, usize, OffloadStats)> {
    let scope = options.map(offload_saved);
    let loss = mlp.loss()?;
    if let (Some(scope), Device::Cuda(ordinal)) = (&scope, mlp.x.device()) {
        // Every copy out completed and the device buffers let go, so backward brings every
        // buffer back from the host (a backward right after the forward would read the last
        // layers' buffers where they still are).
        scope.settle();
        CudaDevice::get(ordinal)?.synchronize()?;
        scope.settle();
    }
    let saved = loss.graph().expect("the loss has history").saved_bytes();
    loss.backward()?;
    let stats = scope.as_ref().map(|s| s.stats()).unwrap_or_default();
    drop(scope);
    Ok((mlp.take_grads()?, saved, stats))
}

#[test]
fn on_the_cpu_the_scope_moves_nothing_and_changes_nothing() {
    ferry_tests::fresh_seed();
    let mlp = Mlp::new(Device::Cpu, 8, 16, 3).unwrap();
    let (plain, plain_saved, _) = step(&mlp, None).unwrap();
    let everything = OffloadOptions { min_bytes: 0 };
    let (offloaded, saved, stats) = step(&mlp, Some(everything)).unwrap();
    assert_eq!(offloaded, plain, "gradients differ under the scope");
    assert_eq!(saved, plain_saved, "saved bytes differ under the scope");
    assert_eq!(
        (stats.offloaded, stats.offloaded_bytes),
        (0, 0),
        "{stats:?}"
    );
    // The first matmul saves x (only its weight wants a gradient), the others (h, w), and each
    // tanh its output: every save was seen, on the host.
    assert_eq!(stats.kept_on_host, 8, "{stats:?}");
    assert_eq!((stats.prefetched, stats.fetched_on_demand), (0, 0));
}

#[test]
fn scopes_nest_and_the_outer_one_resumes() {
    let x = Tensor::from_slice(&[0.5f32, -1.0], &[2])
        .unwrap()
        .with_grad()
        .unwrap();
    let outer = offload_saved(OffloadOptions::default());
    let _a = x.tanh().unwrap(); // saves its output: one save seen by the outer scope
    {
        let inner = offload_saved(OffloadOptions { min_bytes: 0 });
        assert_eq!(inner.options().min_bytes, 0);
        let _b = x.exp().unwrap();
        let _c = x.mul(&x).unwrap(); // x once per slot
        assert_eq!(inner.stats().kept_on_host, 3);
    }
    let _d = x.exp().unwrap();
    assert_eq!(outer.stats().kept_on_host, 2, "{:?}", outer.stats());
    let before = outer.stats();
    let guard_gone = {
        let inner = offload_saved(OffloadOptions::default());
        drop(inner);
        x.exp().unwrap() // the outer scope again
    };
    drop(guard_gone);
    assert_eq!(outer.stats().kept_on_host, before.kept_on_host + 1);
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_gradients_are_bitwise_equal_and_saved_bytes_unchanged() {
    serial(|| {
        let mlp = Mlp::new(GPU, 64, 256, 4)?;
        let (plain, plain_saved, _) = step(&mlp, None)?;
        let options = OffloadOptions {
            min_bytes: 16 << 10,
        };
        let (offloaded, saved, stats) = step(&mlp, Some(options))?;
        assert_eq!(offloaded, plain, "offload changed a gradient: {stats:?}");
        assert_eq!(
            saved, plain_saved,
            "saved_bytes must count host copies the same"
        );
        // Each tanh output (64 KiB) is offloaded once and shared by the next matmul (but the
        // last, which only the sum reads); x and the weights are the caller's.
        assert_eq!(stats.offloaded, 4, "{stats:?}");
        assert_eq!(stats.offloaded_bytes, 4 * 64 * 256 * 4, "{stats:?}");
        assert_eq!(stats.shared, 3, "{stats:?}");
        // x (saved by the first matmul, whose input wants no gradient) and three weights.
        assert_eq!(stats.kept_not_activation, 4, "{stats:?}");
        assert_eq!(stats.kept_over_budget + stats.kept_on_error, 0, "{stats:?}");
        // Backward brought each buffer back once (tanh and the next matmul read one copy), all
        // ahead of their turn.
        assert_eq!(
            (stats.prefetched, stats.fetched_on_demand),
            (4, 0),
            "{stats:?}"
        );
        // The graph is gone: nothing offloaded is left alive.
        assert_eq!(ferry_graph::OffloadedSave::live(), 0);
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_a_backward_right_after_the_forward_reads_the_last_save_where_it_is() {
    serial(|| {
        let layers = 4;
        let mlp = Mlp::new(GPU, 64, 256, layers)?;
        let (plain, _, _) = step(&mlp, None)?;
        // No settle: backward follows the forward at once, as in a training step.
        let scope = offload_saved(OffloadOptions {
            min_bytes: 16 << 10,
        });
        let loss = mlp.loss()?;
        let before = scope.stats();
        loss.backward()?;
        let stats = scope.stats();
        drop(scope);
        assert_eq!(
            mlp.take_grads()?,
            plain,
            "offload changed a gradient: {stats:?}"
        );
        let activation = 64 * 256 * 4;
        // The last tanh output was saved at the last tanh; only `sum` was recorded after it,
        // so its copy was never queued: backward read it on the device.
        assert_eq!(before.offloaded, layers as u64 - 1, "{before:?}");
        assert_eq!(stats.offloaded, layers as u64 - 1, "{stats:?}");
        assert_eq!(
            stats.offloaded_bytes,
            (layers as u64 - 1) * activation,
            "{stats:?}"
        );
        assert_eq!(
            (stats.read_in_place, stats.read_in_place_bytes),
            (1, activation),
            "{stats:?}"
        );
        // The others came back ahead of their turn.
        assert_eq!(
            (stats.prefetched, stats.fetched_on_demand),
            (3, 0),
            "{stats:?}"
        );
        assert_eq!(ferry_graph::OffloadedSave::live(), 0);
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_offload_lowers_device_memory_held_after_the_forward() {
    serial(|| {
        let dev = CudaDevice::get(0)?;
        let mlp = Mlp::new(GPU, 1024, 1024, 6)?; // 4 MiB per activation
        let held = |options: Option<OffloadOptions>| -> Result<(usize, OffloadStats)> {
            dev.synchronize()?;
            let before = dev.memory_stats().allocated_bytes;
            let scope = options.map(offload_saved);
            let loss = mlp.loss()?;
            if let Some(scope) = &scope {
                // Every copy queued, completed, and the device buffers let go.
                scope.settle();
                dev.synchronize()?;
                scope.settle();
            }
            let held = dev.memory_stats().allocated_bytes - before;
            loss.backward()?;
            let stats = scope.as_ref().map(|s| s.stats()).unwrap_or_default();
            drop(scope);
            mlp.take_grads()?;
            Ok((held, stats))
        };
        let (plain, _) = held(None)?;
        let (offloaded, stats) = held(Some(OffloadOptions::default()))?;
        assert_eq!(stats.offloaded, 6, "{stats:?}");
        let freed = plain.saturating_sub(offloaded) as u64;
        assert!(
            freed * 10 >= stats.offloaded_bytes * 9,
            "after the forward {plain} B were held without offload and {offloaded} B with it: \
             only {freed} B of the {} B offloaded were freed",
            stats.offloaded_bytes
        );
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_leaves_parameters_and_their_views_stay_on_the_device() {
    serial(|| {
        let x = randn(GPU, &[256, 256])?.with_grad()?;
        let w = randn(GPU, &[256, 256])?.with_grad()?;
        let scope = offload_saved(OffloadOptions { min_bytes: 0 });
        // matmul saves x (a leaf) and wᵀ (a view of a parameter); mul saves x twice.
        let y = x.matmul(&w.t()?)?.add(&x.mul(&x)?)?.sum()?;
        let stats = scope.stats();
        assert_eq!(stats.offloaded, 0, "{stats:?}");
        assert_eq!(stats.kept_not_activation, 4, "{stats:?}");
        drop(scope);
        y.backward()?;
        assert!(x.grad().is_some() && w.grad().is_some());
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_second_order_gradients_through_offloaded_saves_match() {
    serial(|| {
        let mlp = Mlp::new(GPU, 64, 128, 3)?;
        // d/dw0 of the squared norm of d loss / d w0: a Hessian-vector product.
        let run = |options: Option<OffloadOptions>| -> Result<(Vec<u32>, u64)> {
            let scope = options.map(offload_saved);
            let loss = mlp.loss()?;
            let w0 = &mlp.ws[0];
            let first = grad(
                &[&loss],
                &[w0],
                GradOptions {
                    create_graph: true,
                    ..Default::default()
                },
            )?;
            let g = first[0].clone().expect("w0 is reached");
            let penalty = g.mul(&g)?.sum()?;
            let second = grad(&[&penalty], &[w0], GradOptions::default())?;
            let bits = second[0].clone().expect("w0 is reached").to_vec::<f32>()?;
            let offloaded = scope.as_ref().map_or(0, |s| s.stats().offloaded);
            Ok((bits.iter().map(|v| v.to_bits()).collect(), offloaded))
        };
        let (plain, _) = run(None)?;
        let (offloaded, count) = run(Some(OffloadOptions { min_bytes: 0 }))?;
        assert!(count >= 3, "the tanh outputs were offloaded ({count})");
        assert_eq!(
            offloaded, plain,
            "a second-order gradient changed under offload"
        );
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_an_offloaded_tensor_written_in_place_is_refused_in_backward() {
    serial(|| {
        let w = randn(GPU, &[128, 128])?.with_grad()?;
        let x = randn(GPU, &[128, 128])?;
        let scope = offload_saved(OffloadOptions { min_bytes: 0 });
        let y = x.matmul(&w)?.exp()?; // exp's output is offloaded; the caller still holds it
        scope.settle(); // the last op's save goes too
        assert_eq!(scope.stats().offloaded, 1);
        drop(scope);
        {
            let _off = no_grad();
            y.assign(&y.zeros_like()?)?;
        }
        let err = y.sum()?.backward().unwrap_err();
        let TensorError::Graph(GraphError::Backward { source, .. }) = &err else {
            panic!("expected a failed backward, got {err:?}");
        };
        assert!(
            matches!(
                source.downcast_ref::<TensorError>(),
                Some(TensorError::ModifiedInPlace { op: "exp", .. })
            ),
            "{err}"
        );
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_beyond_the_pinned_budget_saves_stay_on_the_device() {
    serial(|| {
        let mlp = Mlp::new(GPU, 256, 512, 3)?; // 512 KiB activations
        let (plain, plain_saved, _) = step(&mlp, None)?;
        let pool = PinnedPool::global()?;
        pool.empty_cache()?;
        let old = pool.budget();
        // Room for two activations' blocks, not three.
        pool.set_budget(2 * PinnedPool::block_size(256 * 512 * 4))?;
        let result = step(&mlp, Some(OffloadOptions { min_bytes: 0 }));
        let _ = pool.empty_cache();
        pool.set_budget(old)?;
        let (offloaded, saved, stats) = result?;
        assert_eq!(offloaded, plain, "{stats:?}");
        assert_eq!(saved, plain_saved, "{stats:?}");
        assert!(stats.offloaded >= 1, "{stats:?}");
        assert!(stats.kept_over_budget >= 1, "{stats:?}");
        assert_eq!(
            stats.kept_over_budget_bytes,
            stats.kept_over_budget * 256 * 512 * 4,
            "{stats:?}"
        );
        Ok(())
    });
}
