//! Host-memory counters: one atomic total, with small buffers batched per thread.
//!
//! Every large allocation adds to one shared total (and frees subtract), so that total, and the
//! highest value it ever took, follow a real order of the allocations. Small buffers go through
//! a per-thread batch first (see [`SMALL`] below). The price of the shared total is one cache
//! line that every allocating thread writes. Measured on the H200 host (16 cores, 2026-11-30; a scratch benchmark, each
//! variant built from this crate, 13 runs of each, interleaved):
//!
//! | 16 threads                                | no counters | this | per-thread shards |
//! |-------------------------------------------|-------------|------|-------------------|
//! | `HostBuffer::zeroed(16 KiB)`, M/s         | 60-83       | 7-9  | 59-75             |
//! | training steps/s, mean (64x64, 5 ops+bwd) | 393k        | 366k | 382k              |
//!
//! The training loop, which is what ferry runs, loses about 7% at 16 threads and 5% at 8
//! (single runs vary by 10%); per-thread shards would lose about 3%, but cannot give an exact
//! peak: a peak of the sum needs the sum at every allocation. A sharded variant that kept the
//! peak exact by handing out headroom (threads allocate within a quota; an empty quota freezes
//! every shard to count) was tried and measured 4-7x slower at 8-16 threads, because a busy
//! process sits near its own peak, where the quotas run dry. A microbenchmark that does
//! nothing but allocate tops out near 8 M allocations a second process-wide with this design.

use std::sync::atomic::{AtomicIsize, AtomicU64, AtomicUsize, Ordering};

/// Counts at one instant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    pub(crate) live: usize,
    pub(crate) peak: usize,
    pub(crate) allocations: u64,
}

/// Keeps what it holds on cache lines of its own (128 bytes: adjacent-line prefetch pairs lines).
#[repr(align(128))]
struct Padded<T>(T);

/// The counters; `HOST_COUNTERS` in the parent module is the process's. The live total and
/// the allocation count share a line (an allocation writes both); the peak has its own, written
/// only when it rises, so in a steady state allocations only read it.
pub(crate) struct HostCounters {
    /// Signed: a thread may free small buffers another thread made before that thread's batch
    /// of their allocations arrives, so the total can dip below zero for a moment.
    live: Padded<(AtomicIsize, AtomicU64)>,
    peak: Padded<AtomicUsize>,
}

impl HostCounters {
    pub(crate) const fn new() -> Self {
        Self {
            live: Padded((AtomicIsize::new(0), AtomicU64::new(0))),
            peak: Padded(AtomicUsize::new(0)),
        }
    }

    /// Counts `bytes` more in live buffers.
    pub(crate) fn allocated(&self, bytes: usize) {
        self.allocated_many(bytes, 1);
    }

    /// Counts `allocations` buffers of `bytes` in all more in live buffers.
    pub(crate) fn allocated_many(&self, bytes: usize, allocations: u64) {
        let (live, count) = &self.live.0;
        count.fetch_add(allocations, Ordering::Relaxed);
        let bytes = signed(bytes);
        let now = non_negative(live.fetch_add(bytes, Ordering::Relaxed).wrapping_add(bytes));
        if now > self.peak.0.load(Ordering::Relaxed) {
            self.peak.0.fetch_max(now, Ordering::Relaxed);
        }
    }

    /// Counts `bytes` fewer in live buffers.
    pub(crate) fn freed(&self, bytes: usize) {
        self.live.0.0.fetch_sub(signed(bytes), Ordering::Relaxed);
    }

    /// Counts `allocations` more made, with `bytes` fewer live in all (a batch whose frees
    /// outweighed its allocations).
    pub(crate) fn freed_many(&self, bytes: usize, allocations: u64) {
        let (live, count) = &self.live.0;
        count.fetch_add(allocations, Ordering::Relaxed);
        live.fetch_sub(signed(bytes), Ordering::Relaxed);
    }

    /// The counts now.
    pub(crate) fn read(&self) -> Counts {
        let (live, count) = &self.live.0;
        let live = non_negative(live.load(Ordering::Relaxed));
        Counts {
            live,
            // An allocation may have raised the total and not yet the peak: the peak is at
            // least what is live.
            peak: self.peak.0.load(Ordering::Relaxed).max(live),
            allocations: count.load(Ordering::Relaxed),
        }
    }

    /// Makes the peak what is allocated now. An allocation racing with the reset may or may
    /// not count towards the new peak.
    pub(crate) fn reset_peak(&self) {
        let live = || non_negative(self.live.0.0.load(Ordering::Relaxed));
        self.peak.0.store(live(), Ordering::Relaxed);
        self.peak.0.fetch_max(live(), Ordering::Relaxed);
    }
}

/// Sizes of live memory fit in `isize` (no allocation is larger).
fn signed(bytes: usize) -> isize {
    isize::try_from(bytes).unwrap_or(isize::MAX)
}

/// A total that batches from other threads have pushed below zero for a moment reads as zero.
fn non_negative(total: isize) -> usize {
    usize::try_from(total).unwrap_or(0)
}

/// Small buffers are counted per thread first and reach the shared counters in batches.
///
/// Measured on the H200 host (2026-11-30, `ferry bench autograd`): once a CPU op took 2.7 µs,
/// threads stepping their own 64x64 models spent their time bouncing the shared counters'
/// cache line (efficiency at 8 threads fell to 0.58, where plain arithmetic on the same machine
/// reaches 0.77). Buffers below [`SMALL`] now add to a count of the calling thread's, which
/// goes to the shared counters whenever it passes [`BATCH`] either way, when the thread reads
/// the statistics, and when the thread ends. So the calling thread's own buffers are always in
/// the numbers it reads, and another thread's last less than [`BATCH`] of small-buffer traffic
/// may not be yet: the live total is exact within `BATCH` per thread, and a peak made only of
/// such traffic may be missed by as much.
pub(crate) const SMALL: usize = 64 << 10;
/// How far a thread's uncounted small-buffer bytes may drift either way.
pub(crate) const BATCH: isize = 1 << 20;

/// A thread's small-buffer traffic not yet in the shared counters.
struct Pending {
    bytes: std::cell::Cell<isize>,
    allocations: std::cell::Cell<u64>,
}

impl Pending {
    fn flush(&self, into: &HostCounters) {
        let (bytes, allocations) = (self.bytes.replace(0), self.allocations.replace(0));
        if bytes >= 0 {
            into.allocated_many(bytes as usize, allocations);
        } else {
            into.freed_many(bytes.unsigned_abs(), allocations);
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.flush(&super::HOST_COUNTERS);
    }
}

thread_local! {
    static PENDING: Pending = const {
        Pending { bytes: std::cell::Cell::new(0), allocations: std::cell::Cell::new(0) }
    };
}

/// Counts an allocation of `bytes` in the process's counters (batched per thread when small).
pub(crate) fn count_allocation(bytes: usize) {
    if bytes >= SMALL || !batch(bytes as isize, 1) {
        super::HOST_COUNTERS.allocated(bytes);
    }
}

/// Counts a free of `bytes` in the process's counters (batched per thread when small).
pub(crate) fn count_free(bytes: usize) {
    if bytes >= SMALL || !batch(-(bytes as isize), 0) {
        super::HOST_COUNTERS.freed(bytes);
    }
}

/// Adds to this thread's batch, flushing it past [`BATCH`]; `false` when the thread is ending
/// (its batch is gone: count directly).
fn batch(bytes: isize, allocations: u64) -> bool {
    PENDING
        .try_with(|p| {
            let now = p.bytes.get() + bytes;
            p.bytes.set(now);
            p.allocations.set(p.allocations.get() + allocations);
            if now.abs() >= BATCH {
                p.flush(&super::HOST_COUNTERS);
            }
        })
        .is_ok()
}

/// Puts this thread's batch into the shared counters (before reading them).
pub(crate) fn flush_this_thread() {
    let _ = PENDING.try_with(|p| p.flush(&super::HOST_COUNTERS));
}

#[cfg(test)]
mod tests {
    use std::sync::Barrier;

    use super::*;

    fn counts(live: usize, peak: usize, allocations: u64) -> Counts {
        Counts {
            live,
            peak,
            allocations,
        }
    }

    #[test]
    fn one_thread_counts_and_peaks_exactly() {
        let c = HostCounters::new();
        c.allocated(100);
        c.allocated(50);
        c.freed(100);
        assert_eq!(c.read(), counts(50, 150, 2));
        // Headroom from the free: no new peak until the total passes 150 again.
        c.allocated(100); // back to the peak, not past it
        assert_eq!(c.read(), counts(150, 150, 3));
        c.allocated(1);
        assert_eq!(c.read(), counts(151, 151, 4));
        c.reset_peak();
        c.freed(151);
        c.allocated(10);
        assert_eq!(c.read(), counts(10, 151, 5));
        c.freed(10);
        c.reset_peak();
        assert_eq!(c.read(), counts(0, 0, 5));
        c.allocated(1 << 40); // counts are bytes, not limited by memory
        c.freed(1 << 40);
        assert_eq!(c.read(), counts(0, 1 << 40, 6));
    }

    #[test]
    fn a_peak_made_by_many_threads_at_once_is_exact() {
        const THREADS: usize = 8;
        let c = HostCounters::new();
        let barrier = Barrier::new(THREADS);
        std::thread::scope(|scope| {
            for t in 0..THREADS {
                let (c, barrier) = (&c, &barrier);
                scope.spawn(move || {
                    for round in 1..=50 {
                        // Everyone holds `round * (t + 1)` bytes at once, then lets go.
                        let bytes = round * (t + 1);
                        c.allocated(bytes);
                        barrier.wait();
                        barrier.wait();
                        c.freed(bytes);
                        barrier.wait();
                    }
                });
            }
        });
        let together = 50 * (1..=THREADS).sum::<usize>();
        assert_eq!(c.read(), counts(0, together, (50 * THREADS) as u64));
    }

    #[test]
    fn racing_threads_leave_exact_totals_and_a_possible_peak() {
        const THREADS: usize = 8;
        let c = HostCounters::new();
        std::thread::scope(|scope| {
            for t in 1..=THREADS {
                let c = &c;
                scope.spawn(move || {
                    let mut held = Vec::new();
                    for i in 0..20_000usize {
                        let bytes = (i * 7919 + t * 104_729) % 40_000;
                        c.allocated(bytes);
                        held.push(bytes);
                        if held.len() > 8 {
                            c.freed(held.remove(i % 8));
                        }
                    }
                    held.into_iter().for_each(|b| c.freed(b));
                });
            }
        });
        let end = c.read();
        assert_eq!((end.live, end.allocations), (0, (20_000 * THREADS) as u64));
        // Each thread holds at most nine buffers below 40 kB.
        assert!(end.peak > 0 && end.peak < THREADS * 9 * 40_000, "{end:?}");
    }

    #[test]
    fn small_buffers_are_batched_yet_exact_for_the_reading_thread_and_after_a_thread_ends() {
        // The process-wide counters: taking turns with the other tests that read them exactly.
        let _turn = crate::host::tests::stats_turn();
        let before = crate::host_stats();
        // Another thread's small buffers: in the totals once it has ended.
        std::thread::spawn(|| {
            let kept: Vec<_> = (0..10)
                .map(|_| crate::HostBuffer::zeroed(1000).unwrap())
                .collect();
            std::mem::forget(kept); // 10 kB stay allocated
        })
        .join()
        .unwrap();
        let mine = crate::HostBuffer::zeroed(4096).unwrap();
        let now = crate::host_stats();
        // Other tests of this binary allocate and free meanwhile, so bytes can only be bounded
        // loosely; the count of allocations only grows. The ended thread's ten (far below a
        // batch) are in only if its end flushed them; this thread's one only if reading did.
        assert!(
            now.allocations >= before.allocations + 11,
            "{now:?} vs {before:?}"
        );
        drop(mine);
    }

    #[test]
    fn buffers_freed_on_another_thread_leave_the_totals_exact() {
        let c = HostCounters::new();
        c.allocated(1000);
        std::thread::scope(|scope| {
            scope.spawn(|| c.freed(1000));
        });
        c.allocated(10);
        assert_eq!(c.read(), counts(10, 1000, 2));
    }

    #[test]
    fn a_free_counted_before_its_allocation_reads_as_zero_not_a_huge_total() {
        // A thread freed a small buffer whose allocation is still in its maker's batch.
        let c = HostCounters::new();
        c.freed(4096);
        assert_eq!(c.read(), counts(0, 0, 0));
        c.reset_peak();
        c.allocated(100);
        assert_eq!(c.read(), counts(0, 0, 1), "the total is still below zero");
        c.allocated_many(4096, 1);
        assert_eq!(c.read(), counts(100, 100, 2));
    }
}
