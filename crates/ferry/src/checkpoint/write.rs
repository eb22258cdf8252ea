//! Durable writes: a temporary file beside the target, fsynced, renamed over the target, and
//! the directory fsynced, so after a crash or power cut the name holds the old file or the
//! new one, never a mix or zeroed blocks. Tensor bytes go from their storage to the file with
//! no copy, hashed as they go.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use ferry_tensor::{Device, Tensor, TensorError};
use safetensors::tensor::TensorInfo;

use super::CheckpointError;
use super::format::{Checksums, header_bytes, header_checksum, safetensors_dtype};

/// Bytes hashed and written at a time: small enough to stay in cache between the two.
const CHUNK: usize = 4 << 20;

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes host tensors (contiguous, names checked) and `metadata` to `path` durably.
pub(super) fn write_file(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: &BTreeMap<String, String>,
) -> Result<(), CheckpointError> {
    // safetensors' order: widest dtype first, then by name, so every tensor is aligned to its
    // element size in the file (the header's length is a multiple of 8).
    let mut order: Vec<&(String, Tensor)> = tensors.iter().collect();
    order.sort_by(|(a, x), (b, y)| {
        let (dx, dy) = (safetensors_dtype(x.dtype()), safetensors_dtype(y.dtype()));
        dy.cmp(&dx).then(a.cmp(b))
    });
    let mut infos = Vec::with_capacity(order.len());
    let mut offset = 0usize;
    for (key, t) in &order {
        let end = offset + t.nbytes();
        let info = TensorInfo {
            dtype: safetensors_dtype(t.dtype()),
            shape: t.shape().to_vec(),
            data_offsets: (offset, end),
        };
        infos.push((key.clone(), info));
        offset = end;
    }
    let mut sums = Checksums {
        header: header_checksum(&infos, metadata),
        tensors: infos.iter().map(|(k, _)| (k.clone(), 0)).collect(),
    };
    // Checksums have a fixed width: the header with zeros is as long as the final one.
    let placeholder = header_bytes(path, &infos, metadata, &sums)?;

    let temp = TempFile::create(path)?;
    let mut out = BufWriter::with_capacity(1 << 20, &temp.file);
    out.write_all(&(placeholder.len() as u64).to_le_bytes())
        .and_then(|()| out.write_all(&placeholder))
        .map_err(io(&temp.path))?;
    for (key, t) in &order {
        let crc = write_tensor(&mut out, t, &temp.path)?;
        sums.tensors.insert(key.clone(), crc);
    }
    out.flush().map_err(io(&temp.path))?;
    drop(out);
    let header = header_bytes(path, &infos, metadata, &sums)?;
    if header.len() != placeholder.len() {
        return Err(CheckpointError::Format {
            path: path.to_path_buf(),
            reason: "internal error: the header changed length once its checksums were filled in; please report it".into(),
        });
    }
    let mut file = &temp.file;
    file.seek(SeekFrom::Start(8))
        .and_then(|_| file.write_all(&header))
        .and_then(|()| file.sync_all())
        .map_err(io(&temp.path))?;
    temp.persist(path)
}

/// Writes one host tensor's bytes and returns their CRC32. The storage's read lock is held
/// meanwhile, so the bytes hashed are the bytes written, one snapshot, without a copy of the
/// tensor (an in-place write to it waits for the file instead).
fn write_tensor(out: &mut impl Write, t: &Tensor, temp: &Path) -> Result<u32, CheckpointError> {
    let guard = t.storage().read();
    let not_on_host = || TensorError::NotOnHost {
        op: "checkpoint::save",
        device: t.device(),
    };
    let bytes = guard.host_bytes().ok_or_else(not_on_host)?;
    let start = t.layout().offset() * t.dtype().size();
    let bytes = bytes
        .get(start..start + t.nbytes())
        .ok_or_else(not_on_host)?;
    let mut hasher = crc32fast::Hasher::new();
    for chunk in bytes.chunks(CHUNK) {
        hasher.update(chunk);
        out.write_all(chunk).map_err(io(temp))?;
    }
    Ok(hasher.finalize())
}

/// A file beside the target, removed on drop unless persisted.
struct TempFile {
    path: PathBuf,
    file: File,
    persisted: bool,
}

impl TempFile {
    fn create(target: &Path) -> Result<Self, CheckpointError> {
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
    fn persist(mut self, target: &Path) -> Result<(), CheckpointError> {
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

/// Tensors of a state dict as the writer takes them: on the host and contiguous.
pub(super) fn host_contiguous(
    tensors: Vec<(String, Tensor)>,
) -> Result<Vec<(String, Tensor)>, CheckpointError> {
    tensors
        .into_iter()
        .map(|(k, t)| {
            if t.device() != Device::Cpu {
                return Err(TensorError::NotOnHost {
                    op: "checkpoint::save",
                    device: t.device(),
                }
                .into());
            }
            // Non-contiguous host tensors (a transposed view kept on the CPU) are packed first.
            let t = if t.is_contiguous() {
                t
            } else {
                ferry_tensor::with_no_grad(|| t.contiguous())?
            };
            Ok((k, t))
        })
        .collect()
}
