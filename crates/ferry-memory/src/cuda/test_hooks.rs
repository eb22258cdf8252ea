//! Test-only pauses inside the slow parts of the pools (making a pinned block or a pooled host
//! buffer, freeing cached device blocks after a synchronize), so a test can hold one thread there and check that other
//! threads' fast paths do not wait for it: an ordering test, not a timing threshold.

use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::Duration;

use parking_lot::Mutex;

/// A slow part that can be paused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slow {
    /// `PinnedPool` making a block (prefault and register, or `cuMemHostAlloc`).
    PinnedMake,
    /// The device allocator's `empty_cache`, before its device synchronize.
    DeviceRelease,
    /// `HostPool` faulting in the pages of a new buffer.
    HostMake,
}

struct Gate {
    slow: Slow,
    entered: Sender<()>,
    release: Receiver<()>,
}

static GATE: Mutex<Option<Gate>> = Mutex::new(None);

/// Called at the start of a slow part. When a test armed the gate for it, the first thread to
/// get here says so and waits until the test releases it.
pub(crate) fn slow_part(slow: Slow) {
    let gate = {
        let mut gate = GATE.lock();
        match &*gate {
            Some(g) if g.slow == slow => gate.take(),
            _ => None,
        }
    };
    if let Some(gate) = gate {
        let _ = gate.entered.send(());
        // Released by the test, or by its end (the sender drops).
        let _ = gate.release.recv();
    }
}

/// A gate a test armed; dropping it releases a thread held there.
pub(crate) struct Armed {
    entered: Receiver<()>,
    release: Option<Sender<()>>,
}

/// Arms the gate of `slow` for the next thread that reaches it.
pub(crate) fn arm(slow: Slow) -> Armed {
    let (entered_tx, entered_rx) = channel();
    let (release_tx, release_rx) = channel();
    *GATE.lock() = Some(Gate {
        slow,
        entered: entered_tx,
        release: release_rx,
    });
    Armed {
        entered: entered_rx,
        release: Some(release_tx),
    }
}

impl Armed {
    /// Whether a thread reached the gate within `timeout`.
    pub(crate) fn entered(&self, timeout: Duration) -> bool {
        !matches!(
            self.entered.recv_timeout(timeout),
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected)
        )
    }

    /// Lets the held thread go on.
    pub(crate) fn release(mut self) {
        if let Some(tx) = self.release.take() {
            let _ = tx.send(());
        }
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        // Disarm if nobody came; a held thread is released when `release` drops.
        let mut gate = GATE.lock();
        if gate.is_some() {
            *gate = None;
        }
    }
}

/// Tests that arm gates or time the pools take turns.
pub(crate) static SERIAL: Mutex<()> = Mutex::new(());
