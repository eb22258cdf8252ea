//! The size-keyed block cache shared by the device allocator, the pinned pool and the host pool
//! (their size classes are in [`crate::classes`]). Pure bookkeeping: no driver calls, so the
//! reuse rules are tested on any machine.

use std::collections::BTreeMap;

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
    use crate::classes::largest_reusable;

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
