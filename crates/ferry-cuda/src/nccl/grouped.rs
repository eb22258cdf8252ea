//! `ncclGroupStart` .. `ncclGroupEnd` around a closure, and the ordering of buffers used by
//! collectives, which inside a group waits until the group ends (NCCL launches only then).

use std::cell::RefCell;
use std::sync::Arc;

use cudarc::nccl::sys;

use ferry_memory::cuda::{DeviceBuffer, Event, Stream};

use super::library::{check, ensure_nccl};
use crate::CudaLibError;

/// Collectives queued inside [`group`] on this thread, whose events are recorded when the
/// outermost group ends (NCCL launches them only then).
struct GroupState {
    depth: usize,
    /// Each stream a buffer was used on away from home, with the event its later uses wait
    /// for (`None`: making the event failed; the stream is synchronized instead).
    pending: Vec<(Stream, Option<Arc<Event>>)>,
}

thread_local! {
    static GROUP: RefCell<GroupState> = const {
        RefCell::new(GroupState {
            depth: 0,
            pending: Vec::new(),
        })
    };
}

/// Registers a collective just queued on `stream` with `buf`, so that later uses of the buffer
/// on other streams wait for it and the allocator keeps the block until it is done.
pub(super) fn after_queue(buf: &DeviceBuffer, stream: &Stream) -> Result<(), CudaLibError> {
    if stream == buf.stream() || buf.is_empty() {
        return Ok(());
    }
    if GROUP.with_borrow(|group| group.depth == 0) {
        return Ok(buf.queued_on(stream)?);
    }
    let event = Event::new(stream, false).ok().map(Arc::new);
    if let Some(event) = &event {
        buf.queued_with(stream, event);
    }
    GROUP.with_borrow_mut(|group| group.pending.push((stream.clone(), event)));
    Ok(())
}

/// Runs `f` between `ncclGroupStart` and `ncclGroupEnd`: the collectives it queues are
/// launched together when the group ends (always, even when `f` fails or panics).
///
/// Needed when one thread issues a collective on several communicators of one process (one
/// per GPU, from [`Communicator::for_devices`]): without it the thread waits forever on the
/// first, which waits for the others. One thread per communicator needs no group. Groups nest;
/// the collectives launch when the outermost ends.
///
/// [`Communicator::for_devices`]: crate::Communicator::for_devices
///
/// Buffers used inside must outlive the call and be used only by collectives until it returns:
/// nothing runs before the group ends, and the ordering of their later uses is set up then.
///
/// Returns `f`'s error if it failed, otherwise `ncclGroupEnd`'s.
///
/// ```no_run
/// # use ferry_cuda::{group, Communicator, ReduceOp};
/// # use ferry_memory::cuda::CudaDevice;
/// # use ferry_memory::DType;
/// # fn main() -> Result<(), ferry_cuda::CudaLibError> {
/// let devices = [CudaDevice::get(0)?, CudaDevice::get(1)?];
/// let comms = Communicator::for_devices(&devices)?;
/// let mut grads: Vec<_> = devices
///     .iter()
///     .map(|d| d.alloc_zeroed(4 << 20, d.default_stream()))
///     .collect::<Result<_, _>>()?;
/// group(|| {
///     for (comm, grad) in comms.iter().zip(grads.iter_mut()) {
///         comm.all_reduce(grad, DType::F32, ReduceOp::Avg, comm.device().default_stream())?;
///     }
///     Ok(())
/// })?;
/// # Ok(())
/// # }
/// ```
pub fn group<R>(f: impl FnOnce() -> Result<R, CudaLibError>) -> Result<R, CudaLibError> {
    ensure_nccl()?;
    // SAFETY: NCCL is loaded; the guard below ends the group.
    check("ncclGroupStart", unsafe { sys::ncclGroupStart() })?;
    GROUP.with_borrow_mut(|group| group.depth += 1);
    let guard = GroupGuard { ended: false };
    let result = f();
    let ended = guard.end();
    let value = result?;
    ended.map(|()| value)
}

/// Ends the group it was made for, once, also while unwinding.
struct GroupGuard {
    ended: bool,
}

impl GroupGuard {
    fn end(mut self) -> Result<(), CudaLibError> {
        self.ended = true;
        end_group()
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        if !self.ended {
            let _ = end_group();
        }
    }
}

fn end_group() -> Result<(), CudaLibError> {
    // SAFETY: matches the ncclGroupStart of the guard calling this.
    let ended = check("ncclGroupEnd", unsafe { sys::ncclGroupEnd() });
    let pending = GROUP
        .try_with(|group| {
            let mut group = group.borrow_mut();
            group.depth = group.depth.saturating_sub(1);
            if group.depth == 0 {
                std::mem::take(&mut group.pending)
            } else {
                Vec::new()
            }
        })
        .unwrap_or_default();
    // The collectives are queued now: the events recorded after them are what later uses of
    // their buffers wait for.
    let mut recorded = Ok(());
    for (stream, event) in pending {
        let done = match event {
            Some(event) => event.record(&stream).or_else(|_| stream.synchronize()),
            None => stream.synchronize(),
        };
        if let Err(error) = done
            && recorded.is_ok()
        {
            recorded = Err(error);
        }
    }
    ended.and(recorded.map_err(CudaLibError::from))
}

/// How deep this thread is in groups (0 outside any).
#[cfg(test)]
pub(super) fn depth() -> usize {
    GROUP.with_borrow(|group| group.depth)
}
