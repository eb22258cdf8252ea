//! Checks of what a kernel found (an index out of range, a bad class), read by the host without
//! waiting for the device.
//!
//! A kernel that validates its input writes a small flag into device memory. Reading it at once
//! would make the host wait for the kernel, and every training step that validates its targets
//! would stall the pipeline of launches. Instead [`CudaDevice::check_later`] queues a copy of the
//! flag into pinned memory behind the kernel and keeps it; each checked call on the device (every
//! launch, copy, product and [`CudaDevice::synchronize`]) looks at the copies that have landed,
//! in order, and returns the first failure as its error, the way a fault inside a kernel is
//! reported by the next call. [`CudaDevice::synchronize`] waits for all of them, so a program
//! that reads any result from the device sees the error by then at the latest.
//!
//! Checks belong to the thread that queued them: its later calls report them, and another
//! thread's calls on the same device never see them (one thread's bad batch is not another
//! thread's error). They are kept per thread, so polling them takes no lock.

use std::cell::RefCell;

use super::buffer::DeviceBuffer;
use super::device::CudaDevice;
use super::pinned::{PinnedBuffer, PinnedPool};
use super::stream::Stream;
use crate::MemoryError;

/// Turns a landed flag's bytes into a failure message, or `None` when the input was good.
pub type CheckReport = Box<dyn FnOnce(&[u8]) -> Option<String> + Send>;

struct Pending {
    /// The ordinal of the device whose calls report it.
    device: usize,
    op: &'static str,
    flag: PinnedBuffer,
    report: CheckReport,
}

thread_local! {
    /// This thread's checks in flight on every device, in the order they were queued.
    static PENDING: RefCell<Vec<Pending>> = const { RefCell::new(Vec::new()) };
}

impl CudaDevice {
    /// Checks `flag` (bytes a kernel queued on `stream` wrote) without making the host wait: its
    /// bytes go to `report` once they reach the host, and a message `report` returns becomes
    /// [`MemoryError::DeviceCheck`] from this thread's next checked call on this device. Where no pinned
    /// memory is left within the pool's budget, the flag is read at once instead (waiting).
    pub fn check_later(
        &self,
        op: &'static str,
        flag: &DeviceBuffer,
        stream: &Stream,
        report: CheckReport,
    ) -> Result<(), MemoryError> {
        let mut landed = match PinnedPool::global().and_then(|pool| pool.alloc(flag.len())) {
            Ok(landed) => landed,
            Err(_) => {
                let mut bytes = vec![0u8; flag.len()];
                flag.copy_to_host(&mut bytes, stream)?;
                return match report(&bytes) {
                    Some(message) => Err(MemoryError::DeviceCheck { op, message }),
                    None => Ok(()),
                };
            }
        };
        flag.copy_to_pinned_async(&mut landed, stream)?;
        let device = self.ordinal();
        PENDING.with_borrow_mut(|pending| {
            pending.push(Pending {
                device,
                op,
                flag: landed,
                report,
            })
        });
        Ok(())
    }

    /// Reads this thread's checks on this device whose flags have reached the host, oldest
    /// first, and returns the first failure (the rest stay queued). With `all` (the device is
    /// idle), reads every one.
    pub(crate) fn poll_checks(&self, all: bool) -> Result<(), MemoryError> {
        let device = self.ordinal();
        loop {
            let next = PENDING.with_borrow_mut(|pending| {
                let at = pending.iter().position(|check| check.device == device)?;
                (all || pending[at].flag.is_ready()).then(|| pending.remove(at))
            });
            let Some(Pending {
                op, flag, report, ..
            }) = next
            else {
                return Ok(());
            };
            if let Some(message) = report(flag.as_bytes()?) {
                return Err(MemoryError::DeviceCheck { op, message });
            }
        }
    }
}
