//! Finding CUDA devices without ever panicking when there is no driver.

use std::sync::OnceLock;

use cudarc::driver::{result, sys};

use crate::MemoryError;

/// What the driver says about one CUDA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaDeviceInfo {
    /// Ordinal, as in `Device::Cuda(ordinal)`.
    pub ordinal: usize,
    /// Marketing name (`NVIDIA H200`).
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Total device memory in bytes.
    pub total_memory: usize,
    /// Number of streaming multiprocessors.
    pub multiprocessors: i32,
}

/// Whether the CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // Asked once: each try dlopens (and dlcloses) every name the library may have, microseconds
    // that every call making a CUDA device handle would pay again.
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen libcuda; touches no driver state.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// The driver's CUDA version as (major, minor), e.g. (13, 0).
pub fn driver_version() -> Result<(i32, i32), MemoryError> {
    init()?;
    let mut version = 0;
    // SAFETY: the driver is loaded and initialised; `version` is a valid out-pointer.
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| MemoryError::Driver {
            call: "cuDriverGetVersion",
            message: e.to_string(),
        })?;
    Ok((version / 1000, (version % 1000) / 10))
}

pub(crate) fn init() -> Result<(), MemoryError> {
    if !driver_present() {
        return Err(MemoryError::NoDriver);
    }
    result::init().map_err(|e| MemoryError::Driver {
        call: "cuInit",
        message: e.to_string(),
    })
}

/// Every CUDA device the driver reports; [`MemoryError::NoDriver`] without a driver.
pub fn devices() -> Result<Vec<CudaDeviceInfo>, MemoryError> {
    init()?;
    let count = result::device::get_count().map_err(|e| MemoryError::Driver {
        call: "cuDeviceGetCount",
        message: e.to_string(),
    })?;
    (0..count).map(|ordinal| info(ordinal as usize)).collect()
}

pub(crate) fn info(ordinal: usize) -> Result<CudaDeviceInfo, MemoryError> {
    let driver = |call: &'static str| {
        move |e: cudarc::driver::DriverError| MemoryError::Driver {
            call,
            message: e.to_string(),
        }
    };
    let dev = result::device::get(ordinal as i32).map_err(driver("cuDeviceGet"))?;
    let attribute = |attr| {
        // SAFETY: `dev` is a valid device handle from cuDeviceGet.
        unsafe { result::device::get_attribute(dev, attr) }.map_err(driver("cuDeviceGetAttribute"))
    };
    use sys::CUdevice_attribute::*;
    Ok(CudaDeviceInfo {
        ordinal,
        name: result::device::get_name(dev).map_err(driver("cuDeviceGetName"))?,
        compute_capability: (
            attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ),
        // SAFETY: `dev` is a valid device handle from cuDeviceGet.
        total_memory: unsafe { result::device::total_mem(dev) }
            .map_err(driver("cuDeviceTotalMem"))?,
        multiprocessors: attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_driver_discovery_is_an_error_value() {
        if driver_present() {
            assert!(
                devices().is_ok(),
                "a machine with a driver lists its devices"
            );
        } else {
            let err = devices().unwrap_err();
            assert!(matches!(err, MemoryError::NoDriver));
            assert!(err.to_string().contains("use Device::Cpu"), "{err}");
            assert!(matches!(driver_version(), Err(MemoryError::NoDriver)));
        }
    }
}
