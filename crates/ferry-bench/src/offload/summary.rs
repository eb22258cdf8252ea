//! What `ferry bench offload --sweep` measures of a case (four rows of samples) and judges it
//! by: the link bound on the step with offload, `max(forward, bytes / D2H) + max(backward,
//! bytes / H2D)` (forward and backward without offload, bytes what the scope moved), and the
//! share of the saved activations taken off the peak. Pure arithmetic, tested without a GPU.

use ferry::autograd::OffloadStats;

use super::grid::SweepCase;
use crate::harness::goal::{self, Goal};
use crate::harness::measure::Measured;

/// The step with offload may take at most 1.15 times its bound.
pub const STEP_GOAL: Goal = Goal {
    name: "step over its link bound",
    metric: "step_over_bound",
    bound: goal::Bound::AtMost(1.15),
};

/// The peak must drop by at least 60% of the saved activations.
pub const PEAK_GOAL: Goal = Goal {
    name: "peak lower, as a share of the saved activations",
    metric: "peak_reduction",
    bound: goal::Bound::AtLeast(0.60),
};

/// The link's speed in each direction, in bytes per millisecond, as measured in the run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    pub d2h_bytes_per_ms: f64,
    pub h2d_bytes_per_ms: f64,
}

impl Link {
    /// From `bytes` copied in a median of `d2h_ms` one way and `h2d_ms` the other.
    pub fn from_copies(bytes: u64, d2h_ms: f64, h2d_ms: f64) -> Self {
        Self {
            d2h_bytes_per_ms: bytes as f64 / d2h_ms,
            h2d_bytes_per_ms: bytes as f64 / h2d_ms,
        }
    }

    /// GB/s device to host (10^9 bytes per second).
    pub fn d2h_gb_s(self) -> f64 {
        self.d2h_bytes_per_ms / 1e6
    }

    /// GB/s host to device.
    pub fn h2d_gb_s(self) -> f64 {
        self.h2d_bytes_per_ms / 1e6
    }
}

/// The link bound of one case and its parts, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bound {
    /// `bytes / D2H`: the forward's saved bytes going out.
    pub out_ms: f64,
    /// `bytes / H2D`: coming back.
    pub back_ms: f64,
    /// `max(forward, out) + max(backward, back)`.
    pub ms: f64,
}

impl Bound {
    /// The bound of a step whose forward and backward take `forward_ms` and `backward_ms`
    /// without offload, and whose scope moved `bytes` each way.
    pub fn new(forward_ms: f64, backward_ms: f64, bytes: u64, link: Link) -> Self {
        let out_ms = bytes as f64 / link.d2h_bytes_per_ms;
        let back_ms = bytes as f64 / link.h2d_bytes_per_ms;
        Self {
            out_ms,
            back_ms,
            ms: forward_ms.max(out_ms) + backward_ms.max(back_ms),
        }
    }

    /// Whether the link, not the compute, sets the bound: moving the bytes takes longer than
    /// the phase it overlaps, in either direction.
    pub fn link_bound(self, forward_ms: f64, backward_ms: f64) -> bool {
        self.out_ms > forward_ms || self.back_ms > backward_ms
    }
}

/// `(peak without offload − peak with) / saved activation bytes`: the share of what offload
/// could free that it took off the peak (negative when offload raised the peak). `None`
/// without activations.
pub fn peak_reduction(peak_without: u64, peak_with: u64, activation_bytes: u64) -> Option<f64> {
    (activation_bytes > 0)
        .then(|| (peak_without as f64 - peak_with as f64) / activation_bytes as f64)
}

/// The saved activations an offload scope saw (each buffer once, at least `min_bytes`): those
/// it moved, those backward read before their copy was queued, and those the pinned budget
/// kept on the device. Parameters and inputs, which rules save too, are not activations:
/// their owner keeps them, so offload leaves them in place.
pub fn activation_bytes(stats: &OffloadStats) -> u64 {
    stats.offloaded_bytes + stats.read_in_place_bytes + stats.kept_over_budget_bytes
}

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

impl Sample {
    /// A step timed whole, without an offload scope.
    pub fn whole(ms: f64, peak_forward: u64, peak_backward: u64, saved_bytes: u64) -> Self {
        Self {
            ms,
            forward_ms: None,
            backward_ms: None,
            peak_forward,
            peak_backward,
            saved_bytes,
            stats: None,
        }
    }
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
    pub fn peak(&self) -> Option<u64> {
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

    /// 55 GB/s out, 50 GB/s back.
    const LINK: Link = Link {
        d2h_bytes_per_ms: 55e6,
        h2d_bytes_per_ms: 50e6,
    };

    #[test]
    fn the_link_is_bytes_over_the_median_copy() {
        let link = Link::from_copies(1 << 30, 20.0, 25.0);
        assert_eq!(link.d2h_bytes_per_ms, (1u64 << 30) as f64 / 20.0);
        assert!(
            (link.d2h_gb_s() - 53.687).abs() < 1e-3,
            "{}",
            link.d2h_gb_s()
        );
        assert!(
            (link.h2d_gb_s() - 42.950).abs() < 1e-3,
            "{}",
            link.h2d_gb_s()
        );
    }

    #[test]
    fn the_bound_takes_the_slower_of_compute_and_link_in_each_phase() {
        // Compute-bound both ways: 110 MB take 2 ms out and 2.2 ms back.
        let b = Bound::new(8.0, 16.0, 110_000_000, LINK);
        assert_eq!((b.out_ms, b.back_ms), (2.0, 2.2));
        assert_eq!(b.ms, 24.0);
        assert!(!b.link_bound(8.0, 16.0));
        // 1.1 GB: 20 ms out (over the 8 ms forward), 22 ms back (over the 16 ms backward).
        let b = Bound::new(8.0, 16.0, 1_100_000_000, LINK);
        assert_eq!(b.ms, 20.0 + 22.0);
        assert!(b.link_bound(8.0, 16.0));
        // Link-bound one way only: 550 MB take 10 ms out, 11 ms back.
        let b = Bound::new(8.0, 16.0, 550_000_000, LINK);
        assert_eq!(b.ms, 10.0 + 16.0);
        assert!(b.link_bound(8.0, 16.0));
        // Nothing moved: the bound is the step without offload.
        assert_eq!(Bound::new(8.0, 16.0, 0, LINK).ms, 24.0);
    }

    #[test]
    fn the_step_goal_is_at_most_1_15_times_the_bound() {
        let step_goal = |x: Option<f64>| STEP_GOAL.verdict(x).as_bool();
        let bound = Bound::new(8.0, 16.0, 0, LINK).ms;
        assert_eq!(step_goal(Some(27.5 / bound)), Some(true)); // 1.146x
        assert_eq!(step_goal(Some(27.7 / bound)), Some(false));
        assert_eq!(step_goal(None), None);
    }

    #[test]
    fn the_peak_reduction_is_a_share_of_the_saved_activations() {
        let peak_goal = |x: Option<f64>| PEAK_GOAL.verdict(x).as_bool();
        // 6 x 64 MiB saved, five moved and the last read in place; the peak went from 464 MiB
        // to 320 MiB: 144 / 384 = 37.5%.
        let mib = 1u64 << 20;
        let activations = activation_bytes(&OffloadStats {
            offloaded: 5,
            offloaded_bytes: 320 * mib,
            read_in_place: 1,
            read_in_place_bytes: 64 * mib,
            shared: 5,
            kept_not_activation: 7,
            ..OffloadStats::default()
        });
        assert_eq!(activations, 384 * mib);
        // Those the pinned budget kept are activations too.
        let over = OffloadStats {
            kept_over_budget_bytes: 64 * mib,
            ..OffloadStats::default()
        };
        assert_eq!(activation_bytes(&over), 64 * mib);
        let r = peak_reduction(464 * mib, 320 * mib, activations);
        assert_eq!(r, Some(0.375));
        assert_eq!(peak_goal(r), Some(false));
        assert_eq!(
            peak_goal(peak_reduction(464 * mib, 230 * mib, activations)),
            Some(true)
        );
        // Offload that raised the peak reduces it by a negative share, never wraps around.
        assert_eq!(peak_reduction(100, 148, 96), Some(-0.5));
        assert_eq!(peak_reduction(100, 50, 0), None);
    }

    const MIB: u64 = 1 << 20;

    fn sample(ms: f64, split: Option<(f64, f64)>, peaks: (u64, u64)) -> Sample {
        Sample {
            forward_ms: split.map(|s| s.0),
            backward_ms: split.map(|s| s.1),
            ..Sample::whole(ms, peaks.0, peaks.1, (384 + 112) * MIB)
        }
    }

    /// 6 x 2048 at batch 8192 as the analysis models it: 64 MiB activations, 112 MiB of
    /// weights and input, five activations moved (the last read in place).
    fn mlp_6x2048() -> CaseRun {
        let mut run = CaseRun::new(SweepCase::mlp(6, 2048, 8192));
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
        let s = Summary::of(&mlp_6x2048(), Some(LINK));
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
        let s = Summary::of(&run, Some(LINK));
        assert_eq!((s.offload_ms, s.bound, s.step_met), (None, None, None));
        assert_eq!((s.peak_with, s.reduction, s.peak_met), (None, None, None));
        // The row without offload still reports.
        assert_eq!(s.step_ms, Some(24.5));
        assert_eq!(s.peak_without, Some(464 * MIB));
    }
}
