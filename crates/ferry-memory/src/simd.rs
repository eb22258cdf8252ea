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
}
