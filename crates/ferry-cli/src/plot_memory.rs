//! `ferry plot memory FILE`: the memory plan's curves, peak memory against step time, one
//! picture per model (PNG and SVG), from the JSON that `ferry bench memory --json` or `python
//! -m ferry.bench --memory --json` wrote. The plan's points are joined from the highest peak
//! down; the rivals (no plan, recomputation, offload, torch's checkpointing, selective or not,
//! and save_on_cpu) are markers. Drawn with the same embedded font as the training curves, so
//! any machine draws them (no matplotlib, no system fonts).

use std::error::Error;
use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use plotters::coord::Shift;
use plotters::prelude::*;
use serde_json::Value;

use crate::plot::{GRID, font};

const SIZE: (u32, u32) = (900, 560);
const GIB: f64 = (1u64 << 30) as f64;
const PLAN: RGBColor = RGBColor(31, 119, 180);

#[derive(Args, Debug)]
pub struct PlotArgs {
    #[command(subcommand)]
    what: PlotCommand,
}

#[derive(Subcommand, Debug)]
enum PlotCommand {
    /// The memory plan's curves from a `ferry bench memory --json` or `python -m ferry.bench
    /// --memory --json` file: `memory-<model>.png` and `.svg` per model.
    Memory {
        /// The benchmark's JSON file.
        json: PathBuf,
        /// Where the pictures go.
        #[arg(long, default_value = "docs/img")]
        out: PathBuf,
    },
}

pub fn run(args: PlotArgs) -> Result<(), Box<dyn Error>> {
    match args.what {
        PlotCommand::Memory { json, out } => {
            let text =
                std::fs::read_to_string(&json).map_err(|e| format!("{}: {e}", json.display()))?;
            let doc: Value = serde_json::from_str(&text)
                .map_err(|e| format!("{}: not JSON ({e})", json.display()))?;
            let curves = memory_curves(&doc).ok_or_else(|| {
                format!(
                    "{}: neither `ferry bench memory --json` (\"cases\") nor `python -m \
                     ferry.bench --memory --json` (\"models\") output",
                    json.display()
                )
            })?;
            std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
            for curve in &curves {
                let png = draw_memory(&out, curve)?;
                println!("{}: {}", curve.name, png.display());
            }
            Ok(())
        }
    }
}

/// One model's measured points.
#[derive(Debug, Clone, PartialEq)]
struct Curve {
    name: String,
    points: Vec<Point>,
}

#[derive(Debug, Clone, PartialEq)]
struct Point {
    label: String,
    plan: bool,
    /// Median step, ms.
    ms: f64,
    /// Peak memory above the model, GiB.
    peak_gib: f64,
    /// A plan point whose target was out of reach (drawn hollow).
    reachable: bool,
}

/// The curves of either benchmark's JSON; `None` when it is neither's. Points without a
/// measured step (out of memory) are left out, as are models without any.
fn memory_curves(doc: &Value) -> Option<Vec<Curve>> {
    let curves: Vec<Curve> = if let Some(cases) = doc.get("cases").and_then(Value::as_array) {
        // ferry bench memory: {"cases": [{"case", "points": [{"way", "median_ms", "peak_bytes"}]}]}
        cases
            .iter()
            .map(|case| Curve {
                name: text(&case["case"]),
                points: case["points"]
                    .as_array()
                    .map_or(&[][..], Vec::as_slice)
                    .iter()
                    .filter_map(|p| {
                        let label = text(&p["way"]);
                        Some(Point {
                            plan: label.starts_with("plan"),
                            ms: p["median_ms"].as_f64()?,
                            peak_gib: p["peak_bytes"].as_f64()? / GIB,
                            reachable: true,
                            label,
                        })
                    })
                    .collect(),
            })
            .collect()
    } else {
        // python -m ferry.bench --memory: {"models": {name: {"rows": {label: {"status", "kind",
        // "ms": [...], "peak_bytes": [...], "reachable"}}}}}
        let models = doc.get("models")?.as_object()?;
        models
            .iter()
            .map(|(name, result)| Curve {
                name: name.clone(),
                points: result["rows"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .filter(|(_, run)| run["status"] == "ok")
                    .filter_map(|(label, run)| {
                        let ms = median(&numbers(&run["ms"]))?;
                        let peak = numbers(&run["peak_bytes"]).into_iter().reduce(f64::max)?;
                        Some(Point {
                            label: label.clone(),
                            plan: run["kind"] == "plan",
                            ms,
                            peak_gib: peak / GIB,
                            reachable: run["reachable"].as_bool().unwrap_or(true),
                        })
                    })
                    .collect(),
            })
            .collect()
    };
    Some(
        curves
            .into_iter()
            .filter(|c| !c.points.is_empty())
            .collect(),
    )
}

fn text(v: &Value) -> String {
    v.as_str().unwrap_or("?").to_string()
}

fn numbers(v: &Value) -> Vec<f64> {
    v.as_array()
        .map_or(&[][..], Vec::as_slice)
        .iter()
        .filter_map(Value::as_f64)
        .collect()
}

fn median(values: &[f64]) -> Option<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(sorted[n / 2]),
        _ => Some((sorted[n / 2 - 1] + sorted[n / 2]) / 2.0),
    }
}

/// The rivals' colours by what their label names.
fn rival_color(label: &str) -> RGBColor {
    let label = label.to_lowercase();
    if label == "no plan" {
        BLACK
    } else if label.contains("selective") {
        RGBColor(148, 103, 189)
    } else if label.contains("recompute") || label.contains("checkpoint") {
        RGBColor(214, 39, 40)
    } else if label.contains("save_on_cpu") {
        RGBColor(44, 160, 44)
    } else if label.contains("offload") {
        RGBColor(255, 127, 14)
    } else {
        RGBColor(127, 127, 127)
    }
}

/// `out/memory-<name>.png` and the same as SVG; the PNG's path.
fn draw_memory(out: &Path, curve: &Curve) -> Result<PathBuf, Box<dyn Error>> {
    font()?;
    let png = out.join(format!("memory-{}.png", curve.name));
    draw(BitMapBackend::new(&png, SIZE).into_drawing_area(), curve)?;
    draw(
        SVGBackend::new(&png.with_extension("svg"), SIZE).into_drawing_area(),
        curve,
    )?;
    Ok(png)
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    curve: &Curve,
) -> Result<(), Box<dyn Error>>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let label_font = ("sans-serif", 15).into_font();
    let (ms_max, gib_max) = curve.points.iter().fold((0.0f64, 0.0f64), |(m, g), p| {
        (m.max(p.ms), g.max(p.peak_gib))
    });
    let ms_min = curve
        .points
        .iter()
        .map(|p| p.ms)
        .fold(f64::INFINITY, f64::min);
    let span = (ms_max - ms_min).max(1e-3);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("{}: peak memory against step time", curve.name),
            ("sans-serif", 20).into_font(),
        )
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(
            (ms_min - 0.08 * span).max(0.0)..ms_max + 0.08 * span,
            0.0..gib_max.max(1e-3) * 1.1,
        )?;
    chart
        .configure_mesh()
        .bold_line_style(GRID)
        .light_line_style(WHITE)
        .x_desc("step ms (median)")
        .y_desc("peak GiB above the model")
        .axis_desc_style(label_font.clone())
        .label_style(label_font.clone())
        .y_label_formatter(&|v| format!("{v:.1}"))
        .draw()?;
    let mut plans: Vec<&Point> = curve.points.iter().filter(|p| p.plan).collect();
    plans.sort_by(|a, b| {
        b.peak_gib
            .total_cmp(&a.peak_gib)
            .then(a.ms.total_cmp(&b.ms))
    });
    if !plans.is_empty() {
        chart
            .draw_series(LineSeries::new(
                plans.iter().map(|p| (p.ms, p.peak_gib)),
                PLAN.stroke_width(2),
            ))?
            .label("the plan, at its targets")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], PLAN.stroke_width(2)));
        chart.draw_series(plans.iter().map(|p| {
            let style = if p.reachable {
                PLAN.filled()
            } else {
                PLAN.stroke_width(2)
            };
            Circle::new((p.ms, p.peak_gib), 5, style)
        }))?;
    }
    for p in curve.points.iter().filter(|p| !p.plan) {
        let color = rival_color(&p.label);
        chart
            .draw_series(std::iter::once(TriangleMarker::new(
                (p.ms, p.peak_gib),
                8,
                color.filled(),
            )))?
            .label(p.label.clone())
            .legend(move |(x, y)| TriangleMarker::new((x + 10, y), 6, color.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font(label_font)
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn rust_doc() -> Value {
        json!({"cases": [{"case": "gpt2_small", "points": [
            {"way": "no plan", "median_ms": 100.0, "peak_bytes": 8.0 * GIB},
            {"way": "recompute every block", "median_ms": 125.0, "peak_bytes": 2.0 * GIB},
            {"way": "offload every block", "median_ms": 160.0, "peak_bytes": 3.0 * GIB},
            {"way": "plan at 90%", "median_ms": 101.0, "peak_bytes": 7.0 * GIB},
            {"way": "plan at full recomputation's bytes", "median_ms": 110.0, "peak_bytes": 2.0 * GIB},
            {"way": "plan at 10%", "median_ms": null, "peak_bytes": 1.0 * GIB},
        ]}]})
    }

    fn python_doc() -> Value {
        json!({"models": {
            "nanogpt": {"rows": {
                "no plan": {"status": "ok", "kind": "plain", "ms": [230.0, 240.0, 235.0],
                            "peak_bytes": [16.0 * GIB, 16.5 * GIB]},
                "torch checkpoint, every block": {"status": "ok", "kind": "rival",
                            "ms": [275.0], "peak_bytes": [7.4 * GIB]},
                "plan at 4.00 GiB": {"status": "ok", "kind": "plan", "ms": [300.0, 280.0],
                            "peak_bytes": [7.0 * GIB], "reachable": false},
                "save_on_cpu": {"status": "oom", "kind": "rival", "ms": [], "peak_bytes": []},
            }},
            "vit": {"note": "skipped: no timm"},
        }})
    }

    #[test]
    fn both_benchmarks_json_read_as_curves() {
        let rust = memory_curves(&rust_doc()).unwrap();
        assert_eq!(rust.len(), 1);
        let points = &rust[0].points;
        // The point without a measured step is left out.
        assert_eq!(points.len(), 5);
        assert_eq!(points.iter().filter(|p| p.plan).count(), 2);
        assert_eq!((points[1].ms, points[1].peak_gib), (125.0, 2.0));
        let python = memory_curves(&python_doc()).unwrap();
        // The skipped model has no points; the out-of-memory row is left out.
        assert_eq!(python.len(), 1);
        let points = &python[0].points;
        assert_eq!(points.len(), 3);
        let plain = points.iter().find(|p| p.label == "no plan").unwrap();
        assert_eq!((plain.ms, plain.peak_gib), (235.0, 16.5));
        let plan = points.iter().find(|p| p.plan).unwrap();
        assert_eq!((plan.ms, plan.reachable), (290.0, false));
        assert!(memory_curves(&json!({"rows": []})).is_none());
    }

    #[test]
    fn a_curve_is_drawn_as_png_and_svg_with_its_labels() {
        let dir = tempfile::tempdir().unwrap();
        let curve = &memory_curves(&rust_doc()).unwrap()[0];
        let png = draw_memory(dir.path(), curve).unwrap();
        assert_eq!(png, dir.path().join("memory-gpt2_small.png"));
        assert_eq!(&std::fs::read(&png).unwrap()[..8], b"\x89PNG\r\n\x1a\n");
        let svg = std::fs::read_to_string(png.with_extension("svg")).unwrap();
        for text in [
            "gpt2_small",
            "step ms",
            "peak GiB",
            "the plan, at its targets",
            "recompute every block",
            "offload every block",
        ] {
            assert!(svg.contains(text), "the SVG has no {text:?}");
        }
    }

    #[test]
    fn a_file_of_neither_benchmark_is_an_error_naming_both() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.json");
        std::fs::write(&path, "{\"saves\": []}").unwrap();
        let args = PlotArgs {
            what: PlotCommand::Memory {
                json: path,
                out: dir.path().join("img"),
            },
        };
        let err = run(args).unwrap_err().to_string();
        assert!(
            err.contains("ferry bench memory") && err.contains("--memory"),
            "{err}"
        );
    }
}
