//! The peer rows of `ferry methods --device cuda:N` (N >= 1): the moves from cuda:0 to cuda:N.
//!
//! A peer move returns once it is queued (the result is ordered on the target's stream), so
//! each row's run waits for the target device before the clock stops: the times are whole
//! copies, comparable with the host rows.

use ferry::memory::cuda::{CudaDevice, Stream};
use ferry::prelude::*;
use ferry::{ChunkPlan, TransferReport};

use super::{Method, Outcome, Run, Setup};

/// `report`'s result once the target has finished the copy.
fn finished(target: &CudaDevice, y: Tensor, report: TransferReport) -> ferry::Result<Outcome> {
    target.synchronize()?;
    Ok(Outcome::moved(y, report))
}

/// The peer rows for `src` (on cuda:0, requiring grad) to `target`; `stream` belongs to
/// `target`.
pub(super) fn peer_methods<'a>(
    src: &'a Tensor,
    source: &'a CudaDevice,
    target: &'a CudaDevice,
    stream: &'a Stream,
) -> Vec<Method<'a>> {
    let to = target.device();
    let label = |what: &str| format!("{} -> {to}: {what}", source.device());
    let same = move || -> Setup<'a> { Box::new(move || Ok(src.clone())) };
    let method = |name: String, setup: Setup<'a>, run: Run<'a>| Method { name, setup, run };
    vec![
        method(
            label(".to()"),
            same(),
            Box::new(move |x| {
                let (y, report) = x.to_with(to, MoveOptions::default())?;
                finished(target, y, report)
            }),
        ),
        method(
            label(".to(f16)"),
            same(),
            Box::new(move |x| {
                let (y, report) = x.to_with(to, MoveOptions::dtype(DType::F16))?;
                finished(target, y, report)
            }),
        ),
        method(
            label("detach().to()"),
            same(),
            Box::new(move |x| {
                let (y, report) = x.detach().to_with(to, MoveOptions::default())?;
                finished(target, y, report)
            }),
        ),
        method(
            label("into_device()"),
            Box::new(move || {
                let fresh = Tensor::randn(src.shape(), DType::F32, source.device())?.with_grad()?;
                source.synchronize()?; // its producer is not part of the move
                Ok(fresh)
            }),
            Box::new(move |x| {
                let (y, report) = x.into_device(to)?;
                finished(target, y, report)
            }),
        ),
        method(
            label("to_chunked(scratch <= 1/4)"),
            same(),
            Box::new(move |x| {
                let bound =
                    (x.nbytes() / 4).max(ChunkPlan::min_staging_bytes(x.shape(), x.dtype()));
                let (y, report) = x.to_chunked(to, ChunkSpec::MaxStagingBytes(bound))?;
                finished(target, y, report)
            }),
        ),
        method(
            label("to_async(its stream) + wait"),
            same(),
            Box::new(move |x| {
                let (y, report) = x.to_async(to, stream)?.wait()?;
                Ok(Outcome::moved(y, report))
            }),
        ),
    ]
}
