//! What is checked before any cuDNN call: the spec's own consistency (an argument error), what
//! cuDNN's fused attention takes (an unsupported error, so the caller falls back), and each
//! operand's extent, layout and alignment against its buffer.

use ferry_memory::DType;
use ferry_memory::cuda::DeviceBuffer;

use super::super::backend::BYTE_ALIGNMENT;
use super::{Causal, DropoutRng, SdpaSpec};
use crate::CudaLibError;

/// Largest head dim ferry sends to cuDNN's fused attention.
pub const SDPA_MAX_HEAD_DIM: usize = 128;

fn bad(argument: &'static str, reason: String) -> CudaLibError {
    CudaLibError::AttentionArgument { argument, reason }
}

fn unsupported(reason: String) -> CudaLibError {
    CudaLibError::AttentionUnsupported { reason }
}

impl SdpaSpec {
    /// Whether the spec describes a computable attention: an error naming the argument
    /// otherwise (heads that do not group, keys missing for present queries, a scale or
    /// dropout probability out of range, an extent beyond cuDNN's 32-bit indices).
    pub fn check(&self) -> Result<(), CudaLibError> {
        if self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return Err(bad(
                "kv_heads",
                format!(
                    "{} must be at least 1 and divide the query heads ({})",
                    self.kv_heads, self.heads
                ),
            ));
        }
        if self.head_dim == 0 {
            return Err(bad("head_dim", "must be at least 1".to_string()));
        }
        if self.kv_len == 0 && self.q_len > 0 {
            return Err(bad(
                "kv_len",
                format!(
                    "is 0, so the {} queries have no keys to attend to",
                    self.q_len
                ),
            ));
        }
        if !self.scale.is_finite() {
            return Err(bad("scale", format!("{} is not finite", self.scale)));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(bad(
                "dropout",
                format!("{} is not a probability in [0, 1)", self.dropout),
            ));
        }
        for (name, n) in [
            ("batch", self.batch),
            ("heads", self.heads),
            ("q_len", self.q_len),
            ("kv_len", self.kv_len),
        ] {
            if i32::try_from(n).is_err() {
                return Err(bad(name, format!("{n} exceeds cuDNN's 32-bit limit")));
            }
        }
        Ok(())
    }

    /// Whether cuDNN's fused attention takes this spec (before asking cuDNN itself): f16 or
    /// bf16, a head dim that is a multiple of 8 up to [`SDPA_MAX_HEAD_DIM`]. An
    /// [`CudaLibError::AttentionUnsupported`] otherwise, saying why.
    pub fn supported(&self) -> Result<(), CudaLibError> {
        if !matches!(self.dtype, DType::F16 | DType::BF16) {
            return Err(unsupported(format!(
                "cuDNN's fused attention runs f16 and bf16, not {}",
                self.dtype
            )));
        }
        if !self.head_dim.is_multiple_of(8) || self.head_dim > SDPA_MAX_HEAD_DIM {
            return Err(unsupported(format!(
                "head dim {} is not a multiple of 8 up to {SDPA_MAX_HEAD_DIM}",
                self.head_dim
            )));
        }
        Ok(())
    }
}

/// The byte just past the last element of a strided `dims` view starting at `offset`, or
/// `None` on overflow (`Some(offset)` for an empty view).
pub(super) fn end_byte(
    offset: usize,
    dims: [usize; 4],
    strides: [usize; 4],
    elem: usize,
) -> Option<usize> {
    if dims.contains(&0) {
        return Some(offset);
    }
    let last = dims.iter().zip(strides).try_fold(0usize, |acc, (&d, s)| {
        acc.checked_add((d - 1).checked_mul(s)?)
    })?;
    last.checked_add(1)?.checked_mul(elem)?.checked_add(offset)
}

/// Checks one operand against its buffer and returns its strides as cuDNN takes them: its
/// extent within the buffer and its offset a multiple of the element (argument errors), its
/// last axis contiguous and its address 16-byte aligned (unsupported otherwise).
pub(super) fn operand(
    name: &'static str,
    buffer: &DeviceBuffer,
    offset: usize,
    strides: [usize; 4],
    dims: [usize; 4],
    elem: usize,
) -> Result<[i64; 4], CudaLibError> {
    let strides_i64 = layout(name, buffer.len(), offset, strides, dims, elem)?;
    let address = buffer.device_ptr() + offset as u64;
    if !address.is_multiple_of(BYTE_ALIGNMENT as u64) {
        return Err(unsupported(format!(
            "{name} starts at address {address:#x}, not a multiple of {BYTE_ALIGNMENT} bytes"
        )));
    }
    Ok(strides_i64)
}

/// [`operand`]'s checks that need no device: the extent against a buffer of `len` bytes, the
/// element alignment of the offset and the contiguous last axis.
pub(super) fn layout(
    name: &'static str,
    len: usize,
    offset: usize,
    strides: [usize; 4],
    dims: [usize; 4],
    elem: usize,
) -> Result<[i64; 4], CudaLibError> {
    if !offset.is_multiple_of(elem) {
        return Err(bad(
            name,
            format!("offset {offset} is not a multiple of the element size {elem}"),
        ));
    }
    let end = end_byte(offset, dims, strides, elem).ok_or_else(|| {
        bad(
            name,
            format!("the extent of {dims:?} at strides {strides:?} overflows"),
        )
    })?;
    if end > len {
        return Err(bad(
            name,
            format!(
                "{dims:?} at strides {strides:?} and offset {offset} reaches byte {end}, but its \
                 buffer has {len}"
            ),
        ));
    }
    if strides[3] != 1 && dims[3] > 1 {
        return Err(unsupported(format!(
            "{name}'s last axis has stride {}; cuDNN needs it contiguous (stride 1)",
            strides[3]
        )));
    }
    let mut out = [0i64; 4];
    for (o, s) in out.iter_mut().zip(strides) {
        *o = i64::try_from(s).map_err(|_| bad(name, format!("stride {s} exceeds i64")))?;
    }
    if dims[3] == 1 {
        // The statistics' last axis has one element: its stride is immaterial, and cuDNN
        // gets the contiguous one.
        out[3] = 1;
    }
    Ok(out)
}

/// Dropout's seed and offset are given when dropout is on, each holding one i64.
pub(super) fn check_rng(spec: &SdpaSpec, rng: Option<DropoutRng<'_>>) -> Result<(), CudaLibError> {
    match rng {
        None if spec.dropout > 0.0 => Err(bad(
            "rng",
            format!(
                "dropout {} needs a seed and an offset (DropoutRng)",
                spec.dropout
            ),
        )),
        Some(rng) => {
            for (name, buffer) in [("rng seed", rng.seed), ("rng offset", rng.offset)] {
                if buffer.len() < 8 {
                    return Err(bad(
                        name,
                        format!(
                            "must hold one i64, but its buffer has {} bytes",
                            buffer.len()
                        ),
                    ));
                }
            }
            Ok(())
        }
        None => Ok(()),
    }
}

/// What cuDNN `version` on a GPU of compute capability `major` is known not to run of `spec`
/// (the backward pass when `backward`), after cudnn-frontend's support checks; `None` when
/// nothing is known against it.
pub(super) fn known_limit(
    spec: &SdpaSpec,
    backward: bool,
    version: usize,
    major: i32,
) -> Option<String> {
    let (t, s) = (spec.q_len, spec.kv_len);
    let bottom_right = spec.causal == Causal::BottomRight;
    if major < 8 {
        return Some(format!(
            "cuDNN's fused attention needs compute capability 8.0 or newer, not {major}.x"
        ));
    }
    if version == 91000 || version == 91001 {
        return Some(format!(
            "cuDNN {version} has known bugs in fused f16/bf16 attention; use 9.10.2 or newer"
        ));
    }
    if bottom_right && t > s {
        return Some(format!(
            "a bottom-right causal mask needs q_len ({t}) <= kv_len ({s})"
        ));
    }
    if bottom_right && spec.dropout > 0.0 {
        return Some("a bottom-right causal mask does not combine with dropout".to_string());
    }
    if bottom_right && version < 90600 && !(t.is_multiple_of(64) && s.is_multiple_of(64)) {
        return Some(format!(
            "before cuDNN 9.6 a bottom-right causal mask needs q_len and kv_len multiples of \
             64, not {t} and {s}"
        ));
    }
    if t == 1 && spec.causal != Causal::None && version <= 90900 {
        return Some("before cuDNN 9.10 a single query cannot be masked".to_string());
    }
    if backward && t == 1 && s == 1 {
        return Some("the backward pass does not run q_len = kv_len = 1".to_string());
    }
    None
}
