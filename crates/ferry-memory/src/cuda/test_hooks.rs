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

/// A stream held on the device by a host function until the test lets it go (or 60 s pass):
/// work queued there after [`hold`] and events recorded there stay incomplete until then.
pub(crate) struct Held {
    release: Sender<()>,
}

impl Held {
    /// Lets the stream run on.
    pub(crate) fn release(self) {
        let _ = self.release.send(());
    }
}

unsafe extern "C" fn wait_for_release(data: *mut std::ffi::c_void) {
    // The callback owns the receiver and makes no CUDA calls.
    // SAFETY: `hold` leaked this box for the callback, which runs once.
    let receiver = unsafe { Box::from_raw(data.cast::<Receiver<()>>()) };
    let _ = receiver.recv_timeout(Duration::from_secs(60));
}

/// Holds `stream` until the returned guard is released or dropped.
pub(crate) fn hold(stream: &super::Stream) -> Held {
    let (release, receiver) = channel();
    let receiver = Box::into_raw(Box::new(receiver));
    // SAFETY: the callback takes ownership of the boxed receiver and makes no CUDA calls.
    let launch = unsafe {
        cudarc::driver::sys::cuLaunchHostFunc(
            stream.cudarc().cu_stream(),
            Some(wait_for_release),
            receiver.cast(),
        )
    };
    if launch != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        // SAFETY: a failed launch did not hand the box to the callback.
        drop(unsafe { Box::from_raw(receiver) });
        panic!("cuLaunchHostFunc failed: {launch:?}");
    }
    Held { release }
}

/// A second, non-primary context on `device`'s GPU: its streams are not waited for by the
/// device's own synchronize, as another GPU's would not be. The device's context is bound
/// again before this returns.
pub(crate) fn second_context(
    device: &super::CudaDevice,
) -> std::sync::Arc<cudarc::driver::CudaContext> {
    use cudarc::driver::sys;
    let cu_device = device.inner.ctx.cu_device();
    let mut ctx = std::ptr::null_mut();
    // SAFETY: a fresh context on a valid device; no creation parameters.
    unsafe { sys::cuCtxCreate_v4(&mut ctx, std::ptr::null_mut(), 0, cu_device) }
        .result()
        .expect("cuCtxCreate");
    // SAFETY: `ctx` was just created on `cu_device`; the wrapper destroys it on drop.
    let other =
        unsafe { cudarc::driver::CudaContext::from_raw_context(device.ordinal(), cu_device, ctx) }
            .expect("wrapping the second context");
    device.bind().unwrap();
    other
}
