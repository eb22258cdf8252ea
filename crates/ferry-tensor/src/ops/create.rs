//! Creating tensors directly on their device, and the seedable generator behind rand/randn.

use std::cell::RefCell;

use ferry_memory::{DType, Device, Element};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

use crate::cpu::{any_dispatch, build, float_dispatch};
use crate::layout::shape_bytes;
use crate::{Result, Tensor, TensorError, backend, cuda};

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
        match device {
            Device::Cpu => any_dispatch!(dtype, |T| build::<T>("arange", &[len], |out| {
                out.iter_mut()
                    .enumerate()
                    .for_each(|(i, o)| *o = <T as Element>::from_f64(start + i as f64))
            })),
            Device::Cuda(ordinal) => cuda::arange(ordinal, start, len, dtype),
        }
    }

    /// Uniform samples in `[0, 1)` from this thread's generator.
    pub fn rand(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        sample(shape, dtype, device, false, |rng| rng.random::<f64>())
    }

    /// Standard normal samples from this thread's generator.
    pub fn randn(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        sample(shape, dtype, device, true, |rng| {
            rng.sample::<f64, _>(StandardNormal)
        })
    }
}

/// Samples drawn on the host for CPU tensors; on a GPU the kernel draws them from a seed taken
/// from this thread's generator, so `manual_seed` makes both repeatable.
fn sample(
    shape: &[usize],
    dtype: DType,
    device: Device,
    normal: bool,
    draw: impl Fn(&mut StdRng) -> f64 + Sync,
) -> Result<Tensor> {
    /// Elements per generator: large tensors fill in parallel, each block from its own
    /// generator seeded by (draw seed, block index), so a seed still fixes every value.
    const BLOCK: usize = 1 << 16;
    let op = if normal { "randn" } else { "rand" };
    shape_bytes(op, shape, dtype)?;
    let seed = RNG.with(|rng| rng.borrow_mut().random::<u64>());
    match device {
        Device::Cpu => float_dispatch!(dtype, op, |T| build::<T>(op, shape, |out| {
            use rayon::prelude::*;
            out.par_chunks_mut(BLOCK)
                .enumerate()
                .for_each(|(block, out)| {
                    let mut rng = StdRng::seed_from_u64(
                        seed ^ (block as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
                    );
                    out.iter_mut()
                        .for_each(|o| *o = <T as Element>::from_f64(draw(&mut rng)));
                })
        })),
        Device::Cuda(ordinal) => cuda::random(ordinal, shape, dtype, seed, normal),
    }
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
