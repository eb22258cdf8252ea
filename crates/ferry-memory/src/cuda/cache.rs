//! Size classes and the size-keyed block cache shared by the device allocator and the pinned
//! pool. Pure bookkeeping: no driver calls, so the reuse rules are tested on any machine.

use std::collections::BTreeMap;

/// Device requests below this are "small" and come from the small pool.
pub(crate) const SMALL_LIMIT: usize = 1 << 20;
/// Small device blocks are multiples of this.
pub(crate) const SMALL_GRANULE: usize = 512;
/// Large device blocks are multiples of this (the driver maps device memory in 2 MiB pages).
pub(crate) const LARGE_GRANULE: usize = 2 << 20;
/// The smallest pinned block: one page.
pub(crate) const PINNED_MIN: usize = 4096;

/// The block size the device allocator uses for a request of `bytes` (> 0).
pub(crate) fn device_class(bytes: usize) -> usize {
    if bytes < SMALL_LIMIT {
        bytes.div_ceil(SMALL_GRANULE) * SMALL_GRANULE
    } else {
        bytes.div_ceil(LARGE_GRANULE) * LARGE_GRANULE
    }
}

/// The block size the pinned pool uses for a request of `bytes` (> 0).
///
/// Rounds up to a multiple of 2^(floor(log2 n) - 3): eight classes per power of two, so the
/// waste is below 1/8 of the request. Power-of-two doubling would waste up to half.
pub(crate) fn pinned_class(bytes: usize) -> usize {
    if bytes <= PINNED_MIN {
        return PINNED_MIN;
    }
    let granule = 1usize << (bytes.ilog2() - 3);
    bytes.div_ceil(granule) * granule
}

/// The pinned class after `class` (a class of [`pinned_class`]): the largest block the pinned
/// pool hands out for a request of `class`. A block serves requests one class smaller than
/// itself, so at most 1/4 of it goes unused (two granules of 1/8 of the request's power of two).
pub(crate) fn next_pinned_class(class: usize) -> usize {
    let class = class.max(PINNED_MIN);
    class + (1usize << (class.ilog2() - 3))
}

/// The largest cached block the device allocator hands out for a request of class `class`: at
/// most 1/8 of the block may go unused (block - class <= block / 8, i.e. block <= 8/7 class).
pub(crate) fn largest_reusable(class: usize) -> usize {
    class.saturating_mul(8) / 7
}

/// A free block kept for reuse.
pub(crate) trait Cached {
    /// Its size in bytes (a class size).
    fn size(&self) -> usize;
}

/// A cached block and when it was cached (a tick of the cache's own clock).
struct Entry<B> {
    age: u64,
    block: B,
}

/// Free blocks by size. Each size keeps a stack so the most recently freed (cache-warm, and on
/// the same stream most likely already complete) block is tried first; a second index by age
/// gives the least recently cached block, which is what a budget trims first.
pub(crate) struct BlockCache<B> {
    by_size: BTreeMap<usize, Vec<Entry<B>>>,
    /// Age -> size of the block cached at that tick.
    by_age: BTreeMap<u64, usize>,
    next_age: u64,
    bytes: usize,
}

impl<B: Cached> BlockCache<B> {
    pub(crate) fn new() -> Self {
        Self {
            by_size: BTreeMap::new(),
            by_age: BTreeMap::new(),
            next_age: 0,
            bytes: 0,
        }
    }

    /// Bytes held in the cache.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Blocks held in the cache.
    pub(crate) fn len(&self) -> usize {
        self.by_age.len()
    }

    /// Takes the smallest block of `class..=largest` bytes that `usable` accepts (the caller's
    /// stream and event rule), the most recently cached one among blocks of that size.
    pub(crate) fn take(
        &mut self,
        class: usize,
        largest: usize,
        mut usable: impl FnMut(&B) -> bool,
    ) -> Option<B> {
        let mut found = None;
        for (&size, blocks) in self.by_size.range(class..=largest) {
            if let Some(index) = blocks.iter().rposition(|e| usable(&e.block)) {
                found = Some((size, index));
                break;
            }
        }
        let (size, index) = found?;
        Some(self.remove(size, index))
    }

    /// Takes the least recently cached block that `usable` accepts.
    pub(crate) fn take_oldest(&mut self, mut usable: impl FnMut(&B) -> bool) -> Option<B> {
        let (size, index) = self.by_age.iter().find_map(|(&age, &size)| {
            let blocks = &self.by_size[&size];
            let index = blocks
                .iter()
                .position(|e| e.age == age)
                .expect("every age indexes a cached block");
            usable(&blocks[index].block).then_some((size, index))
        })?;
        Some(self.remove(size, index))
    }

    fn remove(&mut self, size: usize, index: usize) -> B {
        let blocks = self.by_size.get_mut(&size).expect("a cached size");
        // `remove`, not `swap_remove`: the stack order is the recency order `take` relies on.
        let entry = blocks.remove(index);
        if blocks.is_empty() {
            self.by_size.remove(&size);
        }
        self.by_age.remove(&entry.age);
        self.bytes -= size;
        entry.block
    }

    /// Returns a block to the cache.
    pub(crate) fn put(&mut self, block: B) {
        let (size, age) = (block.size(), self.next_age);
        self.next_age += 1;
        self.bytes += size;
        self.by_age.insert(age, size);
        self.by_size
            .entry(size)
            .or_default()
            .push(Entry { age, block });
    }

    /// Empties the cache, handing back every block.
    pub(crate) fn drain(&mut self) -> Vec<B> {
        self.bytes = 0;
        self.by_age.clear();
        std::mem::take(&mut self.by_size)
            .into_values()
            .flatten()
            .map(|e| e.block)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq)]
    struct Block {
        size: usize,
        stream: u64,
    }

    impl Cached for Block {
        fn size(&self) -> usize {
            self.size
        }
    }

    #[test]
    fn device_classes_round_small_to_512_and_large_to_2_mib() {
        assert_eq!(device_class(1), 512);
        assert_eq!(device_class(512), 512);
        assert_eq!(device_class(513), 1024);
        assert_eq!(device_class(SMALL_LIMIT - 1), SMALL_LIMIT);
        assert_eq!(device_class(SMALL_LIMIT), 2 << 20);
        assert_eq!(device_class((2 << 20) + 1), 4 << 20);
        // 400e6 / 2 MiB = 190.7 -> 191 pages.
        assert_eq!(device_class(400_000_000), 191 * (2 << 20));
    }

    #[test]
    fn pinned_classes_waste_under_an_eighth_and_never_double() {
        assert_eq!(pinned_class(1), PINNED_MIN);
        assert_eq!(pinned_class(4096), 4096);
        // 4097: log2 = 12, granule 2^9 = 512, so 4608 (not 8192).
        assert_eq!(pinned_class(4097), 4608);
        // 400 MB: granule 2^25 = 32 MiB, 400e6 / 2^25 = 11.92 -> 12 * 32 MiB.
        assert_eq!(pinned_class(400_000_000), 12 << 25);
        let mut n = PINNED_MIN + 1;
        while n < (1 << 40) {
            for m in [n, n + 1, n * 3 / 2, 2 * n - 1] {
                let class = pinned_class(m);
                assert!(class >= m && (class - m) * 8 < m, "{m} -> {class}");
                assert_eq!(pinned_class(class), class, "a class is its own class");
            }
            n *= 2;
        }
    }

    #[test]
    fn a_pinned_block_serves_requests_one_class_smaller_wasting_under_a_quarter() {
        // Classes from 4096: 4096, 4608, ..., 7680, 8192, 9216, ...
        assert_eq!(next_pinned_class(4096), 4608);
        assert_eq!(next_pinned_class(7680), 8192);
        assert_eq!(next_pinned_class(8192), 9216);
        // 384 MiB (the class of 400 MB): granule 32 MiB.
        assert_eq!(next_pinned_class(12 << 25), 13 << 25);
        let mut n = PINNED_MIN + 1;
        while n < (1 << 40) {
            for m in [n, n + 1, n * 3 / 2, 2 * n - 1] {
                let class = pinned_class(m);
                let next = next_pinned_class(class);
                assert!(next > class, "{m}");
                assert_eq!(pinned_class(next), next, "the next class is a class");
                assert_eq!(pinned_class(class + 1), next, "no class lies between");
                // Served by the next class up, a request leaves under 1/4 of the block unused.
                assert!((next - m) * 4 < next, "{m} in a block of {next}");
            }
            n *= 2;
        }
    }

    #[test]
    fn the_oldest_usable_block_is_trimmed_first() {
        let mut cache = BlockCache::new();
        for (size, stream) in [(4096, 1), (8192, 2), (4096, 3), (4608, 4)] {
            cache.put(Block { size, stream });
        }
        assert_eq!(cache.len(), 4);
        // Stream 1's block is the oldest.
        assert_eq!(cache.take_oldest(|_| true).map(|b| b.stream), Some(1));
        // Skipping what the caller may not free (stream 2 still busy, say): the next oldest.
        assert_eq!(
            cache.take_oldest(|b| b.stream != 2).map(|b| b.stream),
            Some(3)
        );
        // A block taken by size leaves the age order too.
        assert_eq!(cache.take(8192, 8192, |_| true).map(|b| b.stream), Some(2));
        assert_eq!(cache.take_oldest(|_| true).map(|b| b.stream), Some(4));
        assert_eq!((cache.len(), cache.bytes()), (0, 0));
        assert_eq!(cache.take_oldest(|_| true), None);
        // Re-cached blocks count as new.
        cache.put(Block {
            size: 4096,
            stream: 5,
        });
        cache.put(Block {
            size: 4096,
            stream: 6,
        });
        let five = cache.take(4096, 4096, |b| b.stream == 5).unwrap();
        cache.put(five);
        assert_eq!(cache.take_oldest(|_| true).map(|b| b.stream), Some(6));
    }

    #[test]
    fn reuse_bound_allows_exact_and_up_to_an_eighth_unused() {
        assert_eq!(largest_reusable(3584), 4096); // 512 of 4096 unused = 1/8
        assert!(largest_reusable(3583) < 4096);
        for class in [512, 4096, 2 << 20, 191 * (2 << 20)] {
            let largest = largest_reusable(class);
            assert!((largest - class) * 8 <= largest && largest >= class);
        }
    }

    #[test]
    fn cache_takes_smallest_usable_block_within_the_waste_bound() {
        let mut cache = BlockCache::new();
        for (size, stream) in [(4096, 1), (3584, 2), (8192, 1), (3584, 1)] {
            cache.put(Block { size, stream });
        }
        assert_eq!(cache.bytes(), 4096 + 3584 + 8192 + 3584);
        // Stream 1's 3584 block is most recent and smallest.
        let bound = largest_reusable(3584);
        assert_eq!(
            cache.take(3584, bound, |b| b.stream == 1),
            Some(Block {
                size: 3584,
                stream: 1
            })
        );
        // Only stream 2 accepted: its 3584 block.
        assert_eq!(
            cache.take(3584, bound, |b| b.stream == 2),
            Some(Block {
                size: 3584,
                stream: 2
            })
        );
        // Exact class only (the pinned pool's rule): the 4096 block is not taken.
        assert_eq!(cache.take(3584, 3584, |_| true), None);
        // Next best within the bound is 4096 (waste 512 = 1/8); 8192 is never used for 3584.
        assert_eq!(
            cache.take(3584, bound, |_| true),
            Some(Block {
                size: 4096,
                stream: 1
            })
        );
        assert_eq!(cache.take(3584, bound, |_| true), None);
        // A block nobody may use yet stays.
        assert_eq!(cache.take(8192, 8192, |_| false), None);
        assert_eq!(cache.bytes(), 8192);
        assert_eq!(
            cache.drain(),
            vec![Block {
                size: 8192,
                stream: 1
            }]
        );
        assert_eq!(cache.bytes(), 0);
    }
}
