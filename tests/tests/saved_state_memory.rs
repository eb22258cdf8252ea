//! The saved-state cases of the suite (tests/saved_state/cases.rs) with memory read from the
//! source as well: on a GPU the allocator's allocated bytes, on the host ferry's host
//! statistics. Both are process-wide, so these take the binary's lock.

use ferry::memory::cuda::CudaDevice;
use ferry_tensor::{Device, Result};
use ferry_tests::device_test;

#[path = "saved_state/cases.rs"]
mod cases;

use cases::Meter;

/// Allocated bytes of one device: the caching allocator's on a GPU, the host statistics on the
/// CPU (pinned memory, counted apart, is not seen).
struct Allocated(Device);

impl Meter for Allocated {
    fn allocated(&self) -> Result<usize> {
        match self.0 {
            Device::Cpu => Ok(ferry::host::memory_allocated()),
            gpu => ferry::cuda::memory_allocated(gpu),
        }
    }

    fn block(&self, device: Device, bytes: usize) -> usize {
        match device {
            d if d != self.0 => 0,
            Device::Cpu => bytes,
            // The allocator's classes: 512 B granules below 1 MiB, 2 MiB granules from there.
            Device::Cuda(_) if bytes == 0 => 0,
            Device::Cuda(_) if bytes < 1 << 20 => bytes.next_multiple_of(512),
            Device::Cuda(_) => bytes.next_multiple_of(2 << 20),
        }
    }
}

fn serial() -> std::sync::MutexGuard<'static, ()> {
    super::LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

fn every_op(device: Device) -> Result<()> {
    let _serial = serial();
    if let Device::Cuda(ordinal) = device {
        CudaDevice::get(ordinal)?.synchronize()?;
    }
    let meter = Allocated(device);
    for group in [
        cases::binary(),
        cases::unary(),
        cases::reductions(),
        cases::matmul(),
        cases::shapes(),
        cases::softmax_family(),
        cases::moves_and_chains(),
    ] {
        for case in &group {
            cases::check(device, case, Some(&meter))?;
        }
    }
    Ok(())
}
device_test!(every_op_allocates_only_what_its_rule_keeps, every_op);

fn chain(device: Device) -> Result<()> {
    let _serial = serial();
    cases::chain_keeps_only_the_leaf_and_exp(device, Some(&Allocated(device)))
}
device_test!(a_four_op_chain_allocates_the_leaf_and_exp_output, chain);
