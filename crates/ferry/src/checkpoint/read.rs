//! Reading a file: the header is checked against the file's length before anything is
//! allocated, then each tensor is read straight into its own buffer and hashed on the way (peak
//! memory: the tensors themselves, about the file's size). Every claim of the header is checked:
//! a damaged file is an error, never a panic or an allocation sized by a corrupt number.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use ferry_memory::HostBuffer;
use ferry_tensor::{Tensor, TensorError};
use ferry_transfer::StateDict;
use safetensors::tensor::{Metadata, TensorInfo};

use super::CheckpointError;
use super::format::{CHECKSUM_KEY, Checksums, MAX_HEADER_LEN, ferry_dtype, header_checksum};

/// Bytes read and hashed at a time.
const CHUNK: usize = 4 << 20;

/// Every tensor of the file at `path` (in file order) and its metadata, less ferry's checksum
/// record. When the file carries the record, every tensor and the header are verified.
pub(super) fn read_file(
    path: &Path,
) -> Result<(StateDict, BTreeMap<String, String>), CheckpointError> {
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

    let mut tensors = Vec::with_capacity(infos.len());
    for ((key, info), dtype) in infos.into_iter().zip(dtypes) {
        let (start, end) = info.data_offsets;
        let mut buffer = HostBuffer::zeroed(end - start).map_err(TensorError::from)?;
        let mut hasher = crc32fast::Hasher::new();
        for chunk in buffer.as_bytes_mut().chunks_mut(CHUNK) {
            file.read_exact(chunk).map_err(io)?;
            hasher.update(chunk);
        }
        if let Some(sums) = &checksums {
            let expected = sums.tensors[&key];
            let found = hasher.finalize();
            if found != expected {
                return Err(CheckpointError::ChecksumMismatch {
                    path: path.to_path_buf(),
                    key,
                    expected,
                    found,
                });
            }
        }
        let t = Tensor::from_host_buffer(buffer, dtype, &info.shape)?;
        tensors.push((key, t));
    }
    Ok((tensors, metadata))
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
