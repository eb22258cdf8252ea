//! A loaded kernel ([`CudaFunction`]) and the safe boundary for its launches: arguments are
//! collected by value or as buffers of the launch's device, and the one `unsafe` launch call
//! lives here. A launch starts at [`Kernels::launch`](crate::Kernels::launch); the kernels come
//! from `kernels`, which compiles and loads their modules.

use std::borrow::Cow;
use std::ffi::c_void;
use std::fmt;

use cudarc::driver::{CudaFunction as RawFunction, result};
use ferry_memory::cuda::{CudaDevice, DeviceBuffer, Stream};
use ferry_memory::{Device, MemoryError};

use crate::CudaLibError;
use crate::profile::profiled;

/// A kernel loaded on one device, ready for [`Kernels::launch`](crate::Kernels::launch).
#[derive(Clone)]
pub struct CudaFunction {
    pub(crate) raw: RawFunction,
    pub(crate) device: Device,
    pub(crate) module: &'static str,
    pub(crate) name: &'static str,
}

impl CudaFunction {
    /// The kernel's name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The module it came from.
    pub fn module(&self) -> &'static str {
        self.module
    }

    /// The device it is loaded on.
    pub fn device(&self) -> Device {
        self.device
    }
}

impl fmt::Debug for CudaFunction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CudaFunction({}::{} on {})",
            self.module, self.name, self.device
        )
    }
}

/// Grid and block sizes, as (x, y, z).
pub type Dim3 = (u32, u32, u32);

/// A kernel launch being assembled; nothing runs until [`Launch::run`].
///
/// Contract: the arguments, in order and type, must match the kernel's C signature (a
/// [`DeviceBuffer`] is passed as a pointer, `arg_u32` as `unsigned int`, `arg_pod` as the struct
/// with the same `#[repr(C)]` layout), and the kernel must stay inside each buffer's
/// [`DeviceBuffer::len`]. The builder borrows the buffers, so they outlive the call; after it
/// returns they may be dropped at once, because the allocator orders the reuse of their memory
/// after the work queued on the launch's stream.
#[must_use = "a launch does nothing until `.run()`"]
pub struct Launch<'a> {
    device: &'a CudaDevice,
    function: &'a CudaFunction,
    grid: Dim3,
    block: Dim3,
    shared_mem_bytes: u32,
    stream: &'a Stream,
    /// Each argument's bytes, 8-byte aligned, so the kernel-parameter array can point at them.
    args: Vec<Vec<u64>>,
    error: Option<CudaLibError>,
}

impl<'a> Launch<'a> {
    /// See [`Kernels::launch`](crate::Kernels::launch).
    pub(crate) fn new(
        device: &'a CudaDevice,
        function: &'a CudaFunction,
        grid: Dim3,
        block: Dim3,
        shared_mem_bytes: u32,
        stream: &'a Stream,
    ) -> Self {
        Launch {
            device,
            function,
            grid,
            block,
            shared_mem_bytes,
            stream,
            args: Vec::new(),
            error: None,
        }
    }
}

/// The most blocks a grid's x dimension holds (CUDA's limit on every GPU ferry supports).
pub const MAX_GRID_X: u32 = i32::MAX as u32;

/// Blocks of `threads` threads needed to cover `n` elements, one thread each (clamped to
/// `u32::MAX`: a grid-stride kernel caps it further, one without a loop wants [`exact_grid`]).
pub fn blocks_for(n: usize, threads: u32) -> u32 {
    n.div_ceil(threads.max(1) as usize).min(u32::MAX as usize) as u32
}

/// The grid of a grid-stride kernel over `units` rows or tiles: at least one block, at most
/// `cap`. Clamped before narrowing to `u32`, so 2^32 rows give `cap` blocks, not 0.
pub fn grid_stride_blocks(units: usize, cap: u32) -> u32 {
    units.clamp(1, cap.max(1) as usize) as u32
}

/// The grid of a kernel with one block per unit and no grid-stride loop: `units` blocks, or
/// [`CudaLibError::GridTooLarge`] naming [`MAX_GRID_X`] when a grid cannot hold that many.
pub fn exact_grid(op: &'static str, units: usize) -> Result<u32, CudaLibError> {
    u32::try_from(units)
        .ok()
        .filter(|&blocks| blocks <= MAX_GRID_X)
        .ok_or(CudaLibError::GridTooLarge {
            op,
            blocks: units,
            limit: MAX_GRID_X,
        })
}

impl<'a> Launch<'a> {
    /// A buffer the kernel only reads, passed as a pointer.
    pub fn arg_buffer(mut self, buffer: &'a DeviceBuffer) -> Self {
        self.push_buffer(buffer);
        self
    }

    /// A buffer the kernel writes, passed as a pointer.
    pub fn arg_buffer_mut(mut self, buffer: &'a mut DeviceBuffer) -> Self {
        self.push_buffer(buffer);
        self
    }

    /// An `unsigned int`.
    pub fn arg_u32(self, value: u32) -> Self {
        self.arg_pod(&value)
    }

    /// An `int`.
    pub fn arg_i32(self, value: i32) -> Self {
        self.arg_pod(&value)
    }

    /// A `long long`.
    pub fn arg_i64(self, value: i64) -> Self {
        self.arg_pod(&value)
    }

    /// An `unsigned long long` (sizes, element counts).
    pub fn arg_u64(self, value: u64) -> Self {
        self.arg_pod(&value)
    }

    /// A `float`.
    pub fn arg_f32(self, value: f32) -> Self {
        self.arg_pod(&value)
    }

    /// A `double`.
    pub fn arg_f64(self, value: f64) -> Self {
        self.arg_pod(&value)
    }

    /// A small struct passed by value (shapes, strides), with the kernel's C layout.
    pub fn arg_pod<T: bytemuck::Pod>(mut self, value: &T) -> Self {
        const {
            assert!(
                align_of::<T>() <= 8,
                "kernel arguments are copied into 8-byte aligned storage"
            )
        };
        let bytes = bytemuck::bytes_of(value);
        let mut words = vec![0u64; bytes.len().div_ceil(8).max(1)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes.len()].copy_from_slice(bytes);
        self.args.push(words);
        self
    }

    fn push_buffer(&mut self, buffer: &DeviceBuffer) {
        if buffer.device() != self.device.device() && self.error.is_none() {
            self.error = Some(CudaLibError::LaunchArgumentDevice {
                function: self.function.name(),
                index: self.args.len(),
                expected: self.device.device(),
                actual: buffer.device(),
            });
        }
        buffer.record_stream(self.stream);
        self.args.push(vec![buffer.device_ptr()]);
    }

    /// Queues the kernel on the stream. Errors in the configuration (too many threads, too much
    /// shared memory) are returned here; faults inside the kernel surface at the next
    /// synchronization.
    pub fn run(mut self) -> Result<(), CudaLibError> {
        if let Some(error) = self.error.take() {
            return Err(error);
        }
        self.device.check()?;
        self.device
            .check_operands("launch", [self.stream.device(), self.function.device()])?;
        self.device.bind()?;
        let mut params: Vec<*mut c_void> = self
            .args
            .iter_mut()
            .map(|words| words.as_mut_ptr().cast())
            .collect();
        let name = || Cow::Borrowed(self.function.name());
        profiled(self.device, self.stream, name, || {
            // SAFETY: the function comes from a module loaded in this device's context, which the
            // function keeps alive; each parameter points at owned, aligned storage that lives until
            // after the call (the driver copies parameters at launch); every pointer argument is a
            // live buffer of this device (checked above) whose reuse the allocator orders after this
            // stream's work. That the kernel's signature matches the arguments and stays in bounds
            // is the documented contract of `Launch`.
            unsafe {
                result::launch_kernel(
                    self.function.raw.cu_function(),
                    self.grid,
                    self.block,
                    self.shared_mem_bytes,
                    self.stream.cudarc().cu_stream(),
                    &mut params,
                )
            }
            .map_err(|e| {
                CudaLibError::Memory(MemoryError::Driver {
                    call: "cuLaunchKernel",
                    message: e.to_string(),
                })
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_every_element() {
        assert_eq!(blocks_for(0, 256), 0);
        assert_eq!(blocks_for(1, 256), 1);
        assert_eq!(blocks_for(256, 256), 1);
        assert_eq!(blocks_for(257, 256), 2);
        assert_eq!(blocks_for(usize::MAX, 1), u32::MAX);
        assert_eq!(blocks_for(usize::MAX, 256), u32::MAX);
    }

    #[test]
    fn grid_stride_grids_clamp_before_narrowing() {
        assert_eq!(grid_stride_blocks(0, 65535), 1);
        assert_eq!(grid_stride_blocks(300, 65535), 300);
        // 2^32 rows narrowed first would be a grid of 0 blocks; 2^32 + 1 one of a single block.
        for units in [1 << 32, (1 << 32) + 1, usize::MAX - 1, usize::MAX] {
            assert_eq!(grid_stride_blocks(units, 65535), 65535, "{units}");
        }
        assert_eq!(grid_stride_blocks(usize::MAX, u32::MAX), u32::MAX);
    }

    #[test]
    fn exact_grids_past_the_limit_are_errors_naming_it() {
        assert_eq!(exact_grid("op", 7).unwrap(), 7);
        assert_eq!(exact_grid("op", MAX_GRID_X as usize).unwrap(), MAX_GRID_X);
        for units in [MAX_GRID_X as usize + 1, 1 << 32, usize::MAX] {
            match exact_grid("layer_norm backward", units) {
                Err(err @ CudaLibError::GridTooLarge { .. }) => {
                    let text = err.to_string();
                    for needle in ["layer_norm backward", &units.to_string(), "2147483647"] {
                        assert!(text.contains(needle), "`{needle}` missing from: {text}");
                    }
                }
                other => panic!("{units} blocks gave {other:?}"),
            }
        }
    }
}
