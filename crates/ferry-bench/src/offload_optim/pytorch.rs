//! PyTorch's rows of `ferry bench offload-optim --compare-pytorch` (python/offload_optim.py):
//! the same GPT at the same batch with torch's fused AdamW on the GPU, the simple offload, and
//! torchao's CPUOffloadOptimizer, each against torch's own all-GPU step, beside ferry's.

use serde_json::Value;

use super::{OffloadOptimArgs, gib_text};
use crate::harness::measure::Measured;
use crate::harness::pytorch;
use crate::harness::report::{print_table, significant};

/// Runs the script: its JSON document, or why there is none.
pub(super) fn run(args: &OffloadOptimArgs) -> Result<Value, String> {
    eprintln!("running {}/offload_optim.py ...", pytorch::SCRIPT_DIR);
    let script =
        pytorch::locate_script(args.pytorch.pytorch_script.as_deref(), "offload_optim.py")?;
    let flags = [
        ("--layers", args.layers.to_string()),
        ("--width", args.width.to_string()),
        ("--batch", args.batch.to_string()),
        ("--seq", args.seq.to_string()),
        ("--samples", args.samples.to_string()),
        ("--warmup", args.warmup.to_string()),
    ];
    let argv: Vec<String> = flags
        .into_iter()
        .flat_map(|(flag, value)| [flag.to_string(), value])
        .collect();
    pytorch::run_once(&args.pytorch.python, &script, &argv, &[])
}

/// A row's median step in ms, when it ran.
fn median_ms(row: &Value) -> Option<f64> {
    let samples: Vec<f64> = row
        .get("ms")?
        .as_array()?
        .iter()
        .filter_map(Value::as_f64)
        .collect();
    Measured::from_samples(samples).median()
}

/// The rows as a table, each against torch's AdamW on the GPU, then ferry's offloaded step
/// (`ferry_ms`, with its share of ferry's all-GPU step) against PyTorch's fastest offload.
pub(super) fn print(doc: &Value, ferry_ms: Option<(f64, f64)>) {
    let rows = doc
        .get("rows")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let name = |row: &Value| {
        row.get("name")
            .and_then(Value::as_str)
            .unwrap_or("?")
            .to_string()
    };
    let base = rows.first().and_then(median_ms);
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|row| match median_ms(row) {
            Some(ms) => vec![
                name(row),
                format!("{} ms", significant(ms)),
                base.map_or("-".into(), |b| format!("{}%", significant(100.0 * b / ms))),
                base.map_or("-".into(), |b| format!("{} ms", significant(ms - b))),
                row.get("peak_bytes")
                    .and_then(Value::as_u64)
                    .map_or("-".into(), |b| gib_text(b as usize)),
            ],
            None => vec![
                name(row),
                row.get("error")
                    .and_then(Value::as_str)
                    .unwrap_or("no samples")
                    .to_string(),
                "-".into(),
                "-".into(),
                "-".into(),
            ],
        })
        .collect();
    println!(
        "PyTorch {}, the same GPT (tests/torch/gpt.py) at the same batch:",
        doc.get("torch").and_then(Value::as_str).unwrap_or("?")
    );
    print_table(
        &[
            "run",
            "step",
            "of torch's AdamW on the GPU (throughput)",
            "added to its step",
            "device peak",
        ],
        &table,
    );
    if let Some(note) = doc.get("note").and_then(Value::as_str) {
        println!("{note}");
    }
    let fastest = rows
        .iter()
        .skip(1)
        .filter_map(|row| Some((name(row), median_ms(row)?)))
        .min_by(|a, b| a.1.total_cmp(&b.1));
    if let (Some((gpu, off)), Some((torch_name, torch_ms)), Some(base)) = (ferry_ms, fastest, base)
    {
        // The two runtimes' all-GPU steps differ (their kernels), so the offloads compare by
        // what each adds to its own step, and by the share of its own throughput it keeps.
        println!(
            "ferry's offload keeps {}% of ferry's all-GPU throughput and adds {} ms to its step; \
             PyTorch's fastest offload ({torch_name}) keeps {}% of torch's and adds {} ms; the \
             all-GPU steps: ferry {} ms, torch {} ms",
            significant(100.0 * gpu / off),
            significant(off - gpu),
            significant(100.0 * base / torch_ms),
            significant(torch_ms - base),
            significant(gpu),
            significant(base)
        );
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn a_row_without_samples_has_no_median() {
        assert_eq!(
            super::median_ms(&json!({ "ms": [3.0, 1.0, 2.0] })),
            Some(2.0)
        );
        assert_eq!(
            super::median_ms(&json!({ "error": "out of GPU memory" })),
            None
        );
        assert_eq!(super::median_ms(&json!({ "ms": [] })), None);
        // A document missing what it should hold prints its rows as far as they go.
        super::print(&json!({ "rows": [{ "ms": "?" }] }), Some((1.0, 2.0)));
    }
}
