//! `ferry bench pipeline --trace`: one run of `pipelined` with timed events around each frame's
//! kernels and copy and the host's clock around each step, then runs that leave a stage out. A
//! copy right after the previous one means a busy link; a gap says what it waited for.

use std::collections::VecDeque;
use std::time::Instant;

use ferry::memory::cuda::Event;
use ferry::{Device, DeviceMove, Result};

use super::stages::{Fixture, process, produce};
use crate::harness::measure::median;
use crate::harness::report::{print_table, significant};

/// Frames printed one by one (the rest go into the medians only).
const SHOWN: usize = 12;

/// One frame's events on the device and instants on the host.
struct FrameTrace {
    produced: Event,
    copy_queued_after: Event,
    copied: Event,
    launch: f64,
    queued: f64,
    waited: f64,
    processed: f64,
}

/// Device times of one frame, ms since the run's start.
struct DeviceTimes {
    produced: f64,
    copy_start: f64,
    copied: f64,
}

pub(crate) fn trace(fx: &Fixture, when: &str) -> Result<()> {
    let default = fx.dev.default_stream();
    fx.dev.synchronize()?;
    let origin = default.record_timed()?;
    origin.synchronize()?;
    let t0 = Instant::now();
    let ms = |t: Instant| t.duration_since(t0).as_secs_f64() * 1e3;

    let mut frames: Vec<FrameTrace> = Vec::with_capacity(fx.frames);
    let mut in_flight = VecDeque::with_capacity(fx.depth);
    let finish = |frames: &mut Vec<FrameTrace>, k: usize, pending: ferry::PendingTensor| {
        let (host, _) = pending.wait()?;
        frames[k].waited = ms(Instant::now());
        process(&host, fx.passes)?;
        frames[k].processed = ms(Instant::now());
        Ok::<_, ferry::TensorError>(())
    };
    for i in 0..fx.frames {
        let launch = ms(Instant::now());
        let frame = produce(&fx.base, i)?;
        let produced = default.record_timed()?;
        let copy_queued_after = fx.copy.record_timed()?;
        in_flight.push_back((i, frame.to_async(Device::Cpu, &fx.copy)?));
        let copied = fx.copy.record_timed()?;
        frames.push(FrameTrace {
            produced,
            copy_queued_after,
            copied,
            launch,
            queued: ms(Instant::now()),
            waited: 0.0,
            processed: 0.0,
        });
        if in_flight.len() == fx.depth {
            let (k, pending) = in_flight.pop_front().expect("depth >= 2");
            finish(&mut frames, k, pending)?;
        }
    }
    while let Some((k, pending)) = in_flight.pop_front() {
        finish(&mut frames, k, pending)?;
    }
    let total = ms(Instant::now()) / fx.frames as f64;

    let since = |e: &Event| Ok::<_, ferry::TensorError>(f64::from(Event::elapsed_ms(&origin, e)?));
    let mut device = Vec::with_capacity(frames.len());
    for f in &frames {
        let produced = since(&f.produced)?;
        device.push(DeviceTimes {
            produced,
            copy_start: produced.max(since(&f.copy_queued_after)?),
            copied: since(&f.copied)?,
        });
    }

    println!(
        "\ntrace of ferry's pipeline, {when} ({} frames, {} in flight): {} ms/frame in this run",
        fx.frames,
        fx.depth,
        significant(total)
    );
    println!(
        "device times are ms since the start; copy start = the later of its frame's kernels and the copy before it"
    );
    let mut table = Vec::new();
    for (i, (f, d)) in frames.iter().zip(&device).enumerate().take(SHOWN) {
        let gap = i
            .checked_sub(1)
            .map(|p| d.copy_start - device[p].copied)
            .map_or_else(|| "-".into(), |g| format!("{g:.3}"));
        table.push(vec![
            i.to_string(),
            format!("{:.3}", f.launch),
            format!("{:.3}", f.queued),
            format!("{:.3}", d.produced),
            format!("{:.3}", d.copy_start),
            format!("{:.3}", d.copied),
            gap,
            format!("{:.3}", f.waited),
            format!("{:.3}", f.processed),
        ]);
    }
    print_table(
        &[
            "frame",
            "host: launch",
            "queued",
            "device: kernels done",
            "copy start",
            "copy done",
            "link idle before",
            "host: waited",
            "processed",
        ],
        &table,
    );

    let steady = 2.min(frames.len())..frames.len();
    let med = |xs: Vec<f64>| median(&xs).map_or_else(|| "-".into(), significant);
    let link_idle: Vec<f64> = steady
        .clone()
        .filter(|&i| i > 0)
        .map(|i| (device[i].copy_start - device[i - 1].copied).max(0.0))
        .collect();
    let late_kernels = steady
        .clone()
        .filter(|&i| i > 0 && device[i].produced > device[i - 1].copied + 1e-3)
        .count();
    println!(
        "medians from frame {}: copy {} ms, link idle before a copy {} ms ({} of {} copies waited for their frame's kernels), \
         kernels done after launch {} ms, host launch+queue {} ms, wait {} ms, process {} ms",
        steady.start,
        med(steady
            .clone()
            .map(|i| device[i].copied - device[i].copy_start)
            .collect()),
        med(link_idle),
        late_kernels,
        steady.len().saturating_sub(1),
        med(steady
            .clone()
            .map(|i| device[i].produced - frames[i].launch)
            .collect()),
        med(steady
            .clone()
            .map(|i| frames[i].queued - frames[i].launch)
            .collect()),
        // The host starts waiting for frame i once it has queued frame i + depth - 1.
        med(steady
            .clone()
            .filter(|&i| i + fx.depth - 1 < frames.len())
            .map(|i| frames[i].waited - frames[i + fx.depth - 1].queued)
            .collect()),
        med(steady
            .clone()
            .map(|i| frames[i].processed - frames[i].waited)
            .collect()),
    );

    for (label, gpu_work, host_work) in [
        ("without host work", true, false),
        ("without GPU work (one frame moved each time)", false, true),
    ] {
        println!(
            "pipelined {label}: {} ms/frame",
            significant(leave_out(fx, gpu_work, host_work)?)
        );
    }
    Ok(())
}

/// The `pipelined` row with a stage left out, ms per frame.
fn leave_out(fx: &Fixture, gpu_work: bool, host_work: bool) -> Result<f64> {
    let fixed = produce(&fx.base, 0)?;
    fx.dev.synchronize()?;
    let start = Instant::now();
    let mut in_flight = VecDeque::with_capacity(fx.depth);
    let finish = |pending: ferry::PendingTensor| -> Result<()> {
        let (host, _) = pending.wait()?;
        if host_work {
            process(&host, fx.passes)?;
        }
        Ok(())
    };
    for i in 0..fx.frames {
        let frame = if gpu_work {
            produce(&fx.base, i)?
        } else {
            fixed.clone()
        };
        in_flight.push_back(frame.to_async(Device::Cpu, &fx.copy)?);
        if in_flight.len() == fx.depth {
            finish(in_flight.pop_front().expect("depth >= 2"))?;
        }
    }
    while let Some(pending) = in_flight.pop_front() {
        finish(pending)?;
    }
    Ok(start.elapsed().as_secs_f64() * 1e3 / fx.frames as f64)
}
