//! What `ferry bench offload --sweep` judges each case by: the link bound on the step with
//! offload and the share of the saved activations offload takes off the peak. Pure arithmetic,
//! tested without a GPU.
//!
//! The bound: the forward cannot end before its saved bytes have gone device to host at the
//! link's speed, nor the backward before they have come back, so a step with offload takes at
//! least `max(forward, bytes / D2H) + max(backward, bytes / H2D)`, where forward and backward
//! are the times without offload and bytes what the scope moved
//! (`OffloadStats::offloaded_bytes`).

use ferry::autograd::OffloadStats;

use crate::harness::goal::{self, Goal};

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

/// "met", "MISSED" or "-" (not measured).
pub fn verdict(met: Option<bool>) -> &'static str {
    match met {
        Some(true) => "met",
        Some(false) => "MISSED",
        None => "-",
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
        assert_eq!(verdict(step_goal(Some(1.0))), "met");
        assert_eq!(verdict(step_goal(Some(1.2))), "MISSED");
        assert_eq!(verdict(None), "-");
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
}
