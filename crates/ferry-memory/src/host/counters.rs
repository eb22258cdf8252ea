//! Exact host-memory counters: one atomic total, whose every value is a real instant.
//!
//! Every allocation adds to one shared total (and frees subtract), so the total, and the
//! highest value it ever took, are exact under any concurrency: the atomic's order of updates
//! is a real order of the allocations. The price is one cache line that every allocating
//! thread writes. Measured on the H200 host (16 cores, 2026-11-30; a scratch benchmark, each
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

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

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
    live: Padded<(AtomicUsize, AtomicU64)>,
    peak: Padded<AtomicUsize>,
}

impl HostCounters {
    pub(crate) const fn new() -> Self {
        Self {
            live: Padded((AtomicUsize::new(0), AtomicU64::new(0))),
            peak: Padded(AtomicUsize::new(0)),
        }
    }

    /// Counts `bytes` more in live buffers.
    pub(crate) fn allocated(&self, bytes: usize) {
        let (live, count) = &self.live.0;
        count.fetch_add(1, Ordering::Relaxed);
        let now = live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        if now > self.peak.0.load(Ordering::Relaxed) {
            self.peak.0.fetch_max(now, Ordering::Relaxed);
        }
    }

    /// Counts `bytes` fewer in live buffers.
    pub(crate) fn freed(&self, bytes: usize) {
        self.live.0.0.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// The counts now.
    pub(crate) fn read(&self) -> Counts {
        let (live, count) = &self.live.0;
        let live = live.load(Ordering::Relaxed);
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
        let live = &self.live.0.0;
        self.peak
            .0
            .store(live.load(Ordering::Relaxed), Ordering::Relaxed);
        self.peak
            .0
            .fetch_max(live.load(Ordering::Relaxed), Ordering::Relaxed);
    }
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
    fn buffers_freed_on_another_thread_leave_the_totals_exact() {
        let c = HostCounters::new();
        c.allocated(1000);
        std::thread::scope(|scope| {
            scope.spawn(|| c.freed(1000));
        });
        c.allocated(10);
        assert_eq!(c.read(), counts(10, 1000, 2));
    }
}
