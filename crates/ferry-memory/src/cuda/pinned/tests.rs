//! The pool's lock is not held across making a block: a cache hit completes while another
//! thread is inside that slow part (held there by a test gate, so this is an ordering test,
//! not a timing threshold). Needs a GPU.

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use super::PinnedPool;
use crate::cuda::test_hooks::{SERIAL, Slow, arm};

const BIG: usize = 1 << 30;
const SMALL: usize = 64 << 10;

/// Raises the budget for the test if needed; puts it back on drop.
struct Room {
    pool: &'static PinnedPool,
    budget: usize,
}

impl Room {
    fn for_bytes(pool: &'static PinnedPool, bytes: usize) -> Self {
        let budget = pool.budget();
        let needed = pool.stats().reserved_bytes + bytes;
        if budget < needed {
            pool.set_budget(needed).unwrap();
        }
        Self { pool, budget }
    }
}

impl Drop for Room {
    fn drop(&mut self) {
        let _ = self.pool.set_budget(self.budget);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_cache_hit_does_not_wait_for_another_thread_making_a_block() {
    // The host pool's tests take these two locks in this order too.
    let _host_statistics = crate::host::tests::stats_turn();
    let _serial = SERIAL.lock();
    let pool = PinnedPool::global().unwrap();
    let _room = Room::for_bytes(pool, BIG + (SMALL << 4));
    // A small block in the cache, and no 1 GiB one: the big request must make its block.
    pool.empty_cache().unwrap();
    drop(pool.alloc(SMALL).unwrap());

    let gate = arm(Slow::PinnedMake);
    let maker = thread::spawn(move || {
        let started = Instant::now();
        let len = pool.alloc(BIG).map(|b| b.len());
        (len, started.elapsed())
    });
    assert!(
        gate.entered(Duration::from_secs(120)),
        "the 1 GiB request never reached the making of its block"
    );
    // The maker is inside its slow part now, holding a reservation but (if the pool is right)
    // not the lock.
    let (done_tx, done_rx) = mpsc::channel();
    let small = thread::spawn(move || {
        let started = Instant::now();
        let len = pool.alloc(SMALL).map(|b| b.len());
        let _ = done_tx.send((len, started.elapsed()));
    });
    let small_outcome = done_rx.recv_timeout(Duration::from_secs(30));
    let maker_done_first = maker.is_finished();
    gate.release();
    let (big_len, big_time) = maker.join().unwrap();
    small.join().unwrap();
    let (small_len, small_time) = small_outcome.expect(
        "a 64 KiB cache hit waited while another thread made a 1 GiB block: the pool's lock is held across making blocks",
    );
    assert!(!maker_done_first, "the gate did not hold the maker");
    assert_eq!(small_len.unwrap(), SMALL);
    assert_eq!(big_len.unwrap(), BIG);
    println!(
        "held at the gate: 64 KiB cache hit {:.3} ms while the 1 GiB request took {:.1} ms (gate included)",
        small_time.as_secs_f64() * 1e3,
        big_time.as_secs_f64() * 1e3
    );

    // Without the gate: the figures the lead reports. Cache hits run while the block is made.
    pool.empty_cache().unwrap();
    drop(pool.alloc(SMALL).unwrap());
    let maker = thread::spawn(move || {
        let started = Instant::now();
        let buffer = pool.alloc(BIG).unwrap();
        (started.elapsed(), buffer)
    });
    let mut hits = Vec::new();
    while !maker.is_finished() {
        let started = Instant::now();
        drop(pool.alloc(SMALL).unwrap());
        hits.push(started.elapsed());
    }
    let (big_time, buffer) = maker.join().unwrap();
    drop(buffer);
    let slowest = hits.iter().max().copied().unwrap_or_default();
    println!(
        "ungated: making a 1 GiB pinned block took {:.1} ms; meanwhile {} cache hits of 64 KiB, the slowest {:.3} ms",
        big_time.as_secs_f64() * 1e3,
        hits.len(),
        slowest.as_secs_f64() * 1e3
    );
    pool.empty_cache().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_block_used_on_another_stream_is_reused_only_after_that_work() {
    use crate::cuda::CudaDevice;
    use crate::cuda::test_hooks::hold;

    let _host_statistics = crate::host::tests::stats_turn();
    let _serial = SERIAL.lock();
    let pool = PinnedPool::global().unwrap();
    let _room = Room::for_bytes(pool, 4 * SMALL);
    pool.empty_cache().unwrap();
    let dev = CudaDevice::get(0).unwrap();
    let stream = dev.new_stream().unwrap();
    // Work another runtime queued there (a copy torch reads the block with), not done yet.
    let held = hold(&stream);
    let buffer = pool.alloc(SMALL).unwrap();
    let first = buffer.as_bytes().unwrap().as_ptr();
    buffer.record_stream(&stream);
    drop(buffer);
    let while_held = pool.alloc(SMALL).unwrap();
    let reused_under_the_copy = while_held.as_bytes().unwrap().as_ptr() == first;
    held.release();
    stream.synchronize().unwrap();
    drop(while_held);
    assert!(
        !reused_under_the_copy,
        "the pool handed out a block while work recorded on another stream still used it"
    );
    // Once that work is done the block is reused as usual.
    let hits = pool.stats().cache_hits;
    let again = pool.alloc(SMALL).unwrap();
    assert_eq!(pool.stats().cache_hits, hits + 1);
    drop(again);
    pool.empty_cache().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn memory_pinned_in_place_counts_in_the_budget_until_its_buffer_drops() {
    use crate::{HostBuffer, MemoryError};

    let _host_statistics = crate::host::tests::stats_turn();
    let _serial = SERIAL.lock();
    let pool = PinnedPool::global().unwrap();
    let len = 8 << 20;
    let _room = Room::for_bytes(pool, len);
    let before = pool.stats();
    let buffer = HostBuffer::zeroed(len).unwrap();
    assert!(!PinnedPool::is_page_locked(&buffer));
    assert!(pool.pin_in_place(&buffer).unwrap());
    assert!(PinnedPool::is_page_locked(&buffer));
    let pinned = pool.stats();
    assert_eq!(pinned.registered_bytes, before.registered_bytes + len);
    assert_eq!(pinned.reserved_bytes, before.reserved_bytes + len);
    // Pinned already: nothing more is locked or counted.
    assert!(!pool.pin_in_place(&buffer).unwrap());
    assert_eq!(pool.stats().registered_bytes, pinned.registered_bytes);
    drop(buffer);
    let after = pool.stats();
    assert_eq!(after.registered_bytes, before.registered_bytes);
    assert_eq!(after.reserved_bytes, before.reserved_bytes);

    // A budget without room refuses, naming the budget.
    pool.empty_cache().unwrap();
    let budget = pool.budget();
    pool.set_budget(pool.stats().reserved_bytes + (1 << 20))
        .unwrap();
    let big = HostBuffer::zeroed(len).unwrap();
    let refused = pool.pin_in_place(&big);
    pool.set_budget(budget).unwrap();
    match refused {
        Err(err @ MemoryError::PinnedBudgetExceeded { .. }) => {
            assert!(err.to_string().contains("FERRY_PINNED_BUDGET"), "{err}")
        }
        other => panic!("expected PinnedBudgetExceeded, got {other:?}"),
    }
    assert!(!PinnedPool::is_page_locked(&big));
}
