//! `ferry bench ddp`'s figures and presentation: samples/s, scaling efficiency, the goals, the
//! table and the JSON.

use serde_json::{Value, json};

use crate::RunInfo;

use super::{Config, Row};
use crate::harness::goal::{Bound, Goal, Judged, goals_json, print_goals};
use crate::harness::report::{format_ratio, print_table, significant};

/// The two goals: efficiency >= 0.9 and ferry's two-GPU step no slower than PyTorch's.
const GOALS: [Goal; 2] = [
    Goal {
        name: "scaling efficiency on 2 GPUs >= 0.9",
        metric: "ferry_scaling_efficiency",
        bound: Bound::AtLeast(0.9),
    },
    Goal {
        name: "2-GPU step time <= PyTorch DDP's",
        metric: "ddp_2 median_ms, ferry / PyTorch",
        bound: Bound::AtMost(1.0),
    },
];

/// Two-replica samples/s over twice the one-GPU (plain) samples/s.
pub(super) fn scaling_efficiency(rows: &[Row], batch: usize) -> Option<f64> {
    let one = find(rows, "plain_1")?.samples_per_s(batch)?;
    let two = find(rows, "ddp_2")?.samples_per_s(batch)?;
    Some(two / (2.0 * one))
}

pub(super) fn find<'a>(rows: &'a [Row], id: &str) -> Option<&'a Row> {
    rows.iter().find(|r| r.id == id)
}

/// [`GOALS`] judged on ferry's rows and PyTorch's.
pub(super) fn goals(ferry: &[Row], torch: Option<&[Row]>, batch: usize) -> Vec<Judged> {
    let efficiency = scaling_efficiency(ferry, batch);
    let ours = find(ferry, "ddp_2").and_then(Row::median_ms);
    let theirs = torch
        .and_then(|rows| find(rows, "ddp_2"))
        .and_then(Row::median_ms);
    let step = match (ours, theirs) {
        (Some(f), Some(t)) => format!(
            "{} ms vs {} ms ({})",
            significant(f),
            significant(t),
            format_ratio(f, t)
        ),
        (Some(f), None) => format!("{} ms vs -", significant(f)),
        _ => "-".into(),
    };
    vec![
        GOALS[0].judge(efficiency, efficiency.map_or("-".into(), significant)),
        GOALS[1].judge(ours.zip(theirs).map(|(f, t)| f / t), step),
    ]
}

/// The table's cells for one row, PyTorch's beside it.
pub(super) fn cells(ours: &Row, theirs: Option<&Row>, batch: usize) -> Vec<String> {
    let ms = |v: Option<f64>| v.map_or("-".into(), |ms| format!("{} ms", significant(ms)));
    let rate = |v: Option<f64>| v.map_or("-".into(), significant);
    let (f, t) = (ours.median_ms(), theirs.and_then(Row::median_ms));
    vec![
        ours.id.to_string(),
        ours.replicas.to_string(),
        ms(f),
        rate(ours.samples_per_s(batch)),
        ms(t),
        rate(theirs.and_then(|r| r.samples_per_s(batch))),
        match (f, t) {
            (Some(f), Some(t)) => format_ratio(f, t),
            _ => "-".into(),
        },
        match ours.buckets {
            Some((all, early)) => format!("{all} ({early})"),
            None => "-".into(),
        },
        match ours.max_weight_diff {
            Some(0.0) => "yes".into(),
            Some(d) => format!("NO (max diff {d:e})"),
            None => "-".into(),
        },
    ]
}

pub(super) fn row_json(row: &Row, batch: usize) -> Value {
    json!({
        "id": row.id,
        "replicas": row.replicas,
        "step_ms": row.steps.samples_ms,
        "median_ms": row.median_ms(),
        "samples_per_s": row.samples_per_s(batch),
        "final_loss": row.final_loss,
        "max_weight_diff": row.max_weight_diff,
        "buckets": row.buckets.map(|b| b.0),
        "buckets_started_in_backward": row.buckets.map(|b| b.1),
        "replicas_equal": row.max_weight_diff.map(|d| d == 0.0),
        "error": row.steps.error,
    })
}

pub(super) fn to_json(
    cfg: &Config,
    device: &str,
    ferry: &[Row],
    torch: Option<&(String, Vec<Row>)>,
    notes: &[String],
) -> Value {
    let batch = cfg.batch;
    // The goals are for GPUs; --host checks the path, not the speed.
    let judged = if cfg.host {
        Vec::new()
    } else {
        goals(ferry, torch.map(|(_, r)| r.as_slice()), batch)
    };
    RunInfo::stamp(json!({
        "bench": "ddp",
        "device": device,
        "host": cfg.host,
        "widths": cfg.widths,
        "batch_per_replica": batch,
        "steps": cfg.steps,
        "warmup": cfg.warmup,
        "bucket_bytes": cfg.bucket_bytes,
        "timing": "each step synchronized and timed alone; median over steps of the slowest replica",
        "ferry": ferry.iter().map(|r| row_json(r, batch)).collect::<Vec<_>>(),
        "ferry_scaling_efficiency": scaling_efficiency(ferry, batch),
        "pytorch": torch.map(|(label, rows)| json!({
            "version": label,
            "rows": rows.iter().map(|r| row_json(r, batch)).collect::<Vec<_>>(),
            "scaling_efficiency": scaling_efficiency(rows, batch),
        })),
        "goals": goals_json(&judged),
        "notes": notes,
    }))
}

pub(super) fn print_results(cfg: &Config, ferry: &[Row], torch: Option<&(String, Vec<Row>)>) {
    let batch = cfg.batch;
    let torch_rows = torch.map(|(_, rows)| rows.as_slice());
    let header = [
        "row",
        "replicas",
        "ferry step",
        "samples/s",
        "PyTorch step",
        "samples/s",
        "ferry/PyTorch",
        "buckets (in backward)",
        "replicas equal",
    ];
    let rows: Vec<Vec<String>> = ferry
        .iter()
        .map(|r| cells(r, torch_rows.and_then(|t| find(t, r.id)), batch))
        .collect();
    print_table(&header, &rows);
    println!(
        "medians over {} steps after {} warm-up steps, each step synchronized and timed alone, \
         the slowest replica's time per step; batch {batch} per replica; ratio below 1: ferry \
         faster; buckets: all-reduced in the last step (started by backward itself)",
        cfg.steps, cfg.warmup
    );
    if let Some(e) = torch_rows.and_then(|rows| scaling_efficiency(rows, batch)) {
        println!("PyTorch DDP scaling efficiency: {}", significant(e));
    }
    if cfg.host {
        println!("goals: judged on GPUs only (--host checks the data-parallel path, not speed)");
    }
    let judged = if cfg.host {
        Vec::new()
    } else {
        goals(ferry, torch_rows, batch)
    };
    print_goals(&judged);
    let sides = [("ferry", Some(ferry)), ("PyTorch", torch_rows)];
    for (side, rows) in sides {
        for row in rows.unwrap_or_default() {
            if let Some(err) = &row.steps.error {
                println!("{} ({side}): {err}", row.id);
            }
        }
    }
}
