//! The digits data: parsing the gzip CSV and the fixed train/test split.

use std::error::Error;
use std::io::Read;

use ferry::prelude::*;

/// The digits data, gzip-compressed CSV (`p0..p63,label`), embedded so the command works from
/// any directory. See data/README.md for its origin and licence.
pub const DIGITS_CSV_GZ: &[u8] = include_bytes!("../../../../data/digits.csv.gz");
/// Rows that train; the rest test.
pub const TRAIN_ROWS: usize = 1500;
/// Pixels per image.
pub const FEATURES: usize = 64;
/// Digit classes.
pub const CLASSES: usize = 10;

/// Features `[n, 64]` (f32, pixels scaled to 0..1) and labels `[n]` (i64), on the host.
pub struct Split {
    pub(super) x: Vec<f32>,
    pub(super) y: Vec<i64>,
}

impl Split {
    pub(super) fn rows(&self) -> usize {
        self.y.len()
    }

    /// The rows in `order`, as tensors on `device` (one move for the whole set).
    pub(super) fn tensors(
        &self,
        order: &[usize],
        device: Device,
    ) -> ferry::Result<(Tensor, Tensor)> {
        let mut x = Vec::with_capacity(order.len() * FEATURES);
        for &i in order {
            x.extend_from_slice(&self.x[i * FEATURES..(i + 1) * FEATURES]);
        }
        let y: Vec<i64> = order.iter().map(|&i| self.y[i]).collect();
        let x = Tensor::from_vec(x, &[order.len(), FEATURES])?.to(device)?;
        let y = Tensor::from_vec(y, &[order.len()])?.to(device)?;
        Ok((x, y))
    }
}

/// Reads the digits CSV (gzip) and splits it: first 1,500 rows train, the rest test.
pub fn load_digits(gz: &[u8]) -> Result<(Split, Split), Box<dyn Error>> {
    let mut text = String::new();
    flate2::read::GzDecoder::new(gz).read_to_string(&mut text)?;
    let mut lines = text.lines();
    let header = lines.next().ok_or("the digits file is empty")?;
    if header.split(',').count() != FEATURES + 1 || !header.ends_with(",label") {
        return Err(format!("unexpected digits header {header:?}: want p0..p63,label").into());
    }
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for (n, line) in lines.enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let fields: Vec<&str> = line.split(',').collect();
        let bad = |what: &str| format!("digits row {}: {what}: {line:?}", n + 1);
        if fields.len() != FEATURES + 1 {
            return Err(bad("expected 65 fields").into());
        }
        for f in &fields[..FEATURES] {
            let v: f32 = f.trim().parse().map_err(|_| bad("bad pixel"))?;
            x.push(v / 16.0);
        }
        let label: i64 = fields[FEATURES]
            .trim()
            .parse()
            .map_err(|_| bad("bad label"))?;
        if !(0..CLASSES as i64).contains(&label) {
            return Err(bad("label outside 0..10").into());
        }
        y.push(label);
    }
    if y.len() <= TRAIN_ROWS {
        return Err(format!("only {} digits rows; need more than {TRAIN_ROWS}", y.len()).into());
    }
    let test = Split {
        x: x.split_off(TRAIN_ROWS * FEATURES),
        y: y.split_off(TRAIN_ROWS),
    };
    Ok((Split { x, y }, test))
}
