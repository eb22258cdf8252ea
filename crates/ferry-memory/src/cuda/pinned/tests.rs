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
    let _host_statistics = crate::host::tests::SERIAL.lock();
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
