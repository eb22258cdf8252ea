//! Copies that rearrange elements: strided to contiguous, and concatenation.

use ferry_memory::{DType, Device, HostBuffer};

use super::Cpu;
use crate::Result;
use crate::kernel::{Copies, Dense, Operand, Source, View};
use crate::layout::Layout;
use crate::storage::{Buffer, Storage};

/// Runs `$body` with `$T` an unsigned integer as wide as `dtype`'s elements: copies move bits.
macro_rules! bits_dispatch {
    ($dtype:expr, |$T:ident| $body:expr) => {
        match $dtype.size() {
            1 => {
                type $T = u8;
                $body
            }
            2 => {
                type $T = u16;
                $body
            }
            4 => {
                type $T = u32;
                $body
            }
            _ => {
                type $T = u64;
                $body
            }
        }
    };
}

/// Raw-bit view of a storage, whatever its dtype.
fn bits<T: bytemuck::Pod>(t: &impl View) -> Result<parking_lot::MappedRwLockReadGuard<'_, [T]>> {
    let guard = t.storage().read();
    guard.host_slice("copy", t.device())?; // waits for pinned bytes, or says why there are none
    parking_lot::RwLockReadGuard::try_map(guard, |b| {
        b.host_bytes().map(bytemuck::cast_slice::<u8, T>)
    })
    .map_err(|_| crate::TensorError::NotOnHost {
        op: "copy",
        device: t.device(),
    })
}

impl Copies for Cpu {
    /// A contiguous copy of `x`.
    fn contiguous(&self, x: &Operand<'_>) -> Result<Dense> {
        bits_dispatch!(x.dtype(), |B| {
            let src = bits::<B>(x)?;
            let (len, stride) = x.layout().row();
            let out = build_bits::<B>(x.dtype(), x.shape(), |out| {
                for (out, start) in out.chunks_mut(len.max(1)).zip(x.layout().row_starts()) {
                    if stride == 1 {
                        out.copy_from_slice(&src[start..start + out.len()]);
                    } else if stride == 0 {
                        out.fill(src[start]);
                    } else {
                        for (j, o) in out.iter_mut().enumerate() {
                            *o = src[start + j * stride];
                        }
                    }
                }
            })?;
            Ok(out)
        })
    }

    /// Writes `src`'s elements (row-major) into `dst`'s storage where `dst`'s layout says; `src`
    /// has storage of its own (the caller copies it otherwise).
    fn assign(&self, dst: &Operand<'_>, src: &Operand<'_>) -> Result<()> {
        bits_dispatch!(dst.dtype(), |B| {
            let mut locks = Storage::lock_for_update("assign", &[dst.storage()], &[src.storage()])?;
            let values: &[B] =
                bytemuck::cast_slice(locks.reads[0].host_slice("assign", src.device())?);
            let out: &mut [B] =
                bytemuck::cast_slice_mut(locks.writes[0].host_slice_mut("assign", dst.device())?);
            let ((len, sd), (_, ss)) = (dst.layout().row(), src.layout().row());
            for (rd, rs) in dst.layout().row_starts().zip(src.layout().row_starts()) {
                for j in 0..len {
                    out[rd + j * sd] = values[rs + j * ss];
                }
            }
            Ok(())
        })
    }

    /// Concatenates contiguous copies of `parts` along `axis`.
    fn cat(&self, parts: &[Operand<'_>], axis: usize, shape: &[usize]) -> Result<Dense> {
        let parts: Vec<Source<'_>> = parts.iter().map(super::dense).collect::<Result<_>>()?;
        let dtype = parts[0].dtype();
        let outer: usize = shape[..axis].iter().product();
        let inner: usize = shape[axis + 1..].iter().product();
        let row = shape[axis] * inner;
        bits_dispatch!(dtype, |B| {
            let guards: Vec<_> = parts.iter().map(bits::<B>).collect::<Result<_>>()?;
            build_bits::<B>(dtype, shape, |out| {
                let mut start = 0;
                for (part, src) in parts.iter().zip(&guards) {
                    let width = part.shape()[axis] * inner;
                    let src = &src[part.layout().offset()..part.layout().offset() + part.numel()];
                    for o in 0..outer {
                        out[o * row + start..o * row + start + width]
                            .copy_from_slice(&src[o * width..(o + 1) * width]);
                    }
                    start += width;
                }
            })
        })
    }

    /// Contiguous `parts` (of one dtype) copied into one 1-D array of `len` bytes, each at its byte
    /// offset; the bytes between them are zero.
    fn pack(&self, parts: &[Operand<'_>], offsets: &[usize], len: usize) -> Result<Dense> {
        let dtype = parts[0].dtype();
        let size = dtype.size();
        let whole = Layout::contiguous(&[len / size]);
        let out = Dense::new(Storage::host_zeroed(len / size, dtype)?, &[len / size]);
        for (part, &at) in parts.iter().zip(offsets) {
            let flat = (part.layout().reshape_view(&[part.numel()]))
                .expect("the parts of a pack are contiguous");
            let dst = whole.narrow(0, at / size, part.numel());
            self.assign(
                &Operand::new(out.storage(), &dst),
                &Operand::new(part.storage(), &flat),
            )?;
        }
        Ok(out)
    }
}

/// Fresh host storage of `shape` whose every element `fill` writes (it starts unspecified).
fn build_bits<B: bytemuck::Pod>(
    dtype: DType,
    shape: &[usize],
    fill: impl FnOnce(&mut [B]),
) -> Result<Dense> {
    let bytes = crate::layout::shape_bytes("copy", shape, dtype)?;
    let mut buffer = HostBuffer::for_overwrite(bytes)?;
    fill(bytemuck::cast_slice_mut(buffer.as_bytes_mut()));
    Ok(Dense::new(
        Storage::new(Buffer::Host(buffer), dtype, Device::Cpu),
        shape,
    ))
}
