//! The copies of a [`DeviceBuffer`] (from and to pageable and pinned host memory, within a
//! device, from a peer GPU) and its fill with zeros. Each checks lengths, ranges and devices
//! before any driver call, and orders itself across streams as the parent module describes.

use cudarc::driver::result;

use super::DeviceBuffer;
use crate::cuda::pinned::PinnedBuffer;
use crate::cuda::stream::{Event, Stream, driver};
use crate::{Device, MemoryError};

impl DeviceBuffer {
    /// Copies all of `src` (pageable or not) into this buffer; returns when the copy is done.
    pub fn copy_from_host(&mut self, src: &[u8], stream: &Stream) -> Result<(), MemoryError> {
        self.expect_len("copy_from_host", src.len())?;
        self.copy_from_host_at(0, src, stream)
    }

    /// Copies `src` into bytes `offset..offset + src.len()`; returns when the copy is done.
    pub fn copy_from_host_at(
        &mut self,
        offset: usize,
        src: &[u8],
        stream: &Stream,
    ) -> Result<(), MemoryError> {
        let dst = self.range("copy_from_host", offset, src.len(), stream)?;
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst..dst + src.len()` lies in our block (checked above); `src` is borrowed
        // until the stream synchronize below, so the driver never reads it after we return.
        unsafe { result::memcpy_htod_async(dst, src, stream.cudarc().cu_stream()) }
            .map_err(driver("cuMemcpyHtoDAsync"))?;
        stream.synchronize()
    }

    /// Copies the whole buffer into `dst`; returns when the bytes are there.
    pub fn copy_to_host(&self, dst: &mut [u8], stream: &Stream) -> Result<(), MemoryError> {
        self.expect_len("copy_to_host", dst.len())?;
        self.copy_to_host_at(0, dst, stream)
    }

    /// Copies bytes `offset..offset + dst.len()` into `dst`; returns when the bytes are there.
    pub fn copy_to_host_at(
        &self,
        offset: usize,
        dst: &mut [u8],
        stream: &Stream,
    ) -> Result<(), MemoryError> {
        let src = self.range("copy_to_host", offset, dst.len(), stream)?;
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: the source range lies in our block; `dst` is exclusively borrowed until the
        // synchronize below, so nothing reads it while the DMA writes.
        unsafe { result::memcpy_dtoh_async(dst, src, stream.cudarc().cu_stream()) }
            .map_err(driver("cuMemcpyDtoHAsync"))?;
        stream.synchronize()?;
        // The stream's earlier work is done, so are the flag copies queued on it: a value read
        // back never hides a failed device check that came before it.
        self.cuda_device().poll_checks(false)
    }

    /// Queues a copy of all of `src` (same device, same length) into this buffer.
    pub fn copy_from_device(
        &mut self,
        src: &DeviceBuffer,
        stream: &Stream,
    ) -> Result<(), MemoryError> {
        self.expect_len("copy_from_device", src.len())?;
        self.copy_region(0, src, 0, src.len(), stream)
    }

    /// Queues a copy of `len` bytes from `src[src_offset..]` to `self[dst_offset..]` (same device).
    pub fn copy_region(
        &mut self,
        dst_offset: usize,
        src: &DeviceBuffer,
        src_offset: usize,
        len: usize,
        stream: &Stream,
    ) -> Result<(), MemoryError> {
        if src.device() != self.device() {
            return Err(MemoryError::DeviceMismatch {
                op: "copy_region",
                expected: self.device(),
                actual: src.device(),
            });
        }
        let dst_ptr = self.range("copy_region", dst_offset, len, stream)?;
        let src_ptr = src.range("copy_region", src_offset, len, stream)?;
        if len == 0 {
            return Ok(());
        }
        // SAFETY: both ranges lie in live blocks (checked above) and `&mut self` keeps the
        // destination distinct from `src`; both are marked used on `stream`, so neither block is
        // reused before the copy finishes.
        unsafe { result::memcpy_dtod_async(dst_ptr, src_ptr, len, stream.cudarc().cu_stream()) }
            .map_err(driver("cuMemcpyDtoDAsync"))?;
        src.note_queued(stream)?;
        self.note_queued(stream)
    }

    /// Queues a copy of all of `src`, which lives on another GPU, into this buffer. `stream` may
    /// belong to either device. Direct over NVLink/PCIe after
    /// [`CudaDevice::enable_peer_access`](crate::cuda::CudaDevice::enable_peer_access), staged through the host otherwise.
    ///
    /// The copy waits, on the device, for the work queued so far on both buffers' own streams
    /// (where their data is produced), and later uses of either buffer on other streams wait
    /// for the copy (see the module docs on ordering).
    pub fn copy_from_peer(
        &mut self,
        src: &DeviceBuffer,
        stream: &Stream,
    ) -> Result<(), MemoryError> {
        self.expect_len("copy_from_peer", src.len())?;
        if stream.device() != self.device() && stream.device() != src.device() {
            return Err(MemoryError::DeviceMismatch {
                op: "copy_from_peer",
                expected: self.device(),
                actual: stream.device(),
            });
        }
        self.device.check()?;
        src.device.check()?;
        if self.is_empty() {
            return Ok(());
        }
        // Records an event on the source's stream (on its own device) and makes the copy
        // stream wait for it: the copy reads what the source's producers wrote.
        src.order_use(stream)?;
        self.order_use(stream)?;
        stream
            .cudarc()
            .context()
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))?;
        let (dst_ctx, src_ctx) = (
            self.device.inner.ctx.cu_ctx(),
            src.device.inner.ctx.cu_ctx(),
        );
        if src.device() == self.device() {
            // One device (two of its streams): an ordinary device copy.
            // SAFETY: both blocks are live, `len` bytes each, in the bound context, distinct
            // (`&mut self`), and marked used on `stream`.
            unsafe {
                result::memcpy_dtod_async(
                    self.device_ptr(),
                    src.device_ptr(),
                    self.len,
                    stream.cudarc().cu_stream(),
                )
            }
            .map_err(driver("cuMemcpyDtoDAsync"))?;
            src.note_queued(stream)?;
            return self.note_queued(stream);
        }
        // SAFETY: both pointers are live blocks of `len` bytes in their own contexts, both
        // marked used on `stream`; the contexts live as long as their devices.
        unsafe {
            result::memcpy_peer_async(
                dst_ctx,
                self.device_ptr(),
                src_ctx,
                src.device_ptr(),
                self.len,
                stream.cudarc().cu_stream(),
            )
        }
        .map_err(driver("cuMemcpyPeerAsync"))?;
        src.note_queued(stream)?;
        self.note_queued(stream)
    }

    /// Queues a copy of all of `src` into this buffer and returns at once; `src` records an
    /// event so it is neither rewritten nor reused by the pool before the copy has read it.
    pub fn copy_from_pinned_async(
        &mut self,
        src: &mut PinnedBuffer,
        stream: &Stream,
    ) -> Result<(), MemoryError> {
        self.expect_len("copy_from_pinned_async", src.len())?;
        self.copy_from_pinned_async_at(0, src, stream)
    }

    /// Like [`DeviceBuffer::copy_from_pinned_async`], into bytes `offset..offset + src.len()`.
    pub fn copy_from_pinned_async_at(
        &mut self,
        offset: usize,
        src: &mut PinnedBuffer,
        stream: &Stream,
    ) -> Result<(), MemoryError> {
        let dst = self.range("copy_from_pinned_async", offset, src.len(), stream)?;
        if src.is_empty() {
            return Ok(());
        }
        src.order_before(stream)?;
        // SAFETY: the range lies in our block; the pinned bytes stay allocated and unwritten
        // until the event recorded below completes (PinnedBuffer waits on it before handing out
        // `&mut` and the pool before reuse).
        unsafe { result::memcpy_htod_async(dst, src.raw_bytes(), stream.cudarc().cu_stream()) }
            .map_err(driver("cuMemcpyHtoDAsync"))?;
        mark_pending(src, stream)?;
        self.note_queued(stream)
    }

    /// Queues a copy of the whole buffer into `dst` and returns at once; `dst` cannot be read
    /// (it waits) until the copy has finished.
    pub fn copy_to_pinned_async(
        &self,
        dst: &mut PinnedBuffer,
        stream: &Stream,
    ) -> Result<(), MemoryError> {
        self.expect_len("copy_to_pinned_async", dst.len())?;
        self.copy_to_pinned_async_at(0, dst, stream)
    }

    /// Like [`DeviceBuffer::copy_to_pinned_async`], from bytes `offset..offset + dst.len()`.
    pub fn copy_to_pinned_async_at(
        &self,
        offset: usize,
        dst: &mut PinnedBuffer,
        stream: &Stream,
    ) -> Result<(), MemoryError> {
        self.download("copy_to_pinned_async", offset, dst, stream, None)
    }

    /// Queues the device-to-pinned copy of bytes `offset..offset + dst.len()` on `stream`,
    /// ordered after `producers` when given (else after everything on the home stream).
    fn download(
        &self,
        op: &'static str,
        offset: usize,
        dst: &mut PinnedBuffer,
        stream: &Stream,
        producers: Option<&Event>,
    ) -> Result<(), MemoryError> {
        let src = self.range_after(op, offset, dst.len(), stream, producers)?;
        if dst.is_empty() {
            return Ok(());
        }
        dst.order_before(stream)?;
        // SAFETY: the range lies in our block; `dst` is not readable, writable or reusable
        // until the event recorded below completes, and the block is not reused before it
        // either (`note_queued` makes its free wait for the copy).
        unsafe { result::memcpy_dtoh_async(dst.raw_bytes_mut(), src, stream.cudarc().cu_stream()) }
            .map_err(driver("cuMemcpyDtoHAsync"))?;
        mark_pending(dst, stream)?;
        // An in-place write of this buffer on another stream now waits for the copy.
        self.note_queued(stream)
    }

    /// [`DeviceBuffer::copy_to_pinned_async`], ordered on the device after `ready` alone: an
    /// event recorded on this buffer's own stream after the work that wrote its bytes (see
    /// [`DeviceBuffer::stream`]), not after everything queued there so far. Kernels queued on
    /// the buffer's stream since, which read it, run alongside the copy instead of ahead of it
    /// (activation offload queues the copy of a saved activation after the op that reads it
    /// next, yet wants it to start when its producer ends). Work queued since that *writes* the
    /// buffer races with the copy, and the pinned bytes are then unspecified; the device memory
    /// stays valid either way (its reuse waits for the copy), and later uses on other streams
    /// wait for the copy as after any copy.
    pub fn copy_to_pinned_async_after(
        &self,
        dst: &mut PinnedBuffer,
        stream: &Stream,
        ready: &Event,
    ) -> Result<(), MemoryError> {
        self.expect_len("copy_to_pinned_async_after", dst.len())?;
        if ready.cudarc().context() != self.stream.cudarc().context() {
            return Err(MemoryError::DeviceMismatch {
                op: "copy_to_pinned_async_after",
                expected: self.device(),
                actual: Device::Cuda(ready.cudarc().context().ordinal()),
            });
        }
        self.download("copy_to_pinned_async_after", 0, dst, stream, Some(ready))
    }

    /// Queues setting every byte to zero.
    pub fn memset_zero(&mut self, stream: &Stream) -> Result<(), MemoryError> {
        let ptr = self.range("memset_zero", 0, self.len, stream)?;
        if self.is_empty() {
            return Ok(());
        }
        // SAFETY: `ptr..ptr + len` is our live block, marked used on `stream`.
        unsafe { result::memset_d8_async(ptr, 0, self.len, stream.cudarc().cu_stream()) }
            .map_err(driver("cuMemsetD8Async"))?;
        self.note_queued(stream)
    }
}

/// Records the copy just queued on `pinned`. If that fails, waits for the stream instead, so the
/// buffer is never handed out while a DMA still uses it.
fn mark_pending(pinned: &mut PinnedBuffer, stream: &Stream) -> Result<(), MemoryError> {
    pinned.record(stream).inspect_err(|_| {
        // The record error is the one to report; a failing wait means the context is gone.
        let _ = stream.synchronize();
    })
}
