//! What moves record, prune and stage, read from process-wide counts (graph nodes, saved
//! bytes, pinned-pool and allocator statistics): run serialised behind the binary's lock.

use ferry::memory::cuda::{CudaDevice, PinnedPool};
use ferry::{
    ChunkPlan, ChunkSpec, DeviceMove, MoveOptions, TransferPath, move_state_dict, pinned_block_size,
};
use ferry_tensor::ops::optim::AdamStep;
use ferry_tensor::{DType, Device, Graph, Result, Tensor, no_grad};

use super::run;

const GPU: Device = Device::Cuda(0);

/// (live nodes, saved bytes, nodes recorded so far) of `g`.
fn counts(g: &Graph) -> (usize, usize, u64) {
    let s = g.stats();
    (s.live_nodes, s.saved_bytes, s.recorded)
}

#[test]
fn detach_then_move_records_nothing_and_prunes_the_history() {
    run(|| {
        let x = Tensor::randn(&[8, 8], DType::F32, Device::Cpu)?.with_grad()?;
        let h = x.relu()?.exp()?;
        let g = x.graph().unwrap();
        let before = counts(&g);
        let y = h.detach().cpu()?;
        assert!(!y.requires_grad());
        assert_eq!(counts(&g), before, "detach().cpu() recorded something");
        let (z, report) = h.detach_into(Device::Cpu)?;
        assert_eq!(
            (report.nodes_recorded, report.nodes_pruned),
            (0, 2),
            "relu and exp left"
        );
        assert_eq!(g.live_nodes(), before.0 - 2, "only the leaf is left");
        assert_eq!(g.saved_bytes(), 0, "their saved buffers were freed");
        assert_eq!(z.to_vec::<f32>()?, y.to_vec::<f32>()?);
        Ok(())
    });
}

#[test]
fn a_move_by_value_keeps_the_history_it_records_on() {
    run(|| {
        let x = Tensor::randn(&[4], DType::F64, Device::Cpu)?.with_grad()?;
        let h = x.tanh()?;
        let g = x.graph().unwrap();
        let before = counts(&g);
        let (y, report) = h.into_device(Device::Cpu)?;
        assert_eq!((report.nodes_recorded, report.nodes_pruned), (1, 0));
        assert_eq!(g.live_nodes(), before.0 + 1);
        y.sum()?.backward()?;
        assert!(x.grad().is_some());
        Ok(())
    });
}

#[test]
fn no_grad_moves_record_nothing_and_save_nothing() {
    run(|| {
        let x = Tensor::randn(&[16, 4], DType::F32, Device::Cpu)?.with_grad()?;
        let g = x.graph().unwrap();
        let before = counts(&g);
        let _guard = no_grad();
        let moved = [
            x.cpu()?,
            x.to_with(Device::Cpu, MoveOptions::dtype(DType::F16))?.0,
            x.to_chunked(Device::Cpu, ChunkSpec::Count(3))?.0,
            x.clone().into_device(Device::Cpu)?.0,
        ];
        assert!(moved.iter().all(|t| !t.requires_grad()));
        assert_eq!(
            counts(&g),
            before,
            "a move under no_grad recorded or saved something"
        );
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn chunked_staging_stays_within_its_bound_by_the_pools_count() {
    run(|| {
        let pool = PinnedPool::global()?;
        let x = Tensor::randn(&[1000, 1000], DType::F32, GPU)?;
        for bound in [1 << 20, 1_000_000, 64 << 10, x.nbytes() / 4] {
            let baseline = pool.stats().allocated_bytes;
            let (y, report) = x.to_chunked(Device::Cpu, ChunkSpec::MaxStagingBytes(bound))?;
            assert!(
                report.staging_peak_bytes > 0 && report.staging_peak_bytes <= bound,
                "{report}"
            );
            let plan = ChunkPlan::new(x.shape(), x.dtype(), ChunkSpec::MaxStagingBytes(bound))?;
            assert_eq!(report.staging_peak_bytes, plan.staging_bytes());
            assert_eq!(
                pool.stats().allocated_bytes,
                baseline,
                "staging went back to the pool"
            );
            assert_eq!(y.to_vec::<f32>()?, x.to_vec::<f32>()?);
        }
        // Non-contiguous: the device scratch is bounded by a piece too.
        let (_, report) = x.t()?.to_chunked(Device::Cpu, ChunkSpec::Count(8))?;
        assert!(report.staging_peak_bytes <= 2 * pinned_block_size(x.nbytes() / 8) + (2 << 20) * 2);
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn an_async_move_dropped_unread_returns_its_block_to_the_pool() {
    run(|| {
        let pool = PinnedPool::global()?;
        let stream = ferry::memory::cuda::CudaDevice::get(0)?.new_stream()?;
        let x = Tensor::randn(&[2048, 1024], DType::F32, GPU)?;
        // Nothing cached that the request could take (a block of the class above would).
        pool.empty_cache()?;
        let baseline = pool.stats().allocated_bytes;
        let pending = x.to_async(Device::Cpu, &stream)?;
        assert_eq!(
            pool.stats().allocated_bytes,
            baseline + pinned_block_size(x.nbytes())
        );
        drop(pending);
        assert_eq!(pool.stats().allocated_bytes, baseline);
        // The block is reused only once the copy that targeted it has finished.
        let (y, _) = x.to_async(Device::Cpu, &stream)?.wait()?;
        assert_eq!(y.to_vec::<f32>()?, x.to_vec::<f32>()?);
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_state_dict_lands_in_one_arena_per_dtype() {
    run(|| {
        let pool = PinnedPool::global()?;
        let dict: Vec<(String, Tensor)> = (0..10)
            .map(|i| {
                let dtype = if i % 2 == 0 { DType::F32 } else { DType::F16 };
                Ok((format!("p{i}"), Tensor::randn(&[100 + i, 37], dtype, GPU)?))
            })
            .collect::<ferry::Result<_>>()?;
        let before = pool.stats();
        let (moved, _) = move_state_dict(&dict, Device::Cpu)?;
        let after = pool.stats();
        assert_eq!(
            after.allocations - before.allocations,
            2,
            "one arena per dtype"
        );
        let f32_views: Vec<&Tensor> = moved.iter().step_by(2).map(|(_, t)| t).collect();
        assert!(f32_views.windows(2).all(|w| w[0].shares_storage(w[1])));
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_facade_memory_helpers_follow_the_allocator() {
    run(|| {
        use ferry::cuda;
        cuda::synchronize(GPU)?;
        let before = cuda::memory_allocated(GPU)?;
        cuda::reset_peak(GPU)?;
        let x = Tensor::zeros(&[1 << 20], DType::F32, GPU)?;
        assert_eq!(cuda::memory_allocated(GPU)?, before + (4 << 20));
        drop(x);
        assert_eq!(cuda::memory_allocated(GPU)?, before);
        assert_eq!(cuda::max_memory_allocated(GPU)?, before + (4 << 20));
        assert!(cuda::memory_reserved(GPU)? >= before + (4 << 20));
        cuda::empty_cache(GPU)?;
        // Nothing cached that a 4 MiB request could take (a block of the class above would).
        cuda::pinned::empty_cache()?;
        cuda::pinned::reset_peak()?;
        let pinned = cuda::pinned::memory_allocated()?;
        let host = Tensor::randn(&[1 << 20], DType::F32, GPU)?.cpu()?; // 4 MiB: lands pinned
        assert_eq!(cuda::pinned::memory_allocated()?, pinned + (4 << 20));
        drop(host);
        assert_eq!(cuda::pinned::max_memory_allocated()?, pinned + (4 << 20));
        cuda::pinned::empty_cache()?;
        assert_eq!(
            cuda::pinned::memory_reserved()?,
            cuda::pinned::memory_allocated()?
        );
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn moves_leave_the_users_peak_statistics_alone() {
    run(|| {
        let dev = CudaDevice::get(0)?;
        let pool = PinnedPool::global()?;
        let x = Tensor::randn(&[1000, 1000], DType::F32, GPU)?; // 4 MB
        let host = Tensor::randn(&[8192, 1024], DType::F32, Device::Cpu)?; // 32 MiB: pipelined
        let dict: Vec<(String, Tensor)> = (0..4)
            .map(|i| Ok((format!("p{i}"), Tensor::randn(&[100, 37], DType::F32, GPU)?)))
            .collect::<ferry::Result<_>>()?;
        let host_dict: Vec<(String, Tensor)> = dict
            .iter()
            .map(|(n, t)| Ok((n.clone(), t.cpu()?)))
            .collect::<ferry::Result<_>>()?;
        let stream = dev.new_stream()?;
        // The user's high-water marks, above anything the moves below use.
        drop(pool.alloc(256 << 20)?);
        drop(dev.alloc(512 << 20, dev.default_stream())?);
        drop(Tensor::zeros(&[64 << 20], DType::F32, Device::Cpu)?);
        let peaks = || {
            (
                pool.stats().peak_allocated_bytes,
                dev.memory_stats().peak_allocated_bytes,
                ferry::host::max_memory_allocated(),
            )
        };
        let before = peaks();
        type Move<'a> = Box<dyn Fn() -> ferry::Result<()> + 'a>;
        let moves: Vec<(&str, Move<'_>)> = vec![
            (
                "to_chunked to the host",
                Box::new(|| x.to_chunked(Device::Cpu, ChunkSpec::Count(4)).map(drop)),
            ),
            (
                "to_chunked of a transposed view",
                Box::new(|| {
                    x.t()?
                        .to_chunked(Device::Cpu, ChunkSpec::Count(8))
                        .map(drop)
                }),
            ),
            (
                "to_chunked to the GPU",
                Box::new(|| host.to_chunked(GPU, ChunkSpec::Count(4)).map(drop)),
            ),
            ("a pipelined upload", Box::new(|| host.to(GPU).map(drop))),
            (
                "move_state_dict to the host",
                Box::new(|| move_state_dict(&dict, Device::Cpu).map(drop)),
            ),
            (
                "move_state_dict to the GPU",
                Box::new(|| move_state_dict(&host_dict, GPU).map(drop)),
            ),
            (
                "to_async + wait",
                Box::new(|| x.to_async(Device::Cpu, &stream)?.wait().map(drop)),
            ),
        ];
        for (what, run_move) in &moves {
            run_move()?;
            assert_eq!(peaks(), before, "{what} changed the user's peak statistics");
        }
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn an_async_move_reads_its_source_before_a_later_in_place_write() {
    run(|| {
        let dev = CudaDevice::get(0)?;
        let stream = dev.new_stream()?;
        let x = Tensor::randn(&[1024, 1024], DType::F32, GPU)?;
        let old = x.to_vec::<f32>()?;
        // The copy is queued behind a 200 ms spin on its stream; the write right after it.
        let _held = super::hold(&stream)?;
        let pending = x.to_async(Device::Cpu, &stream)?;
        x.assign(&Tensor::zeros(x.shape(), DType::F32, GPU)?)?;
        assert!(
            !pending.is_ready(),
            "the copy finished before the write was queued: lengthen the spin"
        );
        let (moved, _) = pending.wait()?;
        assert_eq!(
            moved.to_vec::<f32>()?,
            old,
            "the async move saw an assign issued after it"
        );
        assert!(
            x.to_vec::<f32>()?.iter().all(|&v| v == 0.0),
            "the assign ran"
        );

        // An optimizer step writes its parameter in place the same way.
        let p = Tensor::randn(&[1024, 1024], DType::F32, GPU)?;
        let (g, m, v) = (
            Tensor::ones(p.shape(), DType::F32, GPU)?,
            p.zeros_like()?,
            p.zeros_like()?,
        );
        let old = p.to_vec::<f32>()?;
        let step = AdamStep {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            bias_correction1: 0.1,
            bias_correction2: 0.001,
            decoupled: 0,
            pad: 0,
        };
        // Load the Adam kernel first: loading a module may wait for the whole device, which
        // would let the held copy finish before the step is queued.
        let scratch = || p.zeros_like();
        no_grad_scope(|| scratch()?.adam_update(&scratch()?, &scratch()?, &scratch()?, &step))?;
        let _held = super::hold(&stream)?;
        let pending = p.to_async(Device::Cpu, &stream)?;
        no_grad_scope(|| p.adam_update(&g, &m, &v, &step))?;
        assert!(
            !pending.is_ready(),
            "the copy finished before the step was queued"
        );
        let (moved, _) = pending.wait()?;
        assert_eq!(
            moved.to_vec::<f32>()?,
            old,
            "the async move saw a later adam_update"
        );
        assert_ne!(p.to_vec::<f32>()?, old, "the step ran");
        Ok(())
    });
}

fn no_grad_scope<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    let _guard = no_grad();
    f()
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_move_beyond_the_pinned_budget_lands_in_pageable_memory_with_the_same_values() {
    run(|| {
        let pool = PinnedPool::global()?;
        let x = Tensor::randn(&[1000, 1000], DType::F32, GPU)?;
        let old_budget = pool.budget();
        pool.empty_cache()?;
        pool.set_budget(pool.stats().allocated_bytes + (1 << 20))?;
        let moved = x.to_with(Device::Cpu, MoveOptions::default());
        pool.set_budget(old_budget)?;
        let (y, report) = moved?;
        assert!(
            matches!(report.path, TransferPath::Chunked { .. }),
            "{report}"
        );
        assert!(matches!(
            &*y.storage().read(),
            ferry::tensor::Buffer::Host(_)
        ));
        assert_eq!(y.to_vec::<f32>()?, x.to_vec::<f32>()?);
        Ok(())
    });
}
