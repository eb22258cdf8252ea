//! Storage: the bytes behind one or more tensors, on one device, of one dtype.

use std::sync::atomic::{AtomicU64, Ordering};

use ferry_memory::cuda::{DeviceBuffer, PinnedBuffer};
use ferry_memory::{DType, Device, Element, HostBuffer};
use parking_lot::{
    MappedRwLockReadGuard, MappedRwLockWriteGuard, RwLock, RwLockReadGuard, RwLockWriteGuard,
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
    pub fn host_bytes(&self) -> Option<&[u8]> {
        match self {
            Buffer::Host(b) => Some(b.as_bytes()),
            Buffer::Pinned(b) => b.as_bytes().ok(),
            Buffer::Cuda(_) => None,
        }
    }

    /// The bytes, mutably, when they are in host memory.
    pub fn host_bytes_mut(&mut self) -> Option<&mut [u8]> {
        match self {
            Buffer::Host(b) => Some(b.as_bytes_mut()),
            Buffer::Pinned(b) => b.as_bytes_mut().ok(),
            Buffer::Cuda(_) => None,
        }
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Bytes shared by a tensor and its views. The lock lets optimizers update parameters in place
/// while views and saved copies keep reading consistent data.
///
/// Every write access bumps the storage's version: a gradient rule notes the versions of the
/// tensors it saves, and backward refuses to use one that was written in place since, where
/// it would otherwise compute a wrong gradient without a word.
#[derive(Debug)]
pub struct Storage {
    buffer: RwLock<Buffer>,
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
            buffer: RwLock::new(buffer),
            device,
            dtype,
            version: AtomicU64::new(0),
        }
    }

    /// Host storage of `len` zeroed elements.
    pub fn host_zeroed(len: usize, dtype: DType) -> Result<Self> {
        let bytes = len
            .checked_mul(dtype.size())
            .ok_or(ferry_memory::MemoryError::HostOutOfMemory { bytes: usize::MAX })?;
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

    /// Shared access to the buffer.
    pub fn read(&self) -> RwLockReadGuard<'_, Buffer> {
        self.buffer.read()
    }

    /// Unique access to the buffer; counts as an in-place write (see [`Storage::version`]).
    pub fn write(&self) -> RwLockWriteGuard<'_, Buffer> {
        self.version.fetch_add(1, Ordering::AcqRel);
        self.buffer.write()
    }

    /// The host elements as `T`.
    pub fn host<T: Element>(&self, op: &'static str) -> Result<MappedRwLockReadGuard<'_, [T]>> {
        self.check::<T>(op)?;
        RwLockReadGuard::try_map(self.buffer.read(), |b| {
            b.host_bytes().map(bytemuck::cast_slice::<u8, T>)
        })
        .map_err(|_| TensorError::NotOnHost {
            op,
            device: self.device,
        })
    }

    /// The host elements as `T`, mutably.
    pub fn host_mut<T: Element>(
        &self,
        op: &'static str,
    ) -> Result<MappedRwLockWriteGuard<'_, [T]>> {
        self.check::<T>(op)?;
        RwLockWriteGuard::try_map(self.write(), |b| {
            b.host_bytes_mut().map(bytemuck::cast_slice_mut::<u8, T>)
        })
        .map_err(|_| TensorError::NotOnHost {
            op,
            device: self.device,
        })
    }

    fn check<T: Element>(&self, op: &'static str) -> Result<()> {
        if T::DTYPE != self.dtype {
            return Err(TensorError::dtype_mismatch(op, self.dtype, T::DTYPE));
        }
        Ok(())
    }
}
