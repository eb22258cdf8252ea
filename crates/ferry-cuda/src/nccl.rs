//! NCCL collectives (all-reduce, broadcast, all-gather) on [`DeviceBuffer`]s, through cudarc's
//! raw NCCL layer (`nccl::sys`): ferry's buffers are raw allocator blocks, not cudarc slices.
//!
//! The public guide is on [`Communicator`] (which constructor, the rules, the ordering) and
//! [`group`]. Inside: `library` loads libnccl without ever panicking (nothing here calls NCCL
//! before [`nccl_present`] has said it can be loaded; every entry point returns
//! [`CudaLibError::NoNccl`] instead), `types` maps dtypes and reductions to NCCL's, and `grouped`
//! defers the ordering of buffers used inside a group until NCCL launches the group's work.

mod grouped;
mod library;
mod types;

use std::ffi::{c_int, c_void};
use std::fmt;

use cudarc::nccl::sys::{self, ncclResult_t};

use grouped::after_queue;
pub use grouped::group;
use library::{check, ensure_nccl};
pub use library::{nccl_present, nccl_version};
use types::nccl_dtype;
pub use types::{ReduceOp, UniqueId};

use ferry_memory::DType;
use ferry_memory::cuda::{CudaDevice, DeviceBuffer, Stream};

use crate::CudaLibError;

/// One rank of an NCCL communicator, bound to one GPU: all-reduce, broadcast and all-gather
/// over [`DeviceBuffer`]s.
///
/// # Which constructor
///
/// - [`Communicator::for_devices`]: one process drives several GPUs; one communicator per GPU,
///   all made at once. Issue collectives on them from one thread inside [`group`], or from one
///   thread per communicator.
/// - [`Communicator::for_rank`]: one process (or thread) per GPU. One rank makes a
///   [`UniqueId`] and hands its bytes ([`UniqueId::to_bytes`]) to the others by any means (a
///   file, a socket, a launcher's environment); each calls `for_rank` with its own rank. This
///   is also how a communicator spans several hosts.
///
/// # Rules
///
/// - Every rank issues the same collectives in the same order, with the same element counts
///   and dtypes; a rank that does not (or that fails an argument check the others pass) leaves
///   the others waiting on the device. Argument errors are found before anything is queued.
/// - One thread that issues a collective on several communicators of one process must do so
///   inside [`group`]: the first use of a communicator connects the ranks and waits for the
///   others, so without the group the thread waits forever on the first. One thread per
///   communicator needs no group.
/// - A communicator moves between threads ([`Send`]) but is used by one thread at a time (not
///   [`Sync`]).
///
/// # Ordering
///
/// Collectives are queued on the given stream and return at once, with the promises of
/// [`DeviceBuffer`]'s copies: on a stream other than a buffer's home stream (the one it was
/// allocated on), the collective waits on the device for the work queued on the home stream so
/// far, and later uses of the buffer on any stream wait for the collective; the allocator keeps
/// the memory until it is done. The buffers and the stream must be on this rank's device.
///
/// Dropping a communicator destroys it (`ncclCommDestroy`, after the work queued on it), or
/// aborts it (`ncclCommAbort`) if NCCL reported an asynchronous error; it never panics, and an
/// error it meets is reported by the next checked call on the device.
pub struct Communicator {
    comm: sys::ncclComm_t,
    rank: usize,
    world_size: usize,
    device: CudaDevice,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not
// overlap; it is not Sync, so only the thread that owns it (or a `&mut` to it) calls it.
unsafe impl Send for Communicator {}

impl Communicator {
    /// One communicator per GPU of this process, all made at once (`ncclCommInitAll`): rank `i`
    /// runs on `devices[i]`. Issue collectives on them from one thread inside [`group`], or
    /// from one thread per communicator. The devices must be distinct.
    pub fn for_devices(devices: &[CudaDevice]) -> Result<Vec<Communicator>, CudaLibError> {
        const OP: &str = "Communicator::for_devices";
        ensure_nccl()?;
        if devices.is_empty() {
            return Err(CudaLibError::CollectiveArgument {
                op: OP,
                reason: "no devices were given; pass one CudaDevice per rank".into(),
            });
        }
        for (i, device) in devices.iter().enumerate() {
            if devices[..i].iter().any(|d| d.ordinal() == device.ordinal()) {
                return Err(CudaLibError::CollectiveArgument {
                    op: OP,
                    reason: format!(
                        "{} appears twice; NCCL needs one rank per GPU, so list each device once",
                        device.device()
                    ),
                });
            }
        }
        let world_size = c_int::try_from(devices.len()).map_err(|_| too_many(OP, devices.len()))?;
        for device in devices {
            device.check()?;
        }
        let ordinals: Vec<c_int> = devices.iter().map(|d| d.ordinal() as c_int).collect();
        let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); devices.len()];
        devices[0].bind()?;
        // SAFETY: `comms` has one slot per device and `ordinals` one valid, distinct ordinal
        // each; NCCL fills every slot or fails.
        check("ncclCommInitAll", unsafe {
            sys::ncclCommInitAll(comms.as_mut_ptr(), world_size, ordinals.as_ptr())
        })?;
        Ok(comms
            .into_iter()
            .zip(devices)
            .enumerate()
            .map(|(rank, (comm, device))| Communicator {
                comm,
                rank,
                world_size: devices.len(),
                device: device.clone(),
            })
            .collect())
    }

    /// Rank `rank` of a communicator of `world_size` ranks, on `device` (`ncclCommInitRank`).
    /// Every rank calls this with the same `id` (made by one of them with [`UniqueId::new`])
    /// from its own process or thread; it returns once all ranks have joined.
    pub fn for_rank(
        id: &UniqueId,
        rank: usize,
        world_size: usize,
        device: &CudaDevice,
    ) -> Result<Communicator, CudaLibError> {
        const OP: &str = "Communicator::for_rank";
        ensure_nccl()?;
        if rank >= world_size {
            return Err(CudaLibError::CollectiveArgument {
                op: OP,
                reason: format!(
                    "rank {rank} is not below the world size {world_size}; ranks run from 0 to world_size - 1"
                ),
            });
        }
        let nranks = c_int::try_from(world_size).map_err(|_| too_many(OP, world_size))?;
        device.check()?;
        // ncclCommInitRank runs on the calling thread's current device.
        device.bind()?;
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; `rank < world_size <= c_int::MAX`.
        check("ncclCommInitRank", unsafe {
            sys::ncclCommInitRank(&mut comm, nranks, id.0, rank as c_int)
        })?;
        Ok(Communicator {
            comm,
            rank,
            world_size,
            device: device.clone(),
        })
    }

    /// This communicator's rank, from 0.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many ranks the communicator has.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The GPU this rank runs on.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// Reduces the whole buffer (`len / dtype.size()` elements) across the ranks, in place:
    /// afterwards every rank holds the combined values. Queued on `stream`, which must belong
    /// to this rank's device, as must the buffer.
    pub fn all_reduce(
        &self,
        buf: &mut DeviceBuffer,
        dtype: DType,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<(), CudaLibError> {
        let len = buf.len();
        self.reduce("all_reduce", buf, 0, len, dtype, op, stream)
    }

    /// Like [`Communicator::all_reduce`], over bytes `offset..offset + bytes` of `buf` only
    /// (a gradient bucket inside a flat buffer). The range must lie in the buffer and start and
    /// end on whole elements of `dtype`.
    #[allow(clippy::too_many_arguments)] // the collective's natural arguments
    pub fn all_reduce_region(
        &self,
        buf: &mut DeviceBuffer,
        offset: usize,
        bytes: usize,
        dtype: DType,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<(), CudaLibError> {
        self.reduce("all_reduce_region", buf, offset, bytes, dtype, op, stream)
    }

    #[allow(clippy::too_many_arguments)]
    fn reduce(
        &self,
        name: &'static str,
        buf: &mut DeviceBuffer,
        offset: usize,
        bytes: usize,
        dtype: DType,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<(), CudaLibError> {
        ensure_nccl()?;
        self.check_placement(name, buf, stream)?;
        if !offset.is_multiple_of(dtype.size()) {
            return Err(CudaLibError::CollectiveArgument {
                op: name,
                reason: format!(
                    "offset {offset} does not start a {dtype} element ({} bytes each); use a multiple of {}",
                    dtype.size(),
                    dtype.size()
                ),
            });
        }
        let count = elements(name, "the range", bytes, dtype)?;
        let ptr = buf.range(name, offset, bytes, stream)?;
        if count == 0 {
            return Ok(());
        }
        // SAFETY: `ptr..ptr + bytes` lies in the buffer's live block on this communicator's
        // device (checked above), ordered on `stream` and exclusively borrowed; in-place
        // all-reduce reads and writes exactly `count` elements there.
        check("ncclAllReduce", unsafe {
            sys::ncclAllReduce(
                ptr as usize as *const c_void,
                ptr as usize as *mut c_void,
                count,
                nccl_dtype(dtype),
                op.to_nccl(),
                self.comm,
                raw_stream(stream),
            )
        })?;
        after_queue(buf, stream)
    }

    /// Copies rank `root`'s buffer into every rank's buffer, in place (the whole buffer, which
    /// must hold whole `dtype` elements and be the same size on every rank).
    pub fn broadcast(
        &self,
        buf: &mut DeviceBuffer,
        dtype: DType,
        root: usize,
        stream: &Stream,
    ) -> Result<(), CudaLibError> {
        const OP: &str = "broadcast";
        ensure_nccl()?;
        self.check_placement(OP, buf, stream)?;
        if root >= self.world_size {
            return Err(CudaLibError::CollectiveArgument {
                op: OP,
                reason: format!(
                    "root {root} is not a rank of this communicator of {} rank(s)",
                    self.world_size
                ),
            });
        }
        let count = elements(OP, "the buffer", buf.len(), dtype)?;
        let ptr = buf.range(OP, 0, buf.len(), stream)?;
        if count == 0 {
            return Ok(());
        }
        // SAFETY: the whole live block of `buf`, on this device, ordered on `stream` and
        // exclusively borrowed; in place, `count` elements.
        check("ncclBroadcast", unsafe {
            sys::ncclBroadcast(
                ptr as usize as *const c_void,
                ptr as usize as *mut c_void,
                count,
                nccl_dtype(dtype),
                root as c_int,
                self.comm,
                raw_stream(stream),
            )
        })?;
        after_queue(buf, stream)
    }

    /// Gathers every rank's `send` into `recv` on every rank: rank `r`'s bytes land at
    /// `r * send.len()`. `recv.len()` must be `world_size * send.len()`.
    pub fn all_gather(
        &self,
        send: &DeviceBuffer,
        recv: &mut DeviceBuffer,
        dtype: DType,
        stream: &Stream,
    ) -> Result<(), CudaLibError> {
        const OP: &str = "all_gather";
        ensure_nccl()?;
        self.check_placement(OP, send, stream)?;
        self.check_placement(OP, recv, stream)?;
        let count = elements(OP, "the send buffer", send.len(), dtype)?;
        let expected = send.len().checked_mul(self.world_size);
        if expected != Some(recv.len()) {
            return Err(CudaLibError::CollectiveArgument {
                op: OP,
                reason: format!(
                    "the receive buffer holds {} bytes but {} rank(s) x {} sent bytes are gathered; allocate it with world_size * send.len() bytes",
                    recv.len(),
                    self.world_size,
                    send.len()
                ),
            });
        }
        let send_ptr = send.range(OP, 0, send.len(), stream)?;
        let recv_ptr = recv.range(OP, 0, recv.len(), stream)?;
        if count == 0 {
            return Ok(());
        }
        // SAFETY: both are live blocks on this device, ordered on `stream`, distinct (`recv` is
        // exclusively borrowed); NCCL reads `count` elements of `send` and writes
        // `world_size * count` of `recv`, its whole length (checked above).
        check("ncclAllGather", unsafe {
            sys::ncclAllGather(
                send_ptr as usize as *const c_void,
                recv_ptr as usize as *mut c_void,
                count,
                nccl_dtype(dtype),
                self.comm,
                raw_stream(stream),
            )
        })?;
        after_queue(send, stream)?;
        after_queue(recv, stream)
    }

    /// The buffer and the stream must be on this rank's device.
    fn check_placement(
        &self,
        op: &'static str,
        buf: &DeviceBuffer,
        stream: &Stream,
    ) -> Result<(), CudaLibError> {
        Ok(self
            .device
            .check_operands(op, [buf.device(), stream.device()])?)
    }
}

// Communicators move to the thread that drives their GPU (one thread per rank).
const _: () = {
    const fn send<T: Send>() {}
    send::<Communicator>();
};

impl Drop for Communicator {
    fn drop(&mut self) {
        if self.comm.is_null() {
            return;
        }
        // Errors here are reported by the next checked call on the device, as for buffers.
        let what = format!(
            "destroying the NCCL communicator of rank {} (of {}) on {}",
            self.rank,
            self.world_size,
            self.device.device()
        );
        // NCCL frees the communicator's device resources in this device's context.
        if let Err(error) = self.device.bind() {
            self.device.defer(what.clone(), error);
        }
        let mut state = ncclResult_t::ncclSuccess;
        // SAFETY: `comm` is live (made by NCCL, destroyed only here); `state` is a valid
        // out-pointer.
        let queried = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
        // An asynchronous error (a failed collective, a lost peer) is reported, and the
        // communicator aborted: destroying it would wait for work that cannot finish.
        let failed = check("ncclCommGetAsyncError", queried)
            .and_then(|()| check("a collective on this communicator", state))
            .err();
        // SAFETY: as above; the handle is not used after this.
        let (call, status) = unsafe {
            match failed {
                None => ("ncclCommDestroy", sys::ncclCommDestroy(self.comm)),
                Some(_) => ("ncclCommAbort", sys::ncclCommAbort(self.comm)),
            }
        };
        self.comm = std::ptr::null_mut();
        if let Some(error) = failed {
            self.device.defer(what.clone(), error);
        }
        if let Err(error) = check(call, status) {
            self.device.defer(what, error);
        }
    }
}

impl fmt::Debug for Communicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("device", &self.device.device())
            .finish()
    }
}

fn too_many(op: &'static str, ranks: usize) -> CudaLibError {
    CudaLibError::CollectiveArgument {
        op,
        reason: format!("{ranks} ranks are more than NCCL can address"),
    }
}

/// `bytes` as a count of `dtype` elements; a partial element is an error.
fn elements(
    op: &'static str,
    what: &str,
    bytes: usize,
    dtype: DType,
) -> Result<usize, CudaLibError> {
    if bytes.is_multiple_of(dtype.size()) {
        Ok(bytes / dtype.size())
    } else {
        Err(CudaLibError::CollectiveArgument {
            op,
            reason: format!(
                "{what} of {bytes} bytes is not a whole number of {dtype} elements ({} bytes each); check the dtype or the length",
                dtype.size()
            ),
        })
    }
}

fn raw_stream(stream: &Stream) -> sys::cudaStream_t {
    stream.cudarc().cu_stream() as sys::cudaStream_t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_elements_and_misaligned_offsets_are_argument_errors() {
        let err = elements("all_reduce", "the range", 10, DType::F32).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("10 bytes") && text.contains("f32") && text.contains("all_reduce"),
            "{text}"
        );
        assert_eq!(elements("all_reduce", "x", 12, DType::F32).unwrap(), 3);
        assert_eq!(elements("all_reduce", "x", 0, DType::F64).unwrap(), 0);
    }
}
