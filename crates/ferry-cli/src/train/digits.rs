//! The digits data: parsing the gzip CSV, the fixed train/test split, and the task the
//! trainer runs on it (shuffled batches, cross-entropy, test accuracy).

use std::error::Error;
use std::io::Read;

use ferry::prelude::*;
use ferry::train::{HostBatch, Task};
use rand::SeedableRng;
use rand::seq::SliceRandom;

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

/// Classifying the digits: each epoch the training rows in a shuffled order, `batch` at a time;
/// scored by accuracy on the test rows.
pub(super) struct Digits<'a> {
    train: &'a Split,
    test: (Tensor, Tensor),
    batch: usize,
}

impl<'a> Digits<'a> {
    /// The task on `train`, tested on `test` (moved to `device` once).
    pub fn new(
        train: &'a Split,
        test: &Split,
        device: Device,
        batch: usize,
    ) -> ferry::Result<Self> {
        let test = test.tensors(&(0..test.rows()).collect::<Vec<_>>(), device)?;
        Ok(Self { train, test, batch })
    }
}

impl Task for Digits<'_> {
    fn steps_per_epoch(&self) -> usize {
        self.train.rows().div_ceil(self.batch)
    }

    fn batches(
        &self,
        _epoch: usize,
        seed: u64,
    ) -> Box<dyn Iterator<Item = ferry::Result<HostBatch>> + '_> {
        let mut order: Vec<usize> = (0..self.train.rows()).collect();
        order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
        let batch = self.batch;
        // Assembled on the host in shuffled order, moved by the trainer's loader.
        Box::new((0..self.steps_per_epoch()).map(move |b| {
            let rows = &order[b * batch..((b + 1) * batch).min(order.len())];
            self.train.tensors(rows, Device::Cpu)
        }))
    }

    fn evaluate(&self, model: &mut dyn Module) -> ferry::Result<f64> {
        accuracy(model, &self.test.0, &self.test.1)
    }
}

/// Accuracy of `model` (in eval mode, without recording) on `x`, `y`.
pub fn accuracy(model: &mut dyn Module, x: &Tensor, y: &Tensor) -> ferry::Result<f64> {
    model.eval();
    let correct = with_no_grad(|| {
        model
            .forward(x)?
            .argmax(1, false)?
            .eq(y)?
            .to_dtype(DType::F32)?
            .sum()
    });
    model.train();
    Ok(correct?.item()? / y.shape()[0] as f64)
}
