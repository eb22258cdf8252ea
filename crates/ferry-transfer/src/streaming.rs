//! Streaming to the host: an iterator of host chunks of a tensor along axis 0, the next chunks'
//! copies in flight while the caller works on the current one.
//!
//! A GPU source streams through a ring of pinned staging blocks (the plan's, within the pinned
//! budget) on the device's copy stream. Each chunk handed out is a view of its ring block, so no
//! host copy is made; when the caller drops it, the block goes back into the ring. A chunk kept
//! longer simply leaves the ring: the ring takes a fresh block in its place, so keeping chunks is
//! always safe and the ring itself never holds more than the plan's staging.

use std::collections::VecDeque;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_memory::cuda::{CudaDevice, PinnedBuffer, PinnedPool, Stream};
use ferry_memory::{DType, Device, HostPool};
use ferry_tensor::{Buffer, Layout, Result, Storage, Tensor, TensorError};

use crate::pipeline::{piece_source, queue_download};
use crate::plan::{ChunkPlan, ChunkSpec};
use crate::report::{TransferPath, TransferReport};
use crate::staging::{StagingMeter, after_default, cuda, transfer_stream, within_budget};

const OP: &str = "stream_to";

/// One chunk of a [`ChunkStream`]: rows `rows()` of the source along axis 0, on the host.
///
/// Detached data: the tensor has no gradient history and does not require grad, whatever the
/// source did (streaming is for consuming values; use [`crate::DeviceMove::to_chunked`] to keep
/// a gradient path). From a GPU source it is a snapshot in its own page-locked block; from a
/// host source it is a view of the source's rows.
#[derive(Clone)]
pub struct HostChunk {
    index: usize,
    rows: Range<usize>,
    tensor: Tensor,
}

impl HostChunk {
    /// Position of this chunk in the stream, from 0.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The source rows (along axis 0) this chunk holds; `0..1` for a 0-d source.
    pub fn rows(&self) -> Range<usize> {
        self.rows.clone()
    }

    /// The chunk's values: shape `[rows().len(), ..]` (the source's shape for a 0-d source),
    /// on the host, contiguous, without gradient history.
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    /// The chunk's tensor, kept as long as wanted (its block then leaves the stream's ring).
    pub fn into_tensor(self) -> Tensor {
        self.tensor
    }
}

impl fmt::Debug for HostChunk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostChunk")
            .field("index", &self.index)
            .field("rows", &self.rows)
            .field("shape", &self.tensor.shape())
            .field("dtype", &self.tensor.dtype())
            .finish()
    }
}

/// The host chunks of a tensor along axis 0, in order: see [`crate::DeviceMove::stream_to`].
///
/// Each item is a `Result`: a failed copy surfaces from `next()`, and the stream ends after it.
/// Dropping the stream early is safe: it waits for the copies still in flight and returns its
/// staging to the pinned pool.
#[must_use = "a chunk stream copies nothing until it is iterated"]
pub struct ChunkStream {
    plan: ChunkPlan,
    shape: Vec<usize>,
    dtype: DType,
    /// Index of the next chunk `next()` hands out.
    next_out: usize,
    source: Source,
    /// The source's storage version when streaming began: an in-place write since would mix
    /// old and new values across chunks.
    version: u64,
    waited: Duration,
    failed: bool,
    started: Instant,
}

enum Source {
    /// Chunks are views of the source's rows.
    Host(Tensor),
    /// Chunks come through the staging ring.
    Cuda(Box<Ring>),
}

/// A chunk queued or ready: in a ring slot, or already in pageable memory.
enum Queued {
    Slot(usize),
    Ready(Tensor),
}

/// The copy machinery of a GPU source.
struct Ring {
    /// Detached, dense or not (non-contiguous pieces are made dense a piece at a time).
    src: Tensor,
    dev: CudaDevice,
    stream: Stream,
    /// Pinned blocks of `plan.piece_bytes()` bytes, each as a host storage chunks view;
    /// `None` once a kept block left and the budget had no room for a new one.
    slots: Vec<Option<Arc<Storage>>>,
    /// Chunks whose copy was queued, oldest first, with where they land.
    in_flight: VecDeque<Queued>,
    /// Index of the next chunk to queue.
    next_in: usize,
    meter: StagingMeter,
}

impl ChunkStream {
    /// Number of chunks in all (0 for a source without elements).
    pub fn chunks(&self) -> usize {
        self.plan.len()
    }

    /// The plan: which rows each chunk carries, and the staging the ring takes.
    pub fn plan(&self) -> &ChunkPlan {
        &self.plan
    }

    /// Time `next()` spent waiting for chunks to arrive, in all: near zero when the caller's
    /// work per chunk is longer than a chunk's copy (the stream keeps up), large when the caller
    /// is waiting on the link.
    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// What the stream has moved so far: bytes of the chunks handed out, `Chunked` path, the
    /// staging the ring held at most (counted by the stream itself), no graph nodes.
    pub fn report(&self) -> TransferReport {
        let row_bytes = self.plan.row_bytes();
        let bytes = match &self.source {
            Source::Host(_) => 0,
            Source::Cuda(_) => self.plan.pieces()[..self.next_out]
                .iter()
                .map(|r| r.len() * row_bytes)
                .sum(),
        };
        let path = match &self.source {
            Source::Host(_) => TransferPath::SameDevice,
            Source::Cuda(_) => TransferPath::Chunked {
                chunks: self.plan.len(),
            },
        };
        let mut report = TransferReport::new(path, bytes);
        if let Source::Cuda(ring) = &self.source {
            report.staging_peak_bytes = ring.meter.peak();
        }
        report.elapsed = self.started.elapsed();
        report
    }

    /// The shape of chunk `i`.
    fn chunk_shape(&self, i: usize) -> Vec<usize> {
        let mut shape = self.shape.clone();
        if let Some(rows) = shape.first_mut() {
            *rows = self.plan.pieces()[i].len();
        }
        shape
    }

    fn next_chunk(&mut self) -> Result<HostChunk> {
        let i = self.next_out;
        let rows = self.plan.pieces()[i].clone();
        let shape = self.chunk_shape(i);
        let source = match &self.source {
            Source::Host(src) => src,
            Source::Cuda(ring) => &ring.src,
        };
        if source.storage().version() != self.version {
            return Err(TensorError::InvalidArgument {
                op: OP,
                message: "the source was written in place while it was streaming, so later \
                          chunks would not match earlier ones; stream a copy (`x.copy()`), or \
                          finish the stream before writing the source"
                    .into(),
            });
        }
        let tensor = match &mut self.source {
            Source::Host(src) => {
                if src.ndim() == 0 {
                    src.clone()
                } else {
                    src.narrow(0, rows.start, rows.len())?
                }
            }
            Source::Cuda(ring) => {
                // Chunk i's block is free once the caller dropped chunk i - 1: refill the ring
                // first, so the next chunks travel while the caller works on this one.
                ring.top_up(&self.plan)?;
                let start = Instant::now();
                let tensor = ring.take(&shape, self.dtype)?;
                self.waited += start.elapsed();
                tensor
            }
        };
        Ok(HostChunk {
            index: i,
            rows,
            tensor,
        })
    }
}

impl Iterator for ChunkStream {
    type Item = Result<HostChunk>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.next_out >= self.plan.len() {
            return None;
        }
        let chunk = self.next_chunk();
        match &chunk {
            Ok(_) => self.next_out += 1,
            Err(_) => self.failed = true,
        }
        Some(chunk)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = if self.failed {
            0
        } else {
            self.plan.len() - self.next_out
        };
        (left, Some(left))
    }
}

impl fmt::Debug for ChunkStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChunkStream")
            .field("shape", &self.shape)
            .field("dtype", &self.dtype)
            .field("chunks", &self.plan.len())
            .field("next", &self.next_out)
            .finish()
    }
}

impl Ring {
    /// Queues copies until the ring is full or every chunk is queued.
    fn top_up(&mut self, plan: &ChunkPlan) -> Result<()> {
        let depth = self.slots.len().max(1);
        while self.next_in < plan.len() && self.in_flight.len() < depth {
            let j = self.next_in;
            let queued = match self.free_slot(plan)? {
                Some(s) => {
                    let storage = self.slots[s].as_ref().expect("a free slot has a block");
                    let mut guard = storage.write();
                    let Buffer::Pinned(staging) = &mut *guard else {
                        unreachable!("ring slots hold pinned blocks")
                    };
                    queue_download(
                        &self.src,
                        &self.dev,
                        plan,
                        j,
                        staging,
                        &self.stream,
                        &mut self.meter,
                    )?;
                    Queued::Slot(s)
                }
                None => Queued::Ready(self.download_pageable(plan, j)?),
            };
            self.in_flight.push_back(queued);
            self.next_in += 1;
        }
        Ok(())
    }

    /// A slot holding no queued copy whose block nobody else holds; a slot whose block the
    /// caller kept gets a fresh block (the kept one is the caller's now). `None` when the
    /// pinned budget has no room for one.
    fn free_slot(&mut self, plan: &ChunkPlan) -> Result<Option<usize>> {
        let busy: Vec<usize> = self
            .in_flight
            .iter()
            .filter_map(|q| match q {
                Queued::Slot(s) => Some(*s),
                Queued::Ready(_) => None,
            })
            .collect();
        let candidates = (0..self.slots.len()).filter(|s| !busy.contains(s));
        let mut kept = None;
        for s in candidates {
            match &self.slots[s] {
                Some(storage) if Arc::strong_count(storage) == 1 => return Ok(Some(s)),
                _ => kept = kept.or(Some(s)),
            }
        }
        let Some(s) = kept else {
            return Ok(None);
        };
        if let Some(old) = self.slots[s].take() {
            self.meter.release(block_size(&old));
        }
        let Some(block) = within_budget(PinnedPool::global()?.alloc_exact(plan.piece_bytes()))?
        else {
            return Ok(None);
        };
        self.meter.hold(block.block_size());
        self.slots[s] = Some(pinned_storage(block, self.src.dtype()));
        Ok(Some(s))
    }

    /// Chunk `j` through the driver's pageable path, blocking: for when the pinned budget has
    /// no room for staging.
    fn download_pageable(&mut self, plan: &ChunkPlan, j: usize) -> Result<Tensor> {
        let len = plan.byte_range(j).len();
        let (piece, offset, scratch) = piece_source(&self.src, plan, j)?;
        self.meter.hold(scratch);
        let mut out = HostPool::global().alloc(len)?;
        {
            let guard = piece.storage().read();
            let Buffer::Cuda(from) = &*guard else {
                return Err(TensorError::UnsupportedDevice {
                    op: OP,
                    device: piece.device(),
                });
            };
            from.copy_to_host_at(offset, out.as_bytes_mut(), self.dev.default_stream())?;
        }
        drop(piece);
        self.meter.release(scratch);
        let storage = Storage::new(Buffer::Host(out), self.src.dtype(), Device::Cpu);
        let rows = plan.pieces()[j].len();
        let mut shape = self.src.shape().to_vec();
        if let Some(first) = shape.first_mut() {
            *first = rows;
        }
        Tensor::from_storage(Arc::new(storage), Layout::contiguous(&shape))
    }

    /// The oldest queued chunk, once its bytes are there.
    fn take(&mut self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let queued = self
            .in_flight
            .pop_front()
            .expect("top_up queued the chunk handed out next");
        match queued {
            Queued::Ready(tensor) => Ok(tensor),
            Queued::Slot(s) => {
                let storage = Arc::clone(self.slots[s].as_ref().expect("a queued slot"));
                {
                    let guard = storage.read();
                    let Buffer::Pinned(block) = &*guard else {
                        unreachable!("ring slots hold pinned blocks")
                    };
                    // A failed copy surfaces here, from `next()`.
                    block.wait()?;
                }
                debug_assert_eq!(storage.dtype(), dtype);
                Tensor::from_storage(storage, Layout::contiguous(shape))
            }
        }
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // Wait for the copies still in flight, so the staging goes back idle. Reading through
        // `Deref` waits, and a failed wait is kept by the pinned pool and reported by its next
        // allocation; the block is not reused before its copy completes either way.
        for queued in &self.in_flight {
            if let Queued::Slot(s) = queued
                && let Some(storage) = &self.slots[*s]
                && let Buffer::Pinned(block) = &*storage.read()
            {
                let _bytes: &[u8] = block;
            }
        }
    }
}

fn block_size(storage: &Storage) -> usize {
    match &*storage.read() {
        Buffer::Pinned(block) => block.block_size(),
        _ => 0,
    }
}

fn pinned_storage(block: PinnedBuffer, dtype: DType) -> Arc<Storage> {
    Arc::new(Storage::new(Buffer::Pinned(block), dtype, Device::Cpu))
}

/// [`crate::DeviceMove::stream_to`].
pub(crate) fn stream_to(src: &Tensor, device: Device, spec: ChunkSpec) -> Result<ChunkStream> {
    let started = Instant::now();
    if device != Device::Cpu {
        return Err(TensorError::InvalidArgument {
            op: OP,
            message: format!(
                "streams chunks to the host, so the target must be Device::Cpu, not {device}; \
                 to move to a GPU use `to_chunked` or `to_async`"
            ),
        });
    }
    let plan = ChunkPlan::new(src.shape(), src.dtype(), spec).map_err(|e| match e {
        TensorError::InvalidArgument { message, .. } => {
            TensorError::InvalidArgument { op: OP, message }
        }
        other => other,
    })?;
    let detached = src.detach();
    let version = detached.storage().version();
    let source = match src.device() {
        Device::Cpu => Source::Host(detached),
        Device::Cuda(ordinal) => {
            let dev = cuda(ordinal)?;
            let stream = transfer_stream(&dev)?;
            // Ring blocks may come back from the pool freed by work still on the default stream.
            after_default(&dev, &stream)?;
            let mut meter = StagingMeter::default();
            let pool = PinnedPool::global()?;
            let mut slots = Vec::with_capacity(plan.staging_buffers());
            for _ in 0..plan.staging_buffers() {
                // Without room for the whole ring, the chunks take the pageable path (slots
                // that did fit still serve).
                match within_budget(pool.alloc_exact(plan.piece_bytes()))? {
                    Some(block) => {
                        meter.hold(block.block_size());
                        slots.push(Some(pinned_storage(block, src.dtype())));
                    }
                    None => break,
                }
            }
            if slots.is_empty() {
                slots.push(None);
            }
            let mut ring = Box::new(Ring {
                src: detached,
                dev,
                stream,
                slots,
                in_flight: VecDeque::new(),
                next_in: 0,
                meter,
            });
            // The first chunks start travelling now, before the caller asks for them.
            ring.top_up(&plan)?;
            Source::Cuda(ring)
        }
    };
    Ok(ChunkStream {
        shape: src.shape().to_vec(),
        dtype: src.dtype(),
        plan,
        next_out: 0,
        source,
        version,
        waited: Duration::ZERO,
        failed: false,
        started,
    })
}
