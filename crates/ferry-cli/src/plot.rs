//! Training curves, as PNG and SVG: two panels (training loss; train and test accuracy) with
//! titles, axis labels, ticks and a legend.
//!
//! Text is drawn with DejaVu Sans, embedded in the binary (assets/fonts, under its permissive
//! license) and rendered by plotters' ab_glyph backend, so no system font or fontconfig is
//! needed: a headless CI machine draws the same picture as a desktop.

use std::error::Error;
use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

use ferry::train::EpochStats;

const FONT: &[u8] = include_bytes!("../assets/fonts/DejaVuSans.ttf");
pub(crate) const GRID: RGBColor = RGBColor(225, 225, 225);
const TRAIN: RGBColor = RGBColor(31, 119, 180);
const TEST: RGBColor = RGBColor(214, 39, 40);
const SIZE: (u32, u32) = (1100, 440);

/// Registers the embedded font once, as plotters' "sans-serif".
pub(crate) fn font() -> Result<(), String> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        register_font("sans-serif", FontStyle::Normal, FONT)
            .map_err(|_| "the embedded DejaVu Sans font did not load".to_string())
    })
    .clone()
}

/// Draws the curves of `history` to `png` and, beside it, the same picture as SVG (the path
/// with the extension `svg`).
pub fn curves(png: &Path, history: &[EpochStats]) -> Result<(), Box<dyn Error>> {
    font()?;
    draw(BitMapBackend::new(png, SIZE).into_drawing_area(), history)?;
    let svg = png.with_extension("svg");
    draw(SVGBackend::new(&svg, SIZE).into_drawing_area(), history)?;
    Ok(())
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    history: &[EpochStats],
) -> Result<(), Box<dyn Error>>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(SIZE.0 / 2);
    let epochs = history.len().max(2) as f64;
    let x = |i: usize| (i + 1) as f64;
    let label_font = ("sans-serif", 15).into_font();
    let title_font = ("sans-serif", 20).into_font();

    let max_loss = history.iter().map(|s| s.loss).fold(0.0, f64::max).max(1e-6) * 1.05;
    let mut loss = ChartBuilder::on(&left)
        .caption("Training loss", title_font.clone())
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(1.0..epochs, 0.0..max_loss)?;
    loss.configure_mesh()
        .bold_line_style(GRID)
        .light_line_style(WHITE)
        .x_labels(history.len().clamp(2, 10))
        .x_desc("epoch")
        .y_desc("mean cross-entropy")
        .axis_desc_style(label_font.clone())
        .label_style(label_font.clone())
        .x_label_formatter(&epoch_tick)
        .y_label_formatter(&|v| format!("{v:.2}"))
        .draw()?;
    loss.draw_series(LineSeries::new(
        history.iter().enumerate().map(|(i, s)| (x(i), s.loss)),
        TRAIN.stroke_width(2),
    ))?
    .label("train")
    .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], TRAIN.stroke_width(2)));
    loss.configure_series_labels()
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font(label_font.clone())
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;

    let lowest = history
        .iter()
        .flat_map(|s| [s.train_accuracy, s.test_accuracy])
        .fold(1.0, f64::min);
    let floor = (lowest - 0.02).clamp(0.0, 0.8);
    let mut acc = ChartBuilder::on(&right)
        .caption("Accuracy", title_font)
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(1.0..epochs, floor..1.0)?;
    acc.configure_mesh()
        .bold_line_style(GRID)
        .light_line_style(WHITE)
        .x_labels(history.len().clamp(2, 10))
        .x_desc("epoch")
        .y_desc("fraction right")
        .axis_desc_style(label_font.clone())
        .label_style(label_font.clone())
        .x_label_formatter(&epoch_tick)
        .y_label_formatter(&|v| format!("{v:.2}"))
        .draw()?;
    for (name, color, pick) in [
        (
            "train",
            TRAIN,
            (|s: &EpochStats| s.train_accuracy) as fn(&EpochStats) -> f64,
        ),
        ("test", TEST, |s: &EpochStats| s.test_accuracy),
    ] {
        acc.draw_series(LineSeries::new(
            history.iter().enumerate().map(|(i, s)| (x(i), pick(s))),
            color.stroke_width(2),
        ))?
        .label(name)
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    acc.configure_series_labels()
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font(label_font)
        .position(SeriesLabelPosition::LowerRight)
        .draw()?;
    root.present()?;
    Ok(())
}

/// Epochs are whole numbers: ticks between them stay unlabelled.
fn epoch_tick(v: &f64) -> String {
    if (v - v.round()).abs() < 1e-6 {
        format!("{v:.0}")
    } else {
        String::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn history() -> Vec<EpochStats> {
        (0..5)
            .map(|i| EpochStats {
                loss: 1.0 / (i + 1) as f64,
                train_accuracy: 0.8 + 0.03 * i as f64,
                test_accuracy: 0.78 + 0.03 * i as f64,
            })
            .collect()
    }

    #[test]
    fn both_pictures_are_written_and_the_svg_carries_its_text() {
        let dir = tempfile::tempdir().unwrap();
        let png = dir.path().join("curves.png");
        curves(&png, &history()).unwrap();
        let bytes = std::fs::read(&png).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        let svg = std::fs::read_to_string(dir.path().join("curves.svg")).unwrap();
        for text in [
            "Training loss",
            "Accuracy",
            "epoch",
            "fraction right",
            "train",
            "test",
        ] {
            assert!(svg.contains(text), "the SVG has no {text:?}");
        }
    }

    #[test]
    fn text_is_drawn_into_the_png() {
        // The same picture with and without its text differs only if glyphs were rendered.
        font().unwrap();
        let mut with_text = vec![0u8; (SIZE.0 * SIZE.1 * 3) as usize];
        draw(
            BitMapBackend::with_buffer(&mut with_text, SIZE).into_drawing_area(),
            &history(),
        )
        .unwrap();
        let dark = with_text
            .chunks(3)
            .filter(|p| p.iter().all(|&c| c < 80))
            .count();
        // Frames and ticks alone leave a few thousand dark pixels; titles, labels and the
        // legend's words add many more.
        assert!(dark > 4000, "only {dark} dark pixels: no text?");
    }
}
