//! `ferry methods`: every way to get a tensor to the host, measured side by side in one run.
//!
//! Each method is warmed up once, then timed `--repeat` times on a source created once (for
//! `into_device`, a fresh source is made before each run, outside the timed region). Peak extra
//! memory comes from the allocators' own statistics, restarted before each run.

use std::error::Error;
use std::str::FromStr;
use std::time::Instant;

use clap::Args;
use ferry::memory::cuda::{CudaDevice, PinnedPool, Stream};
use ferry::prelude::*;
use ferry::tensor::{Buffer, Storage};
use ferry::{ChunkPlan, TransferPath, TransferReport, move_state_dict};
use ferry_bench::{Measured, cuda_device_or_say, print_table, without_cuda};

mod peer;

/// What a run without a GPU shows instead.
const HOST_ROWS: &str = "showing the rows that run on the host";

/// Tensors in the state-dict row: the source split along axis 0 into this many pieces.
const STATE_DICT_TENSORS: usize = 64;

#[derive(Args, Debug)]
pub struct MethodsArgs {
    /// Shape of the f32 tensor to move, as dimensions joined by `x`.
    #[arg(long, default_value = "10000x10000")]
    shape: ShapeArg,
    /// The GPU to move from (`cuda:N`), or `cpu` for the host-only rows. With `cuda:N` for N >= 1
    /// the table also has the peer rows, cuda:0 -> cuda:N (they need two GPUs).
    #[arg(long, default_value = "cuda:0")]
    device: Device,
    /// Timed runs per method, after one warm-up.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    repeat: u32,
}

#[derive(Debug, Clone)]
struct ShapeArg(Vec<usize>);

impl FromStr for ShapeArg {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        s.split('x')
            .map(|d| d.trim().parse::<usize>())
            .collect::<Result<Vec<_>, _>>()
            .map(ShapeArg)
            .map_err(|_| {
                format!("`{s}` is not a shape: write dimensions joined by x, e.g. 10000x10000")
            })
    }
}

/// What one run produced: the result (alive while memory is read) and the move's report.
struct Outcome {
    result: Vec<Tensor>,
    report: Option<TransferReport>,
}

impl Outcome {
    fn moved(result: Tensor, report: TransferReport) -> Self {
        Self {
            result: vec![result],
            report: Some(report),
        }
    }
}

type Setup<'a> = Box<dyn FnMut() -> ferry::Result<Tensor> + 'a>;
type Run<'a> = Box<dyn FnMut(Tensor) -> ferry::Result<Outcome> + 'a>;

struct Method<'a> {
    name: String,
    setup: Setup<'a>,
    run: Run<'a>,
}

/// One table row.
struct Row {
    name: String,
    times: Measured,
    bytes_moved: usize,
    host_extra: usize,
    device_extra: Option<usize>,
    gradient: Option<bool>,
    nodes: usize,
}

/// Where peak memory is read: the GPU's allocator and the pinned pool, when there is a GPU.
struct Meters {
    device: Option<CudaDevice>,
    pinned: Option<&'static PinnedPool>,
}

impl Meters {
    /// Restarts every peak; returns the baselines (device allocated, pinned allocated).
    fn start(&self) -> (usize, usize) {
        let device = self.device.as_ref().map_or(0, |d| {
            d.reset_peak();
            d.memory_stats().allocated_bytes
        });
        let pinned = self.pinned.map_or(0, |p| {
            p.reset_peak();
            p.stats().allocated_bytes
        });
        (device, pinned)
    }

    /// Peak extra (device, pinned) bytes since `start`.
    fn peaks(&self, (device, pinned): (usize, usize)) -> (usize, usize) {
        (
            self.device.as_ref().map_or(0, |d| {
                d.memory_stats().peak_allocated_bytes.saturating_sub(device)
            }),
            self.pinned
                .map_or(0, |p| p.stats().peak_allocated_bytes.saturating_sub(pinned)),
        )
    }

    fn synchronize(&self) -> ferry::Result<()> {
        if let Some(d) = &self.device {
            d.synchronize()?;
        }
        Ok(())
    }
}

/// Pageable host bytes a result holds (pinned bytes are counted by the pool).
fn pageable_bytes(tensors: &[Tensor]) -> usize {
    let mut seen: Vec<*const Storage> = Vec::new();
    tensors
        .iter()
        .filter(|t| {
            let ptr = std::sync::Arc::as_ptr(t.storage());
            !seen.contains(&ptr) && {
                seen.push(ptr);
                true
            }
        })
        .map(|t| match &*t.storage().read() {
            Buffer::Host(b) => b.len(),
            _ => 0,
        })
        .sum()
}

fn measure(method: &mut Method<'_>, meters: &Meters, repeat: u32) -> ferry::Result<Row> {
    let mut row = Row {
        name: method.name.clone(),
        times: Measured::new(),
        bytes_moved: 0,
        host_extra: 0,
        device_extra: meters.device.as_ref().map(|_| 0),
        gradient: None,
        nodes: 0,
    };
    for run in 0..=repeat {
        let input = (method.setup)()?;
        meters.synchronize()?;
        let baseline = meters.start();
        let started = Instant::now();
        let outcome = (method.run)(input)?;
        let elapsed = started.elapsed();
        let (device_peak, pinned_peak) = meters.peaks(baseline);
        if run == 0 {
            continue; // the warm-up
        }
        row.times.push(elapsed.as_secs_f64() * 1e3);
        row.device_extra = row.device_extra.map(|d| d.max(device_peak));
        row.host_extra = row
            .host_extra
            .max(pinned_peak + pageable_bytes(&outcome.result));
        if let Some(report) = &outcome.report {
            row.bytes_moved = report.bytes_moved;
            row.nodes = report.nodes_recorded;
            row.gradient = Some(report.nodes_recorded > 0);
        }
    }
    Ok(row)
}

fn gpu_methods<'a>(
    src: &'a Tensor,
    gpu: Device,
    shape: &'a [usize],
    stream: &'a Stream,
) -> Vec<Method<'a>> {
    let same = move || -> Setup<'a> { Box::new(move || Ok(src.clone())) };
    // The pinned budget to put back after the row that moves beyond it.
    let budget = PinnedPool::global().ok().map(PinnedPool::budget);
    let method = |name: &str, setup: Setup<'a>, run: Run<'a>| Method {
        name: name.into(),
        setup,
        run,
    };
    vec![
        method(
            "cpu()",
            same(),
            Box::new(|x| {
                let (y, report) = x.to_with(Device::Cpu, MoveOptions::default())?;
                Ok(Outcome::moved(y, report))
            }),
        ),
        method(
            "to(cpu)",
            same(),
            Box::new(|x| {
                let (y, report) = x.to_with(Device::Cpu, MoveOptions::default())?;
                Ok(Outcome::moved(y, report))
            }),
        ),
        method(
            "to(cpu, f16)",
            same(),
            Box::new(|x| {
                let (y, report) = x.to_with(Device::Cpu, MoveOptions::dtype(DType::F16))?;
                Ok(Outcome::moved(y, report))
            }),
        ),
        method(
            "detach().cpu()",
            same(),
            Box::new(|x| {
                let (y, report) = x.detach().to_with(Device::Cpu, MoveOptions::default())?;
                Ok(Outcome::moved(y, report))
            }),
        ),
        method(
            "into_device(cpu)",
            Box::new(move || Tensor::randn(shape, DType::F32, gpu)?.with_grad()),
            Box::new(|x| {
                let (y, report) = x.into_device(Device::Cpu)?;
                Ok(Outcome::moved(y, report))
            }),
        ),
        method(
            "to_chunked(Count(4))",
            same(),
            Box::new(|x| {
                let (y, report) = x.to_chunked(Device::Cpu, ChunkSpec::Count(4))?;
                Ok(Outcome::moved(y, report))
            }),
        ),
        method(
            "to_chunked(staging <= 1/4)",
            same(),
            Box::new(|x| {
                let bound =
                    (x.nbytes() / 4).max(ChunkPlan::min_staging_bytes(x.shape(), x.dtype()));
                let (y, report) = x.to_chunked(Device::Cpu, ChunkSpec::MaxStagingBytes(bound))?;
                Ok(Outcome::moved(y, report))
            }),
        ),
        method(
            "to_async(pinned) + wait",
            same(),
            Box::new(move |x| {
                let (y, report) = x.to_async(Device::Cpu, stream)?.wait()?;
                Ok(Outcome::moved(y, report))
            }),
        ),
        method(
            "cpu() beyond the pinned budget",
            Box::new(move || {
                // A budget with room for staging but not for the result (and nothing cached
                // that could serve it): the result lands in pooled pageable memory through
                // bounded pinned staging, as every result past the budget does.
                let pool = PinnedPool::global()?;
                let room = PinnedPool::block_size(src.nbytes()).saturating_sub(1);
                pool.set_budget(pool.stats().allocated_bytes + room)?;
                Ok(src.clone())
            }),
            Box::new(move |x| {
                let moved = x.to_with(Device::Cpu, MoveOptions::default());
                if let Some(budget) = budget {
                    PinnedPool::global()?.set_budget(budget)?;
                }
                let (y, report) = moved?;
                Ok(Outcome::moved(y, report))
            }),
        ),
        method(
            &format!("move_state_dict({STATE_DICT_TENSORS} tensors)"),
            same(),
            Box::new(|x| {
                let parts = x
                    .detach()
                    .chunk(STATE_DICT_TENSORS.min(x.dim(0)?.max(1)), 0)?;
                let dict: Vec<(String, Tensor)> = parts
                    .into_iter()
                    .enumerate()
                    .map(|(i, t)| (format!("layer{i}.weight"), t))
                    .collect();
                let (moved, report) = move_state_dict(&dict, Device::Cpu)?;
                Ok(Outcome {
                    result: moved.into_iter().map(|(_, t)| t).collect(),
                    report: Some(report),
                })
            }),
        ),
    ]
}

fn host_methods<'a>(
    shape: &'a [usize],
    with_cast: bool,
    src: Option<&'a Tensor>,
) -> Vec<Method<'a>> {
    let mut methods = vec![Method {
        name: "direct CPU creation (randn)".into(),
        setup: Box::new(|| Tensor::zeros(&[0], DType::F32, Device::Cpu)),
        run: Box::new(move |_| {
            Ok(Outcome {
                result: vec![Tensor::randn(shape, DType::F32, Device::Cpu)?],
                report: None,
            })
        }),
    }];
    if let (true, Some(src)) = (with_cast, src) {
        methods.push(Method {
            name: "to(cpu, f16) of a CPU tensor".into(),
            setup: Box::new(move || Ok(src.clone())),
            run: Box::new(|x| {
                let (y, report) = x.to_with(Device::Cpu, MoveOptions::dtype(DType::F16))?;
                Ok(Outcome::moved(y, report))
            }),
        });
    }
    methods
}

pub fn run(args: MethodsArgs) -> Result<(), Box<dyn Error>> {
    let shape = args.shape.0;
    let numel: usize = shape.iter().product();
    let dims = shape
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("x");
    println!(
        "ferry methods: {dims} f32 ({:.1} MB), {} timed run(s) per method after one warm-up",
        (numel * 4) as f64 / 1e6,
        args.repeat
    );
    let gpu = match args.device {
        Device::Cuda(ordinal) if ordinal > 0 && CudaDevice::get(0).is_ok() => {
            cuda_device_or_say(ordinal, |err| {
                format!(
                    "the peer rows (cuda:0 -> cuda:{ordinal}) need two GPUs: {err}\n\
                     showing the rows of cuda:0"
                )
            })
            .or_else(|| CudaDevice::get(0).ok())
        }
        Device::Cuda(ordinal) => cuda_device_or_say(ordinal, |err| without_cuda(err, HOST_ROWS)),
        Device::Cpu => {
            println!("device cpu: {HOST_ROWS}");
            None
        }
    };
    let meters = Meters {
        pinned: gpu.as_ref().and_then(|_| PinnedPool::global().ok()),
        device: gpu.clone(),
    };
    let mut rows = Vec::new();
    match &gpu {
        Some(dev) => {
            println!("device {}: {}", dev.device(), dev.info().name);
            let src = Tensor::randn(&shape, DType::F32, dev.device())?.with_grad()?;
            // Made once: creating a stream is not part of an async move.
            let stream = dev.new_stream()?;
            for mut method in gpu_methods(&src, dev.device(), &shape, &stream) {
                rows.push(measure(&mut method, &meters, args.repeat)?);
            }
            for mut method in host_methods(&shape, false, None) {
                rows.push(measure(&mut method, &meters, args.repeat)?);
            }
            if dev.ordinal() > 0 {
                rows.extend(peer_rows(&shape, dev, args.repeat)?);
            }
        }
        None => {
            let src = Tensor::randn(&shape, DType::F32, Device::Cpu)?.with_grad()?;
            for mut method in host_methods(&shape, true, Some(&src)) {
                rows.push(measure(&mut method, &meters, args.repeat)?);
            }
        }
    }
    print_rows(&rows);
    Ok(())
}

/// The peer rows, cuda:0 -> `target`; device +MB is read on `target`.
fn peer_rows(shape: &[usize], target: &CudaDevice, repeat: u32) -> ferry::Result<Vec<Row>> {
    let source = CudaDevice::get(0)?;
    let src = Tensor::randn(shape, DType::F32, source.device())?.with_grad()?;
    let (_, probe) = src
        .detach()
        .to_with(target.device(), MoveOptions::default())?;
    let how = match probe.path {
        TransferPath::Peer { direct: true, .. } => "direct (peer access enabled)",
        TransferPath::Peer { direct: false, .. } => {
            "staged through host memory by the driver (no peer access between these GPUs)"
        }
        _ => "not a peer copy",
    };
    println!(
        "peer rows: {} -> {}, {how}",
        source.device(),
        target.device()
    );
    let meters = Meters {
        device: Some(target.clone()),
        pinned: PinnedPool::global().ok(),
    };
    let stream = target.new_stream()?;
    let mut rows = Vec::new();
    for mut method in peer::peer_methods(&src, &source, target, &stream) {
        source.synchronize()?;
        rows.push(measure(&mut method, &meters, repeat)?);
    }
    Ok(rows)
}

/// One row's cells; every row has at least one timed run (`--repeat` >= 1).
fn cells(r: &Row) -> Vec<String> {
    let mb = |b: usize| format!("{:.1}", b as f64 / 1e6);
    let ms = |t: Option<f64>| format!("{:.3}", t.unwrap_or(f64::NAN));
    let med = r.times.median().unwrap_or(f64::NAN);
    let gbs = if r.bytes_moved > 0 {
        format!("{:.2}", r.bytes_moved as f64 / (med / 1e3) / 1e9)
    } else {
        "-".into()
    };
    let grad = match r.gradient {
        Some(true) => "yes",
        Some(false) => "no",
        None => "-",
    };
    vec![
        r.name.clone(),
        ms(Some(med)),
        ms(r.times.min()),
        ms(r.times.max()),
        gbs,
        mb(r.host_extra),
        r.device_extra.map_or("-".into(), mb),
        grad.into(),
        r.nodes.to_string(),
    ]
}

/// The table: times and widths are ferry-bench's, so `ferry methods` and `ferry bench` read alike.
fn print_rows(rows: &[Row]) {
    let header = [
        "method",
        "median ms",
        "min ms",
        "max ms",
        "GB/s",
        "host +MB",
        "device +MB",
        "grad kept",
        "nodes",
    ];
    let body: Vec<Vec<String>> = rows.iter().map(cells).collect();
    print_table(&header, &body);
    println!(
        "host +MB: pinned-pool peak (its statistics) plus pageable bytes the result holds; \
         device +MB: the allocator's peak over what was allocated before the run; \
         beyond the pinned budget, results go pageable through at most 64 MiB of pinned staging"
    );
    if rows.iter().any(|r| r.name.contains(" -> cuda:")) {
        println!(
            "peer rows: device +MB is read on the target GPU; each run waits for the target \
             before the clock stops"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_reads_its_times_through_the_bench_statistics() {
        let row = Row {
            name: "cpu()".into(),
            times: Measured::from_samples(vec![4.0, 1.0, 3.0, 2.0]),
            bytes_moved: 400_000_000,
            host_extra: 400_000_000,
            device_extra: None,
            gradient: Some(true),
            nodes: 1,
        };
        // The median of an even count is the mean of the middle two: 2.5 ms for 400 MB.
        assert_eq!(
            cells(&row),
            [
                "cpu()", "2.500", "1.000", "4.000", "160.00", "400.0", "-", "yes", "1"
            ]
        );
        let host_only = Row {
            bytes_moved: 0,
            gradient: None,
            device_extra: Some(0),
            ..row
        };
        assert_eq!(cells(&host_only)[4..8], ["-", "400.0", "0.0", "-"]);
    }
}
