//! Presentation shared by the benchmarks: numbers, ratios, units, targets and their verdicts, and
//! an aligned text table (the statistics are in `measure`).

/// Three significant digits, no exponent: 287, 7.24, 0.0253.
pub fn significant(x: f64) -> String {
    if !x.is_finite() {
        return x.to_string();
    }
    if x == 0.0 {
        return "0".into();
    }
    let magnitude = x.abs().log10().floor() as i32;
    let decimals = (2 - magnitude).clamp(0, 6) as usize;
    format!("{x:.decimals$}")
}

/// ferry's time over PyTorch's: below 1 means ferry is faster.
pub fn format_ratio(ferry: f64, pytorch: f64) -> String {
    if pytorch > 0.0 {
        significant(ferry / pytorch)
    } else {
        "-".into()
    }
}

/// How a case's times are shown: large moves in milliseconds, fixed costs in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Ms,
    Us,
}

impl Unit {
    /// A time given in milliseconds, in this unit, with its symbol.
    pub fn format(self, ms: f64) -> String {
        match self {
            Unit::Ms => format!("{} ms", significant(ms)),
            Unit::Us => format!("{} µs", significant(ms * 1e3)),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Unit::Ms => "ms",
            Unit::Us => "us",
        }
    }
}

/// A case's goal, from the performance issue.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Target {
    /// No goal: the row is context (the link itself, a cast).
    None,
    /// ferry's median at most this many milliseconds.
    AtMostMs(f64),
    /// At most this many milliseconds with at most this many bytes of staging.
    AtMostMsStaging { ms: f64, staging_bytes: usize },
    /// ferry's median no higher than PyTorch's.
    NoSlowerThanPyTorch,
    /// ferry's median at most this multiple of PyTorch's.
    AtMostTimesPyTorch(f64),
}

/// Whether a target was met; `Unknown` when the number it needs was not measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Met,
    Missed,
    Unknown,
    NoTarget,
}

impl Verdict {
    pub fn label(self) -> &'static str {
        match self {
            Verdict::Met => "met",
            Verdict::Missed => "MISSED",
            Verdict::Unknown => "?",
            Verdict::NoTarget => "",
        }
    }

    /// For JSON: true, false, or null.
    pub fn as_bool(self) -> Option<bool> {
        match self {
            Verdict::Met => Some(true),
            Verdict::Missed => Some(false),
            Verdict::Unknown | Verdict::NoTarget => None,
        }
    }
}

impl Target {
    pub fn describe(self) -> String {
        match self {
            Target::None => String::new(),
            Target::AtMostMs(ms) => format!("<= {ms} ms"),
            Target::AtMostMsStaging { ms, staging_bytes } => {
                format!("<= {ms} ms, staging <= {} MB", staging_bytes as f64 / 1e6)
            }
            Target::NoSlowerThanPyTorch => "<= PyTorch".into(),
            Target::AtMostTimesPyTorch(times) => format!("<= {times}x PyTorch"),
        }
    }

    /// Judges ferry's median (and staging peak) against the goal.
    pub fn verdict(
        self,
        ferry_ms: f64,
        staging: Option<usize>,
        pytorch_ms: Option<f64>,
    ) -> Verdict {
        let met = |ok: bool| if ok { Verdict::Met } else { Verdict::Missed };
        match self {
            Target::None => Verdict::NoTarget,
            Target::AtMostMs(ms) => met(ferry_ms <= ms),
            Target::AtMostMsStaging { ms, staging_bytes } => match staging {
                Some(peak) => met(ferry_ms <= ms && peak <= staging_bytes),
                None => Verdict::Unknown,
            },
            Target::NoSlowerThanPyTorch => match pytorch_ms {
                Some(theirs) => met(ferry_ms <= theirs),
                None => Verdict::Unknown,
            },
            Target::AtMostTimesPyTorch(times) => match pytorch_ms {
                Some(theirs) => met(ferry_ms <= times * theirs),
                None => Verdict::Unknown,
            },
        }
    }
}

/// Prints rows under a header, columns aligned (the first to the left, the rest to the right).
pub fn print_table(header: &[&str], rows: &[Vec<String>]) {
    debug_assert!(
        rows.iter().all(|row| row.len() == header.len()),
        "every row has a cell per column: {header:?}"
    );
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let parts: Vec<String> = cells
            .zip(&widths)
            .enumerate()
            .map(|(i, (cell, &w))| {
                let pad = " ".repeat(w - cell.chars().count());
                if i == 0 {
                    format!("{cell}{pad}")
                } else {
                    format!("{pad}{cell}")
                }
            })
            .collect();
        println!("{}", parts.join("  ").trim_end());
    };
    line(&mut header.iter().copied());
    let rules: Vec<String> = widths.iter().map(|&w| "-".repeat(w)).collect();
    line(&mut rules.iter().map(String::as_str));
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_keep_three_significant_digits() {
        assert_eq!(significant(287.4), "287");
        assert_eq!(significant(7.2449), "7.24");
        assert_eq!(significant(12.35), "12.3");
        assert_eq!(significant(0.02534), "0.0253");
        assert_eq!(significant(1234.0), "1234");
        assert_eq!(significant(0.0), "0");
    }

    #[test]
    fn ratio_is_ferry_over_pytorch() {
        assert_eq!(format_ratio(7.24, 287.0), "0.0252");
        assert_eq!(format_ratio(10.0, 5.0), "2.00");
        assert_eq!(format_ratio(5.44, 5.44), "1.00");
        assert_eq!(format_ratio(1.0, 0.0), "-");
    }

    #[test]
    fn units_scale_milliseconds() {
        assert_eq!(Unit::Ms.format(7.244), "7.24 ms");
        assert_eq!(Unit::Us.format(0.0124), "12.4 µs");
    }

    #[test]
    fn verdicts_follow_the_targets() {
        assert_eq!(
            Target::AtMostMs(10.0).verdict(9.9, None, None),
            Verdict::Met
        );
        assert_eq!(
            Target::AtMostMs(10.0).verdict(10.1, None, None),
            Verdict::Missed
        );
        let chunked = Target::AtMostMsStaging {
            ms: 12.0,
            staging_bytes: 100_000_000,
        };
        assert_eq!(chunked.verdict(11.0, Some(100_000_000), None), Verdict::Met);
        assert_eq!(
            chunked.verdict(11.0, Some(100_000_001), None),
            Verdict::Missed
        );
        assert_eq!(chunked.verdict(11.0, None, None), Verdict::Unknown);
        let small = Target::NoSlowerThanPyTorch;
        assert_eq!(small.verdict(0.01, None, Some(0.02)), Verdict::Met);
        assert_eq!(small.verdict(0.03, None, Some(0.02)), Verdict::Missed);
        assert_eq!(small.verdict(0.01, None, None), Verdict::Unknown);
        assert_eq!(chunked.describe(), "<= 12 ms, staging <= 100 MB");
        let close = Target::AtMostTimesPyTorch(1.05);
        assert_eq!(close.verdict(2.96, None, Some(2.82)), Verdict::Met);
        assert_eq!(close.verdict(2.97, None, Some(2.82)), Verdict::Missed);
        assert_eq!(close.verdict(1.0, None, None), Verdict::Unknown);
        assert_eq!(close.describe(), "<= 1.05x PyTorch");
    }
}
