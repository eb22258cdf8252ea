//! Attention on CUDA through cuDNN's fused scaled-dot-product attention (ferry-cuda's
//! `Attention` library trait): bf16 and f16, head dims cuDNN takes, no dropout, the value width
//! equal to the head dim. Anything else, a machine without cuDNN (or too old a one), or
//! `FERRY_CUDNN_ATTENTION=0` answers `None`, and the op composes the same node from matrix
//! products and a softmax. cuDNN's statistics are the op's log-sum-exp (f32, natural log of the
//! scaled scores), so either backward runs after either forward.

use std::sync::OnceLock;

use ferry_cuda::{
    Attention as CudnnAttention, Causal, CudaLibError, SdpaBackward, SdpaForward, SdpaInput,
    SdpaOutput, SdpaSpec, cudnn_present,
};
use ferry_memory::DType;
use ferry_memory::cuda::{CudaDevice, DeviceBuffer};

use super::{Cuda, alloc, buffer, cuda_device, dense, wrap};
use crate::Result;
use crate::kernel::{Attention, Dense, Operand, Source, View};
use crate::op::attention::Attend;
use crate::storage::{Buffer, Storage};

/// Whether the fused path is on: libcudnn loads and `FERRY_CUDNN_ATTENTION` is not `0` (set it
/// to compare with the composed path).
fn enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| {
        std::env::var("FERRY_CUDNN_ATTENTION").map_or(true, |v| v != "0") && cudnn_present()
    })
}

/// cuDNN's description of the call, when the fused path may take it.
fn spec(how: &Attend, dtype: DType) -> Option<SdpaSpec> {
    let d = how.dims;
    let fits = enabled()
        && how.dropout == 0.0
        && d.v_dim == d.dim
        && matches!(dtype, DType::BF16 | DType::F16);
    let spec = SdpaSpec {
        batch: d.batch,
        heads: d.heads,
        kv_heads: d.kv_heads,
        q_len: d.q_len,
        kv_len: d.kv_len,
        head_dim: d.dim,
        dtype,
        // The op's queries are the last positions of the keys' sequence.
        causal: if how.causal {
            Causal::BottomRight
        } else {
            Causal::None
        },
        scale: how.scale as f32,
        dropout: 0.0,
    };
    (fits && spec.supported().is_ok()).then_some(spec)
}

/// The dims of q (and the output), of k and v, and of the statistics.
fn dims(how: &Attend) -> [[usize; 4]; 3] {
    let d = how.dims;
    [
        [d.batch, d.heads, d.q_len, d.dim],
        [d.batch, d.kv_heads, d.kv_len, d.dim],
        [d.batch, d.heads, d.q_len, 1],
    ]
}

/// Row-major strides of a dense `[a, b, c, d]`.
fn strides([_, b, c, d]: [usize; 4]) -> [usize; 4] {
    [b * c * d, c * d, d, 1]
}

/// An operand as cuDNN reads it, in place where it can: any strides whose last axis is
/// contiguous and whose others step whole 16-byte groups from a 16-byte aligned start (the
/// layouts cuDNN's kernels take; a head split out of a fused `[B, T, 3C]` projection and
/// permuted to `[B, H, T, D]` is one). Anything else (a broadcast axis, an odd offset) is copied
/// to a dense operand first.
fn readable<'a>(x: &Operand<'a>) -> Result<Source<'a>> {
    const ALIGN: usize = 16;
    let size = x.dtype().size();
    let (shape, strides) = (x.shape(), x.layout().strides());
    let in_place = shape.len() == 4
        && (strides[3] == 1 || shape[3] == 1)
        && (x.layout().offset() * size).is_multiple_of(ALIGN)
        && shape[..3]
            .iter()
            .zip(strides)
            .all(|(&d, &s)| d == 1 || (s > 0 && (s * size).is_multiple_of(ALIGN)));
    match in_place {
        true => Ok(Source::InPlace(*x)),
        false => dense(x),
    }
}

/// An operand (from [`readable`] or [`dense`]) as cuDNN reads it: its own offset and strides
/// over `dims` (a dense copy's are row-major).
fn input<'a>(buffer: &'a DeviceBuffer, x: &Source<'_>, dims: [usize; 4]) -> SdpaInput<'a> {
    let (own, dense) = (x.layout().strides(), strides(dims));
    let strides = match own.len() == 4 {
        // An axis of one element may carry any stride: cuDNN is given the dense one.
        true => std::array::from_fn(|i| if dims[i] == 1 { dense[i] } else { own[i] }),
        false => dense,
    };
    SdpaInput {
        buffer,
        offset_bytes: x.layout().offset() * x.dtype().size(),
        strides,
    }
}

/// A fresh `[B, H, T, D]` output as cuDNN writes it: row-major, or with `heads_inside`, in
/// `[B, T, H, D]` order, the order a model merges the heads back in (`permute(0, 2, 1, 3)` then
/// `reshape(B, T, H·D)` is then a view, not a copy) and the one a projection split into heads
/// arrives in.
fn output(buffer: &mut DeviceBuffer, dims: [usize; 4], heads_inside: bool) -> SdpaOutput<'_> {
    let [b, h, t, d] = dims;
    let strides = match heads_inside {
        true => {
            let [sb, st, sh, sd] = strides([b, t, h, d]);
            [sb, sh, st, sd]
        }
        false => strides(dims),
    };
    SdpaOutput {
        buffer,
        offset_bytes: 0,
        strides,
    }
}

/// The tensor of an [`output`] buffer ([`Dense::swapped_1_2`] for one written heads inside).
fn wrap_output(
    dev: &CudaDevice,
    out: DeviceBuffer,
    dtype: DType,
    dims: [usize; 4],
    heads_inside: bool,
) -> Dense {
    match heads_inside {
        true => Dense::swapped_1_2(Storage::new(Buffer::Cuda(out), dtype, dev.device()), dims),
        false => wrap(dev, out, dtype, &dims),
    }
}

/// Whether `x` (`[B, H, T, D]`) is stored with its heads inside its positions (`[B, T, H, D]`
/// order): its gradient is then written in that order too, so every gradient has its input's
/// layout and the ops behind it (the permute and reshape that split the heads) take it as a view.
fn heads_inside(x: &impl View) -> bool {
    let (shape, strides) = (x.layout().shape(), x.layout().strides());
    shape.len() == 4 && shape[1] > 1 && shape[2] > 1 && strides[1] < strides[2]
}

/// `None` for what cuDNN cannot run (the op composes instead); other errors stand.
fn unsupported_is_none<T>(result: std::result::Result<T, CudaLibError>) -> Result<Option<T>> {
    match result {
        Ok(value) => Ok(Some(value)),
        Err(CudaLibError::AttentionUnsupported { .. } | CudaLibError::NoCudnn { .. }) => Ok(None),
        Err(err) => Err(err.into()),
    }
}

impl Attention for Cuda {
    fn attention(
        &self,
        q: &Operand<'_>,
        k: &Operand<'_>,
        v: &Operand<'_>,
        how: &Attend,
    ) -> Result<Option<(Dense, Dense)>> {
        const OP: &str = "scaled_dot_product_attention";
        let Some(spec) = spec(how, q.dtype()) else {
            return Ok(None);
        };
        let [q_dims, kv_dims, stats_dims] = dims(how);
        let dev = cuda_device(q.device())?;
        let (q, k, v) = (readable(q)?, readable(k)?, readable(v)?);
        let mut out = alloc(&dev, OP, &q_dims, q.dtype())?;
        let mut stats = alloc(&dev, OP, &stats_dims, DType::F32)?;
        let (qb, kb, vb) = (buffer(&q)?, buffer(&k)?, buffer(&v)?);
        let io = SdpaForward {
            q: input(&qb, &q, q_dims),
            k: input(&kb, &k, kv_dims),
            v: input(&vb, &v, kv_dims),
            o: output(&mut out, q_dims, true),
            stats: output(&mut stats, stats_dims, false),
            rng: None,
        };
        let ran = unsupported_is_none(dev.sdpa_forward(&spec, io, dev.default_stream()))?;
        drop((qb, kb, vb));
        Ok(ran.map(|()| {
            (
                wrap_output(&dev, out, q.dtype(), q_dims, true),
                wrap(&dev, stats, DType::F32, &stats_dims[..3]),
            )
        }))
    }

    fn attention_backward(
        &self,
        q: &Operand<'_>,
        k: &Operand<'_>,
        v: &Operand<'_>,
        out: &Operand<'_>,
        g: &Operand<'_>,
        lse: &Operand<'_>,
        how: &Attend,
    ) -> Result<Option<[Dense; 3]>> {
        const OP: &str = "scaled_dot_product_attention backward";
        let Some(spec) = spec(how, q.dtype()) else {
            return Ok(None);
        };
        if lse.dtype() != DType::F32 {
            return Ok(None);
        }
        let [q_dims, kv_dims, stats_dims] = dims(how);
        let dev = cuda_device(q.device())?;
        let (q, k, v) = (readable(q)?, readable(k)?, readable(v)?);
        let (out, g, lse) = (readable(out)?, readable(g)?, dense(lse)?);
        let inside = [heads_inside(&q), heads_inside(&k), heads_inside(&v)];
        let dtype = q.dtype();
        let mut dq = alloc(&dev, OP, &q_dims, dtype)?;
        let mut dk = alloc(&dev, OP, &kv_dims, dtype)?;
        let mut dv = alloc(&dev, OP, &kv_dims, dtype)?;
        let (qb, kb, vb) = (buffer(&q)?, buffer(&k)?, buffer(&v)?);
        let (ob, gb, lb) = (buffer(&out)?, buffer(&g)?, buffer(&lse)?);
        let io = SdpaBackward {
            q: input(&qb, &q, q_dims),
            k: input(&kb, &k, kv_dims),
            v: input(&vb, &v, kv_dims),
            o: input(&ob, &out, q_dims),
            d_o: input(&gb, &g, q_dims),
            stats: input(&lb, &lse, stats_dims),
            dq: output(&mut dq, q_dims, inside[0]),
            dk: output(&mut dk, kv_dims, inside[1]),
            dv: output(&mut dv, kv_dims, inside[2]),
            rng: None,
        };
        let ran = unsupported_is_none(dev.sdpa_backward(&spec, io, dev.default_stream()))?;
        drop((qb, kb, vb, ob, gb, lb));
        Ok(ran.map(|()| {
            [
                wrap_output(&dev, dq, dtype, q_dims, inside[0]),
                wrap_output(&dev, dk, dtype, kv_dims, inside[1]),
                wrap_output(&dev, dv, dtype, kv_dims, inside[2]),
            ]
        }))
    }
}
