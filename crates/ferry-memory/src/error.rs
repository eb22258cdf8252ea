use thiserror::Error;

use crate::Device;
use crate::cuda::{DeviceMemoryInfo, MemoryStats, PinnedStats};
use crate::size::human_bytes;

/// Errors from devices, buffers and allocators.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// A device string that does not parse.
    #[error("`{text}` is not a device: write `cpu` or `cuda:N`")]
    BadDevice {
        /// What was given.
        text: String,
    },
    /// A dtype string that does not parse.
    #[error("`{text}` is not a dtype: write one of f32, f64, f16, bf16, i64, u8")]
    BadDType {
        /// What was given.
        text: String,
    },
    /// The host allocator refused.
    #[error(
        "could not allocate {bytes} bytes of host memory: free some memory or move less at once (a chunked move bounds staging)"
    )]
    HostOutOfMemory {
        /// Size of the request.
        bytes: usize,
    },
    /// No CUDA driver library could be loaded.
    #[error(
        "no CUDA driver found (libcuda could not be loaded): use Device::Cpu, or install the NVIDIA driver"
    )]
    NoDriver,
    /// The driver is there but the device is not.
    #[error(
        "{device} is not available: {available} CUDA device(s) found; use Device::Cpu or a lower ordinal"
    )]
    NoSuchDevice {
        /// The device asked for.
        device: Device,
        /// How many CUDA devices exist.
        available: usize,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver call {call} failed: {message}")]
    Driver {
        /// The driver function.
        call: &'static str,
        /// The driver's error text.
        message: String,
    },
    /// The device allocator could not find memory even after emptying its cache.
    #[error("{}", device_oom(*.device, *.requested, .stats, .memory))]
    DeviceOutOfMemory {
        /// The device that ran out.
        device: Device,
        /// Bytes asked for.
        requested: usize,
        /// The allocator's statistics at the time of the failure (boxed: errors stay small).
        stats: Box<MemoryStats>,
        /// Free and total memory as the driver saw it then (every process's use included);
        /// `None` when the driver could not say.
        memory: Option<DeviceMemoryInfo>,
    },
    /// A device allocation would take ferry's allocator past its budget on that device
    /// (`FERRY_DEVICE_BUDGET`, `CudaDevice::set_budget`), even after emptying its cache.
    #[error(
        "CUDA out of memory on {device} within ferry's device budget: tried to allocate {}, and {} reserved (of it {} allocated) \
         plus that would pass the budget of {} (FERRY_DEVICE_BUDGET or CudaDevice::set_budget); cached blocks were already released. \
         Raise the budget, keep the optimizer's state on the host (ferry::optim::OffloadAdamW), use a smaller batch, \
         or free tensors you no longer need",
        human_bytes(*.requested), human_bytes(.stats.reserved_bytes), human_bytes(.stats.allocated_bytes), human_bytes(*.budget)
    )]
    DeviceBudgetExceeded {
        /// The device whose budget it is.
        device: Device,
        /// Bytes asked for.
        requested: usize,
        /// The budget, bytes.
        budget: usize,
        /// The allocator's statistics at the time (boxed: errors stay small).
        stats: Box<MemoryStats>,
    },
    /// The pinned host pool could not get page-locked memory even after emptying its cache.
    #[error(
        "could not page-lock {} of host memory ({} pinned by ferry in live buffers, {} reserved; cached blocks were already released and the request retried): \
         the OS refused to lock more RAM. Drop pinned results you no longer need (CPU tensors moved from a GPU) and call ferry::cuda::pinned::empty_cache(), \
         or lower ferry::cuda::pinned::set_budget(bytes) so that moves beyond it land in pageable memory",
        human_bytes(*.requested), human_bytes(.stats.allocated_bytes), human_bytes(.stats.reserved_bytes)
    )]
    PinnedOutOfMemory {
        /// Bytes asked for.
        requested: usize,
        /// The pool's statistics at the time of the failure (boxed: errors stay small).
        stats: Box<PinnedStats>,
    },
    /// A pinned request does not fit the pinned-memory budget even with the cache trimmed: live
    /// pinned buffers fill it. Moves handle this themselves (they land in pageable memory); this
    /// reaches code that asks the pool directly.
    #[error(
        "the pinned-memory budget of {} is full: {} is held by live pinned buffers and {} more was asked for (idle cached blocks were already trimmed). \
         Drop pinned buffers you no longer need, raise the budget with ferry::cuda::pinned::set_budget(bytes) or FERRY_PINNED_BUDGET (e.g. FERRY_PINNED_BUDGET=16G), \
         or call ferry::cuda::pinned::empty_cache() to give back blocks still in flight",
        human_bytes(*.budget), human_bytes(.stats.allocated_bytes + .stats.registered_bytes), human_bytes(*.requested)
    )]
    PinnedBudgetExceeded {
        /// Bytes asked for.
        requested: usize,
        /// The budget at the time.
        budget: usize,
        /// The pool's statistics at the time (boxed: errors stay small).
        stats: Box<PinnedStats>,
    },
    /// A request larger than any block a pool makes: rounded up to its size class it would pass
    /// `isize::MAX` bytes, the most one allocation may hold.
    #[error(
        "{op}: {requested} bytes is more than the largest request it serves, {limit} bytes (a size class above that would pass isize::MAX, \
         the most one allocation may hold); ask for less, or move the data in chunks"
    )]
    RequestTooLarge {
        /// The allocation (`HostPool::alloc`, `PinnedPool::alloc`, `CudaDevice::alloc`).
        op: &'static str,
        /// Bytes asked for.
        requested: usize,
        /// The largest request the pool serves.
        limit: usize,
    },
    /// An environment variable meant to hold a memory budget does not hold a size.
    #[error(
        "{variable}=`{value}` is not a size: write a number of bytes, optionally with K, M, G or T (binary units), e.g. {variable}=8G, or unset it for the default"
    )]
    BadBudget {
        /// The variable (`FERRY_PINNED_BUDGET`, `FERRY_HOST_POOL_BUDGET`).
        variable: &'static str,
        /// What it held.
        value: String,
    },
    /// Source and destination of a copy have different lengths.
    #[error(
        "{op}: lengths differ ({expected} bytes expected, {actual} given); use copy_region to copy part of a buffer"
    )]
    LengthMismatch {
        /// The operation.
        op: &'static str,
        /// Length the destination (or operation) needs.
        expected: usize,
        /// Length that was given.
        actual: usize,
    },
    /// A byte range does not fit inside its buffer.
    #[error(
        "{op}: bytes {offset}..{offset}+{len} do not fit in a buffer of {buffer_len} bytes; check the offset and length"
    )]
    OutOfBounds {
        /// The operation.
        op: &'static str,
        /// Start of the range, in bytes.
        offset: usize,
        /// Length of the range, in bytes.
        len: usize,
        /// Length of the buffer, in bytes.
        buffer_len: usize,
    },
    /// Two things that must be on one device are not.
    #[error(
        "{op}: expected {expected} but got {actual}; move the data first (ferry-transfer), or use the peer-copy variant"
    )]
    DeviceMismatch {
        /// The operation.
        op: &'static str,
        /// The device the operation runs on.
        expected: Device,
        /// The device of the offending argument.
        actual: Device,
    },
    /// The hardware cannot map one device's memory into another's address space.
    #[error(
        "{from} cannot access {to} directly (no peer access between them); copies still work but stage through host memory"
    )]
    PeerAccessUnsupported {
        /// The device that would read.
        from: Device,
        /// The device whose memory would be read.
        to: Device,
    },
    /// An event without timing was used to measure time.
    #[error(
        "elapsed time needs events created with timing enabled: use Stream::record_timed or Event::timed"
    )]
    EventTimingDisabled,
    /// A GEMM argument that cuBLAS would reject or that would read outside a buffer.
    #[error("gemm: {argument} {reason}")]
    GemmArgument {
        /// The argument (`lda`, `a`, `batch`, ...).
        argument: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A kernel found its input invalid (checked on the device, read by the host without waiting:
    /// see `CudaDevice::check_later`); reported by the first checked call the same thread makes
    /// on the device after the flag reached the host, in place of that call's result.
    #[error(
        "{op} found invalid input on the device (reported by this thread's next call on the device, in place of its result): {message}"
    )]
    DeviceCheck {
        /// The op whose kernel checked.
        op: &'static str,
        /// What was wrong and how to fix it.
        message: String,
    },
    /// A CUDA call failed where no error can be returned (a destructor, a read through `Deref`,
    /// ordering a buffer's use); it is reported by the next checked call on the same device or
    /// pool, as cudarc does, and that call did not run.
    #[error(
        "this call did not run: an earlier step failed where it could not return an error, while {what}: {source}. \
         If the device keeps failing (an earlier kernel may have faulted), restart the process; otherwise retry the call"
    )]
    FailedInDrop {
        /// What failed, and on what (the buffer's size and device, the stream).
        what: String,
        /// The failure: a [`MemoryError`], or the error of a CUDA library whose destructor
        /// failed (an NCCL communicator's).
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Waiting on a copy into pinned host memory failed: the bytes it was to bring never came.
    #[error(
        "{op}: the copy into pinned host memory that this data waits for failed, so its values never arrived ({source}); \
         move the source again, and if the device keeps failing (an earlier kernel may have faulted) restart the process"
    )]
    PendingCopyFailed {
        /// The operation that read the data.
        op: &'static str,
        /// Why the wait failed.
        source: Box<MemoryError>,
    },
    /// A matrix operand does not fit the slice it was given.
    #[error(
        "matmul operand `{operand}` of {rows}x{cols} does not fit its buffer of {len} elements"
    )]
    OperandOutOfBounds {
        /// Which operand.
        operand: &'static str,
        /// Rows asked for.
        rows: usize,
        /// Columns asked for.
        cols: usize,
        /// Elements available.
        len: usize,
    },
}

/// The out-of-memory message: what was asked, what the device has, what ferry holds, and what
/// is left for the rest (other processes, this process's CUDA context and libraries).
fn device_oom(
    device: Device,
    requested: usize,
    stats: &MemoryStats,
    memory: &Option<DeviceMemoryInfo>,
) -> String {
    let device_line = match memory {
        Some(m) => format!(
            "{device} has {} in total and {} free; ferry holds {} allocated and {} reserved, so {} is used outside ferry's allocator \
             (other processes, and this process's CUDA context and libraries)",
            human_bytes(m.total_bytes),
            human_bytes(m.free_bytes),
            human_bytes(stats.allocated_bytes),
            human_bytes(stats.reserved_bytes),
            human_bytes(
                m.total_bytes
                    .saturating_sub(m.free_bytes)
                    .saturating_sub(stats.reserved_bytes)
            ),
        ),
        None => format!(
            "ferry holds {} allocated and {} reserved on {device} (the driver could not say what else uses it)",
            human_bytes(stats.allocated_bytes),
            human_bytes(stats.reserved_bytes),
        ),
    };
    format!(
        "CUDA out of memory on {device}: tried to allocate {}; {device_line}. Cached blocks were already released and the allocation retried. \
         Free tensors you no longer need, call ferry::cuda::empty_cache(device), stop other processes using the GPU (nvidia-smi lists them), \
         or move the data in chunks (a chunked move bounds device staging)",
        human_bytes(requested)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_stay_small() {
        // TensorError holds a MemoryError inline; large statistics are boxed so results stay
        // cheap to return (and clippy's large-error lint stays quiet for every crate above).
        assert!(
            size_of::<MemoryError>() <= 80,
            "{}",
            size_of::<MemoryError>()
        );
    }

    #[test]
    fn out_of_memory_says_what_was_asked_and_how_to_fix_it() {
        let stats = MemoryStats {
            allocated_bytes: 1 << 30,
            reserved_bytes: 3 << 29,
            ..MemoryStats::default()
        };
        let err = MemoryError::DeviceOutOfMemory {
            device: Device::Cuda(0),
            requested: 200 << 30,
            stats: Box::new(stats),
            memory: Some(DeviceMemoryInfo {
                free_bytes: 1 << 30,
                total_bytes: 140 << 30,
            }),
        };
        let text = err.to_string();
        // 140 GiB total - 1 GiB free - 1.5 GiB reserved by ferry = 137.5 GiB used elsewhere.
        for needle in [
            "cuda:0",
            "200.00 GiB",
            "140.00 GiB in total",
            "1.00 GiB free",
            "1.00 GiB allocated",
            "1.50 GiB reserved",
            "137.50 GiB is used outside ferry's allocator (other processes",
            "ferry::cuda::empty_cache(device)",
            "chunks",
        ] {
            assert!(text.contains(needle), "`{needle}` missing from: {text}");
        }
        let unknown = MemoryError::DeviceOutOfMemory {
            device: Device::Cuda(1),
            requested: 1 << 20,
            stats: Box::new(stats),
            memory: None,
        };
        let text = unknown.to_string();
        assert!(
            text.contains("cuda:1") && text.contains("could not say what else uses it"),
            "{text}"
        );
        let pinned = MemoryError::PinnedOutOfMemory {
            requested: 4096,
            stats: Box::default(),
        };
        assert!(
            pinned
                .to_string()
                .contains("ferry::cuda::pinned::empty_cache()"),
            "{pinned}"
        );
    }

    #[test]
    fn the_pinned_budget_error_names_the_budget_and_how_to_change_it() {
        let err = MemoryError::PinnedBudgetExceeded {
            requested: 400 << 20,
            budget: 8 << 30,
            stats: Box::new(PinnedStats {
                allocated_bytes: 7 << 30,
                ..PinnedStats::default()
            }),
        };
        let text = err.to_string();
        for needle in [
            "budget of 8.00 GiB",
            "7.00 GiB is held by live pinned buffers",
            "400.00 MiB more",
            "ferry::cuda::pinned::set_budget(bytes)",
            "FERRY_PINNED_BUDGET",
            "ferry::cuda::pinned::empty_cache()",
        ] {
            assert!(text.contains(needle), "`{needle}` missing from: {text}");
        }
    }

    #[test]
    fn an_error_from_a_destructor_names_what_failed_and_that_the_call_did_not_run() {
        let err = MemoryError::FailedInDrop {
            what: "returning a 4.00 MiB device buffer on cuda:0 to the allocator".into(),
            source: Box::new(MemoryError::Driver {
                call: "cuEventRecord",
                message: "an illegal memory access was encountered".into(),
            }),
        };
        let text = err.to_string();
        for needle in [
            "this call did not run",
            "while returning a 4.00 MiB device buffer on cuda:0 to the allocator",
            "cuEventRecord",
            "illegal memory access",
            "restart the process",
        ] {
            assert!(text.contains(needle), "`{needle}` missing from: {text}");
        }
    }

    #[test]
    fn a_failed_pending_copy_says_the_values_never_arrived() {
        let err = MemoryError::PendingCopyFailed {
            op: "to_vec",
            source: Box::new(MemoryError::Driver {
                call: "cuEventSynchronize",
                message: "an illegal memory access was encountered".into(),
            }),
        };
        let text = err.to_string();
        for needle in [
            "to_vec",
            "copy into pinned host memory",
            "never arrived",
            "cuEventSynchronize",
            "illegal memory access",
            "move the source again",
        ] {
            assert!(text.contains(needle), "`{needle}` missing from: {text}");
        }
        assert!(!text.contains("move it first"), "{text}");
    }
}
