//! The host pool: large pageable buffers kept with their pages faulted in, under a budget.
//!
//! Results that a copy writes once (moves into pageable memory land here) would otherwise pay
//! a page fault per 4 KiB on first write, slower than the PCIe link itself. The pool keeps
//! freed buffers for reuse, but holds at most a budget of them, live and cached together: by
//! default 1/4 of the machine's memory ([`HostPool::DEFAULT_BUDGET_DIVISOR`]), or
//! `FERRY_HOST_POOL_BUDGET`, or [`HostPool::set_budget`]. Idle buffers are trimmed least
//! recently used first to make room; a request that live buffers leave no room for gets a
//! plain (prefaulted, unpooled) buffer that goes back to the OS when it drops.
//!
//! Size classes are the pinned pool's (eight per power of two), rounded up to whole 2 MiB huge
//! pages; a cached buffer serves requests of its class and of the class below. Faulting pages in
//! and unmapping them run outside the pool's lock.

use std::sync::LazyLock;

use parking_lot::{Condvar, Mutex, MutexGuard};

use super::budget::{Admission, Reservations, budget_from_env};
use super::{HUGE_PAGE, HostBuffer};
use crate::MemoryError;
use crate::cache::{BlockCache, Cached};
use crate::classes::{HOST_MAX_REQUEST, host_class, too_large};

/// The process-wide pool, reached through [`HostPool::global`].
pub(super) static HOST_POOL: LazyLock<HostPool> = LazyLock::new(HostPool::from_env);

/// Counters of the [`HostPool`], in bytes of whole pool blocks (size classes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostPoolStats {
    /// Bytes in buffers handed out.
    pub allocated_bytes: usize,
    /// Bytes held: handed out plus cached. Never above `budget_bytes`, except after the budget
    /// was lowered below what live buffers hold.
    pub reserved_bytes: usize,
    /// Requests served from the cache.
    pub cache_hits: u64,
    /// The budget reserved bytes stay within.
    pub budget_bytes: usize,
    /// Cached buffers freed to stay within the budget, least recently used first.
    pub trimmed_buffers: u64,
    /// Requests served by a plain buffer outside the pool because live buffers filled the
    /// budget.
    pub beyond_budget: u64,
}

impl HostPoolStats {
    /// Bytes of idle buffers kept for reuse; [`HostPool::empty_cache`] returns them.
    pub fn cached_bytes(&self) -> usize {
        self.reserved_bytes - self.allocated_bytes
    }
}

impl Cached for HostBuffer {
    fn size(&self) -> usize {
        self.len
    }
}

/// Large pageable buffers kept with their pages faulted in (see the module docs).
#[derive(Debug)]
pub struct HostPool {
    state: Mutex<PoolState>,
    /// Signalled whenever buffers finish going back to the OS (room may have appeared).
    released: Condvar,
    /// `FERRY_HOST_POOL_BUDGET` held something that is not a size: every request reports it.
    bad_budget: Option<String>,
}

#[derive(Debug)]
struct PoolState {
    /// Idle buffers, each `len` its block size; they are not counted in `host_stats`.
    cache: BlockCache<HostBuffer>,
    accounts: Reservations,
    stats: HostPoolStats,
}

impl std::fmt::Debug for BlockCache<HostBuffer> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockCache")
            .field("buffers", &self.len())
            .field("bytes", &self.bytes())
            .finish()
    }
}

impl PoolState {
    fn snapshot(&self) -> HostPoolStats {
        HostPoolStats {
            // Buffers being made are counted once handed out.
            reserved_bytes: self.accounts.reserved - self.accounts.making,
            budget_bytes: self.accounts.budget,
            ..self.stats
        }
    }
}

/// Rounds of trimming one request may go through before it takes a plain buffer.
const TRIM_ROUNDS: usize = 8;

impl HostPool {
    /// The default budget is this fraction (1/n) of the machine's memory (or of the container's
    /// limit). Pageable memory can be swapped and reclaimed, so the bound is looser than the
    /// pinned pool's 1/8: it keeps idle prefaulted pages from squatting on a quarter of RAM,
    /// while a working set of repeated large moves stays cached.
    pub const DEFAULT_BUDGET_DIVISOR: usize = 4;

    /// The environment variable that sets the budget at start: bytes, or a size such as `8G`.
    pub const BUDGET_VARIABLE: &'static str = "FERRY_HOST_POOL_BUDGET";

    fn from_env() -> Self {
        let (budget, bad_budget) =
            match budget_from_env(Self::BUDGET_VARIABLE, Self::DEFAULT_BUDGET_DIVISOR) {
                Ok(budget) => (budget, None),
                Err(MemoryError::BadBudget { value, .. }) => (0, Some(value)),
                Err(_) => (0, None),
            };
        Self {
            state: Mutex::new(PoolState {
                cache: BlockCache::new(),
                accounts: Reservations::new(budget),
                stats: HostPoolStats::default(),
            }),
            released: Condvar::new(),
            bad_budget,
        }
    }

    /// The process-wide pool.
    pub fn global() -> &'static HostPool {
        &HOST_POOL
    }

    /// A prefaulted buffer of `len` bytes. A cached buffer of its class, or of the class above,
    /// is reused (holding its previous bytes: initialised, but not zero; for destinations that
    /// a copy overwrites whole); otherwise one is made within the budget (trimming idle
    /// buffers, least recently used first), or, when live buffers fill the budget, a plain
    /// prefaulted buffer outside the pool is returned. Buffers below 2 MiB are plain
    /// [`HostBuffer::zeroed`] ones.
    ///
    /// The one error beside running out of memory: `FERRY_HOST_POOL_BUDGET` not being a size.
    pub fn alloc(&self, len: usize) -> Result<HostBuffer, MemoryError> {
        if len < HUGE_PAGE {
            return HostBuffer::zeroed(len);
        }
        if let Some(value) = &self.bad_budget {
            return Err(MemoryError::BadBudget {
                variable: Self::BUDGET_VARIABLE,
                value: value.clone(),
            });
        }
        let class =
            host_class(len).ok_or_else(|| too_large("HostPool::alloc", len, HOST_MAX_REQUEST))?;
        // The class above serves it too; the last class serves its own class only.
        let largest = class.checked_add(1).and_then(host_class).unwrap_or(class);
        let reused = {
            let mut state = self.state.lock();
            let reused = state.cache.take(class, largest, |_| true);
            if let Some(buffer) = &reused {
                state.stats.cache_hits += 1;
                state.stats.allocated_bytes += buffer.len;
            }
            reused
        };
        let mut buffer = match reused {
            Some(buffer) => buffer,
            None if self.reserve(class) => {
                // Faulting in the pages is the work; the lock only guards the counts.
                #[cfg(test)]
                crate::cuda::test_hooks::slow_part(crate::cuda::test_hooks::Slow::HostMake);
                let made = HostBuffer::prefaulted_uncounted(class);
                let mut state = self.state.lock();
                match made {
                    Ok(buffer) => {
                        state.accounts.made(class);
                        state.stats.allocated_bytes += class;
                        buffer
                    }
                    Err(e) => {
                        state.accounts.abandoned(class);
                        self.released.notify_all();
                        return Err(e);
                    }
                }
            }
            None => {
                self.state.lock().stats.beyond_budget += 1;
                return HostBuffer::prefaulted(len);
            }
        };
        let block = buffer.len;
        buffer.len = len;
        buffer.pooled = true;
        Ok(buffer.counted_as(block))
    }

    /// Reserves `class` bytes within the budget (trimming idle buffers outside the lock, or
    /// waiting for other threads' frees); `false` when live buffers leave no room.
    fn reserve(&self, class: usize) -> bool {
        let mut state = self.state.lock();
        let mut rounds = 0;
        loop {
            let s = &mut *state;
            match s.accounts.admit(&mut s.cache, class) {
                Admission::Granted => return true,
                Admission::WaitForReleases => self.released.wait(&mut state),
                Admission::Trim(victims) if rounds < TRIM_ROUNDS => {
                    rounds += 1;
                    state.stats.trimmed_buffers += victims.len() as u64;
                    self.free(&mut state, victims);
                }
                Admission::Trim(victims) => {
                    let bytes: usize = victims.iter().map(Cached::size).sum();
                    for buffer in victims {
                        state.cache.put(buffer);
                    }
                    state.accounts.released(bytes);
                    state.accounts.reserved += bytes;
                    return false;
                }
                Admission::Refused => return false,
            }
        }
    }

    /// Unmaps `victims` outside the lock, then takes their bytes off the books.
    fn free(&self, state: &mut MutexGuard<'_, PoolState>, victims: Vec<HostBuffer>) {
        let bytes: usize = victims.iter().map(Cached::size).sum();
        MutexGuard::unlocked(state, || drop(victims));
        state.accounts.released(bytes);
        self.released.notify_all();
    }

    /// Takes back a dropped buffer (its `len` is its block size).
    pub(super) fn give_back(&self, buffer: HostBuffer) {
        let mut state = self.state.lock();
        state.stats.allocated_bytes -= buffer.len;
        state.cache.put(buffer);
        if state.accounts.reserved > state.accounts.budget {
            let s = &mut *state;
            let victims = s.accounts.trim_excess(&mut s.cache, |_| true);
            s.stats.trimmed_buffers += victims.len() as u64;
            self.free(&mut state, victims);
        }
    }

    /// The pool's counters.
    pub fn stats(&self) -> HostPoolStats {
        let state = self.state.lock();
        debug_assert_eq!(
            state.accounts.reserved,
            state.stats.allocated_bytes + state.cache.bytes() + state.accounts.making
        );
        state.snapshot()
    }

    /// The budget the pool's bytes stay within.
    pub fn budget(&self) -> usize {
        self.state.lock().accounts.budget
    }

    /// Sets the budget. When it is lower than what the pool holds, idle buffers are freed,
    /// least recently used first, until it fits or the cache is empty; live buffers stay, and
    /// requests beyond the budget get plain buffers until they drop.
    pub fn set_budget(&self, bytes: usize) {
        let mut state = self.state.lock();
        state.accounts.budget = bytes;
        let s = &mut *state;
        let victims = s.accounts.trim_excess(&mut s.cache, |_| true);
        s.stats.trimmed_buffers += victims.len() as u64;
        self.free(&mut state, victims);
    }

    /// Returns every cached buffer to the OS (outside the pool's lock).
    pub fn empty_cache(&self) {
        let mut state = self.state.lock();
        let s = &mut *state;
        let victims = s.accounts.drain(&mut s.cache);
        self.free(&mut state, victims);
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::stats_turn;
    use super::*;
    use crate::host_stats;

    /// Sets the pool's budget for a test and puts it back (and empties the cache) on drop.
    struct Budget(usize);

    impl Budget {
        fn set(bytes: usize) -> Self {
            let pool = HostPool::global();
            pool.empty_cache();
            let old = pool.budget();
            pool.set_budget(bytes);
            Self(old)
        }
    }

    impl Drop for Budget {
        fn drop(&mut self) {
            HostPool::global().empty_cache();
            HostPool::global().set_budget(self.0);
        }
    }

    #[test]
    fn pooled_buffers_count_their_block_and_idle_ones_do_not() {
        let _turn = stats_turn();
        let _budget = Budget::set(1 << 30);
        let pool = HostPool::global();
        let before = host_stats();
        assert_eq!(before.pool.cached_bytes(), 0);
        let len = (4 << 20) + 7; // class 4.5 MiB, a 6 MiB block in whole huge pages
        let buffer = pool.alloc(len).unwrap();
        let now = host_stats();
        assert_eq!(now.allocated_bytes, before.allocated_bytes + (6 << 20));
        assert_eq!(
            now.pool.allocated_bytes,
            before.pool.allocated_bytes + (6 << 20)
        );
        drop(buffer);
        let idle = host_stats();
        assert_eq!(
            idle.allocated_bytes, before.allocated_bytes,
            "cached, not live"
        );
        assert_eq!(idle.pool.cached_bytes(), 6 << 20);
        let again = pool.alloc(len).unwrap();
        assert_eq!(
            host_stats().allocated_bytes,
            before.allocated_bytes + (6 << 20)
        );
        assert_eq!(host_stats().pool.cached_bytes(), 0);
        drop(again);
        pool.empty_cache();
        let after = host_stats();
        assert_eq!(after.pool.reserved_bytes, before.pool.reserved_bytes);
        assert_eq!(after.allocated_bytes, before.allocated_bytes);
        // Small requests are plain buffers: counted at their length, never cached.
        let small = pool.alloc(10).unwrap();
        assert_eq!(host_stats().allocated_bytes, before.allocated_bytes + 10);
        drop(small);
        assert_eq!(host_stats().pool, after.pool);
    }

    #[test]
    fn a_cached_buffer_serves_its_class_and_the_class_below() {
        let _turn = stats_turn();
        let _budget = Budget::set(1 << 30);
        let pool = HostPool::global();
        // 20 MiB requests: classes of 2 MiB granules (16, 18, 20, 22 MiB, ...).
        assert_eq!(host_class(20 << 20), Some(20 << 20));
        assert_eq!(host_class((20 << 20) + 1), Some(22 << 20));
        let mut first = pool.alloc(22 << 20).unwrap();
        first.as_bytes_mut()[17] = 9;
        let address = first.as_bytes().as_ptr();
        drop(first);
        let hits = pool.stats().cache_hits;
        // One class smaller: the same pages come back, faulted in and holding their old bytes.
        let reused = pool.alloc((19 << 20) + 5).unwrap();
        assert_eq!(reused.len(), (19 << 20) + 5);
        assert_eq!(pool.stats().cache_hits, hits + 1);
        assert_eq!(reused.as_bytes().as_ptr(), address);
        assert_eq!(reused.as_bytes()[17], 9);
        // Counted as the whole 22 MiB block it holds.
        assert_eq!(pool.stats().allocated_bytes, 22 << 20);
        drop(reused);
        // Two classes smaller (18 MiB) does not take the 22 MiB block.
        let smaller = pool.alloc(18 << 20).unwrap();
        assert_eq!(pool.stats().cache_hits, hits + 1);
        assert_ne!(smaller.as_bytes().as_ptr(), address);
        drop(smaller);
        pool.empty_cache();
        assert_eq!(pool.stats().reserved_bytes, pool.stats().allocated_bytes);
    }

    #[test]
    fn a_request_near_usize_max_is_refused_naming_the_limit() {
        let _turn = stats_turn();
        let pool = HostPool::global();
        let before = pool.stats();
        // Unchecked, the class of usize::MAX - 1 wrapped to 0 and the buffer claimed the length.
        for len in [usize::MAX, usize::MAX - 1, HOST_MAX_REQUEST + 1] {
            match pool.alloc(len) {
                Err(MemoryError::RequestTooLarge {
                    op,
                    requested,
                    limit,
                }) => {
                    assert_eq!(
                        (op, requested, limit),
                        ("HostPool::alloc", len, HOST_MAX_REQUEST)
                    );
                }
                other => panic!("alloc({len}) gave {other:?}"),
            }
        }
        // Nothing was reserved, cached or counted for them.
        assert_eq!(pool.stats(), before);
    }

    #[test]
    fn the_budget_trims_the_least_recently_used_and_sends_the_rest_outside() {
        let _turn = stats_turn();
        let _budget = Budget::set(40 << 20);
        let pool = HostPool::global();
        let before = pool.stats();
        // Three 12 MiB buffers fill 36 of the 40 MiB; dropped in order a, b, c.
        let a = pool.alloc(12 << 20).unwrap();
        let b = pool.alloc(12 << 20).unwrap();
        let c = pool.alloc(12 << 20).unwrap();
        let kept = [b.as_bytes().as_ptr(), c.as_bytes().as_ptr()];
        drop((a, b, c));
        assert_eq!(pool.stats().reserved_bytes, 36 << 20);
        // 16 MiB more: 36 + 16 > 40, so the oldest (a) is trimmed: 24 + 16 = 40.
        let d = pool.alloc(16 << 20).unwrap();
        let after_d = pool.stats();
        assert_eq!(after_d.trimmed_buffers, before.trimmed_buffers + 1);
        assert_eq!(after_d.reserved_bytes, 40 << 20);
        assert_eq!(after_d.budget_bytes, 40 << 20);
        // b and c survived: two 12 MiB requests get exactly their pages back.
        let e = pool.alloc(12 << 20).unwrap();
        let f = pool.alloc(12 << 20).unwrap();
        assert_eq!(pool.stats().cache_hits, before.cache_hits + 2);
        let mut got = [e.as_bytes().as_ptr(), f.as_bytes().as_ptr()];
        got.sort();
        let mut kept = kept;
        kept.sort();
        assert_eq!(
            got, kept,
            "the least recently used buffer was not the one trimmed"
        );
        // Live buffers fill the budget (16 + 12 + 12): a further request gets a plain buffer,
        // counted at its length, and the pool stays within its budget.
        let host_before = host_stats().allocated_bytes;
        let g = pool.alloc(4 << 20).unwrap();
        assert_eq!(g.len(), 4 << 20);
        let now = pool.stats();
        assert_eq!(now.beyond_budget, before.beyond_budget + 1);
        assert_eq!(now.reserved_bytes, 40 << 20);
        assert_eq!(host_stats().allocated_bytes, host_before + (4 << 20));
        drop(g);
        assert_eq!(
            pool.stats().reserved_bytes,
            40 << 20,
            "a plain buffer is not cached"
        );
        // Lowering the budget trims idle buffers (oldest first) once they are back.
        drop((d, e, f));
        pool.set_budget(20 << 20);
        let after = pool.stats();
        assert!(after.reserved_bytes <= 20 << 20, "{after:?}");
        assert_eq!(after.allocated_bytes, 0);
    }

    #[test]
    fn a_cache_hit_does_not_wait_for_another_thread_faulting_in_a_buffer() {
        use std::sync::mpsc;
        use std::time::Duration;

        use crate::cuda::test_hooks::{SERIAL as GATES, Slow, arm};

        let _turn = stats_turn();
        let _gates = GATES.lock();
        let _budget = Budget::set(1 << 30);
        let pool = HostPool::global();
        drop(pool.alloc(4 << 20).unwrap()); // a 4 MiB buffer in the cache
        let gate = arm(Slow::HostMake);
        let maker = std::thread::spawn(move || pool.alloc(64 << 20).map(|b| b.len()));
        assert!(
            gate.entered(Duration::from_secs(60)),
            "the 64 MiB request never reached its faulting-in"
        );
        let (done_tx, done_rx) = mpsc::channel();
        let hit = std::thread::spawn(move || {
            let _ = done_tx.send(pool.alloc(4 << 20).map(|b| b.len()));
        });
        let outcome = done_rx.recv_timeout(Duration::from_secs(30));
        let maker_done_first = maker.is_finished();
        gate.release();
        assert_eq!(maker.join().unwrap().unwrap(), 64 << 20);
        hit.join().unwrap();
        let len = outcome.expect(
            "a cache hit waited while another thread faulted in a new buffer: the host pool's lock is held across it",
        );
        assert!(!maker_done_first, "the gate did not hold the maker");
        assert_eq!(len.unwrap(), 4 << 20);
    }
}
