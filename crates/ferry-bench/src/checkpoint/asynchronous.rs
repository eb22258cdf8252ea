//! `ferry bench checkpoint --async`: a GPT of about 1B parameters trains with AdamW while
//! `save_async` checkpoints it, once per snapshot memory mode: the stall, the steps beside the
//! save against steps without one, the snapshot's rate against the link and the write's against
//! the disk, both measured in this run. With --compare-pytorch, python/checkpoint_async.py's
//! saves of the same GPT afterwards, as rows below ferry's.

use std::error::Error;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

use ferry::amp::autocast;
use ferry::checkpoint::{
    self, AsyncSaveOptions, AsyncSaveReport, Checkpoint, DeviceCopy, SnapshotMemory,
};
use ferry::memory::cuda::{CudaDevice, PinnedPool};
use ferry::models::{Gpt, GptConfig};
use ferry::nn::{Module, cross_entropy};
use ferry::optim::{AdamW, Optimizer};
use ferry::{DType, Device, DeviceMove, Tensor};
use serde_json::{Value, json};

use super::CheckpointArgs;
use crate::harness::measure::median;
use crate::harness::pytorch;
use crate::harness::table::{Cell, Report, Table};

const VOCAB: usize = 256;
const LINK_BYTES: usize = 1 << 30;
/// Steps timed without a save, and the most steps run while one is in flight.
const BASELINE_STEPS: usize = 6;
const MAX_OVERLAP_STEPS: usize = 200;

/// One save, measured while training went on.
struct Measured {
    mode: String,
    /// Building the state dict and `save_async`, on the training thread.
    stall_ms: f64,
    report: AsyncSaveReport,
    /// Each step that began before the save finished.
    overlapped: Vec<f64>,
    /// The disk's sequential write rate around the save: the mean of the measurements taken
    /// just before and just after its mode's saves.
    disk: f64,
}

struct Trainer {
    model: Gpt,
    opt: AdamW,
    x: Tensor,
    y: Tensor,
    batch: usize,
    seq: usize,
}

impl Trainer {
    fn new(args: &CheckpointArgs, device: Device) -> ferry::Result<Self> {
        ferry::manual_seed(0);
        let config = GptConfig {
            vocab: VOCAB,
            context: args.seq,
            width: args.width,
            layers: args.layers,
            heads: args.width / 128,
        };
        let model = Gpt::new(config, device)?;
        let opt = AdamW::new(model.parameters(), 1e-4)?;
        let n = args.batch * args.seq;
        let ids: Vec<i64> = (0..n + 1)
            .map(|i| ((i as u64 * 2_654_435_761) % VOCAB as u64) as i64)
            .collect();
        let x = Tensor::from_vec(ids[..n].to_vec(), &[args.batch, args.seq])?.to(device)?;
        let y = Tensor::from_vec(ids[1..].to_vec(), &[args.batch, args.seq])?.to(device)?;
        Ok(Self {
            model,
            opt,
            x,
            y,
            batch: args.batch,
            seq: args.seq,
        })
    }

    /// One training step, waited for: milliseconds.
    fn step(&mut self, dev: &CudaDevice) -> ferry::Result<f64> {
        let start = Instant::now();
        self.opt.zero_grad();
        let (rows, model) = (self.batch * self.seq, &self.model);
        let loss = autocast(DType::BF16, || {
            let logits = model.forward(&self.x)?;
            cross_entropy(&logits.reshape(&[rows, VOCAB])?, &self.y.reshape(&[rows])?)
        })?;
        loss.backward()?;
        self.opt.step()?;
        dev.synchronize()?;
        Ok(start.elapsed().as_secs_f64() * 1e3)
    }

    /// The training state, as a run's checkpoint holds it: the model and its optimizer.
    fn state(&self) -> Checkpoint {
        let mut ck = Checkpoint::new();
        ck.insert_section("model", self.model.state_dict());
        ck.insert_section("optimizer", self.opt.state_dict());
        ck
    }
}

/// Device-to-pinned bytes per second over 1 GiB, the best of three after one untimed.
fn link_d2h(dev: &CudaDevice) -> Result<f64, Box<dyn Error>> {
    let pool = PinnedPool::global()?;
    let stream = dev.new_stream()?;
    let src = dev.alloc_zeroed(LINK_BYTES, dev.default_stream())?;
    let mut landing = pool.alloc(LINK_BYTES)?;
    let mut best = f64::INFINITY;
    for round in 0..4 {
        dev.synchronize()?;
        let started = Instant::now();
        src.copy_to_pinned_async(&mut landing, &stream)?;
        landing.wait()?;
        if round > 0 {
            best = best.min(started.elapsed().as_secs_f64());
        }
    }
    drop(landing);
    pool.empty_cache()?;
    Ok(LINK_BYTES as f64 / best)
}

/// The disk's sequential write rate as a save writes: `bytes` in 4 MiB writes from memory, a
/// second thread fdatasyncing every 256 MiB (so the disk works while the page cache fills, as
/// the save's writer does), then fsync; bytes per second (the file is removed).
fn disk_write(dir: &Path, bytes: usize) -> Result<f64, Box<dyn Error>> {
    let path = dir.join(format!("ferry-bench-disk-{}.bin", std::process::id()));
    let block = vec![0x5au8; 4 << 20];
    let started = Instant::now();
    let result = (|| -> std::io::Result<()> {
        let file = std::fs::File::create(&path)?;
        std::thread::scope(|scope| {
            let (tick, ticks) = std::sync::mpsc::channel::<()>();
            let flusher = scope.spawn(|| {
                let ticks = ticks;
                while ticks.recv().is_ok() {
                    while ticks.try_recv().is_ok() {}
                    file.sync_data()?;
                }
                Ok::<(), std::io::Error>(())
            });
            let (mut left, mut unflushed) = (bytes, 0usize);
            while left > 0 {
                let n = left.min(block.len());
                (&file).write_all(&block[..n])?;
                left -= n;
                unflushed += n;
                if unflushed >= 256 << 20 {
                    let _ = tick.send(());
                    unflushed = 0;
                }
            }
            drop(tick);
            flusher
                .join()
                .unwrap_or_else(|_| Err(std::io::Error::other("the flusher panicked")))
        })?;
        file.sync_all()
    })();
    let secs = started.elapsed().as_secs_f64();
    let _ = std::fs::remove_file(&path);
    result?;
    Ok(bytes as f64 / secs)
}

/// The drain's rate alone: 1 GiB from pinned memory into host-pool buffers in 64 MiB pieces,
/// each copied by all cores in 4 MiB chunks as the snapshot drains its ring; the second of
/// two rounds (its buffers come back from the pool), bytes per second.
fn drain_rate() -> Result<f64, Box<dyn Error>> {
    use ferry::memory::HostPool;
    const PIECE: usize = 64 << 20;
    let pool = PinnedPool::global()?;
    let mut staged = pool.alloc(PIECE)?;
    staged.as_bytes_mut()?.fill(1);
    let staged = staged.as_bytes()?;
    let mut rate = 0.0;
    for _ in 0..2 {
        let started = Instant::now();
        let mut pieces = Vec::new();
        for _ in 0..LINK_BYTES / PIECE {
            let mut to = HostPool::global().alloc(PIECE)?;
            // As the snapshot drains a ring slot.
            ferry::memory::simd::copy_around_cache_parallel(to.as_bytes_mut(), staged, 4 << 20);
            pieces.push(to);
        }
        rate = LINK_BYTES as f64 / started.elapsed().as_secs_f64();
        drop(pieces);
    }
    Ok(rate)
}

/// The disk's rate around what ran between its last two measurements.
fn last_two_mean(disks: &[f64]) -> f64 {
    match disks {
        [.., before, after] => (before + after) / 2.0,
        _ => f64::NAN,
    }
}

fn gb(bytes_per_sec: f64) -> f64 {
    bytes_per_sec / 1e9
}

fn gib(bytes: usize) -> f64 {
    bytes as f64 / f64::from(1 << 30)
}

/// Saves once in `memory` while training: steps until the save has finished.
fn save_while_training(
    trainer: &mut Trainer,
    dev: &CudaDevice,
    path: &Path,
    memory: SnapshotMemory,
    device_copy: DeviceCopy,
    staging: usize,
    train: bool,
) -> Result<Measured, Box<dyn Error>> {
    dev.synchronize()?;
    let started = Instant::now();
    let options = AsyncSaveOptions {
        staging_bytes: staging,
        memory,
        device_copy,
        ..AsyncSaveOptions::default()
    };
    let pending = trainer.state().save_async(path, options)?;
    let stall_ms = started.elapsed().as_secs_f64() * 1e3;
    let mut overlapped = Vec::new();
    while train && !pending.is_finished() && overlapped.len() < MAX_OVERLAP_STEPS {
        overlapped.push(trainer.step(dev)?);
    }
    let report = pending.wait()?;
    Ok(Measured {
        mode: match memory {
            SnapshotMemory::Auto => "default (auto)".into(),
            SnapshotMemory::Pageable => "pageable".into(),
            SnapshotMemory::Bounded(b) => format!("bounded {:.0} GiB", gib(b)),
            SnapshotMemory::Pinned => "pinned".into(),
        } + match device_copy {
            DeviceCopy::Off => "",
            _ => " + device copy",
        },
        stall_ms,
        report,
        overlapped,
        disk: f64::NAN,
    })
}

pub fn run(args: &CheckpointArgs, dev: &CudaDevice) -> Result<(), Box<dyn Error>> {
    let device = dev.device();
    let staging = usize::try_from(args.staging_mib << 20)?;
    let dir = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let mut lines = Vec::new();
    let path = dir.join(format!(
        "ferry-bench-async-{}.safetensors",
        std::process::id()
    ));
    let mut trainer = Trainer::new(args, device)?;
    // Warm-up: the optimizer's state exists after the first step.
    for _ in 0..3 {
        trainer.step(dev)?;
    }
    let state = trainer.state();
    let bytes: usize = state.tensors().iter().map(|(_, t)| t.nbytes()).sum();
    let params: usize = trainer.model.parameters().iter().map(Tensor::numel).sum();
    drop(state);
    let link = link_d2h(dev)?;
    let disk_bytes = bytes.min(8 << 30);
    // The disk's rate moves within a run (its cache, other tenants): it is measured before
    // each mode's saves and after the last, and each save's write is held against the mean
    // of the two measurements around it.
    let mut disks = vec![disk_write(&dir, disk_bytes)?];
    let drain = drain_rate()?;
    lines.push(format!(
        "checkpoint while training: GPT {} layers x {} wide ({:.2} B parameters), batch {} x {}, \
         bf16 autocast, AdamW on {} ({}); checkpoint {:.2} GiB (model + optimizer state) in {}",
        args.layers,
        args.width,
        params as f64 / 1e9,
        args.batch,
        args.seq,
        device,
        dev.info().name,
        gib(bytes),
        dir.display()
    ));
    lines.push(format!(
        "measured in this run: link device->host {:.1} GB/s (pinned, 1 GiB); disk sequential \
         write {:.2} GB/s ({:.1} GiB, 4 MiB writes, fdatasync every 256 MiB beside them, fsync); \
         drain pinned -> host pool by all cores {:.1} GB/s (1 GiB in 64 MiB pieces)",
        gb(link),
        gb(disks[0]),
        gib(disk_bytes),
        gb(drain)
    ));
    let mut baseline = Vec::new();
    for _ in 0..BASELINE_STEPS {
        baseline.push(trainer.step(dev)?);
    }
    let base = median(&baseline).unwrap_or(f64::NAN);
    let mut runs = Vec::new();
    let bound = usize::try_from(args.bound_mib << 20)?;
    // Each mode twice: the first save faults its host pages in (or pins them); the next finds
    // them in ferry's host (or pinned) pool, as every periodic checkpoint after the first does.
    // The device copy: every GPU tensor copied on the GPU first, so writes wait for nothing.
    // The default: the device copy where the GPU has room, the snapshot then in pageable memory
    // (pinned where tensors are read in place).
    let modes = [
        (SnapshotMemory::Pageable, DeviceCopy::Off),
        (SnapshotMemory::Bounded(bound), DeviceCopy::Off),
        (SnapshotMemory::Pinned, DeviceCopy::Off),
        (SnapshotMemory::Auto, DeviceCopy::IfRoom),
        (SnapshotMemory::Bounded(bound), DeviceCopy::IfRoom),
    ];
    // Then once more with the GPU idle: the snapshot's rate without training beside it.
    for (memory, device_copy) in modes {
        let first_of_mode = runs.len();
        for round in ["first", "again", "idle"] {
            eprintln!("saving in {memory:?} memory, device copy {device_copy:?} ({round}) ...");
            let train = round != "idle";
            let mut measured = save_while_training(
                &mut trainer,
                dev,
                &path,
                memory,
                device_copy,
                staging,
                train,
            )?;
            measured.mode = format!("{} ({round})", measured.mode);
            if runs.is_empty() {
                let verified = checkpoint::verify(&path)?;
                lines.push(format!(
                    "the first file verifies: {} tensors, {:.2} GiB, checksummed: {}",
                    verified.tensors,
                    gib(verified.bytes),
                    verified.checksummed
                ));
            }
            let _ = std::fs::remove_file(&path);
            runs.push(measured);
        }
        PinnedPool::global()?.empty_cache()?;
        disks.push(disk_write(&dir, disk_bytes)?);
        let around = last_two_mean(&disks);
        for measured in &mut runs[first_of_mode..] {
            measured.disk = around;
        }
    }
    let after: Vec<f64> = (0..BASELINE_STEPS)
        .map(|_| trainer.step(dev))
        .collect::<ferry::Result<_>>()?;
    lines.push(format!(
        "step without a save: median {base:.1} ms before the saves, {:.1} ms after",
        median(&after).unwrap_or(f64::NAN)
    ));
    let mut table = Table::new(&HEADER);
    for m in &runs {
        table.push_with(texts(ferry_row(m, base, link)), to_json(m, base));
    }
    let torch = match args.pytorch.compare_pytorch {
        true => Some(pytorch_saves(args, &dir)),
        false => None,
    };
    // PyTorch's rows are held against the disk around them too.
    let torch_disk = match &torch {
        Some(Ok(_)) => {
            disks.push(disk_write(&dir, disk_bytes)?);
            last_two_mean(&disks)
        }
        _ => f64::NAN,
    };
    let disk = disks.iter().sum::<f64>() / disks.len() as f64;
    let (slowest, fastest) = disks.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &d| {
        (lo.min(d), hi.max(d))
    });
    lines.push(format!(
        "disk sequential write before each mode and after the last (PyTorch's included): {} \
         GB/s, their mean {:.2} (the slowest {:.0}% of the fastest); each save's write column \
         is of the mean of the two measurements around its mode",
        disks
            .iter()
            .map(|d| format!("{:.2}", gb(*d)))
            .collect::<Vec<_>>()
            .join(", "),
        gb(disk),
        100.0 * slowest / fastest
    ));
    match &torch {
        Some(Ok(doc)) => {
            let torch_base = doc["baseline_median_ms"].as_f64().unwrap_or(f64::NAN);
            lines.push(format!(
                "PyTorch {} (same GPT, AdamW fused, bf16 autocast): checkpoint {:.2} GiB, step \
                 without a save: median {torch_base:.1} ms before the saves, {:.1} ms after",
                doc["torch"].as_str().unwrap_or("?"),
                doc["bytes"].as_f64().unwrap_or(f64::NAN) / f64::from(1 << 30),
                doc["after_median_ms"].as_f64().unwrap_or(f64::NAN),
            ));
            let saves = doc["saves"].as_array().map_or(&[][..], Vec::as_slice);
            let bytes = doc["bytes"].as_f64().unwrap_or(f64::NAN);
            for save in saves {
                let row = pytorch_row(save, bytes, torch_base, link, torch_disk);
                table.push_with(texts(row), save.clone());
            }
        }
        Some(Err(err)) => lines.push(format!("no PyTorch rows: {err}")),
        None => {}
    }
    let mut report = Report::new("checkpoint --async", lines.join("\n")).with_facts(json!({
        "device": dev.info().name,
        "params": params,
        "bytes": bytes,
        "link_d2h_bytes_per_sec": link,
        "disk_write_bytes_per_sec": disk,
        "disk_writes_bytes_per_sec": disks,
        "baseline_step_ms": baseline,
        "after_step_ms": after,
        "pytorch": match &torch {
            Some(Ok(doc)) => doc.clone(),
            Some(Err(err)) => json!({ "error": err }),
            None => Value::Null,
        },
    }));
    report.table("saves", None, table);
    report.note(
        "the loop's stall: the call plus what every step run while the save was in flight took \
         beyond the median step without one (the stall a training loop feels); goals: loop's \
         stall <= 10 ms in the default mode (auto memory + device copy); steps during the save <= \
         1.03x; pinned <= 256 MiB (pageable and bounded modes); snapshot >= 80% of the link; \
         write >= 90% of the disk",
    );
    report.finish(args.json.as_deref())
}

/// PyTorch's saves of the same GPT (python/checkpoint_async.py): its JSON document.
fn pytorch_saves(args: &CheckpointArgs, dir: &Path) -> Result<Value, String> {
    eprintln!("running {}/checkpoint_async.py ...", pytorch::SCRIPT_DIR);
    let script = pytorch::locate_script(
        args.pytorch.pytorch_script.as_deref(),
        "checkpoint_async.py",
    )?;
    let flags = [
        ("--layers", args.layers.to_string()),
        ("--width", args.width.to_string()),
        ("--batch", args.batch.to_string()),
        ("--seq", args.seq.to_string()),
        ("--dir", dir.display().to_string()),
    ];
    let argv: Vec<String> = flags
        .into_iter()
        .flat_map(|(flag, value)| [flag.to_string(), value])
        .collect();
    pytorch::run_once(&args.pytorch.python, &script, &argv, &[])
}

/// Steps that overlapped the save over the median step without one.
fn overlap_ratio(m: &Measured, base: f64) -> f64 {
    mean_ratio(&m.overlapped, base)
}

/// The loop's stall: the time the training thread spent in the call (`stall_ms`) and what every
/// step run while the save was in flight took beyond the median step without one.
fn loop_stall(stall_ms: f64, steps: &[f64], base: f64) -> f64 {
    stall_ms + steps.iter().map(|s| s - base).sum::<f64>()
}

fn mean_ratio(steps: &[f64], base: f64) -> f64 {
    steps.iter().sum::<f64>() / steps.len().max(1) as f64 / base
}

/// The columns both sides share after the stall: the steps during the save and the rates.
fn overlap_cells(steps: &[f64], base: f64) -> [String; 3] {
    [
        steps.len().to_string(),
        match steps.is_empty() {
            true => "-".into(),
            false => format!("{:.3}x", mean_ratio(steps, base)),
        },
        steps
            .first()
            .map_or("-".into(), |f| format!("{:.2}x", f / base)),
    ]
}

fn rate_cell(bytes_per_sec: f64, of: f64) -> String {
    format!(
        "{:.2} ({:.0}%)",
        gb(bytes_per_sec),
        100.0 * bytes_per_sec / of
    )
}

/// A PyTorch save's row: its steps against PyTorch's own step without a save.
fn pytorch_row(save: &Value, bytes: f64, base: f64, link: f64, disk: f64) -> Vec<String> {
    let num = |k: &str| save[k].as_f64().unwrap_or(f64::NAN);
    let steps: Vec<f64> = save["overlapped_step_ms"]
        .as_array()
        .map_or(Vec::new(), |a| a.iter().filter_map(Value::as_f64).collect());
    let [during, mean, first] = overlap_cells(&steps, base);
    vec![
        save["mode"].as_str().unwrap_or("PyTorch").to_string(),
        format!("{:.1}", loop_stall(num("stall_ms"), &steps, base)),
        match save["call_ms"].as_f64() {
            Some(call) => format!("{:.2} (call {call:.2})", num("stall_ms")),
            None => format!("{:.2}", num("stall_ms")),
        },
        during,
        mean,
        first,
        format!("{:.2}", num("snapshot_s")),
        rate_cell(bytes / num("snapshot_s"), link),
        rate_cell(bytes / num("elapsed_s"), disk),
        // ferry.save_async's rows from PyTorch report it; PyTorch's own do not.
        save["peak_extra_host_bytes"]
            .as_f64()
            .map_or("-".into(), |b| format!("{:.2}", b / f64::from(1 << 30))),
        format!("{:.0}", num("peak_pinned_bytes") / f64::from(1 << 20)),
    ]
}

fn ferry_row(m: &Measured, base: f64, link: f64) -> Vec<String> {
    let r = &m.report;
    let snap = r.snapshot_bytes_per_sec();
    let write = r.bytes as f64 / r.elapsed.as_secs_f64().max(1e-9);
    let [during, mean, first] = overlap_cells(&m.overlapped, base);
    vec![
        m.mode.clone(),
        format!("{:.1}", loop_stall(m.stall_ms, &m.overlapped, base)),
        format!("{:.2} (call {:.2})", m.stall_ms, r.call.as_secs_f64() * 1e3),
        during,
        mean,
        first,
        format!(
            "{:.2} ({:.2}, {:.2})",
            r.snapshot.as_secs_f64(),
            r.snapshot_dma_wait.as_secs_f64(),
            r.snapshot_copy.as_secs_f64()
        ),
        format!("{:.1} ({:.0}%)", gb(snap), 100.0 * snap / link),
        rate_cell(write, m.disk),
        format!("{:.2}", gib(r.peak_extra_host_bytes)),
        format!("{:.0}", r.peak_pinned_bytes as f64 / f64::from(1 << 20)),
    ]
}

const HEADER: [&str; 11] = [
    "snapshot memory",
    "loop's stall ms",
    "stall ms",
    "steps during",
    "their mean / no save",
    "first / no save",
    "snapshot s (DMA wait, copy)",
    "snapshot GB/s (of link)",
    "write GB/s (of disk)",
    "extra host GiB",
    "pinned MiB",
];

/// A row's cells: their text, its figures recorded beside them unrounded.
fn texts(row: Vec<String>) -> Vec<Cell> {
    row.into_iter().map(Cell::text).collect()
}

fn to_json(m: &Measured, base: f64) -> Value {
    let r = &m.report;
    json!({
        "mode": m.mode,
        "stall_ms": m.stall_ms,
        "loop_stall_ms": loop_stall(m.stall_ms, &m.overlapped, base),
        "call_ms": r.call.as_secs_f64() * 1e3,
        "overlapped_step_ms": m.overlapped,
        "overlap_ratio": overlap_ratio(m, base),
        "snapshot_s": r.snapshot.as_secs_f64(),
        "snapshot_dma_wait_s": r.snapshot_dma_wait.as_secs_f64(),
        "snapshot_copy_s": r.snapshot_copy.as_secs_f64(),
        "elapsed_s": r.elapsed.as_secs_f64(),
        "bytes": r.bytes,
        "peak_extra_host_bytes": r.peak_extra_host_bytes,
        "peak_pinned_bytes": r.peak_pinned_bytes,
        "disk_bytes_per_sec": m.disk,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pytorch_save_reads_as_a_row_against_its_own_step_and_this_runs_link_and_disk() {
        let save = json!({
            "mode": "PyTorch pinned snapshot + thread (again)",
            "stall_ms": 178.7,
            "snapshot_s": 0.18,
            "elapsed_s": 10.0,
            "overlapped_step_ms": [120.0, 90.0],
            "peak_pinned_bytes": 9257.0 * 1048576.0,
        });
        let row = pytorch_row(&save, 9.0e9, 100.0, 50.0e9, 1.8e9);
        assert_eq!(row[0], "PyTorch pinned snapshot + thread (again)");
        // The loop lost the call's 178.7 ms and the first step's 20 beyond its 100 ms; the
        // second step gained 10 back.
        assert_eq!(row[1], "188.7");
        assert_eq!(row[2], "178.70");
        // Two steps beside the save, against PyTorch's own step of 100 ms.
        assert_eq!((row[3].as_str(), row[4].as_str()), ("2", "1.050x"));
        assert_eq!(row[5], "1.20x");
        // 9 GB in 0.18 s against a 50 GB/s link; in 10 s against a 1.8 GB/s disk.
        assert_eq!(row[7], "50.00 (100%)");
        assert_eq!(row[8], "0.90 (50%)");
        assert_eq!(row[10], "9257");
        // torch.save from the GPU stops training for the whole save: no steps beside it.
        let blocking = json!({
            "mode": "PyTorch torch.save from GPU (first)",
            "stall_ms": 1000.0,
            "snapshot_s": 1.0,
            "elapsed_s": 1.0,
            "overlapped_step_ms": [],
            "peak_pinned_bytes": 0,
        });
        let row = pytorch_row(&blocking, 9.0e9, 100.0, 50.0e9, 1.8e9);
        assert_eq!(
            (row[3].as_str(), row[4].as_str(), row[5].as_str()),
            ("0", "-", "-")
        );
        // Its stall is the whole save.
        assert_eq!(row[1], "1000.0");
    }
}
