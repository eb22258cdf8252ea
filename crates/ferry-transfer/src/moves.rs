//! Autograd-aware moves: a move is an ordinary graph op whose backward sends the gradient home.

use std::time::Instant;

use ferry_graph::{NodeKind, pruned_on_this_thread};
use ferry_memory::cuda::Stream;
use ferry_memory::{DType, Device};
use ferry_tensor::{Result, Rule, Save, Tensor, record_kind, should_record, with_no_grad};
use smallvec::smallvec;

use crate::chunked::{ChunkSpec, to_chunked};
use crate::copy::{dense_copies, move_bytes};
use crate::pending::{PendingTensor, to_async};
use crate::report::TransferReport;

/// How to move: an optional dtype fused into the move, and whether to wait for the bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MoveOptions {
    /// Convert to this dtype on the way; the cast runs on whichever side moves fewer bytes,
    /// and the backward casts the gradient back.
    pub dtype: Option<DType>,
    /// Return before a GPU-to-host copy finishes. The result's bytes sit in pinned memory and
    /// every read of them waits for the copy, so reading too early is not possible. Beyond
    /// the pinned budget the move blocks instead (into pageable memory; `report.path` says
    /// so).
    pub non_blocking: bool,
}

impl MoveOptions {
    /// Convert to `dtype` during the move.
    pub fn dtype(dtype: DType) -> Self {
        Self {
            dtype: Some(dtype),
            ..Self::default()
        }
    }

    /// Do not wait for a GPU-to-host copy to finish.
    pub fn non_blocking() -> Self {
        Self {
            non_blocking: true,
            ..Self::default()
        }
    }
}

/// Device moves on tensors.
pub trait DeviceMove: Sized {
    /// A copy on `device` (the tensor itself when it is already there). When the source
    /// requires grad and grad mode is on, records a transfer node whose backward moves the
    /// gradient back to the source device.
    ///
    /// GPU to host, the result lands in page-locked memory (DMA straight into it) while the
    /// pinned pool stays within its budget (`ferry::cuda::pinned::set_budget`, 1/8 of RAM by
    /// default); beyond it, in pooled pageable memory through bounded pinned staging
    /// (`report.path` is then `Chunked`).
    fn to(&self, device: Device) -> Result<Tensor>;

    /// [`DeviceMove::to`] with options, returning what the move did.
    fn to_with(&self, device: Device, options: MoveOptions) -> Result<(Tensor, TransferReport)>;

    /// The tensor on the host.
    fn cpu(&self) -> Result<Tensor> {
        self.to(Device::Cpu)
    }

    /// The tensor on CUDA device `ordinal`.
    fn cuda(&self, ordinal: usize) -> Result<Tensor> {
        self.to(Device::Cuda(ordinal))
    }

    /// Moves by value: the source is given up as soon as the copy completes, so its device
    /// memory returns to the allocator (unless a view or the graph still holds it).
    fn into_device(self, device: Device) -> Result<(Tensor, TransferReport)>;

    /// Detaches, then moves by value: records nothing, and the source's history (nodes and
    /// saved buffers only it kept alive) is pruned; the report counts the pruned nodes.
    fn detach_into(self, device: Device) -> Result<(Tensor, TransferReport)>;

    /// Moves in pieces along axis 0 through a bounded ring of pinned staging buffers, on a copy
    /// stream of its own, the DMA of one piece overlapping the host copy of the previous one.
    /// The result is one ordinary tensor (pageable host memory, or device memory), bit-identical
    /// to [`DeviceMove::to`]; non-contiguous sources are made contiguous a piece at a time.
    /// Records one transfer node for the whole move when the source requires grad.
    ///
    /// `report.staging_peak_bytes` is what the move itself held at once (staging blocks as the
    /// pinned pool sizes them, and scratch pieces), counted by the move: the pools' statistics
    /// and their peaks are left alone. When the pinned budget has no room for the staging, the
    /// pieces go through the driver's pageable path instead. A zero count, or a bound smaller
    /// than one row, is an error naming the smallest valid value. Between two GPUs this is a
    /// plain peer copy; on one device it is the identity.
    fn to_chunked(&self, device: Device, spec: ChunkSpec) -> Result<(Tensor, TransferReport)>;

    /// Queues the move on `stream` (of the GPU side of the move) and returns at once. GPU to
    /// host lands in pinned memory; the copy is ordered after the work already queued on the
    /// default stream, where the source was produced, and an in-place write of the source
    /// issued afterwards (`assign`, an optimizer step) waits for the copy on the device, so the
    /// moved values are the ones the source held when the move was issued. See
    /// [`PendingTensor`].
    ///
    /// When the pinned buffer would not fit the pinned budget
    /// (`ferry::cuda::pinned::set_budget`), the move runs blocking instead, through the
    /// staging pipeline into pageable memory, and the pending tensor is ready at once
    /// (`report.path` says `Chunked`).
    fn to_async(&self, device: Device, stream: &Stream) -> Result<PendingTensor>;
}

/// Records `moved` as a transfer of `src` to `to` when `src` requires grad and grad mode is on:
/// the backward moves the gradient back to `src`'s device and dtype.
pub(crate) fn record_transfer(
    moved: Tensor,
    src: &Tensor,
    to: Device,
    op: &'static str,
    report: &mut TransferReport,
) -> Tensor {
    if should_record(&[src]) {
        report.nodes_recorded = 1;
    }
    let kind = NodeKind::Transfer {
        from: src.device(),
        to,
    };
    // Saves nothing: the source's device and dtype are all the way home needs. Under
    // `create_graph` the move back records a transfer node of its own, so second derivatives
    // come home too.
    record_kind(moved, op, kind, &[src], || {
        Rule::new(
            Save::NOTHING,
            (src.device(), src.dtype()),
            |_, &(device, dtype), g, _| {
                let back = MoveOptions {
                    dtype: Some(dtype),
                    non_blocking: false,
                };
                Ok(smallvec![Some(g.to_with(device, back)?.0)])
            },
        )
    })
}

impl DeviceMove for Tensor {
    fn to(&self, device: Device) -> Result<Tensor> {
        Ok(self.to_with(device, MoveOptions::default())?.0)
    }

    fn to_with(&self, device: Device, options: MoveOptions) -> Result<(Tensor, TransferReport)> {
        let start = Instant::now();
        let (from_device, from_dtype) = (self.device(), self.dtype());
        let to_dtype = options.dtype.unwrap_or(from_dtype);
        let (moved, mut report) = with_no_grad(|| -> Result<_> {
            // Cast first when that makes the bytes to move fewer.
            let cast_first = to_dtype.size() < from_dtype.size();
            let src = if cast_first {
                self.detach().to_dtype(to_dtype)?
            } else {
                self.detach()
            };
            let bytes = if from_device == device {
                0
            } else {
                src.nbytes()
            };
            let (moved, path, staging) = move_bytes(&src, device, options.non_blocking)?;
            let moved = moved.to_dtype(to_dtype)?;
            let mut report = TransferReport::new(path, bytes);
            // Pinned staging and scratch of a move beyond the pinned budget, plus (held all
            // the while) a cast before the move, or a non-dense source made dense on its own
            // device first: scratch memory on the source side.
            report.staging_peak_bytes = staging;
            if bytes > 0 && (cast_first || dense_copies(&src)) {
                report.staging_peak_bytes += src.nbytes();
            }
            Ok((moved, report))
        })?;
        let out = record_transfer(moved, self, device, "to_device", &mut report);
        report.elapsed = start.elapsed();
        Ok((out, report))
    }

    fn into_device(self, device: Device) -> Result<(Tensor, TransferReport)> {
        let (out, mut report) = self.to_with(device, MoveOptions::default())?;
        // Counted on this thread: exactly what dropping the source freed, whatever other
        // threads prune meanwhile.
        let before = pruned_on_this_thread();
        drop(self);
        report.nodes_pruned = (pruned_on_this_thread() - before) as usize;
        Ok((out, report))
    }

    fn detach_into(self, device: Device) -> Result<(Tensor, TransferReport)> {
        let detached = self.detach();
        let before = pruned_on_this_thread();
        drop(self);
        let pruned = (pruned_on_this_thread() - before) as usize;
        let (out, mut report) = detached.to_with(device, MoveOptions::default())?;
        report.nodes_pruned = pruned;
        Ok((out, report))
    }

    fn to_chunked(&self, device: Device, spec: ChunkSpec) -> Result<(Tensor, TransferReport)> {
        to_chunked(self, device, spec)
    }

    fn to_async(&self, device: Device, stream: &Stream) -> Result<PendingTensor> {
        to_async(self, device, stream)
    }
}
