//! Grad mode: a thread-local switch that decides whether ops record nodes.

use std::cell::Cell;

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Whether ops on this thread currently record backward nodes.
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(Cell::get)
}

/// Restores the previous grad mode when dropped.
#[must_use = "grad mode is restored as soon as the guard is dropped"]
#[derive(Debug)]
pub struct GradModeGuard {
    previous: bool,
    // The mode is thread-local, so the guard must stay on its thread.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl GradModeGuard {
    fn set(enabled: bool) -> Self {
        let previous = GRAD_ENABLED.with(|g| g.replace(enabled));
        Self {
            previous,
            _not_send: std::marker::PhantomData,
        }
    }
}

impl Drop for GradModeGuard {
    fn drop(&mut self) {
        GRAD_ENABLED.with(|g| g.set(self.previous));
    }
}

/// Turns recording off on this thread until the guard drops (inference, optimizer steps).
pub fn no_grad() -> GradModeGuard {
    GradModeGuard::set(false)
}

/// Turns recording back on inside a [`no_grad`] region until the guard drops.
pub fn enable_grad() -> GradModeGuard {
    GradModeGuard::set(true)
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
}
