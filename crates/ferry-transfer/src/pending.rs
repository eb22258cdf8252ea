//! Asynchronous moves: queued on a stream the caller picks, handed back as a [`PendingTensor`]
//! whose data can only be reached through [`PendingTensor::wait`].

use std::fmt;
use std::time::Instant;

use ferry_graph::enable_grad;
use ferry_memory::cuda::{Event, PinnedBuffer, PinnedPool, Stream};
use ferry_memory::{DType, Device, MemoryError};
use ferry_tensor::{Buffer, Result, Tensor, TensorError, should_record, with_no_grad};

use crate::copy::{beyond_budget, move_bytes, peer_copy};
use crate::record::record_transfer;
use crate::report::{TransferPath, TransferReport};
use crate::staging::{after_default, cuda, dense, dense_copies, within_budget, wrap};

/// A move in flight. It keeps the source alive until it is waited for or dropped, and it has no
/// accessor to the moved data except [`PendingTensor::wait`], which returns only once the copy's
/// event has completed: reading before the copy finished cannot be written.
///
/// Dropping it unread is safe: the destination's pinned block carries the copy's event, and the
/// pinned pool does not hand the block out again before that event completes; device blocks the
/// copy used are marked used on its stream, so the allocator orders their reuse after it too.
///
/// The copy reads the source as it was when the move was issued: it waits for the source's
/// producers on the default stream, and a later in-place write of the source (`assign`,
/// `adam_update`, an optimizer step) waits for the copy on the device, because the source's
/// buffer records the copy's event and ferry's kernels wait for such events before using it.
///
/// Between two GPUs the copy runs on the stream given, of either GPU, directly when peer access
/// is available ([`crate::TransferPath::Peer`] says which); the result's later uses on the
/// target's default stream wait for the copy on the device.
///
/// Peeking at the data without waiting does not compile:
///
/// ```compile_fail
/// fn peek(pending: &ferry_transfer::PendingTensor) -> &ferry_tensor::Tensor {
///     &pending.result // private: only `wait()` hands the tensor out
/// }
/// ```
#[must_use = "a pending move does nothing useful until `wait()` hands out its tensor"]
pub struct PendingTensor {
    /// The destination tensor; private, and returned only by `wait`.
    result: Tensor,
    /// The source (with its history when the move records a node), kept alive for the copy.
    source: Tensor,
    /// A dense copy of the source or a pinned staging buffer the copy reads, when there is one.
    _scratch: Option<Tensor>,
    _staging: Option<PinnedBuffer>,
    /// Completes when the copy has; `None` when nothing was queued.
    done: Option<Event>,
    /// Decided when the move was issued, so waiting under `no_grad` does not change it.
    record: bool,
    to: Device,
    report: TransferReport,
    started: Instant,
}

impl PendingTensor {
    /// Whether the copy has finished (so `wait` will not block). Errors from the copy count as
    /// "not finished" here and surface from `wait`.
    pub fn is_ready(&self) -> bool {
        self.done.as_ref().is_none_or(Event::is_complete)
    }

    /// Makes `stream` wait, on the device, for the copy: work queued there afterwards (an
    /// in-place write of the source, a kernel that reads the result) runs only once the copy
    /// has landed. The host never waits. For a caller's own stream, or another runtime's
    /// ([`ferry_memory::cuda::CudaDevice::borrow_stream`]): ferry's own in-place writes are
    /// ordered after the copy without it.
    pub fn order_stream(&self, stream: &Stream) -> Result<()> {
        if let Some(done) = &self.done {
            stream.wait_event(done)?;
        }
        Ok(())
    }

    /// Blocks until the copy has finished, then hands out the tensor and the move's report.
    /// When the source required grad (and grad mode was on when the move was issued), the result
    /// carries a transfer node whose backward sends the gradient home.
    pub fn wait(self) -> Result<(Tensor, TransferReport)> {
        if let Some(done) = &self.done {
            done.synchronize()?;
        }
        let mut report = self.report;
        let out = if self.record {
            let _grad = enable_grad();
            record_transfer(self.result, &self.source, self.to, "to_async", &mut report)
        } else {
            self.result
        };
        report.elapsed = self.started.elapsed();
        Ok((out, report))
    }

    /// Where the data is going.
    pub fn device(&self) -> Device {
        self.to
    }

    /// The shape the result will have.
    pub fn shape(&self) -> &[usize] {
        self.result.shape()
    }

    /// The dtype the result will have.
    pub fn dtype(&self) -> DType {
        self.result.dtype()
    }
}

impl fmt::Debug for PendingTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PendingTensor")
            .field("shape", &self.shape())
            .field("dtype", &self.dtype())
            .field("from", &self.source.device())
            .field("to", &self.to)
            .field("ready", &self.is_ready())
            .finish()
    }
}

/// `stream` must belong to the GPU side of the move.
fn check_stream(stream: &Stream, gpu: Device) -> Result<()> {
    if stream.device() != gpu {
        return Err(MemoryError::DeviceMismatch {
            op: "to_async",
            expected: gpu,
            actual: stream.device(),
        }
        .into());
    }
    Ok(())
}

/// Between two GPUs, `stream` (of device `on`) may belong to either: the target's (where the
/// result is used; the usual choice) or the source's (to keep the target's copy engine free).
/// A third device's stream is refused with the fix.
fn check_peer_stream(on: Device, from: Device, to: Device) -> Result<()> {
    if on == from || on == to {
        return Ok(());
    }
    Err(TensorError::InvalidArgument {
        op: "to_async",
        message: format!(
            "a move from {from} to {to} was given a stream of {on}: pass a stream of {to} \
             (where the result is used, e.g. `CudaDevice::get({})?.new_stream()?`) or of {from}",
            to.cuda_ordinal().unwrap_or(0)
        ),
    })
}

/// [`crate::DeviceMove::to_async`].
pub(crate) fn to_async(src: &Tensor, device: Device, stream: &Stream) -> Result<PendingTensor> {
    let started = Instant::now();
    let record = should_record(&[src]);
    let mut pending = PendingTensor {
        result: src.detach(),
        source: if record { src.clone() } else { src.detach() },
        _scratch: None,
        _staging: None,
        done: None,
        record,
        to: device,
        report: TransferReport::new(TransferPath::SameDevice, 0),
        started,
    };
    with_no_grad(|| -> Result<()> {
        match (src.device(), device) {
            (from, to) if from == to => {}
            (Device::Cuda(ordinal), Device::Cpu) => {
                check_stream(stream, src.device())?;
                let dev = cuda(ordinal)?;
                let dense = dense(src)?;
                let Some(mut pinned) = within_budget(PinnedPool::global()?.alloc(dense.nbytes()))?
                else {
                    // Beyond the pinned budget: a blocking move into pageable memory, ready now.
                    let (moved, path, staging) = beyond_budget(&dense, ordinal)?;
                    pending.result = moved;
                    pending.report = TransferReport::new(path, dense.nbytes());
                    pending.report.staging_peak_bytes = staging;
                    return Ok(());
                };
                after_default(&dev, stream)?;
                {
                    let guard = dense.storage().read();
                    let Buffer::Cuda(from) = &*guard else {
                        return Err(TensorError::UnsupportedDevice {
                            op: "to_async",
                            device: dense.device(),
                        });
                    };
                    from.copy_to_pinned_async(&mut pinned, stream)?;
                }
                pending.done = Some(stream.record()?);
                pending.result = wrap(Buffer::Pinned(pinned), &dense, Device::Cpu);
                pending.report = TransferReport::new(TransferPath::DeviceToPinned, dense.nbytes());
                pending._scratch = Some(dense);
            }
            (Device::Cpu, Device::Cuda(ordinal)) => {
                check_stream(stream, device)?;
                let dev = cuda(ordinal)?;
                let dense = dense(src)?;
                let Some(mut staging) = within_budget(PinnedPool::global()?.alloc(dense.nbytes()))?
                else {
                    // Beyond the pinned budget: a blocking move, ready now.
                    let (moved, path, staging) = move_bytes(&dense, device, false)?;
                    pending.result = moved;
                    pending.report = TransferReport::new(path, dense.nbytes());
                    pending.report.staging_peak_bytes = staging;
                    return Ok(());
                };
                {
                    let guard = dense.storage().read();
                    let bytes = guard.host_slice("to_async", dense.device())?;
                    staging.as_bytes_mut()?.copy_from_slice(bytes);
                }
                let mut out = dev.alloc(dense.nbytes(), dev.default_stream())?;
                after_default(&dev, stream)?;
                out.copy_from_pinned_async(&mut staging, stream)?;
                pending.done = Some(stream.record()?);
                pending.result = wrap(Buffer::Cuda(out), &dense, device);
                pending.report = TransferReport::new(TransferPath::HostToDevice, dense.nbytes());
                pending.report.staging_peak_bytes = staging.block_size();
                pending._staging = Some(staging);
            }
            // Between GPUs: a peer copy queued on `stream`, of either GPU.
            (Device::Cuda(_), Device::Cuda(ordinal)) => {
                check_peer_stream(stream.device(), src.device(), device)?;
                let dense = dense(src)?;
                let (moved, direct) = peer_copy(&dense, &cuda(ordinal)?, stream)?;
                pending.done = Some(stream.record()?);
                pending.result = moved;
                let path = TransferPath::Peer { direct, chunks: 1 };
                pending.report = TransferReport::new(path, dense.nbytes());
                if dense_copies(src) {
                    pending.report.staging_peak_bytes = dense.nbytes();
                }
                pending._scratch = Some(dense);
            }
            (Device::Cpu, Device::Cpu) => unreachable!("equal devices handled above"),
        }
        Ok(())
    })?;
    Ok(pending)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_move_takes_a_stream_of_either_gpu_and_names_the_fix_for_a_third() {
        let (a, b, c) = (Device::Cuda(0), Device::Cuda(1), Device::Cuda(2));
        assert!(check_peer_stream(b, a, b).is_ok(), "the target's stream");
        assert!(check_peer_stream(a, a, b).is_ok(), "the source's stream");
        let err = check_peer_stream(c, a, b).unwrap_err().to_string();
        for part in [
            "cuda:2",
            "pass a stream of cuda:1",
            "or of cuda:0",
            "get(1)",
        ] {
            assert!(err.contains(part), "`{part}` missing from: {err}");
        }
        let err = check_peer_stream(a, b, c).unwrap_err().to_string();
        assert!(err.contains("from cuda:1 to cuda:2"), "{err}");
    }
}
