//! `ferry doctor`: what this machine offers ferry.

use std::time::Instant;

use ferry::cuda_libs;
use ferry::memory::cuda;

pub fn run() -> Result<(), Box<dyn std::error::Error>> {
    println!("ferry {}", env!("CARGO_PKG_VERSION"));
    println!(
        "cpu: {} threads",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    match cuda_libs::nvrtc_version() {
        Ok((major, minor)) => println!("nvrtc: {major}.{minor}"),
        Err(err) => println!("nvrtc: {err}"),
    }
    match cuda_libs::cudnn_version() {
        Ok(v) => println!(
            "cudnn: {}.{}.{} (conv2d on CUDA)",
            v / 10_000,
            v / 100 % 100,
            v % 100
        ),
        Err(err) => println!("cudnn: {err}"),
    }
    match cuda_libs::nccl_version() {
        Ok((major, minor, patch)) => println!("nccl: {major}.{minor}.{patch}"),
        Err(err) => println!("nccl: {err}"),
    }
    if !cuda::driver_present() {
        println!("cuda: no CUDA driver found (libcuda could not be loaded); CPU only");
        return compile_without_gpu();
    }
    match cuda::driver_version() {
        Ok((major, minor)) => println!("cuda driver: CUDA {major}.{minor}"),
        Err(err) => println!("cuda driver: {err}"),
    }
    let devices = match cuda::devices() {
        Ok(devices) => devices,
        Err(err) => {
            println!("cuda: {err}");
            return Ok(());
        }
    };
    if devices.is_empty() {
        println!("cuda: driver present, no devices");
    }
    for d in &devices {
        println!(
            "cuda:{}: {}, compute capability {}.{}, {:.1} GiB, {} SMs",
            d.ordinal,
            d.name,
            d.compute_capability.0,
            d.compute_capability.1,
            d.total_memory as f64 / (1u64 << 30) as f64,
            d.multiprocessors
        );
        match ferry::tensor::compile_kernels(d.ordinal) {
            Ok(time) => println!(
                "cuda:{}: {} kernel modules compiled and loaded in {:.0} ms",
                d.ordinal,
                ferry::tensor::KERNEL_MODULES.len(),
                time.as_secs_f64() * 1e3
            ),
            Err(err) => println!("cuda:{}: kernels failed to compile: {err}", d.ordinal),
        }
    }
    Ok(())
}

/// Without a GPU, NVRTC can still compile the kernels: say whether they would build.
fn compile_without_gpu() -> Result<(), Box<dyn std::error::Error>> {
    if !cuda_libs::nvrtc_present() {
        return Ok(());
    }
    let start = Instant::now();
    for module in ferry::tensor::KERNEL_MODULES {
        cuda_libs::compile_ptx(module, "compute_90")?;
    }
    println!(
        "kernels: {} modules compile for compute_90 in {:.0} ms (no GPU to load them on)",
        ferry::tensor::KERNEL_MODULES.len(),
        start.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}
