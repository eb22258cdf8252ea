//! DLPack (the legacy, unversioned `dltensor` capsule every array library speaks) both ways:
//! a capsule from torch becomes a ferry tensor over the same memory, holding the producer's
//! `DLManagedTensor` until ferry lets go; a ferry tensor becomes a capsule whose deleter drops
//! the ferry tensor, so its memory goes back to ferry's pools when torch frees it.
//!
//! Streams. ferry's work runs on each GPU's legacy default stream; the moves order it with
//! torch's current stream themselves (crate::order), so torch's tensors come in as capsules
//! made without any synchronization (`torch._C._to_dlpack`). An object handed over with
//! `__dlpack__` is asked for the legacy default stream (`stream=1`). On export, a consumer's
//! stream (`__dlpack__(stream=S)`) waits for ferry's work on the device and is recorded as a
//! user of the memory, so the block is not reused before the work queued on it there has run.
//! A host tensor has no stream: when torch frees one over ferry's pinned memory, the deleter
//! records torch's current stream on each GPU (crate::order::current_streams), and the pinned
//! pool reuses the block only after that work has run. `ferry.record_stream` covers others.

use std::collections::BTreeMap;
use std::ffi::{CStr, c_void};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use ferry::memory::cuda::{CudaDevice, DeviceBuffer, PinnedPool, Stream};
use ferry::memory::{DType, Device, HostBuffer};
use ferry::tensor::{Buffer, Storage};
use ferry::{Layout, Tensor};
use parking_lot::Mutex;
use pyo3::exceptions::{PyBufferError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyCapsule;
use pyo3::{Bound, PyAny, PyResult, Python, ffi};

use crate::errors::to_py;
use crate::order::{InUse, current_streams};

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

/// More dimensions than any producer makes: a larger `ndim` is a corrupt capsule.
const MAX_NDIM: usize = 64;

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

/// What to do with foreign memory that does not start at a multiple of its element size.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Misaligned {
    /// Copy it into aligned memory (ferry's own) and say so: for moves, which only read it.
    Copy,
    /// Refuse it with an error naming the fix: for the exchange, which promises shared memory.
    Refuse,
}

/// A tensor received through DLPack.
pub struct Imported {
    pub tensor: Tensor,
    /// Bytes copied into aligned memory because the producer's were misaligned (0 normally).
    pub realigned_bytes: usize,
}

/// A ferry tensor over the memory of `obj`: a `dltensor` capsule (`torch._C._to_dlpack`), or
/// any object with `__dlpack__` (a torch tensor, a numpy array). No bytes are copied, except
/// that misaligned memory is copied or refused as `misaligned` says; the tensor keeps `obj`'s
/// memory alive. A CUDA capsule must be ordered before ferry's default stream by the caller.
pub fn import(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    misaligned: Misaligned,
) -> PyResult<Imported> {
    let capsule = if obj.is_instance_of::<PyCapsule>() {
        obj.clone()
    } else {
        let (device_type, _) = obj
            .call_method0("__dlpack_device__")?
            .extract::<(i32, i32)>()?;
        if device_type == KDL_CUDA {
            let kwargs = pyo3::types::PyDict::new(py);
            kwargs.set_item("stream", 1)?;
            obj.call_method("__dlpack__", (), Some(&kwargs))?
        } else {
            obj.call_method0("__dlpack__")?
        }
    };
    // SAFETY: `capsule` is a live object; PyCapsule_IsValid only inspects it (it never sets an
    // exception).
    if unsafe { ffi::PyCapsule_IsValid(capsule.as_ptr(), DLTENSOR.as_ptr()) } != 1 {
        return Err(PyValueError::new_err(
            "expected an unused `dltensor` capsule (DLPack): pass a tensor or array, or a \
             capsule from torch.utils.dlpack.to_dlpack that nothing has consumed yet",
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
    wrap(dl, owner, misaligned)
}

/// The device of an unused `dltensor` capsule's tensor, read without consuming it; `None` for
/// anything else (an object that answers `__dlpack_device__`, a used capsule).
pub fn capsule_device(obj: &Bound<'_, PyAny>) -> Option<Device> {
    if !obj.is_instance_of::<PyCapsule>() {
        return None;
    }
    // SAFETY: a live capsule; PyCapsule_IsValid only inspects it (it never sets an exception).
    if unsafe { ffi::PyCapsule_IsValid(obj.as_ptr(), DLTENSOR.as_ptr()) } != 1 {
        return None;
    }
    // SAFETY: valid with this name (checked above).
    let raw = unsafe { ffi::PyCapsule_GetPointer(obj.as_ptr(), DLTENSOR.as_ptr()) };
    let managed = NonNull::new(raw.cast::<DlManagedTensor>())?;
    // SAFETY: the producer keeps the managed tensor valid while the capsule is unused.
    let device = unsafe { (*managed.as_ptr()).dl_tensor.device };
    match device.device_type {
        KDL_CUDA => usize::try_from(device.device_id).ok().map(Device::Cuda),
        KDL_CPU | KDL_CUDA_HOST => Some(Device::Cpu),
        _ => None,
    }
}

/// Shape and strides as ferry takes them (non-negative), checked against `MAX_NDIM`.
fn dims(dl: &DlTensor) -> PyResult<(Vec<usize>, Vec<usize>)> {
    let ndim = usize::try_from(dl.ndim)
        .ok()
        .filter(|&n| n <= MAX_NDIM)
        .ok_or_else(|| {
            PyValueError::new_err(format!(
                "a DLPack tensor with {} dimensions: ferry takes 0 to {MAX_NDIM}",
                dl.ndim
            ))
        })?;
    if ndim > 0 && dl.shape.is_null() {
        return Err(PyValueError::new_err(
            "the DLPack tensor has no shape array",
        ));
    }
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
    Ok((as_usize(&shape, "size")?, as_usize(&strides, "stride")?))
}

/// Bytes from the first element to one past the last one the view reaches; `None` when that
/// does not fit an address.
fn span_bytes(shape: &[usize], strides: &[usize], elem: usize) -> Option<usize> {
    if shape.contains(&0) {
        return Some(0);
    }
    let mut last = 0usize;
    for (&n, &s) in shape.iter().zip(strides) {
        last = last.checked_add((n - 1).checked_mul(s)?)?;
    }
    last.checked_add(1)?
        .checked_mul(elem)
        .filter(|&b| b <= ferry::memory::size::MAX_BYTES)
}

fn wrap(dl: &DlTensor, owner: Managed, misaligned: Misaligned) -> PyResult<Imported> {
    let dtype = ferry_dtype(dl.dtype)?;
    let (shape, strides) = dims(dl)?;
    let too_large = || {
        PyValueError::new_err(format!(
            "a DLPack tensor of shape {shape:?} and strides {strides:?} reaches past the end of \
             the address space"
        ))
    };
    let elem = dtype.size();
    let bytes = span_bytes(&shape, &strides, elem).ok_or_else(too_large)?;
    let device = match dl.device.device_type {
        KDL_CPU | KDL_CUDA_HOST => Device::Cpu,
        KDL_CUDA => Device::Cuda(usize::try_from(dl.device.device_id).map_err(|_| {
            PyValueError::new_err(format!("CUDA device id {}", dl.device.device_id))
        })?),
        other => {
            return Err(PyBufferError::new_err(format!(
                "ferry takes CPU and CUDA tensors; this one is on DLPack device type {other}"
            )));
        }
    };
    if bytes == 0 || dl.data.is_null() {
        drop(owner);
        let tensor = Tensor::zeros(&shape, dtype, device).map_err(to_py)?;
        return Ok(Imported {
            tensor,
            realigned_bytes: 0,
        });
    }
    let base = (dl.data as usize)
        .checked_add(usize::try_from(dl.byte_offset).map_err(|_| too_large())?)
        .filter(|b| b.checked_add(bytes).is_some())
        .ok_or_else(too_large)?;
    let aligned = base % elem == 0;
    if !aligned && misaligned == Misaligned::Refuse {
        return Err(PyValueError::new_err(format!(
            "the data at {base:#x} is not aligned to the {elem} bytes a {dtype} element needs, so \
             ferry cannot share it: pass an aligned copy (torch: .clone(), numpy: .copy()); the \
             moves (ferry.to, ferry.cpu, ...) copy such data into aligned memory themselves"
        )));
    }
    let buffer = match device {
        Device::Cpu => {
            let ptr =
                NonNull::new(base as *mut u8).ok_or_else(|| PyValueError::new_err("null data"))?;
            // SAFETY: the producer keeps `bytes` bytes at `ptr` alive until its deleter runs,
            // which happens when `owner`, moved into the buffer, is dropped.
            Buffer::Host(unsafe { HostBuffer::from_external(ptr, bytes, Box::new(owner)) })
        }
        Device::Cuda(ordinal) => {
            let dev = CudaDevice::get(ordinal).map_err(|e| to_py(e.into()))?;
            let stream = dev.default_stream().clone();
            // SAFETY: as above, on the device; the caller ordered the producer's writes before
            // ferry's default stream (or the producer did, asked for stream 1).
            Buffer::Cuda(unsafe {
                DeviceBuffer::from_external(&dev, base as u64, bytes, &stream, Box::new(owner))
            })
        }
    };
    let buffer = if aligned {
        buffer
    } else {
        realign(buffer).map_err(to_py)?
    };
    let storage = Arc::new(Storage::new(buffer, dtype, device));
    let layout = Layout::new(shape.into(), strides.into(), 0).map_err(to_py)?;
    let tensor = Tensor::from_storage(storage, layout).map_err(to_py)?;
    Ok(Imported {
        tensor,
        realigned_bytes: if aligned { 0 } else { bytes },
    })
}

/// The bytes of a misaligned foreign buffer in a fresh one of ferry's (aligned): a host copy, or
/// a device copy queued on the device's default stream. The foreign buffer is released after.
fn realign(buffer: Buffer) -> ferry::Result<Buffer> {
    Ok(match buffer {
        Buffer::Host(foreign) => {
            let mut own = HostBuffer::for_overwrite(foreign.len())?;
            own.as_bytes_mut().copy_from_slice(foreign.as_bytes());
            Buffer::Host(own)
        }
        Buffer::Cuda(foreign) => {
            let dev = foreign.cuda_device().clone();
            let mut own = dev.alloc(foreign.len(), dev.default_stream())?;
            own.copy_from_device(&foreign, dev.default_stream())?;
            Buffer::Cuda(own)
        }
        other => other,
    })
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
        strides[i] = strides[i + 1].saturating_mul(shape[i + 1].max(1));
    }
    strides
}

/// The memory of the ferry tensors handed out through DLPack and not yet freed, so that
/// `ferry.record_stream` can find the buffer behind a torch tensor's address.
static EXPORTS: Mutex<BTreeMap<(usize, u64), Export>> = Mutex::new(BTreeMap::new());

static NEXT_EXPORT: AtomicU64 = AtomicU64::new(0);

/// One export in [`EXPORTS`], keyed by its first address.
struct Export {
    end: usize,
    device: Device,
    storage: Weak<Storage>,
}

/// What an exported capsule keeps alive: the tensor (so its memory) and the arrays DLPack
/// points at, and its key in [`EXPORTS`].
struct Exported {
    tensor: Tensor,
    shape: Vec<i64>,
    strides: Vec<i64>,
    key: (usize, u64),
    /// The memory's users order their device work on it themselves (see `export`).
    ordered_by_caller: bool,
}

unsafe extern "C" fn delete_exported(managed: *mut DlManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: both boxes were leaked by `export` and are reclaimed once, here.
    let exported = unsafe {
        let managed = Box::from_raw(managed);
        Box::from_raw(managed.manager_ctx.cast::<Exported>())
    };
    // A panic must not unwind into the producer's C code; nothing below is expected to panic.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| release(*exported)));
}

/// torch let go of an export: its host memory is reused only after the work torch queued on it
/// (on its current streams) has run, then the tensor is dropped.
fn release(exported: Exported) {
    EXPORTS.lock().remove(&exported.key);
    let storage = exported.tensor.storage();
    let host_memory = {
        let buffer = storage.read();
        matches!(&*buffer, Buffer::Pinned(_))
            || matches!(&*buffer, Buffer::Host(b) if PinnedPool::is_page_locked(b))
    };
    // Only memory the GPU can read directly may still be in a DMA torch queued; the device
    // buffers recorded their consumer stream when they were exported.
    if host_memory && !exported.ordered_by_caller {
        match current_streams() {
            InUse::Streams(streams) => {
                for stream in &streams {
                    record_host_use(&storage.read(), stream);
                }
            }
            InUse::Nothing => {}
            InUse::Unknown => {
                for device in CudaDevice::made() {
                    let _ = device.synchronize();
                }
            }
        }
    }
    drop(exported);
}

/// Notes a use of host memory on `stream` by other code (see `ferry.record_stream`).
fn record_host_use(buffer: &Buffer, stream: &Stream) {
    match buffer {
        Buffer::Pinned(b) => b.record_stream(stream),
        Buffer::Host(b) => PinnedPool::record_host_use(b, stream),
        _ => {}
    }
}

unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with the capsule; an unconsumed capsule (still named
    // `dltensor`) owns its managed tensor and frees it; a consumed one belongs to the consumer.
    // PyCapsule_IsValid never sets an exception, and freeing runs with one that may already be
    // in flight (a capsule dropped while an exception propagates): it is kept as it is.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, DLTENSOR.as_ptr()) == 1 {
            let managed = ffi::PyCapsule_GetPointer(capsule, DLTENSOR.as_ptr());
            delete_exported(managed.cast());
        }
    }
}

/// A `dltensor` capsule over `t`'s memory. Host tensors whose copy is still in flight are
/// waited for first, so the consumer can never read them early. CUDA tensors are handed to the
/// consumer's `stream` (DLPack's values: None or 1 the legacy default stream, ferry's own; 2 the
/// per-thread default stream; -1 no ordering; otherwise a stream handle): it waits on the
/// device for ferry's work, and the memory is not reused before the work queued there is done.
/// Host memory freed by the consumer is reused only after the work queued on torch's current
/// streams then, unless `ordered_by_caller` says the caller tracks its device uses itself.
pub fn export(
    py: Python<'_>,
    t: &Tensor,
    stream: Option<isize>,
    ordered_by_caller: bool,
) -> PyResult<Py<PyAny>> {
    export_with(py, t, stream, ordered_by_caller, Landing::Wait)
}

/// [`export`] of a host tensor whose copy may still be landing, for a caller that waits for it
/// before anything can read the consumer's tensor (it has not returned it to Python yet).
pub fn export_landing(py: Python<'_>, t: &Tensor, stream: Option<isize>) -> PyResult<Py<PyAny>> {
    export_with(py, t, stream, false, Landing::CallerWaits)
}

/// Whether [`export_with`] waits for a copy still landing in pinned memory.
#[derive(Clone, Copy, PartialEq)]
enum Landing {
    Wait,
    CallerWaits,
}

fn export_with(
    py: Python<'_>,
    t: &Tensor,
    stream: Option<isize>,
    ordered_by_caller: bool,
    landing: Landing,
) -> PyResult<Py<PyAny>> {
    let t = t.detach();
    let storage = t.storage().clone();
    let data = {
        let buffer = storage.read();
        match &*buffer {
            Buffer::Host(b) => b.as_bytes().as_ptr() as usize,
            Buffer::Pinned(b) if landing == Landing::CallerWaits => b.as_ptr() as usize,
            // Waits for a copy still landing in it.
            Buffer::Pinned(b) => b.as_bytes().map_err(|e| to_py(e.into()))?.as_ptr() as usize,
            Buffer::Cuda(b) => {
                hand_over(b, stream)?;
                b.device_ptr() as usize
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
    let key = (data, NEXT_EXPORT.fetch_add(1, Ordering::Relaxed));
    EXPORTS.lock().insert(
        key,
        Export {
            end: data + storage.bytes(),
            device: t.device(),
            storage: Arc::downgrade(&storage),
        },
    );
    let mut ctx = Box::new(Exported {
        shape: layout.shape().iter().map(|&n| n as i64).collect(),
        strides: layout.strides().iter().map(|&s| s as i64).collect(),
        tensor: t.clone(),
        key,
        ordered_by_caller,
    });
    let dl_tensor = DlTensor {
        data: data as *mut c_void,
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

/// Orders the consumer's stream after ferry's work on `buffer`, and records it as a user of it.
fn hand_over(buffer: &DeviceBuffer, stream: Option<isize>) -> PyResult<()> {
    let handle = match stream {
        None | Some(0) | Some(1) | Some(-1) => return Ok(()),
        Some(h) => u64::try_from(h).map_err(|_| {
            PyValueError::new_err(format!(
                "stream {h}: DLPack takes None, -1, 1, 2 or a CUDA stream handle"
            ))
        })?,
    };
    // SAFETY: DLPack's contract: the consumer names a live stream of the tensor's device, on
    // which it will use the tensor.
    let consumer =
        unsafe { buffer.cuda_device().borrow_stream(handle) }.map_err(|e| to_py(e.into()))?;
    buffer.record_stream(&consumer);
    Ok(())
}

/// Records `stream` as a user of the ferry memory that holds address `ptr` on `device`, if any
/// export holds it: `true` when one did.
pub fn record_stream_at(ptr: usize, device: Device, stream: &Stream) -> bool {
    let storages: Vec<Arc<Storage>> = EXPORTS
        .lock()
        .range(..=(ptr, u64::MAX))
        .filter(|(_, e)| e.device == device && ptr < e.end)
        .filter_map(|(_, e)| e.storage.upgrade())
        .collect();
    for storage in &storages {
        match &*storage.read() {
            Buffer::Cuda(b) => b.record_use(stream),
            other => record_host_use(other, stream),
        }
    }
    !storages.is_empty()
}

/// `(device_type, device_id)` for `__dlpack_device__`.
pub fn device_of(t: &Tensor) -> (i32, i32) {
    match t.device() {
        Device::Cpu => (KDL_CPU, 0),
        Device::Cuda(n) => (KDL_CUDA, n as i32),
    }
}
