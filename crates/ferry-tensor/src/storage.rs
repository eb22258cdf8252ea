//! Storage: the bytes behind one or more tensors, on one device, of one dtype.

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
}

impl Buffer {
    /// Size in bytes.
    pub fn len(&self) -> usize {
        match self {
            Buffer::Host(b) => b.len(),
        }
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Bytes shared by a tensor and its views. The lock lets optimizers update parameters in place
/// while views and saved copies keep reading consistent data.
#[derive(Debug)]
pub struct Storage {
    buffer: RwLock<Buffer>,
    device: Device,
    dtype: DType,
}

impl Storage {
    /// Wraps a buffer holding elements of `dtype`.
    pub fn new(buffer: Buffer, dtype: DType, device: Device) -> Self {
        Self {
            buffer: RwLock::new(buffer),
            device,
            dtype,
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
        self.buffer.read().len()
    }

    /// Shared access to the buffer.
    pub fn read(&self) -> RwLockReadGuard<'_, Buffer> {
        self.buffer.read()
    }

    /// Unique access to the buffer.
    pub fn write(&self) -> RwLockWriteGuard<'_, Buffer> {
        self.buffer.write()
    }

    /// The host elements as `T`.
    pub fn host<T: Element>(&self, op: &'static str) -> Result<MappedRwLockReadGuard<'_, [T]>> {
        self.check::<T>(op)?;
        RwLockReadGuard::try_map(self.buffer.read(), |b| match b {
            Buffer::Host(h) => Some(h.as_slice::<T>()),
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
        RwLockWriteGuard::try_map(self.buffer.write(), |b| match b {
            Buffer::Host(h) => Some(h.as_mut_slice::<T>()),
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
