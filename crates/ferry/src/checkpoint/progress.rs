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
    /// Pinned pieces of their own counted within the bound (`Bounded` mode's device pieces).
    pub paced: usize,
    /// The most snapshot bytes held at once in the bounded mode.
    pub bound: Option<usize>,
}

impl State {
    /// The snapshot bytes the bound counts: pageable pieces and pinned pieces of their own
    /// held under it (the pinned ring aside).
    fn bounded(&self) -> usize {
        self.host - self.pinned + self.paced
    }

    /// Whether `bytes` more fit the bound beside what the writer has not written yet (one
    /// piece always fits: pieces are a fraction of the bound).
    fn fits(&self, bytes: usize) -> bool {
        self.bound
            .is_none_or(|bound| self.bounded() == 0 || self.bounded() + bytes <= bound)
    }
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
        let mut state = self.wait_for_room(bytes);
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

    /// Whether `bytes` more of snapshot fit the bound now.
    pub fn fits(&self, bytes: usize) -> bool {
        self.lock().fits(bytes)
    }

    /// Waits until `bytes` more of snapshot fit the bound; returns the state, locked.
    fn wait_for_room(&self, bytes: usize) -> MutexGuard<'_, State> {
        let mut state = self.lock();
        while !state.fits(bytes) {
            state = self.wait(state);
        }
        state
    }

    /// Counts a pinned piece of its own held within the bound, first waiting until it fits.
    pub fn hold_paced(&self, bytes: usize) {
        let mut state = self.wait_for_room(bytes);
        state.paced += bytes;
        state.pinned += bytes;
        state.host += bytes;
        state.pinned_peak = state.pinned_peak.max(state.pinned);
        state.host_peak = state.host_peak.max(state.host);
    }

    pub fn release_paced(&self, bytes: usize) {
        self.update(|s| {
            s.paced -= bytes;
            s.pinned -= bytes;
            s.host -= bytes;
        });
    }

    /// Sets the bound on the snapshot bytes held at once (where the mode is decided after the
    /// save began: `Auto`).
    pub fn set_bound(&self, bound: Option<usize>) {
        self.update(|s| s.bound = bound);
    }
}

impl Shared {
    /// A save of `path` called at `called`; `bound` caps its pageable snapshot;
    /// `needs_confirm` holds the rename for a confirmation.
    pub fn new(path: PathBuf, called: Instant, bound: Option<usize>, needs_confirm: bool) -> Self {
        Self {
            path,
            called,
            state: Mutex::new(State {
                bound,
                ..State::default()
            }),
            changed: Condvar::new(),
            needs_confirm,
        }
    }
}
