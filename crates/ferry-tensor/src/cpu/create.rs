//! Tensors made on the host: ranges and random samples.

use ferry_memory::{DType, Device, Element};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

use super::Cpu;
use crate::Result;
use crate::cpu::{any_dispatch, build, float_dispatch};
use crate::kernel::{Create, Dense};

impl Create for Cpu {
    /// Host storage of `shape` and `dtype` with every element `value`.
    fn full(&self, _: Device, shape: &[usize], dtype: DType, value: f64) -> Result<Dense> {
        any_dispatch!(dtype, |T| build::<T>("full", shape, |out| out
            .fill(<T as Element>::from_f64(value))))
    }

    /// `start, start + 1, ..` (`len` of them).
    fn arange(&self, _: Device, start: f64, len: usize, dtype: DType) -> Result<Dense> {
        any_dispatch!(dtype, |T| build::<T>("arange", &[len], |out| {
            out.iter_mut()
                .enumerate()
                .for_each(|(i, o)| *o = <T as Element>::from_f64(start + i as f64))
        }))
    }

    /// Uniform samples in `[0, 1)`, or standard normal ones when `normal`, fixed by `seed`.
    fn random(
        &self,
        _: Device,
        shape: &[usize],
        dtype: DType,
        seed: u64,
        normal: bool,
    ) -> Result<Dense> {
        if normal {
            fill("randn", shape, dtype, seed, |rng| {
                rng.sample::<f64, _>(StandardNormal)
            })
        } else {
            fill("rand", shape, dtype, seed, |rng| rng.random::<f64>())
        }
    }
}

/// Elements per generator: large tensors fill in parallel, each block from its own generator
/// seeded by (draw seed, block index), so a seed still fixes every value.
const BLOCK: usize = 1 << 16;

fn fill(
    op: &'static str,
    shape: &[usize],
    dtype: DType,
    seed: u64,
    draw: impl Fn(&mut StdRng) -> f64 + Sync,
) -> Result<Dense> {
    float_dispatch!(dtype, op, |T| build::<T>(op, shape, |out| {
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
    }))
}
