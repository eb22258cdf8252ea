//! The cost model of the module docs on a [`StepCost`]: the peak, the extra time and whether the
//! offloads fit, for given choices; the least choices; and the choice for a target.

use std::cmp::Ordering;

use super::{Choice, MeasuredPeaks, RegionCost, StepCost};

/// Bytes a region holds on the device from its forward until its backward.
fn held(region: &RegionCost, choice: Choice) -> u64 {
    match choice {
        Choice::Keep => region.saved_bytes,
        Choice::Offload => region.saved_bytes - region.offloadable(),
        Choice::Recompute => region.unsaved_input_bytes,
        Choice::Selective => region
            .selective
            .map_or(region.saved_bytes, |s| s.held_bytes),
        Choice::SelectiveOffload => region.selective.map_or(region.saved_bytes, |s| {
            s.held_bytes.saturating_sub(s.offloadable_bytes)
        }),
    }
}

/// Bytes a choice sends to host memory in the forward and brings back before the region's
/// backward: what offload moves, or a selective recompute's kept outputs.
fn moved(region: &RegionCost, choice: Choice) -> u64 {
    match choice {
        Choice::Offload => region.offloadable(),
        Choice::SelectiveOffload => region.selective.map_or(0, |s| s.offloadable_bytes),
        Choice::Keep | Choice::Recompute | Choice::Selective => 0,
    }
}

/// Whether a choice sends bytes over the link.
fn offloads(choice: Choice) -> bool {
    matches!(choice, Choice::Offload | Choice::SelectiveOffload)
}

/// Milliseconds a choice adds to the step: a recompute's forward, a selective recompute's
/// measured extra; an offload what a step with it was measured to add, else nothing (hidden in
/// compute).
pub(super) fn extra(region: &RegionCost, choice: Choice) -> f64 {
    match choice {
        Choice::Recompute => region.forward_ms,
        Choice::Selective => region.selective.map_or(0.0, |s| s.extra_ms),
        Choice::SelectiveOffload => region
            .selective
            .map_or(0.0, |s| s.offload_extra_ms.unwrap_or(s.extra_ms)),
        Choice::Offload => region.offload_extra_ms.unwrap_or(0.0),
        Choice::Keep => 0.0,
    }
}

/// Whether a recompute (`Recompute` or `Selective`) of `region` is allowed and frees bytes.
fn frees(region: &RegionCost, choice: Choice) -> bool {
    region.recomputable
        && held(region, choice) < region.saved_bytes
        && match choice {
            Choice::Recompute => true,
            Choice::Selective => region.selective.is_some(),
            Choice::SelectiveOffload => region.selective.is_some_and(|s| s.offloadable_bytes > 0),
            Choice::Keep | Choice::Offload => false,
        }
}

/// Whether the region's backward runs a recompute first (which holds its unsaved input).
fn recomputes(choice: Choice) -> bool {
    matches!(
        choice,
        Choice::Recompute | Choice::Selective | Choice::SelectiveOffload
    )
}

fn with(choices: &[Choice], i: usize, choice: Choice) -> Vec<Choice> {
    let mut out = choices.to_vec();
    out[i] = choice;
    out
}

/// The first of `items` with the least `key` (as Python's `min`).
fn first_least(
    items: impl IntoIterator<Item = usize>,
    key: impl Fn(usize) -> f64,
) -> Option<usize> {
    let mut best: Option<(usize, f64)> = None;
    for i in items {
        let k = key(i);
        if best.is_none_or(|(_, b)| k < b) {
            best = Some((i, k));
        }
    }
    best.map(|(i, _)| i)
}

impl StepCost {
    /// Bytes alive through the whole step whatever the plan: shared, and every region's input.
    fn always_bytes(&self) -> u64 {
        self.shared_bytes + self.regions.iter().map(|r| r.input_bytes).sum::<u64>()
    }

    /// The regions' indices, the longest forward first (ties in forward order).
    fn longest_first(&self, indices: impl IntoIterator<Item = usize>) -> Vec<usize> {
        let mut out: Vec<usize> = indices.into_iter().collect();
        let f = |i: usize| self.regions[i].forward_ms;
        out.sort_by(|&a, &b| f(b).partial_cmp(&f(a)).unwrap_or(Ordering::Equal));
        out
    }

    /// The bytes at the peak under `choices`: the end of the forward, or some region's backward
    /// (see the module docs); from the measured peaks where the profile measured them.
    pub(super) fn peak_bytes(&self, choices: &[Choice]) -> u64 {
        match &self.measured {
            Some(measured) => self.measured_peak(measured, choices),
            None => self.modelled_peak(choices),
        }
    }

    /// The measured step's peaks, each less what `choices` free before it (the regions before
    /// it hold less) and plus what they add to it (a recompute's unsaved input; the upload of
    /// the region before, which `freed` took off).
    fn measured_peak(&self, measured: &MeasuredPeaks, choices: &[Choice]) -> u64 {
        let regions = &self.regions;
        // Signed: a forced recompute may hold more than its region saved.
        let freed: Vec<i128> = regions
            .iter()
            .zip(choices)
            .map(|(r, &c)| i128::from(r.saved_bytes) - i128::from(held(r, c)))
            .collect();
        // autocast's casts stay cached until the forward ends, whatever is chosen.
        let cached: i128 = regions
            .iter()
            .zip(choices)
            .filter(|(_, c)| **c != Choice::Keep)
            .map(|(r, _)| i128::from(r.cached_bytes))
            .sum();
        let mut peak = i128::from(measured.forward_bytes) - freed.iter().sum::<i128>() + cached;
        let mut below = 0;
        for (k, region) in regions.iter().enumerate() {
            let mut during = i128::from(measured.backward_bytes[k]) - below;
            if recomputes(choices[k]) {
                during += i128::from(region.unsaved_input_bytes);
            }
            if k > 0 {
                during += i128::from(moved(&regions[k - 1], choices[k - 1]));
            }
            peak = peak.max(during);
            below += freed[k];
        }
        u64::try_from(peak.max(0)).unwrap_or(u64::MAX)
    }

    /// The peak from the costs alone: saved bytes, inputs, gradients.
    fn modelled_peak(&self, choices: &[Choice]) -> u64 {
        let regions = &self.regions;
        let held: Vec<u64> = regions
            .iter()
            .zip(choices)
            .map(|(r, &c)| held(r, c))
            .collect();
        let always = self.always_bytes();
        // autocast's casts of a region's parameters stay cached until the forward ends.
        let cached: u64 = regions
            .iter()
            .zip(choices)
            .filter(|(_, c)| **c != Choice::Keep)
            .map(|(r, _)| r.cached_bytes)
            .sum();
        let mut peak = always + self.head_bytes + held.iter().sum::<u64>() + cached;
        let mut below = 0;
        let mut grads = self.outside_grad_bytes + regions.iter().map(|r| r.grad_bytes).sum::<u64>();
        for (k, region) in regions.iter().enumerate() {
            grads -= region.grad_bytes;
            let mut during = always + below + region.saved_bytes + grads;
            if recomputes(choices[k]) {
                during += region.unsaved_input_bytes;
            }
            if k > 0 {
                during += moved(&regions[k - 1], choices[k - 1]);
            }
            peak = peak.max(during);
            below += held[k];
        }
        peak
    }

    /// The peak with every region kept.
    pub(super) fn plain_bytes(&self) -> u64 {
        self.peak_bytes(&vec![Choice::Keep; self.regions.len()])
    }

    /// Predicted extra milliseconds: a forward per recomputed region, the measured extra of
    /// each selective one and of each offload measured (an unmeasured one hides in compute).
    pub(super) fn extra_ms(&self, choices: &[Choice]) -> f64 {
        self.regions
            .iter()
            .zip(choices)
            .fold(0.0, |sum, (r, &c)| sum + extra(r, c))
    }

    /// Whether the link moves every offloaded region out inside the forward compute after it
    /// (one queue, in forward order) and each back inside the backward of the region after it
    /// (its recompute included), within the host memory.
    pub(super) fn offload_fits(&self, choices: &[Choice]) -> bool {
        let offloaded: Vec<usize> = (0..choices.len())
            .filter(|&i| offloads(choices[i]))
            .collect();
        if offloaded.is_empty() {
            return true;
        }
        let Some(link) = self.link else { return false };
        let regions = &self.regions;
        let n = regions.len();
        let total: u64 = offloaded
            .iter()
            .map(|&i| moved(&regions[i], choices[i]))
            .sum();
        if self.host_bytes.is_some_and(|host| total > host) {
            return false;
        }
        let mut after = vec![0.0; n]; // forward ms of the regions after each
        for i in (0..n - 1).rev() {
            after[i] = after[i + 1] + regions[i + 1].forward_ms;
        }
        let mut backlog = 0.0;
        for &i in offloaded.iter().rev() {
            let moved = moved(&regions[i], choices[i]) as f64;
            backlog += moved / link.to_host_bytes_per_ms;
            if backlog > after[i] || i + 1 == n {
                return false;
            }
            let next = &regions[i + 1];
            let window = next.backward() + extra(next, choices[i + 1]);
            if moved / link.to_device_bytes_per_ms > window {
                return false;
            }
        }
        true
    }

    /// The choices at the least peak: recompute wherever that frees bytes, then offload instead
    /// where it fits and the peak does not rise, keep where the peak does not rise either, and
    /// recompute selectively where that does not raise it.
    pub(super) fn least_choices(&self) -> Vec<Choice> {
        let regions = &self.regions;
        let mut choices: Vec<Choice> = regions
            .iter()
            .map(|r| match frees(r, Choice::Recompute) {
                true => Choice::Recompute,
                false => Choice::Keep,
            })
            .collect();
        for (i, region) in regions.iter().enumerate() {
            let left = region.saved_bytes - region.offloadable();
            if region.offloadable() > 0 && left <= held(region, choices[i]) {
                let trial = with(&choices, i, Choice::Offload);
                if self.offload_fits(&trial) && self.peak_bytes(&trial) <= self.peak_bytes(&choices)
                {
                    choices = trial;
                }
            }
        }
        for instead in [Choice::Keep, Choice::Selective, Choice::SelectiveOffload] {
            for i in self.longest_first(0..regions.len()) {
                if choices[i] == Choice::Recompute
                    && (instead == Choice::Keep || frees(&regions[i], instead))
                {
                    let trial = with(&choices, i, instead);
                    if self.offload_fits(&trial)
                        && self.peak_bytes(&trial) <= self.peak_bytes(&choices)
                    {
                        choices = trial;
                    }
                }
            }
        }
        choices
    }

    /// The choices for `target_bytes` (checked), or `least` where the target is below the least
    /// peak or the search falls short of it; see the module docs.
    pub(super) fn choose(&self, target_bytes: u64, least: Vec<Choice>) -> Vec<Choice> {
        let regions = &self.regions;
        let n = regions.len();
        let goal = target_bytes.max(self.peak_bytes(&least));
        let peak = |c: &[Choice]| self.peak_bytes(c);
        let mut choices = vec![Choice::Keep; n];
        // Offload is free where it fits and no step measured it dear: the earliest regions
        // first, they have the widest windows.
        for (i, region) in regions.iter().enumerate() {
            if peak(&choices) <= goal {
                break;
            }
            let trial = with(&choices, i, Choice::Offload);
            if region.offloadable() > 0
                && extra(region, Choice::Offload) == 0.0
                && self.offload_fits(&trial)
                && peak(&trial) <= peak(&choices)
            {
                choices = trial;
            }
        }
        // Then a kept region offloaded at its measured cost, or a kept or offloaded one
        // recomputed selectively (its kept outputs offloaded where the link has room) or whole,
        // a selective one with its outputs offloaded or whole; each
        // time the move that lowers the peak at the least time per byte, the last pick the
        // cheapest move that alone reaches the goal where that costs less. Where no move lowers
        // the peak, the one freeing the most bytes per ms without raising it (bytes held, or
        // uploaded beside the next region's backward). Each move lowers the peak, or keeps it
        // and lowers those bytes: the search ends.
        let load = |i: usize, c: Choice| (held(&regions[i], c) + moved(&regions[i], c)) as f64;
        while peak(&choices) > goal {
            let now = peak(&choices);
            let moves: Vec<(usize, Choice)> = (0..n)
                .filter(|&i| choices[i] != Choice::Recompute)
                .flat_map(|i| {
                    [
                        Choice::Offload,
                        Choice::Selective,
                        Choice::SelectiveOffload,
                        Choice::Recompute,
                    ]
                    .map(|c| (i, c))
                })
                .filter(|&(i, c)| {
                    c != choices[i]
                        && if c == Choice::Offload {
                            choices[i] == Choice::Keep && regions[i].offloadable() > 0
                        } else {
                            frees(&regions[i], c)
                        }
                        && extra(&regions[i], c) >= extra(&regions[i], choices[i])
                        && (!offloads(c) || self.offload_fits(&with(&choices, i, c)))
                })
                .collect();
            let after: Vec<u64> = moves
                .iter()
                .map(|&(i, c)| peak(&with(&choices, i, c)))
                .collect();
            let gain = |j: usize| (now - after[j]) as f64; // only where the peak goes down
            let cost = |j: usize| {
                let (i, c) = moves[j];
                extra(&regions[i], c) - extra(&regions[i], choices[i])
            };
            let freed = |j: usize| {
                let (i, c) = moves[j];
                load(i, choices[i]) - load(i, c)
            };
            let covering = (0..moves.len()).filter(|&j| after[j] <= goal);
            let gaining = (0..moves.len()).filter(|&j| after[j] < now);
            let mut pick = first_least(gaining, |j| cost(j) / gain(j));
            let cover = first_least(covering, cost);
            if let Some(c) = cover
                && pick.is_none_or(|p| cost(c) <= cost(p))
            {
                pick = Some(c);
            }
            let plateau = (0..moves.len()).filter(|&j| after[j] == now && freed(j) > 0.0);
            let Some(pick) = pick.or_else(|| first_least(plateau, |j| cost(j) / freed(j))) else {
                break;
            };
            let (i, c) = moves[pick];
            choices[i] = c;
        }
        // Drop the recomputes the goal no longer needs, offload them where that now fits (a
        // recompute after a region lengthens its backward window), or make a whole one selective,
        // the most expensive first.
        let mut changed = true;
        while changed {
            changed = false;
            let mut recomputed: Vec<usize> = (0..n).filter(|&i| recomputes(choices[i])).collect();
            let cost = |i: usize, c: &[Choice]| extra(&regions[i], c[i]);
            recomputed.sort_by(|&a, &b| {
                cost(b, &choices)
                    .partial_cmp(&cost(a, &choices))
                    .unwrap_or(Ordering::Equal)
            });
            for i in recomputed {
                let region = &regions[i];
                for instead in [
                    Choice::Keep,
                    Choice::Offload,
                    Choice::Selective,
                    Choice::SelectiveOffload,
                ] {
                    let allowed = match instead {
                        Choice::Keep => true,
                        Choice::Offload => {
                            region.offloadable() > 0
                                && extra(region, instead) < extra(region, choices[i])
                        }
                        _ => {
                            choices[i] == Choice::Recompute
                                && frees(region, instead)
                                && extra(region, instead) < extra(region, choices[i])
                        }
                    };
                    let trial = with(&choices, i, instead);
                    if allowed && self.offload_fits(&trial) && peak(&trial) <= goal {
                        choices = trial;
                        changed = true;
                        break;
                    }
                }
            }
        }
        if peak(&choices) > goal {
            return least;
        }
        choices
    }
}
