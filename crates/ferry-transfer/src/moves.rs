//! Autograd-aware moves: a move is an ordinary graph op whose backward sends the gradient home.

use ferry_graph::pruned_on_this_thread;
use ferry_memory::Device;
use ferry_memory::cuda::Stream;
use ferry_tensor::{Result, Tensor};

use crate::chunked::to_chunked;
use crate::copy::pin_in_place;
use crate::pending::{PendingTensor, to_async};
use crate::plan::ChunkSpec;
use crate::record::{MoveOptions, to_with};
use crate::report::TransferReport;
use crate::streaming::{ChunkStream, stream_to};

/// Device moves on tensors.
pub trait DeviceMove: Sized {
    /// A copy on `device`. When the tensor is already there nothing is copied: the result is an
    /// alias (the same storage; an in-place write through one shows through the other). Either
    /// way, when the source requires grad and grad mode is on, records a transfer node whose
    /// backward moves the gradient back to the source device.
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
    /// than one row, is an error naming the smallest valid value. Between two GPUs the pieces
    /// go peer to peer through a scratch ring of at most two pieces on each GPU (`report.path`
    /// is `Peer { direct, chunks }`); on one device it copies nothing (an alias, recorded as
    /// [`DeviceMove::to`] records it).
    fn to_chunked(&self, device: Device, spec: ChunkSpec) -> Result<(Tensor, TransferReport)>;

    /// Queues the move on `stream` (of the GPU side of the move; between two GPUs, of either,
    /// and a third device's stream is an error naming the fix) and returns at once. GPU to
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

    /// The tensor's host chunks along axis 0, in order, as an iterator: while the caller works
    /// on one chunk, the copies of the next ones are in flight (on the device's copy stream,
    /// ordered after the work already queued where the source was produced). `device` must be
    /// [`Device::Cpu`]; `spec` bounds the pinned staging exactly as for
    /// [`DeviceMove::to_chunked`] (two blocks when two rows fit, so one chunk travels while the
    /// caller holds the other), and [`ChunkStream::plan`] says which rows each chunk carries.
    ///
    /// Each chunk is a [`HostChunk`](crate::HostChunk): detached data (no gradient history,
    /// whatever the source requires) whose tensor is a view of a page-locked staging block, so
    /// no host copy is made.
    /// Dropping the chunk returns the block to the ring; keeping it is safe too (the block then
    /// leaves the ring, which takes a fresh one), so the ring never holds more than the plan's
    /// staging, and chunks kept are the caller's memory like any tensor. When the pinned budget
    /// has no room for staging, chunks come through the driver's pageable path, one at a time.
    ///
    /// Each chunk holds the values its rows had when its copy was queued, at most one ring
    /// ahead of the chunk handed out; writing the source in place while it streams makes the
    /// next `next()` an error (stream a copy instead). A failed copy surfaces from `next()`.
    /// Dropping the stream early waits for the copies in flight and returns the staging. A
    /// host source streams views of its own rows, with no copy. Records nothing in the graph.
    fn stream_to(&self, device: Device, spec: ChunkSpec) -> Result<ChunkStream>;

    /// Page-locks a host tensor's memory where it is (`cuMemHostRegister`), within the pinned
    /// pool's budget, so that later moves of it to and from a GPU are direct DMA at the link
    /// instead of going through pageable staging. Its storage stays locked until it is freed
    /// (the registration is undone then). `Ok(false)` when the memory is page-locked already
    /// (a pinned result of a move, or pinned before); an error naming the budget when it does
    /// not fit (`PinnedBudgetExceeded`), and for a tensor on a GPU.
    fn pin_in_place(&self) -> Result<bool>;
}

impl DeviceMove for Tensor {
    fn to(&self, device: Device) -> Result<Tensor> {
        Ok(self.to_with(device, MoveOptions::default())?.0)
    }

    fn to_with(&self, device: Device, options: MoveOptions) -> Result<(Tensor, TransferReport)> {
        to_with(self, device, options)
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

    fn stream_to(&self, device: Device, spec: ChunkSpec) -> Result<ChunkStream> {
        stream_to(self, device, spec)
    }

    fn pin_in_place(&self) -> Result<bool> {
        pin_in_place(self)
    }
}
