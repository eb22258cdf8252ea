//! Checkpoints in the safetensors format: state dicts to files and back.
//!
//! Writing streams: each tensor (or piece of a large one) goes from its device through a ring
//! of pinned staging slots to the file, the DMA of the next pieces overlapping the write and
//! CRC of the current one. Extra memory is bounded ([`SaveOptions::staging_bytes`], 256 MiB by
//! default) on the host and on each device, whatever the model's size: no device-side copy of
//! a group of tensors, no host copy of the model. [`load`] gives host tensors
//! (`load_state_dict` moves them to the model's device); [`load_to`] streams the file straight
//! into new tensors on a GPU through the same bounded staging.
//!
//! Files are plain safetensors (little-endian, PyTorch's dtype names), so Python's
//! `safetensors` opens what ferry writes and ferry loads what `safetensors.torch.save_file`
//! writes.
//!
//! What a save promises: the bytes go to a temporary file beside the target, which is fsynced,
//! renamed over the target, and the directory fsynced; so after a crash or a power cut the name
//! holds the previous file or the new one, whole. Should only the directory's fsync fail, the
//! error is [`CheckpointError::NotDurable`]: the new file is in place, its durability unknown. The file gets the default permissions less
//! the umask, like any file the user creates. Two tensors with one name, or a tensor named
//! `__metadata__`, are errors before anything is written.
//!
//! What a load promises: the CRC32 of every tensor's bytes, and of the rest of the header, is
//! written in the header's metadata under [`CHECKSUM_KEY`] and checked on load; a damaged file
//! is an error naming the file and the tensor, returned before anything is handed to a model.
//! Files without the record (written by Python) load unchecked. Each tensor is read straight
//! into its own buffer: loading takes about the file's size in memory, not twice that. A load
//! onto a GPU ([`load_to`]) checks each tensor as its pieces pass and hands out the new tensors
//! only once all passed.
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
use ferry_transfer::{StateDict, TransferReport};

mod device_copy;
mod error;
mod format;
mod pending;
mod plan;
mod progress;
mod read;
mod snapshot;
mod stage;
mod write;

pub use device_copy::{SIDE_COPY_MIN_BYTES, reserve_device_copy};
pub use error::{CheckpointError, Mismatch};
pub use format::CHECKSUM_KEY;
pub use pending::{AsyncSaveReport, PendingSave, SnapshotWaiter, save_async};
pub use plan::{
    AsyncSaveOptions, DEFAULT_STAGING_BYTES, DeviceCopy, LoadOptions, SaveOptions, SnapshotMemory,
    device_copy_headroom,
};
pub use read::Verified;
pub use stage::CheckpointReport;

/// Writes `tensors` to `path` as safetensors, streaming device tensors through the default
/// staging bound ([`DEFAULT_STAGING_BYTES`]); the returned report says what crossed the device
/// boundary, in how many pieces, and the staging peak. [`save_with`] sets the bound and reports
/// the host and device peaks apart.
pub fn save(
    path: impl AsRef<Path>,
    tensors: &[(String, Tensor)],
) -> Result<TransferReport, CheckpointError> {
    Checkpoint::from_tensors(tensors.to_vec()).save(path)
}

/// Writes `tensors` (on any devices, in any layout) to `path` as [`save`] does, holding at most
/// `options.staging_bytes` of extra memory on the host and on each device.
///
/// ```
/// use ferry::checkpoint::{self, SaveOptions};
/// use ferry::{DType, Device, Tensor};
///
/// let path = std::env::temp_dir().join(format!("ferry-doc-with-{}.safetensors", std::process::id()));
/// let w = Tensor::randn(&[512, 256], DType::F32, Device::Cpu)?;
/// let report = checkpoint::save_with(&path, &[("w".into(), w)], SaveOptions { staging_bytes: 1 << 20 })?;
/// assert!(report.peak_extra_host_bytes <= 1 << 20);
/// # std::fs::remove_file(&path).ok();
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn save_with(
    path: impl AsRef<Path>,
    tensors: &[(String, Tensor)],
    options: SaveOptions,
) -> Result<CheckpointReport, CheckpointError> {
    Checkpoint::from_tensors(tensors.to_vec()).save_with(path, options)
}

/// Checks the safetensors file at `path` without loading it (one 4 MiB buffer, whatever the
/// file's size): its header against the file's length, and, when it carries ferry's checksum
/// record, the header and every tensor's bytes against it. The error names the first damage
/// found: the tensor whose bytes changed or are missing, or what is wrong with the header.
pub fn verify(path: impl AsRef<Path>) -> Result<Verified, CheckpointError> {
    read::verify_file(path.as_ref())
}

/// The metadata of the safetensors file at `path` (less ferry's checksum record), reading only
/// its header: what a file says of itself (an epoch, a step) without reading its tensors. The
/// header is checked against the file's length as [`load`] does.
pub fn read_metadata(
    path: impl AsRef<Path>,
) -> Result<std::collections::BTreeMap<String, String>, CheckpointError> {
    read::read_metadata(path.as_ref())
}

/// Reads every tensor of a safetensors file onto the host, in file order.
pub fn load(path: impl AsRef<Path>) -> Result<StateDict, CheckpointError> {
    Ok(Checkpoint::load(path)?.tensors)
}

/// Reads every tensor of a safetensors file onto `device`, in file order. Onto a GPU the file
/// streams through at most `options.staging_bytes` of pinned staging into new device tensors
/// (the file's size on the device, which is the result; nothing of the size of the model on
/// the host); onto the host each tensor is read straight into its own buffer, as [`load`]
/// does. Every checksum is verified before anything is returned.
pub fn load_to(
    path: impl AsRef<Path>,
    device: Device,
    options: LoadOptions,
) -> Result<(StateDict, CheckpointReport), CheckpointError> {
    let (ck, report) = Checkpoint::load_to(path, device, options)?;
    Ok((ck.tensors, report))
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

    /// The tensors, in order, and every metadata entry (a loaded file's, less ferry's checksum
    /// record).
    pub fn into_parts(self) -> (StateDict, BTreeMap<String, String>) {
        (self.tensors, self.metadata)
    }

    /// Writes the checkpoint to `path` durably (temporary file, fsync, rename, fsync of the
    /// directory), with checksums, streaming through the default staging bound. Names are
    /// checked first: a repeated tensor name or a reserved one is an error and nothing is
    /// written.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<TransferReport, CheckpointError> {
        Ok(self
            .save_with(path, SaveOptions::default())?
            .transfer_report())
    }

    /// [`Checkpoint::save`] with a staging bound: at most `options.staging_bytes` of extra
    /// memory on the host and on each device. A bound too small for the staging ring is an
    /// error naming the minimum, before anything is written.
    pub fn save_with(
        &self,
        path: impl AsRef<Path>,
        options: SaveOptions,
    ) -> Result<CheckpointReport, CheckpointError> {
        let path = path.as_ref();
        format::check_names(self.tensors.iter().map(|(k, _)| k.as_str()), &self.metadata)?;
        let slots = plan::Slots::new("save_with", options.staging_bytes)?;
        write::write_file(path, &self.tensors, &self.metadata, slots)
    }

    /// Reads a checkpoint: every tensor onto the host, in file order, and the metadata. A
    /// file with ferry's checksums is verified whole before this returns.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, CheckpointError> {
        let (tensors, metadata) = read::read_file(path.as_ref())?;
        Ok(Self { tensors, metadata })
    }

    /// Reads a checkpoint onto `device` (see [`load_to`]): the tensors, verified, and the
    /// metadata.
    pub fn load_to(
        path: impl AsRef<Path>,
        device: Device,
        options: LoadOptions,
    ) -> Result<(Self, CheckpointReport), CheckpointError> {
        let path = path.as_ref();
        let slots = plan::Slots::new("load_to", options.staging_bytes)?;
        match device {
            Device::Cpu => {
                let started = std::time::Instant::now();
                let (tensors, metadata) = read::read_file(path)?;
                let report = CheckpointReport {
                    tensors: tensors.len(),
                    bytes: tensors.iter().map(|(_, t)| t.nbytes()).sum(),
                    elapsed: started.elapsed(),
                    ..CheckpointReport::default()
                };
                Ok((Self { tensors, metadata }, report))
            }
            Device::Cuda(ordinal) => {
                let (tensors, metadata, report) = read::read_to_device(path, ordinal, slots)?;
                Ok((Self { tensors, metadata }, report))
            }
        }
    }
}
