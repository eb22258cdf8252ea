//! What one case of `ferry bench offload --sweep` measured: its four rows of samples, and the
//! summary its goals are judged on (medians, the link bound, peaks and their drop).

use ferry::autograd::OffloadStats;

use super::goals::{Bound, Link, PEAK_GOAL, STEP_GOAL, activation_bytes, peak_reduction};
use super::grid::SweepCase;
use crate::Measured;

/// One timed step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// The whole step, device-synchronized at its end.
    pub ms: f64,
    /// Split rows: the forward (to the loss) and the backward, each synchronized.
    pub forward_ms: Option<f64>,
    pub backward_ms: Option<f64>,
    /// The allocator's peak over the step's start, in the forward and in the backward.
    pub peak_forward: u64,
    pub peak_backward: u64,
    /// The graph's saved bytes after the forward.
    pub saved_bytes: u64,
    /// The offload scope's counters after the backward.
    pub stats: Option<OffloadStats>,
}

/// The four ways each case is stepped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowKind {
    NoOffload,
    NoOffloadSplit,
    Offload,
    OffloadSplit,
}

impl RowKind {
    /// In the order they run.
    pub const ALL: [RowKind; 4] = [
        RowKind::NoOffload,
        RowKind::NoOffloadSplit,
        RowKind::Offload,
        RowKind::OffloadSplit,
    ];

    pub fn offloads(self) -> bool {
        matches!(self, RowKind::Offload | RowKind::OffloadSplit)
    }

    /// Whether the device is synchronized between forward and backward.
    pub fn split(self) -> bool {
        matches!(self, RowKind::NoOffloadSplit | RowKind::OffloadSplit)
    }

    fn index(self) -> usize {
        self as usize
    }

    pub fn id(self) -> &'static str {
        match self {
            RowKind::NoOffload => "no_offload",
            RowKind::NoOffloadSplit => "no_offload_split",
            RowKind::Offload => "offload",
            RowKind::OffloadSplit => "offload_split",
        }
    }
}

/// A row's samples, or why it stopped.
#[derive(Debug, Default)]
pub struct Row {
    pub step: Measured,
    pub forward: Measured,
    pub backward: Measured,
    pub peak_forward: Vec<u64>,
    pub peak_backward: Vec<u64>,
    pub saved_bytes: Option<u64>,
    pub stats: Option<OffloadStats>,
    /// How far the device's reserved memory grew over the row (from an empty cache).
    pub reserved_growth_bytes: Option<u64>,
}

impl Row {
    pub fn push(&mut self, s: Sample) {
        self.step.push(s.ms);
        if let Some(ms) = s.forward_ms {
            self.forward.push(ms);
        }
        if let Some(ms) = s.backward_ms {
            self.backward.push(ms);
        }
        self.peak_forward.push(s.peak_forward);
        self.peak_backward.push(s.peak_backward);
        self.saved_bytes = Some(s.saved_bytes);
        self.stats = s.stats;
    }

    /// Ends the row: its medians no longer count for the goals.
    pub fn fail(&mut self, error: String) {
        self.step.fail(error.clone());
        self.forward.fail(error.clone());
        self.backward.fail(error);
    }

    pub fn error(&self) -> Option<&str> {
        self.step.error.as_deref()
    }

    fn complete(&self) -> bool {
        self.error().is_none() && !self.step.samples_ms.is_empty()
    }

    /// The largest peak of any sample in the forward and in the backward; `None` for an
    /// incomplete row.
    pub fn phase_peaks(&self) -> Option<(u64, u64)> {
        self.complete().then_some(())?;
        Some((max(&self.peak_forward), max(&self.peak_backward)))
    }

    /// The larger of [`Row::phase_peaks`].
    fn peak(&self) -> Option<u64> {
        self.phase_peaks().map(|(f, b)| f.max(b))
    }
}

fn max(values: &[u64]) -> u64 {
    values.iter().copied().max().unwrap_or(0)
}

/// One case of the sweep: its rows and what the caller's tensors weigh.
#[derive(Debug)]
pub struct CaseRun {
    pub case: SweepCase,
    pub rows: [Row; 4],
    /// Parameters and inputs, each buffer once.
    pub caller_bytes: u64,
    /// Why the case could not run at all (its model did not fit, say).
    pub error: Option<String>,
}

impl CaseRun {
    pub fn new(case: SweepCase) -> Self {
        Self {
            case,
            rows: Default::default(),
            caller_bytes: 0,
            error: None,
        }
    }

    pub fn row_mut(&mut self, kind: RowKind) -> &mut Row {
        &mut self.rows[kind.index()]
    }

    pub fn row(&self, kind: RowKind) -> &Row {
        &self.rows[kind.index()]
    }
}

/// The link's timed copies.
#[derive(Debug)]
pub struct LinkRun {
    pub bytes: u64,
    pub d2h: Measured,
    pub h2d: Measured,
    /// Both directions at once, one copy of `bytes` each way.
    pub both: Measured,
}

impl LinkRun {
    /// Each direction's median copy as a speed.
    pub fn speed(&self) -> Option<Link> {
        let (d2h, h2d) = (self.d2h.complete_median()?, self.h2d.complete_median()?);
        Some(Link::from_copies(self.bytes, d2h, h2d))
    }

    /// Both directions' bytes over the median time of both at once, GB/s.
    pub fn both_gb_s(&self) -> Option<f64> {
        self.both
            .complete_median()
            .map(|ms| 2.0 * self.bytes as f64 / ms / 1e6)
    }
}

/// A case's medians and peaks, and its goals.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Summary {
    pub step_ms: Option<f64>,
    pub forward_ms: Option<f64>,
    pub backward_ms: Option<f64>,
    pub offload_ms: Option<f64>,
    pub offload_forward_ms: Option<f64>,
    pub offload_backward_ms: Option<f64>,
    /// What the scope moved each way.
    pub moved_bytes: Option<u64>,
    pub bound: Option<Bound>,
    pub step_over_bound: Option<f64>,
    /// The saved activations of at least `min_bytes`, as the offload scope saw them.
    pub activation_bytes: Option<u64>,
    pub peak_without: Option<u64>,
    pub peak_with: Option<u64>,
    pub reduction: Option<f64>,
    pub step_met: Option<bool>,
    pub peak_met: Option<bool>,
}

impl Summary {
    pub fn of(run: &CaseRun, link: Option<Link>) -> Self {
        let median =
            |kind: RowKind, pick: fn(&Row) -> &Measured| pick(run.row(kind)).complete_median();
        let forward_ms = median(RowKind::NoOffloadSplit, |r| &r.forward);
        let backward_ms = median(RowKind::NoOffloadSplit, |r| &r.backward);
        let offload_ms = median(RowKind::Offload, |r| &r.step);
        let offloaded = run.row(RowKind::Offload);
        let moved_bytes = offloaded
            .complete()
            .then(|| offloaded.stats.map(|s| s.offloaded_bytes))
            .flatten();
        let bound = match (forward_ms, backward_ms, moved_bytes, link) {
            (Some(f), Some(b), Some(bytes), Some(link)) => Some(Bound::new(f, b, bytes, link)),
            _ => None,
        };
        let step_over_bound = offload_ms.zip(bound).map(|(ms, b)| ms / b.ms);
        let plain = run.row(RowKind::NoOffload);
        let activations = offloaded
            .complete()
            .then(|| offloaded.stats.map(|s| activation_bytes(&s)))
            .flatten();
        let (peak_without, peak_with) = (plain.peak(), offloaded.peak());
        let reduction = match (peak_without, peak_with, activations) {
            (Some(a), Some(b), Some(act)) => peak_reduction(a, b, act),
            _ => None,
        };
        Self {
            step_ms: median(RowKind::NoOffload, |r| &r.step),
            forward_ms,
            backward_ms,
            offload_ms,
            offload_forward_ms: median(RowKind::OffloadSplit, |r| &r.forward),
            offload_backward_ms: median(RowKind::OffloadSplit, |r| &r.backward),
            moved_bytes,
            bound,
            step_over_bound,
            activation_bytes: activations,
            peak_without,
            peak_with,
            reduction,
            step_met: STEP_GOAL.verdict(step_over_bound).as_bool(),
            peak_met: PEAK_GOAL.verdict(reduction).as_bool(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn sample(ms: f64, split: Option<(f64, f64)>, peaks: (u64, u64)) -> Sample {
        Sample {
            ms,
            forward_ms: split.map(|s| s.0),
            backward_ms: split.map(|s| s.1),
            peak_forward: peaks.0,
            peak_backward: peaks.1,
            saved_bytes: (384 + 112) * MIB,
            stats: None,
        }
    }

    /// 6 x 2048 at batch 8192 as the analysis models it: 64 MiB activations, 112 MiB of
    /// weights and input, five activations moved (the last read in place).
    fn mlp_6x2048() -> CaseRun {
        let mut run = CaseRun::new(SweepCase::Mlp {
            layers: 6,
            width: 2048,
            batch: 8192,
        });
        run.caller_bytes = 112 * MIB;
        for ms in [24.4, 24.6, 24.5] {
            run.row_mut(RowKind::NoOffload)
                .push(sample(ms, None, (448 * MIB, 464 * MIB)));
            run.row_mut(RowKind::NoOffloadSplit).push(sample(
                ms + 0.2,
                Some((8.0, 16.0)),
                (448 * MIB, 464 * MIB),
            ));
        }
        for ms in [30.0, 29.0, 31.0] {
            let mut s = sample(ms, None, (192 * MIB, 320 * MIB));
            s.stats = Some(OffloadStats {
                offloaded: 5,
                offloaded_bytes: 320 * MIB,
                read_in_place: 1,
                read_in_place_bytes: 64 * MIB,
                ..OffloadStats::default()
            });
            run.row_mut(RowKind::Offload).push(s);
        }
        run
    }

    #[test]
    fn the_summary_bounds_the_offload_step_and_shares_the_peak_drop() {
        let link = Link {
            d2h_bytes_per_ms: 55e6,
            h2d_bytes_per_ms: 50e6,
        };
        let s = Summary::of(&mlp_6x2048(), Some(link));
        assert_eq!(s.step_ms, Some(24.5));
        assert_eq!((s.forward_ms, s.backward_ms), (Some(8.0), Some(16.0)));
        assert_eq!((s.offload_ms, s.moved_bytes), (Some(30.0), Some(320 * MIB)));
        // 320 MiB take 6.1 ms out and 6.7 ms back: under both phases, so the bound is 24 ms.
        let bound = s.bound.unwrap();
        assert!((bound.out_ms - 320.0 * MIB as f64 / 55e6).abs() < 1e-9);
        assert_eq!(bound.ms, 24.0);
        assert_eq!(s.step_over_bound, Some(1.25));
        assert_eq!(s.step_met, Some(false));
        // Peaks: the larger phase of each row; (464 - 320) / 384 MiB of activations.
        assert_eq!(s.activation_bytes, Some(384 * MIB));
        assert_eq!(
            (s.peak_without, s.peak_with),
            (Some(464 * MIB), Some(320 * MIB))
        );
        assert_eq!(s.reduction, Some(0.375));
        assert_eq!(s.peak_met, Some(false));
        // No split row with offload ran: its medians are absent, nothing else changes.
        assert_eq!((s.offload_forward_ms, s.offload_backward_ms), (None, None));
    }

    #[test]
    fn a_failed_row_or_an_unmeasured_link_leaves_its_goal_unjudged() {
        let mut run = mlp_6x2048();
        assert_eq!(Summary::of(&run, None).step_met, None, "no link, no bound");
        run.row_mut(RowKind::Offload)
            .fail("CUDA out of memory".into());
        let link = Link {
            d2h_bytes_per_ms: 55e6,
            h2d_bytes_per_ms: 50e6,
        };
        let s = Summary::of(&run, Some(link));
        assert_eq!((s.offload_ms, s.bound, s.step_met), (None, None, None));
        assert_eq!((s.peak_with, s.reduction, s.peak_met), (None, None, None));
        // The row without offload still reports.
        assert_eq!(s.step_ms, Some(24.5));
        assert_eq!(s.peak_without, Some(464 * MIB));
    }
}
