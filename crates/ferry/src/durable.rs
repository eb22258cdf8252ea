//! Durable files: a temporary file beside the target, renamed over it once fsynced, and the
//! directory fsynced, so after a crash or power cut the name holds the old file or the new one.
//! Checkpoints and `.npy` files are both saved this way.
//!
//! Temporary names are `.NAME.PID.NANOS.N.tmp`: the process id, the clock in nanoseconds when
//! the file was made and a counter, opened with `create_new` (and retried under another name
//! should one exist). A process id alone repeats across containers, and a save killed in one
//! would block every later save of the same target.
//!
//! A save holds an exclusive lock on its temporary (`flock` on Unix) from the moment it exists;
//! the system drops it when the writer exits, killed or not. Once a save is in place it removes
//! the temporaries of the same target that nobody holds (left by saves that died) and, as
//! before, those no one has written to for a minute before it began (an older ferry's, which
//! took no lock). A temporary a live process is writing stays: its lock is held. The one race
//! left is a temporary made and not yet locked in the same microseconds as another process's
//! scan: that save then fails at its rename, loudly, and loses nothing.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long a temporary of the same target must have gone unwritten, before a save began, to
/// count as left behind by a save that died.
const STALE_AFTER: Duration = Duration::from_secs(60);
/// Names tried before giving up on `create_new`.
const ATTEMPTS: u32 = 64;

/// Why a durable save failed, or how far it got.
#[derive(Debug)]
pub(crate) enum DurableError {
    /// The save failed; the target holds what it held before.
    Io { path: PathBuf, source: io::Error },
    /// The file is in place under its name, whole, but the directory could not be fsynced: the
    /// rename may not survive a power cut.
    NotDurable {
        path: PathBuf,
        dir: PathBuf,
        source: io::Error,
    },
}

fn io_at(path: &Path) -> impl FnOnce(io::Error) -> DurableError + '_ {
    move |source| DurableError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A file beside the target, removed on drop unless persisted.
pub(crate) struct TempFile {
    pub path: PathBuf,
    pub file: File,
    /// When the save began: temporaries unwritten since well before it are stale.
    started: SystemTime,
    persisted: bool,
}

impl TempFile {
    pub fn create(target: &Path) -> Result<Self, DurableError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = target.file_name().ok_or_else(|| DurableError::Io {
            path: target.to_path_buf(),
            source: io::Error::new(
                io::ErrorKind::InvalidInput,
                "the path names no file: give a file name such as `model.safetensors`",
            ),
        })?;
        let started = SystemTime::now();
        let mut last = None;
        for _ in 0..ATTEMPTS {
            let nanos = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let mut temp_name = OsString::from(".");
            temp_name.push(name);
            temp_name.push(format!(".{}.{nanos}.{n}.tmp", std::process::id()));
            let path = target.with_file_name(temp_name);
            // The default mode (0o666 on Unix) less the umask, as for any file the user creates.
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(file) => {
                    // Held until the file is closed: the mark of a live writer.
                    file.try_lock().map_err(|e| DurableError::Io {
                        path: path.clone(),
                        source: match e {
                            std::fs::TryLockError::Error(e) => e,
                            std::fs::TryLockError::WouldBlock => io::Error::new(
                                io::ErrorKind::WouldBlock,
                                "another process locked this new temporary file",
                            ),
                        },
                    })?;
                    return Ok(Self {
                        path,
                        file,
                        started,
                        persisted: false,
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some((path, e)),
                Err(e) => return Err(io_at(&path)(e)),
            }
        }
        let (path, source) = last.expect("at least one name was tried");
        Err(DurableError::Io { path, source })
    }

    /// Renames the (already fsynced) file over `target`, removes stale temporaries of the same
    /// target, then fsyncs the directory so the rename itself survives a power cut.
    pub fn persist(self, target: &Path) -> Result<(), DurableError> {
        self.persist_with(target, sync_dir)
    }

    fn persist_with(
        mut self,
        target: &Path,
        sync: impl FnOnce(&Path) -> io::Result<()>,
    ) -> Result<(), DurableError> {
        std::fs::rename(&self.path, target).map_err(io_at(target))?;
        self.persisted = true;
        remove_stale(target, self.started);
        let dir = directory(target);
        sync(dir).map_err(|source| DurableError::NotDurable {
            path: target.to_path_buf(),
            dir: dir.to_path_buf(),
            source,
        })
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

fn directory(target: &Path) -> &Path {
    match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Whether `file` is a temporary of `target_name`: `.NAME.` then two (an older ferry's
/// `PID.N`) or three (`PID.NANOS.N`) decimal fields, then `.tmp`.
fn is_temporary_of(file: &str, target_name: &str) -> bool {
    let Some(middle) = file
        .strip_prefix('.')
        .and_then(|f| f.strip_prefix(target_name))
        .and_then(|f| f.strip_prefix('.'))
        .and_then(|f| f.strip_suffix(".tmp"))
    else {
        return false;
    };
    let fields: Vec<&str> = middle.split('.').collect();
    (2..=3).contains(&fields.len())
        && fields
            .iter()
            .all(|f| !f.is_empty() && f.bytes().all(|b| b.is_ascii_digit()))
}

/// Whether no live process holds `path`'s lock: its writer is gone (or never took one).
fn unheld(path: &Path) -> bool {
    File::open(path).is_ok_and(|f| f.try_lock().is_ok())
}

/// Removes the temporaries of `target` that no writer holds, and those last written more than
/// [`STALE_AFTER`] before `started`. Best effort: a temporary that cannot be read or removed
/// stays, and the save stands.
fn remove_stale(target: &Path, started: SystemTime) {
    let Some(name) = target.file_name().and_then(|n| n.to_str()) else {
        return;
    };
    let Ok(entries) = std::fs::read_dir(directory(target)) else {
        return;
    };
    let cutoff = started.checked_sub(STALE_AFTER).unwrap_or(UNIX_EPOCH);
    for entry in entries.flatten() {
        let file = entry.file_name();
        if !file.to_str().is_some_and(|f| is_temporary_of(f, name)) {
            continue;
        }
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|modified| modified < cutoff);
        if old || unheld(&entry.path()) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

#[cfg(unix)]
fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir).and_then(|d| d.sync_all())
}

#[cfg(not(unix))]
fn sync_dir(_dir: &Path) -> io::Result<()> {
    // Only Unix lets a directory be opened and fsynced; elsewhere the rename is as durable as
    // the OS makes it.
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn write_new(target: &Path, bytes: &[u8]) -> TempFile {
        let mut temp = TempFile::create(target).unwrap();
        temp.file.write_all(bytes).unwrap();
        temp.file.sync_all().unwrap();
        temp
    }

    #[test]
    fn a_failed_directory_fsync_says_the_file_is_in_place_but_not_durable() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("w.bin");
        std::fs::write(&target, b"old").unwrap();
        let temp = write_new(&target, b"new");
        let temp_path = temp.path.clone();
        let err = temp
            .persist_with(&target, |_| Err(io::Error::other("the disk went away")))
            .unwrap_err();
        let DurableError::NotDurable {
            path, dir: synced, ..
        } = err
        else {
            panic!("{err:?}");
        };
        assert_eq!((path, synced), (target.clone(), dir.path().to_path_buf()));
        assert_eq!(std::fs::read(&target).unwrap(), b"new");
        assert!(!temp_path.exists());
    }

    /// A save in place removes the temporaries nobody holds (their writer died) and keeps one a
    /// live writer holds, however fresh both are.
    #[test]
    fn a_save_removes_dead_writers_temporaries_and_keeps_live_ones() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("w.bin");
        let dead = dir.path().join(".w.bin.4242.1733000000000000000.0.tmp");
        std::fs::write(&dead, b"left by a killed save").unwrap();
        let live = write_new(&target, b"still being written");
        write_new(&target, b"new").persist(&target).unwrap();
        assert!(!dead.exists(), "nobody held it: its writer is gone");
        assert!(live.path.exists(), "its writer holds it");
        assert_eq!(std::fs::read(&target).unwrap(), b"new");
        let live_path = live.path.clone();
        drop(live);
        assert!(
            !live_path.exists(),
            "dropped unpersisted: removed by its own writer"
        );
    }

    #[test]
    fn temporaries_of_the_target_are_told_from_other_files() {
        for name in [".w.bin.12.0.tmp", ".w.bin.12.1733000000000000000.7.tmp"] {
            assert!(is_temporary_of(name, "w.bin"), "{name}");
        }
        for name in [
            ".w.bin.tmp",
            ".w.bin.12.tmp",
            ".w.bin.x.12.0.tmp",
            ".w.bin.1.2.3.4.tmp",
            ".v.bin.12.0.tmp",
            "w.bin.12.0.tmp",
            ".w.bin.12.0.tmp.keep",
        ] {
            assert!(!is_temporary_of(name, "w.bin"), "{name}");
        }
    }
}
