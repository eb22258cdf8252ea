//! Behaviour of the CUDA layer on a real GPU. Every test is ignored on machines without one;
//! run them with `cargo test -p ferry-memory --test cuda -- --ignored`. Tests that need a kernel
//! or a CUDA library (kernels as slow producers included) are ferry-cuda's.
//!
//! The tests share one device and its allocator, so each holds a process-wide lock: statistics
//! compared before and after would otherwise see other tests' buffers.

use std::sync::{Mutex, MutexGuard};

use ferry_memory::MemoryError;
use ferry_memory::cuda::{CudaDevice, Event, PinnedPool};

static ONE_TEST_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The first GPU, with the lock that keeps other tests off it; fails with the reason otherwise.
fn gpu() -> (MutexGuard<'static, ()>, CudaDevice) {
    let guard = ONE_TEST_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let device = CudaDevice::get(0)
        .unwrap_or_else(|e| panic!("this test needs CUDA device 0, and getting it failed: {e}"));
    (guard, device)
}

/// Deterministic pseudo-random bytes (xorshift64*), so a failure reproduces.
fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    (0..len)
        .map(|_| {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA device"]
fn statistics_return_to_baseline_after_buffers_drop() {
    let (_lock, dev) = gpu();
    let stream = dev.default_stream();
    let before = dev.memory_stats();
    let sizes = [100, 5000, 3 << 20];
    let buffers: Vec<_> = sizes
        .iter()
        .map(|&n| dev.alloc(n, stream).unwrap())
        .collect();
    let during = dev.memory_stats();
    // 100 -> 512, 5000 -> 5120, 3 MiB -> 4 MiB.
    assert_eq!(
        during.allocated_bytes - before.allocated_bytes,
        512 + 5120 + (4 << 20)
    );
    assert_eq!(during.allocations - before.allocations, 3);
    assert!(during.peak_allocated_bytes >= during.allocated_bytes);
    drop(buffers);
    let after = dev.memory_stats();
    assert_eq!(after.allocated_bytes, before.allocated_bytes);
    assert_eq!(after.frees - before.frees, 3);
    assert!(
        after.reserved_bytes >= during.allocated_bytes - before.allocated_bytes,
        "freed blocks stay cached"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn repeated_same_size_allocations_hit_the_cache() {
    let (_lock, dev) = gpu();
    let stream = dev.default_stream();
    drop(dev.alloc(6 << 20, stream).unwrap());
    let before = dev.memory_stats();
    for _ in 0..10 {
        let buffer = dev.alloc(6 << 20, stream).unwrap();
        assert_eq!(buffer.len(), 6 << 20);
    }
    let after = dev.memory_stats();
    assert_eq!(after.cache_hits - before.cache_hits, 10);
    assert_eq!(
        after.device_allocations, before.device_allocations,
        "no cuMemAlloc for a cached size"
    );
    assert_eq!(after.reserved_bytes, before.reserved_bytes);
}

#[test]
#[ignore = "needs a CUDA device"]
fn empty_cache_brings_reserved_down_to_allocated() {
    let (_lock, dev) = gpu();
    let stream = dev.default_stream();
    let kept = dev.alloc(1 << 20, stream).unwrap();
    drop(dev.alloc(8 << 20, stream).unwrap());
    let cached = dev.memory_stats();
    assert!(cached.reserved_bytes >= cached.allocated_bytes + (8 << 20));
    dev.empty_cache().unwrap();
    let emptied = dev.memory_stats();
    assert_eq!(emptied.reserved_bytes, emptied.allocated_bytes);
    assert!(emptied.allocated_bytes >= kept.len());
    drop(kept);
}

#[test]
#[ignore = "needs a CUDA device"]
fn an_impossible_request_is_an_error_and_the_device_keeps_working() {
    let (_lock, dev) = gpu();
    let stream = dev.default_stream();
    let requested = 200usize << 30; // 200 GiB on a 141 GB card
    match dev.alloc(requested, stream) {
        Err(err @ MemoryError::DeviceOutOfMemory { .. }) => {
            let MemoryError::DeviceOutOfMemory {
                requested: asked,
                memory,
                ..
            } = &err
            else {
                unreachable!()
            };
            assert_eq!(*asked, requested);
            let memory = memory.expect("the driver reports free and total memory");
            assert!(memory.total_bytes >= 1 << 30, "{memory:?}");
            assert!(memory.free_bytes <= memory.total_bytes, "{memory:?}");
            let text = err.to_string();
            for needle in [
                "200.00 GiB",
                "in total",
                "free",
                "used outside ferry's allocator (other processes",
                "ferry::cuda::empty_cache",
            ] {
                assert!(text.contains(needle), "`{needle}` missing from: {text}");
            }
            println!("the out-of-memory message on this GPU: {text}");
        }
        other => panic!("expected DeviceOutOfMemory, got {other:?}"),
    }
    let data = random_bytes(1 << 20, 7);
    let mut buffer = dev.alloc(data.len(), stream).unwrap();
    buffer.copy_from_host(&data, stream).unwrap();
    let mut back = vec![0; data.len()];
    buffer.copy_to_host(&mut back, stream).unwrap();
    assert_eq!(back, data);
}

#[test]
#[ignore = "needs a CUDA device"]
fn requests_near_usize_max_are_refused_naming_the_limit() {
    let (_lock, dev) = gpu();
    let pool = PinnedPool::global().unwrap();
    // A small idle block in the cache: an unchecked class of usize::MAX - 1 wrapped to 0, and
    // this block was handed out for the whole length.
    drop(pool.alloc(4096).unwrap());
    let before = pool.stats();
    for len in [usize::MAX, usize::MAX - 1] {
        match pool.alloc(len) {
            Err(MemoryError::RequestTooLarge {
                op,
                requested,
                limit,
            }) => {
                assert_eq!((op, requested), ("PinnedPool::alloc", len));
                // The limit is a class of its own, and nothing above it is.
                assert_eq!(PinnedPool::block_size(limit), limit);
                assert_eq!(PinnedPool::block_size(limit + 1), usize::MAX);
            }
            other => panic!("PinnedPool::alloc({len}) gave {other:?}"),
        }
        match dev.alloc(len, dev.default_stream()) {
            Err(MemoryError::RequestTooLarge {
                op,
                requested,
                limit,
            }) => {
                assert_eq!((op, requested), ("CudaDevice::alloc", len));
                assert_eq!(CudaDevice::block_size(limit), limit);
                assert_eq!(CudaDevice::block_size(limit + 1), usize::MAX);
            }
            other => panic!("CudaDevice::alloc({len}) gave {other:?}"),
        }
    }
    let after = pool.stats();
    assert_eq!(
        after.cache_hits, before.cache_hits,
        "a cached block was handed out"
    );
    assert_eq!(after.cached_bytes, before.cached_bytes);
}

#[test]
#[ignore = "needs a CUDA device"]
fn pageable_round_trip_and_device_copies_are_exact() {
    let (_lock, dev) = gpu();
    let stream = dev.default_stream();
    let data = random_bytes((3 << 20) + 1, 1);
    let mut first = dev.alloc(data.len(), stream).unwrap();
    first.copy_from_host(&data, stream).unwrap();
    let mut second = dev.alloc_zeroed(data.len(), stream).unwrap();
    second.copy_from_device(&first, stream).unwrap();
    let mut back = vec![0; data.len()];
    second.copy_to_host(&mut back, stream).unwrap();
    assert_eq!(back, data);

    // A region: bytes 10..110 of `first` to 1000..1100 of a zeroed buffer.
    let mut third = dev.alloc_zeroed(4096, stream).unwrap();
    third.copy_region(1000, &first, 10, 100, stream).unwrap();
    let mut region = vec![0xff; 4096];
    third.copy_to_host(&mut region, stream).unwrap();
    assert!(
        region[..1000]
            .iter()
            .chain(&region[1100..])
            .all(|&b| b == 0)
    );
    assert_eq!(&region[1000..1100], &data[10..110]);

    assert!(matches!(
        first.copy_from_host(&data[1..], stream),
        Err(MemoryError::LengthMismatch { .. })
    ));
    assert!(matches!(
        third.copy_region(4000, &first, 0, 100, stream),
        Err(MemoryError::OutOfBounds { .. })
    ));
}

#[test]
#[ignore = "needs a CUDA device"]
fn pinned_round_trips_sync_and_async_are_exact() {
    let (_lock, dev) = gpu();
    let pool = PinnedPool::global().unwrap();
    let stream = dev.new_stream().unwrap();
    let data = random_bytes(64 << 20, 2);
    let mut src = pool.alloc(data.len()).unwrap();
    src.copy_from_slice(&data);
    let mut device = dev.alloc(data.len(), &stream).unwrap();
    device.copy_from_pinned_async(&mut src, &stream).unwrap();
    let mut dst = pool.alloc(data.len()).unwrap();
    device.copy_to_pinned_async(&mut dst, &stream).unwrap();
    dst.wait().unwrap();
    assert!(dst.is_ready());
    assert_eq!(dst.as_bytes().unwrap(), &data[..]);

    // The synchronous path into a pinned destination reads the same bytes.
    let mut sync_copy = pool.alloc(data.len()).unwrap();
    device.copy_to_host(&mut sync_copy, &stream).unwrap();
    assert_eq!(&sync_copy[..], &data[..]);
}

#[test]
#[ignore = "needs a CUDA device"]
fn registered_host_memory_receives_copies() {
    let (_lock, dev) = gpu();
    let stream = dev.default_stream();
    let data = random_bytes(8 << 20, 3);
    let mut device = dev.alloc(data.len(), stream).unwrap();
    device.copy_from_host(&data, stream).unwrap();
    let mut host = vec![0u8; data.len()];
    {
        let mut registered = dev.register_host(&mut host).unwrap();
        device.copy_to_host(&mut registered, stream).unwrap();
    }
    assert_eq!(host, data);
}

#[test]
#[ignore = "needs a CUDA device"]
fn pinned_pool_reuses_blocks_and_bounds_rounding_waste() {
    let (_lock, _dev) = gpu();
    let pool = PinnedPool::global().unwrap();
    pool.empty_cache().unwrap();
    let before = pool.stats();
    let sizes = [5000, 70_001, 123_457, 1_000_001, 3_333_333, 50_000_001];
    let requested: usize = sizes.iter().sum();
    let buffers: Vec<_> = sizes.iter().map(|&n| pool.alloc(n).unwrap()).collect();
    let held = pool.stats();
    let reserved = held.reserved_bytes - before.reserved_bytes;
    assert!(
        reserved as f64 <= 1.125 * requested as f64,
        "{reserved} reserved for {requested} requested"
    );
    drop(buffers);
    let buffers: Vec<_> = sizes.iter().map(|&n| pool.alloc(n).unwrap()).collect();
    let again = pool.stats();
    assert_eq!(again.cache_hits - held.cache_hits, sizes.len() as u64);
    assert_eq!(again.host_allocations, held.host_allocations);
    drop(buffers);
    pool.empty_cache().unwrap();
    let emptied = pool.stats();
    assert_eq!(emptied.reserved_bytes, emptied.allocated_bytes);
}

#[test]
#[ignore = "needs a CUDA device"]
fn events_time_a_large_copy() {
    let (_lock, dev) = gpu();
    let stream = dev.new_stream().unwrap();
    let src = dev.alloc_zeroed(256 << 20, &stream).unwrap();
    let mut dst = dev.alloc(256 << 20, &stream).unwrap();
    let start = stream.record_timed().unwrap();
    dst.copy_from_device(&src, &stream).unwrap();
    let end = stream.record_timed().unwrap();
    let ms = Event::elapsed_ms(&start, &end).unwrap();
    assert!(ms > 0.0, "a 256 MiB device copy took {ms} ms");
    assert!(end.query().unwrap());
    let untimed = stream.record().unwrap();
    assert!(matches!(
        Event::elapsed_ms(&start, &untimed),
        Err(MemoryError::EventTimingDisabled)
    ));
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_stream_waits_for_another_streams_event() {
    let (_lock, dev) = gpu();
    let pool = PinnedPool::global().unwrap();
    let (producer, consumer) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let data = random_bytes(128 << 20, 4);
    let mut staged = pool.alloc(data.len()).unwrap();
    staged.copy_from_slice(&data);
    let mut written = dev.alloc(data.len(), &producer).unwrap();
    written
        .copy_from_pinned_async(&mut staged, &producer)
        .unwrap();
    let produced = producer.record().unwrap();
    consumer.wait_event(&produced).unwrap();
    // Without the wait, this copy could read `written` before the upload finished.
    let mut copy = dev.alloc(data.len(), &consumer).unwrap();
    copy.copy_from_device(&written, &consumer).unwrap();
    let mut back = vec![0; data.len()];
    copy.copy_to_host(&mut back, &consumer).unwrap();
    assert_eq!(back, data);
}

#[test]
#[ignore = "needs two CUDA devices"]
fn peer_copy_between_two_gpus_is_exact() {
    let (_lock, first) = gpu();
    // With --include-ignored on a one-GPU machine this is a visible skip, not a pass.
    let Ok(second) = CudaDevice::get(1) else {
        eprintln!("skipped: peer copy needs two CUDA devices; this machine has one");
        return;
    };
    match first.enable_peer_access(&second) {
        Ok(()) | Err(MemoryError::PeerAccessUnsupported { .. }) => {}
        Err(e) => panic!("enable_peer_access failed: {e}"),
    }
    let data = random_bytes(16 << 20, 5);
    let mut src = first.alloc(data.len(), first.default_stream()).unwrap();
    src.copy_from_host(&data, first.default_stream()).unwrap();
    let mut dst = second.alloc(data.len(), second.default_stream()).unwrap();
    dst.copy_from_peer(&src, second.default_stream()).unwrap();
    let mut back = vec![0; data.len()];
    dst.copy_to_host(&mut back, second.default_stream())
        .unwrap();
    assert_eq!(back, data);
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_pinned_batch_gathers_and_scatters_regions_with_one_event() {
    let (_lock, dev) = gpu();
    let pool = PinnedPool::global().unwrap();
    let stream = dev.default_stream();
    let (a, b) = (random_bytes(3000, 11), random_bytes(5000, 12));
    let mut da = dev.alloc(a.len(), stream).unwrap();
    let mut db = dev.alloc(b.len(), stream).unwrap();
    da.copy_from_host(&a, stream).unwrap();
    db.copy_from_host(&b, stream).unwrap();

    // Gather: a at 0, the second half of b at 4096.
    let mut arena = pool.alloc(8192).unwrap();
    let mut batch = arena.batch(stream).unwrap();
    batch.download(&da, 0, 0, a.len()).unwrap();
    batch.download(&db, 2500, 4096, 2500).unwrap();
    assert_eq!(batch.queued(), 2);
    let err = batch.download(&db, 0, 8000, 500).unwrap_err();
    assert!(matches!(err, MemoryError::OutOfBounds { .. }), "{err}");
    batch.finish().unwrap();
    assert_eq!(&arena[..a.len()], &a[..]);
    assert_eq!(&arena[4096..6596], &b[2500..]);

    // Scatter back: b's second half over a's start.
    let mut batch = arena.batch(stream).unwrap();
    batch.upload(&mut da, 0, 4096, 2500).unwrap();
    batch.finish().unwrap();
    let mut back = vec![0u8; a.len()];
    da.copy_to_host(&mut back, stream).unwrap();
    assert_eq!(&back[..2500], &b[2500..]);
    assert_eq!(&back[2500..], &a[2500..]);
}

/// Sets the pinned pool's budget for a test; puts it back (emptying the cache) on drop.
struct PinnedBudget {
    pool: &'static PinnedPool,
    old: usize,
}

impl PinnedBudget {
    fn set(bytes: usize) -> Self {
        let pool = PinnedPool::global().unwrap();
        pool.empty_cache().unwrap();
        let old = pool.budget();
        pool.set_budget(bytes).unwrap();
        Self { pool, old }
    }
}

impl Drop for PinnedBudget {
    fn drop(&mut self) {
        let _ = self.pool.empty_cache();
        let _ = self.pool.set_budget(self.old);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_pinned_block_serves_a_request_one_class_smaller_but_not_two() {
    let (_lock, _dev) = gpu();
    let pool = PinnedPool::global().unwrap();
    let _budget = PinnedBudget::set(1 << 30);
    // From 8 MiB to 16 MiB the classes are 1 MiB apart (8, 9, 10, ..); below 8 MiB, 512 KiB
    // apart (.., 7, 7.5 MiB).
    drop(pool.alloc(9 << 20).unwrap());
    let before = pool.stats();
    // One class smaller: an 8 MiB request takes the cached 9 MiB block.
    let eight = pool.alloc(8 << 20).unwrap();
    assert_eq!(eight.block_size(), 9 << 20);
    assert_eq!(pool.stats().cache_hits, before.cache_hits + 1);
    assert_eq!(
        pool.stats().allocated_bytes,
        before.allocated_bytes + (9 << 20)
    );
    drop(eight);
    // Two classes smaller (7.5 MiB) does not.
    let smaller = pool.alloc((15 << 20) / 2).unwrap();
    assert_eq!(smaller.block_size(), (15 << 20) / 2);
    assert_eq!(pool.stats().cache_hits, before.cache_hits + 1);
    drop(smaller);
    // Staging that must stay within a bound takes its own class only.
    let exact = pool.alloc_exact(8 << 20).unwrap();
    assert_eq!(exact.block_size(), 8 << 20);
    assert_eq!(pool.stats().cache_hits, before.cache_hits + 1);
    drop(exact);
    let stats = pool.stats();
    assert_eq!(
        stats.reserved_bytes,
        stats.allocated_bytes + stats.cached_bytes
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_pinned_budget_trims_the_oldest_block_and_refuses_what_live_blocks_leave_no_room_for() {
    let (_lock, _dev) = gpu();
    let pool = PinnedPool::global().unwrap();
    let _budget = PinnedBudget::set(40 << 20);
    let before = pool.stats();
    assert_eq!(before.budget_bytes, 40 << 20);
    // 12 MiB blocks (granule 1 MiB): a, b, c cached in that order, 36 of 40 MiB.
    let (a, b, c) = (
        pool.alloc(12 << 20).unwrap(),
        pool.alloc(12 << 20).unwrap(),
        pool.alloc(12 << 20).unwrap(),
    );
    let mut kept = [b.as_ptr(), c.as_ptr()];
    drop((a, b, c));
    // 16 MiB more needs 12 MiB of room: the least recently cached, a, goes.
    let d = pool.alloc(16 << 20).unwrap();
    let stats = pool.stats();
    assert_eq!(stats.trimmed_blocks, before.trimmed_blocks + 1);
    assert_eq!(stats.reserved_bytes, 40 << 20);
    let (e, f) = (pool.alloc(12 << 20).unwrap(), pool.alloc(12 << 20).unwrap());
    let mut got = [e.as_ptr(), f.as_ptr()];
    got.sort();
    kept.sort();
    assert_eq!(
        got, kept,
        "a block other than the least recently used one was trimmed"
    );
    // Live blocks fill the budget: the pool refuses, naming the budget and the fix.
    match pool.alloc(4 << 20) {
        Err(err @ MemoryError::PinnedBudgetExceeded { .. }) => {
            let text = err.to_string();
            assert!(
                text.contains("set_budget") && text.contains("40.00 MiB"),
                "{text}"
            );
        }
        other => panic!("expected PinnedBudgetExceeded, got {other:?}"),
    }
    let stats = pool.stats();
    assert_eq!(stats.budget_refusals, before.budget_refusals + 1);
    assert!(stats.reserved_bytes <= stats.budget_bytes, "{stats:?}");
    // Lowering the budget trims idle blocks once they are back.
    drop((d, e, f));
    pool.set_budget(20 << 20).unwrap();
    let stats = pool.stats();
    assert!(stats.reserved_bytes <= 20 << 20, "{stats:?}");
}

/// Lifts the device budget when the test ends, passed or not: the other tests share the device.
struct BudgetLifted(CudaDevice);

impl Drop for BudgetLifted {
    fn drop(&mut self) {
        self.0.set_budget(None);
    }
}

/// A device budget: what fits is allocated, cached blocks are given back to make room, and
/// what does not fit is the out-of-memory error, naming the budget, its variable and the fixes.
#[test]
#[ignore = "needs a CUDA device"]
fn the_device_budget_caps_the_allocator_and_its_error_names_it() {
    let (_guard, device) = gpu();
    device.empty_cache().unwrap();
    let base = device.memory_stats().reserved_bytes;
    let lifted = BudgetLifted(device.clone());
    let stream = device.default_stream().clone();
    device.set_budget(Some(base + (64 << 20)));
    assert_eq!(device.budget(), Some(base + (64 << 20)));

    let a = device.alloc(40 << 20, &stream).unwrap();
    drop(a);
    // 40 MiB cached and 48 MiB wanted: the cache goes back to the driver, then it fits.
    let b = device.alloc(48 << 20, &stream).unwrap();
    assert!(device.memory_stats().reserved_bytes <= base + (64 << 20));
    match device.alloc(32 << 20, &stream) {
        Err(err @ MemoryError::DeviceBudgetExceeded { .. }) => {
            let text = err.to_string();
            for needle in ["FERRY_DEVICE_BUDGET", "32.00 MiB", "OffloadAdamW", "cuda:0"] {
                assert!(text.contains(needle), "{needle:?} missing from: {text}");
            }
        }
        other => panic!("expected DeviceBudgetExceeded, got {other:?}"),
    }
    drop(b);
    drop(lifted);
    assert_eq!(device.budget(), None);
    device.alloc(96 << 20, &stream).unwrap();
}
