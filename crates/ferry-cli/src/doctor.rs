//! `ferry doctor`: what this machine offers ferry.

use ferry::memory::cuda;

pub fn run() -> Result<(), Box<dyn std::error::Error>> {
    println!("ferry {}", env!("CARGO_PKG_VERSION"));
    println!(
        "cpu: {} threads",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    if !cuda::driver_present() {
        println!("cuda: no CUDA driver found (libcuda could not be loaded); CPU only");
        return Ok(());
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
    }
    Ok(())
}
