//! The file format: safetensors' header, ferry's dtype names for it, and the checksum record
//! ferry keeps in the header's `__metadata__`.
//!
//! The record is one metadata entry, [`CHECKSUM_KEY`], whose value is JSON text:
//! `{"header":"8 hex digits","tensors":{"name":"8 hex digits",...}}`. Each tensor's value is
//! the CRC32 (IEEE, as Python's `zlib.crc32`) of its bytes in the file; `header` is the CRC32
//! of a canonical description of everything else in the header (names, dtypes, shapes, offsets,
//! the other metadata), so a damaged shape or metadata value is caught too. Every checksum has
//! eight digits, so the header's length is known before the data is written and hashed.

use std::collections::BTreeMap;
use std::path::Path;

use ferry_tensor::DType;
use safetensors::tensor::{Dtype, Metadata, TensorInfo};

use super::CheckpointError;

/// The `__metadata__` entry holding ferry's checksums.
pub const CHECKSUM_KEY: &str = "ferry.crc32";

/// The largest header a file may declare: safetensors' own limit.
pub(super) const MAX_HEADER_LEN: u64 = 100_000_000;

/// Checksums of one file: of the rest of the header, and of each tensor's bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Checksums {
    pub header: u32,
    pub tensors: BTreeMap<String, u32>,
}

impl Checksums {
    fn encode(&self) -> String {
        let tensors: BTreeMap<&str, String> = self
            .tensors
            .iter()
            .map(|(k, v)| (k.as_str(), format!("{v:08x}")))
            .collect();
        serde_json::json!({ "header": format!("{:08x}", self.header), "tensors": tensors })
            .to_string()
    }

    /// Parses a record; `None` when it is damaged.
    pub fn decode(text: &str) -> Option<Self> {
        let value: serde_json::Value = serde_json::from_str(text).ok()?;
        let hex = |v: &serde_json::Value| {
            let s = v.as_str()?;
            (s.len() == 8)
                .then(|| u32::from_str_radix(s, 16).ok())
                .flatten()
        };
        let header = hex(value.get("header")?)?;
        let tensors = value
            .get("tensors")?
            .as_object()?
            .iter()
            .map(|(k, v)| Some((k.clone(), hex(v)?)))
            .collect::<Option<_>>()?;
        Some(Self { header, tensors })
    }
}

/// The CRC32 of everything in the header but the checksum record, in a canonical form (the
/// JSON header itself may list keys in any order).
pub(super) fn header_checksum(
    tensors: &[(String, TensorInfo)],
    metadata: &BTreeMap<String, String>,
) -> u32 {
    let mut described: Vec<_> = tensors
        .iter()
        .map(|(k, info)| {
            (
                k.as_str(),
                format!("{:?}", info.dtype),
                info.shape.as_slice(),
                info.data_offsets,
            )
        })
        .collect();
    // In file order, and among empty tensors at one offset by name: a reader that sorts by
    // offset cannot tell their order, so the description must not depend on it.
    described.sort_by(|a, b| (a.3, a.0).cmp(&(b.3, b.0)));
    let others: BTreeMap<&String, &String> = metadata
        .iter()
        .filter(|(k, _)| k.as_str() != CHECKSUM_KEY)
        .collect();
    let text = serde_json::to_vec(&(described, others))
        .expect("strings, numbers and maps always serialise");
    crc32fast::hash(&text)
}

/// The header bytes of a file holding `tensors` (in file order, offsets set) and `metadata`
/// plus the checksum record, padded with spaces to a multiple of 8 as safetensors pads.
pub(super) fn header_bytes(
    path: &Path,
    tensors: &[(String, TensorInfo)],
    metadata: &BTreeMap<String, String>,
    checksums: &Checksums,
) -> Result<Vec<u8>, CheckpointError> {
    let mut entries = metadata.clone();
    entries.insert(CHECKSUM_KEY.into(), checksums.encode());
    let failed = |e: &dyn std::fmt::Display| CheckpointError::Format {
        path: path.to_path_buf(),
        reason: format!("cannot describe the tensors: {e}"),
    };
    // safetensors checks the layout (offsets in order, no gaps, sizes that match)...
    Metadata::new(
        Some(entries.clone().into_iter().collect()),
        tensors.to_vec(),
    )
    .map_err(|e| failed(&e))?;
    // ...but serializes its metadata from a HashMap, in an order that changes from run to
    // run: the header is written here instead, the metadata sorted and the tensors in file
    // order, so one save gives the same bytes every time.
    let text = |r: serde_json::Result<String>| r.map_err(|e| failed(&e));
    let mut header = format!(
        "{{\"__metadata__\":{}",
        text(serde_json::to_string(&entries))?
    );
    for (name, info) in tensors {
        let (name, info) = (serde_json::to_string(name), serde_json::to_string(info));
        header.push_str(&format!(",{}:{}", text(name)?, text(info)?));
    }
    header.push('}');
    let mut bytes = header.into_bytes();
    bytes.resize(bytes.len().next_multiple_of(8), b' ');
    if bytes.len() as u64 > MAX_HEADER_LEN {
        return Err(CheckpointError::Format {
            path: path.to_path_buf(),
            reason: format!(
                "its header would take {} bytes, more than safetensors allows ({MAX_HEADER_LEN}): save fewer tensors or less metadata per file",
                bytes.len()
            ),
        });
    }
    Ok(bytes)
}

/// Checks the names of a checkpoint about to be written: no repeats, nothing reserved.
pub(super) fn check_names<'a>(
    names: impl IntoIterator<Item = &'a str>,
    metadata: &BTreeMap<String, String>,
) -> Result<(), CheckpointError> {
    let mut seen = std::collections::HashSet::new();
    for key in names {
        if key == "__metadata__" {
            return Err(CheckpointError::ReservedName {
                key: key.into(),
                fix: "safetensors keeps this name for the file's string metadata, so no tensor can have it; rename the tensor (string metadata goes through `Checkpoint::set_metadata`)",
            });
        }
        if !seen.insert(key) {
            return Err(CheckpointError::DuplicateName { key: key.into() });
        }
    }
    if metadata.contains_key(CHECKSUM_KEY) {
        return Err(CheckpointError::ReservedName {
            key: CHECKSUM_KEY.into(),
            fix: "ferry writes its checksums under this metadata key; store your value under another key",
        });
    }
    Ok(())
}

pub(super) fn safetensors_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I64 => Dtype::I64,
        DType::U8 => Dtype::U8,
    }
}

pub(super) fn ferry_dtype(path: &Path, key: &str, dtype: Dtype) -> Result<DType, CheckpointError> {
    Ok(match dtype {
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I64 => DType::I64,
        Dtype::U8 => DType::U8,
        other => {
            return Err(CheckpointError::UnsupportedDType {
                path: path.to_path_buf(),
                key: key.to_string(),
                dtype: format!("{other:?}"),
            });
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_record_round_trips_and_keeps_its_length() {
        let mut sums = Checksums {
            header: 0,
            tensors: [("a\"b".to_string(), 0), ("w".to_string(), 0)].into(),
        };
        let blank = sums.encode();
        sums.header = 0xdead_beef;
        sums.tensors.insert("w".into(), 7);
        let full = sums.encode();
        assert_eq!(blank.len(), full.len());
        assert_eq!(Checksums::decode(&full), Some(sums));
        assert_eq!(Checksums::decode(r#"{"header":"123","tensors":{}}"#), None);
        assert_eq!(Checksums::decode("not json"), None);
    }
}
