//! Reading a file: the header is checked against the file's length before anything is
//! allocated, then each tensor is read straight into its own buffer (from the host pool:
//! prefaulted, reused from an earlier load) and hashed on the way, all cores reading and hashing
//! 4 MiB chunks side by side (peak memory: the tensors themselves, about the file's size). Every
//! claim of the header is checked: a damaged file is an error, never a panic or an allocation
//! sized by a corrupt number.
//!
//! Reading onto a GPU streams: each piece is read into a pinned slot (by all cores, hashed),
//! and uploaded on a copy stream into the new tensor's device buffer while the next piece is
//! read into another slot. The tensors are handed out only once every checksum has passed.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use ferry_memory::HostPool;
use ferry_memory::cuda::{CudaDevice, DeviceBuffer};
use ferry_tensor::{Buffer, DType, Device, Layout, Storage, Tensor, TensorError};
use ferry_transfer::StateDict;
use rayon::prelude::*;
use safetensors::tensor::{Metadata, TensorInfo};

use super::CheckpointError;
use super::format::{CHECKSUM_KEY, Checksums, MAX_HEADER_LEN, ferry_dtype, header_checksum};
use super::plan::{Piece, SLOTS, Slots, pieces};
use super::stage::{CheckpointReport, Meter, Ring, Slot, after_default, copy_stream};

/// Bytes read and hashed at a time.
const CHUNK: usize = 4 << 20;

/// A file whose header was read and checked, positioned at its first tensor's bytes.
struct Opened<'p> {
    path: &'p Path,
    file: BufReader<File>,
    /// Where the data section starts in the file.
    data_start: u64,
    /// Each tensor's name and description, in file order.
    infos: Vec<(String, TensorInfo)>,
    dtypes: Vec<DType>,
    /// The metadata, less ferry's checksum record.
    metadata: BTreeMap<String, String>,
    /// The record, verified against the header, when the file has one.
    checksums: Option<Checksums>,
}

impl Opened<'_> {
    /// Checks a tensor's CRC32 against the record, if there is one.
    fn verify(&self, key: &str, hasher: crc32fast::Hasher) -> Result<(), CheckpointError> {
        if let Some(sums) = &self.checksums {
            let expected = sums.tensors[key];
            let found = hasher.finalize();
            if found != expected {
                return Err(CheckpointError::ChecksumMismatch {
                    path: self.path.to_path_buf(),
                    key: key.to_string(),
                    expected,
                    found,
                });
            }
        }
        Ok(())
    }
}

/// Opens `path` and checks its header: lengths against the file, dtypes, the checksum record.
fn open(path: &Path) -> Result<Opened<'_>, CheckpointError> {
    let io = |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    };
    let format = |reason: String| CheckpointError::Format {
        path: path.to_path_buf(),
        reason,
    };
    let file = File::open(path).map_err(io)?;
    let file_len = file.metadata().map_err(io)?.len();
    let mut file = BufReader::with_capacity(1 << 16, file);
    if file_len < 8 {
        return Err(format(format!(
            "the file has {file_len} bytes, fewer than its header needs (it is truncated or not a safetensors file)"
        )));
    }
    let mut len_bytes = [0u8; 8];
    file.read_exact(&mut len_bytes).map_err(io)?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER_LEN {
        return Err(format(format!(
            "its first 8 bytes declare a {header_len}-byte header, more than safetensors allows ({MAX_HEADER_LEN}); the file is damaged or not a safetensors file"
        )));
    }
    if header_len > file_len - 8 {
        return Err(format(format!(
            "its first 8 bytes declare a {header_len}-byte header, but the file has {file_len} bytes: it is truncated or not a safetensors file"
        )));
    }
    // Bounded by the file's length (checked above), so no allocation sized by a corrupt number.
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(io)?;
    let header = std::str::from_utf8(&header)
        .map_err(|e| format(format!("its header is not UTF-8 text ({e})")))?;
    let meta: Metadata = serde_json::from_str(header)
        .map_err(|e| format(format!("its header does not describe tensors: {e}")))?;

    let keys = meta.offset_keys();
    let infos: Vec<(String, TensorInfo)> = keys
        .iter()
        .map(|k| {
            (
                k.clone(),
                meta.info(k)
                    .expect("offset_keys come from the header")
                    .clone(),
            )
        })
        .collect();
    let available = file_len - 8 - header_len;
    check_length(path, &infos, available)?;
    let dtypes = infos
        .iter()
        .map(|(k, info)| ferry_dtype(path, k, info.dtype))
        .collect::<Result<Vec<_>, _>>()?;
    // An empty tensor may declare other dimensions of any size; its strides must still count.
    if let Some((key, info)) = infos.iter().find(|(_, info)| {
        info.shape
            .iter()
            .filter(|&&d| d != 0)
            .try_fold(8usize, |n, &d| n.checked_mul(d))
            .is_none()
    }) {
        return Err(CheckpointError::Format {
            path: path.to_path_buf(),
            reason: format!(
                "tensor {key:?} has shape {:?}, whose strides are too large to address",
                info.shape
            ),
        });
    }

    let mut metadata: BTreeMap<String, String> = meta
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    let checksums = match metadata.remove(CHECKSUM_KEY) {
        Some(record) => Some(verify_header(path, &record, &infos, &metadata)?),
        None => None,
    };
    Ok(Opened {
        path,
        file,
        data_start: 8 + header_len,
        infos,
        dtypes,
        metadata,
        checksums,
    })
}

/// The metadata of the file at `path`, less ferry's checksum record: its header alone is read.
pub(super) fn read_metadata(path: &Path) -> Result<BTreeMap<String, String>, CheckpointError> {
    Ok(open(path)?.metadata)
}

/// Every tensor of the file at `path` (in file order) and its metadata, less ferry's checksum
/// record. When the file carries the record, every tensor and the header are verified.
pub(super) fn read_file(
    path: &Path,
) -> Result<(StateDict, BTreeMap<String, String>), CheckpointError> {
    let io = |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut opened = open(path)?;
    let infos = std::mem::take(&mut opened.infos);
    let dtypes = std::mem::take(&mut opened.dtypes);
    let mut tensors = Vec::with_capacity(infos.len());
    for ((key, info), dtype) in infos.into_iter().zip(dtypes) {
        let (start, end) = info.data_offsets;
        // Prefaulted, and reused from an earlier load or save when one left a buffer of its
        // class: the read is a copy at memory speed rather than page faults; every byte is
        // overwritten (a short read is an error).
        let mut buffer = HostPool::global()
            .alloc(end - start)
            .map_err(TensorError::from)?;
        let at = opened.data_start + start as u64;
        let hasher =
            read_at_hashed(opened.file.get_ref(), at, buffer.as_bytes_mut()).map_err(io)?;
        opened.verify(&key, hasher)?;
        let t = Tensor::from_host_buffer(buffer, dtype, &info.shape)?;
        tensors.push((key, t));
    }
    Ok((tensors, opened.metadata))
}

/// What [`super::verify`] found in a sound file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// Tensors in the file.
    pub tensors: usize,
    /// Bytes of tensor data.
    pub bytes: usize,
    /// Whether the file carries ferry's checksum record, so every tensor's bytes and the
    /// header were checked against it (a plain safetensors file has its structure checked
    /// alone).
    pub checksummed: bool,
}

/// Reads the file at `path` through one chunk-sized buffer, checking its header and every
/// tensor's checksum; the first damage found is the error, naming the tensor.
pub(super) fn verify_file(path: &Path) -> Result<Verified, CheckpointError> {
    let io = |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut opened = open(path)?;
    let infos = std::mem::take(&mut opened.infos);
    let mut chunk = vec![0u8; CHUNK];
    let mut bytes = 0;
    for (key, info) in &infos {
        let (start, end) = info.data_offsets;
        let mut hasher = crc32fast::Hasher::new();
        let mut left = end - start;
        while left > 0 {
            let n = left.min(CHUNK);
            read_hashed(&mut opened.file, &mut chunk[..n], &mut hasher).map_err(io)?;
            left -= n;
        }
        opened.verify(key, hasher)?;
        bytes += end - start;
    }
    Ok(Verified {
        tensors: infos.len(),
        bytes,
        checksummed: opened.checksums.is_some(),
    })
}

/// Every tensor of the file at `path`, in file order, on CUDA device `ordinal`, streamed through
/// pinned slots of `slots`; and the metadata. Returned only once every tensor is verified.
pub(super) fn read_to_device(
    path: &Path,
    ordinal: usize,
    slots: Slots,
) -> Result<(StateDict, BTreeMap<String, String>, CheckpointReport), CheckpointError> {
    let started = Instant::now();
    let io = |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    };
    let opened = open(path)?;
    let dev = CudaDevice::get(ordinal).map_err(TensorError::from)?;
    let mut report = CheckpointReport {
        tensors: opened.infos.len(),
        ..CheckpointReport::default()
    };
    // The results: the file's size on the device, allocated before the first byte is read so
    // a load that cannot fit fails before the file is read.
    let mut buffers = opened
        .infos
        .iter()
        .map(|(_, info)| {
            dev.alloc(
                info.data_offsets.1 - info.data_offsets.0,
                dev.default_stream(),
            )
        })
        .collect::<Result<Vec<DeviceBuffer>, _>>()
        .map_err(TensorError::from)?;
    // Every piece, in file order: (tensor, byte range of its data).
    let parts: Vec<(usize, Range<usize>)> = opened
        .infos
        .iter()
        .enumerate()
        .flat_map(|(t, (_, info))| {
            let len = info.data_offsets.1 - info.data_offsets.0;
            pieces(&[len], 1, true, slots)
                .into_iter()
                .map(move |piece| match piece {
                    Piece::Bytes(range) => (t, range),
                    Piece::Block(_) => unreachable!("file data is contiguous"),
                })
        })
        .collect();
    // Slots no larger than a quarter of the file (a small one takes little pinned memory), but
    // holding the longest piece.
    let total: usize = parts.iter().map(|(_, r)| r.len()).sum();
    let longest = parts.iter().map(|(_, r)| r.len()).max().unwrap_or(0);
    let slot_len = longest.max(total.div_ceil(SLOTS)).min(slots.slot);
    let mut host = Meter::default();
    let stream = copy_stream(&dev)?;
    // The fresh blocks may have been freed by work still queued on the default stream.
    after_default(&dev, &stream)?;
    let mut ring = (!parts.is_empty())
        .then(|| Ring::new(slot_len, parts.len(), &mut host))
        .transpose()?;
    let mut hashers: Vec<crc32fast::Hasher> = buffers.iter().map(|_| Default::default()).collect();
    let (mut next, mut group) = (0usize, 0usize);
    while next < parts.len() {
        // The next pieces that fit one slot: read (and hashed) one after the other, then
        // uploaded in one batch while the following slot is filled.
        let mut end = next + 1;
        let mut used = parts[next].1.len();
        while end < parts.len() && used + parts[end].1.len() <= slot_len {
            used += parts[end].1.len();
            end += 1;
        }
        let ring = ring.as_mut().expect("pieces have a ring");
        let n = ring.slots.len();
        let slot = &mut ring.slots[group % n];
        let bytes = match slot {
            // Waits for the upload that last read this slot; the others stay in flight.
            Slot::Pinned(staging) => staging.as_bytes_mut().map_err(TensorError::from)?,
            Slot::Pageable(bytes) => bytes.as_mut_slice(),
        };
        let mut at = 0;
        for (t, range) in &parts[next..end] {
            let dst = &mut bytes[at..at + range.len()];
            let from = opened.data_start + (opened.infos[*t].1.data_offsets.0 + range.start) as u64;
            let piece = read_at_hashed(opened.file.get_ref(), from, dst).map_err(io)?;
            // Pieces come in file order: each extends its tensor's checksum.
            hashers[*t].combine(&piece);
            at += range.len();
            if range.end == buffers[*t].len() {
                // A damaged tensor ends the load here: the new buffers drop, the caller's
                // tensors are untouched.
                let hasher = std::mem::take(&mut hashers[*t]);
                opened.verify(&opened.infos[*t].0, hasher)?;
            }
        }
        let mut at = 0;
        match slot {
            Slot::Pinned(staging) => {
                let mut batch = staging.batch(&stream).map_err(TensorError::from)?;
                for (t, range) in &parts[next..end] {
                    batch
                        .upload(&mut buffers[*t], range.start, at, range.len())
                        .map_err(TensorError::from)?;
                    at += range.len();
                }
                batch.finish().map_err(TensorError::from)?;
            }
            Slot::Pageable(bytes) => {
                for (t, range) in &parts[next..end] {
                    buffers[*t]
                        .copy_from_host_at(
                            range.start,
                            &bytes[at..at + range.len()],
                            dev.default_stream(),
                        )
                        .map_err(TensorError::from)?;
                    at += range.len();
                }
            }
        }
        report.pieces += end - next;
        report.device_bytes += used;
        next = end;
        group += 1;
    }
    // Empty tensors have no pieces: their checksums are those of no bytes.
    for (t, buffer) in buffers.iter().enumerate() {
        if buffer.is_empty() {
            let hasher = std::mem::take(&mut hashers[t]);
            opened.verify(&opened.infos[t].0, hasher)?;
        }
    }
    stream.synchronize().map_err(TensorError::from)?;
    if let Some(ring) = ring {
        report.pageable = ring.pageable();
        ring.release(&mut host);
    }
    let device = Device::Cuda(ordinal);
    let mut tensors = Vec::with_capacity(buffers.len());
    for (((key, info), dtype), buffer) in opened.infos.iter().zip(&opened.dtypes).zip(buffers) {
        let storage = Storage::new(Buffer::Cuda(buffer), *dtype, device);
        let t = Tensor::from_storage(Arc::new(storage), Layout::contiguous(&info.shape))?;
        tensors.push((key.clone(), t));
    }
    report.bytes = report.device_bytes;
    report.peak_extra_host_bytes = host.peak();
    report.elapsed = started.elapsed();
    Ok((tensors, opened.metadata, report))
}

/// Fills `bytes` with the file's bytes from `offset`, the cores reading and hashing separate
/// chunks side by side (a read from the page cache is a memory copy, which one core does at a
/// fraction of what the machine's memory moves); the CRC32 of the whole, the chunks' combined
/// in order.
fn read_at_hashed(
    file: &File,
    offset: u64,
    bytes: &mut [u8],
) -> std::io::Result<crc32fast::Hasher> {
    let parts = bytes
        .par_chunks_mut(CHUNK)
        .enumerate()
        .map(|(i, chunk)| {
            read_exact_at(file, chunk, offset + (i * CHUNK) as u64)?;
            let mut hasher = crc32fast::Hasher::new();
            hasher.update(chunk);
            Ok(hasher)
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    let mut whole = crc32fast::Hasher::new();
    for part in &parts {
        whole.combine(part);
    }
    Ok(whole)
}

/// Fills `buf` with the file's bytes from `offset`, without moving the file's position (so
/// several threads read one file at once).
#[cfg(unix)]
fn read_exact_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
}

#[cfg(windows)]
fn read_exact_at(file: &File, mut buf: &mut [u8], mut offset: u64) -> std::io::Result<()> {
    use std::os::windows::fs::FileExt;
    while !buf.is_empty() {
        match file.seek_read(buf, offset) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Fills `bytes` from `file`, hashing each cache-sized chunk as it arrives.
fn read_hashed(
    file: &mut impl Read,
    bytes: &mut [u8],
    hasher: &mut crc32fast::Hasher,
) -> std::io::Result<()> {
    for chunk in bytes.chunks_mut(CHUNK) {
        file.read_exact(chunk)?;
        hasher.update(chunk);
    }
    Ok(())
}

/// The data section must hold exactly what the header describes: a short one names the first
/// tensor whose bytes are missing.
fn check_length(
    path: &Path,
    infos: &[(String, TensorInfo)],
    available: u64,
) -> Result<(), CheckpointError> {
    let needed = infos.last().map_or(0, |(_, info)| info.data_offsets.1) as u64;
    if needed > available {
        let (key, info) = infos
            .iter()
            .find(|(_, info)| info.data_offsets.1 as u64 > available)
            .expect("the last tensor at least runs past the end");
        return Err(CheckpointError::Truncated {
            path: path.to_path_buf(),
            key: key.clone(),
            start: info.data_offsets.0,
            end: info.data_offsets.1,
            available: available as usize,
        });
    }
    if needed < available {
        return Err(CheckpointError::Format {
            path: path.to_path_buf(),
            reason: format!(
                "its data section has {available} bytes, {} more than the header describes (trailing bytes: the file is damaged, or two writes were mixed)",
                available - needed
            ),
        });
    }
    Ok(())
}

/// Parses the checksum record and checks the header against it, before any data is read.
fn verify_header(
    path: &Path,
    record: &str,
    infos: &[(String, TensorInfo)],
    metadata: &BTreeMap<String, String>,
) -> Result<Checksums, CheckpointError> {
    let damaged = |what: String| CheckpointError::Format {
        path: path.to_path_buf(),
        reason: format!(
            "{what}; the header was damaged after the file was written, use another checkpoint"
        ),
    };
    let sums = Checksums::decode(record).ok_or_else(|| {
        damaged(format!(
            "its checksum record ({CHECKSUM_KEY:?}) cannot be read"
        ))
    })?;
    let found = header_checksum(infos, metadata);
    if found != sums.header {
        return Err(damaged(format!(
            "its header (names, shapes, dtypes, metadata) has CRC32 {found:08x}, but {:08x} was recorded",
            sums.header
        )));
    }
    if let Some((key, _)) = infos.iter().find(|(k, _)| !sums.tensors.contains_key(k)) {
        return Err(damaged(format!(
            "tensor {key:?} has no checksum in the record"
        )));
    }
    if sums.tensors.len() != infos.len() {
        return Err(damaged(format!(
            "the checksum record lists {} tensors, the header {}",
            sums.tensors.len(),
            infos.len()
        )));
    }
    Ok(sums)
}
