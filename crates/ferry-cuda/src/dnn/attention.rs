//! Fused scaled-dot-product attention through cuDNN's flash-attention engine, forward (O and
//! the log-sum-exp statistics) and backward (dQ, dK, dV), without materializing the
//! `[B, H, T, S]` scores.
//!
//! # What runs
//! The composite graph cudnn-frontend builds for its `sdpa` and `sdpa_backward` nodes (see
//! `graph`): matmul, scale, an optional causal mask from generated row and column indices,
//! softmax written as max / subtract / exp / sum (the statistics are `max + log(sum)`),
//! optional dropout from cuDNN's Bernoulli RNG, matmul; the backward graph recomputes the
//! probabilities from the statistics. cuDNN's heuristics (mode A, then its fallback list) pick
//! the engine; the plan of each (shape, dtype, options, strides) is built once per cuDNN
//! handle and kept on the device, so later calls only fill a variant pack and enqueue.
//!
//! # Which cuDNN
//! cuDNN 9.0 or newer: the composite graph is what every cuDNN 9 runs (cudnn-frontend still
//! builds it for the backward pass on all versions). cuDNN 9.13.1 added a single-node
//! `CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR` (cudnn-frontend's "unified" node, with causal
//! masks from 9.21 and dropout from 9.22) and cuDNN 9.21 headers name an `SDPA_BWD` one; they
//! are not used here, as the composite graph covers every version and option ferry needs.
//!
//! # What falls back
//! Without libcudnn the calls return [`CudaLibError::NoCudnn`]; with a cuDNN older than 9.0,
//! dtypes other than f16 and bf16, head dims that are not a multiple of 8 up to 128, operands
//! whose head dim is not contiguous or whose address is not 16-byte aligned, or a shape no
//! cuDNN engine runs, they return [`CudaLibError::AttentionUnsupported`] saying why, and the
//! caller runs the composed attention (matmul, softmax, matmul). Arguments that are wrong in
//! themselves (head counts that do not divide, an operand outside its buffer) are
//! [`CudaLibError::AttentionArgument`].

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cudnn::result as dnn;
use ferry_memory::DType;
use ferry_memory::cuda::{CudaDevice, DeviceBuffer, Stream};
use parking_lot::Mutex;

use super::backend::Plan;
use super::library::ensure_cudnn_graphs;
use super::{DnnDevice, DnnHandle, failed};
use crate::CudaLibError;
use crate::profile::profiled;
use crate::sealed::Sealed;

mod checks;
mod graph;
#[cfg(test)]
mod tests;

pub use checks::SDPA_MAX_HEAD_DIM;
use checks::{check_rng, operand};

/// The oldest cuDNN whose flash-attention engine runs the composite graph (9.0.0).
pub const SDPA_MIN_CUDNN: usize = 90000;

/// Which keys each query may attend to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Causal {
    /// Every query sees every key.
    None,
    /// Query `i` sees keys `j <= i`: the diagonal starts at the top-left corner of the
    /// `T x S` scores (PyTorch's `is_causal`, `tril(ones(T, S))`).
    TopLeft,
    /// Query `i` sees keys `j <= i + S - T`: the diagonal ends at the bottom-right corner, so
    /// the last query sees every key (flash-attention's convention, for queries that continue
    /// a cached prefix). The same as top-left when `T == S`.
    BottomRight,
}

/// One attention call's shape and options. Q is `[batch, heads, q_len, head_dim]`, K and V
/// `[batch, kv_heads, kv_len, head_dim]`, O like Q, the statistics f32 `[batch, heads, q_len,
/// 1]`; query head `h` reads key/value head `h / (heads / kv_heads)` (grouped-query attention).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SdpaSpec {
    /// B.
    pub batch: usize,
    /// Query heads H.
    pub heads: usize,
    /// Key/value heads; divides `heads`.
    pub kv_heads: usize,
    /// Queries per sequence T.
    pub q_len: usize,
    /// Keys per sequence S.
    pub kv_len: usize,
    /// D, of queries, keys and values alike.
    pub head_dim: usize,
    /// f16 or bf16 (the statistics are f32).
    pub dtype: DType,
    /// The mask.
    pub causal: Causal,
    /// What the scores `Q Kᵀ` are multiplied by before the softmax (usually `1 / sqrt(D)`).
    pub scale: f32,
    /// Probability of dropping an attention weight, in `[0, 1)`; 0 is none.
    pub dropout: f32,
}

/// One attention operand: its buffer, where it starts in bytes and its strides in elements
/// over `[B, heads, len, D]` (so a `[B, T, H, D]` buffer is read as `[B, H, T, D]` by giving
/// its strides `[T*H*D, D, H*D, 1]`). The statistics' strides are over `[B, H, T, 1]`.
#[derive(Debug, Clone, Copy)]
pub struct SdpaInput<'a> {
    /// The buffer holding it.
    pub buffer: &'a DeviceBuffer,
    /// Byte offset of the first element.
    pub offset_bytes: usize,
    /// Elements between neighbours along each axis; the last must be 1.
    pub strides: [usize; 4],
}

/// An operand written by the call, laid out as [`SdpaInput`] says.
#[derive(Debug)]
pub struct SdpaOutput<'a> {
    /// The buffer written.
    pub buffer: &'a mut DeviceBuffer,
    /// Byte offset of the first element.
    pub offset_bytes: usize,
    /// Elements between neighbours along each axis; the last must be 1.
    pub strides: [usize; 4],
}

/// The Philox seed and offset of dropout, one i64 each at the start of a device buffer, read
/// when the work runs (so a step can advance them on the device); the backward call must get
/// the values the forward call read, to redraw the same mask.
#[derive(Debug, Clone, Copy)]
pub struct DropoutRng<'a> {
    /// The seed.
    pub seed: &'a DeviceBuffer,
    /// The offset into the seed's stream.
    pub offset: &'a DeviceBuffer,
}

/// Operands of [`Attention::sdpa_forward`].
#[derive(Debug)]
pub struct SdpaForward<'a> {
    /// Queries.
    pub q: SdpaInput<'a>,
    /// Keys.
    pub k: SdpaInput<'a>,
    /// Values.
    pub v: SdpaInput<'a>,
    /// The output, written.
    pub o: SdpaOutput<'a>,
    /// The log-sum-exp of each query row's scaled, masked scores (f32), written.
    pub stats: SdpaOutput<'a>,
    /// Dropout's seed and offset; needed when the spec's dropout is above 0.
    pub rng: Option<DropoutRng<'a>>,
}

/// Operands of [`Attention::sdpa_backward`].
#[derive(Debug)]
pub struct SdpaBackward<'a> {
    /// Queries, as given to the forward call.
    pub q: SdpaInput<'a>,
    /// Keys, as given to the forward call.
    pub k: SdpaInput<'a>,
    /// Values, as given to the forward call.
    pub v: SdpaInput<'a>,
    /// The forward call's output.
    pub o: SdpaInput<'a>,
    /// The gradient of the output.
    pub d_o: SdpaInput<'a>,
    /// The forward call's statistics.
    pub stats: SdpaInput<'a>,
    /// The gradient of the queries, written.
    pub dq: SdpaOutput<'a>,
    /// The gradient of the keys, written.
    pub dk: SdpaOutput<'a>,
    /// The gradient of the values, written.
    pub dv: SdpaOutput<'a>,
    /// The forward call's dropout seed and offset.
    pub rng: Option<DropoutRng<'a>>,
}

/// Uids of the graphs' named tensors, shared by the graphs and the variant packs.
mod uid {
    pub const Q: i64 = 1;
    pub const K: i64 = 2;
    pub const V: i64 = 3;
    pub const O: i64 = 4;
    pub const STATS: i64 = 5;
    pub const D_O: i64 = 6;
    pub const DQ: i64 = 7;
    pub const DK: i64 = 8;
    pub const DV: i64 = 9;
    pub const SEED: i64 = 10;
    pub const OFFSET: i64 = 11;
    /// Backward's f32 `rowsum(dO ∘ O)`, in scratch memory.
    pub const ROW_SUM: i64 = 12;
    /// Backward's f32 dQ accumulator, in scratch memory.
    pub const DQ_ACCUM: i64 = 13;
    pub const SCALE: i64 = 20;
    pub const NEG_INF: i64 = 21;
    pub const KEEP: i64 = 22;
    pub const DROPOUT_SCALE: i64 = 23;
    pub const KV_LEN: i64 = 24;
    pub const Q_LEN: i64 = 25;
}

/// Strides in elements of each operand as the graph declares them (zero for those a pass does
/// not use); part of a plan's key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
struct Strides {
    q: [i64; 4],
    k: [i64; 4],
    v: [i64; 4],
    o: [i64; 4],
    stats: [i64; 4],
    d_o: [i64; 4],
    dq: [i64; 4],
    dk: [i64; 4],
    dv: [i64; 4],
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Pass {
    Forward,
    Backward,
}

/// What a plan is built for: the spec (floats by their bits), the pass, the strides and the
/// handle it runs on (an execution plan records its handle, so each handle of the pool gets
/// its own plans, as PyTorch keeps its cuDNN attention graphs per thread).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct PlanKey {
    handle: usize,
    pass: Pass,
    shape: [usize; 6],
    dtype: DType,
    causal: Causal,
    scale: u32,
    dropout: u32,
    strides: Strides,
}

/// A device's attention plans (a device slot): each built plan, or the reason cuDNN had no
/// engine for it, so an unsupported shape is refused at once on later calls.
#[derive(Default)]
struct AttentionPlans {
    plans: Mutex<HashMap<PlanKey, Arc<Result<Plan, String>>>>,
}

impl SdpaSpec {
    fn q_dims(&self) -> [usize; 4] {
        [self.batch, self.heads, self.q_len, self.head_dim]
    }

    fn kv_dims(&self) -> [usize; 4] {
        [self.batch, self.kv_heads, self.kv_len, self.head_dim]
    }

    fn stats_dims(&self) -> [usize; 4] {
        [self.batch, self.heads, self.q_len, 1]
    }

    /// Whether there is nothing to compute (no query rows).
    fn is_empty(&self) -> bool {
        self.batch == 0 || self.heads == 0 || self.q_len == 0
    }

    fn key(&self, handle: usize, pass: Pass, strides: Strides) -> PlanKey {
        PlanKey {
            handle,
            pass,
            shape: [
                self.batch,
                self.heads,
                self.kv_heads,
                self.q_len,
                self.kv_len,
                self.head_dim,
            ],
            dtype: self.dtype,
            causal: self.causal,
            scale: self.scale.to_bits(),
            dropout: self.dropout.to_bits(),
            strides,
        }
    }
}

/// A device's fused attention through cuDNN (see the module docs for what runs and what
/// falls back).
pub trait Attention: Sealed {
    /// Writes `O = softmax(Q Kᵀ · scale, masked) V` (with dropout on the weights) and the
    /// statistics on `stream`.
    fn sdpa_forward(
        &self,
        spec: &SdpaSpec,
        io: SdpaForward<'_>,
        stream: &Stream,
    ) -> Result<(), CudaLibError>;

    /// Writes dQ, dK and dV (overwriting them) from the forward call's inputs, output and
    /// statistics and the output's gradient, on `stream`.
    fn sdpa_backward(
        &self,
        spec: &SdpaSpec,
        io: SdpaBackward<'_>,
        stream: &Stream,
    ) -> Result<(), CudaLibError>;
}

/// The loaded cuDNN's version once its graph API is known to be there and new enough.
fn usable_cudnn() -> Result<usize, CudaLibError> {
    ensure_cudnn_graphs()?;
    let version = dnn::get_version();
    if version < SDPA_MIN_CUDNN {
        return Err(CudaLibError::AttentionUnsupported {
            reason: format!(
                "the loaded cuDNN is {version}, and its fused attention needs 9.0 or newer"
            ),
        });
    }
    Ok(version)
}

/// The value masked scores are set to: older cuDNN wants the lowest float, not -inf (as
/// cudnn-frontend does).
fn masked_value(version: usize) -> f32 {
    if version < 91000 {
        f32::MIN
    } else {
        f32::NEG_INFINITY
    }
}

/// Builds (or finds) the plan of `pass` for `spec` and `strides` on `handle`.
fn attention_plan(
    device: &CudaDevice,
    handle: &DnnHandle,
    spec: &SdpaSpec,
    pass: Pass,
    strides: Strides,
    version: usize,
) -> Result<Arc<Result<Plan, String>>, CudaLibError> {
    let key = spec.key(handle.0 as usize, pass, strides);
    let plans = device.local::<AttentionPlans>();
    if let Some(plan) = plans.plans.lock().get(&key) {
        return Ok(plan.clone());
    }
    // Built without the lock: finalizing a plan can take milliseconds.
    let neg = masked_value(version);
    let graph = match pass {
        Pass::Forward => graph::forward(spec, &strides, neg),
        Pass::Backward => graph::backward(spec, &strides, neg),
    }
    .map_err(|e| in_graph(e, pass, spec))?;
    let plan = Arc::new(graph.plan(handle.0).map_err(|e| in_graph(e, pass, spec))?);
    plans.plans.lock().insert(key, plan.clone());
    Ok(plan)
}

/// A cuDNN error met building a graph, with the graph's pass and shape added.
fn in_graph(err: CudaLibError, pass: Pass, spec: &SdpaSpec) -> CudaLibError {
    match err {
        CudaLibError::Cudnn { call, message } => CudaLibError::Cudnn {
            call,
            message: format!("{message}, building the attention {pass:?} graph of {spec:?}"),
        },
        other => other,
    }
}

/// The plan, or the reason cuDNN has none, as an error.
fn runnable(plan: &Result<Plan, String>, pass: Pass, spec: &SdpaSpec) -> Result<(), CudaLibError> {
    match plan {
        Ok(_) => Ok(()),
        Err(reason) => Err(CudaLibError::AttentionUnsupported {
            reason: format!("{reason} (attention {pass:?} of {spec:?})"),
        }),
    }
}

fn address(buffer: &DeviceBuffer, offset: usize) -> u64 {
    buffer.device_ptr() + offset as u64
}

impl Attention for CudaDevice {
    fn sdpa_forward(
        &self,
        spec: &SdpaSpec,
        io: SdpaForward<'_>,
        stream: &Stream,
    ) -> Result<(), CudaLibError> {
        let version = usable_cudnn()?;
        self.check()?;
        spec.check()?;
        let SdpaForward {
            q,
            k,
            v,
            o,
            stats,
            rng,
        } = io;
        self.check_operands(
            "sdpa_forward",
            [q.buffer, k.buffer, v.buffer, &*o.buffer, &*stats.buffer]
                .map(|b| b.device())
                .into_iter()
                .chain(
                    rng.iter()
                        .flat_map(|r| [r.seed.device(), r.offset.device()]),
                )
                .chain([stream.device()]),
        )?;
        let elem = spec.dtype.size();
        let strides = Strides {
            q: operand(
                "q",
                q.buffer,
                q.offset_bytes,
                q.strides,
                spec.q_dims(),
                elem,
            )?,
            k: operand(
                "k",
                k.buffer,
                k.offset_bytes,
                k.strides,
                spec.kv_dims(),
                elem,
            )?,
            v: operand(
                "v",
                v.buffer,
                v.offset_bytes,
                v.strides,
                spec.kv_dims(),
                elem,
            )?,
            o: operand(
                "o",
                o.buffer,
                o.offset_bytes,
                o.strides,
                spec.q_dims(),
                elem,
            )?,
            stats: operand(
                "stats",
                stats.buffer,
                stats.offset_bytes,
                stats.strides,
                spec.stats_dims(),
                4,
            )?,
            ..Strides::default()
        };
        check_rng(spec, rng)?;
        spec.supported()?;
        if spec.is_empty() {
            return Ok(());
        }

        self.bind()?;
        let dnn_device = self.local::<DnnDevice>();
        let lease = dnn_device.handles.take(|| {
            dnn::create_handle()
                .map(DnnHandle)
                .map_err(failed("cudnnCreate"))
        })?;
        let handle = lease.0;
        // SAFETY: the handle is ours (leased, used by this call alone) and `stream` belongs to
        // this device's context, which is current.
        unsafe { dnn::set_stream(handle, stream.cudarc().cu_stream() as _) }
            .map_err(failed("cudnnSetStream"))?;
        let plan = attention_plan(self, &lease, spec, Pass::Forward, strides, version)?;
        runnable(&plan, Pass::Forward, spec)?;
        let Ok(plan) = &*plan else {
            unreachable!("runnable returned early for a missing plan")
        };
        let workspace = self.alloc(plan.workspace, stream)?;
        let mut memory = vec![
            (uid::Q, address(q.buffer, q.offset_bytes)),
            (uid::K, address(k.buffer, k.offset_bytes)),
            (uid::V, address(v.buffer, v.offset_bytes)),
            (uid::O, address(o.buffer, o.offset_bytes)),
            (uid::STATS, address(stats.buffer, stats.offset_bytes)),
        ];
        let mut used = vec![
            q.buffer,
            k.buffer,
            v.buffer,
            &*o.buffer,
            &*stats.buffer,
            &workspace,
        ];
        if let (Some(rng), true) = (rng, spec.dropout > 0.0) {
            memory.push((uid::SEED, rng.seed.device_ptr()));
            memory.push((uid::OFFSET, rng.offset.device_ptr()));
            used.extend([rng.seed, rng.offset]);
        }
        for buffer in used {
            buffer.record_stream(stream);
        }
        // Ordering a buffer on the host may have made another GPU's context current.
        self.bind()?;
        let name = || format!("cudnn sdpa forward {spec:?}").into();
        // SAFETY: every operand's extent and alignment were checked against its buffer and
        // match the graph's tensors (same spec and strides); the buffers and the workspace are
        // marked used on `stream`, so their memory is not reused before the work finishes; the
        // handle is this call's, its stream set above.
        profiled(self, stream, name, || unsafe {
            plan.execute(handle, &memory, workspace.device_ptr())
        })
    }

    fn sdpa_backward(
        &self,
        spec: &SdpaSpec,
        io: SdpaBackward<'_>,
        stream: &Stream,
    ) -> Result<(), CudaLibError> {
        let version = usable_cudnn()?;
        self.check()?;
        spec.check()?;
        let SdpaBackward {
            q,
            k,
            v,
            o,
            d_o,
            stats,
            dq,
            dk,
            dv,
            rng,
        } = io;
        self.check_operands(
            "sdpa_backward",
            [q, k, v, o, d_o, stats]
                .map(|x| x.buffer.device())
                .into_iter()
                .chain([&*dq.buffer, &*dk.buffer, &*dv.buffer].map(|b| b.device()))
                .chain(
                    rng.iter()
                        .flat_map(|r| [r.seed.device(), r.offset.device()]),
                )
                .chain([stream.device()]),
        )?;
        let elem = spec.dtype.size();
        let input = |name, x: SdpaInput<'_>, dims| {
            operand(name, x.buffer, x.offset_bytes, x.strides, dims, elem)
        };
        let (qd, kvd) = (spec.q_dims(), spec.kv_dims());
        let strides = Strides {
            q: input("q", q, qd)?,
            k: input("k", k, kvd)?,
            v: input("v", v, kvd)?,
            o: input("o", o, qd)?,
            d_o: input("d_o", d_o, qd)?,
            stats: operand(
                "stats",
                stats.buffer,
                stats.offset_bytes,
                stats.strides,
                spec.stats_dims(),
                4,
            )?,
            dq: operand("dq", dq.buffer, dq.offset_bytes, dq.strides, qd, elem)?,
            dk: operand("dk", dk.buffer, dk.offset_bytes, dk.strides, kvd, elem)?,
            dv: operand("dv", dv.buffer, dv.offset_bytes, dv.strides, kvd, elem)?,
        };
        check_rng(spec, rng)?;
        spec.supported()?;
        if spec.is_empty() {
            if spec.batch == 0 || spec.kv_len == 0 {
                return Ok(());
            }
            // dK and dV are zero, but they may be views of larger buffers: the composed path
            // writes them.
            return Err(CudaLibError::AttentionUnsupported {
                reason: "there are no query rows, so dK and dV are zeros".to_string(),
            });
        }

        self.bind()?;
        let dnn_device = self.local::<DnnDevice>();
        let lease = dnn_device.handles.take(|| {
            dnn::create_handle()
                .map(DnnHandle)
                .map_err(failed("cudnnCreate"))
        })?;
        let handle = lease.0;
        // SAFETY: as in the forward call.
        unsafe { dnn::set_stream(handle, stream.cudarc().cu_stream() as _) }
            .map_err(failed("cudnnSetStream"))?;
        let plan = attention_plan(self, &lease, spec, Pass::Backward, strides, version)?;
        runnable(&plan, Pass::Backward, spec)?;
        let Ok(plan) = &*plan else {
            unreachable!("runnable returned early for a missing plan")
        };
        let workspace = self.alloc(plan.workspace, stream)?;
        let row_sum = self.alloc(spec.stats_dims().iter().product::<usize>() * 4, stream)?;
        let accum_bytes = qd.iter().product::<usize>() * 4;
        // cuDNN zeroes its dQ accumulator itself from 9.6 on.
        let accum = if version < 90600 {
            self.alloc_zeroed(accum_bytes, stream)?
        } else {
            self.alloc(accum_bytes, stream)?
        };
        let mut memory = vec![
            (uid::Q, address(q.buffer, q.offset_bytes)),
            (uid::K, address(k.buffer, k.offset_bytes)),
            (uid::V, address(v.buffer, v.offset_bytes)),
            (uid::O, address(o.buffer, o.offset_bytes)),
            (uid::D_O, address(d_o.buffer, d_o.offset_bytes)),
            (uid::STATS, address(stats.buffer, stats.offset_bytes)),
            (uid::DQ, address(dq.buffer, dq.offset_bytes)),
            (uid::DK, address(dk.buffer, dk.offset_bytes)),
            (uid::DV, address(dv.buffer, dv.offset_bytes)),
            (uid::ROW_SUM, row_sum.device_ptr()),
            (uid::DQ_ACCUM, accum.device_ptr()),
        ];
        let mut used = vec![
            q.buffer,
            k.buffer,
            v.buffer,
            o.buffer,
            d_o.buffer,
            stats.buffer,
            &*dq.buffer,
            &*dk.buffer,
            &*dv.buffer,
            &workspace,
            &row_sum,
            &accum,
        ];
        if let (Some(rng), true) = (rng, spec.dropout > 0.0) {
            memory.push((uid::SEED, rng.seed.device_ptr()));
            memory.push((uid::OFFSET, rng.offset.device_ptr()));
            used.extend([rng.seed, rng.offset]);
        }
        for buffer in used {
            buffer.record_stream(stream);
        }
        self.bind()?;
        let name = || format!("cudnn sdpa backward {spec:?}").into();
        // SAFETY: as in the forward call; the two scratch buffers have the extents of the
        // graph's ROW_SUM and DQ_ACCUM tensors (dense f32 [B, H, T, 1] and [B, H, T, D]).
        profiled(self, stream, name, || unsafe {
            plan.execute(handle, &memory, workspace.device_ptr())
        })
    }
}
