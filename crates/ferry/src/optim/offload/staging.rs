//! Bounded staging: when a pinned limit cannot hold a landing and an upload buffer for every
//! parameter, [`super::OffloadAdamW`] takes each landing buffer as its gradient is sent down
//! and each upload buffer as its parameter is stepped, and gives them back once the step has
//! read the one and the link has carried the other. The optimizer's state is in pageable
//! memory either way; only what the link touches is pinned.
//!
//! The landings and the uploads are bounded separately, half the limit each, so the step
//! thread, which holds a landing while it waits for an upload buffer, waits only on the GPU's
//! copies, and backward's hooks, which wait for a landing, wait only on the step thread.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use ferry_memory::cuda::{PinnedBuffer, PinnedPool};
use ferry_memory::size::human_bytes;
use ferry_tensor::{Buffer, Layout, Result, Storage, Tensor};
use ferry_tensor::{DType, Device};
use parking_lot::{Condvar, Mutex};

/// How the pinned buffers are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Plan {
    /// A landing and an upload buffer per parameter, for the optimizer's life.
    PerParameter,
    /// Taken and given back as they are used, within `limit` bytes.
    Staged { limit: usize },
}

/// Chooses how to hold the pinned buffers of parameters whose buffers take `blocks` bytes
/// each (pool blocks), within the caller's `limit` when given, else within `room` (what the
/// pinned pool's budget has left). Staging takes half the room, leaving the rest to other
/// moves, or the least it needs: room for the largest parameter's two buffers.
pub(super) fn plan(
    blocks: &[usize],
    limit: Option<usize>,
    room: usize,
) -> std::result::Result<Plan, String> {
    let needed = 2 * blocks.iter().sum::<usize>();
    let (largest, at) = blocks
        .iter()
        .enumerate()
        .map(|(i, &b)| (b, i))
        .max()
        .unwrap_or((0, 0));
    let least = 2 * largest;
    match limit {
        Some(limit) if needed <= limit => Ok(Plan::PerParameter),
        Some(limit) if least <= limit => Ok(Plan::Staged { limit }),
        Some(limit) => Err(format!(
            "a pinned limit of {} cannot stage parameter {at}: its landing and upload buffers \
             take {} each, so staging needs at least {} (a buffer per parameter would take {})",
            human_bytes(limit),
            human_bytes(largest),
            human_bytes(least),
            human_bytes(needed)
        )),
        None if needed <= room => Ok(Plan::PerParameter),
        None if least <= room => Ok(Plan::Staged {
            limit: (room / 2).clamp(least, room),
        }),
        None => Err(format!(
            "the pinned budget has {} left; OffloadAdamW needs {} for a landing and an upload \
             buffer per parameter, or at least {} to stage them (parameter {at}'s two buffers): \
             raise FERRY_PINNED_BUDGET (or PinnedPool::set_budget), or free pinned buffers",
            human_bytes(room),
            human_bytes(needed),
            human_bytes(least)
        )),
    }
}

/// The staged buffers: landings and uploads, each within half the limit.
pub(super) struct Staging {
    pub(super) limit: usize,
    /// What a buffer per parameter would have taken.
    pub(super) needed: usize,
    pub(super) landings: Half,
    pub(super) uploads: Half,
}

impl Staging {
    pub(super) fn new(limit: usize, needed: usize) -> Self {
        Self {
            limit,
            needed,
            landings: Half::new(limit / 2),
            uploads: Half::new(limit - limit / 2),
        }
    }

    /// Pinned bytes held now (buffers given back count until the copies using them finish).
    pub(super) fn held(&self) -> usize {
        self.landings.held() + self.uploads.held()
    }

    pub(super) fn report(&self) -> StagingReport {
        StagingReport {
            limit: self.limit,
            per_parameter: self.needed,
            peak: self.landings.peak() + self.uploads.peak(),
        }
    }
}

/// What [`OffloadAdamW::staging`](super::OffloadAdamW::staging) reports: the pinned limit
/// could not hold a landing and an upload buffer per parameter, so they are staged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagingReport {
    /// The pinned bytes the staged buffers stay within.
    pub limit: usize,
    /// What a landing and an upload buffer per parameter would take.
    pub per_parameter: usize,
    /// The most the staged buffers held at once so far (the landings' peak plus the uploads').
    pub peak: usize,
}

impl StagingReport {
    /// Why the delayed update is refused here, and the fixes.
    pub fn delayed_refusal(&self) -> String {
        format!(
            "the delayed update holds every parameter's new weights in pinned memory until the \
             next backward, {} here, and the pinned limit of {} stages the buffers instead: \
             raise the limit to {} (pinned_limit from Python, OffloadAdamW::new_within, or \
             FERRY_PINNED_BUDGET) or step without the delayed update",
            human_bytes(self.per_parameter / 2),
            human_bytes(self.limit),
            human_bytes(self.per_parameter)
        )
    }
}

impl fmt::Display for StagingReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "pinned buffers staged: a landing and an upload buffer per parameter would take {}, \
             more than the pinned limit of {}, so gradients land and weights go up through \
             buffers taken and given back within it (peak {} so far; backward waits when the \
             CPU's steps fall behind, and the delayed update is off)",
            human_bytes(self.per_parameter),
            human_bytes(self.limit),
            human_bytes(self.peak)
        )
    }
}

/// One half of the staged buffers: pinned bytes held within a bound.
pub(super) struct Half {
    bound: usize,
    state: Mutex<HalfState>,
    room: Condvar,
}

#[derive(Default)]
struct HalfState {
    held: usize,
    peak: usize,
    /// Given back, held until nothing uses them.
    retiring: Vec<Retired>,
}

/// A buffer given back.
pub(super) enum Retired {
    /// A landing tensor: done once its gradient was read and no one else holds it (another
    /// runtime's view of it, through DLPack).
    Landing(Tensor),
    /// An upload buffer: done once its upload has finished.
    Upload(PinnedBuffer),
}

impl Retired {
    fn bytes(&self) -> usize {
        match self {
            Retired::Landing(t) => match &*t.storage().read() {
                Buffer::Pinned(b) => b.block_size(),
                _ => 0,
            },
            Retired::Upload(b) => b.block_size(),
        }
    }

    fn is_done(&self) -> bool {
        match self {
            Retired::Landing(t) => {
                Arc::strong_count(t.storage()) == 1
                    && match &*t.storage().read() {
                        Buffer::Pinned(b) => b.is_ready(),
                        _ => true,
                    }
            }
            Retired::Upload(b) => b.is_ready(),
        }
    }
}

impl HalfState {
    fn reclaim(&mut self) {
        let mut freed = 0;
        self.retiring.retain(|r| {
            let done = r.is_done();
            if done {
                freed += r.bytes();
            }
            !done
        });
        self.held -= freed;
    }
}

impl Half {
    fn new(bound: usize) -> Self {
        Self {
            bound,
            state: Mutex::default(),
            room: Condvar::new(),
        }
    }

    /// A pinned buffer of `len` bytes, once the half has room for it: buffers given back
    /// count until the copies using them finish, so this may wait for the GPU.
    pub(super) fn take(&self, len: usize) -> Result<PinnedBuffer> {
        let size = PinnedPool::block_size(len);
        {
            let mut state = self.state.lock();
            loop {
                state.reclaim();
                if state.held + size <= self.bound || state.held == 0 {
                    break;
                }
                // What is given back waits on the GPU (or on another runtime's view), which
                // does not call back: look again shortly.
                self.room.wait_for(&mut state, Duration::from_micros(100));
            }
            state.held += size;
            state.peak = state.peak.max(state.held);
        }
        PinnedPool::global()
            .and_then(|pool| pool.alloc_exact(len))
            .map_err(|e| {
                self.state.lock().held -= size;
                self.room.notify_all();
                e.into()
            })
    }

    /// A landing tensor of `shape` and `dtype` over a buffer taken from this half.
    pub(super) fn take_landing(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let bytes = shape.iter().product::<usize>() * dtype.size();
        let storage = Storage::new(Buffer::Pinned(self.take(bytes)?), dtype, Device::Cpu);
        Tensor::from_storage(Arc::new(storage), Layout::contiguous(shape))
    }

    /// Gives a buffer back: its bytes are free once nothing uses it.
    pub(super) fn give_back(&self, retired: Retired) {
        self.state.lock().retiring.push(retired);
        self.room.notify_all();
    }

    fn held(&self) -> usize {
        let mut state = self.state.lock();
        state.reclaim();
        state.held
    }

    fn peak(&self) -> usize {
        self.state.lock().peak
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn buffers_per_parameter_when_they_fit() {
        let blocks = [4 * MIB, MIB, MIB];
        assert_eq!(plan(&blocks, None, 12 * MIB), Ok(Plan::PerParameter));
        assert_eq!(plan(&blocks, Some(12 * MIB), 0), Ok(Plan::PerParameter));
    }

    #[test]
    fn staged_within_the_limit_when_they_do_not() {
        let blocks = [4 * MIB, MIB, MIB];
        assert_eq!(
            plan(&blocks, Some(8 * MIB), usize::MAX),
            Ok(Plan::Staged { limit: 8 * MIB })
        );
        // Without a limit: half the pool's room, or the least staging needs.
        assert_eq!(
            plan(&blocks, None, 11 * MIB),
            Ok(Plan::Staged { limit: 8 * MIB })
        );
        assert_eq!(
            plan(&[MIB; 64], None, 64 * MIB),
            Ok(Plan::Staged { limit: 32 * MIB })
        );
    }

    #[test]
    fn a_limit_below_the_largest_parameters_two_buffers_names_the_least() {
        let blocks = [MIB, 4 * MIB, MIB];
        let err = plan(&blocks, Some(7 * MIB), usize::MAX).unwrap_err();
        assert!(
            err.contains("parameter 1") && err.contains("8.00 MiB"),
            "{err}"
        );
        let err = plan(&blocks, None, 7 * MIB).unwrap_err();
        assert!(
            err.contains("FERRY_PINNED_BUDGET") && err.contains("12.00 MiB"),
            "{err}"
        );
    }

    #[test]
    fn the_report_says_what_would_not_fit() {
        let text = StagingReport {
            limit: 512 * MIB,
            per_parameter: 8 << 30,
            peak: 300 * MIB,
        }
        .to_string();
        for needle in ["8.00 GiB", "512.00 MiB", "300.00 MiB", "staged"] {
            assert!(text.contains(needle), "{needle} not in {text}");
        }
    }

    /// The delayed update's refusal, which Rust's next `step()` and Python's constructor both
    /// give: what it would hold, the limit, and the limit that would do.
    #[test]
    fn the_delayed_updates_refusal_names_the_limit_that_would_do() {
        let text = StagingReport {
            limit: 512 * MIB,
            per_parameter: 8 << 30,
            peak: 0,
        }
        .delayed_refusal();
        for needle in [
            "delayed update",
            "4.00 GiB here",
            "512.00 MiB",
            "raise the limit to 8.00 GiB",
            "pinned_limit",
        ] {
            assert!(text.contains(needle), "{needle} not in {text}");
        }
    }
}
