//! `ferry train --devices ...`: one process group rank per device.

use ferry::distributed::ProcessGroup;
use ferry::prelude::*;

/// One group rank per device: host ranks for `cpu,cpu,...`, NCCL for CUDA devices.
pub(super) fn groups(devices: &[Device]) -> Result<Vec<ProcessGroup>, String> {
    if devices.iter().all(|d| *d == Device::Cpu) {
        return Ok(ProcessGroup::host(devices.len()));
    }
    if devices.contains(&Device::Cpu) {
        return Err(format!(
            "--devices mixes the CPU and GPUs ({}); list only CUDA devices, or only cpu",
            devices
                .iter()
                .map(Device::to_string)
                .collect::<Vec<_>>()
                .join(",")
        ));
    }
    ProcessGroup::nccl(devices).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixed_devices_are_refused_with_the_fix() {
        let err = groups(&[Device::Cpu, Device::Cuda(0)]).unwrap_err();
        assert!(err.contains("only CUDA devices"), "{err}");
        assert_eq!(groups(&[Device::Cpu, Device::Cpu]).unwrap().len(), 2);
    }
}
