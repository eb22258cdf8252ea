//! Optimizer steps over host memory at the memory bus's speed: AdamW and SGD with momentum on
//! fp32 master weights and state, from gradients in f32, bf16 or f16, writing the parameters
//! back in the GPU's dtype in the same pass. The CPU half of optimizer offload, and usable on
//! its own over any host slices.
//!
//! A step reads each element's master weight, gradient and state once and writes them back
//! once (AdamW from f32 gradients: 16 bytes read and 12 written per parameter), so it is bound
//! by the memory bus, not by arithmetic. The key decisions follow from that: every tensor of a
//! step is cut into blocks of [`BLOCK`] elements and all blocks of all tensors go to all cores
//! at once (a model's small tensors do not each pay for a parallel loop), each core streams
//! contiguous memory, and each block runs compiled for the widest vectors the CPU has
//! (AVX-512, else AVX2, chosen at run time by [`ferry_memory::simd::vectorized_wide`]).
//!
//! The arithmetic is f32 in the order of ferry's CUDA kernel (kernels/optim.cu), which is
//! torch.optim.AdamW's update: decoupled decay `p *= 1 - lr·wd`, `m = β₁m + (1-β₁)g`,
//! `v = β₂v + (1-β₂)g²`, `p -= lr/(1-β₁ᵗ) · m / (√(v/(1-β₂ᵗ)) + ε)`. It differs from the GPU's
//! only where the GPU fuses a multiply and an add into one rounding: the tests hold the two
//! within a few ulp of the parameter's magnitude (see `tests::cpu_matches_the_f64_update`
//! and the CUDA comparison in tests/tests/host_optim.rs).
//!
//! ```
//! use ferry::optim::AdamStep;
//! use ferry::optim::host::{self, AdamTensor, GradSlice};
//!
//! let (mut p, mut m, mut v) = (vec![1.0f32; 1000], vec![0.0f32; 1000], vec![0.0f32; 1000]);
//! let grad = vec![0.5f32; 1000];
//! let step = host::adamw_step(1, 1e-3, (0.9, 0.999), 1e-8, 0.01);
//! host::adamw(&step, vec![AdamTensor {
//!     master: &mut p,
//!     exp_avg: &mut m,
//!     exp_avg_sq: &mut v,
//!     grad: GradSlice::F32(&grad),
//!     out: None,
//! }])?;
//! // The first step moves every weight by lr (the bias-corrected m / sqrt(v) is 1), after decay.
//! assert!((p[0] - (1.0 - 1e-5 - 1e-3)).abs() < 1e-6);
//! # Ok::<(), ferry::TensorError>(())
//! ```

use ferry_memory::simd;
use ferry_memory::{bf16, f16};
use ferry_tensor::ops::optim::AdamStep;
use ferry_tensor::{Result, TensorError};
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

/// Elements per unit of parallel work: 64 KiB of each f32 stream, so the four or five streams
/// of a block sit in a core's L2 while it works and a 1 GiB tensor makes 16 Ki blocks.
pub const BLOCK: usize = 1 << 14;

/// Elements a block converts at a time from a 16-bit gradient (on the stack, in L1).
const SUB: usize = 1 << 10;

/// A gradient on the host, in the dtype it arrived in.
#[derive(Debug, Clone, Copy)]
pub enum GradSlice<'a> {
    /// f32 gradients.
    F32(&'a [f32]),
    /// bf16 gradients (bf16 autocast training).
    Bf16(&'a [bf16]),
    /// f16 gradients.
    F16(&'a [f16]),
}

/// Where a step writes the updated parameter in the GPU's dtype (its upload buffer), besides
/// the f32 master weight.
#[derive(Debug)]
pub enum ParamSlice<'a> {
    /// An f32 copy.
    F32(&'a mut [f32]),
    /// A bf16 copy, rounded to nearest even as the GPU's cast rounds.
    Bf16(&'a mut [bf16]),
    /// An f16 copy, rounded to nearest even.
    F16(&'a mut [f16]),
}

/// One tensor's part of an AdamW step: all slices of one length.
#[derive(Debug)]
pub struct AdamTensor<'a> {
    /// fp32 master weights, updated in place.
    pub master: &'a mut [f32],
    /// First moment, updated in place.
    pub exp_avg: &'a mut [f32],
    /// Second moment, updated in place.
    pub exp_avg_sq: &'a mut [f32],
    /// The gradient.
    pub grad: GradSlice<'a>,
    /// Also write the updated weights here, in the GPU's dtype.
    pub out: Option<ParamSlice<'a>>,
}

/// One tensor's part of an SGD step: all slices of one length.
#[derive(Debug)]
pub struct SgdTensor<'a> {
    /// fp32 master weights, updated in place.
    pub master: &'a mut [f32],
    /// The momentum buffer, zeros before the first step (`None` without momentum).
    pub momentum_buffer: Option<&'a mut [f32]>,
    /// The gradient.
    pub grad: GradSlice<'a>,
    /// Also write the updated weights here, in the GPU's dtype.
    pub out: Option<ParamSlice<'a>>,
}

/// The scalars of one SGD step, as torch.optim.SGD (no dampening) and ferry's [`super::Sgd`]:
/// `g += wd·p`; `b = μ·b + g` (a zero buffer makes the first step's `b = g`); `g = b`, or
/// `g + μ·b` with Nesterov; `p -= lr·g`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdStep {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor `μ`; ignored for tensors without a buffer.
    pub momentum: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
}

/// The [`AdamStep`] of AdamW's step `t` (counting from 1) with these hyperparameters.
pub fn adamw_step(t: u64, lr: f64, betas: (f64, f64), eps: f64, weight_decay: f64) -> AdamStep {
    let t = i32::try_from(t).unwrap_or(i32::MAX);
    AdamStep {
        lr,
        beta1: betas.0,
        beta2: betas.1,
        eps,
        weight_decay,
        bias_correction1: 1.0 - betas.0.powi(t),
        bias_correction2: 1.0 - betas.1.powi(t),
        decoupled: 1,
        pad: 0,
    }
}

/// One Adam step (AdamW when `step.decoupled` is 1) over every tensor, on all cores.
///
/// Returns an error, touching nothing, when a tensor's slices differ in length.
pub fn adamw<'a>(step: &AdamStep, tensors: impl IntoIterator<Item = AdamTensor<'a>>) -> Result<()> {
    adamw_scaled(step, 1.0, tensors)
}

/// [`adamw`] from the gradients times `grad_scale` (unscaling and clipping in the same pass):
/// the same bits as scaling the gradients first, without a pass over them.
pub fn adamw_scaled<'a>(
    step: &AdamStep,
    grad_scale: f32,
    tensors: impl IntoIterator<Item = AdamTensor<'a>>,
) -> Result<()> {
    let k = AdamConsts {
        grad_scale,
        ..AdamConsts::new(step)
    };
    let mut blocks = Vec::new();
    for t in tensors {
        let n = t.master.len();
        check_len("host::adamw", "exp_avg", n, t.exp_avg.len())?;
        check_len("host::adamw", "exp_avg_sq", n, t.exp_avg_sq.len())?;
        check_len("host::adamw", "grad", n, t.grad.len())?;
        if let Some(out) = &t.out {
            check_len("host::adamw", "out", n, out.len())?;
        }
        let grads = t.grad.blocks();
        let outs = ParamSlice::blocks(t.out, n);
        let state = t
            .exp_avg
            .chunks_mut(BLOCK)
            .zip(t.exp_avg_sq.chunks_mut(BLOCK));
        for (((p, (m, v)), g), out) in t.master.chunks_mut(BLOCK).zip(state).zip(grads).zip(outs) {
            blocks.push((p, m, v, g, out));
        }
    }
    blocks.into_par_iter().for_each(|(p, m, v, g, out)| {
        // Inlined into `vectorized_wide`'s wide function, so the loop is compiled for its vectors.
        simd::vectorized_wide(
            #[inline(always)]
            || {
                each_sub_block(
                    p,
                    g,
                    out,
                    #[inline(always)]
                    |at, p, g| adam_run(&k, p, g, m, v, at),
                )
            },
        )
    });
    Ok(())
}

/// One SGD step over every tensor, on all cores.
///
/// Returns an error, touching nothing, when a tensor's slices differ in length.
pub fn sgd<'a>(step: &SgdStep, tensors: impl IntoIterator<Item = SgdTensor<'a>>) -> Result<()> {
    let k = SgdConsts::new(step);
    let mut blocks = Vec::new();
    for t in tensors {
        let n = t.master.len();
        check_len("host::sgd", "grad", n, t.grad.len())?;
        if let Some(b) = &t.momentum_buffer {
            check_len("host::sgd", "momentum_buffer", n, b.len())?;
        }
        if let Some(out) = &t.out {
            check_len("host::sgd", "out", n, out.len())?;
        }
        let grads = t.grad.blocks();
        let outs = ParamSlice::blocks(t.out, n);
        let bufs: Box<dyn Iterator<Item = Option<&mut [f32]>>> = match t.momentum_buffer {
            Some(b) => Box::new(b.chunks_mut(BLOCK).map(Some)),
            None => Box::new(std::iter::repeat_with(|| None)),
        };
        for (((p, b), g), out) in t.master.chunks_mut(BLOCK).zip(bufs).zip(grads).zip(outs) {
            blocks.push((p, b, g, out));
        }
    }
    blocks.into_par_iter().for_each(|(p, mut b, g, out)| {
        simd::vectorized_wide(
            #[inline(always)]
            || {
                each_sub_block(
                    p,
                    g,
                    out,
                    #[inline(always)]
                    |at, p, g| match b.as_deref_mut() {
                        Some(b) => sgd_momentum_run(&k, p, g, &mut b[at..at + p.len()]),
                        None => sgd_run(&k, p, g),
                    },
                )
            },
        )
    });
    Ok(())
}

fn check_len(op: &'static str, what: &str, master: usize, len: usize) -> Result<()> {
    if master == len {
        return Ok(());
    }
    Err(TensorError::InvalidArgument {
        op,
        message: format!(
            "`{what}` has {len} elements and the master weights {master}: \
             each tensor's slices must be of one parameter"
        ),
    })
}

/// Adds `grad` to `held` (or, with `first`, copies it there), in f32, on all cores, and
/// returns the sum of the squares of the result: a gradient accumulated over backward passes,
/// and its share of the global norm, in one pass over memory.
///
/// # Panics
/// When `held` and `grad` differ in length.
pub fn accumulate(held: &mut [f32], grad: GradSlice<'_>, first: bool) -> f64 {
    assert_eq!(held.len(), grad.len(), "host::accumulate: lengths differ");
    held.par_chunks_mut(BLOCK)
        .zip(grad.blocks())
        .map(|(h, g)| {
            let mut buf = [0f32; SUB];
            let mut sumsq = 0f64;
            for at in (0..h.len()).step_by(SUB) {
                let len = SUB.min(h.len() - at);
                let g = g.f32s(at, &mut buf, len);
                let h = &mut h[at..at + len];
                if first {
                    h.copy_from_slice(g);
                } else {
                    for (h, g) in h.iter_mut().zip(g) {
                        *h += g;
                    }
                }
                sumsq += square_sum(h);
            }
            sumsq
        })
        .sum()
}

/// The sum of the squares of `grad` (each element as f32, squared and summed in f64), on all
/// cores: a gradient's share of the global norm, read in place.
pub fn sum_squares(grad: GradSlice<'_>) -> f64 {
    grad.blocks()
        .into_par_iter()
        .map(|g| {
            let mut buf = [0f32; SUB];
            let mut sumsq = 0f64;
            for at in (0..g.len()).step_by(SUB) {
                let len = SUB.min(g.len() - at);
                sumsq += square_sum(g.f32s(at, &mut buf, len));
            }
            sumsq
        })
        .sum()
}

/// The sum of the squares of `values`, squared and summed in f64: a finite gradient's square
/// never overflows to a false infinity.
#[inline(always)]
fn square_sum(values: &[f32]) -> f64 {
    values.iter().map(|&x| f64::from(x) * f64::from(x)).sum()
}

impl<'a> GradSlice<'a> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(g) => g.len(),
            Self::Bf16(g) => g.len(),
            Self::F16(g) => g.len(),
        }
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn blocks(self) -> Vec<GradSlice<'a>> {
        match self {
            Self::F32(g) => g.chunks(BLOCK).map(Self::F32).collect(),
            Self::Bf16(g) => g.chunks(BLOCK).map(Self::Bf16).collect(),
            Self::F16(g) => g.chunks(BLOCK).map(Self::F16).collect(),
        }
    }

    /// Elements `at..at + len` as f32: borrowed when they are f32, else converted into `buf`.
    #[inline(always)]
    fn f32s<'b>(&'b self, at: usize, buf: &'b mut [f32; SUB], len: usize) -> &'b [f32] {
        match self {
            Self::F32(g) => &g[at..at + len],
            Self::Bf16(g) => {
                for (d, s) in buf[..len].iter_mut().zip(&g[at..at + len]) {
                    *d = f32::from_bits(u32::from(s.to_bits()) << 16);
                }
                &buf[..len]
            }
            Self::F16(g) => {
                g[at..at + len].convert_to_f32_slice(&mut buf[..len]);
                &buf[..len]
            }
        }
    }
}

impl<'a> ParamSlice<'a> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(p) => p.len(),
            Self::Bf16(p) => p.len(),
            Self::F16(p) => p.len(),
        }
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `BLOCK`-sized pieces of `out`, or as many `None`s as a tensor of `n` elements has blocks.
    fn blocks(out: Option<Self>, n: usize) -> Vec<Option<ParamSlice<'a>>> {
        match out {
            None => (0..n.div_ceil(BLOCK)).map(|_| None).collect(),
            Some(Self::F32(p)) => p.chunks_mut(BLOCK).map(|c| Some(Self::F32(c))).collect(),
            Some(Self::Bf16(p)) => p.chunks_mut(BLOCK).map(|c| Some(Self::Bf16(c))).collect(),
            Some(Self::F16(p)) => p.chunks_mut(BLOCK).map(|c| Some(Self::F16(c))).collect(),
        }
    }

    /// Writes `master` into elements `at..`, rounded to this slice's dtype, around the cache
    /// (see [`simd::store_around_cache`]; a 16-bit copy is rounded on the stack first).
    #[inline(always)]
    fn write(&mut self, at: usize, master: &[f32]) {
        let range = at..at + master.len();
        match self {
            Self::F32(p) => simd::store_around_cache(&mut p[range], master),
            Self::Bf16(p) => {
                let mut rounded = [bf16::ZERO; SUB];
                let rounded = &mut rounded[..master.len()];
                for (d, &s) in rounded.iter_mut().zip(master) {
                    *d = bf16::from_bits(bf16_bits(s));
                }
                simd::store_around_cache(&mut p[range], rounded);
            }
            Self::F16(p) => {
                let mut rounded = [f16::ZERO; SUB];
                let rounded = &mut rounded[..master.len()];
                rounded.convert_from_f32_slice(master);
                simd::store_around_cache(&mut p[range], rounded);
            }
        }
    }
}

/// `x` rounded to bf16, to nearest even (NaN stays a quiet NaN): the GPU's `__float2bfloat16`,
/// branch-free so the loop around it vectorises.
#[inline(always)]
fn bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    let rounded = (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
    let quiet = ((bits >> 16) | 0x40) as u16;
    if x.is_nan() { quiet } else { rounded }
}

/// Runs `run(at, master, grad)` over `p` a sub-block at a time (`grad` as f32), then writes the
/// updated weights to `out`.
#[inline(always)]
fn each_sub_block(
    p: &mut [f32],
    g: GradSlice<'_>,
    mut out: Option<ParamSlice<'_>>,
    mut run: impl FnMut(usize, &mut [f32], &[f32]),
) {
    let mut buf = [0.0f32; SUB];
    let mut at = 0;
    while at < p.len() {
        let len = SUB.min(p.len() - at);
        let master = &mut p[at..at + len];
        run(at, master, g.f32s(at, &mut buf, len));
        if let Some(out) = &mut out {
            out.write(at, master);
        }
        at += len;
    }
    if out.is_some() {
        simd::fence_stores();
    }
}

/// [`AdamStep`] as the f32 constants of the loop, each cast from f64 as the CUDA kernel casts.
struct AdamConsts {
    /// What each gradient is multiplied by first (1 leaves it as it is, exactly).
    grad_scale: f32,
    decay: f32,
    l2: f32,
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    step_size: f32,
    bias_correction2: f32,
    eps: f32,
}

impl AdamConsts {
    fn new(s: &AdamStep) -> Self {
        let decoupled = s.decoupled != 0;
        Self {
            grad_scale: 1.0,
            // Multiplying by 1 and adding 0·p change nothing: one loop serves both kinds.
            decay: if decoupled {
                (1.0 - s.lr * s.weight_decay) as f32
            } else {
                1.0
            },
            l2: if decoupled {
                0.0
            } else {
                s.weight_decay as f32
            },
            beta1: s.beta1 as f32,
            one_minus_beta1: (1.0 - s.beta1) as f32,
            beta2: s.beta2 as f32,
            one_minus_beta2: (1.0 - s.beta2) as f32,
            step_size: (s.lr / s.bias_correction1) as f32,
            bias_correction2: s.bias_correction2 as f32,
            eps: s.eps as f32,
        }
    }
}

/// The Adam update of `p[i]`, `m[at + i]`, `v[at + i]` from `g[i]`.
#[inline(always)]
fn adam_run(k: &AdamConsts, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], at: usize) {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[at..at + n], &mut v[at..at + n]);
    for i in 0..n {
        let pi = p[i] * k.decay;
        let gi = g[i] * k.grad_scale + k.l2 * pi;
        let mi = k.beta1 * m[i] + k.one_minus_beta1 * gi;
        let vi = k.beta2 * v[i] + k.one_minus_beta2 * gi * gi;
        p[i] = pi - k.step_size * mi / ((vi / k.bias_correction2).sqrt() + k.eps);
        m[i] = mi;
        v[i] = vi;
    }
}

/// [`SgdStep`] as the f32 constants of the loop.
struct SgdConsts {
    lr: f32,
    momentum: f32,
    weight_decay: f32,
    nesterov: bool,
}

impl SgdConsts {
    fn new(s: &SgdStep) -> Self {
        Self {
            lr: s.lr as f32,
            momentum: s.momentum as f32,
            weight_decay: s.weight_decay as f32,
            nesterov: s.nesterov,
        }
    }
}

#[inline(always)]
fn sgd_run(k: &SgdConsts, p: &mut [f32], g: &[f32]) {
    let g = &g[..p.len()];
    for (p, &g) in p.iter_mut().zip(g) {
        *p -= k.lr * (g + k.weight_decay * *p);
    }
}

#[inline(always)]
fn sgd_momentum_run(k: &SgdConsts, p: &mut [f32], g: &[f32], b: &mut [f32]) {
    let n = p.len();
    let (g, b) = (&g[..n], &mut b[..n]);
    if k.nesterov {
        for i in 0..n {
            let gi = g[i] + k.weight_decay * p[i];
            b[i] = k.momentum * b[i] + gi;
            p[i] -= k.lr * (gi + k.momentum * b[i]);
        }
    } else {
        for i in 0..n {
            let gi = g[i] + k.weight_decay * p[i];
            b[i] = k.momentum * b[i] + gi;
            p[i] -= k.lr * b[i];
        }
    }
}

#[cfg(test)]
mod tests;
