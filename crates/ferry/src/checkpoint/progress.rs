//! What an asynchronous save's snapshot thread, writer thread and `PendingSave` share: how
//! far the save is, and the extra host memory it holds (which the bounded mode caps).

use std::path::PathBuf;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// What a save's threads and its `PendingSave` share.
pub(super) struct Shared {
    pub path: PathBuf,
    pub called: Instant,
    state: Mutex<State>,
    changed: Condvar,
    /// The most snapshot bytes held at once in the bounded mode.
    bound: Option<usize>,
    /// Whether the file waits for `confirmed` (or `abandoned`) before its rename.
    pub needs_confirm: bool,
}

#[derive(Default)]
pub(super) struct State {
    /// Set when every tensor is copied, or the snapshot stopped.
    pub snapshot: Option<Duration>,
    pub finished: bool,
    pub abandoned: Option<String>,
    pub confirmed: bool,
    /// The error of a save nobody waited for.
    pub error: Option<String>,
    pub host: usize,
    pub host_peak: usize,
    pub pinned: usize,
    pub pinned_peak: usize,
}

impl Shared {
    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn wait<'a>(&self, guard: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.changed.wait(guard).unwrap_or_else(|p| p.into_inner())
    }

    pub fn update(&self, f: impl FnOnce(&mut State)) {
        f(&mut self.lock());
        self.changed.notify_all();
    }

    /// Counts `bytes` of pageable snapshot, first waiting (in the bounded mode) until they fit
    /// beside what the writer has not written yet.
    pub fn hold_host(&self, bytes: usize) {
        let mut state = self.lock();
        if let Some(bound) = self.bound {
            // One piece always fits: pieces are a fraction of the bound.
            while state.host - state.pinned > 0 && state.host - state.pinned + bytes > bound {
                state = self.wait(state);
            }
        }
        state.host += bytes;
        state.host_peak = state.host_peak.max(state.host);
    }

    pub fn release_host(&self, bytes: usize) {
        self.update(|s| s.host -= bytes);
    }

    /// Counts pinned memory (ring slots, pinned pieces): host memory too.
    pub fn hold_pinned(&self, bytes: usize) {
        self.update(|s| {
            s.pinned += bytes;
            s.host += bytes;
            s.pinned_peak = s.pinned_peak.max(s.pinned);
            s.host_peak = s.host_peak.max(s.host);
        });
    }

    pub fn release_pinned(&self, bytes: usize) {
        self.update(|s| {
            s.pinned -= bytes;
            s.host -= bytes;
        });
    }
}

impl Shared {
    /// A save of `path` called at `called`; `bound` caps its pageable snapshot;
    /// `needs_confirm` holds the rename for a confirmation.
    pub fn new(path: PathBuf, called: Instant, bound: Option<usize>, needs_confirm: bool) -> Self {
        Self {
            path,
            called,
            state: Mutex::default(),
            changed: Condvar::new(),
            bound,
            needs_confirm,
        }
    }
}
