//! Registration of existing host memory: page-locked in place for as long as a guard lives.

use std::fmt;
use std::ops::{Deref, DerefMut};

use cudarc::driver::result;
use cudarc::driver::sys::{self, CUresult};

use crate::MemoryError;
use crate::cuda::device::CudaDevice;
use crate::cuda::stream::driver;
use crate::error::human_bytes;

/// Existing host memory page-locked in place for as long as this guard lives, so copies into it
/// are direct DMA; unregistered on drop.
pub struct HostRegistration<'a> {
    bytes: &'a mut [u8],
    device: CudaDevice,
}

impl CudaDevice {
    /// Page-locks `bytes` (any alignment) until the returned guard drops.
    pub fn register_host<'a>(
        &self,
        bytes: &'a mut [u8],
    ) -> Result<HostRegistration<'a>, MemoryError> {
        self.check()?;
        if !bytes.is_empty() {
            self.bind()?;
            // SAFETY: `bytes` is valid for its length and stays borrowed (so allocated and
            // unmoved) until the guard unregisters it.
            unsafe {
                sys::cuMemHostRegister_v2(
                    bytes.as_mut_ptr().cast(),
                    bytes.len(),
                    sys::CU_MEMHOSTREGISTER_PORTABLE,
                )
            }
            .result()
            .map_err(driver("cuMemHostRegister"))?;
        }
        Ok(HostRegistration {
            bytes,
            device: self.clone(),
        })
    }
}

impl Deref for HostRegistration<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.bytes
    }
}

impl DerefMut for HostRegistration<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.bytes
    }
}

impl Drop for HostRegistration<'_> {
    fn drop(&mut self) {
        if self.bytes.is_empty() {
            return;
        }
        let outcome = self.device.bind().and_then(|()| {
            // SAFETY: registered in `register_host`; copies into it are synchronous, so none is
            // in flight.
            match unsafe { sys::cuMemHostUnregister(self.bytes.as_mut_ptr().cast()) } {
                CUresult::CUDA_SUCCESS => Ok(()),
                other => Err(driver("cuMemHostUnregister")(result::DriverError(other))),
            }
        });
        if let Err(e) = outcome {
            self.device.defer(
                format!(
                    "unregistering {} of host memory page-locked by CudaDevice::register_host",
                    human_bytes(self.bytes.len())
                ),
                e,
            );
        }
    }
}

impl fmt::Debug for HostRegistration<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostRegistration")
            .field("len", &self.bytes.len())
            .finish()
    }
}
