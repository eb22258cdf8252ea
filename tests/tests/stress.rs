//! Sixteen threads for a minute on one GPU, mixing every move method with ops on shared and tied
//! storage, in-place writes, optimizer steps, checkpoint saves and `empty_cache`: no deadlock
//! (a watchdog fails the run when nothing progresses for 30 s), no wrong value (every result is
//! checked against values known on the host), pinned memory within its budget throughout, and
//! every allocator back to its baseline at the end.
//!
//! `FERRY_STRESS_SECS` sets the duration (default 60); `FERRY_SEED` replays a run. The counts of
//! each operation are printed at the end: `cargo test --test stress -- --ignored --nocapture`.

use std::error::Error;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ferry::memory::cuda::{CudaDevice, PinnedPool, Stream};
use ferry::nn::{Linear, Module};
use ferry::optim::{Adam, Optimizer};
use ferry::{ChunkSpec, DeviceMove, MoveOptions, move_state_dict};
use ferry_tensor::ops::optim::AdamStep;
use ferry_tensor::{DType, Device, Tensor, with_no_grad};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const GPU: Device = Device::Cuda(0);
const THREADS: usize = 16;
/// No operation finishing anywhere for this long is a deadlock.
const STALL: Duration = Duration::from_secs(30);
/// Small enough that large results go beyond it under load (exercising the pageable path),
/// large enough that most land pinned.
const PINNED_BUDGET: usize = 512 << 20;
const HOST_POOL_BUDGET: usize = 4 << 30;

type Failure = Box<dyn Error + Send + Sync>;
type Outcome = Result<(), Failure>;

/// What each thread does, chosen at random per iteration.
#[derive(Debug, Clone, Copy)]
enum Op {
    Cpu,
    ToF16,
    NonBlocking,
    DetachInto,
    IntoDevice,
    ChunkedDown,
    ChunkedUp,
    Upload,
    AsyncWait,
    AsyncThenAssign,
    StateDict,
    SharedReads,
    SharedAssign,
    TiedAdam,
    OptimizerSteps,
    Checkpoint,
    EmptyCache,
}

const OPS: [Op; 17] = [
    Op::Cpu,
    Op::ToF16,
    Op::NonBlocking,
    Op::DetachInto,
    Op::IntoDevice,
    Op::ChunkedDown,
    Op::ChunkedUp,
    Op::Upload,
    Op::AsyncWait,
    Op::AsyncThenAssign,
    Op::StateDict,
    Op::SharedReads,
    Op::SharedAssign,
    Op::TiedAdam,
    Op::OptimizerSteps,
    Op::Checkpoint,
    Op::EmptyCache,
];

/// Values known on the host, exact in f32, f16 and their squares: multiples of 1/4 below 510.
fn pattern(seed: u64, n: usize) -> Vec<f32> {
    let start = (seed % 2039) as usize;
    (0..n)
        .map(|i| ((start + i * 31) % 2039) as f32 * 0.25)
        .collect()
}

/// Mostly small tensors; one in eight large enough for the pipelines and the pinned budget.
fn shape(rng: &mut StdRng) -> [usize; 2] {
    if rng.random_range(0..8) == 0 {
        [rng.random_range(4096..=16384), 1024]
    } else {
        [rng.random_range(1..=256), 256]
    }
}

fn mismatch(what: &str, got: &[f32], want: &[f32]) -> Failure {
    if got.len() != want.len() {
        return format!("{what}: {} values, expected {}", got.len(), want.len()).into();
    }
    let at = got.iter().zip(want).position(|(g, w)| g != w).unwrap_or(0);
    format!(
        "{what}: element {at} is {}, expected {} ({} of {} differ)",
        got[at],
        want[at],
        got.iter().zip(want).filter(|(g, w)| g != w).count(),
        got.len()
    )
    .into()
}

fn expect(what: &str, t: &Tensor, want: &[f32]) -> Outcome {
    let got = match t.dtype() {
        DType::F32 => t.to_vec::<f32>()?,
        _ => t.to_vec_f64()?.into_iter().map(|v| v as f32).collect(),
    };
    if got != want {
        return Err(mismatch(what, &got, want));
    }
    Ok(())
}

fn transposed(values: &[f32], [rows, cols]: [usize; 2]) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    out
}

/// What every thread shares: a tensor all of them read (some write the same values back), and
/// the bookkeeping of the run.
struct Run {
    shared: Tensor,
    shared_source: Tensor,
    shared_values: Vec<f32>,
    stop: AtomicBool,
    progress: AtomicU64,
    counts: Vec<AtomicU64>,
    /// Per thread: 1 + the index of the operation it is in, 0 between operations.
    current: Vec<AtomicUsize>,
    failure: Mutex<Option<String>>,
    most_pinned: AtomicUsize,
}

impl Run {
    fn fail(&self, message: String) {
        self.failure.lock().unwrap().get_or_insert(message);
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// One thread's own things.
struct Worker {
    rng: StdRng,
    stream: Stream,
    dir: tempfile::TempDir,
    thread: usize,
    iteration: u64,
}

impl Worker {
    fn values(&mut self, shape: [usize; 2]) -> Vec<f32> {
        let seed = self.rng.random();
        pattern(seed, shape[0] * shape[1])
    }

    /// A GPU tensor of a random shape, its values, and the shape.
    fn gpu(&mut self) -> Result<(Tensor, Vec<f32>, [usize; 2]), Failure> {
        let shape = shape(&mut self.rng);
        let values = self.values(shape);
        let t = Tensor::from_slice(&values, &shape)?.to(GPU)?;
        Ok((t, values, shape))
    }

    fn run(&mut self, op: Op, shared: &Run) -> Outcome {
        match op {
            Op::Cpu => {
                let (x, want, _) = self.gpu()?;
                expect("cpu()", &x.cpu()?, &want)
            }
            Op::ToF16 => {
                let (x, want, _) = self.gpu()?;
                let (y, _) = x.to_with(Device::Cpu, MoveOptions::dtype(DType::F16))?;
                expect("to(cpu, f16)", &y, &want)
            }
            Op::NonBlocking => {
                let (x, want, _) = self.gpu()?;
                let (y, _) = x.to_with(Device::Cpu, MoveOptions::non_blocking())?;
                drop(x);
                expect("to(cpu, non_blocking)", &y, &want)
            }
            Op::DetachInto => {
                let (x, want, _) = self.gpu()?;
                let h = x.with_grad()?.relu()?;
                let (y, report) = h.detach_into(Device::Cpu)?;
                if y.requires_grad() || report.nodes_recorded != 0 {
                    return Err(format!("detach_into recorded: {report}").into());
                }
                expect("detach_into", &y, &want)
            }
            Op::IntoDevice => {
                let (x, want, _) = self.gpu()?;
                let (y, _) = x.into_device(Device::Cpu)?;
                expect("into_device", &y, &want)
            }
            Op::ChunkedDown => {
                let (x, want, shape) = self.gpu()?;
                let (y, _) = x.to_chunked(Device::Cpu, ChunkSpec::Count(3))?;
                expect("to_chunked(cpu)", &y, &want)?;
                if shape[0] <= 256 {
                    let (y, _) = x.t()?.to_chunked(Device::Cpu, ChunkSpec::Count(2))?;
                    expect(
                        "to_chunked(cpu) of a transpose",
                        &y,
                        &transposed(&want, shape),
                    )?;
                }
                Ok(())
            }
            Op::ChunkedUp => {
                let shape = shape(&mut self.rng);
                let want = self.values(shape);
                let h = Tensor::from_slice(&want, &shape)?;
                let (y, _) = h.to_chunked(GPU, ChunkSpec::Count(4))?;
                expect("to_chunked(cuda)", &y, &want)
            }
            Op::Upload => {
                let shape = shape(&mut self.rng);
                let want = self.values(shape);
                let y = Tensor::from_slice(&want, &shape)?.to(GPU)?;
                expect("to(cuda)", &y, &want)
            }
            Op::AsyncWait => {
                let (x, want, _) = self.gpu()?;
                let (y, _) = x.to_async(Device::Cpu, &self.stream)?.wait()?;
                expect("to_async + wait", &y, &want)?;
                let h = Tensor::from_slice(&want, y.shape())?;
                let (z, _) = h.to_async(GPU, &self.stream)?.wait()?;
                expect("to_async(cuda) + wait", &z, &want)
            }
            Op::AsyncThenAssign => {
                let (x, want, shape) = self.gpu()?;
                let pending = x.to_async(Device::Cpu, &self.stream)?;
                // An in-place write issued after the move: the move still reads the old values.
                x.assign(&Tensor::zeros(&shape, DType::F32, GPU)?)?;
                let (y, _) = pending.wait()?;
                expect("to_async before an assign", &y, &want)?;
                expect("the assign", &x, &vec![0.0; want.len()])
            }
            Op::StateDict => {
                let (a, va, _) = self.gpu()?;
                let (b, vb, _) = self.gpu()?;
                let half = Tensor::from_slice(&vb, b.shape())?
                    .to_dtype(DType::F16)?
                    .to(GPU)?;
                let dict = vec![
                    ("a".to_string(), a.clone()),
                    ("b".to_string(), b),
                    ("a.tied".to_string(), a),
                    ("b.f16".to_string(), half),
                ];
                let (host, _) = move_state_dict(&dict, Device::Cpu)?;
                let (back, _) = move_state_dict(&host, GPU)?;
                for moved in [&host, &back] {
                    for ((name, t), want) in moved.iter().zip([&va, &vb, &va, &vb]) {
                        expect(&format!("move_state_dict `{name}`"), t, want)?;
                    }
                }
                Ok(())
            }
            Op::SharedReads => {
                // One storage read twice per op, while other threads write it.
                let s = &shared.shared;
                let want = &shared.shared_values;
                let squares: Vec<f32> = want.iter().map(|v| v * v).collect();
                expect("shared * shared", &s.mul(s)?, &squares)?;
                let twice: Vec<f32> = want.iter().chain(want).copied().collect();
                expect("cat([shared, shared])", &Tensor::cat(&[s, s], 0)?, &twice)?;
                let rows = s.shape()[0] / 2;
                let (top, bottom) = (s.narrow(0, 0, rows)?, s.narrow(0, rows, rows)?);
                let cols = s.shape()[1];
                let sums: Vec<f32> = (0..rows * cols)
                    .map(|k| want[k] + want[rows * cols + k])
                    .collect();
                expect("views of one storage added", &top.add(&bottom)?, &sums)?;
                let (y, _) = s.to_with(Device::Cpu, MoveOptions::default())?;
                expect("cpu() of the shared tensor", &y, want)
            }
            Op::SharedAssign => {
                // The same values written back: readers see no change, but take the write lock.
                with_no_grad(|| shared.shared.assign(&shared.shared_source))?;
                Ok(())
            }
            Op::TiedAdam => {
                // The gradient is the parameter itself (one storage as both).
                let shape = [64, 64];
                let start = self.values(shape);
                let p = Tensor::from_slice(&start, &shape)?
                    .to_dtype(DType::F64)?
                    .to(GPU)?;
                let (m, v) = (p.zeros_like()?, p.zeros_like()?);
                let lr = 1e-3;
                let step = AdamStep {
                    lr,
                    beta1: 0.9,
                    beta2: 0.999,
                    eps: 1e-8,
                    weight_decay: 0.0,
                    bias_correction1: 0.1,
                    bias_correction2: 1.0 - 0.999,
                    decoupled: 0,
                    pad: 0,
                };
                with_no_grad(|| p.adam_update(&p, &m, &v, &step))?;
                // Step 1 with g = p: p - lr * p / (|p| + eps).
                let want: Vec<f64> = start
                    .iter()
                    .map(|&x| f64::from(x) - lr * f64::from(x) / (f64::from(x).abs() + 1e-8))
                    .collect();
                close("adam_update with the parameter as its gradient", &p, &want)
            }
            Op::OptimizerSteps => optimizer_steps(),
            Op::Checkpoint => {
                let (a, va, _) = self.gpu()?;
                let (b, vb, _) = self.gpu()?;
                let path = self.dir.path().join("state.safetensors");
                let dict = vec![("a".to_string(), a), ("b".to_string(), b)];
                ferry::checkpoint::save(&path, &dict)?;
                let loaded = ferry::checkpoint::load(&path)?;
                for (name, want) in [("a", &va), ("b", &vb)] {
                    let Some((_, t)) = loaded.iter().find(|(n, _)| n == name) else {
                        return Err(format!("checkpoint: `{name}` is missing").into());
                    };
                    expect(&format!("checkpoint `{name}`"), t, want)?;
                }
                check_no_leftovers(self.dir.path())
            }
            Op::EmptyCache => {
                match self.iteration % 3 {
                    0 => ferry::cuda::empty_cache(GPU)?,
                    1 => ferry::cuda::pinned::empty_cache()?,
                    _ => ferry::host::empty_cache(),
                }
                Ok(())
            }
        }
    }
}

/// Values within a relative 1e-12 (f64 arithmetic on both sides).
fn close(what: &str, t: &Tensor, want: &[f64]) -> Outcome {
    let got = t.to_vec_f64()?;
    let bad = got
        .iter()
        .zip(want)
        .position(|(g, w)| (g - w).abs() > 1e-12 * (1.0 + w.abs()));
    match bad {
        None if got.len() == want.len() => Ok(()),
        None => Err(format!("{what}: {} values, expected {}", got.len(), want.len()).into()),
        Some(at) => {
            Err(format!("{what}: element {at} is {}, expected {}", got[at], want[at]).into())
        }
    }
}

/// A checkpoint save leaves the file and nothing else (no temporary files behind).
fn check_no_leftovers(dir: &Path) -> Outcome {
    let names: Vec<String> = std::fs::read_dir(dir)?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<std::io::Result<_>>()?;
    if names != ["state.safetensors"] {
        return Err(format!("the checkpoint directory holds {names:?}").into());
    }
    Ok(())
}

/// Three Adam steps of a linear layer (f64) on the GPU, checked against the closed form: with
/// `loss = sum(x·Wᵀ + b)` the gradient is the same every step (`dW[o][i] = Σ_b x[b][i]`,
/// `db[o] = batch`), so bias-corrected Adam moves each parameter by `lr·g/(|g| + eps)` a step.
fn optimizer_steps() -> Outcome {
    const STEPS: usize = 3;
    let (batch, inputs, outputs, lr) = (8, 16, 4, 1e-3);
    let w0: Vec<f64> = (0..outputs * inputs)
        .map(|k| ((k * 13 % 17) as f64 - 8.0) * 0.125)
        .collect();
    let b0 = vec![0.5; outputs];
    let xs: Vec<f64> = (0..batch * inputs)
        .map(|k| 0.25 * ((k % 7) + 1) as f64)
        .collect();
    let layer = Linear::from_tensors(
        Tensor::from_slice(&w0, &[outputs, inputs])?.to(GPU)?,
        Some(Tensor::from_slice(&b0, &[outputs])?.to(GPU)?),
    )?;
    let mut opt = Adam::new(layer.parameters(), lr)?;
    let x = Tensor::from_slice(&xs, &[batch, inputs])?.to(GPU)?;
    for _ in 0..STEPS {
        opt.zero_grad();
        let loss = layer.forward(&x)?.sum()?;
        if !loss.item()?.is_finite() {
            return Err("the loss is not finite".into());
        }
        loss.backward()?;
        opt.step()?;
    }
    let moved = |p: f64, g: f64| p - STEPS as f64 * lr * g / (g.abs() + 1e-8);
    let gw: Vec<f64> = (0..inputs)
        .map(|i| (0..batch).map(|b| xs[b * inputs + i]).sum())
        .collect();
    let want_w: Vec<f64> = w0
        .iter()
        .enumerate()
        .map(|(k, &p)| moved(p, gw[k % inputs]))
        .collect();
    let want_b: Vec<f64> = b0.iter().map(|&p| moved(p, batch as f64)).collect();
    close("Adam steps (weight)", layer.weight(), &want_w)?;
    close("Adam steps (bias)", layer.bias().expect("a bias"), &want_b)
}

/// Allocated bytes of the GPU's allocator, the pinned pool and host buffers.
fn allocated(dev: &CudaDevice, pool: &PinnedPool) -> (usize, usize, usize) {
    (
        dev.memory_stats().allocated_bytes,
        pool.stats().allocated_bytes,
        ferry::host::memory_allocated(),
    )
}

fn worker(run: &Run, thread: usize, seed: u64, deadline: Instant) -> Outcome {
    let mut me = Worker {
        rng: StdRng::seed_from_u64(seed.wrapping_add(thread as u64)),
        stream: CudaDevice::get(0)?.new_stream()?,
        dir: tempfile::tempdir()?,
        thread,
        iteration: 0,
    };
    while !run.stop.load(Ordering::SeqCst) && Instant::now() < deadline {
        let index = me.rng.random_range(0..OPS.len());
        let op = OPS[index];
        run.current[me.thread].store(index + 1, Ordering::SeqCst);
        let outcome = catch_unwind(AssertUnwindSafe(|| me.run(op, run)))
            .unwrap_or_else(|panic| Err(format!("panicked: {}", panic_text(&*panic)).into()));
        run.current[me.thread].store(0, Ordering::SeqCst);
        if let Err(e) = outcome {
            return Err(format!("thread {thread}, iteration {}, {op:?}: {e}", me.iteration).into());
        }
        run.counts[index].fetch_add(1, Ordering::Relaxed);
        run.progress.fetch_add(1, Ordering::SeqCst);
        me.iteration += 1;
    }
    Ok(())
}

fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(no message)".into())
}

/// Fails the process when no operation completes for [`STALL`] (the workers are deadlocked:
/// no join would ever return), and samples the pinned pool against its budget.
fn watchdog(run: &Run, pool: &PinnedPool, started: Instant) {
    let mut last = (run.progress.load(Ordering::SeqCst), Instant::now());
    while !run.stop.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(100));
        let stats = pool.stats();
        run.most_pinned
            .fetch_max(stats.reserved_bytes, Ordering::Relaxed);
        if stats.reserved_bytes > stats.budget_bytes {
            run.fail(format!("pinned reserved over its budget: {stats:?}"));
        }
        let progress = run.progress.load(Ordering::SeqCst);
        if progress != last.0 {
            last = (progress, Instant::now());
        } else if last.1.elapsed() > STALL {
            let stuck: Vec<String> = run
                .current
                .iter()
                .enumerate()
                .filter_map(|(t, op)| match op.load(Ordering::SeqCst) {
                    0 => None,
                    i => Some(format!("thread {t} in {:?}", OPS[i - 1])),
                })
                .collect();
            eprintln!(
                "DEADLOCK: no operation finished for {} s ({} s into the run, {progress} done); {}",
                STALL.as_secs(),
                started.elapsed().as_secs(),
                stuck.join(", ")
            );
            std::process::exit(1);
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn sixteen_threads_mix_every_move_without_deadlock_or_wrong_values() {
    let seed = ferry_tests::fresh_seed();
    let seconds: u64 = std::env::var("FERRY_STRESS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let dev = CudaDevice::get(0).expect("the stress test needs CUDA device 0");
    let pool = PinnedPool::global().unwrap();
    let (old_pinned, old_host) = (pool.budget(), ferry::host::pool_budget());
    pool.set_budget(PINNED_BUDGET).unwrap();
    ferry::host::set_pool_budget(HOST_POOL_BUDGET);

    let shape = [512, 256];
    let shared_values = pattern(seed, shape[0] * shape[1]);
    let run = Run {
        shared: Tensor::from_slice(&shared_values, &shape)
            .and_then(|t| t.to(GPU))
            .unwrap(),
        shared_source: Tensor::from_slice(&shared_values, &shape)
            .and_then(|t| t.to(GPU))
            .unwrap(),
        shared_values,
        stop: AtomicBool::new(false),
        progress: AtomicU64::new(0),
        counts: OPS.iter().map(|_| AtomicU64::new(0)).collect(),
        current: (0..THREADS).map(|_| AtomicUsize::new(0)).collect(),
        failure: Mutex::new(None),
        most_pinned: AtomicUsize::new(0),
    };

    // Every operation once on this thread first: kernels compiled, cuBLAS made, copy streams
    // there. The baseline is taken after, with the caches emptied.
    {
        let mut warm = Worker {
            rng: StdRng::seed_from_u64(seed),
            stream: dev.new_stream().unwrap(),
            dir: tempfile::tempdir().unwrap(),
            thread: 0,
            iteration: 0,
        };
        for op in OPS {
            if let Err(e) = warm.run(op, &run) {
                panic!("warm-up {op:?} failed (replay with FERRY_SEED={seed}): {e}");
            }
        }
    }
    dev.synchronize().unwrap();
    ferry::cuda::empty_cache(GPU).unwrap();
    pool.empty_cache().unwrap();
    ferry::host::empty_cache();
    let baseline = allocated(&dev, pool);

    let started = Instant::now();
    let deadline = started + Duration::from_secs(seconds);
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let run = &run;
                scope.spawn(move || worker(run, t, seed, deadline))
            })
            .collect();
        let dog = scope.spawn(|| watchdog(&run, pool, started));
        for (t, handle) in workers.into_iter().enumerate() {
            match handle.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => run.fail(e.to_string()),
                Err(panic) => run.fail(format!("thread {t} panicked: {}", panic_text(&*panic))),
            }
        }
        run.stop.store(true, Ordering::SeqCst);
        dog.join().unwrap();
    });
    let elapsed = started.elapsed();

    let total: u64 = run.counts.iter().map(|c| c.load(Ordering::Relaxed)).sum();
    println!(
        "stress: {total} operations in {:.1} s on {THREADS} threads (seed {seed}); most pinned reserved {:.1} MiB of a {} MiB budget",
        elapsed.as_secs_f64(),
        run.most_pinned.load(Ordering::Relaxed) as f64 / (1 << 20) as f64,
        PINNED_BUDGET >> 20
    );
    for (op, count) in OPS.iter().zip(&run.counts) {
        println!(
            "  {:<16} {}",
            format!("{op:?}"),
            count.load(Ordering::Relaxed)
        );
    }
    if let Some(failure) = run.failure.lock().unwrap().take() {
        panic!("{failure} (replay with FERRY_SEED={seed})");
    }
    assert!(
        run.counts.iter().all(|c| c.load(Ordering::Relaxed) > 0),
        "an operation never ran: run longer"
    );

    // Memory back to its baseline: everything the threads made is gone (the shared tensors,
    // counted in the baseline, are still alive).
    dev.synchronize().unwrap();
    let after = allocated(&dev, pool);
    drop(run);
    pool.set_budget(old_pinned).unwrap();
    ferry::host::set_pool_budget(old_host);
    assert_eq!(
        after, baseline,
        "(device, pinned, host) allocated bytes did not return to their baseline"
    );
}
