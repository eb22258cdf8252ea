//! The operation graphs of fused attention, the composite form cudnn-frontend builds for its
//! `sdpa` and `sdpa_backward` nodes: matmuls, pointwise operations, reductions, index
//! generation, a Bernoulli RNG and reshapes, which cuDNN's flash-attention engine fuses into one
//! kernel. Only the operands, the statistics and two f32 scratch tensors of the backward pass
//! live in memory; every score-sized tensor is virtual.

use cudarc::cudnn::sys::{
    cudnnDataType_t as Dt, cudnnPointwiseMode_t as Pw, cudnnReduceTensorOp_t as Reduce,
};

use super::super::backend::{Graph, Tensor, dense};
use super::{Causal, SdpaSpec, Strides, uid};
use crate::CudaLibError;

const F32: Dt = Dt::CUDNN_DATA_FLOAT;

/// Uids of virtual tensors start here, above every named one.
const FIRST_VIRTUAL: i64 = 100;

/// The cuDNN type of the attention operands.
pub(super) fn io_type(spec: &SdpaSpec) -> Dt {
    match spec.dtype {
        ferry_memory::DType::F16 => Dt::CUDNN_DATA_HALF,
        _ => Dt::CUDNN_DATA_BFLOAT16,
    }
}

fn swap_last(a: [i64; 4]) -> [i64; 4] {
    [a[0], a[1], a[3], a[2]]
}

/// A graph being built with the spec's extents at hand.
struct Builder<'a> {
    g: Graph,
    spec: &'a SdpaSpec,
    io: Dt,
    /// `[B, H, T, S]`, the scores' extents.
    scores: [i64; 4],
    /// `[B, H, T, 1]`, one value per query row.
    rows: [i64; 4],
    scale: Option<Tensor>,
    dropout_scale: Option<Tensor>,
}

impl<'a> Builder<'a> {
    fn new(spec: &'a SdpaSpec) -> Self {
        let [b, h, t, s] = [spec.batch, spec.heads, spec.q_len, spec.kv_len].map(|n| n as i64);
        Self {
            g: Graph::new(FIRST_VIRTUAL),
            spec,
            io: io_type(spec),
            scores: [b, h, t, s],
            rows: [b, h, t, 1],
            scale: None,
            dropout_scale: None,
        }
    }

    fn dims(&self, heads: usize, len: usize) -> [i64; 4] {
        let s = self.spec;
        [s.batch, heads, len, s.head_dim].map(|n| n as i64)
    }

    /// Operand `id` in memory, `[B, heads, len, D]` in the operands' type, or seen transposed
    /// (`[B, heads, D, len]`, its last two strides swapped) as a matmul's right side.
    fn operand(
        &mut self,
        id: i64,
        (heads, len): (usize, usize),
        strides: [i64; 4],
        transposed: bool,
    ) -> Result<Tensor, CudaLibError> {
        let dims = self.dims(heads, len);
        if transposed {
            self.g
                .memory(id, self.io, swap_last(dims), swap_last(strides))
        } else {
            self.g.memory(id, self.io, dims, strides)
        }
    }

    fn virt(&mut self, dtype: Dt, dims: [i64; 4]) -> Result<Tensor, CudaLibError> {
        self.g.virtual_tensor(dtype, dims, dense(dims))
    }

    /// `mode(x, b)` into a new f32 virtual tensor of the broadcast extents.
    fn binary(&mut self, mode: Pw, x: Tensor, b: Tensor) -> Result<Tensor, CudaLibError> {
        let dims = std::array::from_fn(|i| x.dims[i].max(b.dims[i]));
        let strides = if x.dims == dims {
            x.strides
        } else {
            dense(dims)
        };
        let y = self.g.virtual_tensor(F32, dims, strides)?;
        self.g.pointwise(mode, F32, (x, Some(b), None), y, None)?;
        Ok(y)
    }

    fn unary(&mut self, mode: Pw, x: Tensor) -> Result<Tensor, CudaLibError> {
        let y = self.g.virtual_tensor(F32, x.dims, x.strides)?;
        self.g.pointwise(mode, F32, (x, None, None), y, None)?;
        Ok(y)
    }

    /// `mode(x[, b])` into `y`, computed in f32.
    fn write(
        &mut self,
        mode: Pw,
        x: Tensor,
        b: Option<Tensor>,
        y: Tensor,
    ) -> Result<(), CudaLibError> {
        self.g.pointwise(mode, F32, (x, b, None), y, None)
    }

    /// `Q Kᵀ · scale` in f32, from Q and Kᵀ (K's memory seen with its last two axes swapped).
    fn scaled_scores(&mut self, q: Tensor, kt: Tensor) -> Result<Tensor, CudaLibError> {
        let scores = self.virt(F32, self.scores)?;
        self.g.matmul(q, kt, scores)?;
        let scale = self.scale()?;
        self.binary(Pw::CUDNN_POINTWISE_MUL, scores, scale)
    }

    fn reduce(&mut self, op: Reduce, x: Tensor, dims: [i64; 4]) -> Result<Tensor, CudaLibError> {
        let y = self.virt(F32, dims)?;
        self.g.reduction(op, x, y)?;
        Ok(y)
    }

    fn scale(&mut self) -> Result<Tensor, CudaLibError> {
        if self.scale.is_none() {
            self.scale = Some(self.g.scalar_f32(uid::SCALE, self.spec.scale)?);
        }
        Ok(self.scale.expect("set above"))
    }

    fn dropout_scale(&mut self) -> Result<Tensor, CudaLibError> {
        if self.dropout_scale.is_none() {
            let value = 1.0 / (1.0 - self.spec.dropout);
            self.dropout_scale = Some(self.g.scalar_f32(uid::DROPOUT_SCALE, value)?);
        }
        Ok(self.dropout_scale.expect("set above"))
    }

    /// The keep-mask of dropout over the scores, from the device seed and offset.
    fn dropout_mask(&mut self) -> Result<Tensor, CudaLibError> {
        let one = [1; 4];
        let seed = self.g.memory(uid::SEED, Dt::CUDNN_DATA_INT64, one, one)?;
        let offset = self.g.memory(uid::OFFSET, Dt::CUDNN_DATA_INT64, one, one)?;
        let mask = self.virt(F32, self.scores)?;
        let keep = 1.0 - f64::from(self.spec.dropout);
        self.g.bernoulli(keep, seed, offset, mask)?;
        Ok(mask)
    }

    /// `x` with the entries above the causal diagonal set to `neg_inf`: query row `i` keeps key
    /// column `j` where `i >= j` (top-left), or `i + S - T >= j` (bottom-right).
    fn causal(&mut self, x: Tensor, neg_inf: f32) -> Result<Tensor, CudaLibError> {
        if self.spec.causal == Causal::None {
            return Ok(x);
        }
        let int = Dt::CUDNN_DATA_INT32;
        let mut row = self.g.virtual_tensor(int, x.dims, x.strides)?;
        let gen_index = Pw::CUDNN_POINTWISE_GEN_INDEX;
        self.g
            .pointwise(gen_index, F32, (x, None, None), row, Some(2))?;
        let col = self.g.virtual_tensor(int, x.dims, x.strides)?;
        self.g
            .pointwise(gen_index, F32, (x, None, None), col, Some(3))?;
        let (t, s) = (self.spec.q_len, self.spec.kv_len);
        if self.spec.causal == Causal::BottomRight && t != s {
            // row + S - T, in two integer steps as cudnn-frontend writes it.
            for (id, len, mode) in [
                (uid::KV_LEN, s, Pw::CUDNN_POINTWISE_ADD),
                (uid::Q_LEN, t, Pw::CUDNN_POINTWISE_SUB),
            ] {
                let len = self.g.scalar_i32(id, len as i32)?;
                let shifted = self.g.virtual_tensor(int, x.dims, x.strides)?;
                self.g
                    .pointwise(mode, int, (row, Some(len), None), shifted, None)?;
                row = shifted;
            }
        }
        let keep = self
            .g
            .virtual_tensor(Dt::CUDNN_DATA_BOOLEAN, x.dims, x.strides)?;
        self.g.pointwise(
            Pw::CUDNN_POINTWISE_CMP_GE,
            Dt::CUDNN_DATA_BOOLEAN,
            (row, Some(col), None),
            keep,
            None,
        )?;
        let fill = self.g.scalar_f32(uid::NEG_INF, neg_inf)?;
        let y = self.g.virtual_tensor(F32, x.dims, x.strides)?;
        self.g.pointwise(
            Pw::CUDNN_POINTWISE_BINARY_SELECT,
            F32,
            (x, Some(fill), Some(keep)),
            y,
            None,
        )?;
        Ok(y)
    }

    /// `out = a · b`, summed over the query heads of each key/value head when there are fewer
    /// of those (`full` is the per-query-head product's extents).
    fn grad(
        &mut self,
        a: Tensor,
        b: Tensor,
        out: Tensor,
        full: [i64; 4],
    ) -> Result<(), CudaLibError> {
        if out.dims == full {
            return self.g.matmul(a, b, out);
        }
        let per_head = self.virt(self.io, full)?;
        self.g.matmul(a, b, per_head)?;
        self.g
            .reduction(Reduce::CUDNN_REDUCE_TENSOR_ADD, per_head, out)
    }
}

/// `O = softmax(Q Kᵀ · scale [masked]) V` with dropout on the probabilities, and
/// `stats = max + log(sum(exp(x - max)))` per query row.
pub(super) fn forward(
    spec: &SdpaSpec,
    strides: &Strides,
    neg_inf: f32,
) -> Result<Graph, CudaLibError> {
    let mut b = Builder::new(spec);
    let io = b.io;
    let (rows, kv) = ((spec.heads, spec.q_len), (spec.kv_heads, spec.kv_len));
    let q = b.operand(uid::Q, rows, strides.q, false)?;
    let kt = b.operand(uid::K, kv, strides.k, true)?;
    let v = b.operand(uid::V, kv, strides.v, false)?;
    let o = b.operand(uid::O, rows, strides.o, false)?;
    let stats = b.g.memory(uid::STATS, F32, b.rows, strides.stats)?;

    let x = b.scaled_scores(q, kt)?;
    let x = b.causal(x, neg_inf)?;
    let max = b.reduce(Reduce::CUDNN_REDUCE_TENSOR_MAX, x, b.rows)?;
    let x = b.binary(Pw::CUDNN_POINTWISE_SUB, x, max)?;
    let e = b.unary(Pw::CUDNN_POINTWISE_EXP, x)?;
    let sum = b.reduce(Reduce::CUDNN_REDUCE_TENSOR_ADD, e, b.rows)?;
    let log = b.unary(Pw::CUDNN_POINTWISE_LOG, sum)?;
    b.write(Pw::CUDNN_POINTWISE_ADD, max, Some(log), stats)?;

    // The probabilities reach the second matmul in the operands' type, as cuDNN requires.
    let p = b.virt(io, b.scores)?;
    if spec.dropout > 0.0 {
        let probs = b.binary(Pw::CUDNN_POINTWISE_DIV, e, sum)?;
        let mask = b.dropout_mask()?;
        let kept = b.binary(Pw::CUDNN_POINTWISE_MUL, probs, mask)?;
        let rescale = b.dropout_scale()?;
        b.write(Pw::CUDNN_POINTWISE_MUL, kept, Some(rescale), p)?;
    } else {
        b.write(Pw::CUDNN_POINTWISE_DIV, e, Some(sum), p)?;
    }
    b.g.matmul(p, v, o)?;
    Ok(b.g)
}

/// dV = Pᵀ dO, dS = P ∘ (dP − rowsum(dO ∘ O)) · scale with dP = dO Vᵀ, dK = dSᵀ Q, dQ = dS K;
/// P is recomputed from the statistics (`exp(x − stats)`), dropout's mask redrawn from the
/// same seed and offset.
pub(super) fn backward(
    spec: &SdpaSpec,
    strides: &Strides,
    neg_inf: f32,
) -> Result<Graph, CudaLibError> {
    let mut b = Builder::new(spec);
    let io = b.io;
    let (rows, kv) = ((spec.heads, spec.q_len), (spec.kv_heads, spec.kv_len));
    let (q_dims, kv_dims) = (b.dims(rows.0, rows.1), b.dims(kv.0, kv.1));
    let q = b.operand(uid::Q, rows, strides.q, false)?;
    let kt = b.operand(uid::K, kv, strides.k, true)?;
    let vt = b.operand(uid::V, kv, strides.v, true)?;
    let o = b.operand(uid::O, rows, strides.o, false)?;
    let d_o = b.operand(uid::D_O, rows, strides.d_o, false)?;
    let stats = b.g.memory(uid::STATS, F32, b.rows, strides.stats)?;
    let dq = b.operand(uid::DQ, rows, strides.dq, false)?;
    let dk = b.operand(uid::DK, kv, strides.dk, false)?;
    let dv = b.operand(uid::DV, kv, strides.dv, false)?;

    // rowsum(dO ∘ O), scaled by the keep probability, into f32 scratch memory.
    let product = b.virt(F32, q_dims)?;
    b.write(Pw::CUDNN_POINTWISE_MUL, d_o, Some(o), product)?;
    let rowsum = b.reduce(Reduce::CUDNN_REDUCE_TENSOR_ADD, product, b.rows)?;
    let row_sum = b.g.memory(uid::ROW_SUM, F32, b.rows, dense(b.rows))?;
    let keep = b.g.scalar_f32(uid::KEEP, 1.0 - spec.dropout)?;
    b.write(Pw::CUDNN_POINTWISE_MUL, rowsum, Some(keep), row_sum)?;

    let x = b.scaled_scores(q, kt)?;
    let x = b.binary(Pw::CUDNN_POINTWISE_SUB, x, stats)?;
    let x = b.causal(x, neg_inf)?;
    let p = b.unary(Pw::CUDNN_POINTWISE_EXP, x)?;

    let mask = if spec.dropout > 0.0 {
        Some(b.dropout_mask()?)
    } else {
        None
    };
    let p_dropped = match mask {
        Some(mask) => {
            let kept = b.binary(Pw::CUDNN_POINTWISE_MUL, p, mask)?;
            let rescale = b.dropout_scale()?;
            b.binary(Pw::CUDNN_POINTWISE_MUL, kept, rescale)?
        }
        None => p,
    };
    let [bb, h, t, s] = b.scores;
    let transposed = [bb, h, s, t];
    let transposed_strides = [h * t * s, t * s, 1, s];
    let pt = b.g.virtual_tensor(io, transposed, transposed_strides)?;
    b.g.reshape(p_dropped, pt)?;
    let full_kv = b.dims(spec.heads, spec.kv_len);
    b.grad(pt, d_o, dv, full_kv)?;

    let dp = b.virt(F32, b.scores)?;
    b.g.matmul(d_o, vt, dp)?;
    let dp = match mask {
        Some(mask) => b.binary(Pw::CUDNN_POINTWISE_MUL, dp, mask)?,
        None => dp,
    };
    let ds = b.binary(Pw::CUDNN_POINTWISE_SUB, dp, row_sum)?;
    let ds = b.binary(Pw::CUDNN_POINTWISE_MUL, ds, p)?;
    let ds = if mask.is_some() {
        let rescale = b.dropout_scale()?;
        b.binary(Pw::CUDNN_POINTWISE_MUL, ds, rescale)?
    } else {
        ds
    };
    let scale = b.scale()?;
    let ds = b.binary(Pw::CUDNN_POINTWISE_MUL, ds, scale)?;
    let dst = b.g.virtual_tensor(io, transposed, transposed_strides)?;
    b.g.reshape(ds, dst)?;
    b.grad(dst, q, dk, full_kv)?;

    // dQ accumulates in f32 scratch memory, then is converted into dq.
    let k = b.g.virtual_tensor(F32, kv_dims, strides.k)?;
    b.g.reshape(kt, k)?;
    let accum = b.g.memory(uid::DQ_ACCUM, F32, q_dims, dense(q_dims))?;
    b.g.matmul(ds, k, accum)?;
    b.write(Pw::CUDNN_POINTWISE_IDENTITY, accum, None, dq)?;
    Ok(b.g)
}
