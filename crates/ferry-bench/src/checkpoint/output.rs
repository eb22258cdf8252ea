//! What `ferry bench checkpoint` reports: the table and the JSON file.

use ferry::memory::cuda::CudaDevice;
use serde_json::{Value, json};

use super::{CheckpointArgs, Row};
use crate::RunInfo;
use crate::harness::report::{print_table, significant};

fn mb(bytes: Option<f64>) -> String {
    bytes.map_or("-".into(), |b| significant(b / 1e6))
}

pub(super) fn print_rows(rows: &[Row], bytes: usize, staging: usize) {
    let ferry_ms = |save: bool| rows[usize::from(!save)].median_ms();
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let ms = r.median_ms();
            vec![
                r.name.to_string(),
                ms.map_or("-".into(), significant),
                ms.map_or("-".into(), |ms| significant(bytes as f64 / ms / 1e6)),
                mb(r.most(|s| s.extra_device)),
                mb(r.most(|s| s.extra_host)),
                mb(r.most(|s| s.resident)),
                match (ferry_ms(r.save), ms) {
                    _ if r.id.starts_with("ferry") => "-".into(),
                    (Some(f), Some(p)) => significant(f / p),
                    _ => "-".into(),
                },
            ]
        })
        .collect();
    print_table(
        &[
            "case",
            "ms",
            "GB/s",
            "extra device MB",
            "extra host MB",
            "resident growth MB",
            "ferry / this",
        ],
        &table,
    );
    let bound = staging as f64;
    for r in &rows[..2] {
        let (dev, host) = (r.most(|s| s.extra_device), r.most(|s| s.extra_host));
        let verdict = match (dev, host) {
            (Some(d), Some(h)) if d <= bound && h <= bound => "met",
            (Some(_), Some(_)) => "MISSED",
            _ => "?",
        };
        println!(
            "{}: goal extra device and host memory each <= {} MB: {verdict}; measured by the pools: device allocator +{} MB, pinned pool +{} MB",
            r.name,
            significant(bound / 1e6),
            mb(r.most(|s| s.allocator)),
            mb(r.most(|s| s.pinned)),
        );
        if let Some(e) = &r.error {
            println!("  error: {e}");
        }
    }
    for r in &rows[2..] {
        if let Some(e) = &r.error {
            println!("{}: error: {e}", r.name);
        }
    }
    println!(
        "ferry's save includes fsync of the file and its directory and the rename; compare it with the `+ fsync` rows. Loads read files just written (page cache) on both sides."
    );
}

#[allow(clippy::too_many_arguments)]
pub(super) fn to_json(
    args: &CheckpointArgs,
    dev: &CudaDevice,
    rows: &[Row],
    bytes: usize,
    tensors: usize,
    staging: usize,
    pytorch: Option<String>,
    pytorch_note: Option<String>,
) -> Value {
    let rows: Vec<Value> = rows
        .iter()
        .map(|r| {
            let samples: Vec<Value> = r
                .samples
                .iter()
                .map(|s| {
                    json!({
                        "ms": s.ms,
                        "extra_device_bytes": s.extra_device,
                        "extra_host_bytes": s.extra_host,
                        "resident_growth_bytes": s.resident,
                        "device_allocator_growth_bytes": s.allocator,
                        "pinned_pool_growth_bytes": s.pinned,
                    })
                })
                .collect();
            let ms = r.median_ms();
            json!({
                "id": r.id,
                "name": r.name,
                "kind": if r.save { "save" } else { "load" },
                "samples": samples,
                "median_ms": ms,
                "gbps": ms.map(|ms| bytes as f64 / ms / 1e6),
                "max_extra_device_bytes": r.most(|s| s.extra_device),
                "max_extra_host_bytes": r.most(|s| s.extra_host),
                "max_resident_growth_bytes": r.most(|s| s.resident),
                "error": r.error,
            })
        })
        .collect();
    RunInfo::stamp(json!({
        "benchmark": "ferry bench checkpoint",
        "device": format!("{} ({})", dev.device(), dev.info().name),
        "gb": args.gb,
        "bytes": bytes,
        "tensors": tensors,
        "staging_bytes": staging,
        "samples": args.samples,
        "warmup": args.warmup,
        "pytorch": pytorch,
        "pytorch_note": pytorch_note,
        "rows": rows,
    }))
}
