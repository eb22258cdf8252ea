//! Writing a checkpoint: the header, then every tensor's bytes hashed on the way, into a
//! durable temporary file (see `durable`) renamed over the target at the end.
//!
//! Tensors go to the file in pieces (see `plan`): a contiguous host tensor's bytes go from its
//! storage with no copy; a device tensor's pieces go through a ring of pinned slots on a copy
//! stream, so the DMA of the next pieces overlaps the write and CRC of the current one; a
//! non-contiguous tensor is made contiguous a block at a time on its own device. Extra memory
//! is bounded by the staging bound on the host and on each device.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::Path;
use std::time::Instant;

use ferry_memory::cuda::CudaDevice;
use ferry_tensor::{Buffer, Device, Tensor, TensorError};
use safetensors::tensor::TensorInfo;

use super::CheckpointError;
use super::format::{Checksums, header_bytes, header_checksum, safetensors_dtype};
use super::plan::{Piece, SLOTS, Slots, pieces};
use super::stage::{CheckpointReport, Meter, Ring, Slot, after_default, copy_stream};
use crate::durable::TempFile;

/// Bytes hashed and written at a time: small enough to stay in cache between the two.
const CHUNK: usize = 4 << 20;

/// Hashes and writes `bytes`, a cache-sized chunk at a time.
pub(super) fn hash_and_write(
    out: &mut impl Write,
    hasher: &mut crc32fast::Hasher,
    bytes: &[u8],
    temp: &Path,
) -> Result<(), CheckpointError> {
    for chunk in bytes.chunks(CHUNK) {
        hasher.update(chunk);
        out.write_all(chunk).map_err(io(temp))?;
    }
    Ok(())
}

pub(super) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A tensor as the file takes it: the tensor (detached) and its pieces.
struct Entry {
    t: Tensor,
    pieces: Vec<Piece>,
}

impl Entry {
    fn on_device(&self) -> bool {
        self.t.device().is_cuda()
    }
}

/// Where each tensor goes in a file: safetensors' order (widest dtype first, then by name, so
/// every tensor is aligned to its element size in the file; the header's length is a multiple
/// of 8) and the header's record of each.
pub(super) struct FileLayout {
    /// Indices into the tensors given, in file order.
    pub order: Vec<usize>,
    /// Each tensor's name and place, in file order.
    pub infos: Vec<(String, TensorInfo)>,
    /// Bytes of tensor data.
    pub bytes: usize,
}

impl FileLayout {
    pub fn new(tensors: &[(String, Tensor)]) -> Self {
        let mut order: Vec<usize> = (0..tensors.len()).collect();
        order.sort_by(|&a, &b| {
            let ((ka, ta), (kb, tb)) = (&tensors[a], &tensors[b]);
            let (da, db) = (safetensors_dtype(ta.dtype()), safetensors_dtype(tb.dtype()));
            db.cmp(&da).then(ka.cmp(kb))
        });
        let mut infos = Vec::with_capacity(order.len());
        let mut offset = 0usize;
        for &i in &order {
            let (key, t) = &tensors[i];
            let end = offset + t.nbytes();
            let info = TensorInfo {
                dtype: safetensors_dtype(t.dtype()),
                shape: t.shape().to_vec(),
                data_offsets: (offset, end),
            };
            infos.push((key.clone(), info));
            offset = end;
        }
        Self {
            order,
            infos,
            bytes: offset,
        }
    }
}

/// A file being written: the temporary file with its header's placeholder written, and the
/// checksums to fill in.
pub(super) struct OpenFile {
    pub temp: TempFile,
    sums: Checksums,
    placeholder_len: usize,
}

impl OpenFile {
    /// Creates the temporary file beside `path` and writes the header with zero checksums
    /// (they have a fixed width: the final header is as long); the data follows at
    /// [`OpenFile::data_start`].
    pub fn create(
        path: &Path,
        layout: &FileLayout,
        metadata: &BTreeMap<String, String>,
    ) -> Result<Self, CheckpointError> {
        let sums = Checksums {
            header: header_checksum(&layout.infos, metadata),
            tensors: layout.infos.iter().map(|(k, _)| (k.clone(), 0)).collect(),
        };
        let placeholder = header_bytes(path, &layout.infos, metadata, &sums)?;
        let temp = TempFile::create(path)?;
        let mut file = &temp.file;
        file.write_all(&(placeholder.len() as u64).to_le_bytes())
            .and_then(|()| file.write_all(&placeholder))
            .map_err(io(&temp.path))?;
        Ok(Self {
            temp,
            sums,
            placeholder_len: placeholder.len(),
        })
    }

    /// Fills in the checksums (one per tensor, in file order), fsyncs the file and renames it
    /// over `path` (then fsyncs the directory). Everything written through `&self.temp.file`
    /// must be flushed first.
    pub fn persist(
        mut self,
        path: &Path,
        layout: &FileLayout,
        metadata: &BTreeMap<String, String>,
        crcs: Vec<u32>,
    ) -> Result<(), CheckpointError> {
        for ((key, _), crc) in layout.infos.iter().zip(crcs) {
            self.sums.tensors.insert(key.clone(), crc);
        }
        let header = header_bytes(path, &layout.infos, metadata, &self.sums)?;
        if header.len() != self.placeholder_len {
            return Err(CheckpointError::Format {
                path: path.to_path_buf(),
                reason: "internal error: the header changed length once its checksums were filled in; please report it".into(),
            });
        }
        let mut file = &self.temp.file;
        file.seek(SeekFrom::Start(8))
            .and_then(|_| file.write_all(&header))
            .and_then(|()| file.sync_all())
            .map_err(io(&self.temp.path))?;
        self.temp.persist(path)?;
        Ok(())
    }
}

/// Writes `tensors` (names checked; any device, any layout) and `metadata` to `path` durably,
/// in pieces that fit `slots`.
pub(super) fn write_file(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: &BTreeMap<String, String>,
    slots: Slots,
) -> Result<CheckpointReport, CheckpointError> {
    write_file_as_is(path, tensors, metadata, slots).map_err(|e| e.for_target(path))
}

fn write_file_as_is(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: &BTreeMap<String, String>,
    slots: Slots,
) -> Result<CheckpointReport, CheckpointError> {
    let started = Instant::now();
    let layout = FileLayout::new(tensors);
    let entries: Vec<Entry> = layout
        .order
        .iter()
        .map(|&i| {
            let t = tensors[i].1.detach();
            let pieces = pieces(t.shape(), t.dtype().size(), t.is_contiguous(), slots);
            Entry { t, pieces }
        })
        .collect();
    let file = OpenFile::create(path, &layout, metadata)?;
    let mut report = CheckpointReport {
        tensors: entries.len(),
        bytes: layout.bytes,
        ..CheckpointReport::default()
    };
    let mut out = BufWriter::with_capacity(1 << 20, &file.temp.file);
    let crcs = write_pieces(&mut out, &entries, slots, &file.temp.path, &mut report)?;
    out.flush().map_err(io(&file.temp.path))?;
    drop(out);
    file.persist(path, &layout, metadata, crcs)?;
    report.elapsed = started.elapsed();
    Ok(report)
}

/// A device piece queued into a slot.
struct Part {
    /// Index into the sequence of all pieces.
    item: usize,
    /// Where it lies in the slot.
    at: usize,
    len: usize,
    /// The contiguous block it was copied from (a non-contiguous tensor's) and the device
    /// bytes that holds, kept until the piece is written.
    scratch: Option<(Tensor, usize)>,
}

/// Consecutive device pieces of one device queued into one slot with one batch (one event), so
/// many small tensors cost one synchronization, not one each.
struct Group {
    slot: usize,
    parts: VecDeque<Part>,
}

/// Every piece of every entry, in file order, hashed and written; returns each entry's CRC32.
fn write_pieces(
    out: &mut impl Write,
    entries: &[Entry],
    slots: Slots,
    temp: &Path,
    report: &mut CheckpointReport,
) -> Result<Vec<u32>, CheckpointError> {
    let items: Vec<(usize, usize)> = entries
        .iter()
        .enumerate()
        .flat_map(|(e, entry)| (0..entry.pieces.len()).map(move |p| (e, p)))
        .collect();
    let device_items: Vec<usize> = (0..items.len())
        .filter(|&i| entries[items[i].0].on_device())
        .collect();
    let lens: Vec<usize> = device_items
        .iter()
        .map(|&i| {
            let (e, p) = items[i];
            entries[e].pieces[p].len(entries[e].t.shape(), entries[e].t.dtype().size())
        })
        .collect();
    let (mut host, mut device) = (Meter::default(), Meter::default());
    // Slots no larger than a quarter of what crosses (a small model takes little pinned
    // memory), but holding the longest piece.
    let slot_len = lens.iter().max().map(|&longest| {
        let total: usize = lens.iter().sum();
        longest.max(total.div_ceil(SLOTS)).min(slots.slot)
    });
    let mut ring = slot_len
        .map(|len| Ring::new(len, device_items.len(), &mut host))
        .transpose()?;
    let mut free: Vec<usize> = ring
        .as_ref()
        .map_or(Vec::new(), |r| (0..r.slots.len()).rev().collect());
    let mut groups: VecDeque<Group> = VecDeque::new();
    let mut queue = Queue {
        entries,
        items: &items,
        device_items: &device_items,
        lens: &lens,
        next: 0,
        ordered: HashSet::new(),
    };
    let mut hashers: Vec<crc32fast::Hasher> = entries.iter().map(|_| Default::default()).collect();
    for (i, &(e, p)) in items.iter().enumerate() {
        let entry = &entries[e];
        let piece = &entry.pieces[p];
        if !entry.on_device() {
            write_host_piece(out, entry, piece, &mut hashers[e], &mut host, temp)?;
            if matches!(piece, Piece::Block(_)) {
                report.pieces += 1;
            }
            continue;
        }
        let ring = ring.as_mut().expect("device pieces have a ring");
        while let Some(&slot) = free.last() {
            if queue.next == device_items.len() {
                break;
            }
            let limit = slot_len.expect("device pieces have a slot length");
            let parts = queue.group(&mut ring.slots[slot], limit, &mut device)?;
            free.pop();
            groups.push_back(Group { slot, parts });
        }
        let group = groups.front_mut().expect("the next device piece is queued");
        let part = group.parts.pop_front().expect("groups are not empty");
        debug_assert_eq!(part.item, i);
        let bytes = match &ring.slots[group.slot] {
            // Waits for this slot's DMA only; the other slots stay in flight meanwhile.
            Slot::Pinned(b) => b.as_bytes().map_err(TensorError::from)?,
            Slot::Pageable(v) => v.as_slice(),
        };
        let range = part.at..part.at + part.len;
        hash_and_write(out, &mut hashers[e], &bytes[range], temp)?;
        if let Some((_, held)) = part.scratch {
            device.release(held);
        }
        if group.parts.is_empty() {
            free.push(group.slot);
            groups.pop_front();
        }
        report.pieces += 1;
        report.device_bytes += part.len;
    }
    if let Some(ring) = ring {
        report.pageable = ring.pageable();
        ring.release(&mut host);
    }
    report.peak_extra_host_bytes = host.peak();
    report.peak_extra_device_bytes = device.peak();
    Ok(hashers
        .into_iter()
        .map(crc32fast::Hasher::finalize)
        .collect())
}

/// The device pieces still to queue, in file order.
struct Queue<'a> {
    entries: &'a [Entry],
    items: &'a [(usize, usize)],
    device_items: &'a [usize],
    /// Bytes of each device piece.
    lens: &'a [usize],
    /// The next device piece to queue (an index into `device_items`).
    next: usize,
    /// Devices whose copy stream was ordered after their default stream.
    ordered: HashSet<usize>,
}

impl Queue<'_> {
    /// Queues the next device pieces that fit `limit` bytes of `slot` (at least one), all of one
    /// device, with their scratch (as the allocator sizes it) within `limit` too.
    fn group(
        &mut self,
        slot: &mut Slot,
        limit: usize,
        device: &mut Meter,
    ) -> Result<VecDeque<Part>, CheckpointError> {
        let first = self.entries[self.items[self.device_items[self.next]].0]
            .t
            .device();
        let Device::Cuda(ordinal) = first else {
            unreachable!("device pieces come from device tensors")
        };
        let dev = CudaDevice::get(ordinal).map_err(TensorError::from)?;
        let (mut parts, mut sources) = (VecDeque::new(), Vec::new());
        let (mut used, mut scratch_used, mut fresh) = (0usize, 0usize, false);
        while self.next < self.device_items.len() {
            let item = self.device_items[self.next];
            let (e, p) = self.items[item];
            let entry = &self.entries[e];
            let len = self.lens[self.next];
            if entry.t.device() != first || (!parts.is_empty() && used + len > limit) {
                break;
            }
            // What the piece is read from: a byte range of the tensor's storage, a block of it
            // that is contiguous already, or a contiguous copy of the block (scratch).
            let (view, copied) = match &entry.pieces[p] {
                Piece::Bytes(r) => {
                    let start = entry.t.layout().offset() * entry.t.dtype().size() + r.start;
                    ((entry.t.clone(), start), false)
                }
                Piece::Block(ranges) => {
                    let b = block_view(&entry.t, ranges)?;
                    let start = b.layout().offset() * b.dtype().size();
                    let copied = !b.is_contiguous();
                    ((b, start), copied)
                }
            };
            let held = if copied {
                CudaDevice::block_size(len)
            } else {
                0
            };
            if !parts.is_empty() && scratch_used + held > limit {
                break;
            }
            let ((source, start), scratch) = if copied {
                let b = view.0.copy()?;
                device.hold(held);
                fresh = true;
                let start = b.layout().offset() * b.dtype().size();
                ((b.clone(), start), Some((b, held)))
            } else {
                (view, None)
            };
            sources.push((source, start));
            parts.push_back(Part {
                item,
                at: used,
                len,
                scratch,
            });
            used += len;
            scratch_used += held;
            self.next += 1;
        }
        match slot {
            Slot::Pinned(staging) => {
                let stream = copy_stream(&dev)?;
                // Once per device, and after blocks just made on the default stream.
                if self.ordered.insert(ordinal) || fresh {
                    after_default(&dev, &stream)?;
                }
                let mut batch = staging.batch(&stream).map_err(TensorError::from)?;
                for ((source, start), part) in sources.iter().zip(&parts) {
                    let guard = source.storage().read();
                    batch
                        .download(cuda_buffer(&guard, source)?, *start, part.at, part.len)
                        .map_err(TensorError::from)?;
                }
                batch.finish().map_err(TensorError::from)?;
            }
            Slot::Pageable(bytes) => {
                for ((source, start), part) in sources.iter().zip(&parts) {
                    let guard = source.storage().read();
                    cuda_buffer(&guard, source)?
                        .copy_to_host_at(
                            *start,
                            &mut bytes[part.at..part.at + part.len],
                            dev.default_stream(),
                        )
                        .map_err(TensorError::from)?;
                }
            }
        }
        Ok(parts)
    }
}

/// The device buffer behind `t`'s storage.
pub(super) fn cuda_buffer<'a>(
    guard: &'a Buffer,
    t: &Tensor,
) -> Result<&'a ferry_memory::cuda::DeviceBuffer, CheckpointError> {
    match guard {
        Buffer::Cuda(from) => Ok(from),
        _ => Err(TensorError::UnsupportedDevice {
            op: "checkpoint::save",
            device: t.device(),
        }
        .into()),
    }
}

/// The view of `t` a block is (contiguous or not).
pub(super) fn block_view(
    t: &Tensor,
    ranges: &[std::ops::Range<usize>],
) -> Result<Tensor, CheckpointError> {
    let mut b = t.clone();
    for (axis, r) in ranges.iter().enumerate() {
        b = b.narrow(axis as isize, r.start, r.len())?;
    }
    Ok(b)
}

/// What a piece of host tensor `t` is read from: `t` itself and a byte range of its storage,
/// or, for a block that is not contiguous, a contiguous copy of it made in scratch memory.
pub(super) fn host_source(
    t: &Tensor,
    piece: &Piece,
) -> Result<(Tensor, std::ops::Range<usize>), CheckpointError> {
    let source = match piece {
        Piece::Bytes(r) => {
            let start = t.layout().offset() * t.dtype().size();
            return Ok((t.clone(), start + r.start..start + r.end));
        }
        Piece::Block(ranges) => {
            let b = block_view(t, ranges)?;
            if b.is_contiguous() { b } else { b.copy()? }
        }
    };
    let start = source.layout().offset() * source.dtype().size();
    let range = start..start + source.nbytes();
    Ok((source, range))
}

/// Runs `f` on bytes `range` of host tensor `source`'s storage, under its read lock (so the
/// bytes `f` sees are not written meanwhile).
pub(super) fn with_host_bytes<R>(
    op: &'static str,
    source: &Tensor,
    range: std::ops::Range<usize>,
    f: impl FnOnce(&[u8]) -> Result<R, CheckpointError>,
) -> Result<R, CheckpointError> {
    let guard = source.storage().read();
    let not_on_host = || TensorError::NotOnHost {
        op,
        device: source.device(),
    };
    let bytes = guard
        .try_host_bytes()
        .map_err(TensorError::from)?
        .ok_or_else(not_on_host)?
        .get(range)
        .ok_or_else(not_on_host)?;
    f(bytes)
}

/// Writes one piece of a host tensor: a range of its storage, read under its lock so the bytes
/// hashed are the bytes written (an in-place write waits for the file instead), or a block made
/// contiguous in scratch memory first.
fn write_host_piece(
    out: &mut impl Write,
    entry: &Entry,
    piece: &Piece,
    hasher: &mut crc32fast::Hasher,
    host: &mut Meter,
    temp: &Path,
) -> Result<(), CheckpointError> {
    let (source, range) = host_source(&entry.t, piece)?;
    let held = if source.shares_storage(&entry.t) {
        0
    } else {
        source.nbytes()
    };
    host.hold(held);
    with_host_bytes("checkpoint::save", &source, range, |bytes| {
        hash_and_write(out, hasher, bytes, temp)
    })?;
    host.release(held);
    Ok(())
}
