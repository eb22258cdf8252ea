//! Per-device state of each CUDA library (cuBLAS, cuBLASLt, cuDNN, the kernel cache). A library
//! declares its state as a type of its own, in its own module, and finds it through
//! `CudaDevice::local`: the device type names none of them, so adding a library touches only
//! that library's folder. A leaf module: it knows nothing of the device.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::RwLock;

/// One slot per state type, each made on first use and kept as long as the device.
#[derive(Default)]
pub(crate) struct DeviceLocals(RwLock<HashMap<TypeId, Arc<dyn Any + Send + Sync>>>);

impl DeviceLocals {
    /// The `T`, made with `T::default()` on first use. Found under a read lock (every kernel
    /// launch asks, from any thread); the write lock only inserts a new slot; `T` guards its own
    /// contents.
    pub(crate) fn get<T: Default + Send + Sync + 'static>(&self) -> Arc<T> {
        let found = self.0.read().get(&TypeId::of::<T>()).map(Arc::clone);
        let slot = match found {
            Some(slot) => slot,
            None => Arc::clone(
                self.0
                    .write()
                    .entry(TypeId::of::<T>())
                    .or_insert_with(|| Arc::new(T::default())),
            ),
        };
        match slot.downcast::<T>() {
            Ok(state) => state,
            Err(_) => unreachable!("a slot holds the type it is keyed by"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[derive(Default)]
    struct Counter(AtomicUsize);

    #[derive(Default)]
    struct Other(parking_lot::Mutex<Vec<u8>>);

    #[test]
    fn each_type_has_one_slot_shared_by_every_lookup() {
        let locals = DeviceLocals::default();
        let a = locals.get::<Counter>();
        a.0.fetch_add(3, Ordering::Relaxed);
        let b = locals.get::<Counter>();
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(b.0.load(Ordering::Relaxed), 3);
        locals.get::<Other>().0.lock().push(7);
        assert_eq!(locals.0.read().len(), 2);
        assert_eq!(*locals.get::<Other>().0.lock(), vec![7]);
        assert_eq!(locals.get::<Counter>().0.load(Ordering::Relaxed), 3);
    }
}
