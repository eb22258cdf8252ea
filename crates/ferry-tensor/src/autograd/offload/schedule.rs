//! When a saved activation's copy to the host is queued: at the second op recorded after the
//! save. Pure bookkeeping, so the schedule is tested on any machine.
//!
//! One record would do for ordering: by then the op that reads the activation next is queued,
//! and the copy, ordered on the device after the activation's producer alone, runs alongside
//! it. The second record keeps the last op's saves of a forward off the link: backward, which
//! usually follows at once, reads them first, on the device, instead of waiting for them to go
//! out and come back. Queuing later on the host delays nothing on the device (the host runs
//! ahead of it, and the copy waits for the producer only); it holds the device buffer through
//! one more op, which the caller, still holding the activation as the next op's input, usually
//! does anyway.

use std::collections::VecDeque;

/// Ops recorded after a save before its copy is queued.
pub(super) const QUEUE_AFTER_RECORDS: u32 = 2;

/// Saves whose copies are not queued yet, oldest first, each with the records it still waits
/// for.
pub(super) struct Waiting<T> {
    entries: VecDeque<(T, u32)>,
}

impl<T> Waiting<T> {
    pub(super) fn new() -> Self {
        Self {
            entries: VecDeque::new(),
        }
    }

    /// A save just made.
    pub(super) fn push(&mut self, item: T) {
        self.entries.push_back((item, QUEUE_AFTER_RECORDS));
    }

    /// One more op recorded: the saves whose copies are due now, oldest first.
    pub(super) fn record(&mut self) -> Vec<T> {
        for (_, left) in &mut self.entries {
            *left = left.saturating_sub(1);
        }
        // Pushed in order with the same wait, so the due ones are a prefix.
        let due = self
            .entries
            .iter()
            .take_while(|(_, left)| *left == 0)
            .count();
        self.entries.drain(..due).map(|(item, _)| item).collect()
    }

    /// Every save still waiting, oldest first (settling the scope).
    pub(super) fn drain(&mut self) -> Vec<T> {
        self.entries.drain(..).map(|(item, _)| item).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_is_queued_at_the_second_record_after_its_save_and_settling_queues_all() {
        // A 3-layer MLP, record by record (each record ticks first, then keeps the op's
        // saves): tanh saves its output, the next matmul shares that save, `sum` saves nothing.
        let mut waiting = Waiting::new();
        assert!(waiting.record().is_empty()); // matmul 1 (saves x and w1: the caller's)
        assert!(waiting.record().is_empty()); // tanh 1
        waiting.push("y1");
        assert!(waiting.record().is_empty(), "due at the next op's record"); // matmul 2
        assert_eq!(waiting.record(), ["y1"]); // tanh 2
        waiting.push("y2");
        assert!(waiting.record().is_empty()); // matmul 3
        assert_eq!(waiting.record(), ["y2"]); // tanh 3
        waiting.push("y3");
        // The loss ends the forward: the last save still waits when backward starts, so
        // backward reads it where it is.
        assert!(waiting.record().is_empty(), "the loss's record queued y3"); // sum
        // Settling sends everything still waiting, oldest first.
        waiting.push("late");
        assert_eq!(waiting.drain(), ["y3", "late"]);
        assert!(waiting.record().is_empty());
    }

    #[test]
    fn saves_of_one_record_fall_due_together_in_order() {
        let mut waiting = Waiting::new();
        waiting.push(1);
        waiting.push(2); // one op saving two buffers
        assert!(waiting.record().is_empty());
        waiting.push(3);
        assert_eq!(waiting.record(), [1, 2]);
        assert_eq!(waiting.record(), [3]);
        assert!(waiting.record().is_empty());
    }
}
