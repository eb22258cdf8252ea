//! Per-op cost of CPU autograd on 64x64 tensors: forward and backward of mul, add and relu.
//!
//! `cargo run --release -p ferry-tensor --example autograd_overhead`

use std::time::Instant;

use ferry_tensor::{DType, Device, Result, Tensor};

fn main() -> Result<()> {
    let x = Tensor::randn(&[64, 64], DType::F32, Device::Cpu)?.with_grad()?;
    let y = Tensor::randn(&[64, 64], DType::F32, Device::Cpu)?.with_grad()?;
    let step = || -> Result<()> {
        let z = x.mul(&y)?.add(&x)?.relu()?.sum()?;
        z.backward().map(|_| ())
    };
    for _ in 0..200 {
        step()?;
    }
    let rounds = 5_000;
    let mut samples = Vec::new();
    for _ in 0..7 {
        let start = Instant::now();
        for _ in 0..rounds {
            step()?;
        }
        samples.push(start.elapsed().as_secs_f64() / rounds as f64);
    }
    samples.sort_by(f64::total_cmp);
    // Forward: mul, add, relu, sum; backward: the same four nodes plus two leaf accumulations.
    let ops = 4.0;
    println!(
        "64x64 mul+add+relu+sum, forward+backward: {:.2} us per step, {:.2} us per op (median of 7)",
        samples[3] * 1e6,
        samples[3] * 1e6 / ops
    );
    Ok(())
}
