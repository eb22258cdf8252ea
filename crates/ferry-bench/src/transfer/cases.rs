//! The cases of `ferry bench transfer`: one row each, pairing ferry's function (in
//! `ferry_cases`) with python/transfer.py's function of the same id, with the target.

use super::ferry_cases::{
    self as ferry_side, BIG_BYTES, BenchResult, Fixture, SMALL_BYTES, STAGING_BOUND, Sample,
};
use super::resnet50;
use crate::harness;
use crate::harness::report::{Target, Unit};

/// Which direction of the link a case's throughput is compared with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    DeviceToHost,
    HostToDevice,
    None,
}

/// One row: what each side runs, how it is shown, and its goal.
pub struct Case {
    /// Shared with python/transfer.py.
    pub id: &'static str,
    pub name: &'static str,
    pub ferry: &'static str,
    pub pytorch: &'static str,
    pub unit: Unit,
    /// Bytes of the source tensor(s), for GB/s.
    pub bytes: usize,
    pub link: Link,
    pub target: Target,
    pub run: fn(&mut Fixture) -> BenchResult<Sample>,
}

/// ferry's side of each small case, by index into SMALL_BYTES.
const SMALL_RUNS: [fn(&mut Fixture) -> BenchResult<Sample>; 3] = [
    |fx| ferry_side::small(fx, 0),
    |fx| ferry_side::small(fx, 1),
    |fx| ferry_side::small(fx, 2),
];

pub const LINK_IDS: [&str; 2] = ["link_d2h", "link_h2d"];

pub fn cases() -> Vec<Case> {
    let dict_bytes = resnet50::total_bytes();
    let chunk_target = Target::AtMostMsStaging {
        ms: 12.0,
        staging_bytes: STAGING_BOUND,
    };
    let small = |id, name, which: usize| Case {
        id,
        name,
        ferry: "t.cpu(), 100 times per sample",
        pytorch: "t.cpu(), 100 times per sample",
        unit: Unit::Us,
        bytes: SMALL_BYTES[which],
        link: Link::None,
        target: Target::NoSlowerThanPyTorch,
        run: SMALL_RUNS[which],
    };
    let big = |id, name, ferry, pytorch, target, run| Case {
        id,
        name,
        ferry,
        pytorch,
        unit: Unit::Ms,
        bytes: BIG_BYTES,
        link: Link::DeviceToHost,
        target,
        run,
    };
    vec![
        big(
            "link_d2h",
            "link: pinned DMA, device to host",
            "DeviceBuffer::copy_to_pinned_async into a reused PinnedBuffer; wait",
            "pinned.copy_(x) into a reused torch.empty(.., pin_memory=True); synchronize",
            Target::None,
            ferry_side::link_d2h,
        ),
        Case {
            link: Link::HostToDevice,
            ..big(
                "link_h2d",
                "link: pinned DMA, host to device",
                "DeviceBuffer::copy_from_pinned_async out of a reused PinnedBuffer; synchronize",
                "gpu.copy_(pinned) between reused tensors; synchronize",
                Target::None,
                ferry_side::link_h2d,
            )
        },
        big(
            "cpu_repeated",
            "cpu(), repeated, fresh host memory",
            "x.cpu() (result dropped after the clock stops)",
            "x.cpu() (result dropped after the clock stops)",
            Target::AtMostMs(10.0),
            ferry_side::cpu_repeated,
        ),
        big(
            "first_cpu",
            "first cpu() of a fresh process",
            "`ferry bench transfer --first-cpu-sample`, one process per sample",
            "`transfer.py --first-cpu-sample`, one process per sample",
            Target::AtMostMs(40.0),
            ferry_side::first_cpu,
        ),
        big(
            "non_blocking",
            "to(cpu, non_blocking), then wait",
            "x.to_with(Cpu, MoveOptions::non_blocking()), then read it",
            "x.to('cpu', non_blocking=True); torch.cuda.synchronize()",
            Target::AtMostMs(7.6),
            ferry_side::non_blocking,
        ),
        big(
            "chunks4",
            "4 chunks into pageable memory",
            "x.to_chunked(Cpu, ChunkSpec::Count(4))",
            "torch.cat([c.cpu() for c in x.chunk(4)])",
            chunk_target,
            ferry_side::chunks_count4,
        ),
        big(
            "chunks_staging",
            "chunks, staging <= 100 MB",
            "x.to_chunked(Cpu, ChunkSpec::MaxStagingBytes(100 MB))",
            "out[i*n:(i+1)*n].copy_(c) for the 4 chunks, out pageable and preallocated",
            chunk_target,
            ferry_side::chunks_staging,
        ),
        big(
            "to_f16",
            "to(cpu, f16)",
            "x.to_with(Cpu, MoveOptions::dtype(F16))",
            "x.to(device='cpu', dtype=torch.float16)",
            Target::None,
            ferry_side::to_f16,
        ),
        Case {
            bytes: dict_bytes,
            ..big(
                "state_dict_nb",
                "resnet50 state dict (non_blocking)",
                "move_state_dict(&sd, Cpu)",
                "{k: v.detach().to('cpu', non_blocking=True)}; torch.cuda.synchronize()",
                Target::AtMostMs(2.7),
                ferry_side::state_dict,
            )
        },
        Case {
            bytes: dict_bytes,
            ..big(
                "state_dict_plain",
                "resnet50 state dict (plain)",
                "move_state_dict(&sd, Cpu), the same call again",
                "{k: v.cpu() for k, v in sd.items()}",
                Target::None,
                ferry_side::state_dict,
            )
        },
        Case {
            link: Link::HostToDevice,
            ..big(
                "h2d_pageable",
                "host to device from pageable",
                "host.to(Cuda(0)); synchronize",
                "host.cuda(); torch.cuda.synchronize()",
                Target::AtMostMs(15.0),
                ferry_side::h2d_pageable,
            )
        },
        small("small_4k", "small cpu(): 4 KB", 0),
        small("small_64k", "small cpu(): 64 KB", 1),
        small("small_1m", "small cpu(): 1 MB", 2),
    ]
}

/// The cases to run, in table order: the link always, then the ones asked for (all by default).
pub fn select<'a>(all: &'a [Case], ids: &[String]) -> Result<Vec<&'a Case>, String> {
    let mut wanted = ids.to_vec();
    if !wanted.is_empty() {
        wanted.extend(LINK_IDS.map(String::from));
    }
    harness::select(all, &wanted, "case", |c| c.id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn case_ids_are_unique_and_links_come_first() {
        let all = cases();
        let mut ids: Vec<&str> = all.iter().map(|c| c.id).collect();
        assert_eq!(ids[..2], LINK_IDS);
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), all.len());
    }

    #[test]
    fn selecting_keeps_the_link_and_rejects_unknown_ids() {
        let all = cases();
        let picked = select(&all, &["small_4k".to_string()]).unwrap();
        let ids: Vec<&str> = picked.iter().map(|c| c.id).collect();
        assert_eq!(ids, ["link_d2h", "link_h2d", "small_4k"]);
        assert_eq!(select(&all, &[]).unwrap().len(), all.len());
        let err = select(&all, &["cpu".to_string()]).err().unwrap();
        assert!(err.contains("cpu_repeated"), "{err}");
    }

    /// Every id ferry runs must be one python/transfer.py answers, or the PyTorch column is empty.
    #[test]
    fn every_case_exists_in_the_pytorch_script() {
        let script = include_str!("../../python/transfer.py");
        for case in cases() {
            let registered = format!("\"{}\":", case.id);
            assert!(
                script.contains(&registered),
                "transfer.py lacks {registered}"
            );
        }
    }
}
