//! A kernel profiler: while it is on, every kernel launch, GEMM and convolution ferry queues on a
//! device is bracketed by two timed events on its stream, and [`Profiling::stop_profile`] sums
//! the GPU time between them by name.
//!
//! What it measures is the time from the moment the GPU reached the work to the moment it
//! finished it. When the host queues work faster than the GPU runs it, that is the work's own
//! time; when the GPU waits for the host, the wait for the launch after the first event counts
//! too. Benchmarks that want the first put a long product ahead of what they profile, so the
//! host runs ahead (`ferry bench train --profile` does). While no device is profiled, the
//! profiler costs one relaxed atomic load per launch. Its state is a device slot of its own
//! (`CudaDevice::local`), beside the libraries it times.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use ferry_memory::MemoryError;
use ferry_memory::cuda::{CudaDevice, Event, Stream};
use parking_lot::Mutex;

use crate::CudaLibError;
use crate::sealed::Sealed;

/// GPU time spent in one kind of work while the profiler was on.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelTime {
    /// The kernel's name, or `gemm MxNxK ...` / `conv ...` for library calls.
    pub name: String,
    /// How many times it ran.
    pub launches: u64,
    /// Milliseconds summed over its runs.
    pub total_ms: f64,
}

struct Bracket {
    name: Cow<'static, str>,
    start: Event,
    end: Event,
}

/// How many devices have their profiler on: while none has, a launch looks at nothing else.
static PROFILING: AtomicUsize = AtomicUsize::new(0);

/// The per-device profiler state (a device slot).
#[derive(Default)]
struct Profiler {
    on: AtomicBool,
    brackets: Mutex<Vec<Bracket>>,
}

/// The kernel profiler of a device (see the module docs).
pub trait Profiling: Sealed {
    /// Starts timing every launch, GEMM and convolution queued on this device, from any thread;
    /// anything timed before and not yet collected is dropped.
    fn start_profile(&self);

    /// Stops the profiler, waits for the timed work, and returns its GPU time by name, most
    /// first.
    fn stop_profile(&self) -> Result<Vec<KernelTime>, MemoryError>;
}

impl Profiling for CudaDevice {
    fn start_profile(&self) {
        let profiler = self.local::<Profiler>();
        profiler.brackets.lock().clear();
        if !profiler.on.swap(true, Ordering::SeqCst) {
            PROFILING.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn stop_profile(&self) -> Result<Vec<KernelTime>, MemoryError> {
        let profiler = self.local::<Profiler>();
        if profiler.on.swap(false, Ordering::SeqCst) {
            PROFILING.fetch_sub(1, Ordering::SeqCst);
        }
        let brackets = std::mem::take(&mut *profiler.brackets.lock());
        self.synchronize()?;
        let mut by_name: HashMap<Cow<'static, str>, (u64, f64)> = HashMap::new();
        for bracket in brackets {
            let ms = Event::elapsed_ms(&bracket.start, &bracket.end)?;
            let entry = by_name.entry(bracket.name).or_default();
            entry.0 += 1;
            entry.1 += f64::from(ms);
        }
        let mut times: Vec<KernelTime> = by_name
            .into_iter()
            .map(|(name, (launches, total_ms))| KernelTime {
                name: name.into_owned(),
                launches,
                total_ms,
            })
            .collect();
        times.sort_by(|a, b| b.total_ms.total_cmp(&a.total_ms));
        Ok(times)
    }
}

/// Runs `queue` (which queues work on `stream` of `device`) between two timed events when the
/// device's profiler is on; `name` is only built then.
pub(crate) fn profiled<R>(
    device: &CudaDevice,
    stream: &Stream,
    name: impl FnOnce() -> Cow<'static, str>,
    queue: impl FnOnce() -> Result<R, CudaLibError>,
) -> Result<R, CudaLibError> {
    if PROFILING.load(Ordering::Relaxed) == 0 {
        return queue();
    }
    let profiler = device.local::<Profiler>();
    if !profiler.on.load(Ordering::Relaxed) {
        return queue();
    }
    let start = stream.record_timed()?;
    let out = queue()?;
    let end = stream.record_timed()?;
    let mut brackets = profiler.brackets.lock();
    // Read under the lock: work queued while `stop_profile` was stopping lands either in what it
    // collects or nowhere, never in the next profile.
    if profiler.on.load(Ordering::SeqCst) {
        brackets.push(Bracket {
            name: name(),
            start,
            end,
        });
    }
    Ok(out)
}
