//! DLPack (the legacy, unversioned `dltensor` capsule every array library speaks) both ways:
//! a capsule from torch becomes a ferry tensor over the same memory, holding the producer's
//! `DLManagedTensor` until ferry lets go; a ferry tensor becomes a capsule whose deleter drops
//! the ferry tensor, so its memory goes back to ferry's pools when torch frees it.
//!
//! Streams: ferry queues its work on each GPU's legacy default stream, so a consumer is asked for
//! (and a producer given) stream `1`, the legacy default: torch's default stream is that
//! stream, and for any other torch stream DLPack has the producer order itself (import) or
//! ferry waits for its own work (export).

use std::ffi::{CStr, c_void};
use std::ptr::NonNull;
use std::sync::Arc;

use ferry::memory::cuda::{CudaDevice, DeviceBuffer};
use ferry::memory::{DType, Device, HostBuffer};
use ferry::tensor::{Buffer, Storage};
use ferry::{Layout, Tensor};
use pyo3::exceptions::{PyBufferError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::{Bound, PyAny, PyResult, Python, ffi};

use crate::errors::to_py;

const DLTENSOR: &CStr = c"dltensor";
const USED_DLTENSOR: &CStr = c"used_dltensor";

/// `DLDeviceType` values ferry meets.
const KDL_CPU: i32 = 1;
const KDL_CUDA: i32 = 2;
const KDL_CUDA_HOST: i32 = 3;

/// `DLDataTypeCode` values.
const KDL_INT: u8 = 0;
const KDL_UINT: u8 = 1;
const KDL_FLOAT: u8 = 2;
const KDL_BFLOAT: u8 = 4;

#[repr(C)]
#[derive(Clone, Copy)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

fn dl_dtype(dtype: DType) -> DlDataType {
    let (code, bits) = match dtype {
        DType::F32 => (KDL_FLOAT, 32),
        DType::F64 => (KDL_FLOAT, 64),
        DType::F16 => (KDL_FLOAT, 16),
        DType::BF16 => (KDL_BFLOAT, 16),
        DType::I64 => (KDL_INT, 64),
        DType::U8 => (KDL_UINT, 8),
    };
    DlDataType {
        code,
        bits,
        lanes: 1,
    }
}

fn ferry_dtype(dt: DlDataType) -> PyResult<DType> {
    Ok(match (dt.code, dt.bits, dt.lanes) {
        (KDL_FLOAT, 32, 1) => DType::F32,
        (KDL_FLOAT, 64, 1) => DType::F64,
        (KDL_FLOAT, 16, 1) => DType::F16,
        (KDL_BFLOAT, 16, 1) => DType::BF16,
        (KDL_INT, 64, 1) => DType::I64,
        (KDL_UINT, 8, 1) => DType::U8,
        (code, bits, lanes) => {
            return Err(PyTypeError::new_err(format!(
                "ferry has no dtype for DLPack type code {code}, {bits} bits, {lanes} lane(s): \
                 convert to float32, float64, float16, bfloat16, int64 or uint8 first"
            )));
        }
    })
}

/// The producer's tensor, released through its deleter when ferry's buffer is dropped.
struct Managed(NonNull<DlManagedTensor>);

// SAFETY: a DLManagedTensor may be released from any thread (the DLPack contract: the deleter
// is the only call made on it, exactly once).
unsafe impl Send for Managed {}
// SAFETY: ferry never touches the struct through a shared reference; only Drop uses it.
unsafe impl Sync for Managed {}

impl Drop for Managed {
    fn drop(&mut self) {
        // SAFETY: we took ownership of the managed tensor when we renamed its capsule; its
        // deleter is called once, here.
        unsafe {
            if let Some(deleter) = (*self.0.as_ptr()).deleter {
                deleter(self.0.as_ptr());
            }
        }
    }
}

/// A ferry tensor over the memory of `obj`, any object with `__dlpack__` (a torch tensor, a
/// numpy array). No bytes are copied; the tensor keeps `obj`'s memory alive.
pub fn import(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    let (device_type, _) = obj
        .call_method0("__dlpack_device__")?
        .extract::<(i32, i32)>()?;
    let capsule = if device_type == KDL_CUDA {
        let kwargs = pyo3::types::PyDict::new(py);
        kwargs.set_item("stream", 1)?;
        obj.call_method("__dlpack__", (), Some(&kwargs))?
    } else {
        obj.call_method0("__dlpack__")?
    };
    // SAFETY: `capsule` is a live object; PyCapsule_IsValid only inspects it.
    if unsafe { ffi::PyCapsule_IsValid(capsule.as_ptr(), DLTENSOR.as_ptr()) } != 1 {
        return Err(PyValueError::new_err(
            "__dlpack__ did not return an unused `dltensor` capsule",
        ));
    }
    // SAFETY: the capsule is valid with this name (checked above).
    let raw = unsafe { ffi::PyCapsule_GetPointer(capsule.as_ptr(), DLTENSOR.as_ptr()) };
    let Some(managed) = NonNull::new(raw.cast::<DlManagedTensor>()) else {
        return Err(PyValueError::new_err(
            "the dltensor capsule holds a null pointer",
        ));
    };
    // From here on the managed tensor is ours: renaming tells the capsule not to free it.
    // SAFETY: a valid capsule; the name is a static C string.
    if unsafe { ffi::PyCapsule_SetName(capsule.as_ptr(), USED_DLTENSOR.as_ptr()) } != 0 {
        return Err(PyErr::fetch(py));
    }
    let owner = Managed(managed);
    // SAFETY: the producer guarantees the struct and its shape/strides arrays stay valid until
    // its deleter runs, which `owner` defers until the ferry buffer is dropped.
    let dl = unsafe { &(*managed.as_ptr()).dl_tensor };
    wrap(dl, owner)
}

fn wrap(dl: &DlTensor, owner: Managed) -> PyResult<Tensor> {
    let dtype = ferry_dtype(dl.dtype)?;
    let ndim = usize::try_from(dl.ndim).map_err(|_| PyValueError::new_err("negative ndim"))?;
    // SAFETY: `shape` holds `ndim` entries; `strides` too, or is null for a compact row-major
    // tensor (DLPack's rule).
    let shape: Vec<i64> = unsafe { slice_or_empty(dl.shape, ndim) };
    let strides: Vec<i64> = if dl.strides.is_null() {
        row_major(&shape)
    } else {
        // SAFETY: as above.
        unsafe { slice_or_empty(dl.strides, ndim) }
    };
    let as_usize = |v: &[i64], what: &str| -> PyResult<Vec<usize>> {
        v.iter()
            .map(|&x| {
                usize::try_from(x).map_err(|_| {
                    PyValueError::new_err(format!(
                        "negative {what} {x}: ferry views have non-negative strides; pass a \
                         .contiguous() copy"
                    ))
                })
            })
            .collect()
    };
    let (shape, strides) = (as_usize(&shape, "size")?, as_usize(&strides, "stride")?);
    let numel: usize = shape.iter().product();
    let elem = dtype.size();
    // Elements from the first to one past the last reachable one.
    let span = if numel == 0 {
        0
    } else {
        shape
            .iter()
            .zip(&strides)
            .map(|(&n, &s)| (n - 1) * s)
            .sum::<usize>()
            + 1
    };
    let bytes = span * elem;
    let device = match dl.device.device_type {
        KDL_CPU | KDL_CUDA_HOST => Device::Cpu,
        KDL_CUDA => Device::Cuda(dl.device.device_id as usize),
        other => {
            return Err(PyBufferError::new_err(format!(
                "ferry takes CPU and CUDA tensors; this one is on DLPack device type {other}"
            )));
        }
    };
    if numel == 0 || dl.data.is_null() {
        drop(owner);
        return Tensor::zeros(&shape, dtype, device).map_err(to_py);
    }
    let base = (dl.data as usize + dl.byte_offset as usize) as *mut u8;
    let buffer = match device {
        Device::Cpu => {
            let ptr = NonNull::new(base).ok_or_else(|| PyValueError::new_err("null data"))?;
            // SAFETY: the producer keeps `bytes` bytes at `ptr` alive until its deleter runs,
            // which happens when `owner`, moved into the buffer, is dropped.
            Buffer::Host(unsafe { HostBuffer::from_external(ptr, bytes, Box::new(owner)) })
        }
        Device::Cuda(ordinal) => {
            let dev = CudaDevice::get(ordinal).map_err(|e| to_py(e.into()))?;
            let stream = dev.default_stream().clone();
            // SAFETY: as above, on the device; the producer ordered its writes before stream 1
            // (the legacy default stream, ferry's default stream) when it made the capsule.
            Buffer::Cuda(unsafe {
                DeviceBuffer::from_external(&dev, base as u64, bytes, &stream, Box::new(owner))
            })
        }
    };
    let storage = Arc::new(Storage::new(buffer, dtype, device));
    let layout = Layout::new(shape.into(), strides.into(), 0).map_err(to_py)?;
    Tensor::from_storage(storage, layout).map_err(to_py)
}

/// # Safety
/// `ptr` points at `n` readable `i64`s (or `n` is 0).
unsafe fn slice_or_empty(ptr: *const i64, n: usize) -> Vec<i64> {
    if n == 0 || ptr.is_null() {
        return Vec::new();
    }
    // SAFETY: the caller's promise.
    unsafe { std::slice::from_raw_parts(ptr, n) }.to_vec()
}

fn row_major(shape: &[i64]) -> Vec<i64> {
    let mut strides = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1].max(1);
    }
    strides
}

/// What an exported capsule keeps alive: the tensor (so its memory) and the arrays DLPack
/// points at.
struct Exported {
    _tensor: Tensor,
    shape: Vec<i64>,
    strides: Vec<i64>,
}

unsafe extern "C" fn delete_exported(managed: *mut DlManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: both boxes were leaked by `export` and are reclaimed once, here.
    unsafe {
        let managed = Box::from_raw(managed);
        drop(Box::from_raw(managed.manager_ctx.cast::<Exported>()));
    }
}

unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with the capsule; an unconsumed capsule (still named
    // `dltensor`) owns its managed tensor and frees it; a consumed one belongs to the consumer.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, DLTENSOR.as_ptr()) == 1 {
            let managed = ffi::PyCapsule_GetPointer(capsule, DLTENSOR.as_ptr());
            delete_exported(managed.cast());
        } else {
            ffi::PyErr_Clear();
        }
    }
}

/// A `dltensor` capsule over `t`'s memory. Host tensors whose copy is still in flight are
/// waited for first, so the consumer can never read them early; CUDA tensors are handed over
/// ordered on the legacy default stream (`stream` other than 1 or None: ferry waits for its
/// own work first).
pub fn export(py: Python<'_>, t: &Tensor, stream: Option<isize>) -> PyResult<Py<PyAny>> {
    let t = t.detach();
    let storage = t.storage().clone();
    let data = {
        let buffer = storage.read();
        match &*buffer {
            Buffer::Host(b) => b.as_bytes().as_ptr() as *mut c_void,
            // Waits for a copy still landing in it.
            Buffer::Pinned(b) => b.as_bytes().map_err(|e| to_py(e.into()))?.as_ptr() as *mut c_void,
            Buffer::Cuda(b) => {
                if !matches!(stream, None | Some(1) | Some(-1)) {
                    b.cuda_device().synchronize().map_err(|e| to_py(e.into()))?;
                }
                b.device_ptr() as *mut c_void
            }
            _ => {
                return Err(PyBufferError::new_err(
                    "this tensor's memory kind cannot be exported through DLPack; .copy() it",
                ));
            }
        }
    };
    let device = match t.device() {
        Device::Cpu => DlDevice {
            device_type: KDL_CPU,
            device_id: 0,
        },
        Device::Cuda(n) => DlDevice {
            device_type: KDL_CUDA,
            device_id: n as i32,
        },
    };
    let layout = t.layout();
    let mut ctx = Box::new(Exported {
        shape: layout.shape().iter().map(|&n| n as i64).collect(),
        strides: layout.strides().iter().map(|&s| s as i64).collect(),
        _tensor: t.clone(),
    });
    let dl_tensor = DlTensor {
        data,
        device,
        ndim: layout.ndim() as i32,
        dtype: dl_dtype(t.dtype()),
        shape: ctx.shape.as_mut_ptr(),
        strides: ctx.strides.as_mut_ptr(),
        byte_offset: (layout.offset() * t.dtype().size()) as u64,
    };
    let managed = Box::into_raw(Box::new(DlManagedTensor {
        dl_tensor,
        manager_ctx: Box::into_raw(ctx).cast(),
        deleter: Some(delete_exported),
    }));
    // SAFETY: a fresh capsule over our leaked managed tensor, named `dltensor`, with a
    // destructor that frees it unless a consumer took it.
    let capsule =
        unsafe { ffi::PyCapsule_New(managed.cast(), DLTENSOR.as_ptr(), Some(capsule_destructor)) };
    if capsule.is_null() {
        // SAFETY: the capsule was not made, so the managed tensor is still ours to free.
        unsafe { delete_exported(managed) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: PyCapsule_New returned a new reference.
    Ok(unsafe { Bound::from_owned_ptr(py, capsule) }.unbind())
}

/// `(device_type, device_id)` for `__dlpack_device__`.
pub fn device_of(t: &Tensor) -> (i32, i32) {
    match t.device() {
        Device::Cpu => (KDL_CPU, 0),
        Device::Cuda(n) => (KDL_CUDA, n as i32),
    }
}
