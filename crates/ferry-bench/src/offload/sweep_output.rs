//! What `ferry bench offload --sweep` prints and writes: the header, the two tables, each
//! case's offload counters and the goals' tally, and the JSON with every sample.

use ferry::autograd::OffloadStats;
use serde_json::{Value, json};

use super::goals::{Link, PEAK_GOAL, STEP_GOAL, verdict};
use super::grid::SweepOptions;
use super::sweep_case::{CaseRun, LinkRun, Row, RowKind, Summary};
use crate::RunInfo;
use crate::harness::report::{print_table, significant};

fn gib(bytes: u64) -> String {
    significant(bytes as f64 / (1u64 << 30) as f64)
}

fn cell<T>(value: Option<T>, show: impl Fn(T) -> String) -> String {
    value.map_or("-".into(), show)
}

pub fn print_header(device: &str, link: &LinkRun, pinned_budget: u64, options: &SweepOptions) {
    println!(
        "ferry bench offload --sweep on {device}: f32; a step = forward, loss, backward \
         (gradients cleared before it); min_bytes {}",
        options.min_bytes
    );
    let speed = link.speed();
    println!(
        "link ({} GiB, ferry's copy on a copy stream, median of {}): D2H {} GB/s, H2D {} GB/s, \
         both at once {} GB/s (the two directions' sum); pinned budget {} GiB",
        link.bytes >> 30,
        options.samples,
        cell(speed, |l| significant(l.d2h_gb_s())),
        cell(speed, |l| significant(l.h2d_gb_s())),
        cell(link.both_gb_s(), significant),
        gib(pinned_budget),
    );
    println!(
        "each case: 4 rows (no offload; the same split by a sync after the forward; offload; \
         offload split), each from an empty device cache: {} warm-up + {} timed steps, medians",
        options.warmup, options.samples
    );
}

/// Both tables, each case's offload counters, errors and the goals' tally.
pub fn print_results(runs: &[CaseRun], link: Option<Link>) {
    let summaries: Vec<Summary> = runs.iter().map(|r| Summary::of(r, link)).collect();
    let ms = |v: Option<f64>| cell(v, significant);
    let time: Vec<Vec<String>> = runs
        .iter()
        .zip(&summaries)
        .map(|(r, s)| {
            vec![
                r.case.to_string(),
                ms(s.step_ms),
                ms(s.forward_ms),
                ms(s.backward_ms),
                cell(s.moved_bytes, gib),
                ms(s.bound.map(|b| b.out_ms)),
                ms(s.bound.map(|b| b.back_ms)),
                ms(s.bound.map(|b| b.ms)),
                ms(s.offload_ms),
                cell(s.step_over_bound, |x| format!("{}x", significant(x))),
                ms(s.offload_forward_ms),
                ms(s.offload_backward_ms),
                verdict(s.step_met).into(),
            ]
        })
        .collect();
    println!();
    println!(
        "time, ms: bound = max(fwd, out) + max(bwd, back), out/back = moved bytes over D2H/H2D; \
         fwd, bwd from the split row without offload"
    );
    print_table(
        &[
            "case",
            "step",
            "fwd",
            "bwd",
            "moved GiB",
            "out",
            "back",
            "bound",
            "offload",
            "/bound",
            "off fwd",
            "off bwd",
            "<=1.15x",
        ],
        &time,
    );
    let memory: Vec<Vec<String>> = runs
        .iter()
        .zip(&summaries)
        .map(|(r, s)| {
            let peaks = |kind: RowKind| match r.row(kind).phase_peaks() {
                Some((f, b)) => (gib(f), gib(b)),
                None => ("-".into(), "-".into()),
            };
            let ((nf, nb), (of, ob)) = (peaks(RowKind::NoOffload), peaks(RowKind::Offload));
            let reserved = |kind: RowKind| cell(r.row(kind).reserved_growth_bytes, gib);
            vec![
                r.case.to_string(),
                cell(s.activation_bytes, gib),
                cell(s.peak_without, gib),
                nf,
                nb,
                cell(s.peak_with, gib),
                of,
                ob,
                cell(s.reduction, |x| format!("{}%", significant(100.0 * x))),
                verdict(s.peak_met).into(),
                reserved(RowKind::NoOffload),
                reserved(RowKind::Offload),
            ]
        })
        .collect();
    println!();
    println!(
        "memory, GiB: act = saved activations (moved, read in place or over the pinned budget); \
         peaks allocated over the step's start (max of the samples; fwd / bwd: in each phase); -% = (peak - peak with \
         offload) / act; reserved = growth of the device's reserved memory over the row"
    );
    print_table(
        &[
            "case", "act", "peak", "fwd", "bwd", "offload", "fwd", "bwd", "-% act", ">=60%",
            "reserved", "offload",
        ],
        &memory,
    );
    println!();
    for r in runs {
        if let Some(s) = r.row(RowKind::Offload).stats {
            println!(
                "{}: moved {} buffers ({} GiB), {} read in place ({} GiB), {} shared, {} kept \
                 as the caller's, {} small, {} over the pinned budget ({} GiB), {} on error; \
                 prefetched {}, on demand {}",
                r.case,
                s.offloaded,
                gib(s.offloaded_bytes),
                s.read_in_place,
                gib(s.read_in_place_bytes),
                s.shared,
                s.kept_not_activation,
                s.kept_small,
                s.kept_over_budget,
                gib(s.kept_over_budget_bytes),
                s.kept_on_error,
                s.prefetched,
                s.fetched_on_demand,
            );
        }
        if let Some(e) = &r.error {
            println!("{}: {e}", r.case);
        }
        for kind in RowKind::ALL {
            if let Some(e) = r.row(kind).error() {
                println!("{} {}: {e}", r.case, kind.id());
            }
        }
    }
    let tally = |met: fn(&Summary) -> Option<bool>| {
        let judged: Vec<bool> = summaries.iter().filter_map(met).collect();
        let passed = judged.iter().filter(|&&m| m).count();
        format!("{passed} of {} judged", judged.len())
    };
    println!(
        "goals: step <= {}x its bound in {}; peak lower by >= {}% of the saved activations in \
         {} ({} cases)",
        STEP_GOAL.bound.value(),
        tally(|s| s.step_met),
        100.0 * PEAK_GOAL.bound.value(),
        tally(|s| s.peak_met),
        runs.len(),
    );
}

/// The offload scope's counters, as both `ferry bench offload` and its sweep record them.
pub fn stats_json(s: &OffloadStats) -> Value {
    json!({
        "offloaded": s.offloaded,
        "offloaded_bytes": s.offloaded_bytes,
        "read_in_place": s.read_in_place,
        "read_in_place_bytes": s.read_in_place_bytes,
        "shared": s.shared,
        "kept_small": s.kept_small,
        "kept_not_activation": s.kept_not_activation,
        "kept_over_budget": s.kept_over_budget,
        "kept_over_budget_bytes": s.kept_over_budget_bytes,
        "kept_on_error": s.kept_on_error,
        "prefetched": s.prefetched,
        "fetched_on_demand": s.fetched_on_demand,
    })
}

fn row_json(row: &Row) -> Value {
    json!({
        "step_ms": row.step.samples_ms,
        "step_ms_median": row.step.complete_median(),
        "forward_ms": row.forward.samples_ms,
        "backward_ms": row.backward.samples_ms,
        "peak_forward_bytes": row.peak_forward,
        "peak_backward_bytes": row.peak_backward,
        "saved_bytes": row.saved_bytes,
        "reserved_growth_bytes": row.reserved_growth_bytes,
        "offload": row.stats.as_ref().map(stats_json),
        "error": row.error(),
    })
}

fn case_json(run: &CaseRun, link: Option<Link>) -> Value {
    let s = Summary::of(run, link);
    let rows: serde_json::Map<String, Value> = RowKind::ALL
        .iter()
        .map(|&k| (k.id().to_string(), row_json(run.row(k))))
        .collect();
    json!({
        "case": run.case.to_string(),
        "heads": run.case.heads(),
        "mlp_activation_bytes": run.case.mlp_activation_bytes(),
        "caller_bytes": run.caller_bytes,
        "saved_bytes_less_caller": run.row(RowKind::NoOffload).saved_bytes
            .map(|s| s.saturating_sub(run.caller_bytes)),
        "error": run.error,
        "rows": rows,
        "summary": {
            "step_ms": s.step_ms,
            "forward_ms": s.forward_ms,
            "backward_ms": s.backward_ms,
            "offload_step_ms": s.offload_ms,
            "offload_forward_ms": s.offload_forward_ms,
            "offload_backward_ms": s.offload_backward_ms,
            "moved_bytes": s.moved_bytes,
            "bound_out_ms": s.bound.map(|b| b.out_ms),
            "bound_back_ms": s.bound.map(|b| b.back_ms),
            "bound_ms": s.bound.map(|b| b.ms),
            "link_bound": s.bound.zip(s.forward_ms.zip(s.backward_ms))
                .map(|(b, (f, bw))| b.link_bound(f, bw)),
            "step_over_bound": s.step_over_bound,
            "activation_bytes": s.activation_bytes,
            "peak_no_offload_bytes": s.peak_without,
            "peak_offload_bytes": s.peak_with,
            "peak_reduction_of_activations": s.reduction,
            "step_goal_met": s.step_met,
            "peak_goal_met": s.peak_met,
        },
    })
}

/// Every number of the run, all samples included.
pub fn json(
    device: &str,
    pinned_budget: u64,
    options: &SweepOptions,
    link: &LinkRun,
    runs: &[CaseRun],
) -> Value {
    let speed = link.speed();
    RunInfo::stamp(json!({
        "bench": "offload --sweep",
        "device": device,
        "pinned_budget_bytes": pinned_budget,
        "samples": options.samples,
        "warmup": options.warmup,
        "min_bytes": options.min_bytes,
        "goals": {
            "max_step_over_bound": STEP_GOAL.bound.value(),
            "min_peak_reduction_of_activations": PEAK_GOAL.bound.value(),
        },
        "link": {
            "bytes": link.bytes,
            "d2h_ms": link.d2h.samples_ms,
            "h2d_ms": link.h2d.samples_ms,
            "both_ms": link.both.samples_ms,
            "d2h_gb_s": speed.map(Link::d2h_gb_s),
            "h2d_gb_s": speed.map(Link::h2d_gb_s),
            "both_gb_s": link.both_gb_s(),
            "error": link.d2h.error.as_ref().or(link.h2d.error.as_ref()),
        },
        "cases": runs.iter().map(|r| case_json(r, speed)).collect::<Vec<_>>(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::offload::grid::SweepCase;
    use crate::offload::sweep_case::Sample;

    #[test]
    fn a_failed_row_keeps_its_samples_beside_its_error_in_the_json() {
        let mut run = CaseRun::new(SweepCase::Mlp {
            layers: 2,
            width: 64,
            batch: 8,
        });
        for kind in RowKind::ALL {
            for ms in [3.0, 1.0] {
                run.row_mut(kind).push(Sample {
                    ms,
                    forward_ms: kind.split().then_some(ms / 3.0),
                    backward_ms: kind.split().then_some(2.0 * ms / 3.0),
                    peak_forward: 100,
                    peak_backward: 200,
                    saved_bytes: 300,
                    stats: kind.offloads().then(OffloadStats::default),
                });
            }
        }
        run.row_mut(RowKind::Offload)
            .fail("CUDA out of memory".into());
        let link = Link {
            d2h_bytes_per_ms: 1.0,
            h2d_bytes_per_ms: 1.0,
        };
        let doc = case_json(&run, Some(link));
        assert_eq!(doc["case"], "2x64@8");
        let offload = &doc["rows"]["offload"];
        assert_eq!(offload["error"], "CUDA out of memory");
        assert_eq!(offload["step_ms"], json!([3.0, 1.0]));
        assert_eq!(offload["step_ms_median"], Value::Null);
        assert_eq!(
            doc["rows"]["no_offload_split"]["forward_ms"],
            json!([1.0, 1.0 / 3.0])
        );
        assert_eq!(doc["summary"]["step_ms"], 2.0);
        assert_eq!(doc["summary"]["step_goal_met"], Value::Null);
        assert_eq!(doc["summary"]["peak_no_offload_bytes"], 200);
    }
}
