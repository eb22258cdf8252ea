//! Grad mode: thread-local switches that decide whether ops record nodes.
//!
//! [`no_grad`] turns recording off on the calling thread only. [`inference_mode`] does too, and
//! marks the tensors created meanwhile as inference data, which no op records on, on any
//! thread: work a thread pool runs on them records nothing. [`GradMode::current`] captures the
//! calling thread's mode so that a task sent to another thread can run under it.

use std::cell::Cell;

thread_local! {
    static MODE: Cell<GradMode> = const { Cell::new(GradMode::RECORDING) };
}

/// A thread's grad mode: whether ops record, and whether new tensors are inference data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GradMode {
    /// Ops record backward nodes.
    pub enabled: bool,
    /// Tensors created now are inference data (see [`inference_mode`]).
    pub inference: bool,
}

impl GradMode {
    const RECORDING: GradMode = GradMode {
        enabled: true,
        inference: false,
    };

    /// The calling thread's mode, to carry into work another thread runs.
    pub fn current() -> GradMode {
        MODE.with(Cell::get)
    }

    /// Makes this the calling thread's mode until the guard drops.
    pub fn enter(self) -> GradModeGuard {
        GradModeGuard {
            previous: MODE.with(|m| m.replace(self)),
            _not_send: std::marker::PhantomData,
        }
    }

    /// Runs `f` under this mode on whichever thread calls it: wrap tasks handed to a pool with
    /// `let mode = GradMode::current(); pool.spawn(move || mode.run(|| ..))`.
    pub fn run<R>(self, f: impl FnOnce() -> R) -> R {
        let _guard = self.enter();
        f()
    }
}

/// Whether ops on this thread currently record backward nodes.
pub fn is_grad_enabled() -> bool {
    MODE.with(Cell::get).enabled
}

/// Whether this thread is inside an [`inference_mode`] scope.
pub fn is_inference_mode() -> bool {
    MODE.with(Cell::get).inference
}

/// Restores the previous grad mode when dropped.
#[must_use = "grad mode is restored as soon as the guard is dropped"]
#[derive(Debug)]
pub struct GradModeGuard {
    previous: GradMode,
    // The mode is thread-local, so the guard must stay on its thread.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for GradModeGuard {
    fn drop(&mut self) {
        MODE.with(|m| m.set(self.previous));
    }
}

/// Turns recording off on this thread until the guard drops (evaluation, optimizer steps).
/// Other threads, a pool's workers included, keep their own mode.
pub fn no_grad() -> GradModeGuard {
    GradMode {
        enabled: false,
        ..GradMode::current()
    }
    .enter()
}

/// Turns recording back on inside a [`no_grad`] region until the guard drops.
pub fn enable_grad() -> GradModeGuard {
    GradMode {
        enabled: true,
        inference: false,
    }
    .enter()
}

/// Turns recording off on this thread and makes every tensor created meanwhile inference data:
/// an op that reads inference data records nothing and returns inference data, on any thread.
/// So work a pool runs on the batch of an inference scope records nothing, even though the
/// pool's threads are not in the scope.
pub fn inference_mode() -> GradModeGuard {
    GradMode {
        enabled: false,
        inference: true,
    }
    .enter()
}

/// Runs `f` with recording off.
pub fn with_no_grad<R>(f: impl FnOnce() -> R) -> R {
    let _guard = no_grad();
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guards_nest_and_restore() {
        assert!(is_grad_enabled());
        {
            let _outer = no_grad();
            assert!(!is_grad_enabled());
            {
                let _inner = enable_grad();
                assert!(is_grad_enabled());
            }
            assert!(!is_grad_enabled());
        }
        assert!(is_grad_enabled());
        assert!(!with_no_grad(is_grad_enabled));
    }

    #[test]
    fn a_captured_mode_travels_to_another_thread() {
        let _inference = inference_mode();
        let mode = GradMode::current();
        let seen = std::thread::spawn(move || {
            let before = (is_grad_enabled(), is_inference_mode());
            let inside = mode.run(|| (is_grad_enabled(), is_inference_mode()));
            (before, inside)
        })
        .join()
        .unwrap();
        assert_eq!(seen, ((true, false), (false, true)));
    }
}
