//! What can go wrong with a checkpoint, each case naming the file, the tensor and the fix.

use std::fmt;
use std::path::PathBuf;

use ferry_tensor::{DType, TensorError};

/// Why a checkpoint could not be written, read, or loaded into a model or optimizer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// The file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file (or, for a failed save, the temporary file or the directory).
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The disk (or the process's file-size limit, or a quota) had no room for the file: its
    /// temporary was removed, and the file at `path`, if any, is as it was.
    #[error(
        "{}: no room on the disk for the checkpoint (writing {} failed: {source}); the previous file, if any, is kept as it was: free space, or save elsewhere, and save again",
        path.display(),
        temp.display()
    )]
    DiskFull {
        /// The checkpoint's target.
        path: PathBuf,
        /// The temporary file whose write failed.
        temp: PathBuf,
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
    /// A tensor's bytes differ from the checksum ferry wrote beside them: the file was damaged
    /// after it was written (disk, copy, transfer). Nothing was loaded.
    #[error(
        "{}: tensor {key:?} is corrupted: its bytes have CRC32 {found:08x}, but {expected:08x} was recorded when the file was written; the file was damaged after it was saved (disk, copy or transfer), use another checkpoint",
        path.display()
    )]
    ChecksumMismatch {
        /// The file.
        path: PathBuf,
        /// The tensor whose bytes changed.
        key: String,
        /// The CRC32 recorded at save time.
        expected: u32,
        /// The CRC32 of the bytes in the file now.
        found: u32,
    },
    /// The checkpoint was written and renamed into place, whole, but the directory could not be
    /// fsynced: the file is there now, yet the rename may not survive a power cut.
    #[error(
        "{}: saved, but fsyncing its directory {} failed ({source}): the file is in place and whole, but may not survive a power cut; save again, or sync the filesystem, before relying on it",
        path.display(),
        dir.display()
    )]
    NotDurable {
        /// The file, in place.
        path: PathBuf,
        /// The directory whose fsync failed.
        dir: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a safetensors file (or its header is damaged).
    #[error("{}: not a valid safetensors file: {reason}", path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// What the parser found.
        reason: String,
    },
    /// A model directory's configuration (transformers' `config.json`, a shard index) is
    /// missing or describes what ferry cannot build.
    #[error("{}: {message}", path.display())]
    Config {
        /// The file, or the directory lacking it.
        path: PathBuf,
        /// What is wrong and what to do.
        message: String,
    },
    /// A tensor of a dtype ferry has no counterpart for.
    #[error(
        "{}: tensor {key:?} has dtype {dtype}, which ferry does not support (F32, F64, F16, BF16, I64, U8): convert it before saving, e.g. `t.float()` in PyTorch",
        path.display()
    )]
    UnsupportedDType {
        /// The file.
        path: PathBuf,
        /// The tensor.
        key: String,
        /// Its safetensors dtype.
        dtype: String,
    },
    /// Two tensors of one checkpoint share a name; nothing was written.
    #[error(
        "tensor name {key:?} appears more than once in the checkpoint (two tensors given one name, or `insert_section` called twice with one prefix): give each tensor its own name; nothing was written"
    )]
    DuplicateName {
        /// The repeated name.
        key: String,
    },
    /// A tensor name or metadata key the file format keeps for itself; nothing was written.
    #[error("{key:?} is reserved: {fix}; nothing was written")]
    ReservedName {
        /// The name.
        key: String,
        /// Why it is reserved and what to do instead.
        fix: &'static str,
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
    /// The staging bound of a bounded save or load is too small to hold its ring of pieces.
    #[error(
        "{op}: a staging bound of {staging_bytes} bytes is too small: the staging ring needs at least {minimum} bytes (four pinned blocks of 4 KiB); raise `staging_bytes` (the default is 256 MiB); nothing was written or loaded"
    )]
    StagingTooSmall {
        /// `"save_with"` or `"load_to"`.
        op: &'static str,
        /// The bound given.
        staging_bytes: usize,
        /// The smallest bound that works.
        minimum: usize,
    },
    /// An asynchronous save whose `PendingSave` was dropped without `wait()` failed; this
    /// call started nothing.
    #[error(
        "an earlier asynchronous save of {} failed and nobody waited for it: {message}; nothing was started by this call (call `wait()` on each PendingSave to handle its error where it happens)",
        path.display()
    )]
    EarlierSaveFailed {
        /// The earlier save's file.
        path: PathBuf,
        /// Its error.
        message: String,
    },
    /// The save was abandoned (`PendingSave::abandon`): its file was removed, not renamed over
    /// the target, which holds what it held before.
    #[error("the save of {} was abandoned and its file removed: {reason}", path.display())]
    Abandoned {
        /// The target, unchanged.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A tensor operation (a device move, a copy) failed.
    #[error(transparent)]
    Tensor(#[from] TensorError),
}

impl CheckpointError {
    /// A save of `target` whose write failed for want of room, told as
    /// [`CheckpointError::DiskFull`]; any other error as it is.
    pub(crate) fn for_target(self, target: &std::path::Path) -> Self {
        use std::io::ErrorKind::{FileTooLarge, QuotaExceeded, StorageFull};
        match self {
            CheckpointError::Io { path, source }
                if matches!(source.kind(), StorageFull | FileTooLarge | QuotaExceeded) =>
            {
                CheckpointError::DiskFull {
                    path: target.to_path_buf(),
                    temp: path,
                    source,
                }
            }
            other => other,
        }
    }
}

impl From<crate::durable::DurableError> for CheckpointError {
    fn from(e: crate::durable::DurableError) -> Self {
        use crate::durable::DurableError;
        match e {
            DurableError::Io { path, source } => CheckpointError::Io { path, source },
            DurableError::NotDurable { path, dir, source } => {
                CheckpointError::NotDurable { path, dir, source }
            }
        }
    }
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

#[cfg(test)]
mod tests {
    use std::io::{Error, ErrorKind};
    use std::path::Path;

    use super::CheckpointError;

    fn failed_write(kind: ErrorKind) -> CheckpointError {
        CheckpointError::Io {
            path: "/ckpt/.m.safetensors.1.2.3.tmp".into(),
            source: Error::from(kind),
        }
    }

    #[test]
    fn a_write_without_room_names_the_target_and_what_is_kept() {
        for kind in [
            ErrorKind::StorageFull,
            ErrorKind::FileTooLarge,
            ErrorKind::QuotaExceeded,
        ] {
            let e = failed_write(kind).for_target(Path::new("/ckpt/m.safetensors"));
            let CheckpointError::DiskFull { path, temp, .. } = &e else {
                panic!("{kind:?} became {e:?}");
            };
            assert_eq!(path, Path::new("/ckpt/m.safetensors"));
            assert!(temp.ends_with(".m.safetensors.1.2.3.tmp"));
            let message = e.to_string();
            assert!(
                message.starts_with("/ckpt/m.safetensors: no room on the disk"),
                "{message}"
            );
            assert!(
                message.contains("previous file, if any, is kept"),
                "{message}"
            );
        }
        // Other failures stay what they were.
        let e = failed_write(ErrorKind::PermissionDenied).for_target(Path::new("/ckpt/m"));
        assert!(matches!(e, CheckpointError::Io { .. }), "{e:?}");
    }
}
