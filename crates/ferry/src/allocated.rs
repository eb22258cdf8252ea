//! Allocated bytes of either kind of device, read one way: ferry's host statistics for
//! [`Device::Cpu`] ([`crate::host`]), the caching allocator's for a GPU ([`crate::cuda`]). What
//! measures a step's memory on whichever device it runs (a plan's measured peaks, the tests
//! that check them) reads it here.
//!
//! ```
//! use ferry::prelude::*;
//!
//! let before = ferry::allocated::current(Device::Cpu)?;
//! ferry::allocated::reset_peak(Device::Cpu)?;
//! let x = Tensor::zeros(&[1024], DType::F32, Device::Cpu)?;
//! assert!(ferry::allocated::peak(Device::Cpu)? >= before + 4096);
//! # drop(x);
//! # Ok::<(), ferry::TensorError>(())
//! ```

use ferry_tensor::{Device, Result};

/// Bytes allocated on `on` now; on a GPU once its queued work has finished, so that the frees
/// deferred behind that work are counted.
pub fn current(on: Device) -> Result<usize> {
    match on {
        Device::Cpu => Ok(crate::host::memory_allocated()),
        gpu => {
            crate::cuda::synchronize(gpu)?;
            crate::cuda::memory_allocated(gpu)
        }
    }
}

/// The most bytes allocated at once on `on` since the last [`reset_peak`] (or start).
pub fn peak(on: Device) -> Result<usize> {
    match on {
        Device::Cpu => Ok(crate::host::max_memory_allocated()),
        gpu => crate::cuda::max_memory_allocated(gpu),
    }
}

/// Restarts `on`'s peak tracking from what is allocated now.
pub fn reset_peak(on: Device) -> Result<()> {
    match on {
        Device::Cpu => crate::host::reset_peak(),
        gpu => crate::cuda::reset_peak(gpu)?,
    }
    Ok(())
}
