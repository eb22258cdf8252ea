//! Saving while training runs: [`save_async`] returns at once with a [`PendingSave`]; a
//! snapshot thread copies the tensors into memory of the save's own (see `snapshot`) and a
//! writer thread writes, checksums, fsyncs and renames the file as [`save`](super::save) does.
//!
//! What waits for what:
//! - The copies come after every piece of work queued before the call, on each device's
//!   default stream and on the streams in [`AsyncSaveOptions::after`].
//! - From the call until a tensor's bytes are copied, its storage is held for reading:
//!   training reads it as usual, and the first in-place write to it (an optimizer step,
//!   `assign`, a load) waits for that tensor's copy alone. Nothing ever writes into a tensor
//!   whose snapshot is still being taken.
//! - One save per file at a time: a second [`save_async`] to a path whose save is still in
//!   flight waits for it on the calling thread first, so files land in call order (the
//!   report's [`AsyncSaveReport::waited_for_previous`] says how long).
//! - A save's error comes from [`PendingSave::wait`]; one that nobody waited for (its
//!   `PendingSave` was dropped, which waits for it) is returned by the next `save_async`
//!   call, which then starts nothing.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferry_memory::cuda::{CudaDevice, Event, Stream};
use ferry_tensor::{Device, Storage, Tensor, TensorError};
use parking_lot::Mutex;

use super::device_copy;
use super::format::check_names;
use super::plan::{AsyncSaveOptions, DeviceCopy, Slots, SnapshotMemory, pieces};
use super::progress::Shared;
use super::snapshot::{self, Chunk, Entry, Held, Job, Stop};
use super::write::{FileLayout, OpenFile, io};
use super::{Checkpoint, CheckpointError};

/// What an asynchronous save did and how long each part took.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AsyncSaveReport {
    /// Tensors written.
    pub tensors: usize,
    /// Bytes of tensor data in the file.
    pub bytes: usize,
    /// Of those, bytes copied from a GPU.
    pub device_bytes: usize,
    /// Time [`save_async`] took on the calling thread: the stall it caused.
    pub call: Duration,
    /// Of that, time spent waiting for an earlier save to the same path.
    pub waited_for_previous: Duration,
    /// From the call until every tensor was copied: how long in-place writes could be held.
    pub snapshot: Duration,
    /// Of the snapshot thread's time, waiting for device-to-host DMAs to land.
    pub snapshot_dma_wait: Duration,
    /// Of the snapshot thread's time, copying landed bytes (and host tensors) into the save's
    /// own memory by all cores but two.
    pub snapshot_copy: Duration,
    /// From the call until the file was synced and renamed.
    pub elapsed: Duration,
    /// Bytes copied on their GPU first ([`AsyncSaveOptions::device_copy`]).
    pub device_copied: usize,
    /// The most extra host memory held at once: the snapshot's pieces not yet written and the
    /// pinned ring, as the pools size them.
    pub peak_extra_host_bytes: usize,
    /// Of that, pinned memory (the ring, and pieces of their own in [`SnapshotMemory::Pinned`]
    /// and [`SnapshotMemory::Bounded`]).
    pub peak_pinned_bytes: usize,
    /// Where the snapshot landed: [`SnapshotMemory::Auto`] resolved to what it chose.
    pub memory: SnapshotMemory,
}

impl AsyncSaveReport {
    /// Bytes per second of the snapshot (call to last copy).
    pub fn snapshot_bytes_per_sec(&self) -> f64 {
        self.bytes as f64 / self.snapshot.as_secs_f64().max(1e-9)
    }
}

/// Writes `tensors` to `path` as [`save`](super::save) does, in the background: returns once
/// the tensors are held and the copies ordered (microseconds per tensor, whatever their
/// size). See the module's documentation for what waits for what.
///
/// ```
/// use ferry::checkpoint::{self, AsyncSaveOptions};
/// use ferry::{DType, Device, Tensor};
///
/// let path = std::env::temp_dir().join(format!("ferry-doc-async-{}.safetensors", std::process::id()));
/// let w = Tensor::randn(&[256, 256], DType::F32, Device::Cpu)?;
/// let pending = checkpoint::save_async(&path, &[("w".into(), w.clone())], AsyncSaveOptions::default())?;
/// // Training goes on; an in-place write to `w` would wait for its copy only.
/// let report = pending.wait()?;
/// assert_eq!(report.bytes, 256 * 256 * 4);
/// assert_eq!(checkpoint::load(&path)?[0].1.to_vec::<f32>()?, w.to_vec::<f32>()?);
/// # std::fs::remove_file(&path).ok();
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn save_async(
    path: impl AsRef<Path>,
    tensors: &[(String, Tensor)],
    options: AsyncSaveOptions,
) -> Result<PendingSave, CheckpointError> {
    Checkpoint::from_tensors(tensors.to_vec()).save_async(path, options)
}

/// A save in flight. [`PendingSave::wait`] gives its report or its error; dropping it waits
/// for it too (an error then comes from the next [`save_async`]).
#[must_use = "a PendingSave's error is only seen through wait(); dropping it waits for the save"]
pub struct PendingSave {
    shared: Arc<Shared>,
    writer: Option<JoinHandle<Result<AsyncSaveReport, CheckpointError>>>,
    /// Whether every GPU tensor was copied on its GPU in the call.
    device_copied_all: bool,
    /// The tensors copied on their device's copy stream, beside the work after the call.
    side_copied: Vec<String>,
    /// Per device: the event after those copies.
    side_copies: Vec<(usize, Event)>,
}

impl std::fmt::Debug for PendingSave {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingSave")
            .field("path", &self.shared.path)
            .field("finished", &self.is_finished())
            .finish()
    }
}

impl PendingSave {
    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// Whether every tensor has been copied (in-place writes no longer wait), or the
    /// snapshot stopped on an error.
    pub fn is_snapshot_taken(&self) -> bool {
        self.shared.lock().snapshot.is_some()
    }

    /// Whether the call copied every GPU tensor on its GPU
    /// ([`AsyncSaveOptions::device_copy`]): in-place writes to them then never wait, and the
    /// snapshot reads only the copies. `false` with [`DeviceCopy::Off`], or where a device had
    /// no room for some (those are read in place, as without it).
    pub fn device_copied_all(&self) -> bool {
        self.device_copied_all
    }

    /// The tensors (by name) the call copied on their device's copy stream, beside the work
    /// queued after it rather than ahead of it: ferry's own writes to them wait for those
    /// copies on the device by themselves; another runtime's writes (torch's) must be ordered
    /// after them with [`PendingSave::order_writes_after`] before they are queued.
    pub fn side_copied(&self) -> &[String] {
        &self.side_copied
    }

    /// Makes each of `streams` wait, on the device, for the copies of
    /// [`PendingSave::side_copied`] on its device: work queued there afterwards (another
    /// runtime's optimizer step) may write those tensors. Never blocks the host.
    pub fn order_writes_after(&self, streams: &[Stream]) -> Result<(), CheckpointError> {
        for stream in streams {
            for (ordinal, event) in &self.side_copies {
                if stream.device() == Device::Cuda(*ordinal) {
                    stream.wait_event(event).map_err(TensorError::from)?;
                }
            }
        }
        Ok(())
    }

    /// Whether the save has finished, well or not.
    pub fn is_finished(&self) -> bool {
        self.shared.lock().finished
    }

    /// Blocks until every tensor has been copied (or the snapshot stopped on an error, which
    /// [`PendingSave::wait`] returns): a barrier before writes that do not go through ferry's
    /// tensors (another runtime's, over the same memory).
    pub fn wait_snapshot(&self) {
        self.snapshot_waiter().wait();
    }

    /// A handle that waits for this save's snapshot without the save itself, so a caller can
    /// wait on one thread while another asks the save other questions (or waits for it).
    pub fn snapshot_waiter(&self) -> SnapshotWaiter {
        SnapshotWaiter {
            shared: Arc::clone(&self.shared),
        }
    }

    /// Marks the save as not to be kept: once written, the file is removed instead of renamed
    /// over the target, and [`PendingSave::wait`] returns [`CheckpointError::Abandoned`] with
    /// `reason`. Too late once the file is in place (see [`PendingSave::is_finished`]).
    pub fn abandon(&self, reason: impl Into<String>) {
        let reason = reason.into();
        self.shared.update(|s| {
            s.abandoned.get_or_insert(reason);
        });
    }

    /// Lets the file be renamed over the target once written, for a save started with
    /// [`AsyncSaveOptions::confirm`] (otherwise it is renamed anyway). [`PendingSave::wait`]
    /// and dropping confirm too, unless the save was abandoned.
    pub fn confirm(&self) {
        self.shared.update(|s| s.confirmed = true);
    }

    /// Waits for the file to be synced and renamed; its report, or the save's error.
    pub fn wait(mut self) -> Result<AsyncSaveReport, CheckpointError> {
        self.join()
    }

    fn join(&mut self) -> Result<AsyncSaveReport, CheckpointError> {
        self.confirm();
        let writer = self.writer.take().expect("joined once");
        writer.join().unwrap_or_else(|_| {
            Err(CheckpointError::Format {
                path: self.shared.path.clone(),
                reason: "internal error: the save's writer thread panicked; please report it"
                    .into(),
            })
        })
    }
}

/// Waits for one save's snapshot ([`PendingSave::snapshot_waiter`]).
#[derive(Clone)]
pub struct SnapshotWaiter {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for SnapshotWaiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotWaiter")
            .field("path", &self.shared.path)
            .finish()
    }
}

impl SnapshotWaiter {
    /// Blocks until every tensor has been copied, as [`PendingSave::wait_snapshot`].
    pub fn wait(&self) {
        let mut state = self.shared.lock();
        while state.snapshot.is_none() {
            state = self.shared.wait(state);
        }
    }
}

impl Drop for PendingSave {
    fn drop(&mut self) {
        if self.writer.is_some()
            && let Err(e) = self.join()
        {
            self.shared.lock().error = Some(e.to_string());
            unreported().lock().push(Arc::clone(&self.shared));
        }
    }
}

/// Bytes written between two fdatasyncs of the flusher thread.
const FLUSH_EVERY: usize = 256 << 20;

/// Saves whose `PendingSave` was dropped with an error nobody has seen yet.
fn unreported() -> &'static Mutex<Vec<Arc<Shared>>> {
    static UNREPORTED: OnceLock<Mutex<Vec<Arc<Shared>>>> = OnceLock::new();
    UNREPORTED.get_or_init(Default::default)
}

/// Saves in flight, by target path.
fn in_flight() -> &'static Mutex<HashMap<PathBuf, Arc<Shared>>> {
    static IN_FLIGHT: OnceLock<Mutex<HashMap<PathBuf, Arc<Shared>>>> = OnceLock::new();
    IN_FLIGHT.get_or_init(Default::default)
}

impl Checkpoint {
    /// [`save_async`] of this checkpoint, metadata included.
    pub fn save_async(
        &self,
        path: impl AsRef<Path>,
        options: AsyncSaveOptions,
    ) -> Result<PendingSave, CheckpointError> {
        start(path.as_ref(), &self.tensors, &self.metadata, options)
    }
}

fn start(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: &BTreeMap<String, String>,
    options: AsyncSaveOptions,
) -> Result<PendingSave, CheckpointError> {
    let called = Instant::now();
    if let Some(earlier) = {
        let mut list = unreported().lock();
        (!list.is_empty()).then(|| list.remove(0))
    } {
        let message = earlier.lock().error.clone().unwrap_or_default();
        return Err(CheckpointError::EarlierSaveFailed {
            path: earlier.path.clone(),
            message,
        });
    }
    check_names(tensors.iter().map(|(k, _)| k.as_str()), metadata)?;
    let staging = match options.memory {
        SnapshotMemory::Bounded(bound) => options.staging_bytes.min(bound),
        _ => options.staging_bytes,
    };
    let slots = Slots::new("save_async", staging)?;
    let path = std::path::absolute(path).map_err(|source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    })?;

    let bound = match options.memory {
        SnapshotMemory::Bounded(bound) => Some(bound),
        _ => None,
    };
    let shared = Arc::new(Shared::new(path.clone(), called, bound, options.confirm));
    // One save per path: wait for the one in flight, if any, then take its place.
    loop {
        let previous = {
            let mut flying = in_flight().lock();
            match flying.get(&path) {
                Some(previous) => Arc::clone(previous),
                None => {
                    flying.insert(path.clone(), Arc::clone(&shared));
                    break;
                }
            }
        };
        let mut state = previous.lock();
        while !state.finished {
            state = previous.wait(state);
        }
    }
    let waited_for_previous = called.elapsed();
    let leave = |shared: &Arc<Shared>| {
        in_flight().lock().remove(&shared.path);
        shared.update(|s| s.finished = true);
    };

    let layout = FileLayout::new(tensors);
    let (entries, holds) = hold_in_file_order(tensors, &layout, slots);
    let opened = order_after(&entries, &options.after).and_then(|order| {
        let file = OpenFile::create(&path, &layout, metadata).map_err(|e| e.for_target(&path))?;
        Ok((order, file))
    });
    let ((ready, after), file) = match opened {
        Ok(opened) => opened,
        Err(e) => {
            leave(&shared);
            return Err(e);
        }
    };
    let counts: Vec<usize> = entries.iter().map(|e| e.pieces.len()).collect();
    let layout_order = layout.order.clone();

    let (tx, rx) = mpsc::channel::<Chunk>();
    let mut job = Job {
        entries,
        holds,
        ready,
        after,
        memory: options.memory,
        slots,
        device_copied: 0,
        retired: Vec::new(),
    };
    let mut copied = device_copy::Copied::default();
    if options.device_copy != DeviceCopy::Off {
        match device_copy::copy_on_devices(&mut job, options.device_copy) {
            Ok(done) => copied = done,
            Err(e) => {
                leave(&shared);
                return Err(e);
            }
        }
    }
    job.device_copied = copied.bytes;
    // GPU tensors the snapshot reads in place (an empty tensor has nothing to copy or hold).
    let read_in_place = job
        .entries
        .iter()
        .any(|e| e.t.device().is_cuda() && !e.released && e.t.numel() > 0);
    let device_copied_all = options.device_copy != DeviceCopy::Off && !read_in_place;
    let on_host = job.entries.iter().any(|e| !e.t.device().is_cuda());
    job.memory = match options.memory {
        SnapshotMemory::Auto if read_in_place => SnapshotMemory::Pinned,
        // Nothing waits for the snapshot: it goes at the disk's pace, through pinned pieces
        // the size of the staging, with no drain beside the training.
        SnapshotMemory::Auto if job.device_copied > 0 && !on_host => {
            SnapshotMemory::Bounded(options.staging_bytes)
        }
        SnapshotMemory::Auto => SnapshotMemory::Pageable,
        chosen => chosen,
    };
    if let SnapshotMemory::Bounded(bound) = job.memory {
        shared.set_bound(Some(bound));
    }
    let memory = job.memory;
    let snap_shared = Arc::clone(&shared);
    let snapshotter = std::thread::Builder::new()
        .name("ferry-snapshot".into())
        .spawn(move || {
            let result = snapshot::run(job, &snap_shared, tx);
            snap_shared.update(|s| s.snapshot = Some(snap_shared.called.elapsed()));
            result
        });
    let snapshotter = match snapshotter {
        Ok(handle) => handle,
        Err(source) => {
            leave(&shared);
            return Err(CheckpointError::Io { path, source });
        }
    };
    let writer_shared = Arc::clone(&shared);
    let metadata = metadata.clone();
    let mut report = AsyncSaveReport {
        tensors: layout.infos.len(),
        bytes: layout.bytes,
        waited_for_previous,
        memory,
        ..AsyncSaveReport::default()
    };
    report.call = called.elapsed();
    let writer = std::thread::Builder::new()
        .name("ferry-save".into())
        .spawn(move || {
            let shared = writer_shared;
            let written = write(&shared, file, &layout, &metadata, &counts, rx)
                .map_err(|e| e.for_target(&shared.path));
            // The snapshot's own error first: the writer only saw it stop.
            let result = match (snapshotter.join(), written) {
                (Ok(Err(Stop::Failed(e))), _) | (_, Err(e)) => Err(e),
                (Ok(Ok(done)), Ok(())) => {
                    report.device_bytes = done.device_bytes;
                    report.snapshot_dma_wait = done.dma_wait;
                    report.snapshot_copy = done.copy;
                    report.device_copied = done.device_copied;
                    Ok(())
                }
                (Ok(Err(Stop::WriterGone)), Ok(())) => unreachable!("the writer finished"),
                (Err(_), Ok(())) => Err(CheckpointError::Format {
                    path: shared.path.clone(),
                    reason: "internal error: the save's snapshot thread panicked; please report it"
                        .into(),
                }),
            };
            let state = shared.lock();
            report.snapshot = state.snapshot.unwrap_or_default();
            report.peak_extra_host_bytes = state.host_peak;
            report.peak_pinned_bytes = state.pinned_peak;
            drop(state);
            report.elapsed = shared.called.elapsed();
            leave(&shared);
            result.map(|()| report)
        });
    let writer = match writer {
        Ok(handle) => handle,
        Err(source) => {
            // The snapshot stops at its first piece (nobody receives) and lets go of the
            // tensors; the temporary file is removed as `file` drops with the closure.
            leave(&shared);
            return Err(CheckpointError::Io { path, source });
        }
    };
    Ok(PendingSave {
        shared,
        writer: Some(writer),
        device_copied_all,
        side_copied: copied
            .side_entries
            .iter()
            .map(|&e| tensors[layout_order[e]].0.clone())
            .collect(),
        side_copies: copied.side,
    })
}

/// The tensors in file order, cut into pieces, each storage held once.
fn hold_in_file_order(
    tensors: &[(String, Tensor)],
    layout: &FileLayout,
    slots: Slots,
) -> (Vec<Entry>, Vec<Held>) {
    let mut by_storage: HashMap<*const Storage, usize> = HashMap::new();
    let mut holds: Vec<Held> = Vec::new();
    let entries = layout
        .order
        .iter()
        .map(|&i| {
            let t = tensors[i].1.detach();
            let hold = *by_storage
                .entry(Arc::as_ptr(t.storage()))
                .or_insert_with(|| {
                    holds.push(Held {
                        hold: Some(t.storage().hold_read()),
                        tensors_left: 0,
                    });
                    holds.len() - 1
                });
            holds[hold].tensors_left += 1;
            let pieces = pieces(t.shape(), t.dtype().size(), t.is_contiguous(), slots);
            Entry {
                t,
                pieces,
                hold,
                released: false,
            }
        })
        .collect();
    (entries, holds)
}

/// Per device with tensors to copy: an event at the end of its default stream and of each of
/// `streams` on it.
fn order_after(entries: &[Entry], streams: &[Stream]) -> Result<Ordering, CheckpointError> {
    let mut devices: Vec<usize> = entries
        .iter()
        .filter_map(|e| match e.t.device() {
            Device::Cuda(ordinal) => Some(ordinal),
            Device::Cpu => None,
        })
        .collect();
    devices.sort_unstable();
    devices.dedup();
    let (mut ready, mut after) = (Vec::new(), Vec::new());
    for ordinal in devices {
        let dev = CudaDevice::get(ordinal).map_err(TensorError::from)?;
        ready.push((
            ordinal,
            dev.default_stream().record().map_err(TensorError::from)?,
        ));
        for s in streams
            .iter()
            .filter(|s| s.device() == Device::Cuda(ordinal))
        {
            after.push((ordinal, s.record().map_err(TensorError::from)?));
        }
    }
    Ok((ready, after))
}

/// Per device, the event recorded at the call on its default stream, and those recorded on
/// the other streams the copies follow ([`AsyncSaveOptions::after`]).
type Ordering = (Vec<(usize, Event)>, Vec<(usize, Event)>);

/// Writes every piece the snapshot sends, in file order, while a second thread hashes the
/// pieces written (and lets go of each once hashed); then the checksums, fsync and rename,
/// unless the save was abandoned.
fn write(
    shared: &Shared,
    file: OpenFile,
    layout: &FileLayout,
    metadata: &BTreeMap<String, String>,
    counts: &[usize],
    rx: mpsc::Receiver<Chunk>,
) -> Result<(), CheckpointError> {
    let temp = file.temp.path.clone();
    let crcs = std::thread::scope(|scope| {
        // The disk starts on the bytes while the rest is still being written: a thread
        // fdatasyncs the file after every `FLUSH_EVERY` bytes, so the page cache's copy
        // overlaps the disk's write instead of preceding it, and the final fsync finds little
        // left. Its first error is kept: the kernel reports a writeback error to one sync only.
        let (tick, ticks) = mpsc::channel::<()>();
        let flushed = scope.spawn(|| {
            let ticks = ticks;
            while ticks.recv().is_ok() {
                while ticks.try_recv().is_ok() {}
                file.temp.file.sync_data()?;
            }
            Ok::<(), std::io::Error>(())
        });
        // The checksums are taken beside the writes, not between them: the writing thread
        // only copies bytes into the page cache, so it keeps pace with the disk.
        let (written, to_hash) = mpsc::channel::<Chunk>();
        let hashed = scope.spawn(|| hash_pieces(shared, counts, to_hash));
        let mut out = BufWriter::with_capacity(1 << 20, &file.temp.file);
        let mut unflushed = 0usize;
        for _ in 0..counts.iter().sum::<usize>() {
            // Only a snapshot that stopped (its error is the save's) closes the channel early.
            let chunk = rx.recv().map_err(|_| CheckpointError::Format {
                path: shared.path.clone(),
                reason: "the snapshot stopped before every tensor was copied".into(),
            })?;
            let bytes = chunk.bytes.as_slice().map_err(TensorError::from)?;
            out.write_all(bytes).map_err(io(&temp))?;
            unflushed += bytes.len();
            // The hashing thread outlives this loop unless it panicked (joined below).
            let _ = written.send(chunk);
            if unflushed >= FLUSH_EVERY {
                out.flush().map_err(io(&temp))?;
                // A flusher that stopped on an error is joined below.
                let _ = tick.send(());
                unflushed = 0;
            }
        }
        out.flush().map_err(io(&temp))?;
        drop((tick, written));
        let crcs = hashed.join().unwrap_or_else(|_| {
            Err(CheckpointError::Format {
                path: shared.path.clone(),
                reason: "internal error: the save's hashing thread panicked; please report it"
                    .into(),
            })
        })?;
        flushed
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("the flusher thread panicked")))
            .map_err(io(&temp))?;
        Ok::<_, CheckpointError>(crcs)
    })?;
    let mut state = shared.lock();
    while shared.needs_confirm && !state.confirmed && state.abandoned.is_none() {
        state = shared.wait(state);
    }
    let abandoned = state.abandoned.clone();
    drop(state);
    if let Some(reason) = abandoned {
        return Err(CheckpointError::Abandoned {
            path: shared.path.clone(),
            reason,
        });
    }
    file.persist(&shared.path, layout, metadata, crcs)
}

/// The hashing thread of [`write`]: the CRC32 of each tensor's pieces, received in file order
/// once written; each piece's memory goes back as soon as it is hashed.
fn hash_pieces(
    shared: &Shared,
    counts: &[usize],
    written: mpsc::Receiver<Chunk>,
) -> Result<Vec<u32>, CheckpointError> {
    let mut crcs = Vec::with_capacity(counts.len());
    for &count in counts {
        let mut hasher = crc32fast::Hasher::new();
        for _ in 0..count {
            let Ok(chunk) = written.recv() else {
                // The writer stopped on an error, which is the save's.
                return Ok(crcs);
            };
            hasher.update(chunk.bytes.as_slice().map_err(TensorError::from)?);
            chunk.release(shared);
        }
        crcs.push(hasher.finalize());
    }
    Ok(crcs)
}
