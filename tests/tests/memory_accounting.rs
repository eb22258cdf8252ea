//! Allocator statistics of the process-wide CUDA device: a binary of its own, every test
//! serialised behind one lock, because other tests' allocations would move the counts.

use std::sync::Mutex;

use ferry::DeviceMove;
use ferry::cuda_libs::{KernelModule, Kernels};
use ferry::memory::cuda::{CudaDevice, DeviceBuffer, Stream};
use ferry_tensor::{DType, Device, Result, Tensor, no_grad};

// Graph counts, pinned-pool and allocator statistics of the transfer methods.
mod transfer_accounting;
// The pinned budget: results stay pinned only within it, moves beyond it go pageable.
mod pinned_budget;
// Every recording op allocates only what its rule keeps (allocator or host statistics).
mod saved_state_memory;
// Activation offload: device memory after the forward, the pinned budget, bitwise gradients.
mod offload;
// A block run plain, recomputed whole and selectively: what stays alive, what the host holds.
mod recompute_memory;
// A memory plan's peaks predicted from a measured step against what each choice takes.
mod plan_peaks;
// The device loader: ordering against held copy streams, which other tests' frees (each one
// waits for the whole device) would spoil in a parallel binary.
mod prefetch;
// Streaming to the host: order, detached chunks, the staging ring, overlap with a slow producer.
mod streaming;
// An asynchronous save's device copy: what it allocates, and the device budget it reads.
mod checkpoint_memory;

static LOCK: Mutex<()> = Mutex::new(());

/// Holds the binary's lock: the tests that hold it run one at a time.
fn serial_lock() -> std::sync::MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

fn run(body: impl FnOnce() -> Result<()>) {
    let _serial = serial_lock();
    ferry_tests::fresh_seed();
    if let Err(e) = body() {
        panic!("(replay with FERRY_SEED={}): {e}", ferry_tests::seed());
    }
}

const GPU: Device = Device::Cuda(0);

/// One thread spins for `cycles` clock ticks: holds a stream so that work queued behind it runs
/// late, and work on other streams not ordered after it runs first.
static SPIN: KernelModule = KernelModule {
    name: "memory_accounting_spin",
    source: r#"
extern "C" __global__ void spin(float *out, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    out[0] = 1.0f;
}
"#,
};

/// Queues a spin of about 200 ms (at the H200's ~2 GHz) on `stream`; the buffer it writes is
/// returned so it outlives the launch.
fn hold(stream: &Stream) -> Result<DeviceBuffer> {
    let dev = CudaDevice::get(0)?;
    let spin = dev.function(&SPIN, "spin")?;
    let mut out = dev.alloc(4, stream)?;
    dev.launch(&spin, (1, 1, 1), (1, 1, 1), 0, stream)
        .arg_buffer_mut(&mut out)
        .arg_i64(400_000_000)
        .run()?;
    Ok(out)
}

#[test]
#[ignore = "needs a CUDA device"]
fn into_device_releases_the_source_memory() {
    run(|| {
        let dev = CudaDevice::get(0)?;
        dev.synchronize()?;
        let before = dev.memory_stats().allocated_bytes;
        let x = Tensor::randn(&[1024, 1024], DType::F32, GPU)?;
        assert_eq!(dev.memory_stats().allocated_bytes, before + (4 << 20));
        let (host, report) = x.into_device(Device::Cpu)?;
        assert_eq!(report.bytes_moved, 4 << 20);
        assert_eq!(
            dev.memory_stats().allocated_bytes,
            before,
            "the source's block went back"
        );
        assert_eq!(host.shape(), &[1024, 1024]);
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn statistics_return_to_baseline_after_tensors_drop() {
    run(|| {
        let dev = CudaDevice::get(0)?;
        let before = dev.memory_stats().allocated_bytes;
        {
            let x = Tensor::randn(&[256, 512], DType::F32, GPU)?.with_grad()?;
            let y = x.matmul(&x.t()?)?.tanh()?.sum()?;
            y.backward()?;
            assert!(dev.memory_stats().allocated_bytes > before);
        }
        assert_eq!(dev.memory_stats().allocated_bytes, before);
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn no_grad_inference_saves_no_buffers() {
    run(|| {
        let w = Tensor::randn(&[512, 512], DType::F32, GPU)?.with_grad()?;
        let x = Tensor::randn(&[64, 512], DType::F32, GPU)?;
        let graph = w.graph().unwrap();
        let saved = graph.saved_bytes();
        let _guard = no_grad();
        let y = x.matmul(&w)?.relu()?.matmul(&w)?.softmax(1)?;
        assert!(!y.requires_grad());
        assert_eq!(graph.saved_bytes(), saved);
        Ok(())
    });
}
