//! The cost model of the module docs on a [`StepCost`]: the peak, the extra time and whether the
//! offloads fit, for given choices; the least choices; and the choice for a target.

use std::cmp::Ordering;

use super::{Choice, RegionCost, StepCost};

/// Bytes a region holds on the device from its forward until its backward.
fn held(region: &RegionCost, choice: Choice) -> u64 {
    match choice {
        Choice::Keep => region.saved_bytes,
        Choice::Offload => region.saved_bytes - region.offloadable(),
        Choice::Recompute => region.unsaved_input_bytes,
    }
}

/// Whether recomputing `region` is allowed and frees bytes.
fn frees_by_recompute(region: &RegionCost) -> bool {
    region.recomputable && region.unsaved_input_bytes < region.saved_bytes
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

    /// The activation bytes at the peak under `choices`: the end of the forward, or some region's
    /// backward (see the module docs).
    pub(super) fn peak_bytes(&self, choices: &[Choice]) -> u64 {
        let regions = &self.regions;
        let held: Vec<u64> = regions
            .iter()
            .zip(choices)
            .map(|(r, &c)| held(r, c))
            .collect();
        let always = self.always_bytes();
        let mut peak = always + self.head_bytes + held.iter().sum::<u64>();
        let mut below = 0;
        let mut grads = self.outside_grad_bytes + regions.iter().map(|r| r.grad_bytes).sum::<u64>();
        for (k, region) in regions.iter().enumerate() {
            grads -= region.grad_bytes;
            let mut during = always + below + region.saved_bytes + grads;
            if choices[k] == Choice::Recompute {
                during += region.unsaved_input_bytes;
            }
            if k > 0 && choices[k - 1] == Choice::Offload {
                during += regions[k - 1].offloadable();
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

    /// Predicted extra milliseconds: a forward per recomputed region; offload hides in compute.
    pub(super) fn extra_ms(&self, choices: &[Choice]) -> f64 {
        self.regions
            .iter()
            .zip(choices)
            .filter(|(_, c)| **c == Choice::Recompute)
            .fold(0.0, |sum, (r, _)| sum + r.forward_ms)
    }

    /// Whether the link moves every offloaded region out inside the forward compute after it
    /// (one queue, in forward order) and each back inside the backward of the region after it
    /// (its recompute included), within the host memory.
    pub(super) fn offload_fits(&self, choices: &[Choice]) -> bool {
        let offloaded: Vec<usize> = (0..choices.len())
            .filter(|&i| choices[i] == Choice::Offload)
            .collect();
        if offloaded.is_empty() {
            return true;
        }
        let Some(link) = self.link else { return false };
        let regions = &self.regions;
        let n = regions.len();
        let moved: u64 = offloaded.iter().map(|&i| regions[i].offloadable()).sum();
        if self.host_bytes.is_some_and(|host| moved > host) {
            return false;
        }
        let mut after = vec![0.0; n]; // forward ms of the regions after each
        for i in (0..n - 1).rev() {
            after[i] = after[i + 1] + regions[i + 1].forward_ms;
        }
        let mut backlog = 0.0;
        for &i in offloaded.iter().rev() {
            let moved = regions[i].offloadable() as f64;
            backlog += moved / link.to_host_bytes_per_ms;
            if backlog > after[i] || i + 1 == n {
                return false;
            }
            let next = &regions[i + 1];
            let window = next.backward()
                + match choices[i + 1] {
                    Choice::Recompute => next.forward_ms,
                    _ => 0.0,
                };
            if moved / link.to_device_bytes_per_ms > window {
                return false;
            }
        }
        true
    }

    /// The choices at the least peak: recompute wherever that frees bytes, then offload instead
    /// where it fits and the peak does not rise, and keep where the peak does not rise either.
    pub(super) fn least_choices(&self) -> Vec<Choice> {
        let regions = &self.regions;
        let mut choices: Vec<Choice> = regions
            .iter()
            .map(|r| match frees_by_recompute(r) {
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
        for i in self.longest_first(0..regions.len()) {
            if choices[i] == Choice::Recompute {
                let trial = with(&choices, i, Choice::Keep);
                if self.peak_bytes(&trial) <= self.peak_bytes(&choices) {
                    choices = trial;
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
        // Offload is free where it fits: the earliest regions first, they have the widest windows.
        for (i, region) in regions.iter().enumerate() {
            if peak(&choices) <= goal {
                break;
            }
            let trial = with(&choices, i, Choice::Offload);
            if region.offloadable() > 0
                && self.offload_fits(&trial)
                && peak(&trial) <= peak(&choices)
            {
                choices = trial;
            }
        }
        // Recompute: the least time per byte the peak goes down; the last pick is the cheapest
        // region that alone reaches the goal where that costs less.
        while peak(&choices) > goal {
            let now = peak(&choices);
            let candidates: Vec<usize> = (0..n)
                .filter(|&i| choices[i] == Choice::Keep && frees_by_recompute(&regions[i]))
                .collect();
            if candidates.is_empty() {
                break;
            }
            let after: Vec<u64> = candidates
                .iter()
                .map(|&i| peak(&with(&choices, i, Choice::Recompute)))
                .collect();
            let gain = |j: usize| (now - after[j]) as f64; // only where the peak goes down
            let f = |j: usize| regions[candidates[j]].forward_ms;
            let covering = (0..candidates.len()).filter(|&j| after[j] <= goal);
            let gaining = (0..candidates.len()).filter(|&j| after[j] < now);
            let mut pick = first_least(gaining, |j| f(j) / gain(j));
            let cover = first_least(covering, f);
            if let Some(c) = cover
                && pick.is_none_or(|p| f(c) <= f(p))
            {
                pick = Some(c);
            }
            // A plateau: the peak is elsewhere; free the most bytes per ms anyway.
            let pick = pick.unwrap_or_else(|| {
                let freed = |j: usize| {
                    let r = &regions[candidates[j]];
                    (r.saved_bytes - r.unsaved_input_bytes) as f64
                };
                first_least(0..candidates.len(), |j| f(j) / freed(j)).expect("candidates")
            });
            choices[candidates[pick]] = Choice::Recompute;
        }
        // Drop the recomputes the goal no longer needs, or offload them where that now fits (a
        // recompute after a region lengthens its backward window), the most expensive first.
        let mut changed = true;
        while changed {
            changed = false;
            let recomputed = (0..n).filter(|&i| choices[i] == Choice::Recompute);
            for i in self.longest_first(recomputed.collect::<Vec<_>>()) {
                for instead in [Choice::Keep, Choice::Offload] {
                    let trial = with(&choices, i, instead);
                    if (instead == Choice::Keep || regions[i].offloadable() > 0)
                        && self.offload_fits(&trial)
                        && peak(&trial) <= goal
                    {
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
