//! ferry's side of `ferry bench transfer`: one function per case, each timing one sample.
//!
//! A sample times the move and whatever makes its result usable (waiting for a non-blocking
//! copy, synchronizing after an upload). The runner synchronizes the device before each call,
//! and results are dropped after the clock stops, as on the PyTorch side (python/transfer.py).

use std::error::Error;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use ferry::memory::cuda::{CudaDevice, DeviceBuffer, PinnedBuffer, PinnedPool};
use ferry::move_state_dict;
use ferry::prelude::*;
use ferry::tensor::Buffer;

use super::resnet50::{self, is_counter};

pub type BenchResult<T> = Result<T, Box<dyn Error>>;

/// The large tensor is SIDE x SIDE f32: 400 MB.
pub const SIDE: usize = 10_000;
pub const BIG_BYTES: usize = SIDE * SIDE * 4;
/// The staging bound of the chunked case: a quarter of the tensor.
pub const STAGING_BOUND: usize = BIG_BYTES / 4;
/// Moves per sample of a small case; the sample is their mean, so timer overhead vanishes.
pub const SMALL_REPS: usize = 100;
/// Bytes of the small cases' f32 tensors: 4 KB, 64 KB, 1 MB.
pub const SMALL_BYTES: [usize; 3] = [4 << 10, 64 << 10, 1 << 20];

/// One timed run.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    pub ms: f64,
    /// Pinned staging in use at once, for the chunked moves (from their report).
    pub staging_peak_bytes: Option<usize>,
}

impl Sample {
    fn since(start: Instant) -> Self {
        Self::ms(start.elapsed().as_secs_f64() * 1e3)
    }

    fn ms(ms: f64) -> Self {
        Self {
            ms,
            staging_peak_bytes: None,
        }
    }
}

/// Everything the cases move, made once before any clock starts.
pub struct Fixture {
    pub dev: CudaDevice,
    /// 10000x10000 f32 on the GPU.
    src: Tensor,
    /// 10000x10000 f32 in pageable host memory, its pages already touched.
    host_src: Tensor,
    /// The link's landing place (and source, host to device): page-locked, reused.
    pinned: PinnedBuffer,
    /// The link's device target for host-to-device.
    device_scratch: DeviceBuffer,
    state_dict: Vec<(String, Tensor)>,
    /// One f32 GPU tensor per entry of SMALL_BYTES.
    small: Vec<Tensor>,
}

impl Fixture {
    pub fn new(dev: CudaDevice) -> BenchResult<Self> {
        let gpu = dev.device();
        let src = Tensor::randn(&[SIDE, SIDE], DType::F32, gpu)?;
        // `full` writes every element, so no page fault lands inside a timed upload.
        let host_src = Tensor::full(&[SIDE, SIDE], 1.0, DType::F32, Device::Cpu)?;
        if !matches!(&*host_src.storage().read(), Buffer::Host(_)) {
            return Err("the host-to-device source is not in pageable memory".into());
        }
        let pinned = PinnedPool::global()?.alloc(BIG_BYTES)?;
        let device_scratch = dev.alloc(BIG_BYTES, dev.default_stream())?;
        let state_dict = resnet50::state_dict()
            .into_iter()
            .map(|(name, shape)| {
                let t = if is_counter(&name) {
                    Tensor::zeros(&shape, DType::I64, gpu)?
                } else {
                    Tensor::randn(&shape, DType::F32, gpu)?
                };
                Ok((name, t))
            })
            .collect::<ferry::Result<Vec<_>>>()?;
        let small = SMALL_BYTES
            .iter()
            .map(|b| Tensor::randn(&[b / 4], DType::F32, gpu))
            .collect::<ferry::Result<Vec<_>>>()?;
        dev.synchronize()?;
        Ok(Self {
            dev,
            src,
            host_src,
            pinned,
            device_scratch,
            state_dict,
            small,
        })
    }
}

/// Waits until a moved tensor's bytes can be read on the host (a no-op for finished moves).
fn readable(t: &Tensor) -> BenchResult<()> {
    match t.storage().read().host_bytes() {
        Some(_) => Ok(()),
        None => Err(format!("a {:?} result is not readable on the host", t.device()).into()),
    }
}

/// The link, device to host: one DMA of the 400 MB into reused page-locked memory.
pub fn link_d2h(fx: &mut Fixture) -> BenchResult<Sample> {
    let storage = fx.src.storage().read();
    let Buffer::Cuda(buf) = &*storage else {
        return Err("the source tensor is not in device memory".into());
    };
    let start = Instant::now();
    buf.copy_to_pinned_async_at(0, &mut fx.pinned, buf.stream())?;
    fx.pinned.wait()?;
    Ok(Sample::since(start))
}

/// The link, host to device: one DMA of the 400 MB out of page-locked memory.
pub fn link_h2d(fx: &mut Fixture) -> BenchResult<Sample> {
    let stream = fx.dev.default_stream();
    let start = Instant::now();
    fx.device_scratch
        .copy_from_pinned_async_at(0, &mut fx.pinned, stream)?;
    stream.synchronize()?;
    Ok(Sample::since(start))
}

/// `cpu()` into fresh host memory; the result is dropped after each sample.
pub fn cpu_repeated(fx: &mut Fixture) -> BenchResult<Sample> {
    let start = Instant::now();
    let y = fx.src.cpu()?;
    readable(&y)?;
    Ok(Sample::since(start))
}

/// The first `cpu()` of a fresh process: one child process per sample, which reports its time.
pub fn first_cpu(_: &mut Fixture) -> BenchResult<Sample> {
    let exe = std::env::current_exe()?;
    let ms = run_first_cpu_child(
        Command::new(&exe).args(["bench", "transfer", "--first-cpu-sample"]),
        &exe,
    )?;
    Ok(Sample::ms(ms))
}

/// Runs a `--first-cpu-sample` child and reads the milliseconds it prints last.
pub fn run_first_cpu_child(command: &mut Command, program: &Path) -> BenchResult<f64> {
    let out = command.output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or("").trim();
    match (out.status.success(), last.parse::<f64>()) {
        (true, Ok(ms)) => Ok(ms),
        _ => Err(format!(
            "{} --first-cpu-sample failed ({}): {}{}",
            program.display(),
            out.status,
            stdout.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into()),
    }
}

/// In the child: start CUDA, make the tensor, synchronize, then time one `cpu()`.
pub fn first_cpu_in_this_process() -> BenchResult<f64> {
    let dev = crate::harness::cuda_device(0)?;
    let src = Tensor::randn(&[SIDE, SIDE], DType::F32, dev.device())?;
    dev.synchronize()?;
    let start = Instant::now();
    let y = src.cpu()?;
    readable(&y)?;
    Ok(Sample::since(start).ms)
}

/// `to(cpu, non_blocking)`, then wait for the bytes.
pub fn non_blocking(fx: &mut Fixture) -> BenchResult<Sample> {
    let start = Instant::now();
    let (y, _) = fx.src.to_with(Device::Cpu, MoveOptions::non_blocking())?;
    readable(&y)?;
    Ok(Sample::since(start))
}

fn chunked(fx: &mut Fixture, spec: ChunkSpec) -> BenchResult<Sample> {
    let start = Instant::now();
    let (y, report) = fx.src.to_chunked(Device::Cpu, spec)?;
    readable(&y)?;
    Ok(Sample {
        staging_peak_bytes: Some(report.staging_peak_bytes),
        ..Sample::since(start)
    })
}

/// Four chunks into pageable memory: `to_chunked(Count(4))`.
pub fn chunks_count4(fx: &mut Fixture) -> BenchResult<Sample> {
    chunked(fx, ChunkSpec::Count(4))
}

/// Chunks into pageable memory through at most 100 MB of staging.
pub fn chunks_staging(fx: &mut Fixture) -> BenchResult<Sample> {
    chunked(fx, ChunkSpec::MaxStagingBytes(STAGING_BOUND))
}

/// `to(cpu)` with the cast to f16 fused into the move.
pub fn to_f16(fx: &mut Fixture) -> BenchResult<Sample> {
    let start = Instant::now();
    let (y, _) = fx
        .src
        .to_with(Device::Cpu, MoveOptions::dtype(DType::F16))?;
    readable(&y)?;
    Ok(Sample::since(start))
}

/// The 320 resnet50 tensors in one `move_state_dict`.
pub fn state_dict(fx: &mut Fixture) -> BenchResult<Sample> {
    let start = Instant::now();
    let (moved, _) = move_state_dict(&fx.state_dict, Device::Cpu)?;
    for (_, t) in &moved {
        readable(t)?;
    }
    Ok(Sample::since(start))
}

/// Pageable host memory to the GPU, synchronized.
pub fn h2d_pageable(fx: &mut Fixture) -> BenchResult<Sample> {
    let start = Instant::now();
    let y = fx.host_src.to(fx.dev.device())?;
    fx.dev.synchronize()?;
    let sample = Sample::since(start);
    drop(y);
    Ok(sample)
}

/// Mean time of one `cpu()` of small tensor `which`, over SMALL_REPS moves.
pub fn small(fx: &mut Fixture, which: usize) -> BenchResult<Sample> {
    let t = &fx.small[which];
    let start = Instant::now();
    for _ in 0..SMALL_REPS {
        let y = t.cpu()?;
        readable(&y)?;
    }
    Ok(Sample::ms(Sample::since(start).ms / SMALL_REPS as f64))
}
