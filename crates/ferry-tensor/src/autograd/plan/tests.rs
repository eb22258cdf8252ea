//! The planner on synthetic costs: each part of the cost model of the module docs, and the choice.

use super::*;
use Choice::{Keep as K, Offload as O, Recompute as R};

const MIB: u64 = 1 << 20;

/// `n` regions of `forward_ms`, `saved` and `input` bytes, nothing outside them.
fn blocks(n: usize, forward_ms: f64, saved: u64, input: u64) -> Vec<RegionCost> {
    vec![RegionCost::new(forward_ms, saved, input); n]
}

/// A step of regions of these forward ms and saved MiB, with `head` MiB after the last.
fn step(forward_ms: &[f64], saved_mib: &[u64], head_mib: u64) -> StepCost {
    StepCost {
        regions: forward_ms
            .iter()
            .zip(saved_mib)
            .map(|(&f, &s)| RegionCost::new(f, s * MIB, 0))
            .collect(),
        head_bytes: head_mib * MIB,
        ..StepCost::default()
    }
}

/// A link moving `mib` MiB in `out_ms` to the host and `in_ms` back.
fn link(mib: u64, out_ms: f64, in_ms: f64) -> Link {
    let bytes = (mib * MIB) as f64;
    Link {
        to_host_bytes_per_ms: bytes / out_ms,
        to_device_bytes_per_ms: bytes / in_ms,
    }
}

fn plan(step: &StepCost, target_mib: u64) -> MemoryPlan {
    MemoryPlan::for_step(step, target_mib * MIB).unwrap()
}

fn peak_mib(step: &StepCost, choices: &[Choice]) -> u64 {
    let bytes = MemoryPlan::with_choices(step, choices)
        .unwrap()
        .peak_bytes();
    assert_eq!(bytes % MIB, 0, "{bytes}");
    bytes / MIB
}

#[test]
fn a_target_at_the_plain_peak_keeps_everything() {
    let regions = blocks(4, 1.0, 100 * MIB, 10 * MIB);
    let plan = MemoryPlan::new(&regions, None, 440 * MIB).unwrap();
    assert_eq!(plan.choices(), vec![K; 4]);
    assert_eq!(plan.peak_bytes(), 440 * MIB);
    assert!(plan.reached());
    assert_eq!(plan.extra_ms(), 0.0);
    assert_eq!(
        plan.step_ms(),
        12.0,
        "a forward and twice it in backward per block"
    );
}

#[test]
fn without_a_link_the_cheapest_per_byte_is_recomputed_first() {
    let mut regions = blocks(4, 2.0, 100 * MIB, 10 * MIB);
    regions[2].forward_ms = 0.5; // as many bytes for a quarter of the time
    let plan = MemoryPlan::new(&regions, None, 400 * MIB).unwrap();
    assert_eq!(plan.choices(), [K, K, R, K]);
    assert_eq!(plan.extra_ms(), 0.5);
    assert!(plan.reached());
}

#[test]
fn recompute_takes_the_cheapest_per_byte_first_and_the_cheapest_cover_last() {
    // ms per MiB: r0 0.04, r1 0.06, r2 0.1, r3 0.02; the loss's 1000 MiB keep the peak at the
    // end of the forward.
    let step = step(&[4.0, 3.0, 1.0, 2.0], &[100, 50, 10, 100], 1000);
    assert_eq!(plan(&step, 1160).choices(), [K, K, K, R]);
    // 200 MiB: r3 (cheapest per byte), then r0 covers the rest.
    let p = plan(&step, 1060);
    assert_eq!((p.choices(), p.extra_ms()), (vec![R, K, K, R], 6.0));
    // 10 MiB: r2 alone covers it in 1 ms, less than the cheapest per byte (r3, 2 ms).
    assert_eq!(plan(&step, 1250).choices(), [K, K, R, K]);
    for target in [1160, 1060, 1250] {
        let p = plan(&step, target);
        assert!(p.peak_bytes() <= target * MIB, "{p}");
        assert_eq!(p.peak_bytes(), peak_mib(&step, &p.choices()) * MIB);
    }
}

#[test]
fn a_recompute_the_target_no_longer_needs_is_dropped() {
    // r0 is the cheapest per byte (0.05 ms/MiB) but frees 20 of the 90 MiB; r1 (0.06) then
    // covers the rest alone, which leaves r0's recompute unneeded: 6 ms, not 7.
    let step = step(&[1.0, 6.0, 100.0], &[20, 100, 10], 1000);
    let p = plan(&step, 1040);
    assert_eq!(p.choices(), [K, R, K], "{p}");
    assert_eq!((p.extra_ms(), p.peak_bytes()), (6.0, 1030 * MIB));
}

#[test]
fn a_recompute_becomes_an_offload_once_the_one_after_lengthens_its_window() {
    // Backward as long as the forward, 10 ms; a copy back takes 15 ms: no region's upload fits
    // the backward after it, until r1 is recomputed (its window is then 10 + 10 ms), so r0's
    // recompute turns into an offload.
    let mut step = step(&[10.0; 3], &[100; 3], 1000);
    for r in &mut step.regions {
        r.backward_ms = Some(10.0);
    }
    step.link = Some(link(100, 1.0, 15.0));
    assert!(
        !MemoryPlan::with_choices(&step, &[O, K, K])
            .unwrap()
            .offload_fits()
    );
    assert!(
        MemoryPlan::with_choices(&step, &[O, R, K])
            .unwrap()
            .offload_fits()
    );
    let p = plan(&step, 1100);
    assert_eq!((p.choices(), p.extra_ms()), (vec![O, R, K], 10.0), "{p}");
}

#[test]
fn offload_takes_what_the_link_moves_inside_the_compute_after_it() {
    // Four regions of 10 ms forward, 20 ms backward, 100 MiB each. A link at 100 MiB per 20 ms:
    // region 0's copy out fits the 30 ms of forward after it and its upload the 20 ms backward
    // of region 1; region 1's copy would queue behind it (40 ms in a 30 ms window), region 2's
    // has 10 ms, region 3's none. Freeing 250 MiB: offload region 0, recompute two others.
    let mut slow = step(&[10.0; 4], &[100; 4], 1000);
    slow.link = Some(link(100, 20.0, 20.0));
    assert_eq!(slow.plain_bytes(), 1400 * MIB);
    let p = plan(&slow, 1150);
    assert_eq!(p.choices(), [O, R, R, K], "{p}");
    assert_eq!((p.peak_bytes(), p.extra_ms()), (1100 * MIB, 20.0));
    assert!(!slow.offload_fits(&[O, O, K, K]));
    // At 100 MiB per 10 ms regions 0, 1 and 2 all fit (backlogs 30, 20 and 10 ms in windows of
    // 30, 20 and 10): offload alone frees the 250 MiB, at no extra time.
    let mut fast = slow.clone();
    fast.link = Some(link(100, 10.0, 10.0));
    let p = plan(&fast, 1150);
    assert_eq!(p.choices(), [O, O, O, K], "{p}");
    assert_eq!((p.peak_bytes(), p.extra_ms()), (1100 * MIB, 0.0));
    // The last region has no compute after it: never offloaded.
    assert!(!fast.offload_fits(&[K, K, K, O]));
    // Without a link (the CPU), the same target is met by recompute alone.
    fast.link = None;
    let p = plan(&fast, 1150);
    assert!(!p.choices().contains(&O));
    assert_eq!(p.choices().iter().filter(|c| **c == R).count(), 3, "{p}");
}

#[test]
fn an_offloaded_region_is_back_on_the_device_during_the_next_ones_backward() {
    // 100 MiB a block at 5 GB/s is about 21 ms a copy; 20 ms of forward each: the copies of
    // blocks 0 to 5 are done by the end of the forward (160 ms), block 6's would not be. Block
    // 5's upload runs during block 6's backward, so the peak stays at two blocks beside the
    // inputs, and recomputing blocks 6 and 7 cannot lower it: below that the plan recomputes.
    let regions = blocks(8, 20.0, 100 * MIB, 10 * MIB);
    let link = Some(Link::gb_per_s(5.0, 5.0));
    let p = MemoryPlan::new(&regions, link, 80 * MIB + 200 * MIB).unwrap();
    assert_eq!(p.choices(), [O, O, O, O, O, O, K, K], "{p}");
    assert_eq!(p.extra_ms(), 0.0, "{p}");
    let p = MemoryPlan::new(&regions, link, 80 * MIB + 100 * MIB).unwrap();
    assert_eq!(p.choices(), [R, R, R, R, R, R, R, K], "{p}");
    assert!(p.reached(), "{p}");
    // Offloading the block before the last alone frees nothing: it is back for the last's
    // backward beside the last's own bytes.
    let step = StepCost::new(
        &blocks(3, 10.0, 100 * MIB, 0),
        Some(Link::gb_per_s(1e3, 1e3)),
    );
    assert_eq!(peak_mib(&step, &[K, K, K]), 300);
    assert_eq!(peak_mib(&step, &[K, O, K]), 300);
    assert_eq!(peak_mib(&step, &[O, K, K]), 200);
}

#[test]
fn a_copy_back_that_would_land_late_is_not_offloaded() {
    // Copies back at 1 GB/s: block 0's 100 MiB take about 105 ms, block 1's backward 40 ms.
    let regions = blocks(2, 20.0, 100 * MIB, 0);
    let slow_back = Link {
        to_host_bytes_per_ms: 1e9,
        to_device_bytes_per_ms: 1e6,
    };
    let step = StepCost::new(&regions, Some(slow_back));
    assert!(!step.offload_fits(&[O, K]));
    // Measured, block 1's backward is long enough.
    let mut measured = step.clone();
    measured.regions[1].backward_ms = Some(110.0);
    assert!(measured.offload_fits(&[O, K]));
    // Nothing left of the forward hides the last block's copy out.
    assert!(!measured.offload_fits(&[K, O]));
    // A forced offload that does not fit is predicted at no extra time, and says it does not fit.
    let forced = MemoryPlan::with_choices(&step, &[O, K]).unwrap();
    assert!(!forced.offload_fits() && forced.extra_ms() == 0.0);
}

#[test]
fn a_slow_link_recomputes_instead() {
    // 1 GB/s: a 100 MiB copy takes about 105 ms, longer than the whole forward.
    let regions = blocks(4, 5.0, 100 * MIB, 10 * MIB);
    let plan = MemoryPlan::new(&regions, Some(Link::gb_per_s(1.0, 1.0)), 250 * MIB).unwrap();
    assert!(!plan.choices().contains(&O), "{plan}");
    assert!(plan.reached(), "{plan}");
}

#[test]
fn offload_takes_only_its_movable_part_and_the_host_room() {
    // Head 1000 MiB; links fast enough for every window.
    let mut step = step(&[10.0; 3], &[100; 3], 1000);
    step.link = Some(link(100, 1.0, 1.0));
    step.regions[0].offloadable_bytes = Some(60 * MIB);
    assert_eq!(peak_mib(&step, &[O, K, K]), 1240);
    step.regions[0].offloadable_bytes = Some(0);
    assert_eq!(plan(&step, 1200).choices(), [K, O, K]);
    // The pinned pool has room for one region: the second 100 MiB are recomputed.
    step.regions[0].offloadable_bytes = None;
    step.host_bytes = Some(100 * MIB);
    assert!(!step.offload_fits(&[O, O, K]));
    let p = plan(&step, 1100);
    assert_eq!((p.choices(), p.extra_ms()), (vec![O, R, K], 10.0), "{p}");
    step.host_bytes = None;
    assert_eq!(plan(&step, 1100).choices(), [O, O, K]);
}

#[test]
fn a_region_that_writes_its_input_or_holds_as_much_input_is_never_recomputed() {
    let mut step = step(&[1.0; 3], &[100; 3], 1000);
    step.regions[0].recomputable = false;
    assert_eq!(plan(&step, 1100).choices(), [K, R, R]);
    // A recompute holds the input nothing else saves: 30 MiB of region 1's.
    step.regions[1].unsaved_input_bytes = 30 * MIB;
    assert_eq!(peak_mib(&step, &[K, R, K]), 1230);
    step.regions[1].unsaved_input_bytes = 100 * MIB; // frees nothing
    let p = plan(&step, 1);
    assert_eq!(p.choices(), [K, K, R], "{p}");
    assert_eq!(p.least_bytes(), 1200 * MIB);
}

#[test]
fn gradients_made_in_backward_and_shared_bytes_count_at_the_peak() {
    // Two regions of 100 MiB, 50 MiB of gradients each, 30 outside: in the last region's
    // backward, region 0's bytes, its own and the outside gradients: 230 MiB, above the
    // forward's 200.
    let mut step = step(&[1.0; 2], &[100; 2], 0);
    for r in &mut step.regions {
        r.grad_bytes = 50 * MIB;
    }
    step.outside_grad_bytes = 30 * MIB;
    assert_eq!(step.plain_bytes(), 230 * MIB);
    // Recomputing region 0: its backward holds its bytes and region 1's and the outside
    // gradients.
    assert_eq!(peak_mib(&step, &[R, K]), 180);
    step.shared_bytes = 20 * MIB; // alive throughout
    assert_eq!(peak_mib(&step, &[R, K]), 200);
    step.regions[1].input_bytes = 5 * MIB; // a region's input counts as shared
    assert_eq!(peak_mib(&step, &[R, K]), 205);
}

#[test]
fn the_peak_counts_a_region_recomputed_during_backward() {
    // Without a head, recomputing the last region frees nothing at the peak: its backward brings
    // its bytes back while every earlier region still holds its own.
    let step = step(&[1.0; 3], &[100; 3], 0);
    assert_eq!(peak_mib(&step, &[K, K, R]), 300);
    assert_eq!(peak_mib(&step, &[R, K, K]), 200);
    // So the least peak keeps the last region (and saves its recompute).
    let p = plan(&step, 100);
    assert_eq!((p.choices(), p.least_bytes()), (vec![R, R, K], 100 * MIB));
    // The head, freed before backward, counts only at the end of the forward.
    let mut headed = step.clone();
    headed.head_bytes = 1000 * MIB;
    assert_eq!(peak_mib(&headed, &[K, K, R]), 1200);
}

#[test]
fn an_unreachable_target_runs_at_the_least_peak_and_says_so() {
    let regions = blocks(3, 1.0, 100 * MIB, 10 * MIB);
    let p = MemoryPlan::new(&regions, None, MIB).unwrap();
    assert!(!p.reached());
    assert_eq!(p.choices(), [R, R, K], "{p}");
    // The inputs and one block's activations.
    assert_eq!(p.peak_bytes(), 30 * MIB + 100 * MIB);
    assert_eq!(p.least_bytes(), p.peak_bytes());
    assert!(p.to_string().contains("below the least"), "{p}");
    // Head and shared stay.
    let mut step = step(&[1.0, 2.0, 3.0], &[100; 3], 400);
    step.shared_bytes = 50 * MIB;
    let p = plan(&step, 60);
    assert!(!p.reached());
    assert_eq!((p.least_bytes(), p.peak_bytes()), (450 * MIB, 450 * MIB));
    assert_eq!(p.choices(), [R, R, R]);
}

#[test]
fn bad_input_is_refused_naming_the_fix() {
    let regions = blocks(2, 1.0, MIB, MIB);
    let says = |r: Result<MemoryPlan>, what: &str| {
        let msg = r.expect_err("an error").to_string();
        assert!(msg.contains(what), "{msg}");
    };
    says(MemoryPlan::new(&[], None, MIB), "one cost per block");
    says(MemoryPlan::new(&regions, None, 0), "must be > 0");
    says(
        MemoryPlan::new(&regions, None, 4 * MIB + 1),
        "above what the step saves",
    );
    says(
        MemoryPlan::new(&blocks(2, 1.0, 0, MIB), None, MIB),
        "save no tensors",
    );
    let mut nan = regions.clone();
    nan[1].forward_ms = f64::NAN;
    says(MemoryPlan::new(&nan, None, MIB), "region 1");
    let mut back = regions.clone();
    back[0].backward_ms = Some(-1.0);
    says(MemoryPlan::new(&back, None, MIB), "region 0's backward");
    let mut part = regions.clone();
    part[0].offloadable_bytes = Some(2 * MIB);
    says(MemoryPlan::new(&part, None, MIB), "exceed its saved_bytes");
    let dead = Link::gb_per_s(0.0, 1.0);
    says(MemoryPlan::new(&regions, Some(dead), MIB), "no link");
    let huge = StepCost {
        shared_bytes: u64::MAX,
        ..StepCost::new(&regions, None)
    };
    says(MemoryPlan::for_step(&huge, MIB), "past 2^64");
    let two = StepCost::new(&regions, None);
    says(
        MemoryPlan::with_choices(&two, &[K]),
        "1 choices for 2 regions",
    );
}

/// `n` regions of 10 ms forward and 100 MiB saved, each selectively recomputable to hold
/// `held_mib` at `extra_ms`.
fn selective_blocks(n: usize, held_mib: u64, extra_ms: f64) -> StepCost {
    let region = RegionCost {
        selective: Some(Selective {
            held_bytes: held_mib * MIB,
            extra_ms,
            offloadable_bytes: held_mib * MIB,
            offload_extra_ms: None,
        }),
        ..RegionCost::new(10.0, 100 * MIB, 0)
    };
    StepCost::new(&vec![region; n], None)
}

#[test]
fn a_cheap_selective_recompute_comes_before_whole_ones() {
    use Choice::Selective as S;
    let step = selective_blocks(4, 40, 1.0);
    assert_eq!(peak_mib(&step, &[K; 4]), 400);
    // Each selective region holds 40 MiB instead of 100: at the end of the forward three of them
    // give 3 x 40 + 100 = 220 MiB, and the last region's backward (the first to run) sees the
    // same.
    let p = plan(&step, 250);
    assert!(!p.choices().contains(&R), "{p}");
    let selective = p.choices().iter().filter(|&&c| c == S).count();
    assert_eq!(selective, 3, "{p}");
    assert!(p.peak_bytes() <= 250 * MIB, "{p}");
    assert_eq!(p.extra_ms(), 3.0, "{p}");
    // Below what selective recomputes reach, whole recomputes take over; the least peak is as
    // low as without selective costs.
    let low = plan(&step, 150);
    assert!(low.choices().contains(&R), "{low}");
    assert!(low.peak_bytes() <= 150 * MIB, "{low}");
    let whole = StepCost::new(&blocks(4, 10.0, 100 * MIB, 0), None);
    assert_eq!(low.least_bytes(), plan(&whole, 400).least_bytes());
    // The least plan keeps the selective ones where whole recomputes would not lower its peak.
    let least = plan(&step, 1);
    assert!(!least.reached());
    assert!(least.extra_ms() < 40.0, "{least}");
}

#[test]
fn a_selective_recompute_dearer_than_the_whole_one_is_not_chosen() {
    use Choice::Selective as S;
    let step = selective_blocks(4, 40, 12.0);
    for target in [350, 250, 150] {
        let p = plan(&step, target);
        assert!(!p.choices().contains(&S), "{target}: {p}");
        assert!(p.peak_bytes() <= target * MIB, "{p}");
    }
}

#[test]
fn a_whole_recompute_becomes_selective_where_that_still_meets_the_target() {
    use Choice::Selective as S;
    // Region 0 is cheap to recompute whole and frees the most per ms; once the others are
    // recomputed, its selective recompute (cheaper still) meets the target too.
    let mut step = selective_blocks(3, 50, 0.5);
    step.regions[0].forward_ms = 1.0;
    let p = plan(&step, 250);
    assert!(p.peak_bytes() <= 250 * MIB, "{p}");
    let extra: f64 = p.regions().iter().map(|r| r.extra_ms).sum();
    assert_eq!(extra, p.extra_ms());
    assert!(p.extra_ms() <= 1.0, "{p}");
    assert!(p.choices().contains(&S), "{p}");
}

#[test]
fn selective_costs_are_checked() {
    use Choice::Selective as S;
    let plain = StepCost::new(&blocks(2, 1.0, MIB, 0), None);
    let err = MemoryPlan::with_choices(&plain, &[S, K]).unwrap_err();
    assert!(
        err.to_string().contains("no measured selective cost"),
        "{err}"
    );
    let mut step = selective_blocks(2, 40, f64::NAN);
    let err = MemoryPlan::for_step(&step, 100 * MIB).unwrap_err();
    assert!(
        err.to_string().contains("selective recompute time"),
        "{err}"
    );
    // A region that writes its input in place is never recomputed, selectively either.
    step = selective_blocks(2, 40, 1.0);
    step.regions[0].recomputable = false;
    let p = plan(&step, 160);
    assert_eq!(p.choices()[0], K, "{p}");
}

#[test]
fn selective_outputs_go_to_the_host_where_the_link_moves_them_in_the_compute() {
    use Choice::{Selective as S, SelectiveOffload as X};
    // The kept 40 MiB of a block move in 5 ms each way, inside the next block's 10 ms forward and
    // 20 ms backward: a selective recompute with its outputs offloaded holds what a whole
    // recompute holds (nothing here) at the selective's 1 ms.
    let mut step = selective_blocks(4, 40, 1.0);
    step.link = Some(link(40, 5.0, 5.0));
    let whole = StepCost {
        link: step.link,
        ..StepCost::new(&blocks(4, 10.0, 100 * MIB, 0), None)
    };
    let p = plan(&step, 150);
    assert!(p.peak_bytes() <= 150 * MIB, "{p}");
    assert!(p.choices().contains(&X), "{p}");
    assert!(!p.choices().contains(&R), "{p}");
    assert!(p.offload_fits(), "{p}");
    assert!(p.extra_ms() < plan(&whole, 150).extra_ms(), "{p}");
    // The last block has no compute after it: never sent to the host.
    assert_ne!(p.choices()[3], X, "{p}");
    // Its uploaded bytes count in the next block's backward, as an offload's do: 40 MiB above
    // whole recomputes, which hold as little.
    assert_eq!(peak_mib(&step, &[R, R, R, K]), 100);
    assert_eq!(peak_mib(&step, &[X, X, X, K]), 140);
    // A link too slow to hide them (40 MiB in 50 ms): selective or whole recomputes instead.
    step.link = Some(link(40, 50.0, 50.0));
    let slow = plan(&step, 150);
    assert!(!slow.choices().contains(&X), "{slow}");
    assert!(slow.choices().iter().any(|&c| c == S || c == R), "{slow}");
    // Without a link: never.
    step.link = None;
    assert!(!plan(&step, 150).choices().contains(&X));
    let err = MemoryPlan::with_choices(&StepCost::new(&blocks(2, 1.0, MIB, 0), None), &[X, K])
        .unwrap_err();
    assert!(
        err.to_string().contains("no measured selective cost"),
        "{err}"
    );
}

#[test]
fn an_offload_measured_dear_is_chosen_at_its_cost() {
    use Choice::{Offload as O, Selective as S, SelectiveOffload as X};
    // The link hides the kept outputs (as in the test above), but a step with them offloaded
    // was measured 6 ms dearer than the selective recompute alone: the runtime waited for the
    // copies. The plan takes the 1 ms selective recomputes where they reach the target.
    let mut step = selective_blocks(4, 40, 1.0);
    step.link = Some(link(40, 5.0, 5.0));
    for region in &mut step.regions {
        region.selective.as_mut().unwrap().offload_extra_ms = Some(7.0);
        region.offload_extra_ms = Some(8.0);
    }
    let p = plan(&step, 250);
    assert!(p.peak_bytes() <= 250 * MIB, "{p}");
    assert!(!p.choices().contains(&X), "{p}");
    assert!(p.choices().contains(&S), "{p}");
    let forced = MemoryPlan::with_choices(&step, &[X, X, X, K]).unwrap();
    assert_eq!(forced.extra_ms(), 21.0);
    // Only where nothing cheaper reaches the target: 150 MiB needs what whole recomputes or
    // offloaded outputs give, and 7 ms is below a 10 ms forward.
    let low = plan(&step, 150);
    assert!(low.peak_bytes() <= 150 * MIB, "{low}");
    assert!(low.choices().contains(&X), "{low}");
    // A whole offload measured dear is no longer the free first move: the 100 MiB of a block
    // in 12.5 ms each way fit the windows, but cost 8 ms where a selective recompute costs 1.
    let mut step = selective_blocks(4, 40, 1.0);
    step.link = Some(link(100, 12.5, 12.5));
    let free = plan(&step, 300);
    assert!(free.choices().contains(&O), "{free}");
    assert_eq!(free.extra_ms(), 0.0, "{free}");
    for region in &mut step.regions {
        region.offload_extra_ms = Some(8.0);
    }
    let dear = plan(&step, 300);
    assert!(dear.peak_bytes() <= 300 * MIB, "{dear}");
    assert!(!dear.choices().contains(&O), "{dear}");
    assert!(dear.extra_ms() < 8.0, "{dear}");
}

#[test]
fn autocast_casts_stay_until_the_forward_ends() {
    // 100 MiB saved per region, 30 of them autocast's casts of its weights: recomputing or
    // offloading frees them only after the forward, so the end of the forward still holds them.
    let mut step = StepCost::new(&blocks(4, 10.0, 100 * MIB, 0), None);
    for r in &mut step.regions {
        r.cached_bytes = 30 * MIB;
    }
    assert_eq!(peak_mib(&step, &[K, K, K, K]), 400);
    assert_eq!(peak_mib(&step, &[R, R, R, K]), 100 + 3 * 30);
    step.regions[0].cached_bytes = 200 * MIB;
    let err = MemoryPlan::with_choices(&step, &[K; 4]).unwrap_err();
    assert!(err.to_string().contains("cached_bytes"), "{err}");
}

/// Four regions saving 100 MiB each, with the peaks a profile measured (MiB above the step's
/// start): the forward's, then each region's backward.
fn measured_step(forward_mib: u64, backward_mib: [u64; 4]) -> StepCost {
    let mut step = step(&[10.0; 4], &[100; 4], 0);
    step.measured = Some(MeasuredPeaks {
        forward_bytes: forward_mib * MIB,
        backward_bytes: backward_mib.iter().map(|b| b * MIB).collect(),
    });
    step
}

#[test]
fn measured_peaks_replace_the_sums() {
    // The sums give 400 MiB; the measured step took more (logits, a backward's temporaries,
    // gradients), the most in the last region's backward.
    let mut step = measured_step(650, [400, 500, 600, 700]);
    assert_eq!(step.plain_bytes(), 700 * MIB);
    // Each phase less what the regions before it free: the forward loses every recompute's
    // bytes, a region's backward those of the regions before it.
    assert_eq!(peak_mib(&step, &[R, R, R, K]), 400);
    assert_eq!(peak_mib(&step, &[R, K, K, K]), 600);
    // Recomputing the last region frees nothing at its backward's peak.
    assert_eq!(peak_mib(&step, &[K, K, K, R]), 700);
    // A recompute holds its unsaved input from the forward to its backward.
    step.regions[1].unsaved_input_bytes = 10 * MIB;
    assert_eq!(peak_mib(&step, &[K, R, K, K]), 610);
    // The planner reaches for the measured peaks.
    let p = plan(&step, 450);
    assert!(p.reached(), "{p}");
    assert!(p.peak_bytes() <= 450 * MIB, "{p}");
    assert_eq!(p.least_bytes(), 410 * MIB, "{p}");
}

#[test]
fn measured_peaks_keep_autocasts_casts_and_uploads() {
    // autocast's casts stay until the forward ends; an offloaded region's bytes come back in the
    // backward of the region after it.
    let mut step = measured_step(700, [400, 500, 600, 700]);
    for r in &mut step.regions {
        r.cached_bytes = 30 * MIB;
    }
    assert_eq!(
        peak_mib(&step, &[R, R, R, K]),
        700 - 3 * 70,
        "the forward's end"
    );
    step.link = Some(link(100, 1.0, 1.0));
    // Region 0 offloaded: the forward's end holds 70 MiB less (its casts stay); it is back in
    // region 1's backward, which then holds what it held without a plan.
    assert_eq!(peak_mib(&step, &[O, K, K, K]), 700 - 70);
    // Region 2 offloaded: back in region 3's backward, at the step's plain peak.
    assert_eq!(peak_mib(&step, &[K, K, O, K]), 700);
}

#[test]
fn measured_peaks_need_one_backward_per_region() {
    let mut step = measured_step(650, [400, 500, 600, 700]);
    step.measured.as_mut().unwrap().backward_bytes.pop();
    let err = MemoryPlan::for_step(&step, 500 * MIB).unwrap_err();
    assert!(err.to_string().contains("one per region"), "{err}");
}
