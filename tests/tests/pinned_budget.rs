//! The pinned-memory budget: results of moves stay page-locked only within it, the pool's
//! reserved bytes never exceed it, and moves beyond it land in pageable memory with the same
//! values. Process-wide pool statistics: run serialised behind the binary's lock.

use std::time::{Duration, Instant};

use ferry::memory::cuda::{CudaDevice, PinnedPool};
use ferry::memory::{HostPool, MemoryError};
use ferry::{DeviceMove, MoveOptions, TransferPath};
use ferry_tensor::{DType, Device, Tensor};

use super::run;

const GPU: Device = Device::Cuda(0);

/// Sets the pinned budget (after emptying the cache, so no cached block serves what the test
/// expects to be made); puts the old budget back on drop, even when the test fails.
struct PinnedBudget {
    pool: &'static PinnedPool,
    old: usize,
}

impl PinnedBudget {
    fn set(bytes: usize) -> ferry::Result<Self> {
        let pool = PinnedPool::global()?;
        pool.empty_cache()?;
        let old = pool.budget();
        pool.set_budget(bytes)?;
        Ok(Self { pool, old })
    }
}

impl Drop for PinnedBudget {
    fn drop(&mut self) {
        let _ = self.pool.empty_cache();
        let _ = self.pool.set_budget(self.old);
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// (min, median, max) in ms.
fn spread(times: &[Duration]) -> (f64, f64, f64) {
    let mut sorted: Vec<f64> = times.iter().copied().map(ms).collect();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => (0.0, 0.0, 0.0),
        n => (sorted[0], sorted[n / 2], sorted[n - 1]),
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn sixty_four_results_of_400_mb_stay_within_an_8_gib_budget() {
    run(|| {
        const RESULTS: usize = 64;
        const BUDGET: usize = 8 << 30;
        let dev = CudaDevice::get(0)?;
        let pool = PinnedPool::global()?;
        let _budget = PinnedBudget::set(BUDGET)?;
        let x = Tensor::randn(&[10_000, 10_000], DType::F32, GPU)?; // 400 MB
        let expected = x.to_vec::<f32>()?;
        let n = expected.len();
        // A few elements of each result, spread over the whole tensor, first and last included.
        let probes: Vec<usize> = (0..61)
            .map(|k| (k * 1_638_397) % n)
            .chain([0, n / 2, n - 1])
            .collect();
        let check = |y: &Tensor, i: usize| -> ferry::Result<()> {
            assert_eq!(y.shape(), &[10_000, 10_000]);
            let values = y.storage().host::<f32>("check")?;
            for &k in &probes {
                // x + i in f32 on the GPU is the correctly rounded sum, as on the host.
                assert_eq!(values[k], expected[k] + i as f32, "result {i}, element {k}");
            }
            Ok(())
        };
        let mut results = Vec::with_capacity(RESULTS);
        let (mut pinned_times, mut pageable_times) = (Vec::new(), Vec::new());
        let mut most_reserved = 0;
        for i in 0..RESULTS {
            // Distinct values per result: a result sharing or reusing another's memory shows.
            let source = x.add_scalar(i as f64)?;
            dev.synchronize()?;
            let started = Instant::now();
            let (y, report) = source.to_with(Device::Cpu, MoveOptions::default())?;
            let elapsed = started.elapsed();
            drop(source);
            let stats = pool.stats();
            most_reserved = most_reserved.max(stats.reserved_bytes);
            assert!(
                stats.reserved_bytes <= BUDGET,
                "after move {i}, {} bytes are pinned, over the budget: {stats:?}",
                stats.reserved_bytes
            );
            match report.path {
                TransferPath::DeviceToPinned => pinned_times.push(elapsed),
                TransferPath::Chunked { .. } => pageable_times.push(elapsed),
                other => panic!("move {i} took an unexpected path: {other:?}"),
            }
            println!(
                "move {i:2}: {:7.2} ms, {:?}, pinned reserved {:.2} GiB",
                ms(elapsed),
                report.path,
                stats.reserved_bytes as f64 / (1u64 << 30) as f64
            );
            check(&y, i)?;
            results.push(y);
        }
        // All alive at once: every value is still its own.
        for (i, y) in results.iter().enumerate() {
            check(y, i)?;
        }
        let fits = BUDGET / PinnedPool::block_size(x.nbytes());
        assert!(
            !pinned_times.is_empty() && pinned_times.len() <= fits,
            "{} results landed pinned; at most {fits} fit",
            pinned_times.len()
        );
        assert_eq!(pinned_times.len() + pageable_times.len(), RESULTS);
        let (pmin, pmed, pmax) = spread(&pinned_times);
        let (qmin, qmed, qmax) = spread(&pageable_times);
        println!(
            "64 x 400 MB cpu() under an 8 GiB pinned budget: most pinned reserved {:.2} GiB; \
             {} results pinned (min/median/max {pmin:.2}/{pmed:.2}/{pmax:.2} ms), \
             {} beyond the budget in pageable memory ({qmin:.2}/{qmed:.2}/{qmax:.2} ms)",
            most_reserved as f64 / (1u64 << 30) as f64,
            pinned_times.len(),
            pageable_times.len()
        );
        drop(results);
        let after = pool.stats();
        assert!(after.reserved_bytes <= BUDGET, "{after:?}");
        assert_eq!(after.allocated_bytes, 0, "{after:?}");
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn non_blocking_moves_beyond_the_budget_run_blocking_into_pageable_memory() {
    run(|| {
        let pool = PinnedPool::global()?;
        let stream = CudaDevice::get(0)?.new_stream()?;
        // 96 MiB: the result needs a 96 MiB block, the staging two 32 MiB ones.
        let x = Tensor::randn(&[24 << 10, 1024], DType::F32, GPU)?;
        let expected = x.to_vec::<f32>()?;
        let is_pageable =
            |y: &Tensor| matches!(&*y.storage().read(), ferry::tensor::Buffer::Host(_));

        // Room for the staging, not for the result.
        let budget = PinnedBudget::set(80 << 20)?;
        let (y, report) = x.to_with(Device::Cpu, MoveOptions::non_blocking())?;
        assert_eq!(report.path, TransferPath::Chunked { chunks: 3 }, "{report}");
        assert_eq!(report.staging_peak_bytes, 64 << 20, "{report}");
        assert!(is_pageable(&y));
        assert_eq!(y.to_vec::<f32>()?, expected);
        assert!(pool.stats().reserved_bytes <= 80 << 20);
        let pending = x.to_async(Device::Cpu, &stream)?;
        assert!(
            pending.is_ready(),
            "beyond the budget, to_async runs blocking"
        );
        let (y, report) = pending.wait()?;
        assert!(
            matches!(report.path, TransferPath::Chunked { .. }),
            "{report}"
        );
        assert!(is_pageable(&y));
        assert_eq!(y.to_vec::<f32>()?, expected);
        drop(budget);

        // No room even for staging: the driver's pageable path, same values.
        let budget = PinnedBudget::set(1 << 20)?;
        let (y, report) = x.to_with(Device::Cpu, MoveOptions::non_blocking())?;
        assert!(
            matches!(report.path, TransferPath::Chunked { .. }),
            "{report}"
        );
        assert_eq!(report.staging_peak_bytes, 0, "{report}");
        assert_eq!(y.to_vec::<f32>()?, expected);
        // Asked directly, the pool refuses and says how to change the budget.
        match pool.alloc(x.nbytes()) {
            Err(err @ MemoryError::PinnedBudgetExceeded { .. }) => {
                assert!(err.to_string().contains("set_budget"), "{err}");
            }
            other => panic!("expected PinnedBudgetExceeded, got {other:?}"),
        }
        drop(budget);

        // Within the budget, a non-blocking move lands pinned.
        let _budget = PinnedBudget::set(1 << 30)?;
        let (y, report) = x.to_with(Device::Cpu, MoveOptions::non_blocking())?;
        assert_eq!(report.path, TransferPath::DeviceToPinned, "{report}");
        assert!(!is_pageable(&y));
        assert_eq!(y.to_vec::<f32>()?, expected);
        Ok(())
    });
}

#[test]
fn the_budgets_are_set_and_read_through_the_facade() {
    run(|| {
        // The pinned pool needs a GPU: without one each call is an error value, not a panic.
        match ferry::cuda::pinned::budget() {
            Ok(budget) => {
                ferry::cuda::pinned::set_budget(budget / 2)?;
                assert_eq!(ferry::cuda::pinned::budget()?, budget / 2);
                assert_eq!(ferry::cuda::pinned::stats()?.budget_bytes, budget / 2);
                ferry::cuda::pinned::set_budget(budget)?;
            }
            Err(_) => {
                assert!(!ferry::cuda::is_available());
                assert!(ferry::cuda::pinned::set_budget(1 << 30).is_err());
            }
        }
        // The host pool works everywhere: beyond its budget a request gets a plain buffer.
        let old = ferry::host::pool_budget();
        ferry::host::empty_cache();
        ferry::host::set_pool_budget(8 << 20);
        let before = ferry::host::pool_stats();
        assert_eq!(before.budget_bytes, 8 << 20);
        let outside = HostPool::global().alloc(12 << 20)?;
        let after = ferry::host::pool_stats();
        assert_eq!(after.beyond_budget, before.beyond_budget + 1);
        assert!(after.reserved_bytes <= 8 << 20, "{after:?}");
        let inside = HostPool::global().alloc(6 << 20)?;
        assert_eq!(ferry::host::pool_stats().allocated_bytes, 6 << 20);
        drop((outside, inside));
        assert_eq!(ferry::host::pool_stats().cached_bytes(), 6 << 20);
        ferry::host::set_pool_budget(old);
        ferry::host::empty_cache();
        assert_eq!(ferry::host::pool_stats().reserved_bytes, 0);
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_host_tensor_pinned_in_place_moves_without_staging_and_counts_in_the_budget() {
    run(|| {
        let _budget = PinnedBudget::set(1 << 30)?;
        let pool = PinnedPool::global()?;
        let x = Tensor::rand(&[64 << 20 >> 2], DType::F32, Device::Cpu)?;
        let expected = x.to_vec::<f32>()?;
        // Pageable: 64 MiB goes through the staging pipeline.
        let (_, pageable) = x.to_with(GPU, MoveOptions::default())?;
        assert!(pageable.staging_peak_bytes > 0, "{pageable}");
        let before = pool.stats().registered_bytes;
        assert!(x.pin_in_place()?);
        assert_eq!(pool.stats().registered_bytes, before + x.nbytes());
        assert!(!x.pin_in_place()?, "pinned twice");
        // Page-locked: one DMA straight from where it is.
        let (y, pinned) = x.to_with(GPU, MoveOptions::default())?;
        assert_eq!(pinned.staging_peak_bytes, 0, "{pinned}");
        assert_eq!(y.to_vec::<f32>()?, expected);
        drop(x);
        assert_eq!(pool.stats().registered_bytes, before);
        // A GPU tensor has nothing to pin; a budget without room refuses, naming it.
        assert!(y.pin_in_place().is_err());
        // (Cached staging blocks would be trimmed to make room: none are left.)
        pool.empty_cache()?;
        pool.set_budget(pool.stats().reserved_bytes + (1 << 20))?;
        let big = Tensor::zeros(&[16 << 20 >> 2], DType::F32, Device::Cpu)?;
        let err = big.pin_in_place().unwrap_err().to_string();
        assert!(err.contains("FERRY_PINNED_BUDGET"), "{err}");
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn order_stream_keeps_a_callers_stream_behind_an_async_copy() {
    run(|| {
        let dev = CudaDevice::get(0)?;
        let copy = dev.new_stream()?;
        let caller = dev.new_stream()?;
        let x = Tensor::ones(&[16 << 20], DType::F32, GPU)?;
        let pending = x.to_async(Device::Cpu, &copy)?;
        pending.order_stream(&caller)?;
        // The caller's stream now completes only after the copy: an event recorded there is
        // done once it is, and the copy is then done too.
        let marker = caller.record()?;
        marker.synchronize()?;
        assert!(
            pending.is_ready(),
            "the caller's stream ran ahead of the copy"
        );
        let (y, _) = pending.wait()?;
        assert!(y.to_vec::<f32>()?.iter().all(|&v| v == 1.0));
        Ok(())
    });
}
