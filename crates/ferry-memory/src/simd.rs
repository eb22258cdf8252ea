//! Vector instructions chosen at run time: [`vectorized`] runs a loop compiled for AVX2 where
//! the CPU has it, and for the baseline (SSE2) elsewhere, from one source; [`vectorized_wide`]
//! goes up to AVX-512 for loops that stream memory (an optimizer step), where 512-bit vectors
//! pay and no narrow loop shares the core.
//!
//! ferry builds for generic x86-64, so its loops use 128-bit vectors; AVX2 doubles the width.
//! Code inlined into a function compiled with `#[target_feature(enable = "avx2")]` is compiled
//! for AVX2 too, so a kernel's loop passed here as a closure (with the loop's helpers marked
//! `#[inline(always)]`, and a large closure itself, `#[inline(always)] || ..`, else the compiler
//! may keep it a baseline function of its own) vectorises at 256 bits. The results are the same
//! bit for bit: the same IEEE operations, only more at a time (Rust never fuses a multiply and
//! an add on its own).

/// The widest vector instructions [`vectorized_wide`] uses on this CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// 512-bit vectors (AVX-512 F, BW and VL).
    Avx512,
    /// 256-bit vectors.
    Avx2,
    /// The target's baseline (SSE2 on x86-64).
    Baseline,
}

impl Level {
    /// This CPU's.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl")
            {
                return Self::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Self::Avx2;
            }
        }
        Self::Baseline
    }

    /// Its name, as CPU feature lists spell it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Avx512 => "avx512",
            Self::Avx2 => "avx2",
            Self::Baseline => "baseline",
        }
    }
}

/// Runs `f`, compiled for AVX2 when this CPU supports it.
#[inline(always)]
pub fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above; `avx2` needs nothing else.
        return unsafe { avx2(f) };
    }
    f()
}

/// Runs `f`, compiled for the widest [`Level`] this CPU supports.
#[inline(always)]
pub fn vectorized_wide<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if Level::detect() == Level::Avx512 {
        // SAFETY: the CPU supports AVX-512 F, BW and VL, checked by `detect`.
        return unsafe { avx512(f) };
    }
    vectorized(f)
}

/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// # Safety
/// The CPU must support AVX-512 F, BW and VL.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// Copies `src` into `dst` (of one length) with stores that bypass the cache where `dst` is
/// 16-byte aligned, on x86-64: for a buffer read next by a GPU's copy engine, not by a core. A
/// cached store first reads each line it writes, so this saves the bus the bytes written once
/// more (an optimizer step's upload buffer: 4 bytes per f32 parameter). Call [`fence_stores`]
/// before handing the buffer on.
///
/// # Panics
/// When the lengths differ.
#[inline(always)]
pub fn store_around_cache<T: bytemuck::Pod>(dst: &mut [T], src: &[T]) {
    let dst: &mut [u8] = bytemuck::cast_slice_mut(dst);
    let src: &[u8] = bytemuck::cast_slice(src);
    assert_eq!(dst.len(), src.len(), "store_around_cache: lengths differ");
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        let head = dst.as_ptr().align_offset(16).min(dst.len());
        let body = (dst.len() - head) / 16 * 16;
        dst[..head].copy_from_slice(&src[..head]);
        for at in (head..head + body).step_by(16) {
            // SAFETY: SSE2 is part of x86-64; `at..at + 16` lies in both slices (of one
            // length), and `dst + at` is 16-byte aligned (`head` aligned it, `at - head` is a
            // multiple of 16).
            unsafe {
                let v = _mm_loadu_si128(src.as_ptr().add(at).cast::<__m128i>());
                _mm_stream_si128(dst.as_mut_ptr().add(at).cast::<__m128i>(), v);
            }
        }
        dst[head + body..].copy_from_slice(&src[head + body..]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// [`store_around_cache`] on all cores: `src` into `dst` (of one length) in tasks of `chunk`
/// bytes, each fenced before it ends. For a large destination read next by another thread or a
/// device, where it would not stay in cache anyway: the bus carries each byte written once
/// instead of twice.
///
/// # Panics
/// When the lengths differ, or `chunk` is 0.
pub fn copy_around_cache_parallel(dst: &mut [u8], src: &[u8], chunk: usize) {
    use rayon::prelude::*;
    assert_eq!(
        dst.len(),
        src.len(),
        "copy_around_cache_parallel: lengths differ"
    );
    dst.par_chunks_mut(chunk)
        .zip(src.par_chunks(chunk))
        .for_each(|(to, from)| {
            store_around_cache(to, from);
            fence_stores();
        });
}

/// Orders the stores of [`store_around_cache`] before every later store of this thread (the
/// one that hands the buffer to another thread, say).
#[inline(always)]
pub fn fence_stores() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is part of x86-64.
    unsafe {
        std::arch::x86_64::_mm_sfence();
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_result_is_the_closures() {
        let data: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
        let plain: f32 = data.iter().map(|v| v * 2.0 + 1.0).sum();
        let fast: f32 = super::vectorized(|| data.iter().map(|v| v * 2.0 + 1.0).sum());
        assert_eq!(plain.to_bits(), fast.to_bits());
        let wide: f32 = super::vectorized_wide(|| data.iter().map(|v| v * 2.0 + 1.0).sum());
        assert_eq!(plain.to_bits(), wide.to_bits());
    }

    /// The stores around the cache copy every byte wherever the destination starts and however
    /// long it is: an unaligned head, the aligned body, a tail.
    #[test]
    fn stores_around_the_cache_copy_any_alignment_and_length() {
        let src: Vec<u8> = (0..1200).map(|i| (i * 7 % 251) as u8).collect();
        for start in 0..32 {
            for len in [0, 1, 3, 15, 16, 17, 31, 64, 255, 1100] {
                let mut dst = vec![0xAAu8; 1200 + 32];
                super::store_around_cache(&mut dst[start..start + len], &src[..len]);
                super::fence_stores();
                assert_eq!(&dst[start..start + len], &src[..len], "{start} {len}");
                assert!(
                    dst[..start]
                        .iter()
                        .chain(&dst[start + len..])
                        .all(|&b| b == 0xAA)
                );
            }
        }
        let mut dst = vec![0u8; src.len() - 3];
        super::copy_around_cache_parallel(&mut dst, &src[3..], 100);
        assert_eq!(&dst[..], &src[3..]);
    }
}
