//! A move as a graph op: the transfer node, and the plain move whose backward it runs. The two
//! live together because the backward of a move is a move (and records a node of its own under
//! `create_graph`), so this module sits right above the raw copies.

use std::time::Instant;

use ferry_graph::NodeKind;
use ferry_memory::{DType, Device};
use ferry_tensor::{Result, Rule, Save, Tensor, record_kind, should_record, with_no_grad};
use smallvec::smallvec;

use crate::copy::move_bytes;
use crate::report::TransferReport;
use crate::staging::dense_copies;

/// How to move: an optional dtype fused into the move, and whether to wait for the bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MoveOptions {
    /// Convert to this dtype on the way; the cast runs on whichever side moves fewer bytes,
    /// and the backward casts the gradient back.
    pub dtype: Option<DType>,
    /// Return before a GPU-to-host copy finishes. The result's bytes sit in pinned memory and
    /// every read of them waits for the copy, so reading too early is not possible. Beyond
    /// the pinned budget the move blocks instead (into pageable memory; `report.path` says
    /// so).
    pub non_blocking: bool,
}

impl MoveOptions {
    /// Convert to `dtype` during the move.
    pub fn dtype(dtype: DType) -> Self {
        Self {
            dtype: Some(dtype),
            ..Self::default()
        }
    }

    /// Do not wait for a GPU-to-host copy to finish.
    pub fn non_blocking() -> Self {
        Self {
            non_blocking: true,
            ..Self::default()
        }
    }
}

/// Records `moved` as a transfer of `src` to `to` when `src` requires grad and grad mode is on:
/// the backward moves the gradient back to `src`'s device and dtype.
pub(crate) fn record_transfer(
    moved: Tensor,
    src: &Tensor,
    to: Device,
    op: &'static str,
    report: &mut TransferReport,
) -> Tensor {
    if should_record(&[src]) {
        report.nodes_recorded = 1;
    }
    let kind = NodeKind::Transfer {
        from: src.device(),
        to,
    };
    // Saves nothing: the source's device and dtype are all the way home needs. Under
    // `create_graph` the move back records a transfer node of its own, so second derivatives
    // come home too.
    record_kind(moved, op, kind, &[src], || {
        Rule::new(
            Save::NOTHING,
            (src.device(), src.dtype()),
            |_, &(device, dtype), g, _| {
                let back = MoveOptions {
                    dtype: Some(dtype),
                    non_blocking: false,
                };
                Ok(smallvec![Some(to_with(g, device, back)?.0)])
            },
        )
    })
}

/// [`crate::DeviceMove::to_with`]: a raw copy (with the cast on the side that moves fewer bytes)
/// plus a transfer node when `src` requires grad.
pub(crate) fn to_with(
    src: &Tensor,
    device: Device,
    options: MoveOptions,
) -> Result<(Tensor, TransferReport)> {
    let start = Instant::now();
    let (from_device, from_dtype) = (src.device(), src.dtype());
    let to_dtype = options.dtype.unwrap_or(from_dtype);
    let (moved, mut report) = with_no_grad(|| -> Result<_> {
        // Cast first when that makes the bytes to move fewer.
        let cast_first = to_dtype.size() < from_dtype.size();
        let src = if cast_first {
            src.detach().to_dtype(to_dtype)?
        } else {
            src.detach()
        };
        let bytes = if from_device == device {
            0
        } else {
            src.nbytes()
        };
        let (moved, path, staging) = move_bytes(&src, device, options.non_blocking)?;
        let moved = moved.to_dtype(to_dtype)?;
        let mut report = TransferReport::new(path, bytes);
        // Pinned staging and scratch of a move beyond the pinned budget, plus (held all
        // the while) a cast before the move, or a non-dense source made dense on its own
        // device first: scratch memory on the source side.
        report.staging_peak_bytes = staging;
        if bytes > 0 && (cast_first || dense_copies(&src)) {
            report.staging_peak_bytes += src.nbytes();
        }
        Ok((moved, report))
    })?;
    let out = record_transfer(moved, src, device, "to_device", &mut report);
    report.elapsed = start.elapsed();
    Ok((out, report))
}
