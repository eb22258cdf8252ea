//! A pool of one CUDA library's handles on one device, so that threads sharing a GPU do not
//! queue behind one handle: a call takes an idle handle (or makes one when none is idle) and
//! gives it back when it returns. The lock guards the list only: it is held to pop and to push,
//! never while a handle is made or used. A leaf module, generic over the handle, so the same
//! pool serves cuBLAS, cuBLASLt and cuDNN and its logic is tested without a GPU.
//!
//! PyTorch keeps a handle pool per device too (and reserves a handle to a thread); here a
//! handle goes back to the pool after each call, so a pool holds as many handles as calls ever
//! ran at once on that device.

use std::ops::{Deref, DerefMut};

use parking_lot::Mutex;

/// The idle handles of one library on one device (see the module docs).
pub(crate) struct HandlePool<H> {
    idle: Mutex<Vec<H>>,
}

impl<H> Default for HandlePool<H> {
    fn default() -> Self {
        Self {
            idle: Mutex::new(Vec::new()),
        }
    }
}

impl<H> HandlePool<H> {
    /// The handle given back last (its memory is the likeliest to be warm), or, when none is
    /// idle, a new one from `make`, called without the lock. The handle returns to the pool
    /// when the lease drops; one that `make` failed to make leaves nothing behind.
    pub(crate) fn take<E>(&self, make: impl FnOnce() -> Result<H, E>) -> Result<Lease<'_, H>, E> {
        let idle = self.idle.lock().pop();
        let handle = match idle {
            Some(handle) => handle,
            None => make()?,
        };
        Ok(Lease {
            pool: self,
            handle: Some(handle),
        })
    }

    /// How many handles are idle now.
    #[cfg(test)]
    fn idle(&self) -> usize {
        self.idle.lock().len()
    }
}

/// A handle taken from a [`HandlePool`], used by one call at a time and given back on drop.
pub(crate) struct Lease<'a, H> {
    pool: &'a HandlePool<H>,
    /// `Some` until the drop gives it back.
    handle: Option<H>,
}

impl<H> Deref for Lease<'_, H> {
    type Target = H;

    fn deref(&self) -> &H {
        match &self.handle {
            Some(handle) => handle,
            None => unreachable!("a lease holds its handle until it drops"),
        }
    }
}

impl<H> DerefMut for Lease<'_, H> {
    fn deref_mut(&mut self) -> &mut H {
        match &mut self.handle {
            Some(handle) => handle,
            None => unreachable!("a lease holds its handle until it drops"),
        }
    }
}

impl<H> Drop for Lease<'_, H> {
    fn drop(&mut self) {
        if let Some(handle) = self.handle.take() {
            self.pool.idle.lock().push(handle);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Barrier;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// A stand-in for a library handle: a number from a counter, as a handle's address would be.
    #[derive(Debug, PartialEq)]
    struct FakeHandle(usize);

    struct Maker(AtomicUsize);

    impl Maker {
        fn make(&self) -> Result<FakeHandle, String> {
            Ok(FakeHandle(self.0.fetch_add(1, Ordering::SeqCst)))
        }
    }

    #[test]
    fn two_threads_at_once_hold_two_handles_and_returned_handles_are_reused() {
        let pool = HandlePool::<FakeHandle>::default();
        let maker = Maker(AtomicUsize::new(0));
        // Both threads hold their lease while the other takes one: the second cannot get the
        // first's handle, so a second one is made.
        let both_hold = Barrier::new(2);
        let taken: Vec<usize> = std::thread::scope(|s| {
            let threads: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        let lease = pool.take(|| maker.make()).unwrap();
                        both_hold.wait();
                        lease.0
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        assert_ne!(taken[0], taken[1], "two calls at once shared a handle");
        assert_eq!(maker.0.load(Ordering::SeqCst), 2);
        assert_eq!(pool.idle(), 2, "both handles went back to the pool");

        // One call after the other: the handles made before serve, and none is made.
        for _ in 0..5 {
            let lease = pool.take(|| maker.make()).unwrap();
            assert!(lease.0 < 2, "{:?}", *lease);
            assert_eq!(pool.idle(), 1);
        }
        assert_eq!(maker.0.load(Ordering::SeqCst), 2);
        // The handle given back last is the one taken next.
        let first = pool.take(|| maker.make()).unwrap();
        let id = first.0;
        drop(first);
        assert_eq!(pool.take(|| maker.make()).unwrap().0, id);
    }

    #[test]
    fn a_failed_make_leaves_the_pool_as_it_was() {
        let pool = HandlePool::<FakeHandle>::default();
        let err = pool
            .take(|| Err::<FakeHandle, _>("no library".to_string()))
            .err();
        assert_eq!(err.as_deref(), Some("no library"));
        assert_eq!(pool.idle(), 0);
        let mut lease = pool.take(|| Ok::<_, String>(FakeHandle(7))).unwrap();
        lease.0 = 8; // a call may change its handle's state (its stream, say)
        drop(lease);
        assert_eq!(
            *pool.take(|| Ok::<_, String>(FakeHandle(9))).unwrap(),
            FakeHandle(8)
        );
    }
}
