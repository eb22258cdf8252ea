//! `ferry bench train --profile`: where the time of ferry's step goes on the GPU, after the timed
//! rounds of each case.
//!
//! Three views of the same steps. *As run*: a timed event at the end of each phase of a step
//! (zero_grad, forward, loss, backward, optimizer step) and the host's clock at the same points;
//! a phase's GPU time then includes any wait for the host. *Host ahead*: before each step the GPU
//! is given a few long products to run, so the host queues the whole step while the GPU is busy
//! and each phase's GPU time is its own work (unless the step synchronizes: then the phases after
//! that point wait for the host again, which shows as their host time). *Kernels*: in the host-
//! ahead steps, every launch, GEMM and convolution timed on its own (the device's kernel
//! profiler), summed by name per step.

use std::error::Error;
use std::time::Instant;

use ferry::cuda_libs::Profiling;
use ferry::memory::cuda::{CudaDevice, Event};
use ferry::prelude::*;

use super::cases::{Case, PHASES, Phase};
use super::step::FerryRun;
use crate::harness::table::{Cell, Table};

/// Products the GPU runs ahead of each host-ahead step (about 2.6 ms each on an H200 in f32).
const HEAD_START: usize = 3;
const HEAD_START_SIDE: usize = 4000;

/// Mean host and GPU milliseconds per phase over `steps` steps; `head_start` runs before each.
fn phase_times(
    run: &mut FerryRun,
    dev: &CudaDevice,
    steps: u32,
    head_start: Option<&(Tensor, Tensor)>,
) -> Result<([f64; 5], [f64; 5]), Box<dyn Error>> {
    let stream = dev.default_stream();
    let mut host = [0.0; 5];
    let mut marks: Vec<(Event, Vec<Event>)> = Vec::new();
    for _ in 0..steps {
        if let Some((a, b)) = head_start {
            let _no_grad = ferry::no_grad();
            for _ in 0..HEAD_START {
                a.matmul(b)?;
            }
        }
        let start = stream.record_timed()?;
        let mut ends = Vec::with_capacity(PHASES.len());
        let mut last = Instant::now();
        run.step_marked(&mut |phase: Phase| {
            ends.push(stream.record_timed()?);
            let now = Instant::now();
            host[phase as usize] += (now - last).as_secs_f64() * 1e3;
            last = now;
            Ok(())
        })?;
        marks.push((start, ends));
    }
    dev.synchronize()?;
    let mut gpu = [0.0; 5];
    for (start, ends) in &marks {
        let mut from = start;
        for (i, end) in ends.iter().enumerate() {
            gpu[i] += f64::from(Event::elapsed_ms(from, end)?);
            from = end;
        }
    }
    let n = f64::from(steps);
    Ok((host.map(|t| t / n), gpu.map(|t| t / n)))
}

/// Profiles `steps` of ferry's steps of `case` on its GPU and prints the three views.
pub(crate) fn profile(case: &Case, run: &mut FerryRun, steps: u32) -> Result<(), Box<dyn Error>> {
    let Some(dev) = run.cuda.clone() else {
        println!("profile of {}: needs a GPU", case.id);
        return Ok(());
    };
    let device = dev.device();
    let side = [HEAD_START_SIDE, HEAD_START_SIDE];
    let head_start = (
        Tensor::randn(&side, DType::F32, device)?,
        Tensor::randn(&side, DType::F32, device)?,
    );
    let (host, as_run) = phase_times(run, &dev, steps, None)?;
    dev.start_profile();
    let timed = phase_times(run, &dev, steps, Some(&head_start));
    let kernels = dev.stop_profile()?;
    let (_, ahead) = timed?;

    println!();
    let (id, what) = (case.id, case.describe());
    println!("profile of {id} ({what}; {steps} steps each view, means per step):");
    let ms = |v: f64| Cell::text(format!("{v:.3}"));
    let mut phases = Table::new(&[
        "phase",
        "host ms (as run)",
        "GPU ms (as run)",
        "GPU ms (host ahead)",
    ]);
    for (i, phase) in PHASES.iter().enumerate() {
        phases.push(vec![Cell::text(phase.label()), ms(host[i]), ms(as_run[i]), ms(ahead[i])]);
    }
    let sum = |v: &[f64; 5]| ms(v.iter().sum());
    phases.push(vec![Cell::text("step"), sum(&host), sum(&as_run), sum(&ahead)]);
    phases.print();
    let head = format!("gemm {HEAD_START_SIDE}x{HEAD_START_SIDE}x{HEAD_START_SIDE}");
    let kernels: Vec<_> = kernels
        .into_iter()
        .filter(|k| !k.name.starts_with(&head))
        .collect();
    let total: f64 = kernels.iter().map(|k| k.total_ms).sum();
    let n = f64::from(steps);
    let mut table = Table::new(&["kernel (host ahead)", "launches/step", "µs/step", "share"]);
    let mut row = |name: String, launches: Option<u64>, ms: f64| {
        let share = match name.as_str() {
            "all" => "100%".into(),
            _ => format!("{:.1}%", 100.0 * ms / total.max(f64::MIN_POSITIVE)),
        };
        table.push(vec![
            Cell::text(name),
            Cell::text(launches.map_or(String::new(), |l| format!("{:.1}", l as f64 / n))),
            Cell::text(format!("{:.1}", ms * 1e3 / n)),
            Cell::text(share),
        ]);
    };
    for k in kernels.iter().take(30) {
        row(k.name.clone(), Some(k.launches), k.total_ms);
    }
    if kernels.len() > 30 {
        let rest: f64 = kernels[30..].iter().map(|k| k.total_ms).sum();
        row(format!("{} more", kernels.len() - 30), None, rest);
    }
    let launches: u64 = kernels.iter().map(|k| k.launches).sum();
    row("all".into(), Some(launches), total);
    println!();
    table.print();
    Ok(())
}
