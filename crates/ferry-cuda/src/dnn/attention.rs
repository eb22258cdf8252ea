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
//! cuDNN 9.0 or newer runs the composite graph, and cudnn-frontend builds it for the backward
//! pass on every version. cuDNN 9.13.1 added a single-node
//! `CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR`, which cudnn-frontend's automatic choice
//! prefers for the forward pass where its support checks pass (no mask or dropout before 9.21,
//! causal masks from 9.21, dropout from 9.22); cudarc's cuDNN 9.21 bindings also name an
//! `SDPA_BWD` descriptor that cudnn-frontend does not build. Neither is used here: the
//! composite graph covers every cuDNN 9 and every option ferry needs.
//!
//! # What falls back
//! Without libcudnn the calls return [`CudaLibError::NoCudnn`]. They return
//! [`CudaLibError::AttentionUnsupported`], saying why, so the caller runs the composed
//! attention (matmul, softmax, matmul), for a cuDNN older than 9.0, dtypes other than f16 and
//! bf16, head dims that are not a multiple of 8 up to 128, operands whose head dim is not
//! contiguous or whose address is not 16-byte aligned, what cudnn-frontend's support checks
//! list against the loaded version and GPU (cuDNN 9.10.0 and 9.10.1, a bottom-right mask with
//! more queries than keys or with dropout, compute capability below 8.0, ...), and a graph no
//! cuDNN engine runs. Arguments wrong in themselves (head counts that do not divide, an operand
//! outside its buffer) are [`CudaLibError::AttentionArgument`].

use ferry_memory::DType;
use ferry_memory::cuda::{CudaDevice, DeviceBuffer, Stream};

use crate::CudaLibError;
use crate::sealed::Sealed;

mod checks;
mod graph;
mod run;
#[cfg(test)]
mod tests;

pub use checks::SDPA_MAX_HEAD_DIM;
use run::{Operands, Pass, Strides, ready, run};

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

impl SdpaOutput<'_> {
    /// The same operand, read-only (to check it and take its address).
    fn view(&self) -> SdpaInput<'_> {
        SdpaInput {
            buffer: self.buffer,
            offset_bytes: self.offset_bytes,
            strides: self.strides,
        }
    }
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

impl Attention for CudaDevice {
    fn sdpa_forward(
        &self,
        spec: &SdpaSpec,
        io: SdpaForward<'_>,
        stream: &Stream,
    ) -> Result<(), CudaLibError> {
        let version = ready(self, spec)?;
        let SdpaForward {
            q,
            k,
            v,
            o,
            stats,
            rng,
        } = io;
        let mut operands = Operands::new(spec);
        operands.add(uid::Q, "q", q)?;
        operands.add(uid::K, "k", k)?;
        operands.add(uid::V, "v", v)?;
        operands.add(uid::O, "o", o.view())?;
        operands.add(uid::STATS, "stats", stats.view())?;
        operands.finish(self, "sdpa_forward", rng, stream)?;
        if spec.is_empty() {
            return Ok(());
        }
        run(self, spec, Pass::Forward, version, operands, stream)
    }

    fn sdpa_backward(
        &self,
        spec: &SdpaSpec,
        io: SdpaBackward<'_>,
        stream: &Stream,
    ) -> Result<(), CudaLibError> {
        let version = ready(self, spec)?;
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
        let mut operands = Operands::new(spec);
        for (id, name, x) in [
            (uid::Q, "q", q),
            (uid::K, "k", k),
            (uid::V, "v", v),
            (uid::O, "o", o),
            (uid::D_O, "d_o", d_o),
            (uid::STATS, "stats", stats),
            (uid::DQ, "dq", dq.view()),
            (uid::DK, "dk", dk.view()),
            (uid::DV, "dv", dv.view()),
        ] {
            operands.add(id, name, x)?;
        }
        operands.finish(self, "sdpa_backward", rng, stream)?;
        if spec.is_empty() {
            if spec.batch == 0 || spec.kv_len == 0 {
                return Ok(());
            }
            // dK and dV are zeros, but they may be views of larger buffers: the composed
            // path writes them.
            return Err(CudaLibError::AttentionUnsupported {
                reason: "there are no query rows, so dK and dV are zeros".to_string(),
            });
        }
        run(self, spec, Pass::Backward, version, operands, stream)
    }
}
