//! Creating tensors directly on their device, and the seedable generator behind rand/randn.

use std::cell::RefCell;

use ferry_memory::{DType, Device};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::layout::shape_bytes;
use crate::{Result, Tensor, TensorError, backend};

thread_local! {
    static RNG: RefCell<StdRng> = RefCell::new(StdRng::from_os_rng());
}

/// Seeds this thread's generator: the rand/randn calls that follow repeat exactly.
pub fn manual_seed(seed: u64) {
    RNG.with(|r| *r.borrow_mut() = StdRng::seed_from_u64(seed));
}

impl Tensor {
    /// Every element `value`, created on `device`.
    pub fn full(shape: &[usize], value: f64, dtype: DType, device: Device) -> Result<Tensor> {
        filled("full", shape, value, dtype, device)
    }

    /// All zeros.
    pub fn zeros(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        filled("zeros", shape, 0.0, dtype, device)
    }

    /// All ones.
    pub fn ones(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        filled("ones", shape, 1.0, dtype, device)
    }

    /// Zeros with this tensor's shape, dtype and device.
    pub fn zeros_like(&self) -> Result<Tensor> {
        Self::zeros(self.shape(), self.dtype(), self.device())
    }

    /// Ones with this tensor's shape, dtype and device.
    pub fn ones_like(&self) -> Result<Tensor> {
        Self::ones(self.shape(), self.dtype(), self.device())
    }

    /// `start, start + 1, ..` below `end`, as a 1-D tensor.
    pub fn arange(start: f64, end: f64, dtype: DType, device: Device) -> Result<Tensor> {
        if end < start || !(end - start).is_finite() {
            return Err(TensorError::InvalidArgument {
                op: "arange",
                message: format!("needs start <= end, got {start}..{end}"),
            });
        }
        let len = (end - start).ceil() as usize; // saturates: the size check refuses it
        shape_bytes("arange", &[len], dtype)?;
        backend::arange(start, len, dtype, device)
    }

    /// Uniform samples in `[0, 1)` from this thread's generator.
    pub fn rand(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        sample(shape, dtype, device, false)
    }

    /// Standard normal samples from this thread's generator.
    pub fn randn(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        sample(shape, dtype, device, true)
    }
}

/// Samples from a seed taken from this thread's generator (the host or the kernel draws them
/// from it), so `manual_seed` makes both devices repeatable.
fn sample(shape: &[usize], dtype: DType, device: Device, normal: bool) -> Result<Tensor> {
    let op = if normal { "randn" } else { "rand" };
    shape_bytes(op, shape, dtype)?;
    let seed = RNG.with(|rng| rng.borrow_mut().random::<u64>());
    backend::random(shape, dtype, device, seed, normal)
}

/// Every element `value`: sized (and refused when too large) before anything is allocated.
fn filled(
    op: &'static str,
    shape: &[usize],
    value: f64,
    dtype: DType,
    device: Device,
) -> Result<Tensor> {
    shape_bytes(op, shape, dtype)?;
    backend::full(shape, dtype, device, value)
}
