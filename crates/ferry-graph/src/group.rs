//! Accounting per connected graph: live nodes, saved bytes, nodes recorded and pruned.
//!
//! Every node belongs to a group. A leaf starts a group of its own; an op's node joins the
//! group of its inputs, and an op whose inputs come from two groups merges them (the smaller
//! points at the larger, union-find style). The counts of a merged graph live at its root,
//! behind the root's own lock: threads working on independent graphs never touch the same
//! lock or cache line.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use crate::node::SavedBuffer;

/// Counts of one graph at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Nodes alive (leaves included).
    pub live_nodes: usize,
    /// Bytes of buffers that live nodes saved for backward, each buffer counted once.
    pub saved_bytes: usize,
    /// Nodes recorded since the graph began, pruned ones included.
    pub recorded: u64,
    /// Nodes pruned (freed) since the graph began.
    pub pruned: u64,
}

impl GraphStats {
    /// The counts of two graphs together.
    pub fn add(&mut self, other: &GraphStats) {
        self.live_nodes += other.live_nodes;
        self.saved_bytes += other.saved_bytes;
        self.recorded += other.recorded;
        self.pruned += other.pruned;
    }
}

/// Saved-buffer keys are addresses: multiplying by an odd constant spreads them well enough.
#[derive(Default)]
pub(crate) struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn write_usize(&mut self, n: usize) {
        self.0 = (n as u64)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .rotate_left(29);
    }
}

#[derive(Default)]
pub(crate) struct GroupState {
    live_nodes: usize,
    recorded: u64,
    pruned: u64,
    /// Bytes of saved buffers without a key (counted per node).
    unkeyed_bytes: usize,
    /// Bytes of the keyed buffers in `shared`, each counted once.
    keyed_bytes: usize,
    /// Keyed buffers saved by live nodes: bytes, and how many nodes save each.
    shared: HashMap<usize, (usize, usize), BuildHasherDefault<AddressHasher>>,
}

impl GroupState {
    pub(crate) fn stats(&self) -> GraphStats {
        GraphStats {
            live_nodes: self.live_nodes,
            saved_bytes: self.unkeyed_bytes + self.keyed_bytes,
            recorded: self.recorded,
            pruned: self.pruned,
        }
    }

    /// Bytes of the keyed buffers among `keys` that live nodes save now, each counted once.
    pub(crate) fn held_bytes(&self, keys: &[usize]) -> usize {
        let mut unique = keys.to_vec();
        unique.sort_unstable();
        unique.dedup();
        unique
            .iter()
            .filter_map(|k| self.shared.get(k))
            .filter(|(_, holders)| *holders > 0)
            .map(|(bytes, _)| bytes)
            .sum()
    }

    pub(crate) fn node_recorded(&mut self, saved: &[SavedBuffer]) {
        self.live_nodes += 1;
        self.recorded += 1;
        self.hold(saved);
    }

    pub(crate) fn node_pruned(&mut self, saved: &[SavedBuffer]) {
        self.live_nodes -= 1;
        self.pruned += 1;
        self.release(saved);
    }

    pub(crate) fn hold(&mut self, saved: &[SavedBuffer]) {
        for buffer in saved {
            match buffer.key {
                None => self.unkeyed_bytes += buffer.bytes,
                Some(key) => self.hold_keyed(key, buffer.bytes, 1),
            }
        }
    }

    fn hold_keyed(&mut self, key: usize, bytes: usize, holders: usize) {
        let entry = self.shared.entry(key).or_insert((bytes, 0));
        if entry.1 == 0 {
            self.keyed_bytes += entry.0;
        }
        entry.1 += holders;
    }

    pub(crate) fn release(&mut self, saved: &[SavedBuffer]) {
        for buffer in saved {
            match buffer.key {
                None => self.unkeyed_bytes -= buffer.bytes,
                Some(key) => {
                    let Some(entry) = self.shared.get_mut(&key) else {
                        debug_assert!(false, "a saved buffer released more often than held");
                        continue;
                    };
                    entry.1 -= 1;
                    if entry.1 == 0 {
                        self.keyed_bytes -= entry.0;
                        self.shared.remove(&key);
                    }
                }
            }
        }
    }

    /// Takes over everything `other` counted: the two graphs became one, and a buffer both
    /// saved is counted once from now on.
    fn absorb(&mut self, other: &mut GroupState) {
        let other = std::mem::take(other);
        self.live_nodes += other.live_nodes;
        self.recorded += other.recorded;
        self.pruned += other.pruned;
        self.unkeyed_bytes += other.unkeyed_bytes;
        for (key, (bytes, holders)) in other.shared {
            self.hold_keyed(key, bytes, holders);
        }
    }
}

/// One connected graph's accounting, or a forwarding pointer to the graph it merged into.
#[derive(Default)]
pub(crate) struct Group {
    parent: OnceLock<Arc<Group>>,
    state: Mutex<GroupState>,
}

impl Group {
    pub(crate) fn new() -> Arc<Group> {
        Arc::new(Group::default())
    }

    /// The group this one forwards to, or itself.
    pub(crate) fn root(self: &Arc<Self>) -> &Arc<Group> {
        let mut group = self;
        while let Some(parent) = group.parent.get() {
            group = parent;
        }
        group
    }

    /// Runs `f` on the root's counts, under the root's lock.
    pub(crate) fn with_state<R>(self: &Arc<Self>, f: impl FnOnce(&mut GroupState) -> R) -> R {
        let mut group = self.root();
        loop {
            let mut state = group.state.lock();
            // A parent is only ever set under the group's own lock: holding it without a parent
            // means this is the root until the lock is released.
            match group.parent.get() {
                None => return f(&mut state),
                Some(parent) => {
                    drop(state);
                    group = parent.root();
                }
            }
        }
    }

    /// One graph made of `self`'s and `other`'s; returns its root.
    pub(crate) fn merge(self: &Arc<Self>, other: &Arc<Group>) -> Arc<Group> {
        loop {
            let (a, b) = (self.root(), other.root());
            if Arc::ptr_eq(a, b) {
                return Arc::clone(a);
            }
            // Lock in address order so two merges of the same pair cannot deadlock.
            let (first, second) = if Arc::as_ptr(a) < Arc::as_ptr(b) {
                (a, b)
            } else {
                (b, a)
            };
            let mut s1 = first.state.lock();
            let mut s2 = second.state.lock();
            if first.parent.get().is_some() || second.parent.get().is_some() {
                continue; // another merge got there first; find the roots again
            }
            // The larger graph stays the root, so forwarding chains stay short.
            let (into, from, into_state, from_state) = if s1.live_nodes >= s2.live_nodes {
                (first, second, &mut *s1, &mut *s2)
            } else {
                (second, first, &mut *s2, &mut *s1)
            };
            into_state.absorb(from_state);
            let _ = from.parent.set(Arc::clone(into));
            return Arc::clone(into);
        }
    }

    /// The root's counts.
    pub(crate) fn stats(self: &Arc<Self>) -> GraphStats {
        self.with_state(|s| s.stats())
    }

    pub(crate) fn held_bytes(self: &Arc<Self>, keys: &[usize]) -> usize {
        self.with_state(|s| s.held_bytes(keys))
    }
}
