//! Storage: the bytes behind one or more tensors, on one device, of one dtype.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ferry_memory::cuda::{DeviceBuffer, PinnedBuffer};
use ferry_memory::{DType, Device, Element, HostBuffer, MemoryError};
use parking_lot::{
    ArcRwLockReadGuard, MappedRwLockReadGuard, MappedRwLockWriteGuard, RawRwLock, RwLock,
    RwLockReadGuard, RwLockWriteGuard,
};

use crate::{Result, TensorError};

/// Where a storage's bytes are.
#[derive(Debug)]
#[non_exhaustive]
pub enum Buffer {
    /// Pageable host memory.
    Host(HostBuffer),
    /// Page-locked host memory, the landing place of DMA copies from a GPU.
    Pinned(PinnedBuffer),
    /// Memory on a CUDA device.
    Cuda(DeviceBuffer),
}

impl Buffer {
    /// Size in bytes.
    pub fn len(&self) -> usize {
        match self {
            Buffer::Host(b) => b.len(),
            Buffer::Pinned(b) => b.len(),
            Buffer::Cuda(b) => b.len(),
        }
    }

    /// The bytes, when they are in host memory (waiting for a pending copy into pinned memory).
    /// `None` for device memory, and also when that pending copy failed:
    /// [`Buffer::try_host_bytes`] says why.
    pub fn host_bytes(&self) -> Option<&[u8]> {
        self.try_host_bytes().ok().flatten()
    }

    /// The bytes, mutably, when they are in host memory (see [`Buffer::host_bytes`]).
    pub fn host_bytes_mut(&mut self) -> Option<&mut [u8]> {
        self.try_host_bytes_mut().ok().flatten()
    }

    /// The bytes, when they are in host memory, once a pending copy into pinned memory has
    /// arrived: `Ok(None)` for device memory, an error when waiting for that copy failed.
    pub fn try_host_bytes(&self) -> Result<Option<&[u8]>, MemoryError> {
        match self {
            Buffer::Host(b) => Ok(Some(b.as_bytes())),
            Buffer::Pinned(b) => b.as_bytes().map(Some),
            Buffer::Cuda(_) => Ok(None),
        }
    }

    /// The bytes, mutably: [`Buffer::try_host_bytes`] for writing.
    pub fn try_host_bytes_mut(&mut self) -> Result<Option<&mut [u8]>, MemoryError> {
        match self {
            Buffer::Host(b) => Ok(Some(b.as_bytes_mut())),
            Buffer::Pinned(b) => b.as_bytes_mut().map(Some),
            Buffer::Cuda(_) => Ok(None),
        }
    }

    /// The host bytes, or the error that says why there are none: the data is on `device` (the
    /// storage's device, named in the error), or the copy into pinned memory it waited for
    /// failed. `op` names the caller in either error.
    pub fn host_slice(&self, op: &'static str, device: Device) -> Result<&[u8]> {
        self.try_host_bytes()
            .map_err(|e| pending_copy_failed(op, e))?
            .ok_or(TensorError::NotOnHost { op, device })
    }

    /// [`Buffer::host_slice`], mutably.
    pub fn host_slice_mut(&mut self, op: &'static str, device: Device) -> Result<&mut [u8]> {
        self.try_host_bytes_mut()
            .map_err(|e| pending_copy_failed(op, e))?
            .ok_or(TensorError::NotOnHost { op, device })
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A shared read of a storage that outlives any scope (see [`Storage::hold_read`]).
pub struct ReadHold {
    guard: ArcRwLockReadGuard<RawRwLock, Buffer>,
}

impl ReadHold {
    /// The buffer, readable for as long as the hold lives.
    pub fn buffer(&self) -> &Buffer {
        &self.guard
    }
}

impl std::fmt::Debug for ReadHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadHold").finish_non_exhaustive()
    }
}

/// Bytes shared by a tensor and its views. The lock lets optimizers update parameters in place
/// while views and saved copies keep reading consistent data.
///
/// Every write access bumps the storage's version: a gradient rule notes the versions of the
/// tensors it saves, and backward refuses to use one that was written in place since, where
/// it would otherwise compute a wrong gradient without a word.
///
/// Locking, and why it cannot deadlock:
/// - Shared reads are *recursive* ([`Storage::read`]). parking_lot's `RwLock` is fair: a plain
///   `read` queues behind a writer that is waiting. An op that reads one storage twice
///   (`w.mul(&w)`, `cat(&[&x, &x])`, tied weights in a state dict) would then hold its first
///   read and wait behind the writer, which waits for that same read: a deadlock as soon as
///   another thread calls `assign` at the wrong moment. A recursive read waits only while a
///   writer *holds* the lock. The price: a stream of overlapping readers can delay a writer
///   until they pause.
/// - An op that writes (assign, the optimizer steps) takes all its locks through
///   `Storage::lock_for_update`: it blocks only on its first lock, holding nothing, and tries
///   the others, releasing everything and retrying when one is busy. So no thread waits while
///   it holds a write lock, and a reader that holds one lock and waits for another always sees
///   that writer finish or let go.
/// - No op reads and writes one storage at once: a source or gradient that shares storage with
///   the tensor written is copied first.
#[derive(Debug)]
pub struct Storage {
    /// In an `Arc` of its own so that a read can be held by a value ([`Storage::hold_read`]).
    buffer: Arc<RwLock<Buffer>>,
    device: Device,
    dtype: DType,
    len: usize,
    version: AtomicU64,
}

impl Storage {
    /// Wraps a buffer holding elements of `dtype`.
    pub fn new(buffer: Buffer, dtype: DType, device: Device) -> Self {
        Self {
            len: buffer.len(),
            buffer: Arc::new(RwLock::new(buffer)),
            device,
            dtype,
            version: AtomicU64::new(0),
        }
    }

    /// Host storage of `len` zeroed elements.
    pub fn host_zeroed(len: usize, dtype: DType) -> Result<Self> {
        let bytes = crate::layout::shape_bytes("host_zeroed", &[len], dtype)?;
        Ok(Self::new(
            Buffer::Host(HostBuffer::zeroed(bytes)?),
            dtype,
            Device::Cpu,
        ))
    }

    /// The device the bytes are on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.len
    }

    /// How many times the bytes were opened for writing; saved tensors compare it.
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// Shared access to the buffer. Recursive: it does not queue behind a waiting writer, so a
    /// thread may hold several reads of one storage (see the type's documentation). Never ask
    /// for [`Storage::write`] while holding one.
    pub fn read(&self) -> RwLockReadGuard<'_, Buffer> {
        self.buffer.read_recursive()
    }

    /// Unique access to the buffer; counts as an in-place write (see [`Storage::version`]).
    /// Blocks until every read is released, so never call it while holding a read of this
    /// storage.
    pub fn write(&self) -> RwLockWriteGuard<'_, Buffer> {
        self.version.fetch_add(1, Ordering::AcqRel);
        self.buffer.write()
    }

    /// A shared read held by a value, not a scope: it may be sent to another thread and is
    /// released when dropped. Writers ([`Storage::write`], the optimizer steps, `assign`)
    /// wait until then; readers do not (the read is recursive). An asynchronous save holds its
    /// tensors this way from the call until each one's bytes are copied, so the first in-place
    /// write to a tensor not yet copied waits for that tensor's copy only.
    pub fn hold_read(&self) -> ReadHold {
        ReadHold {
            guard: self.buffer.read_arc_recursive(),
        }
    }

    /// The host elements as `T`. A storage whose bytes are still arriving in pinned memory
    /// waits for them; if that copy failed, the error says so.
    pub fn host<T: Element>(&self, op: &'static str) -> Result<MappedRwLockReadGuard<'_, [T]>> {
        self.check::<T>(op)?;
        let guard = self.read();
        guard.host_slice(op, self.device)?; // waits, or says why there are no host bytes
        RwLockReadGuard::try_map(guard, |b| b.host_bytes().map(whole_elements::<T>)).map_err(|_| {
            TensorError::NotOnHost {
                op,
                device: self.device,
            }
        })
    }

    /// The host elements as `T`, mutably (see [`Storage::host`]).
    pub fn host_mut<T: Element>(
        &self,
        op: &'static str,
    ) -> Result<MappedRwLockWriteGuard<'_, [T]>> {
        self.check::<T>(op)?;
        let mut guard = self.write();
        guard.host_slice_mut(op, self.device)?;
        RwLockWriteGuard::try_map(guard, |b| b.host_bytes_mut().map(whole_elements_mut::<T>))
            .map_err(|_| TensorError::NotOnHost {
                op,
                device: self.device,
            })
    }

    /// Write locks on `writes` and recursive reads of `reads`, returned in the order given,
    /// taken so that two ops cannot deadlock: this thread blocks only on the first of the locks
    /// (in address order) while holding nothing, and only tries the others; when one is busy
    /// it lets everything go, backs off and starts again. A storage must not be both written
    /// and read (nor written twice): the caller copies it first.
    pub(crate) fn lock_for_update<'a>(
        op: &'static str,
        writes: &[&'a Storage],
        reads: &[&'a Storage],
    ) -> Result<UpdateLocks<'a>> {
        for (i, w) in writes.iter().enumerate() {
            if writes[..i]
                .iter()
                .chain(reads)
                .any(|o| std::ptr::eq(*o, *w))
            {
                return Err(TensorError::InvalidArgument {
                    op,
                    message: "a tensor it writes shares storage with another of its arguments; pass a copy (`.copy()?`) instead".into(),
                });
            }
        }
        // (address, is a write, index in its list), in address order.
        let mut order: Vec<(usize, bool, usize)> = writes
            .iter()
            .enumerate()
            .map(|(i, s)| (*s as *const Storage as usize, true, i))
            .chain(
                reads
                    .iter()
                    .enumerate()
                    .map(|(i, s)| (*s as *const Storage as usize, false, i)),
            )
            .collect();
        order.sort_unstable();
        let mut attempt = 0u32;
        loop {
            let mut w: Vec<Option<RwLockWriteGuard<'a, Buffer>>> =
                writes.iter().map(|_| None).collect();
            let mut r: Vec<Option<RwLockReadGuard<'a, Buffer>>> =
                reads.iter().map(|_| None).collect();
            let mut all = true;
            for (k, &(_, write, i)) in order.iter().enumerate() {
                let block = k == 0;
                if write {
                    let lock = &writes[i].buffer;
                    w[i] = if block {
                        Some(lock.write())
                    } else {
                        lock.try_write()
                    };
                    all &= w[i].is_some();
                } else {
                    let lock = &reads[i].buffer;
                    r[i] = if block {
                        Some(lock.read_recursive())
                    } else {
                        lock.try_read_recursive()
                    };
                    all &= r[i].is_some();
                }
                if !all {
                    break;
                }
            }
            if all {
                for s in writes {
                    s.version.fetch_add(1, Ordering::AcqRel);
                }
                return Ok(UpdateLocks {
                    writes: w.into_iter().flatten().collect(),
                    reads: r.into_iter().flatten().collect(),
                });
            }
            drop((w, r));
            back_off(attempt);
            attempt = attempt.saturating_add(1);
        }
    }

    /// Refuses bytes that do not start at a multiple of the dtype's element size: typed access
    /// to them would be undefined behaviour. ferry's own buffers are always aligned; foreign
    /// memory (DLPack, registered host memory) may not be. Pinned blocks are page-aligned.
    pub fn check_aligned(&self, op: &'static str) -> Result<()> {
        let address = match &*self.read() {
            Buffer::Host(b) => b.as_bytes().as_ptr() as usize,
            Buffer::Cuda(b) => b.device_ptr() as usize,
            Buffer::Pinned(_) => return Ok(()),
        };
        let align = self.dtype.size();
        if address % align == 0 {
            return Ok(());
        }
        Err(TensorError::Misaligned {
            op,
            address,
            align,
            dtype: self.dtype,
        })
    }

    fn check<T: Element>(&self, op: &'static str) -> Result<()> {
        if T::DTYPE != self.dtype {
            return Err(TensorError::dtype_mismatch(op, self.dtype, T::DTYPE));
        }
        self.check_aligned(op)
    }
}

/// The guards [`Storage::lock_for_update`] took, in the order their storages were given.
pub(crate) struct UpdateLocks<'a> {
    pub(crate) writes: Vec<RwLockWriteGuard<'a, Buffer>>,
    pub(crate) reads: Vec<RwLockReadGuard<'a, Buffer>>,
}

/// Waits a little before trying a set of locks again: a few yields, then sleeps growing to a
/// millisecond.
fn back_off(attempt: u32) {
    if attempt < 4 {
        std::thread::yield_now();
    } else {
        let micros = 1u64 << (attempt - 4).min(10);
        std::thread::sleep(std::time::Duration::from_micros(micros));
    }
}

/// The error of a read whose pending copy into pinned memory failed.
fn pending_copy_failed(op: &'static str, source: MemoryError) -> TensorError {
    TensorError::Memory(MemoryError::PendingCopyFailed {
        op,
        source: Box::new(source),
    })
}

/// `bytes` as whole elements of `T` (a storage made with a length that is not a multiple of
/// the element size keeps its tail bytes out of reach).
fn whole_elements<T: Element>(bytes: &[u8]) -> &[T] {
    let whole = bytes.len() - bytes.len() % std::mem::size_of::<T>();
    bytemuck::cast_slice(&bytes[..whole])
}

/// [`whole_elements`], mutably.
fn whole_elements_mut<T: Element>(bytes: &mut [u8]) -> &mut [T] {
    let whole = bytes.len() - bytes.len() % std::mem::size_of::<T>();
    bytemuck::cast_slice_mut(&mut bytes[..whole])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(len: usize) -> Storage {
        Storage::host_zeroed(len, DType::F32).unwrap()
    }

    #[test]
    fn an_update_never_reads_what_it_writes() {
        let (a, b) = (host(2), host(2));
        // Written and read at once would wait on its own lock: refused, naming the fix.
        for (writes, reads) in [(vec![&a], vec![&a]), (vec![&a, &a], vec![])] {
            let err = Storage::lock_for_update("assign", &writes, &reads)
                .err()
                .expect("a storage both written and read is refused");
            assert!(err.to_string().contains(".copy()"), "{err}");
        }
        // Disjoint: guards come back in the order asked, and only writes bump the version.
        let locks = Storage::lock_for_update("assign", &[&b], &[&a, &a]).unwrap();
        assert_eq!((locks.writes.len(), locks.reads.len()), (1, 2));
        drop(locks);
        assert_eq!((a.version(), b.version()), (0, 1));
    }

    #[test]
    fn a_held_read_holds_writers_until_it_is_dropped_on_any_thread() {
        let s = Arc::new(host(4));
        let hold = s.hold_read();
        // Readers pass (the hold is a recursive read), on this thread and another.
        assert!(hold.buffer().host_bytes().is_some());
        drop(s.read());
        let writer = {
            let s = Arc::clone(&s);
            std::thread::spawn(move || {
                let mut w = s.write();
                w.host_bytes_mut().unwrap()[0] = 7;
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!writer.is_finished(), "the writer waits for the hold");
        assert_eq!(hold.buffer().host_bytes().unwrap()[0], 0);
        // Released by another thread than the one that took it.
        std::thread::spawn(move || drop(hold)).join().unwrap();
        writer.join().unwrap();
        assert_eq!(s.read().host_bytes().unwrap()[0], 7);
    }

    #[test]
    fn a_length_that_is_not_whole_elements_reads_the_whole_ones() {
        // Five bytes labelled f32 used to panic in the byte cast.
        let s = Storage::new(
            Buffer::Host(HostBuffer::zeroed(5).unwrap()),
            DType::F32,
            Device::Cpu,
        );
        assert_eq!(s.host::<f32>("read").unwrap().len(), 1);
        assert_eq!(s.host_mut::<f32>("write").unwrap().len(), 1);
    }
}
