//! `ferry bench autograd --json`: every row as one JSON object, both sides with every round,
//! units, the goal and whether it was met.

use serde_json::{Value, json};

use crate::RunInfo;

use super::autograd_chains::{ChainBytes, SIDE};
use super::autograd_output::{
    OVERHEAD_GOAL_US, Reading, Report, SCALING_GOAL_UP_TO, efficiencies, scaling_goal,
    scaling_verdict,
};
use crate::harness::measure::median;
use crate::harness::report::Verdict;

fn side_json<T>(reading: &Reading<T>, value: impl Fn(&T) -> Value) -> Value {
    match reading {
        Reading::Got(v) => value(v),
        Reading::Failed(err) => json!({ "error": err }),
        Reading::Skipped => json!({ "skipped": true }),
    }
}

fn verdict_json(v: Verdict) -> Value {
    v.as_bool().map_or(Value::Null, Value::Bool)
}

fn rounds_json(samples: &Vec<f64>, unit: &str) -> Value {
    json!({ "median": median(samples), "rounds": samples, "unit": unit })
}

/// Every row as one JSON object with a `section`, both sides, units, the goal and whether it
/// was met (null where it cannot be judged).
pub fn rows_json(report: &Report) -> Vec<Value> {
    let mut rows = Vec::new();
    for r in &report.memory {
        let expected = (r.chain.expected)(SIDE);
        let bytes = |b: &ChainBytes| {
            json!({
                "retained_bytes": b.retained,
                "backward_peak_bytes": b.backward_peak,
                "after_drop_bytes": b.after_drop,
                "saved_bytes": b.saved,
            })
        };
        rows.push(json!({
            "section": "memory",
            "id": r.chain.id,
            "forward": r.chain.forward,
            "unit": "bytes",
            "expected_bytes": expected,
            "ferry": side_json(&r.ferry, bytes),
            "pytorch": side_json(&r.pytorch, bytes),
            "ratio": r.ferry.get().zip(r.pytorch.get())
                .map(|(f, p)| f.retained as f64 / p.retained as f64),
            "goal": "retained_bytes <= PyTorch's",
            "met": verdict_json(r.verdict()),
        }));
        rows.push(json!({
            "section": "backward_peak",
            "id": r.chain.id,
            "unit": "bytes",
            "ferry": side_json(&r.ferry, |b| json!({ "backward_peak_bytes": b.backward_peak })),
            "pytorch": side_json(&r.pytorch, |b| json!({ "backward_peak_bytes": b.backward_peak })),
            "ratio": r.ferry.get().zip(r.pytorch.get())
                .map(|(f, p)| f.backward_peak as f64 / p.backward_peak as f64),
            "goal": Value::Null,
            "met": Value::Null,
        }));
    }
    let ferry_eff = efficiencies(&report.scaling, |r| &r.ferry);
    let torch_eff = efficiencies(&report.scaling, |r| &r.pytorch);
    for (r, (fe, te)) in report
        .scaling
        .iter()
        .zip(ferry_eff.into_iter().zip(torch_eff))
    {
        let verdict = scaling_verdict(r.threads, fe, report.cores);
        let side = |reading: &Reading<Vec<f64>>, eff: Option<f64>| {
            side_json(reading, |s| {
                let mut v = rounds_json(s, "steps/s");
                v["efficiency"] = json!(eff);
                v
            })
        };
        rows.push(json!({
            "section": "thread_scaling",
            "id": format!("threads_{}", r.threads),
            "threads": r.threads,
            "unit": "steps/s",
            "ferry": side(&r.ferry, fe),
            "pytorch": side(&r.pytorch, te),
            "goal": (r.threads <= SCALING_GOAL_UP_TO).then(|| scaling_goal(r.threads, report.cores)),
            "met": verdict_json(verdict),
        }));
    }
    if let Some(r) = &report.overhead {
        let us = |s: &Vec<f64>| rounds_json(s, "us/op");
        rows.push(json!({
            "section": "op_overhead",
            "id": "mul_add_relu_sum",
            "unit": "us/op",
            "ferry": side_json(&r.ferry, us),
            "pytorch": side_json(&r.pytorch_one, us),
            "pytorch_default_threads": side_json(&r.pytorch_default, |s| {
                let mut v = us(s);
                v["threads"] = json!(r.default_threads);
                v
            }),
            "ratio": r.ferry.median().zip(r.pytorch_one.median()).map(|(f, p)| f / p),
            "goal": format!("<= {OVERHEAD_GOAL_US} us/op"),
            "met": verdict_json(r.verdict()),
        }));
    }
    rows
}

pub fn to_json(report: &Report) -> Value {
    RunInfo::stamp(json!({
        "benchmark": "ferry bench autograd",
        "cuda_device": report.cuda.as_ref().ok(),
        "cuda_error": report.cuda.as_ref().err(),
        "cpu_cores": report.cores,
        "rounds": report.rounds,
        "warmup": report.warmup,
        "pytorch": report.pytorch,
        "pytorch_note": report.pytorch_note,
        "rows": rows_json(report),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autograd_output::tests::report;

    const MIB: i64 = 1 << 20;

    #[test]
    fn json_has_every_row_with_both_sides_units_goals_and_verdicts() {
        let r = report();
        let doc = to_json(&r);
        assert_eq!(doc["benchmark"], "ferry bench autograd");
        assert_eq!(doc["cuda_device"], "cuda:0 (test)");
        assert_eq!(doc["cpu_cores"], 16);
        let rows = doc["rows"].as_array().unwrap();
        // Two rows per chain (memory, backward_peak), one per thread count, one overhead row.
        assert_eq!(rows.len(), 2 * 3 + 4 + 1);
        for row in rows {
            for key in ["section", "id", "unit", "ferry", "pytorch", "goal", "met"] {
                assert!(row.get(key).is_some(), "{row} lacks {key}");
            }
        }

        let elementwise = &rows[0];
        assert_eq!(elementwise["section"], "memory");
        assert_eq!(elementwise["unit"], "bytes");
        assert_eq!(elementwise["ferry"]["retained_bytes"], 800 * MIB);
        assert_eq!(elementwise["ferry"]["saved_bytes"], 400 * MIB);
        assert_eq!(elementwise["pytorch"]["saved_bytes"], Value::Null);
        assert_eq!(elementwise["expected_bytes"], 2 * SIDE * SIDE * 4);
        assert_eq!(elementwise["met"], true);
        assert_eq!(rows[1]["section"], "backward_peak");
        assert_eq!(rows[1]["ratio"], 1.25);
        assert_eq!(rows[1]["met"], Value::Null);
        assert_eq!(rows[2]["met"], false);
        assert_eq!(rows[4]["ferry"]["error"], "out of memory");

        let four = &rows[7];
        assert_eq!(
            (four["section"].as_str(), four["threads"].as_u64()),
            (Some("thread_scaling"), Some(4))
        );
        assert_eq!(four["ferry"]["efficiency"], 0.75);
        assert_eq!(four["ferry"]["rounds"], json!([3e4, 3e4, 3e4]));
        assert_eq!(four["pytorch"]["error"], "RuntimeError: boom");
        assert_eq!(four["met"], true);
        assert_eq!(rows[9]["pytorch"]["skipped"], true);
        assert_eq!(rows[9]["goal"], Value::Null);

        let overhead = &rows[10];
        assert_eq!(overhead["section"], "op_overhead");
        assert_eq!(overhead["unit"], "us/op");
        assert_eq!(overhead["ferry"]["median"], 2.5);
        assert_eq!(overhead["pytorch"]["median"], 22.5);
        assert_eq!(overhead["pytorch_default_threads"]["error"], "killed");
        assert_eq!(overhead["met"], true);
    }
}
