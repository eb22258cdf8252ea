//! Durable files: a temporary file beside the target, renamed over it once fsynced, and the
//! directory fsynced, so after a crash or power cut the name holds the old file or the new one.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::CheckpointError;

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A file beside the target, removed on drop unless persisted.
pub(super) struct TempFile {
    pub path: PathBuf,
    pub file: File,
    persisted: bool,
}

impl TempFile {
    pub fn create(target: &Path) -> Result<Self, CheckpointError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = target.file_name().ok_or_else(|| CheckpointError::Io {
            path: target.to_path_buf(),
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "the path names no file: give a file name such as `model.safetensors`",
            ),
        })?;
        let mut temp_name = std::ffi::OsString::from(".");
        temp_name.push(name);
        temp_name.push(format!(
            ".{}.{}.tmp",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let path = target.with_file_name(temp_name);
        // The default mode (0o666 on Unix) less the umask, as for any file the user creates.
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(io(&path))?;
        Ok(Self {
            path,
            file,
            persisted: false,
        })
    }

    /// Renames the (already fsynced) file over `target`, then fsyncs the directory so the
    /// rename itself survives a power cut.
    pub fn persist(mut self, target: &Path) -> Result<(), CheckpointError> {
        std::fs::rename(&self.path, target).map_err(io(target))?;
        self.persisted = true;
        sync_dir(target)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.persisted {
            // Best effort: the error that brought us here is the one worth reporting.
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(unix)]
fn sync_dir(target: &Path) -> Result<(), CheckpointError> {
    let dir = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))
}

#[cfg(not(unix))]
fn sync_dir(_target: &Path) -> Result<(), CheckpointError> {
    // Only Unix lets a directory be opened and fsynced; elsewhere the rename is as durable as
    // the OS makes it.
    Ok(())
}
