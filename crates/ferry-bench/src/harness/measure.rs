//! One side's timings of one case: [`Measured`], the same type for ferry's samples and
//! PyTorch's, in every benchmark.

use super::report::significant;

/// Timed samples in milliseconds, and why there are none (or no more): a side that failed keeps
/// the samples it took. Its statistics cover those samples; [`Measured::complete_median`] is the
/// one for verdicts, absent after an error, so a half-measured case never passes for a measured
/// one.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Measured {
    /// Every timed sample, in the order taken.
    pub samples_ms: Vec<f64>,
    /// What went wrong, if something did.
    pub error: Option<String>,
}

impl Measured {
    /// Nothing measured yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// These samples, no error.
    pub fn from_samples(samples_ms: Vec<f64>) -> Self {
        Self {
            samples_ms,
            error: None,
        }
    }

    /// A side that could not run at all.
    pub fn failed(error: impl Into<String>) -> Self {
        Self {
            samples_ms: Vec::new(),
            error: Some(error.into()),
        }
    }

    /// Adds one sample.
    pub fn push(&mut self, ms: f64) {
        self.samples_ms.push(ms);
    }

    /// Records what went wrong (the first error stays).
    pub fn fail(&mut self, error: impl Into<String>) {
        self.error.get_or_insert_with(|| error.into());
    }

    /// One round's result: its sample kept when `timed`, its error recorded; a side that has
    /// failed takes no more rounds. Whether the round succeeded.
    pub fn record<E: ToString>(&mut self, round: Result<f64, E>, timed: bool) -> bool {
        match round {
            _ if self.is_failed() => false,
            Ok(x) => {
                if timed {
                    self.push(x);
                }
                true
            }
            Err(err) => {
                self.fail(err.to_string());
                false
            }
        }
    }

    /// Whether an error was recorded.
    pub fn is_failed(&self) -> bool {
        self.error.is_some()
    }

    /// The median of the samples taken; `None` without samples.
    pub fn median(&self) -> Option<f64> {
        self.percentile(50.0)
    }

    /// The median when the side ran to the end; `None` without samples or after an error.
    pub fn complete_median(&self) -> Option<f64> {
        self.error.is_none().then(|| self.median()).flatten()
    }

    /// The fastest sample; `None` without samples.
    pub fn min(&self) -> Option<f64> {
        self.samples_ms.iter().copied().reduce(f64::min)
    }

    /// The slowest sample; `None` without samples.
    pub fn max(&self) -> Option<f64> {
        self.samples_ms.iter().copied().reduce(f64::max)
    }

    /// The `p`-th percentile (0 to 100) of the samples, interpolated linearly between the
    /// closest ranks (the 50th is the median: the middle sample, or the mean of the two middle
    /// ones); `None` without samples.
    pub fn percentile(&self, p: f64) -> Option<f64> {
        percentile(&self.samples_ms, p)
    }

    /// The interquartile range (75th minus 25th percentile): the spread that outliers do not move.
    pub fn iqr(&self) -> Option<f64> {
        Some(self.percentile(75.0)? - self.percentile(25.0)?)
    }

    /// [`Measured::complete_median`] for a table cell: `format`ted, "error" after an error, "-"
    /// when not measured.
    pub fn median_cell(&self, format: impl Fn(f64) -> String) -> String {
        match self.complete_median() {
            Some(ms) => format(ms),
            None if self.is_failed() => "error".into(),
            None => "-".into(),
        }
    }

    /// [`Measured::median_cell`] with three significant digits.
    pub fn median_text(&self) -> String {
        self.median_cell(significant)
    }
}

/// The median of `samples` in any order; `None` for none.
pub fn median(samples: &[f64]) -> Option<f64> {
    percentile(samples, 50.0)
}

/// The `p`-th percentile of `samples` in any order, interpolated between closest ranks.
fn percentile(samples: &[f64], p: f64) -> Option<f64> {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let last = sorted.len().checked_sub(1)?;
    let rank = p.clamp(0.0, 100.0) / 100.0 * last as f64;
    let (low, high) = (rank.floor() as usize, rank.ceil() as usize);
    let (a, b) = (sorted[low], sorted[high]);
    Some(match rank - low as f64 {
        0.0 => a,
        // The middle of an even count: the mean of the two middle samples.
        0.5 => (a + b) / 2.0,
        frac => a + (b - a) * frac,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts_ignores_order() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0]), Some(3.0));
        assert_eq!(median(&[9.0, 1.0, 5.0]), Some(5.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        // One wild outlier does not move it.
        let samples = [7.3, 7.2, 7.4, 7.25, 300.0, 7.31, 7.28, 7.26, 7.29];
        assert_eq!(median(&samples), Some(7.29));
    }

    #[test]
    fn statistics_come_from_the_samples() {
        let m = Measured::from_samples(vec![5.0, 1.0, 4.0, 2.0, 3.0]);
        assert_eq!(m.median(), Some(3.0));
        assert_eq!(m.min(), Some(1.0));
        assert_eq!(m.max(), Some(5.0));
        assert_eq!(m.percentile(25.0), Some(2.0));
        assert_eq!(m.percentile(90.0), Some(4.6));
        assert_eq!(m.iqr(), Some(2.0));
        assert_eq!(m.median_text(), "3.00");
    }

    #[test]
    fn a_failed_side_has_no_complete_median() {
        let mut m = Measured::new();
        assert_eq!((m.median(), m.min(), m.iqr()), (None, None, None));
        assert_eq!(m.median_text(), "-");
        m.push(2.0);
        assert_eq!(m.complete_median(), Some(2.0));
        m.fail("CUDA out of memory");
        m.fail("a later error");
        assert_eq!(m.error.as_deref(), Some("CUDA out of memory"));
        // The samples taken keep their statistics; the verdict's median is gone.
        assert_eq!((m.median(), m.max()), (Some(2.0), Some(2.0)));
        assert_eq!(m.complete_median(), None);
        assert_eq!(m.median_text(), "error");
        assert_eq!(
            Measured::failed("no GPU").median_cell(|ms| format!("{ms} ms")),
            "error"
        );
    }
}
