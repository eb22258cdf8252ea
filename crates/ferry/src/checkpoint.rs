//! Checkpoints in the safetensors format: state dicts to files and back.
//!
//! Writing goes through the batched transfer ([`move_state_dict`]): the tensors of a CUDA model
//! land in one pinned arena with one synchronization, then go to the file; no per-tensor
//! synchronization. Reading gives host tensors; `load_state_dict` moves them to the model's
//! device in one batch.
//!
//! Files are plain safetensors (little-endian, PyTorch's dtype names), so Python's
//! `safetensors` opens what ferry writes and ferry loads what `safetensors.torch.save_file`
//! writes. The write goes to a temporary file that is renamed into place, so an interrupted
//! write never leaves a truncated checkpoint under the final name.
//!
//! ```
//! use ferry::nn::{Linear, Module};
//! use ferry::{Device, checkpoint};
//!
//! let path = std::env::temp_dir().join(format!("ferry-doc-{}.safetensors", std::process::id()));
//! let layer = Linear::new(3, 2, Device::Cpu)?;
//! checkpoint::save(&path, &layer.state_dict())?;
//! let mut other = Linear::new(3, 2, Device::Cpu)?;
//! other.load_state_dict(&checkpoint::load(&path)?)?;
//! assert_eq!(other.weight().to_vec::<f32>()?, layer.weight().to_vec::<f32>()?);
//! # std::fs::remove_file(&path).ok();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};

use ferry_memory::HostBuffer;
use ferry_tensor::{DType, Device, Tensor, TensorError, with_no_grad};
use ferry_transfer::{StateDict, TransferReport, move_state_dict};
use safetensors::tensor::{Dtype, Metadata, SafeTensorError, View};

/// Why a checkpoint could not be written, read, or loaded into a model or optimizer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// The file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file ends before the data its header describes: the write was interrupted.
    #[error(
        "{}: the file is truncated: tensor {key:?} needs bytes {start}..{end} of the data section, which holds {available} bytes; the write was probably interrupted, use an earlier checkpoint",
        path.display()
    )]
    Truncated {
        /// The file.
        path: PathBuf,
        /// The first tensor whose bytes are missing.
        key: String,
        /// Start of its bytes in the data section.
        start: usize,
        /// End of its bytes in the data section.
        end: usize,
        /// Bytes the data section actually has.
        available: usize,
    },
    /// The file is not a safetensors file (or its header is damaged).
    #[error("{}: not a valid safetensors file: {reason}", path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// What the parser found.
        reason: String,
    },
    /// A tensor of a dtype ferry has no counterpart for.
    #[error(
        "tensor {key:?} has dtype {dtype}, which ferry does not support (F32, F64, F16, BF16, I64, U8): convert it before saving, e.g. `t.float()` in PyTorch"
    )]
    UnsupportedDType {
        /// The tensor.
        key: String,
        /// Its safetensors dtype.
        dtype: String,
    },
    /// The state dict does not fit what it is loaded into; nothing was changed.
    #[error(
        "the {what} state does not match the checkpoint, nothing was loaded:{}",
        problems.iter().map(|p| format!("\n  - {p}")).collect::<String>()
    )]
    Mismatch {
        /// Whose state: "model" or "optimizer".
        what: &'static str,
        /// Every problem found.
        problems: Vec<Mismatch>,
    },
    /// A tensor operation (a device move, a copy) failed.
    #[error(transparent)]
    Tensor(#[from] TensorError),
}

/// One way a state dict differs from the tensors it should fill.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Mismatch {
    /// A key the model has and the checkpoint lacks.
    Missing {
        /// The key.
        key: String,
        /// The model's shape for it.
        shape: Vec<usize>,
        /// The model's dtype for it.
        dtype: DType,
    },
    /// A key the checkpoint has and the model lacks.
    Unexpected {
        /// The key.
        key: String,
        /// Its shape in the checkpoint.
        shape: Vec<usize>,
    },
    /// Shapes differ.
    Shape {
        /// The key.
        key: String,
        /// The model's shape.
        expected: Vec<usize>,
        /// The checkpoint's shape.
        found: Vec<usize>,
    },
    /// Dtypes differ (no silent conversion).
    DType {
        /// The key.
        key: String,
        /// The model's dtype.
        expected: DType,
        /// The checkpoint's dtype.
        found: DType,
    },
}

impl Mismatch {
    /// The key concerned.
    pub fn key(&self) -> &str {
        match self {
            Mismatch::Missing { key, .. }
            | Mismatch::Unexpected { key, .. }
            | Mismatch::Shape { key, .. }
            | Mismatch::DType { key, .. } => key,
        }
    }
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mismatch::Missing { key, shape, dtype } => {
                write!(f, "missing key {key:?} (expected {dtype} {shape:?})")
            }
            Mismatch::Unexpected { key, shape } => write!(
                f,
                "unexpected key {key:?} ({shape:?}) that the model does not have"
            ),
            Mismatch::Shape {
                key,
                expected,
                found,
            } => write!(
                f,
                "key {key:?}: shape {found:?} in the checkpoint, {expected:?} expected"
            ),
            Mismatch::DType {
                key,
                expected,
                found,
            } => write!(
                f,
                "key {key:?}: dtype {found} in the checkpoint, {expected} expected (cast before saving)"
            ),
        }
    }
}

/// Writes `tensors` to `path` as safetensors. Device tensors go to the host in one batch (one
/// pinned arena, one synchronization); the returned report says what that move did.
pub fn save(
    path: impl AsRef<Path>,
    tensors: &[(String, Tensor)],
) -> Result<TransferReport, CheckpointError> {
    Checkpoint::from_tensors(tensors.to_vec()).save(path)
}

/// Reads every tensor of a safetensors file onto the host, in file order.
pub fn load(path: impl AsRef<Path>) -> Result<StateDict, CheckpointError> {
    Ok(Checkpoint::load(path)?.tensors)
}

/// Tensors and string metadata (safetensors' `__metadata__`), with sections by key prefix, so
/// a model and its optimizer can share one file: `model.0.weight`, `optimizer.step`, ...
#[derive(Debug, Clone, Default)]
pub struct Checkpoint {
    tensors: StateDict,
    metadata: BTreeMap<String, String>,
}

impl Checkpoint {
    /// An empty checkpoint.
    pub fn new() -> Self {
        Self::default()
    }

    /// A checkpoint of these tensors, with no metadata.
    pub fn from_tensors(tensors: StateDict) -> Self {
        Self {
            tensors,
            metadata: BTreeMap::new(),
        }
    }

    /// Adds `tensors` under `prefix.` (e.g. `"model"`).
    pub fn insert_section(&mut self, prefix: &str, tensors: StateDict) {
        self.tensors.extend(
            tensors
                .into_iter()
                .map(|(k, t)| (format!("{prefix}.{k}"), t)),
        );
    }

    /// The tensors under `prefix.`, with the prefix removed.
    pub fn section(&self, prefix: &str) -> StateDict {
        let head = format!("{prefix}.");
        self.tensors
            .iter()
            .filter_map(|(k, t)| k.strip_prefix(&head).map(|k| (k.to_string(), t.clone())))
            .collect()
    }

    /// Every tensor, in order.
    pub fn tensors(&self) -> &StateDict {
        &self.tensors
    }

    /// Sets a metadata entry.
    pub fn set_metadata(&mut self, key: impl Into<String>, value: impl Into<String>) {
        self.metadata.insert(key.into(), value.into());
    }

    /// A metadata entry.
    pub fn metadata(&self, key: &str) -> Option<&str> {
        self.metadata.get(key).map(String::as_str)
    }

    /// Writes the checkpoint to `path` (through a temporary file renamed into place).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<TransferReport, CheckpointError> {
        let path = path.as_ref();
        let (host, report) = move_state_dict(&self.tensors, Device::Cpu)?;
        let views = host
            .into_iter()
            .map(|(k, t)| Ok((k, HostView::new(t)?)))
            .collect::<Result<Vec<_>, CheckpointError>>()?;
        let metadata = (!self.metadata.is_empty())
            .then(|| self.metadata.clone().into_iter().collect::<HashMap<_, _>>());
        safetensors::serialize_to_file(views, metadata, path).map_err(|e| match e {
            SafeTensorError::IoError(source) => CheckpointError::Io {
                path: path.to_path_buf(),
                source,
            },
            other => CheckpointError::Format {
                path: path.to_path_buf(),
                reason: other.to_string(),
            },
        })?;
        // The crate writes through a private temporary file (mode 0600); a checkpoint is an
        // ordinary file that others on the machine may read, like one made by `File::create`.
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).map_err(
                |source| CheckpointError::Io {
                    path: path.to_path_buf(),
                    source,
                },
            )?;
        }
        Ok(report)
    }

    /// Reads a checkpoint: every tensor onto the host, in file order, and the metadata.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, CheckpointError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| CheckpointError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let (header_len, meta) = safetensors::SafeTensors::read_metadata(&bytes)
            .map_err(|e| diagnose(path, &bytes, e))?;
        let data = &bytes[8 + header_len..];
        let mut tensors = Vec::new();
        for key in meta.offset_keys() {
            let info = meta.info(&key).expect("offset_keys come from the header");
            let dtype = ferry_dtype(&key, info.dtype)?;
            let (start, end) = info.data_offsets;
            let mut buffer = HostBuffer::zeroed(end - start).map_err(TensorError::from)?;
            buffer.as_bytes_mut().copy_from_slice(&data[start..end]);
            let t = Tensor::from_host_buffer(buffer, dtype, &info.shape)?;
            tensors.push((key, t));
        }
        let metadata = meta
            .metadata()
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect();
        Ok(Self { tensors, metadata })
    }
}

/// A host tensor as safetensors sees it.
struct HostView {
    dtype: Dtype,
    shape: Vec<usize>,
    tensor: Tensor,
}

impl HostView {
    fn new(tensor: Tensor) -> Result<Self, CheckpointError> {
        let dtype = safetensors_dtype(tensor.dtype());
        // Non-contiguous host tensors (a transposed view kept on the CPU) are packed first.
        let tensor = if tensor.is_contiguous() {
            tensor
        } else {
            with_no_grad(|| tensor.contiguous())?
        };
        if tensor.device() != Device::Cpu {
            return Err(TensorError::NotOnHost {
                op: "checkpoint::save",
                device: tensor.device(),
            }
            .into());
        }
        Ok(Self {
            dtype,
            shape: tensor.shape().to_vec(),
            tensor,
        })
    }
}

impl View for HostView {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let guard = self.tensor.storage().read();
        let bytes = guard
            .host_bytes()
            .expect("checked in HostView::new: the tensor is on the host");
        let start = self.tensor.layout().offset() * self.tensor.dtype().size();
        Cow::Owned(bytes[start..start + self.tensor.nbytes()].to_vec())
    }

    fn data_len(&self) -> usize {
        self.tensor.nbytes()
    }
}

fn safetensors_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I64 => Dtype::I64,
        DType::U8 => Dtype::U8,
    }
}

fn ferry_dtype(key: &str, dtype: Dtype) -> Result<DType, CheckpointError> {
    Ok(match dtype {
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I64 => DType::I64,
        Dtype::U8 => DType::U8,
        other => {
            return Err(CheckpointError::UnsupportedDType {
                key: key.to_string(),
                dtype: format!("{other:?}"),
            });
        }
    })
}

/// Turns a parse failure into an error that says what is wrong with the file; a short file
/// names the first tensor whose bytes are missing.
fn diagnose(path: &Path, bytes: &[u8], err: SafeTensorError) -> CheckpointError {
    let format = |reason: String| CheckpointError::Format {
        path: path.to_path_buf(),
        reason,
    };
    match err {
        SafeTensorError::HeaderTooSmall | SafeTensorError::InvalidHeaderLength => format(format!(
            "the file has {} bytes, fewer than its header needs (it is truncated or not a safetensors file)",
            bytes.len()
        )),
        SafeTensorError::MetadataIncompleteBuffer => {
            truncated_key(path, bytes).unwrap_or_else(|| {
                format(
                    "the data section is longer than the header describes (trailing bytes)".into(),
                )
            })
        }
        other => format(other.to_string()),
    }
}

/// The first tensor (by offset) that runs past the end of a short file.
fn truncated_key(path: &Path, bytes: &[u8]) -> Option<CheckpointError> {
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?) as usize;
    let header = std::str::from_utf8(bytes.get(8..8 + n)?).ok()?;
    let meta: Metadata = serde_json::from_str(header).ok()?;
    let available = bytes.len() - 8 - n;
    let key = meta.offset_keys().into_iter().find(|k| {
        meta.info(k)
            .is_some_and(|info| info.data_offsets.1 > available)
    })?;
    let (start, end) = meta.info(&key)?.data_offsets;
    Some(CheckpointError::Truncated {
        path: path.to_path_buf(),
        key,
        start,
        end,
        available,
    })
}
