//! The device loader: order, look-ahead, errors in place, early drops and its statistics on the
//! host; on a GPU, kernels queued right after `next()` read the copied batch, values match an
//! ordinary move, staging beyond its bound moves blocking, and an early drop corrupts nothing.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::memory::cuda::CudaDevice;
use ferry::{DeviceLoader, DeviceMove};
use ferry_tensor::{DType, Device, Result, Tensor, TensorError};

const GPU: Device = Device::Cuda(0);

/// Batch `i` of a test source: `[rows, 3]` f32 whose every value is `i`, and `[rows]` labels.
fn pair(i: usize, rows: usize) -> Result<(Tensor, Tensor)> {
    Ok((
        Tensor::full(&[rows, 3], i as f64, DType::F32, Device::Cpu)?,
        Tensor::from_vec(vec![i as i64; rows], &[rows])?,
    ))
}

/// A source of `n` pairs that counts how many the loader has read.
fn counted(n: usize, pulled: &Rc<Cell<usize>>) -> impl Iterator<Item = Result<(Tensor, Tensor)>> {
    let pulled = Rc::clone(pulled);
    (0..n).map(move |i| {
        pulled.set(pulled.get() + 1);
        pair(i, 2)
    })
}

#[test]
fn batches_come_out_in_order_and_unchanged_on_the_cpu() -> Result<()> {
    for k in [0, 1, 2, 5] {
        let host: Vec<(Tensor, Tensor)> = (0..7).map(|i| pair(i, 4)).collect::<Result<_>>()?;
        let loader = DeviceLoader::new(host.clone(), Device::Cpu).in_flight(k);
        let mut seen = 0;
        for (i, batch) in loader.enumerate() {
            let (x, y) = batch?;
            // Passed through: the very storages of the source, not copies.
            assert!(Arc::ptr_eq(x.storage(), host[i].0.storage()), "k = {k}");
            assert!(Arc::ptr_eq(y.storage(), host[i].1.storage()), "k = {k}");
            assert_eq!(x.to_vec::<f32>()?, vec![i as f32; 12], "k = {k}, batch {i}");
            seen += 1;
        }
        assert_eq!(seen, 7, "k = {k}");
    }
    Ok(())
}

#[test]
fn every_kind_of_batch_keeps_its_tensors_in_place() -> Result<()> {
    let t = |v: f64| Tensor::full(&[2], v, DType::F64, Device::Cpu);
    let single: Vec<Tensor> =
        DeviceLoader::new([t(1.0)?, t(2.0)?], Device::Cpu).collect::<Result<_>>()?;
    assert_eq!(single[1].to_vec::<f64>()?, [2.0, 2.0]);
    let triples: Vec<(Tensor, Tensor, Tensor)> =
        DeviceLoader::new([(t(1.0)?, t(2.0)?, t(3.0)?)], Device::Cpu).collect::<Result<_>>()?;
    let (a, b, c) = &triples[0];
    assert_eq!(
        [
            a.to_vec::<f64>()?[0],
            b.to_vec::<f64>()?[0],
            c.to_vec::<f64>()?[0]
        ],
        [1.0, 2.0, 3.0]
    );
    let groups: Vec<Vec<Tensor>> =
        DeviceLoader::new([vec![t(4.0)?, t(5.0)?, t(6.0)?, t(7.0)?]], Device::Cpu)
            .collect::<Result<_>>()?;
    let firsts: Vec<f64> = groups[0]
        .iter()
        .map(|t| t.to_vec::<f64>().map(|v| v[0]))
        .collect::<Result<_>>()?;
    assert_eq!(firsts, [4.0, 5.0, 6.0, 7.0]);
    let arrays: Vec<[Tensor; 2]> =
        DeviceLoader::new([[t(8.0)?, t(9.0)?]], Device::Cpu).collect::<Result<_>>()?;
    assert_eq!(arrays[0][1].to_vec::<f64>()?, [9.0, 9.0]);
    Ok(())
}

#[test]
fn the_loader_reads_k_batches_ahead_and_no_more() -> Result<()> {
    for k in [0, 1, 2, 4] {
        let pulled = Rc::new(Cell::new(0));
        let mut loader = DeviceLoader::from_results(counted(10, &pulled), Device::Cpu).in_flight(k);
        assert_eq!(
            pulled.get(),
            0,
            "k = {k}: nothing is read before the first next()"
        );
        for handed in 1..=10 {
            loader.next().expect("ten batches")?;
            assert_eq!(
                pulled.get(),
                (handed + k).min(10),
                "k = {k}, after {handed}"
            );
        }
        assert!(loader.next().is_none() && loader.next().is_none());
        assert_eq!(pulled.get(), 10);
        assert_eq!(loader.stats().batches, 10);
    }
    Ok(())
}

/// A caller's own error type, which takes the loader's errors in.
#[derive(Debug, PartialEq)]
enum LoadError {
    Decode(usize),
    Tensor(String),
}

impl From<TensorError> for LoadError {
    fn from(e: TensorError) -> Self {
        LoadError::Tensor(e.to_string())
    }
}

#[test]
fn errors_from_the_source_come_out_in_their_place_and_the_rest_follows() {
    let source = (0..5).map(|i| {
        if i == 1 || i == 3 {
            Err(LoadError::Decode(i))
        } else {
            pair(i, 1).map_err(LoadError::from)
        }
    });
    let out: Vec<std::result::Result<usize, LoadError>> =
        DeviceLoader::from_results(source, Device::Cpu)
            .in_flight(2)
            .map(|b| b.map(|(_, y)| y.to_vec::<i64>().unwrap()[0] as usize))
            .collect();
    assert_eq!(
        out,
        [
            Ok(0),
            Err(LoadError::Decode(1)),
            Ok(2),
            Err(LoadError::Decode(3)),
            Ok(4)
        ]
    );
}

/// Sets its flag when dropped.
struct DropFlag(Rc<Cell<bool>>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.set(true);
    }
}

#[test]
fn dropping_the_loader_early_drops_the_source_and_what_it_read_ahead() -> Result<()> {
    let (dropped, pulled) = (Rc::new(Cell::new(false)), Rc::new(Cell::new(0)));
    let flag = DropFlag(Rc::clone(&dropped));
    let source = counted(100, &pulled).inspect(move |_| {
        let _keep = &flag;
    });
    let mut loader = DeviceLoader::from_results(source, Device::Cpu).in_flight(3);
    let (x, _) = loader.next().unwrap()?;
    assert_eq!(pulled.get(), 4);
    drop(loader);
    assert!(dropped.get(), "the source outlived the loader");
    assert_eq!(pulled.get(), 4, "nothing more was read");
    assert_eq!(x.to_vec::<f32>()?[0], 0.0, "a batch handed out stays valid");
    Ok(())
}

#[test]
fn the_statistics_tell_an_input_bound_loop_from_a_compute_bound_one() -> Result<()> {
    const N: usize = 6;
    let nap = Duration::from_millis(4);
    // Input-bound: the source takes `nap` per batch, the consumer nothing.
    let slow = (0..N).map(|i| {
        std::thread::sleep(nap);
        pair(i, 1)
    });
    let mut loader = DeviceLoader::from_results(slow, Device::Cpu);
    for batch in loader.by_ref() {
        batch?;
    }
    let stats = loader.stats();
    assert_eq!(stats.batches, N);
    assert!(stats.source_time >= nap * N as u32, "{stats:?}");
    assert!(stats.waited >= stats.source_time, "{stats:?}");
    assert!(stats.elapsed >= stats.waited, "{stats:?}");
    assert_eq!(stats.bytes_moved, 0, "nothing crosses a device on the host");

    // Compute-bound: the consumer takes `nap` per batch, outside `next()`.
    let mut loader = DeviceLoader::from_results((0..N).map(|i| pair(i, 1)), Device::Cpu);
    for batch in loader.by_ref() {
        batch?;
        std::thread::sleep(nap);
    }
    let stats = loader.stats();
    // From the first next() to the last: every nap but the last is inside `elapsed`, and none
    // inside `waited`.
    assert!(
        stats.elapsed >= stats.waited + nap * (N as u32 - 1),
        "{stats:?}"
    );
    assert!(stats.waited_fraction() < 1.0, "{stats:?}");
    assert_eq!(
        DeviceLoader::new(Vec::<Tensor>::new(), Device::Cpu)
            .stats()
            .waited_fraction(),
        0.0
    );
    Ok(())
}

// ---- On a GPU ----

/// Runs a loader over `host` once and waits, so that kernels are compiled and pinned blocks
/// of its sizes cached before a test times anything against a spin.
fn warm_up(host: &[Tensor]) -> Result<()> {
    for batch in DeviceLoader::new(host.to_vec(), GPU) {
        batch?.mul_scalar(2.0)?;
    }
    Tensor::zeros(&[4], DType::F32, GPU)?;
    CudaDevice::get(0)?.synchronize()?;
    Ok(())
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_kernel_queued_right_after_next_reads_the_copied_batch() -> Result<()> {
    let _serial = super::serial_lock();
    let dev = CudaDevice::get(0)?;
    let stream = dev.new_stream()?;
    let host: Vec<Tensor> = (0..3)
        .map(|_| Tensor::randn(&[1024, 1024], DType::F32, Device::Cpu))
        .collect::<Result<_>>()?;
    let doubled = |t: &Tensor| -> Result<Vec<f32>> { t.mul_scalar(2.0)?.to_vec::<f32>() };
    warm_up(&host)?;
    let mut loader = DeviceLoader::new(host.clone(), GPU)
        .in_flight(2)
        .with_stream(stream.clone())?;
    // The copies queue behind a 200 ms spin on the copy stream.
    let _held = super::hold(&stream)?;
    let spinning = stream.record()?;
    let x = loader.next().expect("three batches")?;
    let y = x.mul_scalar(2.0)?; // on the default stream, right away
    assert!(
        !spinning.is_complete(),
        "the spin ended before the consumer's kernel was queued: next() waited on the host, or \
         the spin is too short"
    );
    assert_eq!(
        loader.stats().not_ready_at_handout,
        1,
        "{:?}",
        loader.stats()
    );
    assert_eq!(x.device(), GPU);
    assert!(!x.requires_grad());
    assert_eq!(
        y.to_vec::<f32>()?,
        doubled(&host[0])?,
        "read before its copy landed"
    );
    for (i, batch) in loader.enumerate() {
        assert_eq!(
            batch?.mul_scalar(2.0)?.to_vec::<f32>()?,
            doubled(&host[i + 1])?
        );
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA device"]
fn batches_match_an_ordinary_move_for_every_kind_and_depth() -> Result<()> {
    let _serial = super::serial_lock();
    for k in [0, 1, 2, 4] {
        let host: Vec<(Tensor, Tensor, Tensor)> = (0..6)
            .map(|i| -> Result<_> {
                Ok((
                    // Non-contiguous: made dense on the host first.
                    Tensor::randn(&[48, 64], DType::F32, Device::Cpu)?.transpose(0, 1)?,
                    Tensor::from_vec((0..64).map(|j| (i * 64 + j) as i64).collect(), &[64])?,
                    Tensor::randn(&[3, 5], DType::F16, Device::Cpu)?,
                ))
            })
            .collect::<Result<_>>()?;
        let bytes: usize = host
            .iter()
            .map(|(a, b, c)| a.nbytes() + b.nbytes() + c.nbytes())
            .sum();
        let mut loader = DeviceLoader::new(host.clone(), GPU).in_flight(k);
        for (i, batch) in loader.by_ref().enumerate() {
            let (a, b, c) = batch?;
            let (ha, hb, hc) = &host[i];
            assert_eq!(a.device(), GPU);
            assert_eq!(a.shape(), ha.shape());
            assert_eq!(
                a.to_vec::<f32>()?,
                ha.to(GPU)?.to_vec::<f32>()?,
                "k {k} b {i}"
            );
            assert_eq!(b.to_vec::<i64>()?, hb.to_vec::<i64>()?, "k {k} b {i}");
            assert_eq!(c.dtype(), DType::F16);
            assert_eq!(
                c.to_dtype(DType::F32)?.to_vec::<f32>()?,
                hc.to_dtype(DType::F32)?.to_vec::<f32>()?,
                "k {k} b {i}"
            );
        }
        let stats = loader.stats();
        assert_eq!((stats.batches, stats.bytes_moved), (6, bytes), "k {k}");
        let blocking = if k == 0 { 18 } else { 0 };
        assert_eq!(stats.moved_blocking, blocking, "k {k}: {stats:?}");
        assert_eq!(stats.staging_peak_bytes > 0, k > 0, "k {k}: {stats:?}");
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA device"]
fn staging_beyond_the_loaders_bound_moves_blocking_with_the_same_values() -> Result<()> {
    let _serial = super::serial_lock();
    let host: Vec<(Tensor, Tensor)> = (0..5).map(|i| pair(i, 4096)).collect::<Result<_>>()?;
    let block = ferry::memory::cuda::PinnedPool::block_size(host[0].0.nbytes());
    for (bound, blocking) in [(0, Some(10)), (block, None)] {
        let mut loader = DeviceLoader::new(host.clone(), GPU).max_staging_bytes(bound);
        for (i, batch) in loader.by_ref().enumerate() {
            let (x, y) = batch?;
            assert!(x.to_vec::<f32>()?.iter().all(|&v| v == i as f32));
            assert!(y.to_vec::<i64>()?.iter().all(|&v| v == i as i64));
        }
        let stats = loader.stats();
        assert!(stats.staging_peak_bytes <= bound, "{stats:?}");
        match blocking {
            Some(n) => assert_eq!(stats.moved_blocking, n, "{stats:?}"),
            // One block's room: the features stage, the labels (next in line) do not fit.
            None => assert!((1..10).contains(&stats.moved_blocking), "{stats:?}"),
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA device"]
fn dropping_the_loader_with_copies_in_flight_leaves_later_tensors_intact() -> Result<()> {
    let _serial = super::serial_lock();
    let dev = CudaDevice::get(0)?;
    let stream = dev.new_stream()?;
    let host: Vec<Tensor> = (0..4)
        .map(|_| Tensor::full(&[1024, 1024], 7.0, DType::F32, Device::Cpu))
        .collect::<Result<_>>()?;
    warm_up(&host)?;
    let mut loader = DeviceLoader::new(host, GPU)
        .in_flight(3)
        .with_stream(stream.clone())?;
    let _held = super::hold(&stream)?;
    let spinning = stream.record()?;
    let first = loader.next().expect("four batches")?;
    // Three batches' copies wait behind the spin; their device blocks go back now.
    drop(loader);
    drop(first);
    // Same-sized tensors reuse those blocks: their zeros must not be overwritten by the copies.
    let zeros: Vec<Tensor> = (0..4)
        .map(|_| Tensor::zeros(&[1024, 1024], DType::F32, GPU))
        .collect::<Result<_>>()?;
    assert!(
        !spinning.is_complete(),
        "the spin ended before the tensors were made: lengthen it"
    );
    dev.synchronize()?;
    for z in &zeros {
        assert!(
            z.to_vec::<f32>()?.iter().all(|&v| v == 0.0),
            "a dropped batch's copy landed in a reused block"
        );
    }
    Ok(())
}

/// The loop's steps: four `[4096, 1024] x [1024, 1024]` products with relu between, summed.
fn step(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let mut h = x.clone();
    for _ in 0..4 {
        h = h.matmul(w)?.relu()?;
    }
    h.sum()
}

/// Runs 40 steps over `host` (batches already in host memory, as a dataset in RAM) with `k`
/// batches in flight; `sync` reads each step's result back (as a loop logging its loss every
/// step does), else only the total at the end. Returns (wall time, stats, checksum).
fn copy_bound_loop(
    host: &[Tensor],
    w: &Tensor,
    k: usize,
    sync: bool,
) -> Result<(Duration, ferry::LoaderStats, f64)> {
    const STEPS: usize = 40;
    CudaDevice::get(0)?.synchronize()?;
    let start = Instant::now();
    let source = (0..STEPS).map(|i| host[i % host.len()].clone());
    let mut loader = DeviceLoader::new(source, GPU).in_flight(k);
    let (mut checksum, mut total) = (0.0, Tensor::zeros(&[], DType::F32, GPU)?);
    for batch in loader.by_ref() {
        let s = step(&batch?, w)?;
        if sync {
            checksum += s.item()?;
        } else {
            total = total.add(&s)?;
        }
    }
    if !sync {
        checksum = total.item()?;
    }
    Ok((start.elapsed(), loader.stats(), checksum))
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_copy_bound_loop_with_and_without_prefetch() -> Result<()> {
    let _serial = super::serial_lock();
    let host: Vec<Tensor> = (0..8)
        .map(|_| Tensor::rand(&[4096, 1024], DType::F32, Device::Cpu))
        .collect::<Result<_>>()?;
    let w = Tensor::randn(&[1024, 1024], DType::F32, GPU)?.mul_scalar(0.03)?;
    copy_bound_loop(&host, &w, 2, true)?; // warm-up: kernels, pools, streams
    let block = ferry::memory::cuda::PinnedPool::block_size(host[0].nbytes());
    println!(
        "40 steps, batches of [4096, 1024] f32 (16 MiB) from host memory, 4 x ([.., 1024] x \
         [1024, 1024] + relu) + sum per step"
    );
    for sync in [true, false] {
        let (plain, plain_stats, plain_sum) = copy_bound_loop(&host, &w, 0, sync)?;
        let (ahead, ahead_stats, ahead_sum) = copy_bound_loop(&host, &w, 2, sync)?;
        assert_eq!(
            plain_sum, ahead_sum,
            "same batches, same kernels: the same sums"
        );
        assert_eq!(ahead_stats.moved_blocking, 0, "{ahead_stats:?}");
        // Batches in flight, the one being staged, and handed-out ones whose copies may run.
        assert!(
            ahead_stats.staging_peak_bytes <= 6 * block,
            "the loader pinned more than 2k + 2 batches: {ahead_stats:?}"
        );
        let reading = if sync {
            "result read every step"
        } else {
            "result read at the end"
        };
        for (name, time, stats) in [
            ("without prefetch (k = 0)", plain, plain_stats),
            ("with prefetch (k = 2)   ", ahead, ahead_stats),
        ] {
            println!(
                "{reading}: {name}: {:7.1} ms, {:6.2} ms/step, waited {:7.1} ms ({:4.1}%), \
                 not ready at hand-out {:2}, staging peak {:5.1} MiB",
                time.as_secs_f64() * 1e3,
                time.as_secs_f64() * 1e3 / 40.0,
                stats.waited.as_secs_f64() * 1e3,
                stats.waited_fraction() * 100.0,
                stats.not_ready_at_handout,
                stats.staging_peak_bytes as f64 / (1 << 20) as f64,
            );
        }
        println!(
            "{reading}: speedup with prefetch {:.2}x",
            plain.as_secs_f64() / ahead.as_secs_f64()
        );
    }
    Ok(())
}
