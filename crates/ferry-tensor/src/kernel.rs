//! The interface every device's kernels implement, below the tensor type: what a kernel reads
//! (`Operand`: borrowed storage seen through a layout), what it makes (`Dense`: fresh
//! contiguous storage with its shape) and what a device offers (`Backend`: a trait per op
//! family, one method per primitive and per fused path). Kernels know nothing of tensors or
//! autograd; `backend` turns tensors into operands, picks the device's implementation and
//! wraps what it returns.

use ferry_cuda::ConvPass;
use ferry_memory::{DType, Device};

use crate::Result;
use crate::layout::Layout;
use crate::op::attention::Attend;
use crate::op::conv::Geometry;
use crate::op::{AdamStep, BinaryOp, CmpOp, ReduceOp, UnaryOp};
use crate::storage::Storage;

/// What kernels read of an input or an output: storage seen through a layout, and what follows
/// from the two.
pub(crate) trait View {
    /// The bytes.
    fn storage(&self) -> &Storage;
    /// Shape, strides and offset into `View::storage`.
    fn layout(&self) -> &Layout;

    fn shape(&self) -> &[usize] {
        self.layout().shape()
    }
    fn ndim(&self) -> usize {
        self.layout().ndim()
    }
    fn numel(&self) -> usize {
        self.layout().numel()
    }
    fn dtype(&self) -> DType {
        self.storage().dtype()
    }
    fn device(&self) -> Device {
        self.storage().device()
    }
    fn is_contiguous(&self) -> bool {
        self.layout().is_contiguous()
    }
    /// Bytes the elements take (not the storage's).
    fn nbytes(&self) -> usize {
        self.numel() * self.dtype().size()
    }
    /// The same elements as an operand of another kernel.
    fn operand(&self) -> Operand<'_> {
        Operand::new(self.storage(), self.layout())
    }
}

/// A kernel's input: storage it borrows, seen through a layout that fits it (a tensor's own,
/// or one broadcast to an op's output shape).
#[derive(Clone, Copy)]
pub(crate) struct Operand<'a> {
    storage: &'a Storage,
    layout: &'a Layout,
}

impl<'a> Operand<'a> {
    /// `storage` seen through `layout`, which must fit it: kernels trust it.
    pub(crate) fn new(storage: &'a Storage, layout: &'a Layout) -> Self {
        Self { storage, layout }
    }
}

impl View for Operand<'_> {
    fn storage(&self) -> &Storage {
        self.storage
    }
    fn layout(&self) -> &Layout {
        self.layout
    }
}

/// A kernel's output: fresh storage holding a dense array of its shape from offset 0, in
/// row-major order (or, from [`Dense::swapped_1_2`], with its axes 1 and 2 stored swapped).
pub(crate) struct Dense {
    storage: Storage,
    layout: Layout,
}

impl Dense {
    /// `storage`, just allocated for `shape` (its size came from `layout::shape_bytes`, so the
    /// contiguous layout fits by construction).
    pub(crate) fn new(storage: Storage, shape: &[usize]) -> Self {
        let layout = Layout::contiguous(shape);
        debug_assert!(
            layout
                .check_fits("dense output", storage.dtype(), storage.bytes())
                .is_ok()
        );
        Self { storage, layout }
    }

    /// `storage`, just allocated for a `[a, b, c, d]` array stored as `[a, c, b, d]` (written so
    /// by a kernel, as attention writes `[B, H, T, D]` in the `[B, T, H, D]` order that the
    /// heads are merged back in): the tensor is `[a, b, c, d]` with axes 1 and 2's strides
    /// swapped, a dense permuted view.
    pub(crate) fn swapped_1_2(storage: Storage, [a, b, c, d]: [usize; 4]) -> Self {
        let stored = Layout::contiguous(&[a, c, b, d]);
        let s = stored.strides();
        let layout = Layout::from_parts(
            [a, b, c, d].as_slice().into(),
            [s[0], s[2], s[1], s[3]].as_slice().into(),
            0,
        );
        debug_assert!(
            layout
                .check_fits("dense output", storage.dtype(), storage.bytes())
                .is_ok()
        );
        Self { storage, layout }
    }

    /// The storage and its layout.
    pub(crate) fn into_parts(self) -> (Storage, Layout) {
        (self.storage, self.layout)
    }
}

impl View for Dense {
    fn storage(&self) -> &Storage {
        &self.storage
    }
    fn layout(&self) -> &Layout {
        &self.layout
    }
}

/// The elements a kernel reads: an operand in place, or a copy made for the kernel (where it
/// needs them contiguous, say).
pub(crate) enum Source<'a> {
    /// The operand as given.
    InPlace(Operand<'a>),
    /// A fresh copy.
    Copy(Dense),
}

impl View for Source<'_> {
    fn storage(&self) -> &Storage {
        match self {
            Source::InPlace(x) => x.storage,
            Source::Copy(d) => &d.storage,
        }
    }
    fn layout(&self) -> &Layout {
        match self {
            Source::InPlace(x) => x.layout,
            Source::Copy(d) => &d.layout,
        }
    }
}

/// The kernels of one device: every family's trait below, one method per primitive and per
/// fused path, each family implemented for the device's unit struct in that device's file of
/// the family (`cpu/reduce.rs` holds `impl Reduce for Cpu`). Operands share the device (and,
/// where the op says so, the dtype): ops above check that before calling.
///
/// Fused paths have a default that answers `Ok(None)`: a device without the kernel or library
/// says nothing, and the op or rule composes the same result from primitives.
pub(crate) trait Backend:
    Elementwise
    + Reduce
    + Matmul
    + Copies
    + Create
    + Indexing
    + Select
    + Norm
    + Conv
    + Optim
    + Attention
    + Loss
    + Sync
{
}

impl<D> Backend for D where
    D: Elementwise
        + Reduce
        + Matmul
        + Copies
        + Create
        + Indexing
        + Select
        + Norm
        + Conv
        + Optim
        + Attention
        + Loss
        + Sync
{
}

/// Unary maps, broadcast binary ops, comparisons and casts.
pub(crate) trait Elementwise {
    /// `op` applied to every element.
    fn unary(&self, x: &Operand<'_>, op: UnaryOp) -> Result<Dense>;
    /// `op` elementwise over two operands whose layouts are broadcast to the output's shape.
    fn binary(&self, a: &Operand<'_>, b: &Operand<'_>, op: BinaryOp) -> Result<Dense>;
    /// `op` as 1 or 0 (`u8`), elementwise over layouts broadcast to the output's shape.
    fn compare(&self, a: &Operand<'_>, b: &Operand<'_>, op: CmpOp) -> Result<Dense>;
    /// Every element converted to `dtype`.
    fn cast(&self, x: &Operand<'_>, dtype: DType) -> Result<Dense>;
    /// The rotary position embedding over the last axis of `x` (even length), `x * cos +
    /// rotate_half(x) * sin` with `rotate_half(x) = [-x2, x1]`, or with `inverse` its transpose
    /// (the gradient's map), in one pass; `cos` and `sin` have one layout, broadcast to `x`'s
    /// shape, and `x`'s dtype. `None` where the device composes it.
    fn rotary(
        &self,
        _x: &Operand<'_>,
        _cos: &Operand<'_>,
        _sin: &Operand<'_>,
        _inverse: bool,
    ) -> Result<Option<Dense>> {
        Ok(None)
    }
}

/// Reductions, softmax and the cross-entropy loss's last step, with their gradients.
pub(crate) trait Reduce {
    /// `axis` reduced away.
    fn reduce(&self, x: &Operand<'_>, axis: usize, op: ReduceOp) -> Result<Dense>;
    /// The sum of every element, 0-d.
    fn sum_all(&self, x: &Operand<'_>) -> Result<Dense>;
    /// Softmax (or log-softmax) over the last axis.
    fn softmax(&self, x: &Operand<'_>, log: bool) -> Result<Dense>;
    /// `-mean(logp[i, targets[i]])` of `[rows, classes]` log-probabilities.
    fn nll(&self, logp: &Operand<'_>, targets: &Operand<'_>) -> Result<Dense>;
    /// Fused: softmax's (or log-softmax's) gradient over the last axis from its output `y`,
    /// in one pass.
    fn softmax_backward(
        &self,
        _y: &Operand<'_>,
        _g: &Operand<'_>,
        _log: bool,
    ) -> Result<Option<Dense>> {
        Ok(None)
    }
    /// Fused: nll's gradient with respect to `[rows, classes]` log-probabilities, from the 0-d
    /// `g`.
    fn nll_backward(
        &self,
        _targets: &Operand<'_>,
        _g: &Operand<'_>,
        _classes: usize,
    ) -> Result<Option<Dense>> {
        Ok(None)
    }
}

/// Matrix products.
pub(crate) trait Matmul {
    /// `a [.., m, k] · b [.., k, n]` with batch layouts broadcast to `batch`.
    fn matmul(&self, a: &Operand<'_>, b: &Operand<'_>, batch: &[usize]) -> Result<Dense>;
    /// Fused: `x [.., in] · wᵀ + b`, then ReLU when `relu`, as one product.
    fn fused_linear(
        &self,
        _x: &Operand<'_>,
        _w: &Operand<'_>,
        _b: &Operand<'_>,
        _relu: bool,
    ) -> Result<Option<Dense>> {
        Ok(None)
    }
}

/// Copies that rearrange elements.
pub(crate) trait Copies {
    /// A contiguous copy.
    fn contiguous(&self, x: &Operand<'_>) -> Result<Dense>;
    /// `src`'s elements written where `dst`'s layout says in its storage (`src` has storage of
    /// its own).
    fn assign(&self, dst: &Operand<'_>, src: &Operand<'_>) -> Result<()>;
    /// `parts` concatenated along `axis` into `shape`.
    fn cat(&self, parts: &[Operand<'_>], axis: usize, shape: &[usize]) -> Result<Dense>;
    /// Contiguous `parts` of one dtype copied into one 1-D array of `len` bytes, each at its
    /// byte offset.
    fn pack(&self, parts: &[Operand<'_>], offsets: &[usize], len: usize) -> Result<Dense>;
}

/// Arrays made where they are used.
pub(crate) trait Create {
    /// `shape` of `dtype` on `device`, every element `value`.
    fn full(&self, device: Device, shape: &[usize], dtype: DType, value: f64) -> Result<Dense>;
    /// `start, start + 1, ..` (`len` of them) on `device`.
    fn arange(&self, device: Device, start: f64, len: usize, dtype: DType) -> Result<Dense>;
    /// Uniform (or standard normal, when `normal`) samples fixed by `seed`.
    fn random(
        &self,
        device: Device,
        shape: &[usize],
        dtype: DType,
        seed: u64,
        normal: bool,
    ) -> Result<Dense>;
}

/// Indexing along one axis.
pub(crate) trait Indexing {
    /// The entries `index` names along `axis`.
    fn index_select(&self, x: &Operand<'_>, axis: usize, index: &Operand<'_>) -> Result<Dense>;
    /// `x` plus `src` added at the entries `index` names along `axis`.
    fn index_add(
        &self,
        x: &Operand<'_>,
        axis: usize,
        index: &Operand<'_>,
        src: &Operand<'_>,
    ) -> Result<Dense>;
    /// Values picked along `axis` by `index`.
    fn gather(&self, x: &Operand<'_>, axis: usize, index: &Operand<'_>) -> Result<Dense>;
    /// `x` plus `src` scattered along `axis` by `index`.
    fn scatter_add(
        &self,
        x: &Operand<'_>,
        axis: usize,
        index: &Operand<'_>,
        src: &Operand<'_>,
    ) -> Result<Dense>;
}

/// Choosing by a mask.
pub(crate) trait Select {
    /// `a` where `c != 0`, else `b`, over layouts broadcast to the output's shape.
    fn where_cond(&self, c: &Operand<'_>, a: &Operand<'_>, b: &Operand<'_>) -> Result<Dense>;
    /// Dropout's output and its `u8` keep-mask, drawn from `seed`.
    fn dropout(&self, x: &Operand<'_>, p: f64, scale: f64, seed: u64) -> Result<(Dense, Dense)>;
    /// `x * scale` where `mask` is nonzero, else 0.
    fn masked_scale(&self, x: &Operand<'_>, mask: &Operand<'_>, scale: f64) -> Result<Dense>;
}

/// Normalizations.
pub(crate) trait Norm {
    /// Layer norm's output and `[rows, 2]` statistics of `x` (`[rows, cols]`).
    fn layer_norm(
        &self,
        x: &Operand<'_>,
        w: Option<&Operand<'_>>,
        b: Option<&Operand<'_>>,
        eps: f64,
    ) -> Result<(Dense, Dense)>;
    /// Layer norm's `dx`, `dweight` and `dbias`, each only when `want` says so.
    fn layer_norm_backward(
        &self,
        g: &Operand<'_>,
        x: &Operand<'_>,
        w: Option<&Operand<'_>>,
        stats: &Operand<'_>,
        want: [bool; 3],
    ) -> Result<(Option<Dense>, Option<Dense>, Option<Dense>)>;
    /// RMSNorm's output and `[rows]` inverse root mean squares of `x` (`[rows, cols]`).
    fn rms_norm(
        &self,
        x: &Operand<'_>,
        w: Option<&Operand<'_>>,
        eps: f64,
    ) -> Result<(Dense, Dense)>;
    /// RMSNorm's `dx` and `dweight`, each only when `want` says so.
    fn rms_norm_backward(
        &self,
        g: &Operand<'_>,
        x: &Operand<'_>,
        w: Option<&Operand<'_>>,
        rstd: &Operand<'_>,
        want: [bool; 2],
    ) -> Result<(Option<Dense>, Option<Dense>)>;
}

/// Convolution and pooling.
pub(crate) trait Conv {
    /// Columns `[N, C·KH·KW, OH·OW]` of an NCHW input.
    fn im2col(&self, x: &Operand<'_>, geo: &Geometry) -> Result<Dense>;
    /// Columns folded back into NCHW, summing what lands on one pixel.
    fn col2im(&self, cols: &Operand<'_>, geo: &Geometry) -> Result<Dense>;
    /// The index of each pooling window's maximum.
    fn pool_argmax(&self, x: &Operand<'_>, geo: &Geometry) -> Result<Dense>;
    /// Fused: one native convolution pass, `Forward` taking (x, w), `BackwardData` (dy, w),
    /// `BackwardFilter` (x, dy).
    fn convolution(
        &self,
        _pass: ConvPass,
        _geo: &Geometry,
        _groups: usize,
        _filters: usize,
        _first: &Operand<'_>,
        _second: &Operand<'_>,
    ) -> Result<Option<Dense>> {
        Ok(None)
    }
}

/// Optimizer steps, in place.
pub(crate) trait Optim {
    /// One Adam (or AdamW) step on contiguous `p`, `m` and `v` from `g`.
    fn adam(
        &self,
        p: &Operand<'_>,
        g: &Operand<'_>,
        m: &Operand<'_>,
        v: &Operand<'_>,
        step: &AdamStep,
    ) -> Result<()>;
}

/// Fused scaled-dot-product attention: one pass that never holds the `q_len x kv_len` weights
/// and keeps each query row's log-sum-exp for the backward, which recomputes the weights from it.
pub(crate) trait Attention {
    /// The output `[batch, heads, q_len, v_dim]` and the log-sum-exp `[batch, heads, q_len]`
    /// (in `op::stats_dtype` of the operands' dtype) of contiguous `q`, `k` and `v` (see
    /// [`Attend`]).
    fn attention(
        &self,
        _q: &Operand<'_>,
        _k: &Operand<'_>,
        _v: &Operand<'_>,
        _how: &Attend,
    ) -> Result<Option<(Dense, Dense)>> {
        Ok(None)
    }

    /// The gradients of `q`, `k` and `v` from the output's gradient `g`, the inputs, the output
    /// `out` and the log-sum-exp `lse` the forward gave.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        _q: &Operand<'_>,
        _k: &Operand<'_>,
        _v: &Operand<'_>,
        _out: &Operand<'_>,
        _g: &Operand<'_>,
        _lse: &Operand<'_>,
        _how: &Attend,
    ) -> Result<Option<[Dense; 3]>> {
        Ok(None)
    }
}

/// Fused cross-entropy of `[rows, classes]` logits against `[rows]` `i64` targets: one pass per
/// row that keeps only the row's log-sum-exp, never a `[rows, classes]` intermediate. A target
/// equal to `ignore` adds nothing and does not count in the mean.
pub(crate) trait Loss {
    /// The mean loss (0-d, the logits' dtype) and the log-sum-exp of every row (`[rows]`, in
    /// `op::stats_dtype` of the logits' dtype).
    fn cross_entropy(
        &self,
        _logits: &Operand<'_>,
        _targets: &Operand<'_>,
        _ignore: Option<i64>,
    ) -> Result<Option<(Dense, Dense)>> {
        Ok(None)
    }

    /// The logits' gradient `(softmax(logits) - onehot(target)) * scale` (0 on ignored rows),
    /// from the forward's log-sum-exp `lse` and the 0-d `scale` (the loss's gradient over the
    /// rows counted, in `lse`'s dtype).
    fn cross_entropy_backward(
        &self,
        _logits: &Operand<'_>,
        _targets: &Operand<'_>,
        _lse: &Operand<'_>,
        _scale: &Operand<'_>,
        _ignore: Option<i64>,
    ) -> Result<Option<Dense>> {
        Ok(None)
    }
}
