//! Threads sharing one GPU: each thread trains its own small MLP (three `Linear` layers, so each
//! step runs cuBLASLt's fused forward and cuBLAS's backward products) and the table gives the
//! steps per second of all threads together and the efficiency against one thread (N threads'
//! steps/s over N times one thread's). The matrices are small, so a step's host side (launches,
//! library handles, locks) weighs about as much as its arithmetic; every thread's kernels still go
//! to the device's one default stream. With `cpu` for the device the same steps run on host
//! threads, for comparison.
//!
//! The work can be narrowed to find what threads wait for: `linear` (the default, above),
//! `matmul` (products through cuBLAS only, no fused forward, no optimizer), `pointwise`
//! (elementwise kernels only: no library handle is used).
//!
//! `cargo run --release -p ferry --example gpu_threads [-- cuda:0 1,4,8,16 400 linear]`

use std::sync::Barrier;
use std::time::Instant;

use ferry::nn::{self, Linear, ReLU, Sequential};
use ferry::optim::Sgd;
use ferry::prelude::*;

/// Rows of each step's batch and width of every layer.
const BATCH: usize = 64;
const WIDTH: usize = 256;
/// Timed rounds per thread count; the table shows their median.
const ROUNDS: usize = 5;

fn model(device: Device) -> ferry::Result<Sequential> {
    Ok(Sequential::new()
        .push(Linear::new(WIDTH, WIDTH, device)?)
        .push(ReLU)
        .push(Linear::new(WIDTH, WIDTH, device)?)
        .push(ReLU)
        .push(Linear::new(WIDTH, 10, device)?))
}

/// What each thread does in a step.
#[derive(Debug, Clone, Copy)]
enum Work {
    Linear,
    Matmul,
    Pointwise,
}

/// One step of a thread's work, owning what it steps.
type Step = Box<dyn FnMut() -> ferry::Result<Tensor>>;

/// A thread's step: a model of its own trained with SGD (`Linear`), or the products or the
/// pointwise ops over leaves of its own, forward and backward.
fn step_of(work: Work, device: Device) -> ferry::Result<Step> {
    match work {
        Work::Linear => {
            let model = model(device)?;
            let mut opt = Sgd::new(model.parameters(), 1e-3)?;
            let x = Tensor::randn(&[BATCH, WIDTH], DType::F32, device)?;
            let y = Tensor::zeros(&[BATCH], DType::I64, device)?;
            Ok(Box::new(move || {
                opt.zero_grad();
                let loss = nn::cross_entropy(&model.forward(&x)?, &y)?;
                loss.backward()?;
                opt.step()?;
                Ok(loss)
            }))
        }
        Work::Matmul | Work::Pointwise => {
            let a = Tensor::randn(&[BATCH, WIDTH], DType::F32, device)?.with_grad()?;
            let w = Tensor::randn(&[WIDTH, WIDTH], DType::F32, device)?.with_grad()?;
            Ok(Box::new(move || {
                let y = match work {
                    Work::Matmul => a.matmul(&w)?.matmul(&w)?.sum()?,
                    _ => a.mul(&a)?.add(&a)?.relu()?.sum()?,
                };
                y.backward()?;
                Ok(y)
            }))
        }
    }
}

/// One thread's part of a round: its step made and taken once untimed (kernels compiled,
/// handles made, blocks cached), then `steps` steps once every thread is ready, then a read of
/// the last result, which waits for the thread's last kernels. A thread meets the others at
/// `start` even when it failed before, so none is left waiting for it.
fn run(work: Work, device: Device, steps: usize, start: &Barrier) -> ferry::Result<f64> {
    let ready = step_of(work, device).and_then(|mut step| {
        step()?.item()?;
        Ok(step)
    });
    start.wait();
    let mut step = ready?;
    let mut last = None;
    for _ in 0..steps {
        last = Some(step()?);
    }
    last.map_or(Ok(0.0), |result| result.item())
}

/// All threads' steps per second in one round of `threads` threads.
fn round(work: Work, device: Device, threads: usize, steps: usize) -> Result<f64, String> {
    let start = Barrier::new(threads + 1);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| s.spawn(|| run(work, device, steps, &start)))
            .collect();
        start.wait();
        let began = Instant::now();
        for worker in workers {
            match worker.join() {
                Ok(result) => {
                    result.map_err(|e| e.to_string())?;
                }
                Err(_) => return Err("a training thread panicked".into()),
            }
        }
        Ok((threads * steps) as f64 / began.elapsed().as_secs_f64())
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let device: Device = args.next().unwrap_or("cuda:0".into()).parse()?;
    let counts: Vec<usize> = args
        .next()
        .unwrap_or("1,4,8,16".into())
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let steps: usize = args.next().unwrap_or("400".into()).parse()?;
    let work = match args.next().as_deref() {
        None | Some("linear") => Work::Linear,
        Some("matmul") => Work::Matmul,
        Some("pointwise") => Work::Pointwise,
        Some(other) => {
            return Err(format!("unknown work `{other}`: linear, matmul or pointwise").into());
        }
    };
    let one = {
        let mut rates: Vec<f64> = (0..ROUNDS)
            .map(|_| round(work, device, 1, steps))
            .collect::<Result<_, _>>()?;
        rates.sort_by(f64::total_cmp);
        rates[ROUNDS / 2]
    };
    println!(
        "threads sharing {device}: {work:?} work on {BATCH}x{WIDTH}, {steps} steps a thread, median of {ROUNDS} rounds"
    );
    println!("| threads | steps/s (all threads) | efficiency | rounds' efficiency |");
    println!("|---|---|---|---|");
    for &n in &counts {
        let mut rates: Vec<f64> = (0..ROUNDS)
            .map(|_| round(work, device, n, steps))
            .collect::<Result<_, _>>()?;
        rates.sort_by(f64::total_cmp);
        let median = rates[ROUNDS / 2];
        let spread = |r: f64| r / (n as f64 * one);
        println!(
            "| {n} | {median:.0} | {:.2} | {:.2}-{:.2} |",
            spread(median),
            spread(rates[0]),
            spread(rates[ROUNDS - 1])
        );
    }
    Ok(())
}
