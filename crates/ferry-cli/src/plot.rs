//! Training curves to a PNG, with plotters' bitmap backend.
//!
//! Key decision: the picture carries no text. Text would need a font, and plotters finds fonts
//! through the system (fontconfig) or needs one embedded; a headless CI machine has neither.
//! Instead the layout is fixed and documented: left panel the training loss (from 0 at the
//! bottom), right panel accuracy (train blue, test red) with faint lines at 0.80, 0.85, 0.90,
//! 0.95 and 1.00.

use std::error::Error;
use std::path::Path;

use plotters::prelude::*;

use crate::train::EpochStats;

const GRID: RGBColor = RGBColor(225, 225, 225);
const TRAIN: RGBColor = RGBColor(31, 119, 180);
const TEST: RGBColor = RGBColor(214, 39, 40);

/// Draws the loss and accuracy curves of `history` to `path` (PNG, 960x400).
pub fn curves(path: &Path, history: &[EpochStats]) -> Result<(), Box<dyn Error>> {
    let root = BitMapBackend::new(path, (960, 400)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(480);
    let epochs = history.len().max(2) as f64;
    let x = |i: usize| (i + 1) as f64;

    let max_loss = history.iter().map(|s| s.loss).fold(0.0, f64::max).max(1e-6) * 1.05;
    let mut loss = ChartBuilder::on(&left)
        .margin(20)
        .build_cartesian_2d(1.0..epochs, 0.0..max_loss)?;
    frame(&mut loss, epochs, &[])?;
    loss.draw_series(LineSeries::new(
        history.iter().enumerate().map(|(i, s)| (x(i), s.loss)),
        TRAIN.stroke_width(2),
    ))?;

    let lowest = history
        .iter()
        .flat_map(|s| [s.train_accuracy, s.test_accuracy])
        .fold(1.0, f64::min);
    let floor = (lowest - 0.02).clamp(0.0, 0.8);
    let mut acc = ChartBuilder::on(&right)
        .margin(20)
        .build_cartesian_2d(1.0..epochs, floor..1.0)?;
    frame(&mut acc, epochs, &[0.8, 0.85, 0.9, 0.95, 1.0])?;
    for (color, pick) in [
        (
            TRAIN,
            (|s: &EpochStats| s.train_accuracy) as fn(&EpochStats) -> f64,
        ),
        (TEST, |s: &EpochStats| s.test_accuracy),
    ] {
        acc.draw_series(LineSeries::new(
            history.iter().enumerate().map(|(i, s)| (x(i), pick(s))),
            color.stroke_width(2),
        ))?;
    }
    root.present()?;
    Ok(())
}

type Chart<'a, 'b> = ChartContext<
    'a,
    BitMapBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// A box around the plot and faint horizontal lines at `levels`.
fn frame(chart: &mut Chart<'_, '_>, epochs: f64, levels: &[f64]) -> Result<(), Box<dyn Error>> {
    let y = chart.y_range();
    for &level in levels.iter().filter(|l| y.contains(l)) {
        chart.draw_series(LineSeries::new([(1.0, level), (epochs, level)], GRID))?;
    }
    chart.draw_series([Rectangle::new(
        [(1.0, y.start), (epochs, y.end)],
        BLACK.stroke_width(1),
    )])?;
    Ok(())
}
