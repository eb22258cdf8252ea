//! What a move did: bytes, the path it took, staging, and what it recorded or pruned.

use std::fmt;
use std::time::Duration;

/// The route bytes took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransferPath {
    /// Source and target are the same device: no bytes moved (a cast may still have run).
    SameDevice,
    /// Host to GPU.
    HostToDevice,
    /// GPU to host, by DMA straight into page-locked memory that the result keeps.
    DeviceToPinned,
    /// GPU to host into pageable memory (small tensors, or chunked moves).
    DeviceToPageable,
    /// GPU to GPU on one device (two of its streams).
    DeviceToDevice,
    /// GPU to GPU between two devices, in `chunks` copies (1 for a whole move). `direct` when
    /// peer access was enabled (NVLink or PCIe peer-to-peer); otherwise the driver staged the
    /// bytes through host memory of its own (outside ferry's pinned pool and its budget).
    Peer {
        /// Whether the copy went device to device without touching host memory.
        direct: bool,
        /// Number of copies the move was split into.
        chunks: usize,
    },
    /// In pieces through bounded pinned staging.
    Chunked {
        /// Number of pieces.
        chunks: usize,
    },
    /// Many tensors through one pinned arena with one synchronization.
    Batched {
        /// Number of tensors.
        tensors: usize,
    },
}

/// Every move returns one of these.
#[derive(Debug, Clone, PartialEq)]
pub struct TransferReport {
    /// Bytes that crossed the device boundary.
    pub bytes_moved: usize,
    /// The route taken.
    pub path: TransferPath,
    /// Largest amount of staging memory in use at once (pinned or device scratch).
    pub staging_peak_bytes: usize,
    /// Graph nodes this move recorded (1 when the gradient path is kept, else 0).
    pub nodes_recorded: usize,
    /// Graph nodes that left the graph because this move let go of the source.
    pub nodes_pruned: usize,
    /// Bytes of `.grad` buffers copied: 0 by construction, not a measurement. A move copies a
    /// tensor's storage, `.grad` is not part of it, and no move writes this field.
    pub grad_bytes_copied: usize,
    /// Wall time of the move, until the data was usable (or enqueued, for non-blocking moves).
    pub elapsed: Duration,
}

impl TransferReport {
    pub(crate) fn new(path: TransferPath, bytes_moved: usize) -> Self {
        Self {
            bytes_moved,
            path,
            staging_peak_bytes: 0,
            nodes_recorded: 0,
            nodes_pruned: 0,
            grad_bytes_copied: 0,
            elapsed: Duration::ZERO,
        }
    }
}

impl fmt::Display for TransferReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?}: {} bytes in {:.3} ms, staging {} bytes, {} node(s) recorded, {} pruned",
            self.path,
            self.bytes_moved,
            self.elapsed.as_secs_f64() * 1e3,
            self.staging_peak_bytes,
            self.nodes_recorded,
            self.nodes_pruned
        )
    }
}
