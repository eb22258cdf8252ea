//! Budgets of the two host pools (pooled pageable memory and page-locked memory): sizes read
//! from the environment, the default share of physical memory, and the reservation rule both
//! pools follow so that the bytes they hold never exceed their budget.
//!
//! The rule, in bytes of blocks: `reserved` counts blocks handed out, cached, and being made;
//! `releasing` counts blocks taken out of the cache that are being given back to the OS. A new
//! block may be made only while `reserved + releasing + block <= budget`, so what the pool holds
//! at any instant (made or being freed) stays within the budget. When it does not fit, idle
//! cached blocks are trimmed, least recently cached first; when even an empty cache would not
//! make room (live blocks fill the budget), the request is refused and the caller goes
//! elsewhere (pageable memory, or an error naming the budget).
//!
//! The bookkeeping here runs under the pool's lock; making and freeing blocks (faulting pages in,
//! registering them with the driver, unmapping) happens outside it.

use crate::MemoryError;
use crate::cache::{BlockCache, Cached};
pub(crate) use crate::size::parse_bytes;

/// Bytes of memory this process may use: physical memory, or the cgroup's limit when a
/// container sets a lower one. `None` when neither can be read.
pub(crate) fn physical_memory() -> Option<usize> {
    // SAFETY: sysconf reads a system constant; no memory is touched.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    let physical = (pages > 0 && page > 0).then(|| (pages as usize).saturating_mul(page as usize));
    let cgroup = std::fs::read_to_string("/sys/fs/cgroup/memory.max")
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok());
    match (physical, cgroup) {
        (Some(p), Some(c)) => Some(p.min(c)),
        (p, c) => p.or(c),
    }
}

/// Assumed when physical memory cannot be read.
const UNKNOWN_MEMORY: usize = 16 << 30;

/// The budget named by environment variable `variable` when it is set, else `1/divisor` of
/// [`physical_memory`]. A value that is not a size is an error naming the variable.
pub(crate) fn budget_from_env(
    variable: &'static str,
    divisor: usize,
) -> Result<usize, MemoryError> {
    budget_from(variable, std::env::var(variable), divisor)
}

/// [`budget_from_env`] for a value already read.
fn budget_from(
    variable: &'static str,
    value: Result<String, std::env::VarError>,
    divisor: usize,
) -> Result<usize, MemoryError> {
    Ok(size_from(variable, value)?
        .unwrap_or_else(|| physical_memory().unwrap_or(UNKNOWN_MEMORY) / divisor))
}

/// The size environment variable `variable` holds, `None` when it is unset. A value that is
/// not a size is an error naming the variable.
pub(crate) fn size_from_env(variable: &'static str) -> Result<Option<usize>, MemoryError> {
    size_from(variable, std::env::var(variable))
}

/// [`size_from_env`] for a value already read.
fn size_from(
    variable: &'static str,
    value: Result<String, std::env::VarError>,
) -> Result<Option<usize>, MemoryError> {
    match value {
        Ok(value) => match parse_bytes(&value) {
            Some(bytes) => Ok(Some(bytes)),
            None => Err(MemoryError::BadBudget { variable, value }),
        },
        Err(std::env::VarError::NotUnicode(value)) => Err(MemoryError::BadBudget {
            variable,
            value: value.to_string_lossy().into_owned(),
        }),
        Err(std::env::VarError::NotPresent) => Ok(None),
    }
}

/// What a pool may do about a request for a new block.
#[derive(Debug)]
pub(crate) enum Admission<B> {
    /// The block's bytes are reserved: make it (outside the lock), then [`Reservations::made`].
    Granted,
    /// Free these cached blocks (outside the lock), call [`Reservations::released`], ask again.
    Trim(Vec<B>),
    /// Blocks other threads are freeing leave room: wait for them, then ask again.
    WaitForReleases,
    /// Live blocks fill the budget: nothing in the cache can make room.
    Refused,
}

/// The byte counts of one pool's budget (see the module docs for the rule).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Reservations {
    /// Blocks handed out, cached, or being made.
    pub(crate) reserved: usize,
    /// Blocks being made (reserved, not yet handed out).
    pub(crate) making: usize,
    /// Blocks out of the cache on their way back to the OS.
    pub(crate) releasing: usize,
    /// The bound on `reserved + releasing` for new blocks.
    pub(crate) budget: usize,
}

impl Reservations {
    pub(crate) fn new(budget: usize) -> Self {
        Self {
            budget,
            ..Self::default()
        }
    }

    /// Decides a request for a new block of `size` bytes, trimming `cache` if that makes room.
    pub(crate) fn admit<B: Cached>(
        &mut self,
        cache: &mut BlockCache<B>,
        size: usize,
    ) -> Admission<B> {
        let fits = |bytes: usize| bytes.checked_add(size).is_some_and(|b| b <= self.budget);
        if fits(self.reserved + self.releasing) {
            self.reserved += size;
            self.making += size;
            return Admission::Granted;
        }
        if fits(self.reserved) {
            return Admission::WaitForReleases;
        }
        // Bytes the cache must give up: after they and the frees in flight are gone, it fits.
        let need = (self.reserved + size).saturating_sub(self.budget);
        if size > self.budget || cache.bytes() < need {
            return Admission::Refused;
        }
        let mut victims = Vec::new();
        let mut freed = 0;
        while freed < need {
            let Some(block) = cache.take_oldest(|_| true) else {
                break;
            };
            freed += block.size();
            victims.push(block);
        }
        self.releasing(freed);
        Admission::Trim(victims)
    }

    /// Cached blocks (those `idle` accepts, least recently cached first) to free so that
    /// `reserved` comes back within the budget: after the budget was lowered, or when blocks
    /// come back to a pool that is over it.
    pub(crate) fn trim_excess<B: Cached>(
        &mut self,
        cache: &mut BlockCache<B>,
        mut idle: impl FnMut(&B) -> bool,
    ) -> Vec<B> {
        let mut victims = Vec::new();
        while self.reserved > self.budget {
            let Some(block) = cache.take_oldest(&mut idle) else {
                break;
            };
            self.releasing(block.size());
            victims.push(block);
        }
        victims
    }

    /// Every cached block, to free (`empty_cache`).
    pub(crate) fn drain<B: Cached>(&mut self, cache: &mut BlockCache<B>) -> Vec<B> {
        let victims = cache.drain();
        self.releasing(victims.iter().map(Cached::size).sum());
        victims
    }

    /// Moves `bytes` of cached blocks from reserved to releasing.
    fn releasing(&mut self, bytes: usize) {
        self.reserved -= bytes;
        self.releasing += bytes;
    }

    /// `bytes` of blocks taken by `admit`, `trim_excess` or `drain` are back with the OS.
    pub(crate) fn released(&mut self, bytes: usize) {
        self.releasing -= bytes;
    }

    /// A granted block of `size` bytes was made and handed out.
    pub(crate) fn made(&mut self, size: usize) {
        self.making -= size;
    }

    /// A granted block of `size` bytes could not be made.
    pub(crate) fn abandoned(&mut self, size: usize) {
        self.making -= size;
        self.reserved -= size;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq)]
    struct Block(usize);

    impl Cached for Block {
        fn size(&self) -> usize {
            self.0
        }
    }

    #[test]
    fn sizes_parse_in_bytes_and_binary_units() {
        for (text, bytes) in [
            ("0", 0),
            ("1073741824", 1 << 30),
            ("8G", 8 << 30),
            ("8g", 8 << 30),
            ("8GiB", 8 << 30),
            ("8 GB", 8 << 30),
            ("512M", 512 << 20),
            ("64k", 64 << 10),
            ("2T", 2 << 40),
            ("1.5G", 3 << 29),
            (" 100b ", 100),
        ] {
            assert_eq!(parse_bytes(text), Some(bytes), "{text}");
        }
        for bad in [
            "",
            "G",
            "-1G",
            "8X",
            "1e9",
            ".5G",
            "8GG",
            "99999999999999999999T",
        ] {
            assert_eq!(parse_bytes(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_bad_budget_variable_is_an_error_naming_it() {
        const VAR: &str = "FERRY_PINNED_BUDGET";
        assert_eq!(budget_from(VAR, Ok("8G".into()), 8).unwrap(), 8 << 30);
        let unset = budget_from(VAR, Err(std::env::VarError::NotPresent), 8).unwrap();
        assert_eq!(unset, physical_memory().unwrap() / 8);
        let err = budget_from(VAR, Ok("lots".into()), 8).unwrap_err();
        assert!(matches!(&err, MemoryError::BadBudget { value, .. } if value == "lots"));
        let text = err.to_string();
        for needle in ["FERRY_PINNED_BUDGET", "`lots`", "8G"] {
            assert!(text.contains(needle), "`{needle}` missing from: {text}");
        }
    }

    #[test]
    fn physical_memory_is_read() {
        // Linux CI and the GPU host both expose it; the default budgets are shares of it.
        let bytes = physical_memory().expect("physical memory is readable on Linux");
        assert!(bytes >= 256 << 20, "{bytes}");
    }

    #[test]
    fn new_blocks_fit_the_budget_or_trim_the_oldest_or_are_refused() {
        let mut cache = BlockCache::new();
        let mut r = Reservations::new(100);
        assert!(matches!(r.admit(&mut cache, 40), Admission::Granted));
        r.made(40);
        assert!(matches!(r.admit(&mut cache, 30), Admission::Granted));
        r.made(30);
        // Both blocks come back to the cache, the 40 first: 70 reserved, all cached.
        cache.put(Block(40));
        cache.put(Block(30));
        assert_eq!((r.reserved, r.making), (70, 0));
        // 50 more does not fit (70 + 50 > 100): trimming the oldest (40) makes room.
        match r.admit(&mut cache, 50) {
            Admission::Trim(victims) => assert_eq!(victims, vec![Block(40)]),
            other => panic!("{other:?}"),
        }
        assert_eq!((r.reserved, r.releasing), (30, 40));
        // While the 40 is being freed, the request waits rather than overshoot.
        assert!(matches!(
            r.admit(&mut cache, 50),
            Admission::WaitForReleases
        ));
        r.released(40);
        assert!(matches!(r.admit(&mut cache, 50), Admission::Granted));
        assert_eq!(r.reserved, 80);
        // Live blocks fill it: 30 cached cannot make room for 60 (80 + 60 - 100 = 40 > 30).
        assert!(matches!(r.admit(&mut cache, 60), Admission::Refused));
        assert!(matches!(r.admit(&mut cache, 101), Admission::Refused));
        r.abandoned(50);
        assert_eq!((r.reserved, r.making), (30, 0));
    }

    #[test]
    fn lowering_the_budget_trims_idle_blocks_oldest_first() {
        let mut cache = BlockCache::new();
        let mut r = Reservations::new(1000);
        for size in [100, 200, 300] {
            cache.put(Block(size));
        }
        r.reserved = 600 + 50; // 50 of it live
        r.budget = 260;
        let victims = r.trim_excess(&mut cache, |b| b.0 != 200);
        // 650 -> 550 (the 100) -> 250 (the 300; the 200 is busy): within 260.
        assert_eq!(victims, vec![Block(100), Block(300)]);
        assert_eq!((r.reserved, r.releasing), (250, 400));
        assert_eq!(r.drain(&mut cache), vec![Block(200)]);
        assert_eq!((r.reserved, r.releasing), (50, 600));
    }
}
