//! Measures the primitives every device move is built from, on the machine it runs on: the
//! link's DMA rate each way, what fresh, prefaulted, pinned and registered host memory cost, and
//! the fixed cost of a small copy. Run it first: each transfer technique is chosen against these.
//!
//! `cargo run --release -p ferry-memory --example link -- [MiB]` (default 400 MB, as 10000x10000 f32)

use std::time::Instant;

use ferry_memory::HostBuffer;
use ferry_memory::cuda::{CudaDevice, PinnedPool};

fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// Median wall milliseconds of `f` over `runs` runs after one warm-up.
fn time(runs: usize, mut f: impl FnMut()) -> f64 {
    f();
    median(
        (0..runs)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64() * 1e3
            })
            .collect(),
    )
}

fn once(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64() * 1e3
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let bytes: usize = std::env::args()
        .nth(1)
        .map_or(400_000_000, |mb| mb.parse::<usize>().unwrap() << 20);
    let gb = bytes as f64 / 1e9;
    let dev = CudaDevice::get(0)?;
    let stream = dev.default_stream();
    let row = |what: &str, ms: f64| println!("{what:58} {ms:9.2} ms {:8.1} GB/s", gb / (ms / 1e3));
    println!(
        "{} on {}, {} host threads",
        fmt_bytes(bytes),
        dev.info().name,
        rayon::current_num_threads()
    );

    let mut device = dev.alloc_zeroed(bytes, stream)?;
    let pool = PinnedPool::global()?;

    let mut pinned = None;
    let ms = once(|| pinned = Some(pool.alloc(bytes).unwrap()));
    row("pinned alloc, first (prefaulted huge pages + register)", ms);
    let mut pinned = pinned.unwrap();
    row(
        "pinned first touch (CPU writes every page once)",
        once(|| pinned.as_bytes_mut().unwrap().fill(1)),
    );
    row(
        "D2H into pinned (DMA, the link)",
        time(9, || {
            device.copy_to_pinned_async(&mut pinned, stream).unwrap();
            pinned.wait().unwrap();
        }),
    );
    row(
        "H2D from pinned (DMA, the link)",
        time(9, || {
            device.copy_from_pinned_async(&mut pinned, stream).unwrap();
            stream.synchronize().unwrap();
        }),
    );
    stream.synchronize()?;

    row(
        "pageable alloc + single-thread first touch",
        once(|| {
            let mut b = HostBuffer::zeroed(bytes).unwrap();
            b.as_bytes_mut()
                .iter_mut()
                .step_by(4096)
                .for_each(|x| *x = 1);
        }),
    );
    let mut prefaulted = None;
    row(
        "pageable alloc prefaulted (huge pages, all threads)",
        once(|| prefaulted = Some(HostBuffer::prefaulted(bytes).unwrap())),
    );
    let mut prefaulted = prefaulted.unwrap();

    row(
        "D2H into fresh pageable memory (driver staging)",
        time(5, || {
            let mut fresh = HostBuffer::zeroed(bytes).unwrap();
            device.copy_to_host(fresh.as_bytes_mut(), stream).unwrap();
        }),
    );
    row(
        "D2H into prefaulted pageable memory (driver staging)",
        time(5, || {
            device
                .copy_to_host(prefaulted.as_bytes_mut(), stream)
                .unwrap();
        }),
    );
    row(
        "H2D from prefaulted pageable memory (driver staging)",
        time(5, || {
            device
                .copy_from_host(prefaulted.as_bytes(), stream)
                .unwrap();
        }),
    );
    row(
        "memcpy pinned -> prefaulted pageable, all threads",
        time(9, || {
            use rayon::prelude::*;
            let src = pinned.as_bytes().unwrap();
            prefaulted
                .as_bytes_mut()
                .par_chunks_mut(8 << 20)
                .zip(src.par_chunks(8 << 20))
                .for_each(|(d, s)| d.copy_from_slice(s));
        }),
    );
    row(
        "memcpy pinned -> prefaulted pageable, one thread",
        time(3, || {
            prefaulted
                .as_bytes_mut()
                .copy_from_slice(pinned.as_bytes().unwrap());
        }),
    );

    let mut registration = None;
    row(
        "cuMemHostRegister of the prefaulted buffer",
        once(|| registration = Some(dev.register_host(prefaulted.as_bytes_mut()).unwrap())),
    );
    let mut registration = registration.unwrap();
    row(
        "D2H into registered pageable memory (DMA)",
        time(9, || {
            device.copy_to_host(&mut registration, stream).unwrap()
        }),
    );
    row("cuMemHostUnregister", once(|| drop(registration)));

    for small in [4 << 10, 64 << 10, 1 << 20] {
        let mut host = vec![0u8; small];
        let d = dev.alloc(small, stream)?;
        let us = time(101, || d.copy_to_host(&mut host, stream).unwrap()) * 1e3;
        println!(
            "{:58} {us:9.1} us",
            format!("small D2H {} into pageable, synchronous", fmt_bytes(small))
        );
    }
    let mut p = pool.alloc(4096)?;
    let d = dev.alloc(4096, stream)?;
    let us = time(101, || {
        d.copy_to_pinned_async(&mut p, stream).unwrap();
        p.wait().unwrap();
    }) * 1e3;
    println!(
        "{:58} {us:9.1} us",
        "small D2H 4 KiB into pinned, event wait"
    );
    drop(device);
    Ok(())
}

fn fmt_bytes(b: usize) -> String {
    match b {
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b => format!("{} KiB", b >> 10),
    }
}
