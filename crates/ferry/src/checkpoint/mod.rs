//! Checkpoints in the safetensors format: state dicts to files and back.
//!
//! Writing goes through the batched transfer ([`move_state_dict`]): the tensors of a CUDA model
//! land in one pinned arena with one synchronization, then go to the file; no per-tensor
//! synchronization. Reading gives host tensors; `load_state_dict` moves them to the model's
//! device in one batch.
//!
//! Files are plain safetensors (little-endian, PyTorch's dtype names), so Python's
//! `safetensors` opens what ferry writes and ferry loads what `safetensors.torch.save_file`
//! writes.
//!
//! What a save promises: the bytes go to a temporary file beside the target, which is fsynced,
//! renamed over the target, and the directory fsynced; so after a crash or a power cut the name
//! holds the previous file or the new one, whole. The file gets the default permissions less
//! the umask, like any file the user creates. Two tensors with one name, or a tensor named
//! `__metadata__`, are errors before anything is written.
//!
//! What a load promises: the CRC32 of every tensor's bytes, and of the rest of the header, is
//! written in the header's metadata under [`CHECKSUM_KEY`] and checked on load; a damaged file
//! is an error naming the file and the tensor, returned before anything is handed to a model.
//! Files without the record (written by Python) load unchecked. Each tensor is read straight
//! into its own buffer: loading takes about the file's size in memory, not twice that.
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

use std::collections::BTreeMap;
use std::path::Path;

use ferry_tensor::{Device, Tensor};
use ferry_transfer::{StateDict, TransferReport, move_state_dict};

mod error;
mod format;
mod read;
mod write;

pub use error::{CheckpointError, Mismatch};
pub use format::CHECKSUM_KEY;

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

    /// Adds `tensors` under `prefix.` (e.g. `"model"`). A name that ends up twice in the
    /// checkpoint is reported by [`Checkpoint::save`].
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

    /// Sets a metadata entry ([`CHECKSUM_KEY`] is ferry's own: [`Checkpoint::save`] refuses it).
    pub fn set_metadata(&mut self, key: impl Into<String>, value: impl Into<String>) {
        self.metadata.insert(key.into(), value.into());
    }

    /// A metadata entry.
    pub fn metadata(&self, key: &str) -> Option<&str> {
        self.metadata.get(key).map(String::as_str)
    }

    /// Writes the checkpoint to `path` durably (temporary file, fsync, rename, fsync of the
    /// directory), with checksums. Names are checked first: a repeated tensor name or a
    /// reserved one is an error and nothing is written.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<TransferReport, CheckpointError> {
        let path = path.as_ref();
        format::check_names(self.tensors.iter().map(|(k, _)| k.as_str()), &self.metadata)?;
        let (host, report) = move_state_dict(&self.tensors, Device::Cpu)?;
        write::write_file(path, &write::host_contiguous(host)?, &self.metadata)?;
        Ok(report)
    }

    /// Reads a checkpoint: every tensor onto the host, in file order, and the metadata. A
    /// file with ferry's checksums is verified whole before this returns.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, CheckpointError> {
        let (tensors, metadata) = read::read_file(path.as_ref())?;
        Ok(Self { tensors, metadata })
    }
}
