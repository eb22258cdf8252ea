//! A memory plan for a step's saved activations: each region of the forward (a model's blocks,
//! run one after another) keeps what its rules save on the device, offloads it to host memory, or
//! recomputes it in backward, chosen from costs measured in one profiled step so that the bytes
//! on the device fit a target at the least predicted extra time.
//!
//! # The cost model
//!
//! Region `i` has a forward time `f_i`, the bytes its rules save beyond its input (`s_i`) and
//! the bytes of its input (`x_i`). The input stays on the device whatever is chosen (the region
//! before produced it, and a recomputed region starts from it), so the bytes at the end of the
//! forward are `sum x + sum s over kept regions`.
//!
//! - **Recompute** frees `s_i` for `f_i` more milliseconds (the region's forward runs again in
//!   backward). While region `i`'s backward runs its activations are back, and those of the
//!   regions before it are still held: the plan's peak counts that moment too.
//! - **Offload** frees `s_i` for no time when the link has room: the copy out starts when the
//!   region ends and must be done when the forward ends (else the bytes are still on the device
//!   at the peak), one copy at a time on the link; the copy back starts when the backward of the
//!   region after it starts and must be done before region `i`'s backward starts, else the step
//!   waits the difference. Backward is taken to cost twice the forward, a recomputed region's
//!   three times. The last regions, with no forward left to hide their copy, cannot be
//!   offloaded; what the link moves inside the step is all that offload can take.
//! - **Keep** costs nothing and frees nothing.
//!
//! The plan starts from keeping everything and, until the peak fits, takes the single change
//! (a kept region offloaded or recomputed) that adds the least predicted time per byte it frees;
//! a free offload goes first. When even the last change leaves the peak above the target, the
//! plan says so ([`MemoryPlan::reached`]) and stands at the least peak it found.

use std::fmt;

use crate::{Result, TensorError};

const OP: &str = "memory plan";

/// What one region of the forward costs, from a profiled step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RegionCost {
    /// Milliseconds of its forward: what recomputing it costs again in backward.
    pub forward_ms: f64,
    /// Bytes its rules save beyond its input (each buffer once): what keeping it holds and
    /// offloading or recomputing it frees.
    pub saved_bytes: u64,
    /// Bytes of its input, which stays on the device whatever the plan chooses.
    pub input_bytes: u64,
}

/// The link between the device and host memory, as measured: bytes per millisecond each way
/// (1 GB/s is 1e6 bytes per millisecond).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Device to host.
    pub to_host_bytes_per_ms: f64,
    /// Host to device.
    pub to_device_bytes_per_ms: f64,
}

impl Link {
    /// A link of `to_host` and `to_device` GB/s.
    pub fn gb_per_s(to_host: f64, to_device: f64) -> Self {
        Self {
            to_host_bytes_per_ms: to_host * 1e6,
            to_device_bytes_per_ms: to_device * 1e6,
        }
    }
}

/// What a region does with what its rules save.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Choice {
    /// Left on the device.
    Keep,
    /// Moved to host memory during the forward, brought back ahead of backward.
    Offload,
    /// Dropped, and the region's forward run again in backward from its input.
    Recompute,
}

impl fmt::Display for Choice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Choice::Keep => "keep",
            Choice::Offload => "offload",
            Choice::Recompute => "recompute",
        })
    }
}

/// One region's place in a plan.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlannedRegion {
    /// What the plan does with the region's saved bytes.
    pub choice: Choice,
    /// Its measured cost.
    pub cost: RegionCost,
    /// Milliseconds the choice is predicted to add to the step (a recompute's forward, an
    /// offload's wait for its copy back).
    pub extra_ms: f64,
}

/// A choice for every region and what it is predicted to cost; see the module docs.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryPlan {
    regions: Vec<PlannedRegion>,
    target_bytes: u64,
    peak_bytes: u64,
    plain_bytes: u64,
    extra_ms: f64,
    step_ms: f64,
}

impl MemoryPlan {
    /// Plans `regions` (in forward order) for at most `target_bytes` of activations on the
    /// device; `link` is `None` where nothing can be offloaded (a CPU). A target at or above
    /// what keeping everything holds keeps everything; a target below the least the regions
    /// can reach plans that least and says so ([`MemoryPlan::reached`]). A target of 0, no
    /// regions, or a cost that is not finite and non-negative is an error.
    pub fn new(regions: &[RegionCost], link: Option<Link>, target_bytes: u64) -> Result<Self> {
        check(regions, link, target_bytes)?;
        let mut choices = vec![Choice::Keep; regions.len()];
        let mut now = evaluate(regions, link, &choices).expect("keeping everything is feasible");
        while now.peak > target_bytes {
            let mut best: Option<(f64, u64, usize, Choice, Outcome)> = None;
            for i in 0..regions.len() {
                if choices[i] != Choice::Keep {
                    continue;
                }
                for choice in [Choice::Offload, Choice::Recompute] {
                    if choice == Choice::Offload && link.is_none() {
                        continue;
                    }
                    choices[i] = choice;
                    let outcome = evaluate(regions, link, &choices);
                    choices[i] = Choice::Keep;
                    let Some(outcome) = outcome else { continue };
                    let freed = now.peak.saturating_sub(outcome.peak);
                    if freed == 0 {
                        continue;
                    }
                    let per_byte = (outcome.extra_ms - now.extra_ms).max(0.0) / freed as f64;
                    let better = best
                        .as_ref()
                        .is_none_or(|(b, f, ..)| per_byte < *b || (per_byte == *b && freed > *f));
                    if better {
                        best = Some((per_byte, freed, i, choice, outcome));
                    }
                }
            }
            let Some((_, _, i, choice, outcome)) = best else {
                break; // nothing left frees a byte: the least peak stands
            };
            choices[i] = choice;
            now = outcome;
        }
        let forward: f64 = regions.iter().map(|r| r.forward_ms).sum();
        Ok(Self {
            regions: regions
                .iter()
                .zip(&choices)
                .zip(&now.per_region_ms)
                .map(|((&cost, &choice), &extra_ms)| PlannedRegion {
                    choice,
                    cost,
                    extra_ms,
                })
                .collect(),
            target_bytes,
            peak_bytes: now.peak,
            plain_bytes: plain_peak(regions),
            extra_ms: now.extra_ms,
            step_ms: 3.0 * forward,
        })
    }

    /// Every region's choice, in forward order.
    pub fn choices(&self) -> Vec<Choice> {
        self.regions.iter().map(|r| r.choice).collect()
    }

    /// Every region with its choice, cost and predicted extra time.
    pub fn regions(&self) -> &[PlannedRegion] {
        &self.regions
    }

    /// Whether the predicted peak fits the target.
    pub fn reached(&self) -> bool {
        self.peak_bytes <= self.target_bytes
    }

    /// The target asked for.
    pub fn target_bytes(&self) -> u64 {
        self.target_bytes
    }

    /// The predicted most activation bytes on the device (at the end of the forward, or while
    /// a recomputed or returned region's backward runs).
    pub fn peak_bytes(&self) -> u64 {
        self.peak_bytes
    }

    /// The same with every region kept.
    pub fn plain_bytes(&self) -> u64 {
        self.plain_bytes
    }

    /// Predicted milliseconds the plan adds to the step.
    pub fn extra_ms(&self) -> f64 {
        self.extra_ms
    }

    /// The predicted step without a plan: the forward and a backward of twice its time.
    pub fn step_ms(&self) -> f64 {
        self.step_ms
    }
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        writeln!(
            f,
            "memory plan: peak {:.1} MiB of activations (target {:.1}, everything kept {:.1}){}, \
             predicted step {:.2} ms + {:.2} ms ({:.3}x)",
            mib(self.peak_bytes),
            mib(self.target_bytes),
            mib(self.plain_bytes),
            if self.reached() {
                String::new()
            } else {
                format!(
                    "; the target is below the least this plan reaches: it runs at {:.1} MiB",
                    mib(self.peak_bytes)
                )
            },
            self.step_ms,
            self.extra_ms,
            (self.step_ms + self.extra_ms) / self.step_ms.max(f64::MIN_POSITIVE),
        )?;
        writeln!(
            f,
            "{:>6}  {:<9}  {:>10}  {:>10}  {:>10}  {:>9}",
            "region", "choice", "saved MiB", "input MiB", "forward ms", "extra ms"
        )?;
        for (i, r) in self.regions.iter().enumerate() {
            writeln!(
                f,
                "{i:>6}  {:<9}  {:>10.1}  {:>10.1}  {:>10.3}  {:>9.3}",
                r.choice.to_string(),
                mib(r.cost.saved_bytes),
                mib(r.cost.input_bytes),
                r.cost.forward_ms,
                r.extra_ms
            )?;
        }
        Ok(())
    }
}

fn check(regions: &[RegionCost], link: Option<Link>, target_bytes: u64) -> Result<()> {
    let invalid = |message: String| Err(TensorError::InvalidArgument { op: OP, message });
    if regions.is_empty() {
        return invalid(
            "no regions to plan: give one cost per block of the forward (its time, the bytes \
             its rules save, its input's bytes)"
                .into(),
        );
    }
    if target_bytes == 0 {
        return invalid(
            "a target of 0 bytes cannot be met (each region's input stays on the device); \
             ask for at least the inputs' bytes"
                .into(),
        );
    }
    if let Some(i) = regions
        .iter()
        .position(|r| !(r.forward_ms.is_finite() && r.forward_ms >= 0.0))
    {
        return invalid(format!(
            "region {i}'s forward time is {} ms; it must be finite and >= 0",
            regions[i].forward_ms
        ));
    }
    if let Some(link) = link {
        let rates = [link.to_host_bytes_per_ms, link.to_device_bytes_per_ms];
        if rates.iter().any(|r| !(r.is_finite() && *r > 0.0)) {
            return invalid(format!(
                "the link's rates must be finite and > 0, got {rates:?} bytes/ms; pass no link \
                 where nothing can be offloaded"
            ));
        }
    }
    Ok(())
}

/// The peak with every region kept.
fn plain_peak(regions: &[RegionCost]) -> u64 {
    regions.iter().map(|r| r.input_bytes + r.saved_bytes).sum()
}

/// What a set of choices is predicted to give.
struct Outcome {
    peak: u64,
    extra_ms: f64,
    per_region_ms: Vec<f64>,
}

/// The peak and extra time of `choices`, or `None` when an offload's copy out cannot be done
/// by the end of the forward (it would free nothing at the peak).
fn evaluate(regions: &[RegionCost], link: Option<Link>, choices: &[Choice]) -> Option<Outcome> {
    let n = regions.len();
    let inputs: u64 = regions.iter().map(|r| r.input_bytes).sum();
    let on_device = |i: usize| match choices[i] {
        Choice::Keep => regions[i].saved_bytes,
        _ => 0,
    };
    // At the end of the forward; then, in backward, region i's own bytes (back on the device
    // or rebuilt) beside the kept bytes of the regions before it.
    let kept: u64 = (0..n).map(on_device).sum();
    let mut peak = inputs + kept;
    let mut before = 0u64;
    for i in 0..n {
        if choices[i] != Choice::Keep {
            peak = peak.max(inputs + before + regions[i].saved_bytes);
        }
        before += on_device(i);
    }
    let mut per_region_ms = vec![0.0; n];
    for i in 0..n {
        if choices[i] == Choice::Recompute {
            per_region_ms[i] = regions[i].forward_ms;
        }
    }
    if choices.contains(&Choice::Offload) {
        let link = link?;
        // Copies out, one at a time, each from the end of its region.
        let mut end_of = Vec::with_capacity(n);
        let mut t = 0.0;
        for r in regions {
            t += r.forward_ms;
            end_of.push(t);
        }
        let forward_end = t;
        let mut link_free = 0.0f64;
        for i in (0..n).filter(|&i| choices[i] == Choice::Offload) {
            let start = link_free.max(end_of[i]);
            link_free = start + regions[i].saved_bytes as f64 / link.to_host_bytes_per_ms;
            if link_free > forward_end {
                return None;
            }
        }
        // Backward from the last region: each copy back starts when the backward of the region
        // after it starts and must land before its own; a late one holds the step up.
        let backward_ms = |i: usize| {
            let f = regions[i].forward_ms;
            match choices[i] {
                Choice::Recompute => 3.0 * f,
                _ => 2.0 * f,
            }
        };
        let (mut clock, mut link_free) = (forward_end, forward_end);
        let mut starts = vec![0.0; n];
        for i in (0..n).rev() {
            starts[i] = clock;
            if choices[i] == Choice::Offload {
                let allowed = if i + 1 < n { starts[i + 1] } else { clock };
                let start = link_free.max(allowed);
                link_free = start + regions[i].saved_bytes as f64 / link.to_device_bytes_per_ms;
                let wait = (link_free - clock).max(0.0);
                per_region_ms[i] = wait;
                clock += wait;
                starts[i] = clock;
            }
            clock += backward_ms(i);
        }
    }
    Some(Outcome {
        peak,
        extra_ms: per_region_ms.iter().sum(),
        per_region_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn blocks(n: usize, forward_ms: f64, saved: u64, input: u64) -> Vec<RegionCost> {
        vec![
            RegionCost {
                forward_ms,
                saved_bytes: saved,
                input_bytes: input,
            };
            n
        ]
    }

    #[test]
    fn a_target_at_the_plain_peak_keeps_everything() {
        let regions = blocks(4, 1.0, 100 * MIB, 10 * MIB);
        let plan = MemoryPlan::new(&regions, None, 440 * MIB).unwrap();
        assert_eq!(plan.choices(), vec![Choice::Keep; 4]);
        assert_eq!(plan.peak_bytes(), 440 * MIB);
        assert!(plan.reached());
        assert_eq!(plan.extra_ms(), 0.0);
    }

    #[test]
    fn without_a_link_the_cheapest_per_byte_is_recomputed_first() {
        let mut regions = blocks(4, 2.0, 100 * MIB, 10 * MIB);
        regions[2].forward_ms = 0.5; // as many bytes for a quarter of the time
        let plan = MemoryPlan::new(&regions, None, 400 * MIB).unwrap();
        assert_eq!(
            plan.choices(),
            [Choice::Keep, Choice::Keep, Choice::Recompute, Choice::Keep]
        );
        assert_eq!(plan.extra_ms(), 0.5);
        assert!(plan.reached());
    }

    #[test]
    fn offload_takes_what_the_link_hides_and_recompute_the_rest() {
        // 100 MiB a block at 5 GB/s is about 21 ms a copy, one at a time; each block computes
        // 20 ms forward: the copies of blocks 0 to 5 are done by the end of the forward (160
        // ms), block 6's would not be. To keep one block, block 6 is recomputed.
        let regions = blocks(8, 20.0, 100 * MIB, 10 * MIB);
        let link = Some(Link::gb_per_s(5.0, 5.0));
        let plan = MemoryPlan::new(&regions, link, 80 * MIB + 100 * MIB).unwrap();
        use Choice::{Keep, Offload, Recompute};
        let want = [
            Offload, Offload, Offload, Offload, Offload, Offload, Recompute, Keep,
        ];
        assert_eq!(plan.choices(), want, "{plan}");
        assert!(plan.reached(), "{plan}");
        // Only the recompute costs time: every copy back landed inside the backward.
        assert_eq!(plan.extra_ms(), 20.0, "{plan}");
    }

    #[test]
    fn a_copy_back_that_lands_late_is_counted() {
        // Copies back at 1 GB/s: block 0's 100 MiB take about 105 ms from the start of block
        // 1's backward, which lasts 40 ms: it waits about 65 ms.
        let regions = blocks(2, 20.0, 100 * MIB, 0);
        let link = Link {
            to_host_bytes_per_ms: 1e9,
            to_device_bytes_per_ms: 1e6,
        };
        let offloaded = evaluate(&regions, Some(link), &[Choice::Offload, Choice::Keep]).unwrap();
        let late = 100.0 * MIB as f64 / 1e6 - 40.0;
        assert!(
            (offloaded.extra_ms - late).abs() < 1e-9,
            "{}",
            offloaded.extra_ms
        );
        // Nothing left of the forward hides the last block's copy out.
        assert!(evaluate(&regions, Some(link), &[Choice::Keep, Choice::Offload]).is_none());
    }

    #[test]
    fn a_slow_link_recomputes_instead() {
        // 1 GB/s: a 100 MiB copy takes about 105 ms, longer than the whole forward.
        let regions = blocks(4, 5.0, 100 * MIB, 10 * MIB);
        let plan = MemoryPlan::new(&regions, Some(Link::gb_per_s(1.0, 1.0)), 250 * MIB).unwrap();
        assert!(
            plan.choices().iter().all(|c| *c != Choice::Offload),
            "{plan}"
        );
        assert!(plan.reached(), "{plan}");
    }

    #[test]
    fn an_unreachable_target_runs_at_the_least_peak_and_says_so() {
        let regions = blocks(3, 1.0, 100 * MIB, 10 * MIB);
        let plan = MemoryPlan::new(&regions, None, MIB).unwrap();
        assert!(!plan.reached());
        // Recomputing the last block would free nothing: its backward rebuilds it at once.
        use Choice::{Keep, Recompute};
        assert_eq!(plan.choices(), [Recompute, Recompute, Keep], "{plan}");
        // The inputs and one block's activations.
        assert_eq!(plan.peak_bytes(), 30 * MIB + 100 * MIB);
        assert!(plan.to_string().contains("below the least"), "{plan}");
    }

    #[test]
    fn the_backward_peak_counts_a_rebuilt_region() {
        // Recomputing only the first of two regions frees its bytes at the end of the forward,
        // but they are back while its backward runs: no lower than keeping the other alone.
        let regions = blocks(2, 1.0, 100 * MIB, 0);
        let plan = MemoryPlan::new(&regions, None, 100 * MIB).unwrap();
        assert!(plan.reached(), "{plan}");
        assert_eq!(plan.peak_bytes(), 100 * MIB);
    }

    #[test]
    fn bad_input_is_refused_naming_the_fix() {
        let regions = blocks(2, 1.0, MIB, MIB);
        let says = |r: Result<MemoryPlan>, what: &str| {
            let msg = r.expect_err("an error").to_string();
            assert!(msg.contains(what), "{msg}");
        };
        says(MemoryPlan::new(&[], None, MIB), "one cost per block");
        says(MemoryPlan::new(&regions, None, 0), "at least the inputs");
        let mut nan = regions.clone();
        nan[1].forward_ms = f64::NAN;
        says(MemoryPlan::new(&nan, None, MIB), "region 1");
        let dead = Link::gb_per_s(0.0, 1.0);
        says(MemoryPlan::new(&regions, Some(dead), MIB), "no link");
    }
}
